"""What pipeline ranks run: the code of notebooks 09 and 10, exported from their cells (edit it there).

09 writes the micro-batch schedule out by hand (``pipeline_step``) and the
launched children that check it; 10 runs one stage per rank with
``torch.distributed.pipelining`` (``pp_rank``) and DDP over two-stage models
(``hybrid_steps``). Only the imports below are this file's own: later
notebooks, tests and scripts import the same code from here.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                           ScheduleInterleavedZeroBubble)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from . import schedules, stages
from ._rank import report
from .checks import positive_int
from .models import ConvNet, max_param_diff
from .schedules import KINDS, programs
from .stages import TwoStage
from .train import full_fp32, sync


# ---- exported from notebooks/09-model-parallel.ipynb: edit it there, then run `make export` ----
def split_pair(split, seed, devices, dtype=torch.float32):
    """Unsplit ConvNet on the first stage's device, and a TwoStage copy. Introduced in notebooks/09-model-parallel.ipynb."""
    torch.manual_seed(seed)
    ref = ConvNet(batch_norm=False).to(devices[0], dtype)
    return ref, TwoStage(copy.deepcopy(ref), split, devices)


def check_split(rank, world_size, x, y, *, split=4, seed=0, dtype=torch.float32):
    """Split vs unsplit in dtype, and stage bytes in float32. Introduced in notebooks/09-model-parallel.ipynb."""
    plan = stages.plan_stages(2)
    with full_fp32():  # no TF32 where dtype is float32
        ref, model = split_pair(split, seed, plan.devices, dtype)
        x, fp32_model = x.to(dtype), split_pair(split, seed, plan.devices)[1]
        out_ref, out = ref(x.to(plan.devices[0])), model(x)
        F.cross_entropy(out_ref, y.to(out_ref.device)).backward()
        F.cross_entropy(out, y.to(model.output_device)).backward()  # the labels go where the output is
        try:  # the classic mistake: labels left on stage 0's device
            F.cross_entropy(model(x), y.to(model.devices[0]))
            wrong_labels_error = None  # both stages on one device: nothing to mix up
        except RuntimeError as e:
            wrong_labels_error = str(e).splitlines()[0]
        return {"plan": plan.sentence, "devices": [str(d) for d in model.devices], "output_device": str(out.device),
                "forward_diff": (out_ref.detach().cpu() - out.detach().cpu()).abs().max().item(),
                "grad_diff": max((ref.get_parameter(k).grad.cpu() - g).abs().max().item()
                              for k, g in model.convnet_state(grads=True).items()),
                "memory": stages.stage_memory(fp32_model, x.float()), "wrong_labels_error": wrong_labels_error}


def pipeline_step(model, x, y, n_micro, kind="gpipe", loss_fn=F.cross_entropy):
    """Forward and backward in micro-batches. Introduced in notebooks/09-model-parallel.ipynb."""
    if positive_int("n_micro", n_micro) > len(x):
        raise ValueError(f"n_micro must be from 1 to the batch size {len(x)}, got {n_micro}")
    d0, d1 = model.devices
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    order = schedules.simulate(programs(kind, 2, len(xs)))  # chunk may make fewer pieces
    held = {}  # micro-batch -> what its backward still needs: the activations in flight
    total = torch.zeros((), device=d1)
    for slot in order:
        i = slot.mb
        if (slot.stage, slot.op) == (0, "F"):
            h = model.stage0(xs[i].to(d0))
            sent = h.detach().to(d1).requires_grad_(True)  # hand-off: stage 1 gets a fresh leaf on its device
            held[i] = [h, sent, None]
        elif (slot.stage, slot.op) == (1, "F"):
            loss = loss_fn(model.stage1(held[i][1]), ys[i].to(d1)) * (len(ys[i]) / len(y))  # labels on d1
            held[i][2], total = loss, total + loss.detach()
        elif (slot.stage, slot.op) == (1, "B"):
            held[i][2].backward()  # fills sent.grad: the gradient to hand back
        else:
            h, sent, _ = held.pop(i)
            h.backward(sent.grad.to(d0))  # stage 0 receives the gradient and finishes this micro-batch
    return total


def check_schedules(rank, world_size, x, y, *, split=4, micro_counts=(1, 2, 4), seed=0, lr=0.1, dtype=torch.float32):
    """{(kind, M): gradient vs unsplit}, and a training step's weights. Introduced in notebooks/09-model-parallel.ipynb."""
    devices = stages.plan_stages(2).devices
    with full_fp32():  # no TF32 where dtype is float32
        ref, model = split_pair(split, seed, devices, dtype)
        x = x.to(dtype)
        F.cross_entropy(ref(x.to(devices[0])), y.to(devices[0])).backward()
        ref_grads = {k: p.grad.detach().cpu() for k, p in ref.named_parameters()}
        diffs = {}
        for kind in KINDS:
            for m in micro_counts:
                model.zero_grad(set_to_none=True)
                pipeline_step(model, x, y, m, kind)
                diffs[(kind, m)] = max((ref_grads[k] - g).abs().max().item()
                                       for k, g in model.convnet_state(grads=True).items())
        torch.optim.SGD(ref.parameters(), lr=lr).step()
        opt = torch.optim.SGD(model.parameters(), lr=lr)  # one step of training, split: the same recipe
        opt.zero_grad(set_to_none=True)
        pipeline_step(model, x, y, max(micro_counts), "1f1b")
        opt.step()
        step_diff = max((ref.get_parameter(k).detach().cpu() - w).abs().max().item()
                        for k, w in model.convnet_state().items())
    return {"diffs": diffs, "step_diff": step_diff}
