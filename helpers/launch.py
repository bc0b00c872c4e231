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

import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import signal
import socket
import tempfile
import time

import torch

from . import devices
from .procs import _interrupts_deferred, kill_all
from ._rank import child_main, rank_device, report  # noqa: F401  (rank_device, report: this module's API)


class LaunchError(RuntimeError):
    """A launch failed; every rank has been stopped. ``port`` is the port it used."""

    port: int | None = None


class RankFailed(LaunchError):
    """A rank raised or died; the message carries its traceback."""


class RankTimeout(LaunchError, TimeoutError):
    """Ranks did not finish within ``timeout``; the message shows where they were stuck."""


class CudaInitialized(LaunchError):
    """CUDA was initialised in the notebook before forking, which forked ranks cannot survive."""


class LaunchResult(list):
    """Every rank's return value, indexed by rank, plus what the launch used.

    Introduced in notebooks/03-ddp-fork.ipynb.
    """

    def __init__(self, values, plan: devices.Plan, port: int, seconds: float):
        super().__init__(values)
        self.plan, self.port, self.seconds = plan, port, seconds


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prewarm() -> float:
    """Import, once, the ~900 modules the first DDP construction pulls in.

    Forked ranks inherit them, so a launch reaches its first step in about a
    tenth of a second instead of a couple of seconds per launch. Returns the
    seconds spent (close to 0 after the first call).
    Introduced in notebooks/03-ddp-fork.ipynb.
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
    "you launch. torch.cuda.is_available() and device_count() are safe before launching."
)


def launch(fn, world_size: int, *args, timeout: float = 300.0, backend: str | None = None,
           init: bool = True, on_event=None, progress: bool = True, quiet: bool = False) -> LaunchResult:
    """Fork ``world_size`` ranks running ``fn(rank, world_size, *args)``; return their results.

    Each rank gets the device ``helpers.devices.plan`` gives it (with
    ``torch.cuda.set_device``), the env vars torchrun would set, and, when
    ``init``, an initialised process group; with ``init=False`` ``fn`` calls
    ``init_process_group`` itself, as a torchrun script does. Results come
    back as a list indexed by rank, tensors moved to the CPU.

    Each rank runs with ONE torch thread. This is not a tuning choice: a rank
    forked after the notebook has used torch's CPU thread pool hangs forever
    with more (GNU OpenMP's pool does not survive fork), so it cannot be
    changed here. Ranks are the parallelism.

    Failures raise in the cell after every rank is killed: ``RankFailed``
    (a rank raised or died; its traceback is shown), ``RankTimeout`` (not
    done after ``timeout`` seconds; each stuck rank's stack is shown),
    ``CudaInitialized`` (refused before forking), or ``KeyboardInterrupt``.
    ``on_event(rank, metrics)`` receives each ``report(...)`` in the parent;
    ``progress`` draws a tqdm bar from rank 0's ``step``/``total`` reports.
    Introduced in notebooks/03-ddp-fork.ipynb.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    plan = devices.plan(world_size, backend=backend)
    if torch.cuda.is_initialized():
        raise CudaInitialized(CUDA_FIX)
    if "fork" not in mp.get_all_start_methods():
        raise LaunchError("this OS cannot fork (Windows): run the training function from a script with torchrun instead")
    prewarm()
    port = free_port()
    if not quiet:
        print(f"launch: {plan.sentence}")
    ctx = mp.get_context("fork")
    events = ctx.Queue()
    stack_files = [tempfile.TemporaryFile() for _ in range(world_size)]
    procs: list = []
    watcher = _Watcher(world_size, on_event, progress)
    start = time.perf_counter()
    try:
        for rank in range(world_size):
            proc = ctx.Process(target=child_main, name=f"rank-{rank}",
                               args=(fn, rank, world_size, args, plan, port, events,
                                     stack_files[rank], init, timeout, os.getpid()))
            proc.start()
            procs.append(proc)
        _supervise(procs, events, watcher, start, timeout, stack_files)
        return LaunchResult(watcher.results, plan, port, time.perf_counter() - start)
    except LaunchError as e:
        e.port = port
        raise
    except KeyboardInterrupt:
        print(f"launch: interrupted; stopped all {world_size} ranks")
        raise
    finally:
        with _interrupts_deferred():  # a second Ctrl-C must not cut the clean-up short
            watcher.close()
            kill_all(procs)
            events.close()
            events.cancel_join_thread()
            for f in stack_files:
                f.close()


class _Watcher:
    """The parent's side of the queue: prints, events, progress, results."""

    def __init__(self, world_size, on_event, progress):
        self.results = [None] * world_size
        self.done: set[int] = set()
        self.failures: dict[int, str] = {}  # rank → what went wrong, in order of arrival
        self.last: dict[int, dict] = {}
        self.on_event, self.progress, self.bar = on_event, progress, None

    def handle(self, msg) -> None:
        kind, rank = msg[0], msg[1]
        if kind == "print":
            print(f"[rank {rank}] {msg[2]}")
        elif kind == "event":
            self.last[rank] = msg[2]
            self._draw(rank, msg[2])
            if self.on_event is not None:
                self.on_event(rank, msg[2])
        elif kind == "result":
            self.results[rank] = pickle.loads(msg[2])
            self.done.add(rank)
        elif kind == "error":
            self.failures[rank] = f"rank {rank} failed: {msg[2]}\n--- traceback from rank {rank} ---\n{msg[3]}"
            self.done.add(rank)

    def _draw(self, rank, metrics) -> None:
        if not self.progress or rank != 0 or "total" not in metrics or "step" not in metrics:
            return
        if self.bar is None:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=int(metrics["total"]), desc="rank 0", unit="step")
        self.bar.n = int(metrics["step"]) + 1
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if k not in ("step", "total", "t") and isinstance(v, float)}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _supervise(procs, events, watcher: _Watcher, start: float, timeout: float, stack_files) -> None:
    grace = None  # once something fails, listen a little longer to find the first cause
    while len(watcher.done) < len(procs) or watcher.failures:
        try:
            watcher.handle(events.get(timeout=0.05))
        except queue_lib.Empty:
            for r, p in enumerate(procs):
                if r not in watcher.done and p.exitcode is not None:
                    _drain(events, watcher, seconds=0.5)  # its last words may still be in the pipe
                    if r not in watcher.done:
                        watcher.failures = {r: f"rank {r} died without reporting an error: "
                                               f"{_exit_text(p.exitcode)}", **watcher.failures}
                        watcher.done.add(r)
        if watcher.failures:
            grace = grace or time.perf_counter() + 0.5
            if time.perf_counter() > grace or len(watcher.done) == len(procs):
                raise RankFailed(_failure_text(watcher.failures))
        elif time.perf_counter() > start + timeout:
            stuck = [r for r in range(len(procs)) if r not in watcher.done]
            raise RankTimeout(_timeout_text(stuck, timeout, procs, watcher.last, stack_files))


