"""torchrun from a notebook: build its command lines, run them with their output streamed, end every process.

The notebook's own thread reads every line the processes print, as it comes,
and prints it (with a prefix per process); output printed by a background
thread would land in whatever cell runs at the time. torchrun's workers start
their own sessions, so ending a run means walking the process tree: ``kill_tree``
SIGKILLs every descendant's process group, then the process itself. Each
command starts behind a one-line shim that asks Linux to SIGTERM it when the
kernel dies, so a restarted kernel leaves no torchrun behind.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .procs import _interrupts_deferred

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_ddp.py"


def torchrun_command(script_args, *, nproc: int = 1, nnodes: int = 1, node_rank: int = 0,
                     endpoint: str | None = None, rdzv: str = "c10d", max_restarts: int = 0,
                     script=SCRIPT, python: str = sys.executable) -> list:
    """The argument list of ``python -m torch.distributed.run ... script script_args`` (torchrun, this kernel's env).

    One node and no ``endpoint``: ``--standalone`` (torchrun picks a free port).
    Otherwise ``endpoint`` is host:port of the rendezvous: with ``rdzv="c10d"``
    the agents are ranked by sorting them by host name, then process id (not by
    join order; ``--node-rank`` is ignored); with ``rdzv="static"`` the
    ``--node_rank`` given is kept (``--master-addr/--master-port``).
    With ``max_restarts``, run it with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in ``run``'s ``env`` (a store per attempt; scripts/train_ddp.py refuses
    restarts without it).
    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and endpoint is None:
        cmd.append("--standalone")
    elif endpoint is None:
        raise ValueError(f"{nnodes} nodes need an endpoint host:port to meet at")
    elif rdzv == "c10d":
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=course14"]
    elif rdzv == "static":
        host, port = endpoint.rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:
        raise ValueError(f"rdzv must be 'c10d' or 'static', got {rdzv!r}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + [str(script)] + [str(a) for a in script_args]


@dataclass
class Finished:
    """One process's end: exit code, every line it printed, seconds from start to exit."""

    returncode: int | None
    lines: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class RunFailed(RuntimeError):
    """A process of ``run`` exited with a non-zero code or ran past the timeout; the message quotes its last lines.

    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """


def run(commands: dict, *, timeout: float = 300.0, env: dict | None = None, on_line=None, echo: bool = True,
        check: bool = True, stagger: float = 0.0, envs: dict | None = None) -> dict:
    """Start each ``name: argv`` of ``commands``, stream their lines until all exit; returns ``{name: Finished}``.

    ``on_line(name, line, procs)`` sees every line as it arrives (``procs``:
    name -> Popen), so a caller can act mid-run (kill a worker, say). Each
    process runs in its own session with ``OMP_NUM_THREADS=1`` unless ``env``
    says otherwise (``envs``: name -> variables for that process only);
    whatever happens (an error, a timeout, Ctrl-C) every process and its
    descendants are killed before this returns or raises; should the
    kernel itself die, Linux sends each process SIGTERM and torchrun stops
    its workers.
    With ``check``, a non-zero exit code raises ``RunFailed``.
    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, results, partial, start = {}, {}, {}, time.monotonic()
    sel = selectors.DefaultSelector()
    try:
        for i, (name, argv) in enumerate(commands.items()):
            if i and stagger:
                time.sleep(stagger)
            own_env = {**full_env, **(envs or {}).get(name, {})}
            procs[name] = subprocess.Popen(_dying_with_this_thread(argv), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, env=own_env, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            results[name], partial[name] = Finished(None), b""
            sel.register(procs[name].stdout, selectors.EVENT_READ, name)
        while sel.get_map():
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise RunFailed(_failure(f"still running after {timeout:g} s (killed)", results))
            for key, _ in sel.select(timeout=min(left, 1.0)):
                name = key.data
                # raw reads: a buffered readline could hold lines back that select() no longer announces
                chunk = os.read(key.fileobj.fileno(), 65536)
                if chunk:
                    *lines, partial[name] = (partial[name] + chunk).split(b"\n")
                else:  # end of output: what is left is the last line
                    lines, partial[name] = [partial[name]] if partial[name] else [], b""
                for raw in lines:
                    line = raw.decode(errors="replace")
                    results[name].lines.append(line)
                    if echo:
                        print(f"[{name}] {line}" if len(commands) > 1 else line, flush=True)
                    if on_line is not None:
                        on_line(name, line, procs)
                if not chunk:  # end of output: the process is exiting
                    sel.unregister(key.fileobj)
                    results[name].returncode = procs[name].wait(timeout=max(left, 1.0))
                    results[name].seconds = time.monotonic() - start
    finally:
        with _interrupts_deferred():  # a second ■ must not leave torchruns running in their own sessions
            for proc in procs.values():
                kill_tree(proc.pid)
                proc.stdout.close()
                proc.wait()
            sel.close()
    failed = {n: r for n, r in results.items() if r.returncode != 0}
    if check and failed:
        raise RunFailed(_failure("exited with " + ", ".join(f"{n}: code {r.returncode}" for n, r in failed.items()),
                                 failed))
    return results


# Put in front of each command (Linux): ask the kernel to SIGTERM the process when the thread that started it dies
# (the notebook's kernel: a restart, an OOM kill), check that it has not died already, then become the command.
# torchrun answers SIGTERM by stopping its workers. Without it a node waiting for its peers outlived a killed kernel
# by minutes (its rendezvous waits up to 600 s). Done in the child, not with preexec_fn: that is unsafe in a
# process with threads, as a Jupyter kernel is.
_DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 15); "  # PR_SET_PDEATHSIG
                    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def _dying_with_this_thread(argv: list) -> list:
    if not sys.platform.startswith("linux"):
        return list(argv)  # elsewhere the finally of run() is the only guard
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *map(str, argv)]


def _failure(what: str, results: dict) -> str:
    tails = "\n".join(f"--- last lines of {n}:\n" + "\n".join(r.lines[-12:]) for n, r in results.items())
    return f"torchrun {what}\n{tails}"


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, every descendant and their process groups (torchrun's workers lead their own).

    Machinery behind torchrun.run; no notebook calls it directly.
    """
    try:
        root = psutil.Process(pid)
        family = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)  # the group takes DataLoader workers along
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def workers(pid: int, script=SCRIPT) -> list:
    """The processes under torchrun ``pid`` that run ``script``: the workers, not the agent.

    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    found = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in children:
        try:
            if str(script) in proc.cmdline() and "torch.distributed.run" not in proc.cmdline():
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def kill_worker_after(marker: str, node: str | None = None, index: int = 0):
    """An ``on_line`` for ``run`` that SIGKILLs one worker the first time a line containing ``marker`` appears.

    ``node`` names the torchrun whose worker dies (default: the first);
    ``index`` picks the worker. The returned callable's ``killed`` lists
    the pids it killed.
    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    def on_line(name, line, procs):
        if on_line.killed or marker not in line:
            return
        target = procs[node] if node is not None else next(iter(procs.values()))
        victims = workers(target.pid)
        if len(victims) <= index:
            raise RunFailed(f"no worker {index} under torchrun {target.pid} to kill (found {len(victims)})")
        victims[index].kill()
        on_line.killed.append(victims[index].pid)

    on_line.killed = []
    return on_line


