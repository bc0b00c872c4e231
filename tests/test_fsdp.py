"""helpers.fsdp: the machinery around notebook 15's FSDP2 ranks (batches, the after-forward probe, the CPU fallback).

The FSDP lesson itself (fully_shard, the step, DCP) is written in notebooks/15-fsdp.ipynb, whose asserts check it.
Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import devices, fsdp
from conftest import QUIET
from helpers.launch import RankFailed, launch


def test_global_batches_are_disjoint_and_seeded():
    with pytest.raises(ValueError, match="samples"):
        fsdp.global_batches(10, 3, 4)
    b = fsdp.global_batches(10, 2, 4, seed=1)
    assert b.shape == (2, 4) and len(set(b.flatten().tolist())) == 8
    assert torch.equal(b, fsdp.global_batches(10, 2, 4, seed=1))


def _held_rank(rank, world_size, *, reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    if reshard is not None:  # None: a plain model, no FSDP
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    held = fsdp.params_after_forward(model, x, y)
    grads_zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    return held, grads_zeroed


def test_params_after_forward_sees_what_resharding_frees():
    whole = (8 * 16 + 16 + 16 * 4 + 4) * 4
    plain = launch(functools.partial(_held_rank, reshard=None), 1, **QUIET)[0]
    kept = launch(functools.partial(_held_rank, reshard=False), 2, **QUIET)[0]
    freed = launch(functools.partial(_held_rank, reshard=True), 2, **QUIET)[0]
    assert plain == (whole, True) and kept == (whole, True)
    assert freed[0] < whole and freed[1]


def test_launch_fsdp_falls_back_to_cpu_only_for_shared_gpus(monkeypatch, capsys):
    calls = []

    def fake_launch(fn, world_size, *args, **kw):
        on_cpu = getattr(fn, "keywords", {}).get("on_cpu", False)
        calls.append(on_cpu)
        if not on_cpu:
            raise RankFailed("rank 0 raised:\nRuntimeError: no support for _reduce_scatter_base in Gloo")
        return ["ok"]

    def rank_fn(rank, world_size, *, on_cpu=False):
        return on_cpu

    monkeypatch.setattr(fsdp, "launch", fake_launch)
    real_plan = devices.plan
    monkeypatch.setattr(fsdp.devices, "plan", lambda w: real_plan(w, n_gpus=1))
    result, where = fsdp.launch_fsdp(rank_fn, 2)
    assert result == ["ok"] and calls == [False, True] and "CPU" in where
    assert "_reduce_scatter_base" in capsys.readouterr().out
    monkeypatch.setattr(fsdp.devices, "plan", lambda w: real_plan(w, n_gpus=2))
    with pytest.raises(RankFailed):  # own GPUs (nccl): a failure is a failure, not a reason to move
        fsdp.launch_fsdp(rank_fn, 2)
