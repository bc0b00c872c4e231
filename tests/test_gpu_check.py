"""`make gpu-check` (scripts/gpu_check.py): its CPU side. The checks themselves need a GPU; here, what it plans to run
on 1 and on several GPUs, that a machine without a usable GPU stops it at once with the reason, and that it reads
21's script's events (rate, MFU, peak) the way the script writes them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


def test_two_gpus_add_the_nccl_notebooks_to_the_one_gpu_checks():
    one, two, eight = gpu_check.planned(1), gpu_check.planned(2), gpu_check.planned(8)
    assert "two NCCL ranks on one GPU refused" in one and "notebook 09 (smoke)" in one
    assert not any("NCCL)" in row for row in one)
    assert two[:len(one)] == one and two == eight
    assert [r for r in two if r not in one] == [f"notebook {n} (smoke, NCCL)" for n in gpu_check.NOTEBOOKS_TWO_GPUS]
    with pytest.raises(ValueError, match="no usable GPU"):
        gpu_check.planned(0)


def test_every_planned_notebook_exists():
    for number in gpu_check.NOTEBOOKS_ONE_GPU + gpu_check.NOTEBOOKS_TWO_GPUS:
        assert len(list((ROOT / "notebooks").glob(f"{number}-*.ipynb"))) == 1, number


def test_without_a_gpu_it_stops_at_once_and_says_why():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                         timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert run.returncode == gpu_check.NO_GPU, run.stdout + run.stderr
    assert "no usable GPU here" in run.stderr and "--plan N" in run.stderr


def test_the_training_rows_read_the_script_s_events(monkeypatch):
    start = {"event": "start", "size": {"name": "gpu-40g"}, "peak_flops": 989e12, "peak": "datasheet dense bf16 x 1"}
    steps = [{"event": "step", "step": s, "tokens_per_s": 1000.0 * s, "mfu": 0.01 * s} for s in range(1, 9)]
    out = "\n".join(json.dumps(e) for e in [start, *steps]) + "\n"
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout, env=None, cwd=None: (0, out, 12.0))
    ok, text, seconds = gpu_check._train(["--dtype", "bfloat16"], 1, 60)
    assert ok and seconds == 12.0
    # steps 4..8 after the three warm-up steps: median 6
    assert text.startswith("6,000 tokens/s (median of 5 steps), MFU 6.0% of 989 TFLOP/s (datasheet dense bf16")
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout, env=None, cwd=None: (1, "RuntimeError: boom", 3.0))
    assert gpu_check._train([], 1, 60)[:2] == (False, "FAILED: RuntimeError: boom")
