"""helpers.ring_attention: notebook 23's exported ring attention, checked on its own.

The notebook checks the ring inside the GPT's attention on 4 ranks (tests/test_equivalence_23.py reruns that with
perturbed rounding); these tests check the pieces: the layouts cover the sequence once, the block counts the
notebook prints, the log-sum-exp merge, the ring forward and backward against SDPA on 2 and 3 ranks, both
layouts, where W does not equal the notebook's, the overlapped ring equal to the plain one bit for bit, the ring on
a process group of part of the ranks, and notebooks/figures/ring-attention.svg drawn from the blocks the ring runs.
"""

import importlib.util
from pathlib import Path


import pytest
import torch
import torch.nn.functional as F

from conftest import QUIET
from helpers.launch import launch
from helpers.ring_attention import (RingAttention, blocks, chunks_of, merge, positions, ring_forward,
                                    ring_forward_overlapped, scores)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [False, True])
def test_the_ranks_positions_cover_the_sequence_once(world_size, zigzag):
    T = 2 * world_size * 3
    held = torch.cat([positions(r, world_size, T, zigzag) for r in range(world_size)])
    assert sorted(held.tolist()) == list(range(T))
    assert all(len(set(chunks_of(r, world_size, zigzag))) == 2 for r in range(world_size))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_block_counts_contiguous_grow_with_the_rank_and_zigzag_are_level(world_size):
    count = lambda r, z: sum(len(blocks(r, s, world_size, z)) for s in range(world_size))
    contiguous = [count(r, False) for r in range(world_size)]
    zigzag = [count(r, True) for r in range(world_size)]
    assert contiguous == [4 * r + 3 for r in range(world_size)]
    assert zigzag == [2 * world_size + 1] * world_size
    assert sum(contiguous) == sum(zigzag) == world_size * (2 * world_size + 1)  # the causal triangle of 2W chunks
    diagonal = [sum(d for s in range(world_size) for _, _, d in blocks(r, s, world_size, True)) for r in range(world_size)]
    assert diagonal == [2] * world_size  # each rank masks its own two chunks only


def test_merging_blocks_in_any_order_gives_softmax_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v)
    out = lse = None
    for part in (slice(4, 6), slice(0, 1), slice(1, 4)):  # three key blocks, out of order
        s = scores(q, k[:, :, part], diagonal=False)
        block_lse = s.logsumexp(-1, keepdim=True)
        block_out = torch.exp(s - block_lse) @ v[:, :, part]
        out, lse = (block_out, block_lse) if out is None else merge(out, lse, block_out, block_lse)
    assert (out - reference).abs().max() < 1e-14
    assert (lse.squeeze(-1) - scores(q, k, False).logsumexp(-1)).abs().max() < 1e-13


def test_a_diagonal_block_masks_the_future():
    q = torch.randn(1, 1, 5, 3, dtype=torch.float64)
    s = scores(q, q, diagonal=True)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert torch.isinf(s[..., future]).all() and torch.isfinite(s[..., ~future]).all()


def _ring_rank(rank, world_size, T, zigzag):
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, T, 8, dtype=torch.float64) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.backward(grad)
    pos = positions(rank, world_size, T, zigzag)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*mine, zigzag)
    out.backward(grad[:, :, pos])
    pairs = [(out, out_ref[:, :, pos])] + [(m.grad, r.grad[:, :, pos]) for m, r in zip(mine, ref)]
    return max((a - b).abs().max().item() for a, b in pairs)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("zigzag", [False, True])
def test_the_ring_equals_causal_sdpa_in_output_and_gradients(world_size, zigzag):
    gaps = launch(_ring_rank, world_size, 2 * world_size * 5, zigzag, backend="gloo", **QUIET)
    assert max(gaps) < 1e-12, gaps


def _overlap_rank(rank, world_size, T, zigzag):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 4, dtype=torch.float64) for _ in range(3))
    pos = positions(rank, world_size, T, zigzag)
    mine = [t[:, :, pos] for t in (q, k, v)]
    plain, overlapped = ring_forward(*mine, zigzag), ring_forward_overlapped(*mine, zigzag)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, pos]
    return all(torch.equal(a, b) for a, b in zip(plain, overlapped)), (overlapped[0] - reference).abs().max().item()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("zigzag", [False, True])
def test_the_overlapped_ring_computes_what_the_plain_one_does_bit_for_bit(world_size, zigzag):
    out = launch(_overlap_rank, world_size, 2 * world_size * 4, zigzag, backend="gloo", **QUIET)
    assert all(same for same, _ in out)
    assert max(gap for _, gap in out) < 1e-12


def _subgroup_rank(rank, world_size):  # two rings of 2 on a (2, 2) mesh, each over its own cp group
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = mesh["cp"]
    torch.manual_seed(mesh["dp"].get_local_rank())  # each dp row its own sequence
    q, k, v, grad = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).backward(grad)
    pos = positions(cp.get_local_rank(), cp.size(), 8, True)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*mine, True, cp.get_group())
    out.backward(grad[:, :, pos])
    dist.barrier()
    return max((m.grad - r.grad[:, :, pos]).abs().max().item() for m, r in zip(mine, ref))


def test_the_ring_runs_over_the_cp_group_of_a_2d_mesh():
    assert max(launch(_subgroup_rank, 4, backend="gloo", **QUIET)) < 1e-12


def test_the_ring_figure_is_what_the_ring_computes():
    """notebooks/figures/ring-attention.svg is scripts/figure_ring.py's drawing of blocks() and chunks_of()."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "figure_ring.py"
    spec = importlib.util.spec_from_file_location("figure_ring", script)
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    assert figure.OUT.read_text() == figure.svg(), "run: python scripts/figure_ring.py"
    for zigzag in (False, True):  # every causal block exactly once: the triangle of 2W chunks, diagonal included
        cells = figure.computed(zigzag)
        assert sorted(cells) == [(i, j) for i in range(2 * figure.W) for j in range(i + 1)]
        assert all(diagonal == (i == j) for (i, j), (_, _, diagonal) in cells.items())
