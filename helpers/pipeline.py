"""What pipeline ranks run: the code of notebooks 10 and 11, exported from their cells (edit it there).

10 writes the micro-batch schedule out by hand on the GPT cut in two (``pipeline_step``) and the launched children
that check it; 10 runs the GPT's stages one or two a rank with ``torch.distributed.pipelining`` (``cut``,
``pp_train``). Below the regions: ``hybrid_steps``, DDP over two-stage GPTs, the solution of 11's exercise 4: a
solution cell is the learner's and is not exported, so this is a copy, which tests/test_pipeline.py keeps equal to
the cell (the NCCL binding tests and the perturbed checks run it).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                           ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from . import schedules, stages
from ._rank import report
from .gpt import GPT, GPTConfig
from .schedules import KINDS, programs
from .stages import TwoStage, gpt_stage, lm_loss


# ---- exported from notebooks/10-model-parallel.ipynb: edit it there, then run `make export` ----
def split_pair(model, split, devices, dtype=torch.float32):
    """A copy of the GPT on the first stage's device, and a TwoStage copy. Introduced in notebooks/10-model-parallel.ipynb."""
    ref = copy.deepcopy(model).to(devices[0], dtype)
    return ref, TwoStage(ref, split, devices)  # the stages are copies: ref keeps its own weights


def check_split(rank, world_size, gpt, x, y, *, split=2, devices=("cpu", "cpu"), dtype=torch.float32):
    """Split vs unsplit in dtype, and stage bytes in float32. Introduced in notebooks/10-model-parallel.ipynb."""
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 runs compare full float32 on a GPU too
    ref, two = split_pair(gpt, split, devices, dtype)
    out_ref, out = ref(x.to(devices[0])), two(x)
    lm_loss(out_ref, y.to(out_ref.device)).backward()
    lm_loss(out, y.to(two.devices[1])).backward()  # the labels go where the output is: stage 1's device
    try:  # the classic mistake: labels left on stage 0's device
        F.cross_entropy(two(x).flatten(0, 1), y.to(two.devices[0]).flatten())
        wrong_labels_error = None  # both stages on one device: nothing to mix up
    except RuntimeError as e:
        wrong_labels_error = str(e).splitlines()[0]
    return {"devices": [str(d) for d in two.devices], "output_device": str(out.device),
            "forward_diff": (out_ref.detach().cpu() - out.detach().cpu()).abs().max().item(),
            "grad_diff": max((ref.get_parameter(k).grad.cpu() - g).abs().max().item()
                             for k, g in two.gpt_state(grads=True).items()),
            "memory": stage_bytes(TwoStage(gpt, split, devices), x), "wrong_labels_error": wrong_labels_error}


def stage_bytes(two, x):
    """Per stage: parameters, bytes autograd saves for backward, bytes sent on. Introduced in notebooks/10-model-parallel.ipynb."""
    rows, h, saved = [], x, {}  # saved: storage → bytes (a tensor saved twice counts once)

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for stage, device in zip((two.stage0, two.stage1), two.devices):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = stage(h.to(device))
        weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}  # a Linear saves its weight too
        rows.append({"params": sum(p.numel() for p in stage.parameters()), "sent": h.nbytes,
                     "saved": sum(b for k, b in saved.items() if k not in weights)})
    return rows


def pipeline_step(model, x, y, n_micro, kind="gpipe", loss_fn=lm_loss):
    """Forward and backward of a TwoStage in micro-batches. Introduced in notebooks/10-model-parallel.ipynb."""
    if not 1 <= n_micro <= len(x):
        raise ValueError(f"n_micro must be from 1 to the batch size {len(x)}, got {n_micro}")
    d0, d1 = model.devices
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    order = schedules.simulate(programs(kind, 2, len(xs)))  # chunk may make fewer pieces
    held = {}  # micro-batch -> what its backward still needs: the activations in flight
    total = torch.zeros((), device=d1)
    for stage, op, i, *_ in order:  # stage, pass, micro-batch (and the simulated start and end)
        if (stage, op) == (0, "F"):
            h = model.stage0(xs[i].to(d0))
            sent = h.detach().to(d1).requires_grad_(True)  # hand-off: stage 1 gets a fresh leaf on its device
            held[i] = [h, sent, None]
        elif (stage, op) == (1, "F"):
            loss = loss_fn(model.stage1(held[i][1]), ys[i].to(d1)) * (len(ys[i]) / len(y))  # labels on d1
            held[i][2], total = loss, total + loss.detach()
        elif (stage, op) == (1, "B"):
            torch.autograd.backward(held[i][2])  # fills sent.grad: the gradient to hand back
        else:
            h, sent, _ = held.pop(i)
            torch.autograd.backward(h, sent.grad.to(d0))  # stage 0 gets the gradient of h and finishes the micro-batch
    return total


