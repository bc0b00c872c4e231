"""helpers.fsdp: FSDP2 equals one process and DDP on a tiny model, holds 1/W, and checkpoints both ways.

Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest
import torch

from helpers import devices, fsdp, models
from conftest import QUIET, TINY
from helpers.launch import RankFailed, launch





def run(dataset, mode, world_size, steps=4, **kw):
    fn = functools.partial(fsdp.train_rank, mode=mode, **TINY, **kw)
    return launch(fn, world_size, dataset, steps, 32, 0.05, **QUIET)


def test_block_stack_params_by_hand():
    assert fsdp.block_stack_params(16, 2) == models.count_parameters(fsdp.BlockStack(16, 2))
    assert fsdp.block_stack_params(1, 0, d_in=2, classes=1) == 3 + 2


def test_fsdp_equals_one_process_and_ddp_and_holds_half(dataset):
    single = run(dataset, "single", 1)[0]
    sharded = run(dataset, "fsdp", 2, warmup=1)
    ddp = run(dataset, "ddp", 2)
    assert models.max_param_diff(sharded[0]["params"], single["params"]) < 1e-6
    assert models.max_param_diff(ddp[0]["params"], single["params"]) < 1e-6
    assert sharded[1]["params"] == {}, "the full state dict goes to rank 0 only"
    assert max(abs(a - b) for a, b in zip(sharded[0]["losses"], single["losses"])) < 1e-5
    whole = fsdp.block_stack_params(16, 2) * 4
    for r in sharded:
        for part in ("params", "grads", "optimizer"):
            assert abs(r["bytes"][part] - whole / 2) <= 64, (part, r["bytes"])  # one dim-0 row of rounding at most
    assert sum(r["bytes"]["params"] for r in sharded) == whole
    assert all(r["bytes"]["params"] == whole for r in ddp)


def test_reshard_after_forward_false_keeps_full_parameters(dataset):
    kept = run(dataset, "fsdp", 2, steps=1, reshard=False)
    whole = fsdp.block_stack_params(16, 2) * 4
    assert kept[0]["bytes"]["after_forward"] == whole
    freed = run(dataset, "fsdp", 2, steps=1)
    assert freed[0]["bytes"]["after_forward"] < whole


def test_mixed_precision_is_close_not_equal(dataset):
    single = run(dataset, "single", 1)[0]
    mixed = run(dataset, "fsdp", 2, mixed=True)[0]
    diff = models.max_param_diff(mixed["params"], single["params"])
    assert 0 < diff < 1e-2
    assert all(v.dtype == torch.float32 for v in mixed["params"].values()), "bf16 only for compute"


def test_bad_arguments_refused(dataset):
    with pytest.raises(ValueError, match="mode"):
        fsdp.train_rank(0, 1, dataset, 1, 32, 0.1, mode="zero")
    with pytest.raises(ValueError, match="one process"):
        fsdp.train_rank(0, 2, dataset, 1, 32, 0.1, mode="single")
    with pytest.raises(ValueError, match="equal slices"):
        fsdp.train_rank(0, 3, dataset, 1, 32, 0.1)
    with pytest.raises(ValueError, match="samples"):
        fsdp.global_batches(10, 3, 4)
    b = fsdp.global_batches(10, 2, 4, seed=1)
    assert b.shape == (2, 4) and len(set(b.flatten().tolist())) == 8


def test_launch_fsdp_falls_back_to_cpu_only_for_shared_gpus(monkeypatch, capsys):
    calls = []

    def fake_launch(fn, world_size, *args, **kw):
        on_cpu = getattr(fn, "keywords", {}).get("on_cpu", False)
        calls.append(on_cpu)
        if not on_cpu:
            raise RankFailed("rank 0 raised:\nRuntimeError: no support for _reduce_scatter_base in Gloo")
        return ["ok"]

    monkeypatch.setattr(fsdp, "launch", fake_launch)
    real_plan = devices.plan
    monkeypatch.setattr(fsdp.devices, "plan", lambda w: real_plan(w, n_gpus=1))
    result, where = fsdp.launch_fsdp(fsdp.train_rank, 2)
    assert result == ["ok"] and calls == [False, True] and "CPU" in where
    assert "_reduce_scatter_base" in capsys.readouterr().out
    monkeypatch.setattr(fsdp.devices, "plan", lambda w: real_plan(w, n_gpus=2))
    with pytest.raises(RankFailed):  # own GPUs (nccl): a failure is a failure, not a reason to move
        fsdp.launch_fsdp(fsdp.train_rank, 2)
