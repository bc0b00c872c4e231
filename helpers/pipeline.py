"""Pipelines that run: the micro-batch schedule written out in one process, and what ranks run in notebook 05.

``pipeline_step`` is GPipe or 1F1B by hand on a ``TwoStage`` model: the
activation crossing the cut is detached and sent, and its gradient is sent
back, as ``torch.distributed.pipelining`` does between ranks. Everything with a
backward pass runs in launched ranks (``launch(fn, 1)`` for one process), so the
notebook itself never runs autograd before it forks GPU ranks.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from . import schedules
from ._rank import rank_device, report
from .bench import compare
from .checks import positive_int
from .ddp import shard_sampler
from .models import ConvNet, max_param_diff
from .stages import TwoStage, convnet_layers, plan_hybrid, plan_stages, stage_memory
from .train import full_fp32, sync, train_one_epoch


def pipeline_step(model: TwoStage, x, y, n_micro: int, kind: str = "gpipe", loss_fn=F.cross_entropy, clock=None):
    """One training step's forward and backward in ``n_micro`` micro-batches, in the order of ``kind``'s schedule.

    Each micro-batch's loss is weighted by its share of the batch, so the
    gradients are the whole batch's mean-loss gradients. ``clock`` (a list)
    receives a measured ``schedules.Slot`` per pass (devices synchronised: for
    drawing, not for timing). Returns the batch's mean loss.
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    positive_int("n_micro", n_micro)
    if n_micro > len(x):
        raise ValueError(f"{n_micro} micro-batches need at least {n_micro} samples, got {len(x)}")
    d0, d1 = model.devices
    xs, ys = x.chunk(n_micro), y.chunk(n_micro)
    n_micro = len(xs)  # chunk may make fewer when the batch does not divide
    held: dict = {}     # micro-batch -> what its backward needs: the activations in flight
    order = schedules.simulate(schedules.programs(kind, 2, n_micro))
    total = torch.zeros((), device=d1)
    t0 = time.perf_counter()
    for slot in order:
        start = time.perf_counter() - t0
        i = slot.mb
        if (slot.stage, slot.op) == (0, "F"):
            h = model.stage0(xs[i].to(d0))
            sent = h.detach().to(d1).requires_grad_(True)  # "send": the next stage gets a fresh leaf
            held[i] = [h, sent, None]
        elif (slot.stage, slot.op) == (1, "F"):
            out = model.stage1(held[i][1])
            held[i][2] = loss_fn(out, ys[i].to(d1)) * (len(ys[i]) / len(y))  # labels on the output device
            total += held[i][2].detach()
        elif (slot.stage, slot.op) == (1, "B"):
            held[i][2].backward()  # fills sent.grad: the gradient to send back
        else:
            h, sent, _ = held.pop(i)
            h.backward(sent.grad.to(d0))  # "receive" the gradient and finish this micro-batch
        if clock is not None:
            sync(d0), sync(d1)
            clock.append(schedules.Slot(slot.stage, slot.op, i, start, time.perf_counter() - t0))
    return total


def _models(split: int, seed: int, devices):
    """The unsplit reference on this rank's device and the same weights split over ``devices``."""
    torch.manual_seed(seed)
    ref = ConvNet(batch_norm=False).to(rank_device())
    return ref, TwoStage(copy.deepcopy(ref), split, devices)


