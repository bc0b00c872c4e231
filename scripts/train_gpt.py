#!/usr/bin/env python
"""Train the course's GPT under torchrun on a (pp, dp, tp) mesh: the capstone's script.

    torchrun --standalone --nproc-per-node=8 scripts/train_gpt.py --pp 2 --tp 2 --checkpoint-dir ckpt --save-every 40
    torchrun --standalone --nproc-per-node=4 scripts/train_gpt.py --pp 1 --tp 1 --resume ckpt/step-80  # resharded

Each pp rank holds a stage (a copy of the GPT with its own blocks; names unchanged); inside it notebook 19's tensor-
and sequence-parallel plan over tp, activation checkpointing, compile if asked, and FSDP2 over dp. Stages talk through
torch.distributed.pipelining (1F1B over --micro micro-batches); one stage accumulates --micro micro-batches by hand.
Step s's global batch depends on (seed, s) alone, so a run resumed from a DCP checkpoint (saved on any mesh, read on
any other) sees the batches an uninterrupted run sees. Rank 0 prints one JSON object per line for the notebook.
Introduced in notebooks/21-gpt-capstone.ipynb.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import math
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the helpers package sits next to scripts/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,  # noqa: E402
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.checkpoint import checkpoint  # noqa: E402

from helpers import devices, mfu, text  # noqa: E402
from helpers.gpt import GPT, Block, GPTConfig, matmul_params, train_flops_per_token  # noqa: E402


class SetupError(Exception):  # a problem with the options or the checkpoint: one line, exit code 2
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pp x FSDP2 x TP training of the course's GPT (run it with torchrun).")
    p.add_argument("--size", default="auto", choices=["auto", *mfu.SIZES],
                   help="model, batch and steps from helpers.mfu.SIZES; auto: chosen from the device")
    for name in ("n-layer", "n-head", "d-model", "seq-len", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the size's value (batch: global)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate (default: the size's)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages; dp = world size / (pp * tp)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step: pipelined, or accumulated")
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the gradients' global norm to this")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float64"), default="auto",
                   help="auto: bf16 compute (FSDP's MixedPrecisionPolicy) on GPUs that have it, else float32")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="DCP checkpoints go to DIR/step-K")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--async-save", action="store_true", help="dcp.async_save: write while training goes on")
    p.add_argument("--dump-state", type=Path, default=None, help="DCP copies (blocking) of the state at saves, load")
    p.add_argument("--resume", type=Path, default=None, help="a DIR/step-K to resume from (any mesh)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (the schedule stays --steps')")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: at the end only)")
    p.add_argument("--eval-batches", type=int, default=2, help="held-out windows: this many global batches")
    p.add_argument("--peak-flops", type=float, default=None, help="one device's peak FLOP/s for MFU")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the batches' seed")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait before failing")
    return p.parse_args(argv)


def emit(rank: int, **event) -> None:
    if rank == 0:  # one line per event: the notebook parses them
        print(json.dumps(event) + "\n", end="", flush=True)


def setup(args):  # join torchrun's group; returns rank, device, mesh
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan = devices.plan(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = plan.devices[local_rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if plan.backend == "nccl" else plan.backend  # gloo for async saves' CPU side
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if plan.backend == "nccl" else None)
    if dist.get_world_size() % (args.pp * args.tp):
        raise SetupError(f"world size {dist.get_world_size()} is not a multiple of --pp {args.pp} x --tp {args.tp}")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # its notes on 2-D reductions
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the logits are a view; nothing writes in place
    return dist.get_rank(), device, make_mesh(device, args.pp, args.tp)


def sizes(args, device) -> tuple[GPTConfig, dict]:
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    name = args.size if args.size != "auto" else mfu.choose_size(device.type, memory)
    given = {k: getattr(args, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "batch", "steps", "lr")}
    size = {**mfu.SIZES[name], "name": name} | {k: v for k, v in given.items() if v is not None}  # overrides win
    cfg = GPTConfig(vocab_size=text.VOCAB_SIZE, **{k: size[k] for k in ("seq_len", "n_layer", "n_head", "d_model")})
    return cfg, size


def build(args, cfg, mesh, device, dtype):
    torch.manual_seed(args.seed)  # the same whole model on every worker before it is split
    model = GPT(cfg).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    compute = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else {}
    stage = parallelize(stage_of(model, mesh), mesh, recompute=not args.no_ac, compile=args.compile,
                        mp=MixedPrecisionPolicy(**compute))
    # two schedules over the same stage: one trains, one evaluates (torch 2.11's stage, once run forward-only by
    # schedule.eval, keeps its buffers without gradients, and a training step after it fails)
    return stage, pipeline(stage, mesh, device, args.micro), pipeline(stage, mesh, device, args.micro)


# ---- exported from notebooks/21-gpt-capstone.ipynb: edit it there, then run `make export` ----
def make_mesh(device, pp, tp):
    # W workers as a (pp, dp, tp) grid, dp = W / (pp * tp): the tp workers of a row are consecutive ranks (one node's
    # fast links), each dp row takes its rows of the batch, each pp slice holds a part of the blocks
    world = dist.get_world_size()
    return init_device_mesh(device.type, (pp, world // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))


def batch_at(tokens, step, batch, seq_len, seed, mesh, device):
    # step `step`'s global batch, the same for any mesh; this dp row's rows of it
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # held-out batches: steps 10**6 on
    x, y = text.random_windows(tokens, batch, seq_len, g)
    dp, rows = mesh["dp"].get_local_rank(), batch // mesh["dp"].size()
    # contiguous: torch 2.11's PipelineStage compares its input's strides with the first micro-batch's
    return x[dp * rows:(dp + 1) * rows].contiguous().to(device), y[dp * rows:(dp + 1) * rows].contiguous().to(device)


def stage_of(model, mesh):
    # this pp rank's stage: a copy of the whole GPT that keeps its own blocks, so every name (FQN) stays the whole
    # GPT's: "blocks.3.attn.q.weight" is called that on whichever stage holds block 3
    pp, s = mesh["pp"].size(), mesh["pp"].get_local_rank()
    stage, per = copy.deepcopy(model), len(model.blocks) // pp
    for i in range(len(stage.blocks)):
        if i // per != s:
            stage.blocks[i] = nn.Identity()  # another stage's block: no parameters here
    if s > 0:
        stage.tok = stage.pos = None  # forward takes the previous stage's activations
    if s < pp - 1:
        stage.norm = stage.head = None  # forward returns activations for the next stage
    return stage


def tensor_parallel(stage, tp_mesh):
    # notebook 19's plan, torchtitan's apply_tp: vocabulary-parallel embedding and head, norms on 1/tp of the tokens
    ends = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}  # logits stay Shard(-1)
    parallelize_module(stage, tp_mesh, {name: s for name, s in ends.items() if getattr(stage, name) is not None})
    for block in stage.blocks:
        if isinstance(block, Block):
            parallelize_module(block, tp_mesh, {
                "norm1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to this rank's tokens
                "norm2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))})


def parallelize(stage, mesh, *, recompute=True, compile=False, mp=None):
    # torchtitan's order: tensor parallel over "tp", then recompute, compile, and FSDP2 over "dp"
    tensor_parallel(stage, mesh["tp"])
    # with pp, each micro-batch runs forward then backward later: keep the gathered blocks (torchtitan's default)
    fsdp = dict(mesh=mesh["dp"], mp_policy=mp or MixedPrecisionPolicy(), reshard_after_forward=mesh["pp"].size() == 1)
    for block in stage.blocks:
        if isinstance(block, Block):
            if recompute:  # activation checkpointing: keep the input, run the forward again in backward
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            if compile:
                block.compile()
            fully_shard(block, **fsdp)  # the tp slices, sharded again over dp
    fully_shard(stage, **fsdp)  # embeddings, final norm and head, where this stage has them
    return stage


def loss_fn(logits, y):  # mean cross-entropy; 16-bit logits in float32
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), y.flatten())


def pipeline(stage, mesh, device, micro, kind=Schedule1F1B):
    # the stages over "pp", micro-batches in 1F1B order; None with one stage (train_step then accumulates by hand)
    if mesh["pp"].size() == 1:
        return None
    piece = PipelineStage(stage, mesh["pp"].get_local_rank(), mesh["pp"].size(), device, group=mesh["pp"].get_group())
    return kind(piece, n_microbatches=micro, loss_fn=loss_fn)  # gradients divided by micro: the mean


def clip_grad_norm(model, max_norm, mesh):
    # the whole model's gradient norm: DTensor gradients reduce over (dp, tp), the stages add their squares
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    squares = (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(squares, group=mesh["pp"].get_group())
    norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)  # scaled by max_norm / norm if above
    return norm


def reported(loss, mesh):
    # the global batch's mean loss, on every rank: the last stage's, averaged over dp
    value = (loss.full_tensor() if isinstance(loss, DTensor) else torch.as_tensor(loss)).detach().double().clone()
    dist.all_reduce(value, group=mesh["pp"].get_group())  # the other stages hold 0
    dist.all_reduce(value, group=mesh["dp"].get_group())  # gloo has no AVG: sum, then divide
    return value.item() / mesh["dp"].size()


def forward_backward(model, schedule, x, y, micro, mesh):
    # this dp row's rows in `micro` micro-batches; returns the mean loss (0 on stages without the head)
    with loss_parallel():  # the head's logits stay split over tp: cross-entropy on the slices
        if schedule is not None:  # pp > 1: the schedule sends activations between stages
            first, last = mesh["pp"].get_local_rank() == 0, mesh["pp"].get_local_rank() == mesh["pp"].size() - 1
            losses = []
            schedule.step(*[x] * first, target=y if last else None, losses=losses)
            return sum(losses) / micro if last else torch.zeros((), device=x.device)
        total = 0
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            model.set_requires_gradient_sync(i == micro - 1)  # FSDP reduce-scatters after the last one only
            loss = loss_fn(model(xm), ym) / micro
            loss.backward()
            total = total + loss.detach()
        return total


def train_step(model, schedule, optimizer, x, y, *, lr, micro, max_norm, mesh):
    for group in optimizer.param_groups:
        group["lr"] = lr  # the schedule is a function of the step: nothing to save for it
    loss = forward_backward(model, schedule, x, y, micro, mesh)
    norm = clip_grad_norm(model, max_norm, mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm
# ---- end of export from notebooks/21-gpt-capstone.ipynb ----


# ---- exported from notebooks/22-gpt-capstone-run.ipynb: edit it there, then run `make export` ----
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # AdamW's state keyed by each parameter's FQN


def save_checkpoint(model, optimizer, folder, *, async_group=None):
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)  # DTensors: this worker's slices
    state = {"model": model_sd, "optim": optim_sd}
    if async_group is None:
        return dcp.save(state, checkpoint_id=folder)  # every worker writes its own
    # copies to memory now, writes from a thread; its collectives on a gloo group of their own, as torchtitan's
    return dcp.async_save(state, checkpoint_id=folder, process_group=async_group)


def load_checkpoint(model, optimizer, folder):
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)  # the shapes THIS run's layout wants
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)  # each worker reads the parts of the saved slices that it needs
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
# ---- end of export from notebooks/22-gpt-capstone-run.ipynb ----


def held_out(model, schedule, val, size, args, mesh, device) -> float:
    losses, pp = [], mesh["pp"]
    for i in range(args.eval_batches):  # fixed windows of the held-out bytes: "steps" 10**6 on
        x, y = batch_at(val, 10**6 + i, size["batch"], size["seq_len"], args.seed, mesh, device)
        with torch.no_grad(), loss_parallel():
            parts, last = [], pp.get_local_rank() == pp.size() - 1
            if schedule is None:
                parts.append(loss_fn(model(x), y) * args.micro)
            else:  # forward only, through the stages
                schedule.eval(*[x] * (pp.get_local_rank() == 0), target=y if last else None, losses=parts)
        # a tensor on the device on every stage: one backend for the whole group (gloo for CPU, NCCL for CUDA tensors)
        losses.append(reported(sum(parts) / args.micro if last else torch.zeros((), device=device), mesh))
    return sum(losses) / len(losses)


def lr_at(step: int, size: dict) -> float:  # linear warm-up over a tenth of the steps, then cosine to a tenth
    warmup = max(1, size["steps"] // 10)
    frac = min(1.0, max(0.0, (step - warmup) / max(1, size["steps"] - warmup)))
    return size["lr"] * min((step + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


META = ("n_layer", "n_head", "d_model", "seq_len", "batch", "lr", "steps", "max_norm")


class Saver:  # periodic checkpoints, blocking or async (a save, and the run's end, wait for the previous write)
    def __init__(self, args, size):
        self.args, self.meta, self.pending = args, {k: size[k] for k in META[:-1]} | {"max_norm": args.max_norm}, None
        self.group = dist.new_group(backend="gloo") if args.async_save else None  # the writer thread's own

    def save(self, model, optimizer, step) -> None:
        t0 = time.perf_counter()
        self.wait()
        folder = self.args.checkpoint_dir / f"step-{step}"
        written = save_checkpoint(model, optimizer, folder, async_group=self.group)
        self.pending = written if self.group is not None else None  # async: a Future
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "course.json").write_text(json.dumps({"step": step, "seed": self.args.seed, **self.meta}))
        emit(dist.get_rank(), event="save", step=step, blocking=self.group is None, waited=time.perf_counter() - t0)
        if self.args.dump_state:  # the state as it is now, for the checks that read it whole (notebook 22, tests)
            save_checkpoint(model, optimizer, self.args.dump_state / f"saved-{step}")

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.pending = None


def resume(model, optimizer, args, size) -> int:
    meta = json.loads((args.resume / "course.json").read_text())
    mine = {k: size[k] for k in META[:-1]} | {"max_norm": args.max_norm}
    if {k: meta[k] for k in mine} != mine or meta["seed"] != args.seed:
        raise SetupError(f"{args.resume} was written with {meta}; this run has {mine}, seed {args.seed}")
    load_checkpoint(model, optimizer, args.resume)
    if args.dump_state:  # what the load put in this run's layout
        save_checkpoint(model, optimizer, args.dump_state / f"loaded-{meta['step']}")
    return meta["step"]


def train(args) -> None:
    rank, device, mesh = setup(args)
    cfg, size = sizes(args, device)
    dp = mesh["dp"].size()
    if size["batch"] % (dp * args.micro) or size["n_layer"] % args.pp or size["seq_len"] % args.tp:
        raise SetupError(f"batch {size['batch']} / (dp {dp} x micro {args.micro}), {size['n_layer']} layers / pp "
                         f"{args.pp} and seq_len {size['seq_len']} / tp {args.tp} must divide evenly")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" and devices.has_bf16(device) else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    train_tokens, val_tokens = text.byte_splits(text.load_corpus()[0])
    model, schedule, evaluator = build(args, cfg, mesh, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    # the whole model's FLOPs, PaLM's count (6N + 12LHQT): not the QK^T a fused kernel's backward recomputes
    flops_per_token = train_flops_per_token(cfg, cfg.seq_len, matmul_params(GPT(cfg)), fused_attention=False)
    peak, peak_label = mfu.run_peak(device, dist.get_world_size(), dtype, args.peak_flops)
    emit(rank, event="start", world=dist.get_world_size(), pp=args.pp, dp=dp, tp=args.tp, micro=args.micro,
         device=str(device), backend=dist.get_backend(), dtype=str(dtype).replace("torch.", ""), size=size,
         compile=args.compile, ac=not args.no_ac, flops_per_token=flops_per_token, peak_flops=peak, peak=peak_label)
    saver = Saver(args, size)
    step = resume(model, optimizer, args, size) if args.resume else 0
    if step == 0:
        emit(rank, event="eval", step=0, val=held_out(model, evaluator, val_tokens, size, args, mesh, device))
    tokens, t_start = size["batch"] * cfg.seq_len, time.perf_counter()
    stop = min(size["steps"], args.stop_at or size["steps"])
    while step < stop:
        x, y = batch_at(train_tokens, step, size["batch"], cfg.seq_len, args.seed, mesh, device)
        t0 = time.perf_counter()
        loss, norm = train_step(model, schedule, optimizer, x, y, lr=lr_at(step, size), micro=args.micro,
                                max_norm=args.max_norm, mesh=mesh)
        loss_value = reported(loss, mesh)  # collectives: they also wait for the step to end
        seconds = time.perf_counter() - t0
        step += 1
        emit(rank, event="step", step=step, loss=loss_value, grad_norm=norm.item(), seconds=seconds,
             tokens_per_s=tokens / seconds, mfu=mfu.mfu(tokens / seconds, flops_per_token, peak) if peak else None)
        if args.eval_every and step % args.eval_every == 0 and step < stop:
            emit(rank, event="eval", step=step, val=held_out(model, evaluator, val_tokens, size, args, mesh, device))
        if args.save_every and step % args.save_every == 0:
            saver.save(model, optimizer, step)
    seconds = time.perf_counter() - t_start
    saver.wait()  # the last async save is written before the run ends
    emit(rank, event="eval", step=step, val=held_out(model, evaluator, val_tokens, size, args, mesh, device))
    emit(rank, event="done", step=step, seconds=seconds)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.save_every and args.checkpoint_dir is None:
            raise SetupError("--save-every needs --checkpoint-dir")
        if args.resume is not None and not (args.resume / "course.json").is_file():
            raise SetupError(f"--resume {args.resume}: no checkpoint there (no course.json)")
        train(args)
    except (SetupError, text.CorpusMissing) as e:
        print(f"train_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()  # then leave without the interpreter's teardown, as scripts/train_ddp.py does (gloo's threads can
    sys.stdout.flush()  # abort a finished worker while Python shuts down: pytorch/pytorch#38228)
    sys.stderr.flush()
    os._exit(code)
