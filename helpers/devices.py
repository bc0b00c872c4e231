"""What this machine has, read without initialising CUDA, and where ranks go.

Nothing here creates a CUDA context: GPU names, memory and counts come from NVML
(torch's own NVML count, see ``helpers/__init__``), so a notebook can look at its
hardware and still fork training ranks. Where NVML cannot count (MIG slices, no
NVML library), the driver is older than torch's CUDA build, or the build holds no
code for a GPU's compute capability, the GPUs are not planned on, and
``gpu_problem()`` says why, instead of letting a later fork fail.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
from dataclasses import dataclass, field

import torch

from .checks import positive_int
from .procs import ChildDied, call_in_child


@dataclass(frozen=True)
class GPU:
    """One visible GPU as NVML reports it."""

    index: int
    name: str
    memory_gib: float | None  # None when NVML cannot be read


@dataclass(frozen=True)
class Machine:
    """What ``describe()`` found: versions, GPUs, cores, shared memory, peer links."""

    torch_version: str
    cuda_build: str | None
    gpus: tuple[GPU, ...]
    cpu_cores: int
    shm_gib: float | None
    peer_access: dict[tuple[int, int], bool] = field(default_factory=dict)

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the whole box).

    Introduced in notebooks/00-check-environment.ipynb.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def gpu_count() -> int:
    """Number of CUDA GPUs ranks can use, counted without creating a CUDA context (0 where ``gpu_problem()`` says why).

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    return _usable()[0]


def gpu_problem() -> str | None:
    """Why GPUs that this machine seems to have are not used (MIG slices, no NVML, an old driver, no kernels), else None.

    Machinery behind devices.plan (its sentence); no notebook calls it directly.
    """
    return _usable()[1]


def visible_gpu_count() -> int:
    """GPUs that NVML sees under ``CUDA_VISIBLE_DEVICES``, usable or not (0 where NVML cannot count).

    Machinery behind devices.describe; no notebook calls it directly.
    """
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    return max(_nvml_count(), 0)


NO_COUNT = (
    "NVML cannot count the GPUs here ({why}), and asking CUDA instead would start it in this process, after which "
    "no forked rank can use a GPU; so ranks run on the CPU. To train on the GPUs, name them by index in "
    "CUDA_VISIBLE_DEVICES (e.g. 0,1) when NVML is installed, or run the training as a script with torchrun "
    "(notebook 14)."
)


def _nvml_count() -> int:
    """torch's own NVML count under CUDA_VISIBLE_DEVICES: -1 where NVML is missing or the mask holds MIG names."""
    if not torch.cuda._is_compiled():
        return 0
    counter = getattr(torch.cuda, "_device_count_nvml", None)
    return counter() if counter is not None else -1


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _usable() -> tuple[int, str | None]:
    """(GPUs ranks may use, why not where some are there but unusable); never starts CUDA."""
    if not torch.cuda._is_compiled():
        return 0, None
    if torch.cuda.is_initialized():  # too late for fork-safety anyway; launch refuses with its own message
        return torch.cuda.device_count(), None
    n = _nvml_count()
    if n < 0:
        # torch would now fall back to cudaGetDeviceCount, which poisons every later fork: do not ask it
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if "MIG-" in visible:
            return 0, NO_COUNT.format(why=f"CUDA_VISIBLE_DEVICES names MIG slices: {visible}")
        if _nvidia_driver_present():
            return 0, NO_COUNT.format(why="the NVIDIA driver is there, but NVML (libnvidia-ml.so.1) is not")
        return 0, None  # no NVIDIA driver: a CPU machine
    if n == 0:
        return 0, None
    warning = driver_check() or kernel_check()
    if warning is not None:
        return 0, f"{n} GPU{'s' if n > 1 else ''} not used: {warning}"
    return n, None


def _nvml_gpus(n: int) -> tuple[list[GPU], dict[tuple[int, int], bool]]:
    """Names, memory and peer access from NVML; placeholders where it fails."""
    gpus = [GPU(i, "unknown (NVML unreadable)", None) for i in range(n)]
    peers: dict[tuple[int, int], bool] = {}
    if n == 0:
        return gpus, peers
    with _nvml() as pynvml:
        if pynvml is None:
            return gpus, peers
        try:
            _read_nvml(pynvml, n, gpus, peers)
        except (pynvml.NVMLError, AttributeError):
            pass  # keep whatever was read; older drivers lack P2P queries
    return gpus, peers


