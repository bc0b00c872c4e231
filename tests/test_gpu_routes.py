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


# ---- notebook 13's children choose CUDA by the course's plan, not by NVML's count (issue 34, item 4) ----

import ast  # noqa: E402
import json  # noqa: E402

# 2 GPUs that NVML counts and this torch cannot run (a driver older than its CUDA build): as on a 12.x driver with
# the cu132 wheel. Anything that starts CUDA here fails, as it would there (this machine has no GPU at all).
OLD_DRIVER = (
    "import os, sys, runpy, torch, torch.cuda as c; "
    "c._device_count_nvml = lambda: 0 if os.environ.get('CUDA_VISIBLE_DEVICES') == '' else 2; "
    "import helpers.devices as d; d.driver_check = lambda: 'this GPU driver supports CUDA up to 12.4, but ...'; "
)
NB12 = ROOT / "notebooks" / "13-visible-devices.ipynb"


def _nb12_code(start: str) -> str:
    """The source of notebook 13's code cell that starts with ``start``."""
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


# ---- notebook 20: a compile in the notebook's own process starts CUDA on a GPU machine (found on an H200) ----

NB20 = ROOT / "notebooks" / "20-torch-compile.ipynb"
# run first in a child: CUDA looks available to THIS process (as on a GPU machine), and whatever would initialise
# CUDA here (every path goes through torch._C._cuda_init: torch.cuda._lazy_init) is recorded with its caller and
# refused. Processes forked from it see the real machine (no GPU), so the notebook's launches run as in CI.
CUDA_HERE = (
    "import os, sys, traceback, torch, torch.cuda as c\n"
    "PARENT, CUDA_INITS, available = os.getpid(), [], c.is_available\n"
    "c.is_available = lambda: os.getpid() == PARENT or available()\n"
    "def _cuda_init():\n"
    "    if os.getpid() == PARENT:\n"
    "        CUDA_INITS.append([f'{os.path.basename(f.filename)}:{f.name}' for f in traceback.extract_stack()])\n"
    "    raise RuntimeError('CUDA initialised in the notebook process')\n"
    "torch._C._cuda_init = _cuda_init\n"
)


def _cuda_here(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CUDA_HERE + code], cwd=ROOT / "notebooks", capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_a_compile_on_cpu_tensors_initialises_cuda_where_cuda_is_available():
    # torch.cuda.get_rng_state starts CUDA ("This function eagerly initializes CUDA"), and Dynamo calls it
    # before tracing any frame whenever torch.cuda.is_available() (convert_frame.py, preserve_global_state)
    import inspect

    assert "_lazy_init()" in inspect.getsource(torch.cuda.random.get_rng_state)
    code = ("m = torch.nn.Linear(4, 4)\n"
            "try:\n"
            "    with torch.no_grad():\n"
            "        torch.compile(m, backend=lambda gm, ex: gm.forward)(torch.randn(2, 4))\n"
            "except Exception:\n"
            "    pass\n"
            "print(CUDA_INITS[0] if CUDA_INITS else 'none')\n")
    out = _cuda_here(code)
    assert out.returncode == 0, out.stderr[-3000:]
    stack = out.stdout.strip().splitlines()[-1]
    assert "random.py:get_rng_state" in stack and "convert_frame.py:_fn" in stack, stack


