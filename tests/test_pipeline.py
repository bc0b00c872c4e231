"""Pipelines that run, at test size: the code of notebooks 09 and 10 (exported into helpers.pipeline). Every
backward pass happens in a launched rank: a backward here would poison later GPU forks."""

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import ddp, models, pipeline, schedules, stages
from helpers.launch import RankFailed, launch

QUIET = dict(quiet=True, progress=False)
EXACT, TOLERANCE = torch.float64, 1e-10  # the course's equivalence rule (helpers/README.md): float64, < 1e-10


def batch(n=24):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def unsplit_grads(x, y):
    def grads(rank, world_size):
        torch.manual_seed(0)
        net = models.ConvNet(batch_norm=False).to(EXACT)
        torch.nn.functional.cross_entropy(net(x.to(EXACT)), y).backward()
        return {k: p.grad for k, p in net.named_parameters()}

    return launch(grads, 1, **QUIET)[0]


def test_split_equals_unsplit_and_every_schedule_equals_it():
    x, y = batch()
    for split in (1, 4, 8, 9):
        out = launch(functools.partial(pipeline.check_split, split=split, dtype=EXACT), 1, x, y, **QUIET)[0]
        assert out["forward_diff"] < TOLERANCE and out["grad_diff"] < TOLERANCE, (split, out)
        assert out["wrong_labels_error"] is None, "both stages share a device here"
        diffs = launch(functools.partial(pipeline.check_schedules, split=split, micro_counts=(1, 2, 3, 5, 24),
                                         dtype=EXACT), 1, x, y, **QUIET)[0]["diffs"]
        assert set(diffs) == {(k, m) for k in schedules.KINDS for m in (1, 2, 3, 5, 24)}
        for key, diff in diffs.items():
            assert diff < TOLERANCE, (split, key, diff)


def test_schedule_gradients_are_not_trivially_equal():
    """The check above can fail: a schedule that drops a micro-batch's loss weight is caught."""
    x, y = batch()

    def unweighted(rank, world_size):
        ref, model = pipeline.split_pair(4, 0, stages.plan_stages(2).devices)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        pipeline.pipeline_step(model, x, y, 4, loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out, t) * 4)
        return models.max_param_diff(grads, model.convnet_state(grads=True))

    assert launch(unweighted, 1, **QUIET)[0] > 1e-3


def test_a_split_training_step_equals_the_unsplit_one_and_bad_counts_are_refused():
    x, y = batch(16)
    out = launch(functools.partial(pipeline.check_schedules, micro_counts=(1, 4), dtype=EXACT), 1, x, y, **QUIET)[0]
    assert out["step_diff"] < TOLERANCE and max(out["diffs"].values()) < TOLERANCE
    with pytest.raises(RankFailed, match="n_micro must be"):
        launch(functools.partial(pipeline.check_schedules, micro_counts=(4,)), 1, x[:2], y[:2], **QUIET)



@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_on_two_ranks_equals_the_unsplit_model(schedule):
    x, y = batch(16)
    out = launch(functools.partial(pipeline.pp_rank, micro_counts=(4, 2), schedule=schedule, rounds=2, dtype=EXACT), 2,
                 x, y, **QUIET)
    got = {**out[0]["grads"], **out[1]["grads"]}
    assert models.max_param_diff(unsplit_grads(x, y), got) < TOLERANCE, "scale_grads=True: the mean over micro-batches"
    assert out[0]["losses"] is None and len(out[1]["losses"]) == 4
    assert all(len(r["times"][m]) == 2 for r in out for m in (4, 2))
    # each rank timed its own stage on the device its stage ran on (issue: CPU pipeline vs GPU stage times)
    assert all(r["stage_seconds"] > 0 and r["device"] == str(stages.plan_pipeline(2).devices[i])
               for i, r in enumerate(out))


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_two_stages_per_rank_equal_the_unsplit_model_and_return_torch_s_order(schedule):
    """Four stages on two ranks (rank r holds r and r + 2): the batch's gradient, the loss on rank 1 (stage 3), and
    the order torch runs, whose simulated bubble is the Megatron paper's (p−1)/(v·m) for interleaved 1F1B."""
    x, y = batch(16)
    out = launch(functools.partial(pipeline.pp_rank, micro_counts=(4, 8), schedule=schedule, rounds=1, dtype=EXACT), 2,
                 x, y, **QUIET)
    got = {**out[0]["grads"], **out[1]["grads"]}
    assert models.max_param_diff(unsplit_grads(x, y), got) < TOLERANCE
    assert out[0]["losses"] is None and len(out[1]["losses"]) == 4 and out[0]["stage_seconds"] is None
    order = out[0]["order"]
    assert {r: sorted({st for st, _, _ in acts}) for r, acts in order.items()} == {0: [0, 2], 1: [1, 3]}
    ops = {op for acts in order.values() for _, op, _ in acts}
    assert ops == ({"F", "B"} if schedule == "interleaved" else {"F", "I", "W"})
    slots = schedules.simulate_ranks(order, {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5})
    busy = sum(t.end - t.start for t in slots)
    of_ideal = (2 * schedules.makespan(slots) - busy) / busy
    if schedule == "interleaved":
        assert of_ideal == pytest.approx((2 - 1) / (2 * 4))
    else:
        assert of_ideal < (2 - 1) / (2 * 4)


def test_the_interleaved_schedule_refuses_a_micro_batch_count_that_is_no_multiple_of_its_rounds():
    x, y = batch(10)
    with pytest.raises(RankFailed, match="multiple of the number of rounds"):
        launch(functools.partial(pipeline.pp_rank, micro_counts=(5,), schedule="interleaved"), 2, x, y, **QUIET)


def test_pp_rank_under_a_mocked_single_gpu_measures_pipeline_and_stages_on_the_cpu(monkeypatch):
    """One GPU: the ranks would share it, so the plan puts the pipeline on the CPU, and the stage times with it."""
    monkeypatch.setattr(stages, "gpu_count", lambda: 1)  # read in the forked ranks by plan_pipeline
    x, y = batch(8)
    out = launch(functools.partial(pipeline.pp_rank, micro_counts=(2,), rounds=1), 2, x, y, **QUIET)
    assert [r["device"] for r in out] == ["cpu", "cpu"] and all(r["stage_seconds"] > 0 for r in out)


def test_unscaled_gradients_are_the_sum_over_micro_batches():
    x, y = batch(16)
    out = launch(functools.partial(pipeline.pp_rank, micro_counts=(4,), scale_grads=False, dtype=EXACT), 2, x, y,
                 **QUIET)
    ref = {k: 4 * g for k, g in unsplit_grads(x, y).items()}
    assert models.max_param_diff(ref, {**out[0]["grads"], **out[1]["grads"]}) < TOLERANCE


def test_model_and_data_parallel_equal_one_big_batch():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g))
    out = launch(functools.partial(pipeline.hybrid_steps, split=4, dtype=EXACT), 2, data, 3, 16, 0.1, init=False,
                 **QUIET)
    ref = launch(functools.partial(ddp.reference_rank, dtype=EXACT), 1, data, 3, 32, 0.1, **QUIET)[0]
    assert models.max_param_diff(out[0]["params"], ref["params"]) < TOLERANCE
    assert models.max_param_diff(out[0]["params"], out[1]["params"]) == 0.0
    assert not set(out[0]["indices"]) & set(out[1]["indices"])
