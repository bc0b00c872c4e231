"""Notebook 06's exact checks, rerun with perturbed rounding (tests/perturb.py): each must hold by construction.

Three checks compare two runs that must compute the same thing, in float64 to 1e-10 (the notebook argues the bound):
a resumed run's weights against the uninterrupted run's (section 2), gradient accumulation with and without
``no_sync`` against one process on the big batch (section 3), and SyncBatchNorm's statistics and parameters against
one process on the global batch (section 4; exercise 5 runs the same functions at another batch size).

The rank functions are the notebook's own: the imports, the parameters cell's assignments and every function the
notebook defines are executed from notebooks/06-ddp-habits.ipynb (not its launches), so a change there is tested
here. Sizes are smaller than the notebook's. The three checks of one rounding run together in one fresh Python
(``run_check``, where ``SMOKE_TEST=1`` keeps the data set small); the tests read its answer.
"""

import ast
import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
from perturb import ROUNDINGS, perturbed, run_check

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06-ddp-habits.ipynb"
QUIET = dict(quiet=True, progress=False)


def notebook_definitions(path=NOTEBOOK) -> dict:
    """The notebook's imports, its first code cell's assignments and its functions and classes, executed."""
    os.environ["SMOKE_TEST"] = "1"
    cells = [c for c in json.loads(Path(path).read_text())["cells"]
             if c["cell_type"] == "code" and "solution" not in c.get("metadata", {}).get("tags", [])]
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    body = []
    for i, cell in enumerate(cells):
        tree = ast.parse("".join(cell["source"]))
        body += [n for n in tree.body if isinstance(n, kept) or (i == 0 and isinstance(n, (ast.Assign, ast.Try)))]
    namespace = {"__name__": "notebook06"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def check(threads, ulps):
    """All three checks in one fresh Python: every rank function perturbed, the nudge on one side only."""
    nb = notebook_definitions()
    launch, train_set, lr, dtype, diff = nb["launch"], nb["train_set"], nb["LR"], nb["DTYPE"], nb["models"].max_param_diff
    out = {}

    # section 2: 2 epochs uninterrupted (nudged), against 1 epoch, a checkpoint and 1 resumed
    subset = nb["TensorDataset"](train_set.tensors[0][:256].to(dtype), train_set.tensors[1][:256])
    args, folder, fn = (subset, 2, 16, lr), Path(tempfile.mkdtemp(prefix="eq06-")), nb["train_epochs"]
    whole = launch(perturbed(fn, threads, ulps), 2, *args, folder / "whole.pt", **QUIET)
    launch(perturbed(functools.partial(fn, stop_after=1), threads, 0), 2, *args, folder / "cut.pt", **QUIET)
    resumed = launch(perturbed(functools.partial(fn, resume=True), threads, 0), 2, *args, folder / "cut.pt", **QUIET)
    out["resume"] = diff(whole[0]["params"], resumed[0]["params"])

    # section 3: k micro-batches with and without no_sync, against one process on the big batch (nudged)
    steps, k, micro = 3, 4, 16
    ways = [launch(perturbed(functools.partial(nb["accumulate_steps"], no_sync=no_sync), threads, 0), 2, train_set,
                   steps, k, micro, lr, **QUIET)[0] for no_sync in (True, False)]
    big = launch(perturbed(functools.partial(nb["ddp"].reference_rank, dtype=dtype), threads, ulps), 1, train_set,
                 steps, 2 * k * micro, lr, **QUIET)[0]
    out["accumulation"] = [diff(way["params"], big["params"]) for way in ways]

    # section 4: SyncBatchNorm's step-1 statistics and parameters after 3 steps, against one process (nudged)
    reference = perturbed(functools.partial(nb["ddp"].reference_rank, batch_norm=True, dtype=dtype), threads, ulps)
    synced = launch(perturbed(nb["bn_steps"], threads, 0), 2, train_set, steps, 16, lr, **QUIET)
    one = launch(reference, 1, train_set, 1, 2 * 16, lr, **QUIET)[0]
    ref = launch(reference, 1, train_set, steps, 2 * 16, lr, **QUIET)[0]
    out["sync_stats"], out["sync_gap"] = nb["bn_gaps"](synced, one, ref)
    return out


@functools.lru_cache(maxsize=None)
def checked(threads, ulps):
    out = run_check(__file__, "check", threads, ulps)
    print(f"06 with {threads} thread(s), {ulps} ulp: {out}")
    return out


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_a_resumed_run_repeats_the_uninterrupted_one(threads, ulps):
    assert checked(threads, ulps)["resume"] < 1e-10


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_accumulation_with_and_without_no_sync_is_one_big_batch(threads, ulps):
    assert max(checked(threads, ulps)["accumulation"]) < 1e-10


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_sync_batchnorm_is_batchnorm_on_the_global_batch(threads, ulps):
    out = checked(threads, ulps)
    assert out["sync_stats"] < 1e-10 and out["sync_gap"] < 1e-10