def check_split(rank: int, world_size: int, x, y, split: int = 4, micro_counts=(1, 2, 4), seed: int = 0) -> dict:
    """In a launched rank: split vs unsplit forward and gradients, and every schedule's gradients, in full fp32.

    Also returns the unsplit model's gradients, the stage plan, per-stage memory (computed; measured per GPU
    where there are GPUs), and the error that labels on the wrong device give
    (None where both stages share a device, so it cannot happen).
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    plan = plan_stages(2)
    with full_fp32():
        ref, model = _models(split, seed, plan.devices)
        out_ref, out = ref(x.to(rank_device())), model(x)
        F.cross_entropy(out_ref, y.to(out_ref.device)).backward()
        F.cross_entropy(out, y.to(model.output_device)).backward()
        ref_grads = {k: p.grad.detach().cpu() for k, p in ref.named_parameters()}
        result = {"plan": plan.sentence, "kind": plan.kind, "devices": [str(d) for d in model.devices],
                  "output_device": str(out.device),
                  "forward_diff": (out_ref.detach().cpu() - out.detach().cpu()).abs().max().item(),
                  "grad_diff": max_param_diff(ref_grads, model.convnet_state(grads=True)), "schedules": {},
                  "reference_grads": ref_grads}
        for kind in schedules.KINDS:
            for m in micro_counts:
                model.zero_grad(set_to_none=True)
                pipeline_step(model, x, y, m, kind)
                result["schedules"][(kind, m)] = max_param_diff(ref_grads, model.convnet_state(grads=True))
        result["memory"] = stage_memory(model, x)
        result["measured_memory"] = _measured_memory(model, x)
        result["wrong_labels_error"] = _wrong_labels(model, x, y)
    return result


def _measured_memory(model: TwoStage, x) -> dict | None:
    """Bytes each GPU holds after a forward pass (activations kept for backward); None on the CPU."""
    gpus = sorted({d for d in model.devices if d.type == "cuda"}, key=str)
    if not gpus:
        return None
    for d in gpus:
        sync(d)
    before = {d: torch.cuda.memory_allocated(d) for d in gpus}
    out = model(x)
    after = {str(d): torch.cuda.memory_allocated(d) - before[d] for d in gpus}
    del out
    return after


def _wrong_labels(model: TwoStage, x, y) -> str | None:
    """The classic mistake: labels left on the first stage's device."""
    if model.devices[0] == model.devices[1]:
        return None
    try:
        F.cross_entropy(model(x), y.to(model.devices[0]))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "no error?"


def stage_seconds(model: TwoStage, x, y, rounds: int = 5) -> list[float]:
    """Each stage's forward+backward time on the whole batch (median of ``rounds``), devices synchronised.

    Introduced in notebooks/06-model-parallel.ipynb.
    """
    d0, d1 = model.devices
    h = model.stage0(x.to(d0)).detach().to(d1).requires_grad_(True)

    def s0():
        model.stage0(x.to(d0)).sum().backward()  # a stand-in gradient: same work as the real one
        sync(d0)

    def s1():
        F.cross_entropy(model.stage1(h), y.to(d1)).backward()
        sync(d1)

    times = compare({"s0": s0, "s1": s1}, device=d1, rounds=rounds)
    return [times["s0"]["median"], times["s1"]["median"]]


