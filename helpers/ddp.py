"""What DDP ranks run (``ddp_steps``) and the one-process reference they must match (``reference_rank``).

The functions are written in notebooks/04-ddp.ipynb, where a learner reads and changes them; the region
below is exported from there (``make export``). Later notebooks, ``scripts/`` and the tests import them from
here. Above the region: machinery only (the argument checks, the clock around the timed steps, the drawing of a
profiled step for notebooks/07-ddp-internals.ipynb).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from . import models
from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .train import sync


def check_steps(dataset, world_size: int, batch_size: int, steps: int, lr: float) -> None:
    """Refuse bad counts and rates by name, and a dataset too small to give each rank one batch.

    Introduced in notebooks/04-ddp.ipynb.
    """
    positive_int("steps", steps)
    positive_int("batch_size", batch_size)
    positive_number("lr", lr)
    if len(dataset) // world_size < batch_size:
        raise ValueError(f"{len(dataset)} samples cannot give {world_size} rank(s) a batch of {batch_size} each; "
                         "use a smaller batch")


class Clock:
    """Seconds of the work done inside a ``with`` block, the device synchronised at both ends: ``clock.seconds``.

    Queued GPU work counts: the clock starts once earlier work is done and stops once the block's work is.
    Introduced in notebooks/04-ddp.ipynb.
    """

    def __init__(self, device):
        self.device, self.seconds = device, 0.0

    def __enter__(self):
        sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self._start
        return False


STEP_COLORS = {"forward": "#bbbbbb", "backward": "#6b9bd8", "all-reduce": "#e8923a", "step": "#5aa55a"}


def plot_step_timeline(timelines: dict, title: str = "bucket_cap_mb={}: {} bucket(s)"):
    """Draw profiled DDP steps side by side: per rank, a compute row and a communication row.

    ``timelines`` maps a label (a ``bucket_cap_mb``) to every rank's spans ``(lane, start_ms, end_ms)``, lanes
    named as in ``STEP_COLORS``; a ``"call"`` span (a rank asking for an all-reduce) counts a bucket and is not
    drawn. Returns the figure.
    Introduced in notebooks/07-ddp-internals.ipynb.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(6 * len(timelines), 2.8), sharey=True, squeeze=False)
    world_size = len(next(iter(timelines.values())))
    for ax, (label, ranks) in zip(axes[0], timelines.items()):
        t0 = min(s for spans in ranks for _, s, _ in spans)
        for rank, spans in enumerate(ranks):
            for lane, s, e in spans:
                if lane in STEP_COLORS:
                    row = 2 * rank + (lane != "all-reduce")
                    ax.broken_barh([(s - t0, e - s)], (row - 0.35, 0.7), color=STEP_COLORS[lane])
        ax.set_title(title.format(label, sum(lane == "call" for lane, *_ in ranks[0])))
        ax.set_xlabel("ms since the step began")
    axes[0][0].set_yticks(range(2 * world_size),
                          [f"rank {r} {lane}" for r in range(world_size) for lane in ("comm", "compute")])
    axes[0][-1].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in STEP_COLORS.values()],
                       labels=list(STEP_COLORS), loc="upper left", bbox_to_anchor=(1, 1))
    return fig


# ---- exported from notebooks/04-ddp.ipynb: edit it there, then run `make export` ----
def shard_sampler(dataset, rank: int, world_size: int, seed: int = 0) -> DistributedSampler:
    """Rank ``rank``'s share of a seeded shuffle.

    Introduced in notebooks/04-ddp.ipynb.
    """
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)


def batches(sampler, loader):
    """Batches epoch after epoch, each shuffled anew.

    Introduced in notebooks/04-ddp.ipynb.
    """
    for epoch in itertools.count():
        sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
        yield from loader


def train_steps(model, optimizer, stream, device, steps: int, *, live: bool = False) -> list:
    """``steps`` steps on the next batches of ``stream``: the losses, still on the device.

    Introduced in notebooks/04-ddp.ipynb.
    """
    losses, dtype = [], next(model.parameters()).dtype  # float64 for section 4's check
    for _, (x, y) in zip(range(steps), stream):
        x, y = x.to(device, dtype), y.to(device)  # the images come as float32
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # under DDP, the gradients are averaged across ranks in here
        optimizer.step()
        losses.append(loss.detach())
        if live:
            report(step=len(losses), total=steps, loss=loss)  # reads the loss: this step waits for the device
    return losses


def ddp_steps(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, *,
              batch_norm: bool = False, seed: int = 0, warmup: int = 0, tf32: bool = False,
              live: bool = False, dtype=torch.float32, wrap: bool = True) -> dict:
    """A DDP ConvNet in ``dtype``, trained ``steps`` steps of ``batch_size`` per rank (``wrap=False``: no DDP).

    Introduced in notebooks/04-ddp.ipynb.
    """
    check_steps(dataset, world_size, batch_size, steps, lr)
    device = rank_device()  # launch has joined the process group and bound this rank to its device
    if not tf32:  # float32 as float32 on GPUs too (notebook 02); this rank's process only
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(seed)  # the same initial model on every rank
    model = models.ConvNet(batch_norm=batch_norm).to(device, dtype)
    ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None) if wrap else model
    sampler = shard_sampler(dataset, rank, world_size, seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)
    stream = batches(sampler, loader)
    train_steps(ddp_model, optimizer, stream, device, warmup)  # untimed
    with Clock(device) as clock:
        losses = train_steps(ddp_model, optimizer, stream, device, steps, live=live)
    return {"params": {k: v.detach() for k, v in model.state_dict().items()},
            "losses": torch.stack(losses).tolist(), "samples_per_s": steps * batch_size / clock.seconds}


def reference_rank(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, **options) -> dict:
    """One process, no DDP, the same shuffle: what DDP must match (``options``: those of ``ddp_steps``).

    Introduced in notebooks/04-ddp.ipynb.
    """
    if world_size != 1:
        raise ValueError(f"launch it with world_size=1, not {world_size}")
    return ddp_steps(rank, 1, dataset, steps, batch_size, lr, wrap=False, **options)  # a world of one: the whole shuffle
# ---- end of export from notebooks/04-ddp.ipynb ----
