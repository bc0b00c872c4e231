"""helpers.visible: mask rules and checks, children under a mask, launch on a subset."""

import os
import sys

import pytest
import torch

from helpers import visible

# Measured on one H100 with torch 2.11 (one GPU), a child per mask: mask → devices the child saw.
MEASURED_ONE_GPU = {"": 0, "0": 1, "1": 0, "0,0": 0, "0,1": 1, "1,0": 0, "abc": 0, "-1": 0}


@pytest.mark.parametrize("mask,count", MEASURED_ONE_GPU.items())
def test_rule_reproduces_the_h100_measurements(mask, count):
    assert visible.cuda_would_see(mask, 1) == count


def test_rule_on_more_gpus():
    assert visible.cuda_would_see(None, 8) == 8
    assert visible.cuda_would_see("2,3", 8) == 2
    assert visible.cuda_would_see("2,9,3", 8) == 1
    assert visible.cuda_would_see("1, 0", 2) == 2


def test_check_mask_accepts_good_masks():
    assert visible.check_mask("", 0) == ()
    assert visible.check_mask("1,0", 2) == (1, 0)
    assert visible.check_mask(" 3 ,2", 4) == (3, 2)
    assert visible.check_mask("GPU-2517", 0) == ("GPU-2517",)


@pytest.mark.parametrize("mask,n,words", [
    ("1", 1, "no GPU 1 (this machine has GPUs 0..0); CUDA would silently show 0"),
    ("0", 0, "no GPU 0 (this machine has no GPU)"),
    ("0,0", 2, "names 0 twice"),
    ("abc", 2, "'abc' is not a GPU index"),
    ("-1", 2, "'-1' is not a GPU index"),
    ("0,,1", 2, "'' is not a GPU index"),
    ("0,1,2", 2, "no GPU 2"),
])
def test_check_mask_refuses_bad_masks_clearly(mask, n, words):
    with pytest.raises(visible.MaskError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        visible.check_mask(mask, n)


def test_check_mask_wants_a_string():
    with pytest.raises(visible.MaskError, match="must be a string"):
        visible.check_mask(0, 1)


def test_masked_sets_and_restores(monkeypatch):
    monkeypatch.setenv(visible.VAR, "7")
    with visible.masked("", 0):
        assert os.environ[visible.VAR] == ""
    assert os.environ[visible.VAR] == "7"
    monkeypatch.delenv(visible.VAR)
    with pytest.raises(RuntimeError, match="boom"), visible.masked("", 0):
        raise RuntimeError("boom")
    assert visible.VAR not in os.environ


def test_masked_refuses_after_cuda_started(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"), visible.masked("", 0):
        pass
    with pytest.raises(RuntimeError, match="initialised"):
        visible.run_function("", print)


def report_env(x):
    print("hello from the child")
    return os.environ.get(visible.VAR), torch.cuda.device_count(), x * 2


def test_run_function_returns_value_and_output():
    out = visible.run_function("", report_env, 21)
    assert out.value == ("", 0, 42) and out.output == "hello from the child\n"


def test_run_function_reports_errors_and_bad_masks():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        visible.run_function("", lambda: 1 / 0)
    with pytest.raises(visible.MaskError):
        visible.run_function("0,0", report_env, 1)
    assert visible.run_function("0,0", report_env, 1, check=False).value[0] == "0,0"
    here = os.environ.get("CUDA_DEVICE_ORDER")  # PCI_BUS_ID: helpers sets it on import
    order = visible.run_function("", os.environ.get, "CUDA_DEVICE_ORDER", env={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert order.value == "FASTEST_FIRST" and os.environ.get("CUDA_DEVICE_ORDER") == here != "FASTEST_FIRST"


def test_run_script_sees_the_mask(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint(os.environ['CUDA_VISIBLE_DEVICES'] or 'empty', sys.argv[1:])\n")
    out = visible.run_script("", [sys.executable, str(script), "a"])
    assert out.output == "empty ['a']\n"
    raw = visible.run_script("3,1", [sys.executable, str(script)], check=False)
    assert raw.output.startswith("3,1")
    with pytest.raises(visible.MaskError):
        visible.run_script("3,1", [sys.executable, str(script)])
    with pytest.raises(RuntimeError, match="exit code 3"):
        visible.run_script("", [sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"])


def test_start_script_gives_the_child_the_mask_and_env(monkeypatch):
    monkeypatch.setenv(visible.VAR, "7")
    p = visible.start_script("", [sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                                  "os.environ['EXTRA'])"], env={"EXTRA": "x", visible.VAR: "5"})
    assert p.communicate(timeout=60)[0] == "'' x\n" and os.environ[visible.VAR] == "7"
    with pytest.raises(visible.MaskError):
        visible.start_script("0,0", [sys.executable, "-c", "pass"])


def rank_sees(rank, world_size):
    return os.environ.get(visible.VAR), torch.cuda.device_count()


def test_launch_on_a_subset_restores_the_parent(monkeypatch):
    monkeypatch.setattr(visible, "physical_gpus", lambda: [])
    monkeypatch.delenv(visible.VAR, raising=False)
    res = visible.launch_on("", rank_sees, 2, quiet=True, progress=False)
    assert list(res) == [("", 0), ("", 0)]
    assert res.plan.kind == "cpu" and visible.VAR not in os.environ
    with pytest.raises(visible.MaskError):
        visible.launch_on("0", rank_sees, 1, quiet=True, progress=False)


def test_plan_inside_masked_sees_the_subset(monkeypatch):
    from helpers import devices

    def count():  # what torch's NVML count does: read the mask at call time
        mask = os.environ.get(visible.VAR)
        return 4 if mask is None else visible.cuda_would_see(mask, 4)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", count)
    monkeypatch.setattr(devices, "driver_check", lambda: None)
    monkeypatch.delenv(visible.VAR, raising=False)
    assert devices.plan(2).kind == "multi-gpu"
    with visible.masked("3", 4):
        p = devices.plan(2)
    assert p.kind == "shared-gpu" and [str(d) for d in p.devices] == ["cuda:0", "cuda:0"]
    with visible.masked("", 4):
        assert devices.plan(2).kind == "cpu"
