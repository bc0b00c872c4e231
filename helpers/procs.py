"""Process chores for the launcher: kill whole process groups, read children's stderr, defer Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import tempfile
import threading
import time
import warnings

import psutil


def kill_all(procs) -> None:
    """SIGKILL each rank's whole process group (its DataLoader workers too) and wait until they are gone.

    Machinery behind launch; no notebook calls it directly.
    """
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # each rank leads its own group
        except (ProcessLookupError, PermissionError):
            pass
        if proc.exitcode is None:
            proc.kill()
    for proc in started:
        proc.join(timeout=10)
    deadline = time.monotonic() + 5
    while any(_group_alive(proc.pid) for proc in started) and time.monotonic() < deadline:
        time.sleep(0.01)  # SIGKILL is delivered at once, but dying takes a few milliseconds
    left = [proc.pid for proc in started if _group_alive(proc.pid)]
    if left:  # SIGKILL waits for a process stuck in the kernel (a GPU driver call, a hung disk): say so, never hide it
        warnings.warn(f"the process groups of pids {left} were sent SIGKILL but still run after 15 s (stuck in the "
                      "operating system, e.g. a GPU driver call); check nvidia-smi / ps, and restart the kernel "
                      "if they hold a GPU", RuntimeWarning, stacklevel=2)


class ChildDied(RuntimeError):
    """A child forked by ``call_in_child`` ended without answering; ``exitcode`` says how."""

    def __init__(self, exitcode):
        super().__init__(f"the child died without answering (exit code {exitcode})")
        self.exitcode = exitcode


def call_in_child(fn, *args, timeout: float = 60.0, name: str = "child"):
    """Run ``fn(*args)`` in a forked child and return what it returned (pickled back through a pipe).

    Fork, so a function defined in the notebook works. ``fn`` should catch its
    own errors and return them: a child that raises, or returns something
    unpicklable, ends without answering (``ChildDied``); one still busy after
    ``timeout`` seconds is killed (``TimeoutError``). The child leaves with
    ``os._exit``, never through a notebook kernel's exit handlers. It is also
    behind launch's CUDA canary.
    Introduced in notebooks/05-launching-from-a-notebook.ipynb.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_answer, args=(fn, args, writer), name=name)
    try:
        with _interrupts_deferred():  # a Ctrl-C inside fork() would be swallowed by an at-fork hook (see launch)
            proc.start()
    finally:
        writer.close()
    try:
        if not reader.poll(timeout):
            raise TimeoutError(f"{name} did not answer within {timeout:g} s")
        return pickle.loads(reader.recv_bytes())
    except EOFError:
        proc.join(5)
        raise ChildDied(proc.exitcode) from None
    finally:
        reader.close()
        if proc.exitcode is None:
            proc.kill()
        proc.join(10)


def _answer(fn, args, conn) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not the parent's handler of the moment (deferred)
    try:
        conn.send_bytes(pickle.dumps(fn(*args)))
        conn.close()
    finally:
        os._exit(0)  # never run the kernel's exit handlers in a forked child (its ZMQ sockets)


def cuda_canary(device, timeout: float = 60.0) -> str | None:
    """Fork a child that starts CUDA on ``device`` and runs one tiny kernel: None if it could, else its error.

    A fork after CUDA work in the parent, or after a backward pass there, leaves
    children unable to start CUDA while the parent still looks clean; a GPU that
    the torch build has no code for (a V100 under the CUDA 13 wheels) starts CUDA
    and allocates, then fails at its first kernel ("no kernel image is available").
    It finds out both before any rank is forked.
    Machinery behind launch; no notebook calls it directly.
    """
    try:
        return call_in_child(_start_cuda, device, timeout=timeout, name="cuda-canary")
    except TimeoutError:
        return f"the canary did not start CUDA within {timeout:g} s"
    except ChildDied as e:
        return f"the canary died (exit code {e.exitcode})"


def _start_cuda(device) -> str | None:
    import torch

    try:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # a kernel, not just an allocation (torch.empty runs none); .item() waits for it, so an error it raises
        # on the GPU is raised here
        (torch.ones(1, device=device) + 1).item()
        return None
    except BaseException as err:  # every failure is the answer
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def alive(pids) -> list[int]:
    """The pids among ``pids`` that still run (a zombie, dead but not yet reaped, counts as gone).

    Introduced in notebooks/12-data-loading.ipynb.
    """
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (zombies hold nothing and count as gone)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


class _Captured:
    def __init__(self):
        self.value = ""

    def text(self) -> str:
        return self.value


@contextlib.contextmanager
def child_stderr():
    """Collect what child processes write to file descriptor 2, which a notebook never shows.

    A spawned or crashed child prints its traceback there and nowhere else.
    Yields an object whose ``text()`` returns it once the block is over; the
    kernel's stderr is restored then.
    Introduced in notebooks/05-launching-from-a-notebook.ipynb.
    """
    captured = _Captured()
    with tempfile.TemporaryFile() as file:
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            captured.value = file.read().decode(errors="replace")


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold SIGINT until the block ends, then raise KeyboardInterrupt if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