def test_notebook_20_compiles_nothing_in_its_own_process():
    """The cells that compile with the recording backend (1, the forward, graph breaks, solutions 2 and 3) run in
    the notebook's process with CUDA "available": none may start CUDA there, or every later launch is refused.
    Before the fix, cell 3 compiled in the notebook's process (CUDA_INITS non-empty)."""
    cells = [c for c in json.loads(NB20.read_text())["cells"] if c["cell_type"] == "code"]
    chosen = [cells[0]] + [c for c in cells[1:] if "recording" in "".join(c["source"])
                           and "DDP(" not in "".join(c["source"]) and "fsdp_rank" not in "".join(c["source"])]
    assert len(chosen) == 5, len(chosen)  # setup, forward, graph breaks, solutions 2 and 3
    code = ("import json\n"
            f"cells = json.loads({json.dumps(json.dumps(['' .join(c['source']) for c in chosen]))})\n"
            "scope = {}\n"
            "for i, cell in enumerate(cells):\n"
            "    try:\n"
            "        exec(compile(cell, f'cell {i}', 'exec'), scope)\n"
            "    except Exception as e:\n"
            "        print('FAILED', i, type(e).__name__, str(e)[:300])\n"
            "        break\n"
            "print('CUDA_INITS', len(CUDA_INITS), CUDA_INITS[0][-8:] if CUDA_INITS else '')\n")
    out = _cuda_here(code, SMOKE_TEST="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FAILED" not in out.stdout and "CUDA_INITS 0 " in out.stdout, out.stdout[-3000:]


# ---- per-launch devices (issue 44, items 1, 2, 8): four machines, mocked; every launch of 16-20, 23-25 ----

import re  # noqa: E402

from helpers.launch import launch_plan  # noqa: E402

CU132_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")  # the CUDA 13.2 wheel's
# (GPUs, compute capability, the driver's newest CUDA): torch built for CUDA 13.2
MACHINES = {
    "1xH100, CUDA 13 driver": (1, (9, 0), "13.0"),
    "2xT4": (2, (7, 5), "13.0"),
    "8xH100": (8, (9, 0), "13.0"),
    "1xT4, 12.x driver": (1, (7, 5), "12.4"),  # the cu132 wheel on an older driver: GPUs planned off
}
USABLE = {"1xH100, CUDA 13 driver": 1, "2xT4": 2, "8xH100": 8, "1xT4, 12.x driver": 0}
# every launch( call of each notebook, in order: (what it runs, its world sizes, how it is planned).
# "fit": the notebook's RUN/QUIET (plan=devices.plan_launch); "cpu": CPU ranks on every machine.
LAUNCHES = {
    "16-fsdp": [("collectives", (2,), "fit"), ("FSDP", (2,), "fit"), ("one process", (1,), "fit"),
                ("counted: reshard_after_forward None, False", (2,), "fit"), ("exercise 2: one unit", (2,), "fit"),
                ("exercise 3: rings", (2, 3, 4), "fit")],
    "17-fsdp-in-production": [("FSDP with the recipe", (2,), "fit"), ("one process", (1,), "fit"),
                               ("measured: defaults, recipe, 16-bit", (2,), "fit"),
                               ("float32 and 16-bit from the same start", (2,), "fit"), ("HSDP (2, 2)", (4,), "fit"),
                               ("HSDP counted", (4,), "fit"), ("exercise 1: every other block", (2,), "fit"),
                               ("exercise 2: not divided", (2,), "fit")],
    "18-distributed-checkpoints": [("state dicts", (2,), "fit"), ("save", (2,), "fit"),
                                   ("resume at 2, 1, 3", (2, 1, 3), "fit"), ("async save", (2,), "fit"),
                                   ("exercise 4: timing", (2,), "fit")],
    "19-tensor-parallel": [("reference", (1,), "fit"), ("by hand", (2,), "fit"), ("DTensor", (2,), "fit"),
                           ("reference float32", (1,), "fit"), ("DTensor float32", (2,), "fit"),
                           ("2-D mesh (2, 2)", (4,), "fit"), ("exercise 1: 4 tp", (4,), "fit"),
                           ("exercise 2: plain", (2,), "fit")],
    "21-gpt-capstone": [("reference", (1,), "fit"), ("meshes (pp, dp, tp)", (8, 4), "fit"),
                        ("collectives counted (1, 2, 2)", (4,), "fit"), ("exercise 1: GPipe", (8,), "fit")],
    "23-context-parallel": [("one process", (1,), "fit"), ("cp, then (dp, cp) = (2, 2)", (4,), "fit"),
                            ("imbalance timed", (4,), "fit"), ("overlap timed", (4,), "fit"),
                            ("torch context_parallel", (4,), "fit"), ("exercise 1: one process", (1,), "fit"),
                            ("exercise 1: 3 and 8 ranks", (3, 8), "fit"), ("exercise 2: broken", (4,), "fit")],
    "24-mixture-of-experts": [("train: dense, no balancing, aux loss, bias", (1,), "fit")],
    "25-expert-parallel": [("EP × FSDP (2, 2)", (4,), "fit"), ("exercise 1: ep 1", (4,), "fit"),
                                 ("exercise 2: no divide factor", (4,), "fit"), ("exercise 3: capacity", (4,), "fit")],
    "20-torch-compile": [("capture the forward", (1,), "fit"), ("graph breaks", (1,), "fit"),
                         ("DDP graphs, two caps", (2,), "fit"), ("FSDP2, blocks compiled", (2,), "fit"),
                         ("timed, eager and compiled", (2,), "fit"), ("float64, compiled and eager", (2,), "fit"),
                         ("exercise 1: cap 25", (2,), "fit"), ("exercise 2: three lengths", (1,), "fit"),
                         ("exercise 3: one block", (1,), "fit")],
}


def _call_text(text, start):
    """The arguments of a call whose "(" ends at ``start``, up to its closing parenthesis."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError(text[start:])


def _code_cells(name):
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.fixture
def machine(monkeypatch, request):
    """Mock torch's and NVML's answers for one of MACHINES; every CUDA runtime call fails loudly."""
    count, capability, driver = MACHINES[request.param]
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(devices, "_nvml_cuda_version", lambda: driver)
    monkeypatch.setattr(devices, "_capabilities", lambda n: [capability] * n)
    monkeypatch.setattr(devices, "_built_archs", lambda: CU132_ARCHS)
    for name in ("device_count", "is_available", "set_device", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: pytest.fail(f"torch.cuda.{_n} called"))
    return request.param


@pytest.mark.parametrize("notebook", LAUNCHES)
def test_every_launch_of_the_notebook_is_planned_per_launch(notebook):
    cells = _code_cells(notebook)
    calls = [_call_text(cell, m.end()) for cell in cells for m in re.finditer(r"(?<![\w.])launch\(", cell)
             if not cell[cell.rfind("\n", 0, m.start()) + 1:m.start()].lstrip().startswith("#")]
    assert len(calls) == len(LAUNCHES[notebook]), calls  # the table lists every launch of the notebook
    options = re.search(r"^(RUN|QUIET) = dict\(", cells[0], re.M)  # its arguments may span lines
    assert options and "plan=devices.plan_launch" in _call_text(cells[0], options.end()), \
        "launch options must plan per launch"
    for line, (_, _, how) in zip(calls, LAUNCHES[notebook]):
        if how == "fit":
            assert f"**{options.group(1)}" in line, line
        else:
            assert "plan=devices.plan(W, n_gpus=0)" in line, line
    for cell in cells:
        assert 'backend="gloo"' not in cell.replace('new_group(backend="gloo")', ""), "a launch forced onto gloo"
        assert not re.search(r"init_device_mesh\(\"cpu\"", cell) or "torch_cp_rank" in cell, "a mesh fixed on cpu"
        assert "ON_CPU" not in cell


@pytest.mark.parametrize("machine", MACHINES, indirect=True)
@pytest.mark.parametrize("notebook", LAUNCHES)
def test_each_rank_of_each_launch_gets_its_device_and_backend(machine, notebook):
    n = USABLE[machine]
    assert devices.gpu_count() == n
    for what, worlds, how in LAUNCHES[notebook]:
        for w in worlds:
            p = launch_plan(w, plan=devices.plan_launch if how == "fit" else devices.plan(w, n_gpus=0))
            on_gpus = how == "fit" and w <= n
            expected = [f"cuda:{r}" for r in range(w)] if on_gpus else ["cpu"] * w
            assert [str(d) for d in p.devices] == expected, (machine, notebook, what, w)
            assert p.backend == ("nccl" if on_gpus else "gloo"), (machine, notebook, what, w)
            if how == "fit" and not on_gpus and n:
                assert f"{w} ranks need a GPU each and {n}" in p.sentence, p.sentence


@pytest.mark.parametrize("machine", MACHINES, indirect=True)
def test_notebook_20_plans_each_launch_and_compiles_for_its_ranks_device(machine, monkeypatch):
    """20's setup cell, run on each mocked machine: its launch options place every launch as LAUNCHES says (one GPU
    per rank over NCCL where W fits, else CPU ranks over gloo), and the compile backend is checked for the device
    the compiled (W-rank) launches compute on. Before: 1xH100 put its one-process captures on cuda:0 over gloo and
    its 2-rank launches on a shared cuda:0 (backend="gloo"), while the rank functions computed on the CPU."""
    from helpers import compiler

    asked = []
    monkeypatch.setattr(compiler, "pick_backend", lambda device_type="cpu": asked.append(device_type) or ("x", "y"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # cell 1 points it at a fresh folder; restored after
    scope = {}
    exec(compile(_code_cells("20-torch-compile")[0], "20, cell 1", "exec"), scope)
    options = {k: scope["QUIET"].get(k) for k in ("plan", "backend")}
    n = USABLE[machine]
    for what, worlds, _ in LAUNCHES["20-torch-compile"]:
        for w in worlds:
            p = launch_plan(w, **options)
            on_gpus = w <= n
            assert [str(d) for d in p.devices] == ([f"cuda:{r}" for r in range(w)] if on_gpus else ["cpu"] * w), \
                (machine, what, w, p.sentence)
            assert p.backend == ("nccl" if on_gpus else "gloo"), (machine, what, w)
    assert asked == ["cuda" if scope["W"] <= n else "cpu"], asked  # Triton's check for GPU ranks, C++ for CPU ones


@pytest.mark.parametrize("machine", ["2xT4"], indirect=True)
def test_on_two_t4s_the_issue_s_launches_land_where_it_says(machine):
    def where(w):
        p = launch_plan(w, plan=devices.plan_launch)
        return {d.type for d in p.devices}, p.backend
    assert where(2) == ({"cuda"}, "nccl")  # 16's FSDP, 18's save, 19's TP, 24's EP: both GPUs
    assert where(1) == ({"cuda"}, "nccl")  # the one-process references
    assert where(4) == ({"cpu"}, "gloo") and where(3) == ({"cpu"}, "gloo")  # the (2, 2) meshes, the 3-rank reshard


@pytest.mark.parametrize("machine", ["1xT4, 12.x driver"], indirect=True)
def test_gpus_this_torch_cannot_run_plan_every_launch_on_the_cpu_and_say_why(machine):
    p = launch_plan(2, plan=devices.plan_launch)
    assert p.backend == "gloo" and {d.type for d in p.devices} == {"cpu"} and "driver" in p.sentence


def test_a_plan_and_a_backend_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        launch_plan(2, backend="gloo", plan=devices.plan_launch)
    with pytest.raises(ValueError, match="places 2 ranks"):
        launch_plan(3, plan=devices.plan(2, n_gpus=0))


CUDA_CALLS: list = []  # what a rank called in torch.cuda; forked ranks fill their own copy


def _cuda_calls_rank(rank, world_size):
    return list(CUDA_CALLS)


def test_cpu_ranks_on_a_gpu_machine_make_no_cuda_call(monkeypatch):
    """A launch that needs more ranks than the 2 (mocked) GPUs runs on CPU ranks, which never call CUDA."""
    import helpers.launch as launch_module

    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(devices, "driver_check", lambda: None)
    monkeypatch.setattr(devices, "kernel_check", lambda: None)
    monkeypatch.setattr(launch_module, "cuda_canary", lambda device: None)  # no real GPU to start
    for name in ("set_device", "_lazy_init", "init", "current_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: CUDA_CALLS.append(_n))
    monkeypatch.setattr(torch._C, "_cuda_init", lambda: CUDA_CALLS.append("_cuda_init"), raising=False)
    results = launch(_cuda_calls_rank, 3, quiet=True, progress=False, timeout=120, plan=devices.plan_launch)
    assert results.plan.backend == "gloo" and {d.type for d in results.plan.devices} == {"cpu"}
    assert list(results) == [[], [], []]  # zero CUDA calls on every rank
    # the route the notebooks took before (backend="gloo" on GPUs that 3 ranks must share): set_device on each rank
    before = launch(_cuda_calls_rank, 3, quiet=True, progress=False, timeout=120, backend="gloo")
    assert all(calls == ["set_device"] for calls in before)
