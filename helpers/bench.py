"""Honest timing: warm up first, synchronise before reading the clock, report medians."""

from __future__ import annotations

import statistics
import time

from .train import sync


def time_it(fn, *, device="cpu", warmup: int = 1, repeats: int = 5) -> dict:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns median, min and all seconds; the device (or each device of a list)
    is synchronised around each timed call so queued GPU work is counted.
    Machinery behind bench.compare; no notebook calls it directly.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "all": times}


def alternating(names: list, rounds: int):
    """``names`` once per round, in reversed order every other round: the order honest comparisons run in.

    Introduced in notebooks/02-data-parallel.ipynb.
    """
    for r in range(rounds):
        yield from (names if r % 2 == 0 else names[::-1])


def compare(fns: dict, *, device="cpu", warmup: int = 1, rounds: int = 5) -> dict:
    """Time several ``fn()`` alternately: each round runs all of them, in reversed order every other round.

    Alternating keeps a drifting machine (turbo, caches, a neighbour's job)
    from always favouring whichever runs first. Returns, per name, the median,
    min, max and all seconds, one per round. ``device`` may be a list: every
    device a step uses is synchronised before the clock is read.
    Introduced in notebooks/02-data-parallel.ipynb.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in names}
    for name in alternating(names, rounds):
        times[name].append(time_it(fns[name], device=device, warmup=0, repeats=1)["median"])
    return {name: {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "all": ts}
            for name, ts in times.items()}


def ratio(a: float, b: float) -> float:
    """a / b, guarded: the factor by which ``a`` beats ``b`` for rates.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if b <= 0:
        raise ValueError(f"cannot divide by {b}")
    return a / b
