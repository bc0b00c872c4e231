"""Notebook 14's equivalence check under perturbed rounding: scripts/train_ddp.py under torchrun equals launch.

Section 2 asserts that the script's float64 run (torchrun, 2 workers) and ``launch(ddp.ddp_steps, 2, ...,
dtype=torch.float64)`` end < 1e-10 apart. Here the script runs once, as the notebook runs it (one thread per
worker), and the launched side is rerun with 1 and 2 threads per rank and with its initial weights nudged one ulp
(tests/perturb.py): float64 keeps each within ~1e-15, so 1e-10 holds by construction, not by luck.

(Sections 3 and 4 compare the same computation started another way, two nodes or a restart: bit-identical on the
CPU because nothing in the arithmetic changes; tests/test_train_ddp.py and tests/test_restart_two_nodes.py.)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from helpers import torchrun
from perturb import ROUNDINGS, perturbed, run_check

STEPS, BATCH, LR = 10, 32, 0.05
TOLERANCE = 1e-10  # notebook 14, section 2


def check(threads: int, ulps: int) -> dict:
    """Runs in a fresh Python (run_check): the launched side, perturbed, against the script's checkpoint."""
    from helpers import data, ddp, models
    from helpers.launch import launch

    train_set, _ = data.get_datasets("fashion", smoke=True)
    rank_fn = functools.partial(perturbed(ddp.ddp_steps, threads, ulps), dtype=torch.float64)  # as the notebook's
    launched = launch(rank_fn, 2, train_set, STEPS, BATCH, LR, quiet=True, progress=False)
    script = torch.load(os.environ["EQUIVALENCE_13_CHECKPOINT"], map_location="cpu", weights_only=True)["model"]
    return {"diff": models.max_param_diff(launched[0]["params"], script)}


@pytest.fixture(scope="module")
def script_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eq13") / "script.pt"
    args = ["--smoke", "--steps", STEPS, "--batch-size", BATCH, "--lr", LR, "--dtype", "float64", "--checkpoint", path]
    torchrun.run({"node": torchrun.torchrun_command(args, nproc=2)}, timeout=180, echo=False)
    return path


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_script_under_torchrun_is_the_launched_ddp_run(script_checkpoint, monkeypatch, threads, ulps):
    monkeypatch.setenv("EQUIVALENCE_13_CHECKPOINT", str(script_checkpoint))
    diff = run_check(__file__, "check", threads, ulps)["diff"]
    print(f"threads={threads} ulps={ulps}: script vs launch {diff:.1e}")
    assert diff < TOLERANCE
