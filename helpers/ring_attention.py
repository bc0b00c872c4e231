"""Ring attention by hand: context parallelism's causal attention over a sequence split across ranks.

Each rank keeps its queries; key/value blocks travel a ring of batched isend/irecv and partial results are merged
with the log-sum-exp rule; the backward recomputes each block's softmax from the saved lse while dK/dV travel home.
The sequence is cut into 2·W chunks, two per rank: contiguous, or zig-zag (chunks i and 2W-1-i), which balances the
causal mask's work. Written in notebooks/21-context-parallel.ipynb and exported here (``make export``); the tests
import it from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# ---- exported from notebooks/21-context-parallel.ipynb: edit it there, then run `make export` ----
def chunks_of(rank, world_size, zigzag):
    """The two of 2·world_size sequence chunks that ``rank`` holds. Introduced in notebooks/21-context-parallel.ipynb."""
    return [rank, 2 * world_size - 1 - rank] if zigzag else [2 * rank, 2 * rank + 1]


def positions(rank, world_size, T, zigzag):
    """The token positions ``rank`` holds, in order. Introduced in notebooks/21-context-parallel.ipynb."""
    c = T // (2 * world_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks_of(rank, world_size, zigzag)])


def blocks(rank, source, world_size, zigzag):
    """(query half, key half, diagonal) of each causal score block. Introduced in notebooks/21-context-parallel.ipynb."""
    theirs = chunks_of(source, world_size, zigzag)
    return [(a, b, i == j) for a, i in enumerate(chunks_of(rank, world_size, zigzag))
            for b, j in enumerate(theirs) if j <= i]  # j > i: every key after every query, skipped


def scores(q, k, diagonal):
    """Scaled scores q·kᵀ, the future masked on a diagonal block. Introduced in notebooks/21-context-parallel.ipynb."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def merge(out, lse, block_out, block_lse):
    """Fold one block's attention into the running one. Introduced in notebooks/21-context-parallel.ipynb."""
    new = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new


def exchange(t):
    """Send ``t`` right, receive the left's. Introduced in notebooks/21-context-parallel.ipynb."""
    W, r = dist.get_world_size(), dist.get_rank()
    incoming = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, (r + 1) % W), dist.P2POp(dist.irecv, incoming, (r - 1) % W)]
    for request in dist.batch_isend_irecv(ops):  # posted together, as in notebook 03's ring
        request.wait()
    return incoming


def ring_forward(q, k, v, zigzag):
    """Causal attention of this rank's queries over every rank's K/V: (out, lse). Introduced in notebooks/21-context-parallel.ipynb."""
    W, r = dist.get_world_size(), dist.get_rank()
    out, lse, kv = [None, None], [None, None], torch.stack([k, v])
    for step in range(W):
        for a, b, diagonal in blocks(r, (r - step) % W, W, zigzag):
            s = scores(q.chunk(2, 2)[a], kv[0].chunk(2, 2)[b], diagonal)
            block_lse = s.logsumexp(-1, keepdim=True)
            block_out = torch.exp(s - block_lse) @ kv[1].chunk(2, 2)[b]
            out[a], lse[a] = (block_out, block_lse) if out[a] is None else merge(out[a], lse[a], block_out, block_lse)
        if step < W - 1:
            kv = exchange(kv)  # pass the K/V on; receive those of rank r - step - 1
    return torch.cat(out, 2), torch.cat(lse, 2)


def ring_backward(q, k, v, out, lse, dout, zigzag):
    """(dq, dk, dv) of ring_forward, K/V and dK/dV passed around the ring. Introduced in notebooks/21-context-parallel.ipynb."""
    W, r = dist.get_world_size(), dist.get_rank()
    D = (dout * out).sum(-1, keepdim=True)
    dq, kv, dkv = torch.zeros_like(q), torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
    for step in range(W):
        for a, b, diagonal in blocks(r, (r - step) % W, W, zigzag):
            qa, ka, va = q.chunk(2, 2)[a], kv[0].chunk(2, 2)[b], kv[1].chunk(2, 2)[b]
            p = torch.exp(scores(qa, ka, diagonal) - lse.chunk(2, 2)[a])
            ds = p * (dout.chunk(2, 2)[a] @ va.transpose(-2, -1) - D.chunk(2, 2)[a]) * q.shape[-1] ** -0.5
            dq.chunk(2, 2)[a].add_(ds @ ka)
            dkv[0].chunk(2, 2)[b].add_(ds.transpose(-2, -1) @ qa)
            dkv[1].chunk(2, 2)[b].add_(p.transpose(-2, -1) @ dout.chunk(2, 2)[a])
        if step < W - 1:
            kv = exchange(kv)
        dkv = exchange(dkv)  # travels with its K/V; the last hand-off brings it home
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd op. Introduced in notebooks/21-context-parallel.ipynb."""

    @staticmethod
    def forward(ctx, q, k, v, zigzag):
        out, lse = ring_forward(q, k, v, zigzag)
        ctx.save_for_backward(q, k, v, out, lse)  # no scores kept: backward recomputes them block by block
        ctx.zigzag = zigzag
        return out

    @staticmethod
    def backward(ctx, dout):
        return *ring_backward(*ctx.saved_tensors, dout.contiguous(), ctx.zigzag), None
# ---- end of export from notebooks/21-context-parallel.ipynb ----
