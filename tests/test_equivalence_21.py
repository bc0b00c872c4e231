"""Notebook 21's equivalence check, rerun with its rounding perturbed (tests/perturb.py).

The ring (chunks, blocks, the log-sum-exp merge, the forward and the hand-written backward) is exported to
helpers/ring_attention.py and imported here as the notebook defines it. ``check_rank`` repeats the notebook's cell:
the first block's ``Attention`` of the course's GPT on a window of real text, run whole with
``F.scaled_dot_product_attention(is_causal=True)`` in each rank and, on the same rank, on its own tokens with
``RingAttention`` in place of SDPA, the weight gradients all-reduced. Output, input gradient and every weight
gradient are compared in float64 at the notebook's 1e-10, for both layouts. The ring's copy of the attention is made
before the reference's first forward, so ``nudge_first_forward`` nudges the reference alone. The last test shows
that the bound can fail: float32's rounding and a ring that forgets the mask on its diagonal blocks both exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOL = 1e-10  # notebook 21, "The ring, checked against one process"
W, T = 4, 64


def _rel(a, b):  # the notebook's rel
    return ((a - b).abs().max() / b.abs().max()).item()


def check_rank(rank, world_size, tokens, zigzag, dtype="float64", unmasked=False):
    import copy

    import torch
    import torch.distributed as dist

    from helpers import ring_attention
    from helpers.gpt import GPT, GPTConfig
    from helpers.ring_attention import RingAttention, positions

    if unmasked:  # the bug: the diagonal blocks computed without the causal mask
        right = ring_attention.blocks
        ring_attention.blocks = lambda *a: [(qa, kb, False) for qa, kb, _ in right(*a)]
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(seq_len=tokens.shape[1])).to(dtype)
    T = tokens.shape[1]
    x = (gpt.tok.weight[tokens] + gpt.pos.weight[:T]).detach()
    attn, mine = gpt.blocks[0].attn, copy.deepcopy(gpt.blocks[0].attn)  # before the reference runs
    grad_y = torch.randn(x.shape, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    y_ref = attn(x_ref)
    y_ref.backward(grad_y)
    pos = positions(rank, world_size, T, zigzag)
    x_cp = x[:, pos].clone().requires_grad_()
    B, Tl, _ = x_cp.shape
    q, k, v = (w(x_cp).view(B, Tl, -1, mine.head_dim).transpose(1, 2) for w in (mine.q, mine.k, mine.v))
    y = mine.o(RingAttention.apply(q, k, v, zigzag).transpose(1, 2).reshape(B, Tl, -1))
    y.backward(grad_y[:, pos])
    for p in mine.parameters():
        dist.all_reduce(p.grad)
    gaps = {n: _rel(p.grad, ref.grad) for (n, p), ref in zip(mine.named_parameters(), attn.parameters())}
    gaps.update(output=_rel(y, y_ref[:, pos]), input=_rel(x_cp.grad, x_ref.grad[:, pos]))
    return gaps


def _tokens():
    import torch

    from helpers import text

    train, _ = text.byte_splits(text.load_corpus()[0])
    return text.random_windows(train, 1, T, torch.Generator().manual_seed(0))[0]


def _launch(fn, *args):
    from helpers.launch import launch

    return launch(fn, W, *args, quiet=True, progress=False, backend="gloo")


def check_ring(threads, ulps):
    tokens = _tokens()
    return {layout: max(max(g.values()) for g in _launch(perturbed(check_rank, threads, ulps), tokens, zigzag))
            for layout, zigzag in (("contiguous", False), ("zig-zag", True))}


def check_what_the_bound_catches(threads, ulps):
    import functools

    tokens = _tokens()
    float32 = functools.partial(check_rank, dtype="float32")
    unmasked = functools.partial(check_rank, unmasked=True)
    return {"float32": max(max(g.values()) for g in _launch(float32, tokens, True)),
            "unmasked diagonal": max(g["output"] for g in _launch(unmasked, tokens, True))}


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_ring_attention_equals_full_causal_attention_in_float64(threads, ulps):
    gaps = run_check(__file__, "check_ring", threads, ulps)
    print(f"{threads} thread(s), {ulps} ulp: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    assert max(gaps.values()) < TOL, gaps


def test_the_bound_fails_for_float32_and_a_ring_that_sees_the_future():
    out = run_check(__file__, "check_what_the_bound_catches", 1, 0)
    print(out)
    assert out["float32"] > TOL, "float32's rounding alone exceeds it"
    assert out["unmasked diagonal"] > 1e-3, "a bug moves far more"
