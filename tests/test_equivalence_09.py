"""Notebook 09's equivalence check, rerun with its rounding perturbed (tests/perturb.py).

Section 4 checks that activation checkpointing leaves the gradients alone: the course's GPT, plain and with every
block checkpointed (``GPT.checkpointing``: ``checkpoint(block, x, use_reentrant=False)``), one backward pass each,
compared in float64 with < 1e-10. The GPT is imported from helpers/gpt.py (exported from the notebook);
the gradient part of ``recompute_cost`` (its checkpointed twin of the plain model) is copied from the notebook's cells
at its smoke sizes; the nudge lands on the plain model (its forward runs first). The last test shows the bound can fail: float32's
rounding alone (one side one ulp off) and a recompute that sees other weights exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOLERANCE = 1e-10  # notebook 09, section 4
SIZES = dict(n_layer=2, n_head=2, d_model=64, seq_len=64)  # notebook 09's parameters cell, smoke sizes
BATCH, SEED = 8, 0


def _grad_gap(rank, world_size, dtype, other_weights=False):
    import torch

    from helpers import text
    from helpers.gpt import GPT, GPTConfig, gpt_loss

    cfg = GPTConfig(**SIZES)
    data, _ = text.load_corpus()
    train_tokens, _ = text.byte_splits(data, held_out=0.1)
    x, y = text.random_windows(train_tokens, BATCH, cfg.seq_len, torch.Generator().manual_seed(SEED))
    torch.manual_seed(SEED)
    plain = GPT(cfg)
    kept = GPT(cfg)  # notebook 09's recompute_cost: a twin with the plain model's weights, checkpointed
    if not other_weights:  # other_weights: the bug of a checkpointed model that lacks the plain one's weights
        kept.load_state_dict(plain.state_dict())
    kept.checkpointing = True
    grads = []
    for model in (plain, kept):  # recompute_cost's step: the plain model's forward runs first
        model.to(dtype).zero_grad(set_to_none=True)
        gpt_loss(model, x, y).backward()
        grads.append([p.grad for p in model.parameters()])
    return max((g - k).abs().max().item() for g, k in zip(*grads))


def check_checkpointing(threads, ulps, dtype="float64", other_weights=False):
    import functools

    import torch

    from helpers.launch import launch

    run = functools.partial(perturbed(_grad_gap, threads, ulps), dtype=getattr(torch, dtype),
                            other_weights=other_weights)
    return {"grad_gap": launch(run, 1, quiet=True, progress=False)[0]}


def check_bound_fails(threads, ulps):
    return {"float32_nudged": check_checkpointing(threads, 1, "float32")["grad_gap"],
            "other_weights": check_checkpointing(threads, 0, "float64", other_weights=True)["grad_gap"]}


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_checkpointing_leaves_the_gradients_alone_in_float64(threads, ulps):
    out = run_check(__file__, "check_checkpointing", threads, ulps)
    print(f"section 4, {threads} thread(s), {ulps} ulp: {out}")
    assert out["grad_gap"] < TOLERANCE


def test_the_bound_fails_for_float32_and_other_weights():
    out = run_check(__file__, "check_bound_fails", 1, 0)
    print(out)
    assert out["float32_nudged"] > TOLERANCE, "float32's rounding alone exceeds the float64 bound"
    assert out["other_weights"] > 1e-4, "a recompute with other weights is off by a gradient's size"
