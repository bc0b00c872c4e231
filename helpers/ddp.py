"""DDP training functions that ranks run, and the one-process reference they must match.

``ddp_steps`` is what each rank runs under ``launch`` (or torchrun): it reads
its rank and device from the process group, shards the data with
DistributedSampler, wraps the model in DDP and trains with the same
``train_one_epoch`` as notebook 01.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import contextlib

from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .data import DeviceLoader
from .models import ConvNet
from .train import full_fp32, train_one_epoch


def shard_sampler(dataset, rank: int, world_size: int, seed: int = 0) -> DistributedSampler:
    """Rank ``rank``'s disjoint share of a seeded shuffle (drop_last: equal shares).

    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)


def _check_steps(n: int, world_size: int, batch_size: int, steps: int, lr: float) -> None:
    positive_int("steps", steps)
    positive_int("batch_size", batch_size)
    positive_number("lr", lr)
    if steps > n // (world_size * batch_size):
        raise ValueError(f"{steps} steps of {world_size}x{batch_size} need more than one epoch of {n} samples; "
                         "use fewer steps or a smaller batch")


def _precision(tf32: bool):
    """Full float32 unless TF32 is asked for (it only changes anything on Ampere and later GPUs)."""
    return contextlib.nullcontext() if tf32 else full_fp32()


def ddp_steps(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, *,
              batch_norm: bool = False, seed: int = 0, warmup: int = 0, tf32: bool = False) -> dict:
    """Train a DDP ConvNet for ``steps`` steps of ``batch_size`` per rank, from seed ``seed``.

    Returns the final parameters, the per-step losses, the sample indices this
    rank trained on, and samples/s over the steps after ``warmup`` untimed ones.
    Reports step/total/loss to the notebook after each timed step. Runs in
    full float32 (TF32 off) unless ``tf32``, so that it can be compared with
    the one-process reference to float32 precision on any GPU.
    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    assert dist.get_world_size() == world_size and dist.get_rank() == rank
    _check_steps(len(dataset), world_size, batch_size, steps, lr)
    with _precision(tf32):
        return _train_ddp(rank, world_size, dataset, steps, batch_size, lr, batch_norm, seed, warmup)


def _train_ddp(rank, world_size, dataset, steps, batch_size, lr, batch_norm, seed, warmup) -> dict:
    device = rank_device()
    torch.manual_seed(seed)  # every rank builds the same model; DDP also broadcasts rank 0's weights
    model = ConvNet(batch_norm=batch_norm).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    sampler = shard_sampler(dataset, rank, world_size, seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    if warmup:
        train_one_epoch(ddp, loader, opt, device, max_steps=warmup)
    losses = []

    def on_step(step, loss):
        losses.append(loss.item())
        report(step=step, total=steps, loss=losses[-1])

    stats = train_one_epoch(ddp, loader, opt, device, max_steps=steps, on_step=on_step)
    return {"params": {k: v.detach() for k, v in model.state_dict().items()}, "losses": losses,
            "indices": list(sampler)[: steps * batch_size], "samples_per_s": stats.samples_per_s}


def one_process_steps(dataset, steps: int, batch_size: int, lr: float, device="cpu", *,
                      batch_norm: bool = False, seed: int = 0, tf32: bool = False) -> dict:
    """The reference: one process, batch ``batch_size``, the same seeded shuffle as ``ddp_steps``.

    With batch W·b, its step k sees exactly the union of the W ranks' step-k
    batches (DistributedSampler deals the shuffle out round-robin). Full
    float32 unless ``tf32``. In a notebook that forks GPU ranks, run it inside
    a launched child (``reference_rank``): a backward pass in the notebook's
    own process leaves later forks unable to start CUDA.
    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    _check_steps(len(dataset), 1, batch_size, steps, lr)
    with _precision(tf32):
        return _train_one(dataset, steps, batch_size, lr, device, batch_norm, seed)


def reference_rank(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, **kw) -> dict:
    """``one_process_steps`` as a launched rank: ``launch(reference_rank, 1, ...)`` keeps the notebook fork-safe.

    It runs on the device the plan gives one rank (the first GPU, or the CPU).
    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    if world_size != 1:
        raise ValueError(f"the reference is one process: launch it with world_size=1, not {world_size}")
    return one_process_steps(dataset, steps, batch_size, lr, rank_device(), **kw)


def _train_one(dataset, steps, batch_size, lr, device, batch_norm, seed) -> dict:
    torch.manual_seed(seed)
    model = ConvNet(batch_norm=batch_norm).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    loader = DeviceLoader(dataset, batch_size, device, shuffle=True, seed=seed)
    stats = train_one_epoch(model, loader, opt, device, max_steps=steps,
                            on_step=lambda step, loss: losses.append(loss.item()))
    return {"params": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "losses": losses,
            "samples_per_s": stats.samples_per_s}
