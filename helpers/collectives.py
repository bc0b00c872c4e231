"""Collectives by hand and their cost: a ring all-reduce from isend/recv, timings, the α–β fit, nccl-tests' bandwidths.

The functions are written in notebooks/03-collectives.ipynb, where a learner reads and changes them; the region
below is exported from there (``make export``). Later notebooks and the tests import them from here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._rank import rank_device
from .train import sync


# ---- exported from notebooks/03-collectives.ipynb: edit it there, then run `make export` ----
def ring_all_reduce(t):
    """Sum ``t`` over all ranks in place, as dist.all_reduce does: a ring of batched isend/irecv, 2(W - 1) steps.

    Introduced in notebooks/03-collectives.ipynb.
    """
    W, r = dist.get_world_size(), dist.get_rank()
    chunks = t.tensor_split(W)  # views: writing a chunk writes t

    def exchange(send, recv):  # posted together, so that no rank's send waits for a receive not yet posted
        ops = [dist.P2POp(dist.isend, send, (r + 1) % W), dist.P2POp(dist.irecv, recv, (r - 1) % W)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    for step in range(W - 1):  # reduce-scatter: afterwards chunk (r + 1) % W holds the sum over all ranks
        send, recv = chunks[(r - step) % W], chunks[(r - step - 1) % W]
        incoming = torch.empty_like(recv)
        exchange(send, incoming)
        recv += incoming
    for step in range(W - 1):  # all-gather: pass the finished chunks on, so every rank ends with all of them
        exchange(chunks[(r + 1 - step) % W], chunks[(r - step) % W])
    return t


def time_collectives(rank, world_size, sizes, repeats, bytes_per_size):
    """Each op's fastest call per size in seconds, {op: {size: s}}, on this rank: run it under launch.

    Introduced in notebooks/03-collectives.ipynb.
    """
    device = rank_device()
    fastest = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
    for size in sizes:
        full = torch.zeros(size // 4, device=device)  # n bytes of float32; zeros stay zeros however often summed
        shard = torch.zeros(size // 4 // world_size, device=device)  # this rank's 1/W of it
        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
        for op, call in calls.items():
            for _ in range(3):
                call()  # warm-up: buffers allocated, connections made
            seconds = []
            for _ in range(max(5, min(repeats, bytes_per_size // size))):
                dist.barrier()
                sync(device)
                start = time.perf_counter()
                call()
                sync(device)
                seconds.append(time.perf_counter() - start)
            fastest[op][size] = min(seconds)
    return fastest


BUS_FACTOR = {"all_reduce": lambda W: 2 * (W - 1) / W, "all_gather": lambda W: (W - 1) / W,
              "reduce_scatter": lambda W: (W - 1) / W, "all_to_all": lambda W: (W - 1) / W,
              "broadcast": lambda W: 1.0}  # nccl-tests, doc/PERFORMANCE.md


def fit_alpha_beta(sizes, seconds):
    """(α in s, β in s/byte) of T(n) = α + nβ with the least sum of |log T - log fitted|, searched on a grid.

    Introduced in notebooks/03-collectives.ipynb.
    """
    n = torch.as_tensor(sizes, dtype=torch.float64)
    t = torch.as_tensor(seconds, dtype=torch.float64)
    alphas = torch.logspace(-8, -1, 701, dtype=torch.float64)   # 10 ns … 100 ms, 2.3 % apart
    betas = torch.logspace(-13, -6, 701, dtype=torch.float64)   # 10 TB/s … 1 MB/s
    misfit = torch.zeros(len(alphas), len(betas), dtype=torch.float64)
    for size, time in zip(n, t):  # one size at a time: a 701 x 701 table, not one per size at once
        misfit += (torch.log(alphas[:, None] + betas[None, :] * size) - time.log()).abs()
    i, j = divmod(misfit.argmin().item(), len(betas))
    return alphas[i].item(), betas[j].item()


def bus_bandwidth(op, size, seconds, world_size):
    """(algbw, busbw) in bytes/s of one collective on ``size`` bytes, as nccl-tests defines them.

    Introduced in notebooks/03-collectives.ipynb.
    """
    algbw = size / seconds
    return algbw, algbw * BUS_FACTOR[op](world_size)
# ---- end of export from notebooks/03-collectives.ipynb ----