def _failure_text(failures: dict[int, str]) -> str:
    """The first cause in full; what followed from it (peers losing their connection) in one line each."""
    first, *rest = failures.values()
    if rest:
        first += "\nThen, probably as a consequence:\n" + "\n".join(
            "  " + text.split("\n--- traceback", 1)[0][:300] for text in rest)
    return first


def _drain(events, watcher: _Watcher, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        try:
            watcher.handle(events.get(timeout=0.05))
        except queue_lib.Empty:
            return


def _exit_text(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = " (the out-of-memory killer sends this)" if name == "SIGKILL" else ""
        return f"killed by {name}{why}"
    return f"exit code {code}"


def _timeout_text(stuck, timeout, procs, last, stack_files) -> str:
    for r in stuck:
        if procs[r].exitcode is None:
            os.kill(procs[r].pid, signal.SIGUSR1)  # each rank's faulthandler writes its stack
    time.sleep(0.3)
    parts = [f"ranks {stuck} did not finish in time (timeout={timeout:g} s); all ranks were stopped. A rank "
             "waiting in a collective (all_reduce, barrier) usually means another rank skipped it or died; "
             "if the work is just slow, pass a larger timeout to launch."]
    for r in stuck:
        f = stack_files[r]
        f.seek(0)
        lines = f.read().decode(errors="replace").strip().splitlines()
        # most recent call first; what lies below the rank's entry point is the parent's fork
        end = next((i for i, line in enumerate(lines) if "_rank.py" in line), len(lines) - 1)
        stack = "\n".join(lines[: end + 1]) or "(no stack: the rank never got going)"
        parts.append(f"--- rank {r}, last report {last.get(r, 'none')} ---\n{stack}")
    return "\n".join(parts)
