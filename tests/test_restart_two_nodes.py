"""Two torchrun agents ("two nodes" on loopback): node 1's worker is SIGKILLed, the job restarts and ends right.

The case that broke a per-attempt key prefix built from TORCHELASTIC_RESTART_COUNT: that count is per agent. The
agent whose worker died counts a restart; the other agent restarts its healthy worker for the membership change
and does not count it (``elastic/agent/server/api.py``, ``_invoke_run``), so the two new workers disagree on the
attempt. On gloo a survivor waiting *inside* a collective fails at once ("Connection reset by peer"), both agents
count a restart and the counts agree by luck, so here the survivor waits *outside* any collective: every worker
that started from scratch holds after step HOLD (the script's ``TRAIN_DDP_HOLD_AFTER`` hook) and only then is node
1's worker killed. Node 0's worker meanwhile sleeps, as an NCCL rank would wait in a collective.

CPU only (CUDA_VISIBLE_DEVICES=""): the same arithmetic on every side, so the restarted job must end bit-identical
to an uninterrupted 1 node x 2 run.
"""

from __future__ import annotations

import re
import time

import torch

from helpers import torchrun
from helpers.launch import free_port

SCRIPT = torchrun.SCRIPT
STEPS, HOLD = 12, 4  # the workers hold after step HOLD, which is also a save: the restart resumes from it
ARGS = ["--smoke", "--steps", STEPS, "--save-every", HOLD, "--timeout", 30]
ENV = {"CUDA_VISIBLE_DEVICES": "", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _params(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def kill_node1_when_both_hold():
    """An ``on_line`` for torchrun.run: once both nodes' workers hold, SIGKILL the worker of GROUP_RANK 1."""
    group_rank, holding = {}, set()

    def on_line(name, line, procs):
        if m := re.search(r"GROUP_RANK=(\d+)", line):
            group_rank.setdefault(name, int(m.group(1)))
        if "holding after step" in line:
            holding.add(name)
        if on_line.killed or len(holding) < 2:
            return
        node1 = next(n for n, g in group_rank.items() if g == 1)
        victims = torchrun.workers(procs[node1].pid, script=SCRIPT)
        assert len(victims) == 1, victims
        victims[0].kill()
        on_line.killed.append((node1, victims[0].pid))

    on_line.killed = []
    return on_line


def test_node1_worker_killed_outside_a_collective_restarts_both_nodes_and_ends_equal(tmp_path):
    start = time.monotonic()
    ref = tmp_path / "uninterrupted.pt"
    cmd = torchrun.torchrun_command(ARGS + ["--checkpoint", ref], nproc=2, script=SCRIPT)
    torchrun.run({"node": cmd}, timeout=120, echo=False, env=ENV)

    path = tmp_path / "restarted.pt"
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = {f"node{i}": torchrun.torchrun_command(ARGS + ["--checkpoint", path], nproc=1, nnodes=2,
                                                  endpoint=endpoint, max_restarts=1, script=SCRIPT)
            for i in range(2)}
    killer = kill_node1_when_both_hold()
    out = torchrun.run(cmds, timeout=120, echo=False, on_line=killer, check=False,
                       env={**ENV, "TRAIN_DDP_HOLD_AFTER": str(HOLD)})
    text = "\n".join(f"[{n}] {line}" for n, r in out.items() for line in r.lines)
    assert killer.killed, "both workers never held: nothing was killed\n" + text[-4000:]
    assert all(r.returncode == 0 for r in out.values()), \
        f"exit codes {({n: r.returncode for n, r in out.items()})}\n" + text[-6000:]
    # both agents started a second group, which resumed from the save at step HOLD
    assert text.count(f"resumed at step {HOLD}") == 1 and f"done: {STEPS} steps" in text, text[-4000:]
    counts = sorted(re.findall(r"TORCHELASTIC_RESTART_COUNT=(\d)", text))
    failed = re.findall(r"failed \(exitcode: (-?\d+)\)", text)  # what each agent reports of its workers
    print(f"restart counts seen by the workers: {counts}; workers failed: {failed}; "
          f"{time.monotonic() - start:.1f} s in all")
    assert failed == ["-9"], "a worker besides the killed one failed: the restart did not go through at once"
    assert counts == ["0", "0", "0", "1"], counts  # per agent: only node 1's agent counted the restart
    a, b = _params(ref), _params(path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "not the uninterrupted run's weights"
