"""helpers.mfu: datasheet peaks matched by model and by the precision that runs, and notebook 21's run sized from
the GPUs that devices.plan would use, on four machines with mocked GPUs (issue 44, item 4)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from helpers import devices, mfu

CUDA13_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")  # the CUDA 13 wheels' list


class FakeNVML:
    """pynvml for a box of identical GPUs: name, memory (GiB), compute capability, the driver's CUDA version."""

    class NVMLError(Exception):
        pass

    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_STATUS_OK = 0, 0

    def __init__(self, name, memory_gib, capability, driver):
        self.name, self.memory, self.capability, self.driver = name, memory_gib, capability, driver

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=self.memory * 2**30)

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.capability

    def nvmlSystemGetCudaDriverVersion(self):
        return self.driver


# (GPUs, NVML name, GiB, capability, driver's CUDA) -> (world, pp, tp, size, device, dtype, one device's peak)
MACHINES = {
    "1xH100, CUDA 13 driver": ((1, "NVIDIA H100 80GB HBM3", 79.6, (9, 0), 13000),
                               (1, 1, 1, "gpu-40g", "cuda", "bfloat16", 989e12)),
    "2xT4": ((2, "Tesla T4", 15.0, (7, 5), 13000),
             (2, 1, 2, "gpu-16g", "cuda", "float32", 8.1e12)),  # no bf16: float32, FP32's peak, not fp16's 65
    "4xL4": ((4, "NVIDIA L4", 22.5, (8, 9), 13000),
             (4, 2, 2, "gpu-16g", "cuda", "bfloat16", 121e12)),  # pp=2 x dp=1 x tp=2
    "8xH100": ((8, "NVIDIA H100 80GB HBM3", 79.6, (9, 0), 13000),
               (8, 2, 2, "gpu-40g", "cuda", "bfloat16", 989e12)),  # every GPU: pp=2 x dp=2 x tp=2
    "1xT4, 12.x driver": ((1, "Tesla T4", 15.0, (7, 5), 12040),
                          (8, 2, 2, "cpu", "cpu", "float64", None)),  # planned off: the CPU route, 2 x 2 x 2
}


def mock_machine(monkeypatch, n, name, memory_gib, capability, driver):
    """This process sees ``n`` GPUs through torch's NVML count and pynvml, with a torch built for CUDA 13."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(name, memory_gib, capability, driver))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: n)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices, "_built_archs", lambda: CUDA13_ARCHS)


@pytest.mark.parametrize("machine", MACHINES)
def test_notebook_20_is_sized_from_the_plan(monkeypatch, machine):
    gpus, want = MACHINES[machine]
    mock_machine(monkeypatch, *gpus)
    run = mfu.plan_capstone()
    assert (run.world, run.pp, run.tp, run.size, run.device, run.dtype, run.peak) == want, run
    assert run.world % (run.pp * run.tp) == 0  # dp = world / (pp * tp) workers
    assert devices.plan(run.world).kind == ("multi-gpu" if run.device == "cuda" else "cpu")  # one GPU per worker
    assert mfu.plan_capstone(smoke=True).size == "smoke" and not torch.cuda.is_initialized()


def test_datasheet_names_match_models_not_substrings():
    peak = {name: (mfu.datasheet_peak(name) or (None,))[0] for name in (
        "NVIDIA RTX A1000", "NVIDIA T400", "Tesla T4", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S",
        "NVIDIA H200", "NVIDIA L40", "NVIDIA L4", "NVIDIA A10G", "NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090")}
    assert peak == {"NVIDIA RTX A1000": None,  # not an A100
                    "NVIDIA T400": None,  # not a T4
                    "Tesla T4": None,  # no BF16 at all
                    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-40GB": 312e12,
                    "NVIDIA L40S": 362.05e12,  # the datasheet's dense BF16 (733 is the sparse figure)
                    "NVIDIA H200": 989e12, "NVIDIA L40": 181.05e12, "NVIDIA L4": 121e12,
                    "NVIDIA A10G": None,  # no NVIDIA datasheet: not guessed from the A10's
                    "NVIDIA H100 PCIe": 756e12, "NVIDIA GeForce RTX 4090": 165.2e12}
    assert mfu.datasheet_peak("Tesla T4", "fp32")[:2] == (8.1e12, "fp32")
    assert mfu.datasheet_peak("Tesla T4", "fp16")[0] == 65e12
    assert mfu.datasheet_peak("NVIDIA H100 80GB HBM3", "fp32")[0] == 67e12
    assert mfu.datasheet_peak("NVIDIA H100 80GB HBM3", "tf32")[0] == 494.5e12


def test_every_figure_carries_its_datasheet():
    for model, tflops, source in mfu.DATASHEET_TFLOPS:
        assert source.startswith("https://") and "(" in source, model
        for precision, value in tflops.items():  # the figure, or twice it (the sparse one), is quoted in the source
            quoted = {f"{v:,g}" for v in (value, 2 * value)} | {f"{v:,.2f}" for v in (value, 2 * value)}
            assert any(q in source for q in quoted), (model, precision, value, source)


def test_float32_runs_plain_fp32_unless_tf32_is_switched_on():
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")  # torch's default: no TF32 for matmuls
    assert mfu.matmul_precision(torch.float32) == "fp32" and mfu.matmul_precision(torch.bfloat16) == "bf16"
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True  # the legacy switch; set_float32_matmul_precision("high") alike
        assert mfu.matmul_precision(torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert mfu.matmul_precision(torch.float32) == "fp32"
