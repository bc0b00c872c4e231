"""Rerun an equivalence check with its rounding perturbed: the course's rule that such a check holds by construction.

A check "X equals one process" passes by construction only if it still passes when nothing but rounding changes.
Two things change rounding without changing the mathematics:

- the number of torch threads per rank (a CPU kernel splits its reductions by thread, so 1 and 2 threads sum in
  different orders; 04's old float32 check was 7e-8 apart at two threads and 3.1e-4 at one on a Xeon with AMX);
- a one-ulp nudge of one side's initial weights (``torch.nextafter`` towards +inf on every floating parameter of
  the first module that runs a forward), which stands in for any CPU or GPU whose kernels round differently.

A float32 trajectory through ReLU/MaxPool kinks can amplify either into 1e-4 (a kink within rounding of a weight
sends one side's gradient down the other branch). In float64 the same nudge stays ~1e-15 and a check at 1e-10
cannot pass or fail by luck.

How a test uses it (see tests/test_equivalence_04.py)::

    def check(threads, ulps):                 # runs in a fresh Python, see run_check
        ref = launch(perturbed(reference_rank, threads, ulps), 1, ...)
        out = launch(perturbed(ddp_steps, threads, 0), 2, ...)
        return {"diff": models.max_param_diff(...)}

    @pytest.mark.parametrize("threads,ulps", ROUNDINGS)
    def test_ddp_is_one_big_batch(threads, ulps):
        assert run_check(__file__, "check", threads, ulps)["diff"] < 1e-10

Why a fresh Python: a process forked after its parent used torch's (GNU OpenMP) thread pool hangs the first time
it uses more than one thread (measured here with torch 2.15: a child's 2-thread matmul never returns). pytest's own
process has used that pool in other tests, so ``run_check`` starts a new interpreter that sets one thread before
any torch work; its forked ranks may then take two.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (torch threads per rank, ulps of the nudge on one side): the notebook's own setting, another summation order,
# and one side's initial weights one ulp off. The two perturbed runs carry the `perturbed` mark: `make test` runs
# them on the newest torch; `make test-oldest` deselects them (-m "not perturbed") and keeps each check's plain run:
# the perturbations show that a bound cannot pass by luck, which one torch shows; the oldest one needs the check to hold.
ROUNDINGS = [
    pytest.param(1, 0, id="1-thread"),
    pytest.param(2, 0, id="2-threads", marks=pytest.mark.perturbed),
    pytest.param(1, 1, id="1-thread-nudged", marks=pytest.mark.perturbed),
]

_RESULT = "PERTURB-RESULT "


def nudge_(module, ulps: int = 1) -> None:
    """Move every floating parameter of ``module`` ``ulps`` ulps towards +inf, in place (DTensors: their shard)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not local.is_floating_point():
                continue
            up = torch.full_like(local, math.inf)
            for _ in range(ulps):
                local.copy_(torch.nextafter(local, up))


@contextlib.contextmanager
def nudge_first_forward(ulps: int = 1):
    """Within this block, the first module to run a forward has its parameters nudged ``ulps`` ulps first.

    The first module called is the outermost one of that side (the wrapper's pre-hook runs before its children's), so
    a comparison computed in one process perturbs one side only: the one whose forward runs first.
    """
    import torch

    handle = None

    def hook(module, args):
        handle.remove()
        nudge_(module, ulps)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def perturbed(fn, threads: int = 1, ulps: int = 0):
    """``fn`` as a rank function that runs with ``threads`` torch threads and, if ``ulps``, nudged weights."""

    @functools.wraps(fn)
    def rank_fn(*args, **kwargs):
        import torch

        torch.set_num_threads(threads)  # launch set 1; safe here because run_check's parent never used the pool
        with nudge_first_forward(ulps) if ulps else contextlib.nullcontext():
            return fn(*args, **kwargs)

    return rank_fn


def run_check(test_file: str, name: str, threads: int, ulps: int, timeout: float = 600) -> dict:
    """``name(threads, ulps)`` from ``test_file``, run in a fresh Python whose own torch uses one thread; its dict."""
    code = (
        "import torch, json, sys, importlib.util\n"
        "torch.set_num_threads(1)\n"  # before any torch work: the forked ranks may then use more threads
        f"sys.path[:0] = [{str(Path(test_file).parent)!r}, {str(Path(test_file).parent.parent)!r}]\n"
        f"spec = importlib.util.spec_from_file_location('check_module', {test_file!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"out = mod.{name}({threads}, {ulps})\n"
        f"print({_RESULT!r} + json.dumps(out), flush=True)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{name}({threads}, {ulps}) failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(_RESULT):])