SBATCH = SCRIPT.parent / "slurm_train_ddp.sbatch"


def sbatch_dry_run(nodes: int, gpus_per_node: int, *, path=SBATCH, job_id: int = 4242, cpus: int = 16) -> dict:
    """Run the sbatch file with stand-ins for Slurm: ``{'syntax': bash -n verdict, 'node0': argv, ...}``.

    Slurm's variables are set as for a ``nodes`` x ``gpus_per_node`` job; a
    fake ``scontrol`` lists the hosts and a fake ``srun`` prints the srun
    command each node would run, with the variables that torchrun and its
    workers read in front (``SLURM_NODEID`` set per node), so what a real
    cluster would start can be read without one.
    Introduced in notebooks/14-torchrun-and-clusters.ipynb.
    """
    import shlex
    import tempfile

    path = Path(path)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    out = {"syntax": "ok" if check.returncode == 0 else check.stderr.strip()}
    if check.returncode:
        return out
    hosts = [f"gpu-node-{i + 1:02d}" for i in range(nodes)]
    with tempfile.TemporaryDirectory() as fake:
        Path(fake, "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' " + " ".join(hosts) + "\n")
        # srun would start one task per node; here each "task" prints two variables that torchrun and its workers
        # read from the job's environment, then srun's own options and the task's argv, one word a line
        Path(fake, "srun").write_text('#!/bin/bash\nprintf "%s\\n" "TORCH_DISABLE_SHARE_RDZV_TCP_STORE='
                                      '${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}" "OMP_NUM_THREADS=${OMP_NUM_THREADS:-}" '
                                      'srun "$@"\n')
        for name in ("scontrol", "srun"):
            Path(fake, name).chmod(0o755)
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
               "SLURM_JOB_NODELIST": f"gpu-node-[01-{nodes:02d}]", "SLURM_NNODES": str(nodes),
               "SLURM_GPUS_ON_NODE": str(gpus_per_node), "SLURM_JOB_ID": str(job_id), "SLURM_CPUS_PER_TASK": str(cpus)}
        for node in range(nodes):
            res = subprocess.run(["bash", str(path)], env={**env, "SLURM_NODEID": str(node)}, capture_output=True,
                                 text=True, timeout=30)
            if res.returncode:
                raise RunFailed(f"{path} failed in the dry run (code {res.returncode}): {res.stderr.strip()}")
            out[f"node{node}"] = shlex.join(res.stdout.splitlines())
    return out


# ---- exported from notebooks/15-debugging-distributed.ipynb: edit it there, then run `make export` ----
def flight_recorder_env(dump_dir, buffer_size: int = 2000) -> dict:
    """NCCL's Flight Recorder spelled out: torch's defaults (on, dump on timeout) and each rank's dump in dump_dir.

    Introduced in notebooks/15-debugging-distributed.ipynb.
    """
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be ≥ 1, got {buffer_size}")  # 0 turns the recorder off
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(buffer_size),  # entries kept per rank (a ring buffer)
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # the watchdog writes the buffer on a timeout (torch's default)
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(dump_dir) / "rank_")}  # + the rank: rank_0, rank_1, ...


def fr_trace_command(dump_dir, *args, python: str = sys.executable) -> list:
    """torch's analyzer (torchfrtrace) over the dumps in dump_dir, plus args.

    Introduced in notebooks/15-debugging-distributed.ipynb.
    """
    return [python, "-m", "torch.distributed.flight_recorder.fr_trace", str(dump_dir), "--prefix", "rank_",
            *map(str, args)]
# ---- end of export from notebooks/15-debugging-distributed.ipynb ----
