"""The device each NCCL group binds, checked without a GPU: torch's group calls are mocked and their kwargs recorded.

torch 2.15's ``backend="nccl"`` builds ProcessGroupNCCL2, which binds a group to ONE device per rank: the
``device_id`` it is given, else GPU (LOCAL_RANK, else the rank) % GPU count (``distributed_c10d._nccl2_device``).
So every NCCL join names its device, and no rank puts two GPUs into one NCCL group. Four GPUs are mocked.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


class Stop(Exception):
    """Raised by a mock once the groups are made: the test needs nothing after them."""


def record_groups(monkeypatch, stop_at=None):
    calls = []

    def init(backend=None, **kw):
        calls.append(("init", backend, kw.get("device_id")))
        if stop_at == "init":
            raise Stop

    def new_group(ranks=None, backend=None, device_id=None, **kw):
        calls.append(("new_group", backend, device_id))
        return ("group", len(calls))

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return calls


def check_nccl_joins(calls_per_rank):
    """Every NCCL join names one device; a rank puts each GPU in its own group; ranks of a group hold other GPUs."""
    for calls in calls_per_rank:
        for kind, backend, device in calls:
            if backend == "nccl":
                assert isinstance(device, torch.device) and device.type == "cuda", (kind, device)
    by_group = zip(*[[c for c in calls if c[1] == "nccl"] for calls in calls_per_rank])
    for members in by_group:  # the same group, as each rank joined it
        devices = [device for _, _, device in members]
        assert len(set(devices)) == len(devices), f"two ranks on one GPU in one NCCL group: {devices}"


def hybrid_calls(monkeypatch, n_gpus, ranks=range(2)):
    """Each rank's recorded joins when hybrid_steps starts on n_gpus mocked GPUs (stopped before the model is built)."""
    from helpers import pipeline, stages

    monkeypatch.setattr(stages, "gpu_count", lambda: n_gpus)
    monkeypatch.setattr(pipeline, "TwoStage", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    per_rank = []
    for rank in ranks:
        calls = record_groups(monkeypatch)
        with pytest.raises(Stop):
            pipeline.hybrid_steps(rank, 2, None, 1, 1, 0.1)
        per_rank.append(calls)
    return per_rank


def test_hybrid_binds_each_stage_group_to_that_stage_gpu_on_four_gpus(monkeypatch):
    from helpers import stages

    per_rank = hybrid_calls(monkeypatch, 4)
    plan = stages.plan_hybrid(2, 2, n_gpus=4)
    assert [str(d) for d in plan.devices[1]] == ["cuda:2", "cuda:3"]  # rank 1 owns two GPUs
    for rank, calls in enumerate(per_rank):
        groups = [c for c in calls if c[0] == "new_group"]
        assert [c[1] for c in groups] == ["nccl", "nccl"]
        assert [c[2] for c in groups] == list(plan.devices[rank])  # stage s's group: this rank's stage-s GPU
        world = [c for c in calls if c[0] == "init"]
        assert len(world) == 1 and (world[0][1] != "nccl" or world[0][2] is not None)
    check_nccl_joins(per_rank)


def test_hybrid_on_two_gpus_each_rank_binds_its_own(monkeypatch):
    per_rank = hybrid_calls(monkeypatch, 2)
    assert [[str(c[2]) for c in calls if c[1] == "nccl"] for calls in per_rank] == [["cuda:0"] * 2, ["cuda:1"] * 2]
    check_nccl_joins(per_rank)


def test_hybrid_on_the_cpu_stays_gloo_without_a_device(monkeypatch):
    calls, = hybrid_calls(monkeypatch, 0, ranks=[0])
    assert {(c[1], c[2]) for c in calls} == {("gloo", None)}


def test_keras_guide_rank_binds_its_gpu_on_four_gpus(monkeypatch):
    from helpers import keras_ddp

    monkeypatch.setattr(keras_ddp.devices, "gpu_count", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "1")
    per_rank = []
    for rank in range(4):
        calls = record_groups(monkeypatch, stop_at="init")
        with pytest.raises(Stop):
            keras_ddp.guide_rank(rank, 4, None, 1, {})
        per_rank.append(calls)
    assert [(c[1], str(c[2])) for calls in per_rank for c in calls] == [("nccl", f"cuda:{r}") for r in range(4)]
    check_nccl_joins(per_rank)


# launch's forked rank (helpers/_rank.child_main) on a mocked 4-GPU plan: each rank forked from one child process
RANKS = r"""
import json, os, sys, tempfile, torch, torch.distributed as dist
from helpers import _rank, devices
out = sys.argv[1]
def init(backend=None, **kw):
    with open(out, "a") as f:
        f.write(json.dumps([kw.get("rank"), backend, str(kw.get("device_id"))]) + "\n")
dist.init_process_group = init
dist.is_initialized = lambda: False
torch.cuda.set_device = lambda device: None
class Queue:
    def put(self, item): pass
    def close(self): pass
    def join_thread(self): pass
plan = devices.plan(4, n_gpus=4)
assert plan.backend == "nccl", plan
for rank in range(4):
    pid = os.fork()
    if pid == 0:
        with tempfile.TemporaryFile() as stack, tempfile.TemporaryFile() as result:
            _rank.child_main(lambda r, w: None, rank, 4, (), plan, 1, Queue(), stack, result, True, 5, os.getppid())
    assert os.waitpid(pid, 0)[1] == 0
"""


def test_launch_binds_each_rank_to_its_gpu_on_four_gpus(tmp_path):
    out = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    subprocess.run([sys.executable, "-c", RANKS, str(out)], env=env, cwd=ROOT, check=True, timeout=120,
                   capture_output=True, text=True)
    import json

    rows = sorted(json.loads(line) for line in out.read_text().splitlines())
    assert rows == [[r, "nccl", f"cuda:{r}"] for r in range(4)]
