"""Gradient accumulation under DDP, with the all-reduces counted.

k micro-batches per optimizer step give the gradient of one k-times larger
batch. DDP all-reduces after every ``backward()``, so k micro-steps cost k
all-reduces, unless the first k−1 run inside ``ddp.no_sync()``: then the
gradients pile up locally and the k-th backward all-reduces the sum once. A
DDP *communication hook* (a function DDP calls for each gradient bucket
instead of its own all-reduce) counts them here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ._rank import rank_device
from .checks import positive_int, positive_number
from .ddp import shard_sampler
from .models import ConvNet
from .train import full_fp32


class AllReduceCounter:
    """A DDP comm hook that counts the bucket all-reduces, then does the default all-reduce.

    Register with ``ddp.register_comm_hook(counter, AllReduceCounter.hook)``.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """

    def __init__(self):
        self.count = 0

    @staticmethod
    def hook(state: "AllReduceCounter", bucket):
        """Count one bucket, then all-reduce (average) it as DDP would have."""
        state.count += 1
        return allreduce_hook(None, bucket)


def accumulate_steps(rank: int, world_size: int, dataset, steps: int, k: int, micro_batch: int, lr: float, *,
                     no_sync: bool = True, seed: int = 0) -> dict:
    """``steps`` optimizer steps, each over ``k`` micro-batches of ``micro_batch`` per rank. Full float32.

    Each micro-batch's loss is divided by ``k``, so the summed gradient is the
    mean over the k·micro_batch samples. With ``no_sync`` the first k−1
    backward passes skip the all-reduce. Returns the final parameters and the
    all-reduces counted per optimizer step. The same as one process with
    batch W·k·micro_batch (``ddp.reference_rank``), step for step.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("k", k)
    positive_int("steps", steps)
    positive_number("lr", lr)
    device = rank_device()
    with full_fp32():
        torch.manual_seed(seed)  # the same start as the one-process reference
        model = ConvNet(batch_norm=False).to(device)
        ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        counter = AllReduceCounter()
        ddp.register_comm_hook(counter, AllReduceCounter.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        loader = DataLoader(dataset, batch_size=micro_batch, sampler=shard_sampler(dataset, rank, world_size, seed),
                            drop_last=True)
        if steps * k > len(loader):
            raise ValueError(f"{steps} steps of {k} micro-batches need {steps * k} batches; "
                             f"one epoch has {len(loader)}")
        batches = iter(loader)
        per_step = []
        for _ in range(steps):
            before = counter.count
            opt.zero_grad(set_to_none=True)
            for i in range(k):
                x, y = (t.to(device) for t in next(batches))
                quiet = ddp.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext()
                with quiet:  # no all-reduce in here: gradients add up in .grad
                    (F.cross_entropy(ddp(x), y) / k).backward()
            opt.step()
            per_step.append(counter.count - before)
    return {"params": {n: v.detach() for n, v in model.state_dict().items()}, "allreduces_per_step": per_step}
