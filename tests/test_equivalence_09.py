"""Notebook 09's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

"The split model is the same function" (``check_split``: outputs and gradients) and "every schedule gives the
batch's gradient" (``check_schedules``: GPipe and 1F1B for M = 1, 2, 4, and one SGD step) compare with the unsplit
ConvNet in float64 and assert < 1e-10. Each runs here with the notebook's own functions and smoke sizes, for every
rounding in ``ROUNDINGS``; the nudge lands on the unsplit side (its forward runs first). Exercise 3's BatchNorm gap
must stay far above that bound. The last test shows the bound can fail: float32's rounding alone (a one-ulp nudge, or
the micro-batches' other summation order), and a loss share computed wrong, exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOLERANCE = 1e-10  # notebook 09, cells "Is the split model the same function?" and "Micro-batches written out"
SPLIT, SEED, BATCH, MICRO_COUNTS = 4, 0, 32, (1, 2, 4)  # notebook 09's parameters cell, smoke sizes


def _batch():
    import torch

    from helpers import data

    train_set, _ = data.get_datasets("fashion", smoke=True)
    return next(iter(torch.utils.data.DataLoader(train_set, batch_size=BATCH)))


def check_split(threads, ulps, dtype="float64"):
    import functools

    import torch

    from helpers.launch import launch
    from helpers.pipeline import check_split as fn

    x, y = _batch()
    run = functools.partial(perturbed(fn, threads, ulps), split=SPLIT, seed=SEED, dtype=getattr(torch, dtype))
    out = launch(run, 1, x, y, quiet=True, progress=False)[0]
    return {"forward_diff": out["forward_diff"], "grad_diff": out["grad_diff"]}


def check_schedules(threads, ulps, dtype="float64", loss_fn=None):
    import functools

    import torch

    from helpers.launch import launch
    from helpers.pipeline import check_schedules as fn

    x, y = _batch()
    run = functools.partial(perturbed(fn, threads, ulps), split=SPLIT, micro_counts=MICRO_COUNTS, seed=SEED,
                            dtype=getattr(torch, dtype))
    if loss_fn is not None:  # a bug, injected: each micro-batch's loss summed instead of averaged
        import helpers.pipeline as pipeline

        plain = pipeline.pipeline_step
        pipeline.pipeline_step = lambda *a, **k: plain(*a, **k, loss_fn=loss_fn)
    out = launch(run, 1, x, y, quiet=True, progress=False)[0]
    return {"diffs": max(out["diffs"].values()), "step_diff": out["step_diff"]}


def _batchnorm_micro(rank, world_size, x, y, dtype):  # exercise 3's solution, as in the notebook
    import torch

    from helpers import stages
    from helpers.models import ConvNet, max_param_diff
    from helpers.pipeline import pipeline_step
    from helpers.stages import TwoStage

    torch.manual_seed(SEED)
    model = TwoStage(ConvNet(batch_norm=True).to(dtype), SPLIT, stages.plan_stages(2).devices)
    grads = {}
    for m in (1, 4):
        model.zero_grad(set_to_none=True)
        pipeline_step(model, x.to(dtype), y, m)
        grads[m] = model.convnet_state(grads=True)
    return max_param_diff(grads[1], grads[4])


def check_batchnorm(threads, ulps, dtype="float64"):
    import functools

    import torch

    from helpers.launch import launch

    x, y = _batch()
    run = functools.partial(perturbed(_batchnorm_micro, threads, ulps), dtype=getattr(torch, dtype))
    return {"bn_diff": launch(run, 1, x, y, quiet=True, progress=False)[0]}


def check_what_the_bound_catches(threads, ulps):
    import torch.nn.functional as F

    return {"float32_split": check_split(threads, 1, "float32")["grad_diff"],  # unnudged, both sides run one code
            "float32_schedules": check_schedules(threads, ulps, "float32")["diffs"],
            "loss_summed": check_schedules(threads, ulps, "float64",
                                           loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="sum"))["diffs"]}


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_the_split_model_is_the_same_function_in_float64(threads, ulps):
    out = run_check(__file__, "check_split", threads, ulps)
    print(f"check_split, {threads} thread(s), {ulps} ulp: {out}")
    assert out["forward_diff"] < TOLERANCE and out["grad_diff"] < TOLERANCE


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_every_schedule_gives_the_batch_s_gradient_in_float64(threads, ulps):
    out = run_check(__file__, "check_schedules", threads, ulps)
    print(f"check_schedules, {threads} thread(s), {ulps} ulp: {out}")
    assert out["diffs"] < TOLERANCE and out["step_diff"] < TOLERANCE


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_batchnorm_with_micro_batches_stays_far_above_the_bound(threads, ulps):
    out = run_check(__file__, "check_batchnorm", threads, ulps)
    print(f"exercise 3, {threads} thread(s), {ulps} ulp: {out}")
    assert out["bn_diff"] > 1e4 * TOLERANCE  # the notebook's assert


def test_the_bound_fails_for_float32_and_a_wrong_loss_share():
    out = run_check(__file__, "check_what_the_bound_catches", 1, 0)
    print(out)
    assert out["float32_split"] > TOLERANCE and out["float32_schedules"] > TOLERANCE, "float32's rounding exceeds it"
    assert out["loss_summed"] > 1e-4, "a loss share computed wrong moves the gradient by its own size"
