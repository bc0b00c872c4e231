#!/usr/bin/env python
"""Train the course's GPT under torchrun: FSDP2 x tensor parallelism on a 2-D mesh, the capstone's script.

    torchrun --standalone --nproc-per-node=4 scripts/train_gpt.py --tp 2 --checkpoint-dir ckpt --save-at 120
    torchrun --standalone --nproc-per-node=2 scripts/train_gpt.py --tp 2 --resume ckpt/step-120   # resharded

The W workers form a (dp, tp) mesh, dp = W / tp: each block's attention (q, k, v by columns, o by rows) and MLP (up
by columns, down by rows) are split over "tp", then every block and the root are sharded over "dp" with FSDP2's
``fully_shard``. Each block is recomputed in backward (activation checkpointing) and, with ``--compile``, compiled.
The global batch of step s is drawn from a generator seeded by (seed, s), whatever the world size, so that a run
resumed from a DCP checkpoint (model and AdamW state, saved by any number of workers, read by any other) sees the
batches an uninterrupted run sees. Rank 0 prints one JSON object per line (``{"event": ...}``) for the notebook.
Introduced in notebooks/20-gpt-capstone.ipynb.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the helpers package sits next to scripts/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from helpers import devices, mfu, text  # noqa: E402
from helpers.gpt import GPT, GPTConfig, generate, gpt_loss, matmul_params, train_flops_per_token  # noqa: E402

PROMPT = "The "


class SetupError(Exception):
    """A problem with the options or the checkpoint: printed as one line, exit code 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="FSDP2 x TP training of the course's GPT (run it with torchrun).")
    p.add_argument("--size", default="auto", choices=["auto", *mfu.SIZES],
                   help="model, batch and steps from helpers.mfu.SIZES; auto: chosen from the device")
    for name in ("n-layer", "n-head", "d-model", "seq-len", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the size's value (batch: global)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate (default: the size's)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = world size / tp (default 2)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float64"), default="auto",
                   help="auto: bf16 compute (FSDP's MixedPrecisionPolicy) on GPUs that have it, else float32")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="DCP checkpoints go to DIR/step-K")
    p.add_argument("--save-at", type=int, nargs="*", default=[], help="steps after which to save")
    p.add_argument("--resume", type=Path, default=None, help="a DIR/step-K to resume from (any world size)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (the schedule stays --steps')")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: at the end only)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out windows: this many global batches")
    p.add_argument("--sample", type=int, default=0, help="bytes to generate before and after training")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="one device's peak FLOP/s for MFU, times the GPUs (default: the datasheet's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait before failing")
    args = p.parse_args(argv)
    return args


def emit(rank: int, **event) -> None:
    if rank == 0:  # one line per event: the notebook parses them
        print(json.dumps(event) + "\n", end="", flush=True)


