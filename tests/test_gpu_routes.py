"""GPU routes checked without a GPU: what would break on a GPU machine, shown with torch's answers mocked.

The mocked NVML count behaves as torch's does: it honours CUDA_VISIBLE_DEVICES (an empty mask counts 0).
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers import devices

ROOT = Path(__file__).resolve().parent.parent

# run before the code under test, in a child: a machine with 2 GPUs, as torch's NVML count would see it
TWO_GPUS = (
    "import os, torch, torch.cuda as c; "
    "c._device_count_nvml = lambda: 0 if os.environ.get('CUDA_VISIBLE_DEVICES') == '' else 2; "
    "import helpers.devices as d; d.driver_check = lambda: None; "
)


def test_the_mocked_count_sees_two_gpus_without_a_mask():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", TWO_GPUS + "print(d.plan(2).backend)"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "nccl"


def test_bench_launch_plans_cpu_ranks_on_a_gpu_machine():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    code = TWO_GPUS + "import runpy, sys; sys.argv = ['bench_launch.py', '--plan']; " \
                      "runpy.run_path('scripts/bench_launch.py', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "CPU (gloo)" in out, out


def test_unit_tests_plan_cpu_ranks_whatever_the_machine_has():
    # conftest hides the GPUs before anything asks: the tests' launched functions reduce CPU tensors, which NCCL
    # cannot ("No backend type associated with device type cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert torch.cuda._device_count_nvml() == 0
    assert devices.plan(2).kind == "cpu"


# ---- the field's known failures: a rank's error is followed by a one-line fix ----

import functools  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from helpers.launch import RankFailed, launch  # noqa: E402

QUIET = dict(quiet=True, progress=False, timeout=120)


def raise_(rank, world_size, err):
    raise err


# messages as torch and NCCL print them (a GPU would be needed to provoke them for real)
GPU_MESSAGES = {
    "oom": (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                   "of 15.57 GiB of which 1.19 GiB is free."), "smaller batch"),
    "nccl": (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
                                   "NCCL_DEBUG=INFO for details), NCCL version 2.21.5"), "NCCL_P2P_DISABLE=1"),
    "watchdog": (dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                                       "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                                       "600015 milliseconds before timing out."), "skipped it"),
    "cudnn-engine": (RuntimeError("GET was unable to find an engine to execute this computation"),
                   "fp16 with torch.amp.GradScaler"),
}


@pytest.mark.parametrize("name", GPU_MESSAGES)
def test_a_rank_raising_a_known_gpu_failure_gets_its_fix(name):
    err, fix = GPU_MESSAGES[name]
    with pytest.raises(RankFailed) as info:
        launch(functools.partial(raise_, err=err), 1, **QUIET)
    assert "Fix: " in str(info.value) and fix in str(info.value)


class HalfUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def unused_parameter_rank(rank, world_size):
    model = DDP(HalfUsed())
    for _ in range(2):  # DDP notices on the second step
        model(torch.randn(8, 4)).sum().backward()


def test_ddp_with_an_unused_parameter_gets_the_find_unused_parameters_fix():
    with pytest.raises(RankFailed) as info:
        launch(unused_parameter_rank, 2, **QUIET)
    text = str(info.value)
    assert "were not used in producing loss" in text and "find_unused_parameters=True" in text


class BusErrorSet(Dataset):
    """A dataset whose worker dies of SIGBUS, as a worker does when /dev/shm is full."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGBUS)


def bus_error_rank(rank, world_size):
    for _ in DataLoader(BusErrorSet(), batch_size=4, num_workers=1):
        pass


def test_a_dataloader_worker_killed_by_a_bus_error_gets_the_shared_memory_fix():
    with pytest.raises(RankFailed) as info:
        launch(bus_error_rank, 1, **QUIET)
    text = str(info.value)
    assert "Bus error" in text and "--shm-size" in text and "/dev/shm" in text


# ---- what a poisoned fork really prints (issue 26.21): each gets the backward-pass fix ----

POISONED_FORK = {
    # c10/cuda/CUDAFunctions.cpp: cudaGetDeviceCount fails with cudaErrorInitializationError in the child
    "libc10_cuda.so": "CUDA driver initialization failed, you might not have a CUDA gpu.",
    # torch/csrc/autograd/engine.cpp: a backward in a child forked after the parent started autograd's GPU threads
    "libtorch_cpu.so": "Unable to handle autograd's threading in combination with fork-based multiprocessing. "
                       "See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork",
}


@pytest.mark.parametrize("library", POISONED_FORK)
def test_a_poisoned_fork_s_own_words_get_the_backward_fix(library):
    from helpers._rank import _hint

    message = POISONED_FORK[library]
    path = Path(torch.__file__).parent / "lib" / library
    if path.is_file():  # the words are torch's: the installed binary holds them (a CPU-only build has no c10_cuda)
        import mmap

        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert m.find(message.encode()) >= 0, f"{library} no longer says {message!r}"
    assert "backward pass" in _hint(RuntimeError(message))


# ---- notebook 12's children choose CUDA by the course's plan, not by NVML's count (issue 34, item 4) ----

import ast  # noqa: E402
import json  # noqa: E402

# 2 GPUs that NVML counts and this torch cannot run (a driver older than its CUDA build): as on a 12.x driver with
# the cu132 wheel. Anything that starts CUDA here fails, as it would there (this machine has no GPU at all).
OLD_DRIVER = (
    "import os, sys, runpy, torch, torch.cuda as c; "
    "c._device_count_nvml = lambda: 0 if os.environ.get('CUDA_VISIBLE_DEVICES') == '' else 2; "
    "import helpers.devices as d; d.driver_check = lambda: 'this GPU driver supports CUDA up to 12.4, but ...'; "
)
NB12 = ROOT / "notebooks" / "12-visible-devices.ipynb"


def _nb12_code(start: str) -> str:
    """The source of notebook 12's code cell that starts with ``start``."""
    for cell in json.loads(NB12.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and src.startswith(start):
            return src
    raise AssertionError(f"no cell of {NB12.name} starts with {start!r}")


def _run_old_driver(code: str, *argv: str):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, "-c", OLD_DRIVER + code, *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("script", ["job.py", "late.py"])
def test_notebook_12_scripts_start_no_cuda_on_gpus_this_torch_cannot_run(script, tmp_path):
    body = _nb12_code("%%writefile {work}/" + script).split("\n", 1)[1]
    (tmp_path / script).write_text(body)
    ready = tmp_path / "ready"
    ready.mkdir()
    (ready / "B").touch()  # the other job has arrived: job.py waits for it before training
    args = ["A", "0.2", str(ready)] if script == "job.py" else []
    run = "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = _run_old_driver(run, str(tmp_path / script), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if script == "job.py":
        assert out["sees"] == 2 and out["device"] == "cpu" and out["uuids"] == [] and out["steps"] > 0, out
    else:
        assert out["gpus"] == 2 and "after" not in out, out  # torch's count says 2; the plan started no CUDA


@pytest.mark.parametrize("cell_start, name", [("def whoami", "whoami"), ("print(\"CUDA_DEVICE_ORDER", "buses")])
def test_notebook_12_child_functions_start_no_cuda_on_gpus_this_torch_cannot_run(cell_start, name):
    src = _nb12_code(cell_start)
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = "from helpers import devices\n" + ast.get_source_segment(src, fn) + f"\nprint(repr({name}()))"
    proc = _run_old_driver(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() in ("None", "[]"), proc.stdout
