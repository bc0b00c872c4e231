"""Start DDP ranks from a notebook cell by fork, and always clean up after them.

``launch(fn, world_size, *args)`` forks one process per rank, runs
``fn(rank, world_size, *args)`` in each inside an initialised process group,
and returns every rank's result. The parent (the notebook) watches the ranks
through one queue: their prints (``[rank N]``-prefixed), their ``report()``
events (drawn as a tqdm bar or live plot), their results and their errors.
Whatever happens (a rank raises, hangs, dies, or you interrupt the cell) every
rank and its DataLoader workers are killed, the port is released, and the
kernel can launch again.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_lib
import socket
import tempfile
import time

import torch

from . import Stopped, devices
from ._rank import child_main, rank_device, report  # noqa: F401  (rank_device, report: this module's API)
from ._watch import Watcher, drain, exit_text, failure_text, timeout_text
from .procs import _interrupts_deferred, cuda_canary, kill_all


class LaunchError(RuntimeError):
    """A launch failed; every rank has been stopped. ``port`` is the port it used."""

    port: int | None = None


class RankFailed(LaunchError):
    """A rank raised or died; the message carries its traceback."""


class RankTimeout(LaunchError, TimeoutError):
    """Ranks did not finish within ``timeout``; the message shows where they were stuck."""


class CudaInitialized(LaunchError):
    """CUDA was initialised in the notebook before forking, which forked ranks cannot survive."""


class CudaPoisoned(CudaInitialized):
    """A forked child cannot start CUDA, though CUDA looks uninitialised here (a backward pass ran)."""


class LaunchResult(list):
    """Every rank's return value, indexed by rank, plus what the launch used.

    Machinery behind launch (its return value); no notebook calls it directly.
    """

    def __init__(self, values, plan: devices.Plan, port: int, seconds: float):
        super().__init__(values)
        self.plan, self.port, self.seconds = plan, port, seconds


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prewarm() -> float:
    """Import, once, the ~900 modules the first DDP construction pulls in.

    Forked ranks inherit them, so a launch reaches its first step in about a
    tenth of a second instead of a couple of seconds per launch. Returns the
    seconds spent (close to 0 after the first call).
    Machinery behind launch; no notebook calls it directly.
    """
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it)
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    import torch.nn.parallel.distributed  # noqa: F401
    return time.perf_counter() - start


CUDA_FIX = (
    "CUDA is already initialised in this notebook (a tensor went to a GPU, or a torch.cuda call "
    "created a context), and a forked rank cannot use CUDA after that ('Cannot re-initialize CUDA "
    "in forked subprocess'). Fix: restart the kernel, and keep every CUDA call inside the function "
    "you launch. helpers.devices.gpu_count() is safe before launching (it asks NVML, never CUDA)."
)


POISON_FIX = (
    "A forked child could not start CUDA ({error}), although CUDA is not initialised in this notebook. "
    "The usual cause: this kernel ran a backward pass (autograd) before forking, even on the CPU; the autograd "
    "engine then asks the CUDA driver about the GPUs, and a child forked after that cannot initialise CUDA. "
    "Fix: restart the kernel, and run all training (references and baselines too) inside the function you "
    "launch; for one process use launch(fn, 1). If the error says 'no kernel image is available', this torch has "
    "no GPU code for this GPU instead: see helpers.devices.kernel_check() (notebook 00)."
)


def rank_limit() -> int:
    """The largest world size ``launch`` accepts without ``max_world_size``: max(8, 4 per core, the GPUs).

    Each rank is a whole process with its own copy of the model (and, on a GPU,
    its own CUDA context of several hundred MB); more than four ranks a core
    only take turns, so a larger number is almost always a typo.
    Machinery behind launch; no notebook calls it directly.
    """
    return max(8, 4 * devices.cpu_cores(), devices.gpu_count())


def _check_arguments(fn, world_size, timeout, max_world_size) -> None:
    """Refuse bad arguments before anything is opened or forked."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds (e.g. timeout=60), got {timeout!r}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
    limit = rank_limit() if max_world_size is None else max_world_size
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more ranks than this machine can sensibly run ({limit}: max(8, 4 per "
            f"CPU core, one per GPU) with {devices.cpu_cores()} cores and {devices.gpu_count()} GPUs). If you "
            f"mean it, pass max_world_size={world_size}.")


def launch_plan(world_size: int, backend: str | None = None, plan=None) -> devices.Plan:
    """The plan a launch runs on: ``plan`` where given, else ``devices.plan(world_size, backend=backend)``.

    ``plan`` is a ``devices.Plan`` for ``world_size`` ranks, or a function of the world size that returns one
    (``devices.plan_launch``: a GPU per rank over NCCL where the ranks fit the usable GPUs, else CPU ranks over
    gloo). A plan names its backend, so ``backend`` and ``plan`` together are refused.
    Machinery behind launch; no notebook calls it directly.
    """
    if plan is None:
        return devices.plan(world_size, backend=backend)
    if backend is not None:
        raise ValueError(f"pass backend={backend!r} or plan=, not both: a plan names its own backend")
    chosen = plan(world_size) if callable(plan) else plan
    if not isinstance(chosen, devices.Plan):
        raise TypeError(f"plan must be a devices.Plan or a function of the world size returning one, got {chosen!r}")
    if chosen.world_size != world_size:
        raise ValueError(f"the plan places {chosen.world_size} ranks, but world_size={world_size}")
    return chosen


def launch(fn, world_size: int, *args, timeout: float = 300.0, backend: str | None = None,
           init: bool = True, on_event=None, progress: bool = True, quiet: bool = False,
           stop=None, max_world_size: int | None = None, plan=None) -> LaunchResult:
    """Fork ``world_size`` ranks running ``fn(rank, world_size, *args)``; return their results.

    Each rank gets the env vars torchrun would set and, when ``init``, its
    planned device (``helpers.devices.plan``, bound with
    ``torch.cuda.set_device``) and an initialised process group. With
    ``init=False`` ``fn`` does both itself, as a torchrun script does:
    launch binds no device (``rank_device()`` still names the planned one),
    so a rank that uses other GPUs opens no context on the planned one.
    ``plan`` places the ranks instead of ``devices.plan``: a ``devices.Plan``,
    or a function of the world size such as ``devices.plan_launch`` (a GPU
    per rank over NCCL where the ranks fit the GPUs, else CPU ranks over gloo,
    which never touch CUDA); ``launch_plan`` says what a launch will use.
    Results come back as a list indexed by rank, tensors moved to the CPU.

    Each rank runs with ONE torch thread. This is not a tuning choice: a rank
    forked after the notebook has used torch's CPU thread pool hangs forever
    with more (GNU OpenMP's pool does not survive fork), so it cannot be
    changed here. Ranks are the parallelism.

    Failures raise in the cell after every rank is killed: ``RankFailed``
    (a rank raised or died; its traceback is shown), ``RankTimeout`` (not
    done after ``timeout`` seconds, which the process group's own timeout
    outlasts by ``GROUP_TIMEOUT_MARGIN_S``; each stuck rank's stack is shown, and
    over NCCL between GPUs ``devices.nccl_p2p_hint()``),
    ``CudaInitialized`` (refused before forking; ``CudaPoisoned`` when a
    forked canary cannot start CUDA, the trace of a backward pass in this
    process), ``helpers.Stopped`` (the ``stop`` event was set: a panel's Stop
    button) or ``KeyboardInterrupt``. World sizes above ``rank_limit()`` are
    refused unless ``max_world_size`` allows them.
    ``on_event(rank, metrics)`` receives each ``report(...)`` in the parent;
    ``progress`` draws a tqdm bar from rank 0's ``step``/``total`` reports.
    Introduced in notebooks/04-ddp.ipynb.
    """
    _check_arguments(fn, world_size, timeout, max_world_size)
    plan = launch_plan(world_size, backend=backend, plan=plan)
    if torch.cuda.is_initialized():
        raise CudaInitialized(CUDA_FIX)
    if "fork" not in mp.get_all_start_methods():
        raise LaunchError("this OS cannot fork (Windows): run the training function from a script with torchrun instead")
    gpu = next((d for d in plan.devices if d.type == "cuda"), None)
    if gpu is not None:
        error = cuda_canary(gpu)  # ~0.4 s on an H100: cheap next to ranks that would all fail
        if error is not None:
            raise CudaPoisoned(POISON_FIX.format(error=error))
    prewarm()
    port = free_port()
    if not quiet:
        print(f"launch: {plan.sentence}")
    ctx = mp.get_context("fork")
    events = ctx.Queue()
    stack_files = [tempfile.TemporaryFile() for _ in range(world_size)]
    result_files = [tempfile.TemporaryFile() for _ in range(world_size)]
    procs: list = []
    watcher = Watcher(world_size, on_event, progress, result_files)
    start = time.perf_counter()
    try:
        # a Ctrl-C inside fork() would be swallowed by an at-fork hook (the ■ is lost, the run goes on), or would
        # land before the new rank is in procs, where the clean-up cannot see it: hold it until all ranks are in
        with _interrupts_deferred():
            for rank in range(world_size):
                proc = ctx.Process(target=child_main, name=f"rank-{rank}",
                                   args=(fn, rank, world_size, args, plan, port, events,
                                         stack_files[rank], result_files[rank], init, timeout, os.getpid()))
                proc.start()
                procs.append(proc)
        _supervise(procs, events, watcher, start, timeout, stack_files, stop)
        return LaunchResult(watcher.results, plan, port, time.perf_counter() - start)
    except RankTimeout as e:
        e.port = port
        if plan.backend == "nccl" and len({d for d in plan.devices if d.type == "cuda"}) >= 2:
            # NCCL between GPUs that report peer-to-peer access they do not have waits forever on its first
            # collective: the timeout is the only symptom
            e.args = (f"{e.args[0]}\n{devices.nccl_p2p_hint()}",)
        raise
    except LaunchError as e:
        e.port = port
        raise
    except KeyboardInterrupt:
        print(f"launch: interrupted; stopped all {world_size} ranks")
        raise
    except Stopped:
        if not quiet:
            print(f"launch: stopped on request; stopped all {world_size} ranks")
        raise
    finally:
        with _interrupts_deferred():  # a second Ctrl-C must not cut the clean-up short
            kill_all(procs)  # first: nothing after it (a progress bar closing, say) can keep a rank alive
            watcher.close()
            events.close()
            events.cancel_join_thread()
            for f in stack_files + result_files:
                f.close()


def _supervise(procs, events, watcher: Watcher, start: float, timeout: float, stack_files, stop) -> None:
    grace = None  # once something fails, listen a little longer to find the first cause
    while len(watcher.done) < len(procs) or watcher.failures:
        if stop is not None and stop.is_set():
            raise Stopped(f"stopped on request after {time.perf_counter() - start:.1f} s; "
                          f"all {len(procs)} ranks were stopped", partial=dict(watcher.last))
        try:
            watcher.handle(events.get(timeout=0.05))
        except queue_lib.Empty:
            for r, p in enumerate(procs):
                if r not in watcher.done and p.exitcode is not None:
                    drain(events, watcher, seconds=0.5)  # its last words may still be in the pipe
                    if r not in watcher.done:
                        watcher.failures = {r: f"rank {r} died without reporting an error: "
                                               f"{exit_text(p.exitcode)}", **watcher.failures}
                        watcher.done.add(r)
        if watcher.failures:
            grace = grace or time.perf_counter() + 0.5
            if time.perf_counter() > grace or len(watcher.done) == len(procs):
                raise RankFailed(failure_text(watcher.failures))
        elif time.perf_counter() > start + timeout:
            stuck = [r for r in range(len(procs)) if r not in watcher.done]
            raise RankTimeout(timeout_text(stuck, timeout, procs, watcher.last, stack_files))
