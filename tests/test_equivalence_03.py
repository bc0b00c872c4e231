"""Notebook 03's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

03 asserts that the ring all-reduce (``helpers.collectives.ring_all_reduce``, exported from the notebook) and
reduce-scatter + all-gather equal ``dist.all_reduce`` exactly on integer-valued floats (every order of adding is
exact below 2**24), and that on random floats, rank r's 10**r times larger, they differ by no more than
(W - 1)·ε·W·max|x|, the max taken over every rank's inputs. ``ring_check`` is taken from the notebook's own cell, so
this runs the notebook's code. The ranks run with 1 or 2 torch threads; the one-ulp nudge of ``perturb`` acts on a
module's forward, and this check runs none, so the nudged rounding changes nothing here (kept for the common table).
"""

import ast
import json
from pathlib import Path

import pytest
from perturb import ROUNDINGS, perturbed, run_check

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "03-collectives.ipynb"


def notebook_functions(names, namespace):
    """The notebook's definitions of ``names`` (only the ``def`` statements of its code cells), run in namespace."""
    cells = [ast.parse("".join(c["source"])) for c in json.loads(NOTEBOOK.read_text())["cells"]
             if c["cell_type"] == "code" and not "".join(c["source"]).startswith("#| export")]
    defs = [node for tree in cells for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(d.name for d in defs) == sorted(names), "the notebook no longer defines these functions"
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(NOTEBOOK), "exec"), namespace)
    return namespace


def check(threads, ulps, world_size=4, numel=400):
    """03's ring check on ``world_size`` CPU ranks: whether each rank's asserts hold, and the gaps and bounds."""
    import torch
    import torch.distributed as dist

    from helpers.collectives import ring_all_reduce
    from helpers.launch import launch, rank_device

    ns = notebook_functions(["ring_check"], dict(torch=torch, dist=dist, rank_device=rank_device,
                                                 ring_all_reduce=ring_all_reduce))
    results = launch(perturbed(ns["ring_check"], threads, ulps), world_size, numel, quiet=True, progress=False)
    return {"exact": [torch.equal(c["ring"], c["all_reduce"]) and torch.equal(c["rs+ag"], c["all_reduce"])
                      for c in results],
            "gap": [c["noisy_gap"].item() for c in results], "bound": [c["bound"].item() for c in results]}


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_ring_all_reduce_equals_all_reduce(threads, ulps):
    out = run_check(__file__, "check", threads, ulps)
    print(out)
    assert all(out["exact"])
    assert all(gap <= bound for gap, bound in zip(out["gap"], out["bound"]))
    assert len(set(out["bound"])) == 1  # the bound is the same on every rank: the max over all ranks' inputs