# ---- end of export from notebooks/09-model-parallel.ipynb ----


# ---- exported from notebooks/10-pipelines.ipynb: edit it there, then run `make export` ----
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,  # one stage per rank
             "interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}  # several


def pp_rank(rank, world_size, x, y, *, micro_counts=(4,), schedule="gpipe", split=4, rounds=0, seed=0,
            scale_grads=True, dtype=torch.float32, cuts=(1, 4, 8)):
    """A rank's stages, torch.distributed.pipelining. Introduced in notebooks/10-pipelines.ipynb."""
    # returns this rank's gradients (ConvNet's names), the last stage's losses, step times per M, its stage time
    device = stages.plan_pipeline(world_size).devices[rank]  # a GPU per stage (NCCL), else the CPU for every rank
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 (no TF32)
    torch.manual_seed(seed)  # every rank builds the same whole model, then keeps its own stages
    net = ConvNet(batch_norm=False)
    layers = torch.nn.Sequential(*net.layer1, *net.layer2, torch.nn.Flatten(1), net.fc)  # forward's order
    bounds = (0, split, len(layers)) if schedule in ("gpipe", "1f1b") else (0, *cuts, len(layers))
    parts = [layers[a:b] for a, b in zip(bounds, bounds[1:])]  # the cuts: slices, the same modules
    n = len(parts)
    own = list(range(rank, n, world_size))  # stage s on rank s % world_size: rank 0 holds 0 and 2 of 4
    mine = lambda: [PipelineStage(parts[s].to(device, dtype), s, n, device) for s in own]  # per M: they learn shapes
    pipes = {m: SCHEDULES[schedule](mine() if n > world_size else mine()[0], m, loss_fn=F.cross_entropy,
                                    scale_grads=scale_grads) for m in micro_counts}
    part, first, last = parts[rank], 0 in own, n - 1 in own  # part: what the stage timing below times

    def step(m, losses=None):
        net.zero_grad(set_to_none=True)
        args = (x.to(device, dtype),) if first else ()  # the first stage feeds the inputs
        pipes[m].step(*args, **(dict(target=y.to(device), losses=losses) if last else {}))  # the last: labels, loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the clock reads a finished step

    losses = []
    step(micro_counts[0], losses)  # the step whose gradients are checked
    grads = {k: p.grad.detach().cpu() for k, p in net.named_parameters() if p.grad is not None}  # ConvNet's names
    for m in micro_counts[1:]:
        step(m)  # each schedule's first step also works out the shapes sent between stages
    times = {m: [] for m in micro_counts}
    order = [m for r in range(rounds) for m in (micro_counts if r % 2 == 0 else micro_counts[::-1])]
    for m in order:  # alternating order: a drifting machine favours no M
        dist.barrier()  # both ranks start the step together
        start = time.perf_counter()
        step(m)
        times[m].append(time.perf_counter() - start)
    with torch.no_grad():
        inputs = (x if rank == 0 else layers[:split](x)).to(dtype)  # stage 1's input: stage 0's output (a CPU copy)
    own_s = stages.own_stage_seconds(rank, world_size, part, inputs, y if last else None, device, rounds) \
        if rounds and n == world_size else None
    order = {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                 if a is not None and a.computation_type.value in ("F", "B", "I", "W")]  # passes (no comms, idle)
             for r, acts in pipes[micro_counts[0]].pipeline_order.items()} if n > world_size else None
    return {"grads": grads, "losses": [t.item() for t in losses] if last else None, "times": times,
            "stage_seconds": own_s, "device": str(device), "order": order}


# Solution to exercise 4 (exported: tests reuse it)
def hybrid_steps(rank, world_size, dataset, steps, batch_size, lr, *, split=4, seed=0, dtype=torch.float32):
    """DDP over two-stage models. Introduced in notebooks/10-pipelines.ipynb."""
    # launch with init=False: the rank sets up its own groups. Returns parameters (ConvNet's names), losses, samples.
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
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 (no TF32)
        torch.manual_seed(seed)  # the same weights as the one-process reference's ConvNet
        model = TwoStage(ConvNet(batch_norm=False).to(dtype), split, devices)
        stage0, stage1 = (DDP(s, process_group=g) for s, g in zip((model.stage0, model.stage1), groups))
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = []
        for step, (xb, yb) in zip(range(steps), loader):
            opt.zero_grad(set_to_none=True)
            out = stage1(stage0(xb.to(devices[0], dtype)).to(devices[1]))  # TwoStage's forward, through the DDPs
            loss = F.cross_entropy(out, yb.to(devices[1]))  # labels on the output device
            loss.backward()  # each stage's DDP all-reduces its gradients in its own group, on its own device
            opt.step()
            losses.append(loss.item())
            report(step=step + 1, total=steps, loss=losses[-1])
        result = {"params": model.convnet_state(), "losses": losses, "devices": [str(d) for d in devices],
                  "indices": list(sampler)[: steps * batch_size], "plan": plan.sentence}
        dist.barrier()  # the world group: gloo
    finally:
        dist.destroy_process_group()  # every group this rank joined
    return result
# ---- end of export from notebooks/10-pipelines.ipynb ----