@contextlib.contextmanager
def _nvml():
    """pynvml, initialised, or None where there is no NVML library or driver."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _read_nvml(pynvml, n: int, gpus: list, peers: dict) -> None:
    """Fill in names, memory and peer access for the first ``n`` visible GPUs."""
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _nvml_indices(n)]
    for i, h in enumerate(handles):
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
        gpus[i] = GPU(i, name, round(mem, 1))
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i != j:
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ)
                peers[(i, j)] = status == pynvml.NVML_P2P_STATUS_OK


def _nvml_indices(n: int) -> list[int]:
    """NVML counts every GPU in the box; map CUDA_VISIBLE_DEVICES onto it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(n))
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if all(v.isdigit() for v in ids):
        return [int(v) for v in ids[:n]]
    return list(range(n))  # UUIDs: keep CUDA's order as the best guess


def driver_check(torch_cuda: str | None = None, driver_cuda: str | None = "read") -> str | None:
    """A warning when this GPU driver is too old for torch's CUDA build, else None.

    The driver's newest CUDA comes from NVML (``driver_cuda`` overrides it, for
    tests). Only the major versions are compared: by CUDA's minor-version
    compatibility a build for 12.8 runs on any 12.x driver (>= 525) and one for
    13.2 on any 13.x driver (>= 580), which is what Kaggle's and Colab's drivers
    rely on (https://docs.nvidia.com/deploy/cuda-compatibility/). A driver of an
    older major version reports GPUs and then fails on first use, so the
    notebooks check before training.
    Introduced in notebooks/00-check-environment.ipynb.
    """
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    if driver_cuda == "read":
        driver_cuda = _nvml_cuda_version()
    if not torch_cuda or not driver_cuda:
        return None
    need, have = _version(torch_cuda)[0], _version(driver_cuda)[0]
    if have >= need:
        return None
    return (f"this GPU driver supports CUDA up to {driver_cuda}, but torch was built for CUDA {torch_cuda}, a newer "
            f"major version: GPU work will fail. Fix: update the NVIDIA driver to one for CUDA {need}.x, or install a "
            f"torch build for CUDA {have}.x if torch still ships one (pytorch.org's install selector and its "
            "'previous versions' page list them), then restart the kernel.")


def kernel_check(capabilities: list | None = None, archs: list[str] | None = None) -> str | None:
    """A warning when torch's CUDA build holds no code that a visible GPU can run, else None.

    ``capabilities`` are NVML's (major, minor) per visible GPU (None where unreadable);
    ``archs`` is the build's list as ``torch.cuda.get_arch_list()`` gives it (``sm_75 ...
    sm_120`` for the CUDA 13.2 wheel); both override the readings, for tests. A cubin
    ``sm_XY`` runs on capability X.Z for Z >= Y, its own major only (torch's
    ``_check_capability`` and ``_CompatInterval`` in torch/cuda/__init__.py; torch also
    excepts Jetson's integrated GPUs, which this does not); PTX ``compute_XY`` is compiled by
    the driver for X.Y and every later GPU. A GPU with neither (a P100 or V100 under the
    13.x wheels) starts CUDA and allocates, then fails at its first kernel (launch's canary
    runs one and refuses it) with "no kernel image is available for execution on the device".
    Introduced in notebooks/00-check-environment.ipynb.
    """
    if torch.version.cuda is None:
        return None  # a CPU or ROCm build: no CUDA arch list to compare (torch's own check skips ROCm too)
    if capabilities is None:
        capabilities = _capabilities(max(_nvml_count(), 0))
    if all(c is None for c in capabilities):
        return None  # nothing to compare, and no need to read the build's list
    archs = list(_built_archs() if archs is None else archs)
    if not archs:
        return None
    bad = [(i, c) for i, c in enumerate(capabilities) if c is not None and not _runs_on(archs, c)]
    if not bad:
        return None
    gpus = ", ".join(f"cuda:{i} (compute capability {c[0]}.{c[1]})" for i, c in bad)
    major, minor = bad[0][1]
    return (f"torch {torch.__version__} holds GPU code for {' '.join(archs)} only, none of which runs on {gpus}: "
            "every rank there would fail with 'no kernel image is available for execution on the device'. Fix: "
            f"{_build_for(major * 10 + minor)}, then restart the kernel; or show the ranks only GPUs this torch can run, "
            "with CUDA_VISIBLE_DEVICES (notebook 13).")


