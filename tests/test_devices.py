import pytest
import torch

from helpers import devices


@pytest.mark.parametrize("n_gpus, world_size, backend, kind, expected", [
    (0, 1, "gloo", "cpu", ["cpu"]),
    (0, 4, "gloo", "cpu", ["cpu"] * 4),
    (1, 1, "nccl", "multi-gpu", ["cuda:0"]),
    (1, 2, "gloo", "shared-gpu", ["cuda:0", "cuda:0"]),
    (2, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
    (2, 4, "gloo", "partly-shared", ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
    (4, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
    (4, 4, "nccl", "multi-gpu", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (8, 8, "nccl", "multi-gpu", [f"cuda:{i}" for i in range(8)]),
    (8, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
])
def test_plan_places_ranks(n_gpus, world_size, backend, kind, expected):
    p = devices.plan(world_size, n_gpus=n_gpus)
    assert [str(d) for d in p.devices] == expected
    assert (p.backend, p.kind, p.world_size) == (backend, kind, world_size)


def test_plan_sentences_say_what_is_real(monkeypatch):
    monkeypatch.setattr(devices, "cpu_cores", lambda: 2)
    assert "CPU" in devices.plan(2, n_gpus=0).sentence
    single = devices.plan(1, n_gpus=0).sentence
    assert "baseline" in single and "speed-up" not in single, "one rank has no speed-up to speak of"
    crowded = devices.plan(4, n_gpus=0).sentence
    assert "4 ranks on 2 cores take turns" in crowded
    assert "take turns" not in devices.plan(2, n_gpus=0).sentence
    assert "no speed-up" in devices.plan(2, n_gpus=1).sentence
    assert "real multi-GPU" in devices.plan(2, n_gpus=2).sentence
    partly = devices.plan(3, n_gpus=2).sentence
    assert "cuda:0 carries" in partly and "cuda:1" not in partly


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_plan_rejects_impossible_world_sizes(bad):
    with pytest.raises(ValueError, match="world_size"):
        devices.plan(bad, n_gpus=2)


def test_plan_refuses_nccl_without_a_gpu_per_rank():
    with pytest.raises(ValueError, match="one GPU per rank"):
        devices.plan(2, n_gpus=1, backend="nccl")
    forced = devices.plan(2, n_gpus=2, backend="gloo")
    assert forced.backend == "gloo" and forced.kind == "multi-gpu"
    assert "joined over gloo" in forced.sentence and "(nccl)" not in forced.sentence  # says what runs
    with pytest.raises(ValueError, match="backend"):
        devices.plan(2, n_gpus=2, backend="mpi")


def test_plan_uses_the_real_gpu_count_by_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 3)
    monkeypatch.setattr(devices, "driver_check", lambda: None)
    assert devices.gpu_count() == 3
    assert devices.plan(3).backend == "nccl"


def _no_cuda_runtime_count(monkeypatch):
    """Asking the CUDA runtime for the count poisons later forks: any call to it fails the test."""
    def poison():
        raise AssertionError("cudaGetDeviceCount was called: later forks could not use CUDA")
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", poison)
    monkeypatch.setattr(torch.cuda, "device_count", poison)
    monkeypatch.setattr(torch.cuda, "is_available", poison)


def test_mig_slices_plan_the_cpu_with_the_reason_and_never_ask_cuda(monkeypatch):
    _no_cuda_runtime_count(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c89d4e8-8c51-5a7d-9b4b-6b7b5b6c7d8e")
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # what torch's NVML count answers for MIG
    assert devices.gpu_count() == 0
    assert "MIG" in devices.gpu_problem()
    p = devices.plan(2)
    assert p.kind == "cpu" and "MIG" in p.sentence and "torchrun" in p.sentence


def test_no_nvml_library_beside_a_driver_plans_the_cpu_and_says_why(monkeypatch):
    _no_cuda_runtime_count(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    monkeypatch.setattr(devices, "_nvidia_driver_present", lambda: True)
    assert devices.gpu_count() == 0 and "libnvidia-ml" in devices.gpu_problem()
    monkeypatch.setattr(devices, "_nvidia_driver_present", lambda: False)  # a CPU machine: nothing to explain
    assert devices.gpu_count() == 0 and devices.gpu_problem() is None
    assert "GPUs not used" not in devices.plan(2).sentence


def test_a_driver_older_than_the_build_plans_the_cpu_and_says_why(monkeypatch):
    _no_cuda_runtime_count(monkeypatch)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(devices, "driver_check", lambda: "this GPU driver supports CUDA up to 12.2, but ...")
    assert devices.gpu_count() == 0
    p = devices.plan(2)
    assert p.kind == "cpu" and "2 GPUs not used" in p.sentence and "12.2" in p.sentence
    assert devices.visible_gpu_count() == 2  # 00 still lists them


def test_helpers_number_gpus_in_pci_bus_order_like_nvml():
    import os
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_pick_device_falls_back(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert devices.pick_device(1) == torch.device("cpu")
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    assert devices.pick_device(1) == torch.device("cuda", 0)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert devices.pick_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError):
        devices.pick_device(-1)


def test_describe_does_not_initialise_cuda():
    machine = devices.describe()
    assert machine.cpu_cores >= 1
    assert machine.n_gpus == devices.gpu_count()
    assert not torch.cuda.is_initialized()


def test_driver_check_warns_only_when_the_driver_is_of_an_older_major_version():
    assert devices.driver_check("13.0", "13.0") is None
    assert devices.driver_check("12.4", "12.6") is None
    assert devices.driver_check("13.0", None) is None, "no driver: nothing to compare"
    assert devices.driver_check("", "12.0") is None, "CPU-only torch build"
    warning = devices.driver_check("13.0", "12.4")
    assert "CUDA up to 12.4" in warning and "built for CUDA 13.0" in warning and "Fix:" in warning
    assert "CUDA 13.x" in warning and "CUDA 12.x" in warning


def test_driver_check_follows_cuda_minor_version_compatibility():
    """Kaggle's and Colab's drivers run newer 12.x/13.x builds: a minor version ahead of the driver is fine."""
    assert devices.driver_check("12.8", "12.4") is None, "a 12.8 build on a 12.4 driver (Colab, Kaggle) works"
    assert devices.driver_check("13.2", "13.0") is None, "torch 2.15's 13.2 build on a 580 driver (13.0)"
    assert devices.driver_check("13.2", "12.9") is not None, "a new major version needs a new driver"


def test_nccl_p2p_hint_names_the_switch_and_what_nvml_read(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    hint = devices.nccl_p2p_hint({(0, 1): True, (1, 0): True})
    assert "NCCL_P2P_DISABLE" in hint and "cuda:0->cuda:1 yes" in hint
    assert "could not report" in devices.nccl_p2p_hint({})
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "already set" in devices.nccl_p2p_hint({(0, 1): False})


class FakeNVML:
    """Stands in for pynvml: three GPUs in the box, peer access only between 0 and 2."""

    class NVMLError(Exception):
        pass

    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_STATUS_OK = 0, 0

    def __init__(self):
        self.open = 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return f"Fake GPU {h}".encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": (h + 1) * 2**30})()

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0 if {a, b} == {0, 2} else 1

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040


def test_describe_reads_names_memory_and_peers_through_nvml(monkeypatch):
    fake = FakeNVML()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # CUDA's cuda:0 is NVML's GPU 2
    machine = devices.describe()
    assert [(g.index, g.name, g.memory_gib) for g in machine.gpus] == [(0, "Fake GPU 2", 3.0), (1, "Fake GPU 0", 1.0)]
    assert machine.peer_access == {(0, 1): True, (1, 0): True}
    assert devices.driver_check("13.0").startswith("this GPU driver supports CUDA up to 12.4")
    assert fake.open == 0, "every nvmlInit is matched by nvmlShutdown"


@pytest.mark.parametrize("bad, error", [("1", TypeError), (1.0, TypeError), (True, TypeError), (-1, ValueError)])
def test_pick_device_and_plan_refuse_bad_indices_and_counts(bad, error):
    with pytest.raises(error, match="GPU index"):
        devices.pick_device(bad)
    with pytest.raises(error, match="n_gpus"):
        devices.plan(2, n_gpus=bad)


def test_cpu_bf16_is_read_from_the_cpu_flags(tmp_path):
    with_bf16 = tmp_path / "with"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    without = tmp_path / "without"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert devices.cpu_has_bf16(str(with_bf16)) and devices.cpu_has_bf16(str(arm))
    assert not devices.cpu_has_bf16(str(without))
    assert not devices.cpu_has_bf16(str(tmp_path / "missing"))


@pytest.mark.parametrize("capability, expect", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True),
                                                (None, False)])
def test_bf16_is_offered_only_on_gpus_that_have_it(monkeypatch, capability, expect):
    # a T4 (7.5) or V100 (7.0): torch.cuda.is_bf16_supported() says True there; torch runs bf16 convolutions without cuDNN, slowly
    monkeypatch.setattr(devices, "gpu_capability", lambda index: capability)
    assert devices.has_bf16(torch.device("cuda", 0)) is expect
    assert devices.has_bf16("cuda:1") is expect


def test_cpu_bf16_can_be_masked_for_a_whole_run(tmp_path, monkeypatch):
    masked = tmp_path / "cpuinfo"
    masked.write_text("flags\t\t: fpu sse avx2\n")
    monkeypatch.setenv("MULTIGPU_CPUINFO", str(masked))
    assert not devices.cpu_has_bf16() and not devices.has_bf16("cpu")


# ---- a GPU that torch's build holds no code for (a P100 or V100 under the CUDA 13 wheels) ----

CU132 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.15.0+cu132's get_arch_list()


@pytest.mark.parametrize("capability, archs, runs", [
    ((7, 0), CU132, False),                    # V100: sm_75 is the same major but a later minor
    ((6, 0), CU132, False),                    # P100
    ((7, 5), CU132, True),                     # T4
    ((8, 9), CU132, True),                     # L4 runs sm_86 code (same major, minor 6 <= 9)
    ((10, 3), CU132, True),                    # B300 runs sm_100
    ((13, 0), CU132, False),                   # a later major runs no cubin of an earlier one
    ((13, 0), CU132 + ["compute_120"], True),  # ... but the driver compiles PTX for it
    ((7, 0), ["sm_75", "compute_75"], False),  # PTX compiles forward only
    ((9, 0), ["sm_80", "sm_90a"], True),       # an arch-specific cubin of 9.0
])
def test_kernels_run_within_their_major_version_at_or_above_their_minor(capability, archs, runs):
    assert devices._runs_on(archs, capability) is runs
    assert (devices.kernel_check([capability], archs) is None) is runs


def test_a_gpu_the_build_has_no_code_for_plans_the_cpu_and_names_the_fix(monkeypatch):
    _no_cuda_runtime_count(monkeypatch)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(devices, "driver_check", lambda: None)
    monkeypatch.setattr(devices, "_capabilities", lambda n: [(7, 0)] * n, raising=False)  # NVML's, for V100s
    monkeypatch.setattr(devices, "_built_archs", lambda: tuple(CU132), raising=False)
    assert devices.gpu_count() == 0
    p = devices.plan(2)
    assert p.kind == "cpu" and p.backend == "gloo" and "2 GPUs not used" in p.sentence
    assert "compute capability 7.0" in p.sentence and "no kernel image" in p.sentence and "Fix:" in p.sentence
    monkeypatch.setattr(devices, "_capabilities", lambda n: [(9, 0)] * n)  # H100s: planned as before
    assert devices.plan(2).backend == "nccl"
    monkeypatch.setattr(devices, "_capabilities", lambda n: [None] * n)  # unreadable: not held against the GPUs
    monkeypatch.setattr(devices, "_built_archs", lambda: pytest.fail("the build's list read for nothing"))
    assert devices.plan(2).backend == "nccl"


def test_the_fix_names_a_build_with_code_for_the_gpu_where_torch_lists_its_builds(monkeypatch):
    monkeypatch.setattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {"12.6": {"x86_64": {60, 70, 75}, "aarch64": {80}},
                                                                 "13.2": {"x86_64": {75, 80}, "aarch64": {80}}},
                        raising=False)
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    assert "whl/cu126" in devices.kernel_check([(7, 0)], ["sm_75", "sm_80"])
    monkeypatch.setattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {"12.6": {50, 60, 70}, "13.0": {75}})  # torch 2.11's
    assert "whl/cu126" in devices.kernel_check([(7, 0)], ["sm_75", "sm_80"])
    monkeypatch.setattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {}, raising=False)  # no table
    assert "sm_70" in devices.kernel_check([(7, 0)], ["sm_75"]) and "install selector" in devices.kernel_check(
        [(7, 0)], ["sm_75"])


CHECK_ARCH = """
import os, sys, torch
print(torch._C._cuda_getArchFlags() or "-")  # get_arch_list()'s source; torch 2.11's gives [] without a GPU
pid = os.fork()  # after the call: can a forked child still start CUDA?
if pid == 0:
    os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_the_arch_list_is_read_in_a_child_because_reading_it_poisons_later_forks():
    import subprocess
    import sys

    from helpers.procs import call_in_child

    out = subprocess.run([sys.executable, "-c", CHECK_ARCH], capture_output=True, text=True, check=True).stdout
    torch_says, child_exit = out.strip().splitlines()
    devices._built_archs.cache_clear()
    assert (" ".join(devices._built_archs()) or "-") == torch_says  # a CPU-only machine too: the list is compiled in
    assert not torch.cuda.is_initialized()
    assert call_in_child(torch.cuda._is_in_bad_fork) is False, "this process's forks can still start CUDA"
    if torch.cuda._is_compiled():
        assert torch_says and child_exit == "3", "torch's own call poisons forks (Module.cpp: poison_fork)"


def test_capabilities_come_from_nvml_in_cuda_s_numbering(monkeypatch):
    class CapNVML(FakeNVML):
        def nvmlDeviceGetCudaComputeCapability(self, h):
            return (7, 0) if h == 2 else (9, 0)

    fake = CapNVML()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # CUDA's cuda:0 is NVML's GPU 2, a V100 here
    assert devices._capabilities(2) == [(7, 0), (9, 0)] and fake.open == 0
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    warning = devices.kernel_check(archs=CU132)
    assert "cuda:0 (compute capability 7.0)" in warning and "9.0" not in warning, "cuda:1 (9.0) runs sm_90"
