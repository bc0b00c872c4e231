"""Notebook 10's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

"The split model is the same function" (``check_split``: outputs and gradients of the GPT cut in two) and "every
schedule gives the batch's gradient" (``check_schedules``: GPipe and 1F1B for M = 1, 2, 4, and one SGD step) compare
with the unsplit GPT in float64 and assert < 1e-10; exercise 3 asserts that each micro-batch's loss weighted by its
share gives the batch's gradient (< 1e-10) while the mean of unequal micro-batches does not. Each runs here with the
notebook's own functions and smoke sizes, for every rounding in ``ROUNDINGS``; the nudge lands on the unsplit side
(its forward runs first). The last test shows the bound can fail: float32's rounding alone (a one-ulp nudge, or the
micro-batches' other summation order), and a loss share computed wrong, exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOLERANCE = 1e-10  # notebook 10, cells "With gradients too?", "Micro-batches written out by hand", exercise 3
SPLIT, SEED, BATCH, MICRO_COUNTS = 2, 0, 8, (1, 2, 4)  # notebook 10's parameters cell, smoke sizes
SIZES = dict(n_layer=4, n_head=2, d_model=32, seq_len=32)


def _model_and_batch():
    import torch

    from helpers.gpt import GPT, GPTConfig

    cfg = GPTConfig(**SIZES)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    torch.manual_seed(SEED)
    return GPT(cfg), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def check_split(threads, ulps, dtype="float64"):
    import functools

    import torch

    from helpers.launch import launch
    from helpers.pipeline import check_split as fn

    model, x, y = _model_and_batch()
    run = functools.partial(perturbed(fn, threads, ulps), split=SPLIT, dtype=getattr(torch, dtype))
    out = launch(run, 1, model, x, y, quiet=True, progress=False)[0]
    return {"forward_diff": out["forward_diff"], "grad_diff": out["grad_diff"]}


def check_schedules(threads, ulps, dtype="float64", loss_fn=None):
    import functools

    import torch

    from helpers.launch import launch
    from helpers.pipeline import check_schedules as fn

    model, x, y = _model_and_batch()
    run = functools.partial(perturbed(fn, threads, ulps), split=SPLIT, micro_counts=MICRO_COUNTS,
                            dtype=getattr(torch, dtype))
    if loss_fn is not None:  # a bug, injected: each micro-batch's loss summed instead of averaged
        import helpers.pipeline as pipeline

        plain = pipeline.pipeline_step
        pipeline.pipeline_step = lambda *a, **k: plain(*a, **k, loss_fn=loss_fn)
    out = launch(run, 1, model, x, y, quiet=True, progress=False)[0]
    return {"diffs": max(out["diffs"].values()), "step_diff": out["step_diff"]}


def _weighted_grads(rank, world_size, x, y, dtype, m=3):  # exercise 3's solution, as in the notebook
    import torch

    from helpers.gpt import GPT, GPTConfig
    from helpers.stages import lm_loss

    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**SIZES)).to(dtype)
    pieces = list(zip(x.chunk(m), y.chunk(m)))
    losses = {"batch": lambda: lm_loss(model(x), y),
              "mean": lambda: sum(lm_loss(model(a), b) for a, b in pieces) / len(pieces),
              "shares": lambda: sum(lm_loss(model(a), b) * len(a) / len(x) for a, b in pieces)}
    out = {}
    for name, loss in losses.items():
        model.zero_grad(set_to_none=True)
        loss().backward()
        out[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
    return {w: max((out[w][k] - out["batch"][k]).abs().max().item() for k in out["batch"]) for w in ("mean", "shares")}


def check_shares(threads, ulps, dtype="float64"):
    import functools

    import torch

    from helpers.launch import launch

    _, x, y = _model_and_batch()
    run = functools.partial(perturbed(_weighted_grads, threads, ulps), dtype=getattr(torch, dtype))
    return launch(run, 1, x, y, quiet=True, progress=False)[0]


def check_what_the_bound_catches(threads, ulps):
    import torch.nn.functional as F

    def summed(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")

    return {"float32_split": check_split(threads, 1, "float32")["grad_diff"],  # unnudged, both sides run one code
            "float32_schedules": check_schedules(threads, ulps, "float32")["diffs"],
            "loss_summed": check_schedules(threads, ulps, "float64", loss_fn=summed)["diffs"]}


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
def test_loss_shares_give_the_batch_s_gradient_and_the_mean_of_unequal_pieces_does_not(threads, ulps):
    out = run_check(__file__, "check_shares", threads, ulps)
    print(f"exercise 3, {threads} thread(s), {ulps} ulp: {out}")
    assert out["shares"] < TOLERANCE and out["mean"] > 1e4 * TOLERANCE  # the notebook's assert


def test_the_bound_fails_for_float32_and_a_wrong_loss_share():
    out = run_check(__file__, "check_what_the_bound_catches", 1, 0)
    print(out)
    assert out["float32_split"] > TOLERANCE and out["float32_schedules"] > TOLERANCE, "float32's rounding exceeds it"
    assert out["loss_summed"] > 1e-4, "a loss share computed wrong moves the gradient by its own size"
