import pytest
import torch

from helpers import devices


@pytest.mark.parametrize("n_gpus, world_size, backend, kind, expected", [
    (0, 1, "gloo", "cpu", ["cpu"]),
    (0, 4, "gloo", "cpu", ["cpu"] * 4),
    (1, 1, "nccl", "multi-gpu", ["cuda:0"]),
    (1, 2, "gloo", "shared-gpu", ["cuda:0", "cuda:0"]),
    (2, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
    (2, 4, "gloo", "partly-shared", ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
    (4, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
    (4, 4, "nccl", "multi-gpu", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (8, 8, "nccl", "multi-gpu", [f"cuda:{i}" for i in range(8)]),
    (8, 2, "nccl", "multi-gpu", ["cuda:0", "cuda:1"]),
])
def test_plan_places_ranks(n_gpus, world_size, backend, kind, expected):
    p = devices.plan(world_size, n_gpus=n_gpus)
    assert [str(d) for d in p.devices] == expected
    assert (p.backend, p.kind, p.world_size) == (backend, kind, world_size)


def test_plan_sentences_say_what_is_real():
    assert "CPU" in devices.plan(2, n_gpus=0).sentence
    assert "no speed-up" in devices.plan(2, n_gpus=1).sentence
    assert "real multi-GPU" in devices.plan(2, n_gpus=2).sentence
    partly = devices.plan(3, n_gpus=2).sentence
    assert "cuda:0 carries" in partly and "cuda:1" not in partly


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_plan_rejects_impossible_world_sizes(bad):
    with pytest.raises(ValueError, match="world_size"):
        devices.plan(bad, n_gpus=2)


def test_plan_refuses_nccl_without_a_gpu_per_rank():
    with pytest.raises(ValueError, match="one GPU per rank"):
        devices.plan(2, n_gpus=1, backend="nccl")
    assert devices.plan(2, n_gpus=2, backend="gloo").backend == "gloo"
    with pytest.raises(ValueError, match="backend"):
        devices.plan(2, n_gpus=2, backend="mpi")


def test_plan_uses_the_real_gpu_count_by_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.gpu_count() == 3
    assert devices.plan(3).backend == "nccl"


def test_pick_device_falls_back(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert devices.pick_device(1) == torch.device("cpu")
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    assert devices.pick_device(1) == torch.device("cuda", 0)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert devices.pick_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError):
        devices.pick_device(-1)


def test_describe_does_not_initialise_cuda():
    machine = devices.describe()
    assert machine.cpu_cores >= 1
    assert machine.n_gpus == devices.gpu_count()
    assert not torch.cuda.is_initialized()