def sweep_micro_batches(rank: int, world_size: int, x, y, split: int = 4, micro_counts=(1, 2, 4, 8),
                        kind: str = "gpipe", rounds: int = 5, seed: int = 0, timeline_micro: int = 4) -> dict:
    """In a launched rank: the written-out schedule's step time per micro-batch count (median, min, max).

    Also the per-stage times (for ``schedules.predict_step``) and a measured
    timeline of one step with ``timeline_micro`` micro-batches.
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    model = _models(split, seed, plan_stages(2).devices)[1]
    d0, d1 = model.devices
    x, y = x.to(d0), y.to(d1)  # once: a copy from pageable CPU memory would stall the host every micro-batch

    def step(m):
        def run():
            model.zero_grad(set_to_none=True)
            pipeline_step(model, x, y, m, kind)
            sync(d0), sync(d1)
        return run

    times = compare({m: step(m) for m in micro_counts}, device=d1, rounds=rounds)
    clock: list = []
    pipeline_step(model, x, y, timeline_micro, kind, clock=clock)
    return {"times": times, "stage_seconds": stage_seconds(model, x, y, rounds), "timeline": clock,
            "plan": plan_stages(2).sentence}


def _pp_stage(rank, world_size, x, n_micro, split, seed, tracer, device):
    """This rank's PipelineStage: from TwoStage's halves, or cut by the tracer at the same place."""
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

    torch.manual_seed(seed)
    net = ConvNet(batch_norm=False)
    if not tracer:
        model = TwoStage(net, split)
        part = (model.stage0, model.stage1)[rank].to(device)
        return PipelineStage(part, rank, world_size, device), lambda k: model.convnet_name(f"stage{rank}.{k}")
    names = [n for n, _ in convnet_layers(net)]
    # the flatten is a call in ConvNet.forward, not a module: cut "before fc" for it
    spec = {"fc": SplitPoint.BEGINNING} if names[split - 1] == "flatten" else {names[split - 1]: SplitPoint.END}
    pipe = pipeline(net, (x.chunk(n_micro)[0],), split_spec=spec)
    return pipe.build_stage(rank, device), lambda k: k


def pp_rank(rank: int, world_size: int, x, y, n_micro: int = 4, split: int = 4, kind: str = "gpipe",
            tracer: bool = False, seed: int = 0, rounds: int = 0) -> dict:
    """One stage per rank with ``torch.distributed.pipelining``: gradients by ConvNet name, losses, step times.

    GPU ranks use their GPU over NCCL; otherwise the stages run on the CPU
    over gloo. ``scale_grads=True`` (the default) divides by the micro-batch
    count, which makes the gradients the mean over micro-batch losses.
    ``rounds`` > 0 times that many further steps (each after a barrier).
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    device = rank_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    with full_fp32():
        stage, name = _pp_stage(rank, world_size, x, n_micro, split, seed, tracer, device)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        schedule = cls(stage, n_micro, loss_fn=F.cross_entropy, scale_grads=True)
        last = rank == world_size - 1
        losses: list = []

        def step():
            stage.submod.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x.to(device))
            else:
                schedule.step(target=y.to(device), losses=losses)
            sync(device)

        step()
        grads = {name(k): p.grad.detach().cpu() for k, p in stage.submod.named_parameters()}
        first_losses = [l.item() for l in losses] if last else None
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return {"grads": grads, "losses": first_losses, "times": times, "device": str(device)}


def hybrid_steps(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, split: int = 4,
                 seed: int = 0) -> dict:
    """Model + data parallel: each DDP rank trains its own two-stage model (launch with ``init=False``).

    Devices and backend come from ``stages.plan_hybrid``; the process group is
    set up here, without binding one device, since a rank may own two GPUs.
    ``DDP(..., device_ids=None)``: the module spans devices. Full float32.
    Returns parameters (ConvNet names), losses and the samples this rank saw.
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    plan = plan_hybrid(world_size, 2)
    devices = plan.devices[rank]
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])
    dist.init_process_group(plan.backend, rank=rank, world_size=world_size)
    try:
        with full_fp32():
            torch.manual_seed(seed)  # the same weights as ddp.reference_rank's ConvNet
            model = TwoStage(ConvNet(batch_norm=False), split, devices)
            ddp = DDP(model, device_ids=None)
            sampler = shard_sampler(dataset, rank, world_size, seed)
            loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
            opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
            losses = []

            def on_step(step, loss):
                losses.append(loss.item())
                report(step=step, total=steps, loss=losses[-1])

            # the batch goes to the output device: its labels are needed there, and TwoStage moves x itself
            train_one_epoch(ddp, loader, opt, model.output_device, max_steps=steps, on_step=on_step)
            result = {"params": model.convnet_state(), "losses": losses, "devices": [str(d) for d in devices],
                      "indices": list(sampler)[: steps * batch_size], "plan": plan.sentence}
        # name the device: NCCL's barrier otherwise warns that it guesses one
        dist.barrier(**({"device_ids": [devices[0].index]} if plan.backend == "nccl" else {}))
    finally:
        dist.destroy_process_group()
    return result
