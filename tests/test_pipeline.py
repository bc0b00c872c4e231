"""Pipelines that run, at test size: every backward pass happens in a launched rank (FACTS: a backward here
would poison later GPU forks)."""

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import ddp, models, pipeline, schedules, stages
from helpers.launch import RankFailed, launch

QUIET = dict(quiet=True, progress=False)


def batch(n=24):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_split_equals_unsplit_and_every_schedule_equals_it():
    x, y = batch()
    for split in (1, 4, 8, 9):
        out = launch(pipeline.check_split, 1, x, y, split, (1, 2, 3, 5, 24), **QUIET)[0]
        assert out["forward_diff"] < 1e-6 and out["grad_diff"] < 1e-6, (split, out)
        assert set(out["schedules"]) == {(k, m) for k in schedules.KINDS for m in (1, 2, 3, 5, 24)}
        for key, diff in out["schedules"].items():
            assert diff < 1e-6, (split, key, diff)
        assert out["wrong_labels_error"] is None, "both stages share a device here"


def test_schedule_gradients_are_not_trivially_equal():
    """The check above can fail: a schedule that drops a micro-batch's loss weight is caught."""
    x, y = batch()

    def unweighted(rank, world_size):
        ref, model = pipeline._models(4, 0, stages.plan_stages(2).devices)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        pipeline.pipeline_step(model, x, y, 4, loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out, t) * 4)
        return models.max_param_diff(grads, model.convnet_state(grads=True))

    assert launch(unweighted, 1, **QUIET)[0] > 1e-3


def test_measured_clock_and_sweep_give_a_timeline_and_times():
    x, y = batch(16)
    out = launch(functools.partial(pipeline.sweep_micro_batches, rounds=2), 1, x, y, 4, (1, 2, 4), **QUIET)[0]
    assert set(out["times"]) == {1, 2, 4} and all(t["median"] > 0 for t in out["times"].values())
    assert len(out["stage_seconds"]) == 2 and min(out["stage_seconds"]) > 0
    assert [(s.stage, s.op) for s in out["timeline"]].count((0, "F")) == 4
    assert all(s.end >= s.start for s in out["timeline"])
    with pytest.raises(RankFailed, match="need at least"):
        launch(pipeline.sweep_micro_batches, 1, x[:2], y[:2], 4, (4,), **QUIET)


@pytest.mark.parametrize("kind, tracer", [("gpipe", False), ("1f1b", False), ("gpipe", True)])
def test_torch_pipelining_on_two_ranks_equals_the_unsplit_model(kind, tracer):
    x, y = batch(16)
    ref = launch(pipeline.check_split, 1, x, y, 4, (1,), **QUIET)[0]
    out = launch(pipeline.pp_rank, 2, x, y, 4, 4, kind, tracer, 0, 2, **QUIET)

    def grads(rank, world_size):
        torch.manual_seed(0)
        net = models.ConvNet(batch_norm=False)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        return {k: p.grad for k, p in net.named_parameters()}

    full = launch(grads, 1, **QUIET)[0]
    got = {**out[0]["grads"], **out[1]["grads"]}
    assert models.max_param_diff(full, got) < 1e-6, "scale_grads=True: the mean over micro-batch losses"
    assert out[0]["losses"] is None and len(out[1]["losses"]) == 4
    assert len(out[0]["times"]) == 2
    assert ref["grad_diff"] < 1e-6


def test_model_and_data_parallel_equal_one_big_batch():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g))
    out = launch(pipeline.hybrid_steps, 2, data, 3, 16, 0.1, 4, init=False, **QUIET)
    ref = launch(ddp.reference_rank, 1, data, 3, 32, 0.1, **QUIET)[0]
    assert models.max_param_diff(out[0]["params"], ref["params"]) < 1e-5
    assert models.max_param_diff(out[0]["params"], out[1]["params"]) == 0.0
    assert not set(out[0]["indices"]) & set(out[1]["indices"])
