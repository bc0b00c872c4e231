"""The parent's side of ``helpers.launch``: the ranks' queue read, progress drawn, failures put in words."""

from __future__ import annotations

import os
import queue as queue_lib
import signal
import time

import torch


class Watcher:
    """The parent's side of the queue: prints, events, progress, results."""

    def __init__(self, world_size, on_event, progress, result_files):
        self.results = [None] * world_size
        self.result_files = result_files  # rank r writes its result into result_files[r], then says "result"
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
            f = self.result_files[rank]
            f.seek(0)
            self.results[rank] = torch.load(f, map_location="cpu", weights_only=False)  # its own result: trusted
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
        self.bar.n = min(int(metrics["step"]), self.bar.total)  # step counts what is done: 1 … total
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if k not in ("step", "total", "t") and isinstance(v, float)}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def failure_text(failures: dict[int, str]) -> str:
    """The first cause in full; what followed from it (peers losing their connection) in one line each."""
    first, *rest = failures.values()
    if rest:
        first += "\nThen, probably as a consequence:\n" + "\n".join(
            "  " + text.split("\n--- traceback", 1)[0][:300] for text in rest)
    return first


def drain(events, watcher: Watcher, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        try:
            watcher.handle(events.get(timeout=0.05))
        except queue_lib.Empty:
            return


def exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal has no name
            return f"killed by signal {-code}"
        why = " (the out-of-memory killer sends this)" if name == "SIGKILL" else ""
        return f"killed by {name}{why}"
    return f"exit code {code}"


def timeout_text(stuck, timeout, procs, last, stack_files) -> str:
    signalled = [r for r in stuck if procs[r].exitcode is None]
    for r in signalled:
        os.kill(procs[r].pid, signal.SIGUSR1)  # each rank's faulthandler writes its stack
    # wait until every stack is written (its size stops growing), up to 5 s on a busy machine
    sizes, deadline = None, time.monotonic() + 5
    while signalled and time.monotonic() < deadline:
        time.sleep(0.1)
        now = [os.fstat(stack_files[r].fileno()).st_size for r in signalled]
        if all(now) and now == sizes:
            break
        sizes = now
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
