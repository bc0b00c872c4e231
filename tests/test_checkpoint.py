"""helpers.checkpoint: round trips, atomic writes under SIGKILL, clear errors.

Exact resume (the rank function that saves and resumes) is notebook 10's lesson and is asserted there.

No backward pass runs in this process (a CPU backward here would break later GPU forks, FACTS.md):
optimizer state is made by setting .grad by hand, and training runs in launched ranks.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import checkpoint, models
from helpers.launch import launch

ROOT = Path(__file__).resolve().parent.parent
QUIET = dict(quiet=True, progress=False)


def stepped(model, opt, seed=0):
    """One optimizer step with made-up gradients, so the optimizer has state (no autograd)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_plain_round_trip_restores_model_optimizer_and_state(tmp_path):
    torch.manual_seed(0)
    model = models.ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stepped(model, opt)
    path = checkpoint.save(tmp_path / "c.pt", model, opt, epoch=3, note="x", rng=checkpoint.rng_state())
    assert path == tmp_path / "c.pt" and list(tmp_path.iterdir()) == [path], "no temporary file is left"
    torch.manual_seed(1)
    other = models.ConvNet()
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-3)
    state = checkpoint.load(path, other, other_opt)
    assert same(model.state_dict(), other.state_dict())
    a, b = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(same(a[i], b[i]) for i in a) and a.keys() == b.keys()
    assert state["epoch"] == 3 and state["note"] == "x"


def test_rng_state_round_trip_repeats_the_random_numbers(tmp_path):
    state = checkpoint.rng_state()
    want = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.save(tmp_path / "r.pt", models.ConvNet(), rng=state)
    loaded = checkpoint.load(tmp_path / "r.pt", models.ConvNet())["rng"]
    checkpoint.set_rng_state(loaded)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_save_refuses_state_that_weights_only_load_would_refuse(tmp_path):
    with pytest.raises(TypeError, match="weights_only"):
        checkpoint.save(tmp_path / "c.pt", models.ConvNet(), array=np.zeros(3))
    assert not list(tmp_path.iterdir()), "nothing written"


def ddp_round_trip(rank, world_size, path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(models.ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped(model, opt)
    if rank == 0:
        checkpoint.save(path, model, opt, epoch=1)
    dist.barrier()
    torch.manual_seed(1 + rank)
    fresh = DDP(models.ConvNet())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = checkpoint.load(path, fresh, fresh_opt, map_location="cpu")
    return {"same": same(model.module.state_dict(), fresh.module.state_dict()), "epoch": state["epoch"],
            "momentum": same(opt.state_dict()["state"][0], fresh_opt.state_dict()["state"][0])}


def test_ddp_round_trip_saves_the_unwrapped_model(tmp_path):
    path = tmp_path / "ddp.pt"
    out = launch(ddp_round_trip, 2, path, **QUIET)
    assert all(o == {"same": True, "epoch": 1, "momentum": True} for o in out)
    saved = torch.load(path, weights_only=True)["model"]
    assert not any(k.startswith("module.") for k in saved), "DDP's 'module.' prefix must not be saved"
    checkpoint.load(path, models.ConvNet())  # a plain model reads what DDP wrote


WRITER = """
import sys, torch
from helpers import checkpoint
model = torch.nn.Linear(2000, 4000)  # 32 MB: each save takes long enough to be killed in the middle
print("ready", flush=True)
i = 1
while True:
    torch.nn.init.constant_(model.weight, float(i))
    checkpoint.save(sys.argv[1], model, version=i)
    i += 1
"""


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "c.pt"
    model = torch.nn.Linear(2000, 4000)
    torch.nn.init.constant_(model.weight, 0.0)  # version 0 is all zeros, like every later version i is all i
    checkpoint.save(path, model, version=0)
    rng = random.Random(0)
    left_temporary = 0
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        state = checkpoint.load(path, model)  # must never be half a file
        assert torch.all(model.weight == float(state["version"])), "weights and state from the same save"
        temps = [p for p in tmp_path.iterdir() if p != path]
        left_temporary += bool(temps)
        for p in temps:
            p.unlink()
    assert left_temporary, "no kill landed inside a save, so this test proved nothing; make the model bigger"


@pytest.mark.parametrize("damage, says", [
    ("missing", "does not exist"), ("empty", "empty"), ("truncated", "truncated or corrupt"),
    ("garbage", "truncated or corrupt"), ("other", "not a checkpoint"), ("folder", "not a file"),
])
def test_damaged_files_raise_an_error_naming_the_path(tmp_path, damage, says):
    good = checkpoint.save(tmp_path / "good.pt", models.ConvNet(), epoch=1)
    path = tmp_path / "bad.pt"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(random.Random(0).randbytes(5000))  # fixed garbage; the test below tries 200 more
    elif damage == "other":
        torch.save({"weights": torch.zeros(3)}, path)
    elif damage == "folder":
        path.mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=says) as err:
        checkpoint.load(path, models.ConvNet())
    assert str(path) in str(err.value)


def test_random_bytes_always_give_a_checkpoint_error(tmp_path):
    """Garbage reaches torch's legacy unpickler, which fails in many ways (IndexError, KeyError, UnpicklingError...);
    each must surface as one CheckpointError naming the file (CI once met an IndexError here)."""
    path = tmp_path / "bad.pt"
    for seed in range(200):
        path.write_bytes(random.Random(seed).randbytes(64 + seed * 13))
        with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
            checkpoint.load(path, models.ConvNet())


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    path = checkpoint.save(tmp_path / "c.pt", models.ConvNet(batch_norm=False))
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model") as err:
        checkpoint.load(path, models.ConvNet(batch_norm=True))
    assert str(path) in str(err.value)
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer state"):
        model = models.ConvNet(batch_norm=False)
        checkpoint.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_unwrap_sees_through_wrappers():
    inner = models.ConvNet()
    assert checkpoint.unwrap(torch.nn.DataParallel(inner)) is inner
    assert checkpoint.unwrap(inner) is inner

