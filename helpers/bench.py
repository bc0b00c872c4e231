"""Honest timing: warm up first, synchronise before reading the clock, report medians."""

from __future__ import annotations

import statistics
import time

from .train import sync


def time_it(fn, *, device="cpu", warmup: int = 1, repeats: int = 5) -> dict:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns median, min and all seconds; the device is synchronised around
    each timed call so queued GPU work is counted.
    Introduced in notebooks/01-single-gpu.ipynb.
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


def ratio(a: float, b: float) -> float:
    """a / b, guarded: the factor by which ``a`` beats ``b`` for rates.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if b <= 0:
        raise ValueError(f"cannot divide by {b}")
    return a / b
