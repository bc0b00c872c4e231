"""Process chores for the launcher: kill whole process groups, read children's stderr, defer Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time

import psutil


def kill_all(procs) -> None:
    """SIGKILL each rank's whole process group (its DataLoader workers too) and wait until they are gone.

    Introduced in notebooks/03-ddp-fork.ipynb.
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
    Introduced in notebooks/03-ddp-fork.ipynb.
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
