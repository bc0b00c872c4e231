"""Notebook 02's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

02 asserts that DataParallel's gradient (its four steps written out, as the notebook runs them without two GPUs)
equals one device's gradient on the whole batch: in float64, to 1e-10, one replica or several, devices in either
order. With BatchNorm the two must differ by far more than rounding. The functions are taken from the notebook's own
cells (``replicate`` … ``data_parallel_step``, ``single_device_grads``, ``dp_grads``), so this runs the notebook's
code, not a copy of it. No ranks are forked: the gradients are computed in the fresh Python that ``run_check``
starts, with 1 or 2 torch threads, and with the single-device side's weights one ulp off (its forward runs first).
"""

import ast
import contextlib
import json
from pathlib import Path

import pytest
from perturb import ROUNDINGS, nudge_first_forward, run_check

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "02-data-parallel.ipynb"
FUNCTIONS = ("replicate", "scatter", "parallel_apply", "gather", "data_parallel_step", "single_device_grads", "dp_grads")


def notebook_functions(names, namespace):
    """The notebook's definitions of ``names`` (only the ``def`` statements of its code cells), run in namespace."""
    cells = [ast.parse("".join(c["source"])) for c in json.loads(NOTEBOOK.read_text())["cells"]
             if c["cell_type"] == "code"]
    defs = [node for tree in cells for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(d.name for d in defs) == sorted(names), "the notebook no longer defines these functions"
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(NOTEBOOK), "exec"), namespace)
    return namespace


def check(threads, ulps):
    """02's checks at batch 64 on the CPU: the float64 differences the notebook asserts on."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    from helpers import data, models

    torch.set_num_threads(threads)  # nothing is forked after this: the gradients are computed in this process
    cpu = torch.device("cpu")
    train_set, _ = data.get_datasets("fashion", smoke=True)
    ns = notebook_functions(FUNCTIONS, dict(copy=copy, torch=torch, F=F, nn=nn, main=cpu,
                                            x=train_set.tensors[0][:64], y=train_set.tensors[1][:64]))
    nudged = nudge_first_forward(ulps) if ulps else contextlib.nullcontext()
    torch.manual_seed(0)
    plain64 = models.ConvNet(batch_norm=False).to(torch.float64)
    with nudged:  # the single-device side runs the first forward: its weights are the nudged ones
        reference = ns["single_device_grads"](plain64, cpu)
    grads = ns["dp_grads"](plain64, [cpu, cpu])
    out = {"diff": models.max_param_diff(grads, reference),
           "diff4": models.max_param_diff(ns["dp_grads"](plain64, [cpu] * 4), reference)}
    torch.manual_seed(0)
    with_bn = models.ConvNet(batch_norm=True).to(torch.float64)
    with nudge_first_forward(ulps) if ulps else contextlib.nullcontext():
        bn_reference = ns["single_device_grads"](with_bn, cpu)
    out["bn_diff1"] = models.max_param_diff(ns["dp_grads"](with_bn, [cpu]), bn_reference)
    out["bn_diff"] = models.max_param_diff(ns["dp_grads"](with_bn, [cpu, cpu]), bn_reference)
    return out


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_data_parallel_gradient_is_the_whole_batch_gradient(threads, ulps):
    out = run_check(__file__, "check", threads, ulps)
    print(out)
    assert out["diff"] < 1e-10 and out["diff4"] < 1e-10  # cell "Checked" (and exercise 3), four replicas
    assert out["bn_diff1"] < 1e-10  # exercise 2: one replica sees the whole batch
    assert out["bn_diff"] > 100 * max(out["diff"], 1e-8)  # with BatchNorm they must differ, by far more than rounding
