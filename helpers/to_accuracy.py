"""Time to accuracy: what DDP is for. Train until the test accuracy reaches a target, and clock it.

Samples per second flatter DDP (each rank adds its throughput); what a user
waits for is the *time to a given accuracy*. More ranks take bigger global
steps, which may need more samples to get there. ``race`` runs the same
recipe on 1 or W ranks and records test accuracy against training seconds and
samples seen.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .ddp import shard_sampler
from .models import ConvNet
from .scaling import warmup
from .train import evaluate, sync


def _test_accuracy(net, test_loader, device, world_size) -> float:
    """Each rank scores its slice of the test set; the counts are summed over ranks."""
    stats = evaluate(net, test_loader, device)
    counts = torch.tensor([round(stats.accuracy * stats.samples), stats.samples], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def race(rank: int, world_size: int, train_set, test_set, target: float, batch_size: int, lr: float, *,
         max_epochs: int = 5, eval_every: int = 6000, warmup_steps: int = 0, seed: int = 0) -> dict:
    """Train a ConvNet (DDP when W > 1) until test accuracy >= ``target``; the accuracy curve and when.

    Evaluates every ``eval_every`` global samples (the clock stops while it
    evaluates). Returns ``curve`` as (samples seen, training seconds, wall
    seconds, accuracy) rows, and ``reached`` (the first row at the target, or
    None). One rank runs the plain model, as notebook 01 does.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("max_epochs", max_epochs)
    positive_number("lr", lr)
    if not 0 < target <= 1:
        raise ValueError(f"target is an accuracy in (0, 1], got {target}")
    device = rank_device()
    torch.manual_seed(seed)
    model = ConvNet().to(device)
    net = DDP(model, device_ids=[device] if device.type == "cuda" else None) if world_size > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    sched = warmup(opt, warmup_steps)
    sampler = shard_sampler(train_set, rank, world_size, seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000)
    every = max(1, eval_every // (world_size * batch_size))  # steps between evaluations
    curve, samples, train_s, step = [], 0, 0.0, 0
    start = time.perf_counter()
    for epoch in range(max_epochs):
        sampler.set_epoch(epoch)
        net.train()
        sync(device)
        t0 = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step, samples = step + 1, samples + world_size * batch_size
            if step % every == 0 or step == max_epochs * len(loader):
                sync(device)
                train_s += time.perf_counter() - t0
                acc = _test_accuracy(net, test_loader, device, world_size)
                curve.append((samples, train_s, time.perf_counter() - start, acc))
                report(step=step, total=max_epochs * len(loader), loss=loss.item(), accuracy=acc)
                if acc >= target:
                    return {"curve": curve, "reached": curve[-1], "target": target, "world_size": world_size}
                net.train()
                t0 = time.perf_counter()
        sync(device)
        train_s += time.perf_counter() - t0
    return {"curve": curve, "reached": None, "target": target, "world_size": world_size}