def check_schedules(rank, world_size, gpt, x, y, *, split=2, micro_counts=(1, 2, 4), lr=0.1, devices=("cpu", "cpu"),
                    dtype=torch.float32):
    """{(kind, M): gradient vs unsplit}, and a training step's weights. Introduced in notebooks/10-model-parallel.ipynb."""
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 runs compare full float32 on a GPU too
    ref, model = split_pair(gpt, split, devices, dtype)
    lm_loss(ref(x.to(devices[0])), y.to(devices[0])).backward()
    diffs = {}
    for kind in KINDS:
        for m in micro_counts:
            model.zero_grad(set_to_none=True)
            pipeline_step(model, x, y, m, kind)
            diffs[(kind, m)] = max((ref.get_parameter(k).grad.cpu() - g).abs().max().item()
                                   for k, g in model.gpt_state(grads=True).items())
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # one step of training, split: the same recipe
    opt.zero_grad(set_to_none=True)
    pipeline_step(model, x, y, max(micro_counts), "1f1b")
    opt.step()
    step_diff = max((ref.get_parameter(k).detach().cpu() - w).abs().max().item() for k, w in model.gpt_state().items())
    return {"diffs": diffs, "step_diff": step_diff}
# ---- end of export from notebooks/10-model-parallel.ipynb ----


# ---- exported from notebooks/11-pipelines.ipynb: edit it there, then run `make export` ----
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,  # one stage a rank
             "interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,  # two, looped
             "zbv": ScheduleZBVZeroBubble}  # two a rank, in a V


def cut(model, rank, world_size, schedule, split=None):
    """(number of stages, {stage index: this rank's stage}) of the GPT. Introduced in notebooks/11-pipelines.ipynb."""
    L = len(model.blocks)
    n = world_size if schedule in ("gpipe", "1f1b") else 2 * world_size
    one_a_rank = n == world_size  # split: where the cut goes with one stage a rank (else equal shares)
    bounds = [0, split, L] if split is not None and one_a_rank else [L * s // n for s in range(n + 1)]  # blocks
    own = [rank, n - 1 - rank] if schedule == "zbv" else range(rank, n, world_size)  # looped: rank r holds r, r + W
    return n, {s: gpt_stage(model, range(bounds[s], bounds[s + 1]), first=s == 0, last=s == n - 1) for s in own}


def make_schedule(parts, n, device, schedule, n_micro, **kwargs):
    """This rank's stages, each a PipelineStage, driven by one schedule. Introduced in notebooks/11-pipelines.ipynb."""
    held = [PipelineStage(part, s, n, device) for s, part in parts.items()]
    return SCHEDULES[schedule](held if len(held) > 1 else held[0], n_micro, loss_fn=lm_loss, **kwargs)


def pp_train(rank, world_size, cfg, batches, lr, *, schedule="gpipe", n_micro=4, split=None, seed=0,
             dtype=torch.float64, scale_grads=True, devices=None):
    """Pipelined SGD steps on the GPT; this rank's parameters. Introduced in notebooks/11-pipelines.ipynb."""
    device = devices[rank] if devices else torch.device("cpu")  # the plan's: a GPU per rank (NCCL), else the CPU
    torch.manual_seed(seed)  # every rank builds the same whole GPT, then keeps its stages
    n, parts = cut(GPT(cfg).to(device, dtype), rank, world_size, schedule, split)
    pipe = make_schedule(parts, n, device, schedule, n_micro, scale_grads=scale_grads)
    opt = torch.optim.SGD([p for part in parts.values() for p in part.parameters()], lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        inputs = (x.to(device),) if 0 in parts else ()  # the rank holding stage 0 feeds the tokens
        targets = dict(target=y.to(device)) if n - 1 in parts else {}  # the last stage's rank gets the labels
        pipe.step(*inputs, **targets)
        opt.step()
    return {k: p.detach().cpu() for part in parts.values() for k, p in part.named_parameters()}
# ---- end of export from notebooks/11-pipelines.ipynb ----


# A copy of notebooks/11-pipelines.ipynb's solution to exercise 4 (tests/test_pipeline.py keeps it equal to the cell)
def hybrid_steps(rank, world_size, dataset, steps, batch_size, lr, *, cfg=None, split=2, seed=0, dtype=torch.float32):
    """DDP over two-stage GPTs (launch with init=False). Introduced in notebooks/11-pipelines.ipynb."""
    plan = stages.plan_hybrid(world_size, 2)
    devices = plan.devices[rank]  # this rank's two stage devices
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
    # an NCCL group binds ONE device per rank, and this rank has two: the world group is gloo (it carries no
    # gradients), and each stage all-reduces in a group of its own, bound to this rank's device for that stage
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    nccl = plan.backend == "nccl"
    groups = [dist.new_group(backend=plan.backend, device_id=d if nccl else None) for d in devices]
    try:
        torch.manual_seed(seed)  # the same weights as the one process's GPT
        model = TwoStage(GPT(cfg or GPTConfig()).to(dtype), split, devices)
        stage0, stage1 = (DDP(s, process_group=g) for s, g in zip((model.stage0, model.stage1), groups))
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=False)  # rank r: samples r, r + W, …
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for step, (xb, yb) in zip(range(steps), loader):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(stage1(stage0(xb.to(devices[0])).to(devices[1])), yb.to(devices[1]))  # labels: output's
            loss.backward()  # each stage's DDP all-reduces its gradients in its own group, on its own device
            opt.step()
            report(step=step + 1, total=steps, loss=loss.item())
        result = {"params": model.gpt_state(), "devices": [str(d) for d in devices], "plan": plan.sentence}
        dist.barrier()  # the world group: gloo
    finally:
        dist.destroy_process_group()  # every group this rank joined
    return result