def _capabilities(n: int) -> list[tuple[int, int] | None]:
    """NVML's compute capability of each of the first ``n`` visible GPUs, in one NVML session (None: unreadable)."""
    with _nvml() as nvml:
        if nvml is None:
            return [None] * n
        out = []
        for index in _nvml_indices(n):
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(nvml.nvmlDeviceGetHandleByIndex(index))
                out.append((int(major), int(minor)))
            except (nvml.NVMLError, AttributeError):
                out.append(None)
        return out + [None] * (n - len(out))


def _runs_on(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether any entry of a build's arch list (``sm_XY`` cubins, ``compute_XY`` PTX) runs on ``capability``."""
    major, minor = capability
    for arch in archs:
        kind, _, number = arch.partition("_")
        number = number.rstrip("af")  # sm_90a, sm_100f: arch- and family-specific variants of 9.0, 10.0
        if not number.isdigit():
            continue
        code = int(number)
        if kind == "compute" and major * 10 + minor >= code:
            return True
        if kind == "sm" and code // 10 == major and code % 10 <= minor:
            return True
    return False


def _build_for(cc: int) -> str:
    """The fix for a GPU of capability ``cc``: torch's own table of its release builds names one where it has it."""
    table = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {})  # {CUDA: codes} in 2.11, {CUDA: {host: codes}} in 2.15
    host = "aarch64" if platform.machine().lower() == "aarch64" else "x86_64"
    codes = {cuda: ccs.get(host, ()) if isinstance(ccs, dict) else ccs for cuda, ccs in table.items()}
    fits = [cuda for cuda, ccs in codes.items() if _runs_on([f"sm_{code}" for code in ccs], (cc // 10, cc % 10))]
    version = torch.__version__.split("+")[0]
    if fits:
        tag = "cu" + fits[0].replace(".", "")
        return (f"install the torch build for CUDA {fits[0]}, which has code for it (pip install torch=={version} "
                f"--index-url https://download.pytorch.org/whl/{tag})")
    return (f"install a torch build with code for sm_{cc} (pytorch.org's install selector and its 'previous "
            "versions' page list the CUDA builds; older CUDA versions keep older GPUs)")


@functools.lru_cache(maxsize=1)
def _built_archs() -> tuple[str, ...]:
    """The build's arch list, read once in a forked child: the call behind ``get_arch_list()`` starts no CUDA,
    but it registers torch's at-fork handler (``poison_fork`` in torch/csrc/cuda/Module.cpp), after which every
    child this process forks is "in a bad fork" and cannot start CUDA, launch's ranks included."""
    if not torch.cuda._is_compiled():
        return ()
    try:
        flags = call_in_child(_arch_flags, timeout=60, name="torch-arch-list")
    except (TimeoutError, ChildDied):
        return ()  # unknown: nothing is planned off for it
    return tuple(flags.split()) if flags else ()


def _arch_flags() -> str | None:
    return torch._C._cuda_getArchFlags()  # a string fixed when torch was compiled


def nccl_p2p_hint(peer_access: dict[tuple[int, int], bool] | None = None) -> str:
    """What to try when NCCL hangs between GPUs: NCCL_P2P_DISABLE=1, with NVML's answer for each GPU pair.

    Consumer cards and some virtual machines (Kaggle's 2x T4 among them) report
    peer-to-peer access that does not work, and NCCL then waits forever on its
    first call: ranks at their first collective, ``nn.DataParallel`` (one process,
    NCCL broadcasts in ``replicate``) at its first forward. ``NCCL_P2P_DISABLE=1``
    sends the traffic through host memory instead
    (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).
    Introduced in notebooks/00-check-environment.ipynb.
    """
    peers = describe().peer_access if peer_access is None else peer_access
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "NCCL_P2P_DISABLE=1 is already set, so peer-to-peer is not the cause"
    said = ", ".join(f"cuda:{a}->cuda:{b} {'yes' if ok else 'no'}" for (a, b), ok in sorted(peers.items()))
    nvml = f"NVML reports peer access {said}" if said else "NVML could not report peer access here"
    return (f"if NCCL hangs at its first call (ranks at their first collective, DataParallel at its first forward), "
            f"try peer-to-peer off: os.environ['NCCL_P2P_DISABLE'] = '1' in the notebook before the first launch or "
            f"DataParallel call (ranks inherit it), or export it for torchrun ({nvml})")


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def _nvml_cuda_version() -> str | None:
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            v = nvml.nvmlSystemGetCudaDriverVersion()
        except nvml.NVMLError:
            return None
        return f"{v // 1000}.{(v % 1000) // 10}"


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU computes bfloat16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm's BF16 extension).

    Without it, bf16 autocast on the CPU is emulated and runs several times *slower* than fp32 (about 5.5x
    slower was seen on a 2-core AVX2 server), so a notebook times a few steps before it sizes a bf16 run.
    ``cpuinfo`` is read as text; by default ``$MULTIGPU_CPUINFO`` or ``/proc/cpuinfo`` (a test points the
    variable at a copy with the flags masked, to run a notebook's no-bf16 route on a CPU that has bf16).
    Machinery behind devices.has_bf16; no notebook calls it directly.
    """
    cpuinfo = cpuinfo or os.environ.get("MULTIGPU_CPUINFO") or "/proc/cpuinfo"
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def gpu_capability(index: int) -> tuple[int, int] | None:
    """Compute capability of visible GPU ``index`` from NVML (no CUDA context), or None where it cannot be read.

    Machinery behind devices.has_bf16; no notebook calls it directly.
    """
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(_nvml_indices(index + 1)[index])
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        except (nvml.NVMLError, IndexError, AttributeError):
            return None
        return int(major), int(minor)


def has_bf16(device) -> bool:
    """True when ``device`` has bfloat16 hardware: a CPU with BF16 instructions, a GPU of compute capability ≥ 8.0.

    ``torch.cuda.is_bf16_supported()`` answers True on a T4, V100 or RTX 20xx too (it counts emulation, and it
    starts CUDA in the notebook). A bf16 ConvNet runs there, but slowly: torch skips cuDNN for bf16 convolutions
    below compute capability 8.0 (``ConvParams::use_cudnn``, aten/src/ATen/native/Convolution.cpp) and runs its own
    kernels. Those GPUs train faster in fp16 with a GradScaler. An unreadable capability counts as no bf16.
    Introduced in notebooks/08-large-batch.ipynb.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_has_bf16()
    if device.type != "cuda":
        return False
    capability = gpu_capability(device.index or 0)
    return capability is not None and capability >= (8, 0)


def shm_gib() -> float | None:
    """Size of /dev/shm in GiB (DataLoader workers pass batches through it).

    Introduced in notebooks/00-check-environment.ipynb.
    """
    try:
        return round(shutil.disk_usage("/dev/shm").total / 2**30, 1)
    except OSError:
        return None


def describe() -> Machine:
    """Versions, GPUs (names, memory, peer access), CPU cores and /dev/shm.

    Introduced in notebooks/00-check-environment.ipynb.
    """
    gpus, peers = _nvml_gpus(visible_gpu_count())
    return Machine(
        torch_version=torch.__version__,
        cuda_build=torch.version.cuda,
        gpus=tuple(gpus),
        cpu_cores=cpu_cores(),
        shm_gib=shm_gib(),
        peer_access=peers,
    )


def pick_device(index: int = 0) -> torch.device:
    """``cuda:index`` if that GPU exists, else the best that does (cuda:0, then CPU).

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    positive_int("GPU index", index, minimum=0)
    n = gpu_count()
    if index < n:
        return torch.device("cuda", index)
    return torch.device("cuda", 0) if n else torch.device("cpu")


@dataclass(frozen=True)
class Plan:
    """Where each rank runs, over which backend, and one sentence saying what is real."""

    devices: tuple[torch.device, ...]  # devices[rank]
    backend: str                       # "nccl" or "gloo"
    kind: str                          # "cpu", "shared-gpu", "multi-gpu", "partly-shared"
    sentence: str                      # what is real and what is stood in for

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def __str__(self) -> str:
        return self.sentence


def plan(world_size: int, n_gpus: int | None = None, backend: str | None = None) -> Plan:
    """Place ``world_size`` ranks on this machine's devices and pick a backend.

    NCCL only when every rank has a GPU of its own; gloo for CPU ranks and for
    ranks that share a GPU (NCCL refuses two ranks on one GPU). ``n_gpus``
    overrides the count (for tests and "what if" questions); ``backend`` forces
    one, and an impossible choice raises.

    Introduced in notebooks/00-check-environment.ipynb.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n, problem = _usable() if n_gpus is None else (positive_int("n_gpus", n_gpus, minimum=0), None)
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")

    if n == 0:
        devices = tuple(torch.device("cpu") for _ in range(world_size))
        kind = "cpu"
        cores = cpu_cores()
        if world_size == 1:
            what = "1 rank on CPU (gloo): one process, the baseline the others are measured against"
        else:
            what = (f"{world_size} ranks on CPU (gloo): the mechanics are real, the speed-up is CPU cores', "
                    "not GPUs'")
        if world_size > cores:
            what += f"; {world_size} ranks on {cores} cores take turns, so expect no more than {cores} ranks' speed"
        if problem:
            what += f". GPUs not used: {problem}"
    else:
        devices = tuple(torch.device("cuda", r % n) for r in range(world_size))
        if world_size <= n:
            kind = "multi-gpu"
            what = f"{world_size} rank{'s' if world_size > 1 else ''}, each on its own GPU (nccl): real multi-GPU"
        elif n == 1:
            kind = "shared-gpu"
            what = (f"{world_size} ranks share cuda:0 (gloo, since NCCL refuses two ranks on one GPU): "
                    "the mechanics are real, no speed-up is expected")
        else:
            kind = "partly-shared"
            shared = sorted({r % n for r in range(n, world_size)})
            names = ", ".join(f"cuda:{g}" for g in shared)
            what = (f"{world_size} ranks on {n} GPUs, round-robin; {names} {'carries' if len(shared) == 1 else 'carry'} "
                    "more than one rank (gloo): "
                    "the mechanics are real, the speed-up is at most the GPUs'")

    best = "nccl" if kind == "multi-gpu" else "gloo"
    if backend == "nccl" and best != "nccl":
        raise ValueError(
            f"backend='nccl' needs one GPU per rank, but this plan is: {what}. "
            "Use backend='gloo' (or None), or ask for fewer ranks."
        )
    chosen = backend or best
    if chosen != best:  # only gloo can be forced: on ranks with a GPU each, where NCCL is the default
        each = "ranks, each on its own GPU" if world_size > 1 else "rank on a GPU"
        what = (f"{world_size} {each}, joined over gloo "
                "(asked for; NCCL is the default here): the GPUs compute, the collectives are gloo's, not NCCL's")
    return Plan(devices=devices, backend=chosen, kind=kind, sentence=what)


def plan_launch(world_size: int, n_gpus: int | None = None) -> Plan:
    """One launch's plan: a GPU per rank over NCCL where ``world_size`` fits the usable GPUs, else all on the CPU (gloo).

    Unlike ``plan``, ranks never share a GPU: a launch that needs more ranks than there are GPUs runs every rank on
    the CPU, and its sentence says why. Each launch of a notebook is planned on its own, so on 2 GPUs a launch of 2
    ranks uses both GPUs and a launch of 4 runs on the CPU. Pass it to ``launch(..., plan=devices.plan_launch)``.
    ``n_gpus`` overrides the usable count (for tests and "what if" questions).
    Introduced in notebooks/16-fsdp.ipynb.
    """
    n, problem = _usable() if n_gpus is None else (positive_int("n_gpus", n_gpus, minimum=0), None)
    if isinstance(world_size, int) and not isinstance(world_size, bool) and 1 <= world_size <= n:
        return plan(world_size, n_gpus=n)
    cpu = plan(world_size, n_gpus=0)  # validates world_size
    if problem:
        why = f"GPUs not used: {problem}"
    elif n:
        why = (f"on the CPU, not the GPUs: {world_size} ranks need a GPU each and {n} "
               f"{'is' if n == 1 else 'are'} usable here")
    else:
        return cpu
    return Plan(devices=cpu.devices, backend=cpu.backend, kind=cpu.kind, sentence=f"{cpu.sentence}; {why}")
