"""Notebook 08's equivalence check, rerun with its rounding perturbed (tests/perturb.py).

Section 4 checks that activation checkpointing leaves the gradients alone: the same MLP blocks, plain and
checkpointed (``checkpoint(block, x, use_reentrant=False)``), one backward pass each, compared in float64 with
< 1e-10. The blocks and the gradient part of ``recompute_cost`` are copied from the notebook's cells (they are
defined there, not exported) at its smoke sizes; the nudge lands on the plain model (its forward runs first). The
last test shows the bound can fail: float32's rounding alone (one side one ulp off) and a recompute that sees other
weights exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOLERANCE = 1e-10  # notebook 08, section 4
WIDTH, BLOCKS, TOKENS, SEED = 128, 4, 256, 0  # notebook 08's parameters cell, smoke sizes


def _grad_gap(rank, world_size, dtype, other_weights=False):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):  # notebook 08, section 1
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, width, blocks, checkpointed=()):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
            self.checkpointed = set(checkpointed)

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                x = checkpoint(block, x, use_reentrant=False) if i in self.checkpointed else block(x)
            return x

    x = torch.randn(TOKENS, WIDTH)
    torch.manual_seed(SEED)
    plain = Net(WIDTH, BLOCKS)
    kept = Net(WIDTH, BLOCKS, checkpointed=range(BLOCKS))
    if not other_weights:  # other_weights: the bug of a checkpointed model that lacks the plain one's weights
        kept.load_state_dict(plain.state_dict())
    plain, kept = plain.to(dtype), kept.to(dtype)
    for model in (plain, kept):  # recompute_cost's step: the plain model's forward runs first
        model.zero_grad(set_to_none=True)
        model(x.to(dtype)).pow(2).mean().backward()
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(plain.parameters(), kept.parameters()))


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