def setup(args):
    """Join torchrun's group; returns rank, world size, device, mesh."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan = devices.plan(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    device = plan.devices[local_rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(plan.backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if plan.backend == "nccl" else None)
    world = dist.get_world_size()
    if world % args.tp:
        raise SetupError(f"world size {world} is not a multiple of --tp {args.tp}")
    return dist.get_rank(), world, device, make_mesh(device, world, args.tp)


def sizes(args, device) -> tuple[GPTConfig, dict]:
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    name = args.size if args.size != "auto" else mfu.choose_size(device.type, memory)
    size = {**mfu.SIZES[name], "name": name}
    for key in ("n_layer", "n_head", "d_model", "seq_len", "batch", "steps", "lr"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    cfg = GPTConfig(vocab_size=text.VOCAB_SIZE, seq_len=size["seq_len"], n_layer=size["n_layer"],
                    n_head=size["n_head"], d_model=size["d_model"])
    return cfg, size


def build(args, cfg, mesh, device, dtype):
    torch.manual_seed(args.seed)  # the same whole model on every worker before it is split
    model = GPT(cfg).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    compute = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == torch.bfloat16 else {}
    return parallelize(model, mesh, recompute=not args.no_ac, compile=args.compile,
                       mp=MixedPrecisionPolicy(**compute))


# ---- exported from notebooks/20-gpt-capstone.ipynb: edit it there, then run `make export` ----
def make_mesh(device, world_size, tp):
    # W workers as a (dp, tp) grid: the tp workers of a row split every layer, the dp rows shard it (FSDP2)
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def batch_at(tokens, step, batch, seq_len, seed, mesh, device):
    # step `step`'s global batch, the same for any world size; this dp row's rows of it
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # held-out batches: steps 10**6 on
    x, y = text.random_windows(tokens, batch, seq_len, g)
    dp, rows = mesh["dp"].get_local_rank(), batch // mesh["dp"].size()
    return x[dp * rows:(dp + 1) * rows].to(device), y[dp * rows:(dp + 1) * rows].to(device)


def recomputed(forward):
    # activation checkpointing: keep only the input for backward, where the forward runs again
    def run(x):
        return checkpoint(forward, x, use_reentrant=False)
    return run


def parallelize(model, mesh, *, recompute=True, compile=False, mp=None):
    # tensor parallel over "tp", then recompute, compile, and FSDP2 over "dp": torchtitan's order
    fsdp = {"mesh": mesh["dp"]} if mp is None else {"mesh": mesh["dp"], "mp_policy": mp}
    for block in model.blocks:
        # each tp worker: n_head/tp whole heads (q, k, v by columns, o by rows) and 4d/tp of the MLP's width
        parallelize_module(block, mesh["tp"], {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
        if recompute:
            block.forward = recomputed(block.forward)
        if compile:
            block.compile()
        fully_shard(block, **fsdp)  # the tp slices, sharded again over dp; gathered for the block's forward
    fully_shard(model, **fsdp)  # embeddings, final norm and head: whole on every tp worker, sharded over dp
    return model


def train_step(model, optimizer, x, y, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr  # the schedule is a function of the step: nothing to save for it
    loss = gpt_loss(model, x, y)  # the mean over this dp row's rows
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def save_checkpoint(model, optimizer, folder):
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: each worker's slices, with their layout
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)  # every worker writes its own


def load_checkpoint(model, optimizer, folder):
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the shapes THIS run's layout wants
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)  # each worker reads the parts of the saved slices that it needs
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
# ---- end of export from notebooks/20-gpt-capstone.ipynb ----


def mean_over_dp(value: torch.Tensor, mesh) -> float:
    value = value.detach().double().clone()
    dist.all_reduce(value, group=mesh["dp"].get_group())  # gloo has no AVG: sum, then divide
    return value.item() / mesh["dp"].size()


@torch.no_grad()
def held_out(model, val, size, args, mesh, device) -> float:
    losses = []
    for i in range(args.eval_batches):  # fixed windows of the held-out bytes: "steps" 10**6 on
        x, y = batch_at(val, 10**6 + i, size["batch"], size["seq_len"], args.seed, mesh, device)
        losses.append(mean_over_dp(gpt_loss(model, x, y), mesh))
    return sum(losses) / len(losses)


def sample(model, rank, args, step) -> None:
    if args.sample:  # every worker runs the forward (it is sharded); the same generator: the same bytes on all
        # eager, even with --compile: prompts of every length would recompile the blocks with dynamic shapes, and the
        # training step compiled after them failed (torch 2.15, CPU: RecursionError in the backward's compile)
        with torch.compiler.set_stance("force_eager"):
            out = generate(model, text.encode(PROMPT), args.sample, generator=torch.Generator().manual_seed(args.seed))
        emit(rank, event="sample", step=step, text=PROMPT + text.decode(out))


def lr_at(step: int, size: dict) -> float:
    warmup = max(1, size["steps"] // 10)  # linear warm-up, then cosine down to a tenth
    if step < warmup:
        return size["lr"] * (step + 1) / warmup
    frac = (step - warmup) / max(1, size["steps"] - warmup)
    return size["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save(model, optimizer, args, step, size, world) -> None:
    folder = args.checkpoint_dir / f"step-{step}"
    save_checkpoint(model, optimizer, folder)
    if dist.get_rank() == 0:
        meta = {"step": step, "world_size": world, "tp": args.tp, "seed": args.seed,
                **{k: size[k] for k in ("n_layer", "n_head", "d_model", "seq_len", "batch", "lr", "steps")}}
        (folder / "course.json").write_text(json.dumps(meta))
    dist.barrier()


def resume(model, optimizer, args, size) -> int:
    meta = json.loads((args.resume / "course.json").read_text())
    mine = {k: size[k] for k in ("n_layer", "n_head", "d_model", "seq_len", "batch", "lr", "steps")}
    if {k: meta[k] for k in mine} != mine or meta["seed"] != args.seed:
        raise SetupError(f"{args.resume} was written with {meta}; this run has {mine}, seed {args.seed}")
    load_checkpoint(model, optimizer, args.resume)
    return meta["step"]


def train(args) -> None:
    rank, world, device, mesh = setup(args)
    cfg, size = sizes(args, device)
    if size["batch"] % mesh["dp"].size():
        raise SetupError(f"global batch {size['batch']} does not split over dp={mesh['dp'].size()}")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" and devices.has_bf16(device) else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    corpus, where = text.load_corpus()
    train_tokens, val_tokens = text.byte_splits(corpus)
    model = build(args, cfg, mesh, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    # the whole model's FLOPs, PaLM's count (6N + 12LHQT): not the QK^T a fused kernel's backward recomputes
    flops_per_token = train_flops_per_token(cfg, cfg.seq_len, matmul_params(GPT(cfg)), fused_attention=False)
    peak, peak_label = peak_of(args, device, world, dtype)
    emit(rank, event="start", world=world, dp=mesh["dp"].size(), tp=args.tp, device=str(device),
         backend=dist.get_backend(), dtype=str(dtype).replace("torch.", ""), size=size, compile=args.compile,
         ac=not args.no_ac, flops_per_token=flops_per_token, peak_flops=peak, peak=peak_label, corpus=where)
    step = resume(model, optimizer, args, size) if args.resume else 0
    if step == 0:
        sample(model, rank, args, step)
        emit(rank, event="eval", step=0, val=held_out(model, val_tokens, size, args, mesh, device))
    tokens = size["batch"] * cfg.seq_len
    t_start = time.perf_counter()
    stop = min(size["steps"], args.stop_at or size["steps"])
    while step < stop:
        x, y = batch_at(train_tokens, step, size["batch"], cfg.seq_len, args.seed, mesh, device)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, x, y, lr_at(step, size))
        loss_value = mean_over_dp(loss, mesh)  # a collective: it also waits for the step to end
        seconds = time.perf_counter() - t0
        step += 1
        emit(rank, event="step", step=step, loss=loss_value, seconds=seconds, tokens_per_s=tokens / seconds,
             mfu=mfu.mfu(tokens / seconds, flops_per_token, peak) if peak else None)
        if args.eval_every and step % args.eval_every == 0 and step < stop:
            emit(rank, event="eval", step=step, val=held_out(model, val_tokens, size, args, mesh, device))
        if step in args.save_at:
            save(model, optimizer, args, step, size, world)
    emit(rank, event="eval", step=step, val=held_out(model, val_tokens, size, args, mesh, device))
    sample(model, rank, args, step)
    emit(rank, event="done", step=step, seconds=time.perf_counter() - t_start)


def peak_of(args, device, world: int, dtype: torch.dtype) -> tuple[float | None, str]:
    # the global batch's tokens/s are measured against every GPU's peak; CPU workers share one machine's rate. A GPU's
    # peak is its datasheet's for the precision the matmuls run in: bf16, or for float32 plain FP32 (torch leaves
    # TF32 off unless asked; then TF32), never the bf16 figure of a float32 run
    gpus = world if device.type == "cuda" else 1
    if args.peak_flops:
        return args.peak_flops * gpus, f"given (--peak-flops) x {gpus}"
    if device.type == "cuda":
        precision = mfu.matmul_precision(dtype)
        found = mfu.datasheet_peak(torch.cuda.get_device_name(device), precision)
        return (found[0] * gpus, f"datasheet dense {precision} x {gpus}") if found else (
            None, f"no datasheet {precision} figure for this GPU")
    return None, "not measured (pass --peak-flops)"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.save_at and args.checkpoint_dir is None:
            raise SetupError("--save-at needs --checkpoint-dir")
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
    code = main()
    # Leave without the interpreter's teardown, as scripts/train_ddp.py does (gloo's threads can abort a worker
    # that has finished while Python shuts down: pytorch/pytorch#38228).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
