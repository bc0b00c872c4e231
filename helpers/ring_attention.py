"""Ring attention by hand: context parallelism's causal attention over a sequence split across ranks.

Each rank keeps its queries; key/value blocks travel a ring of batched isend/irecv and partial results are merged
with the log-sum-exp rule; the backward recomputes each block's softmax from the saved lse while dK/dV travel home.
The sequence is cut into 2·W chunks, two per rank: contiguous, or zig-zag (chunks i and 2W-1-i), which balances the
causal mask's work. The ring runs in every block of the course's GPT (RingSelfAttention), trained with tokens,
labels and positions split over the CP ranks (cp_step, train_rank); ring_forward_overlapped posts each hand-off
before the step's compute. Written in notebooks/23-context-parallel.ipynb and exported here (``make export``); the
tests import it from here. Below the export: the notebook's timing instrument (time_rings), machinery that only
times the rings the notebook writes.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from helpers.gpt import GPT, GPTConfig
from helpers.launch import rank_device
from helpers.train import sync


# ---- exported from notebooks/23-context-parallel.ipynb: edit it there, then run `make export` ----
def chunks_of(rank, world_size, zigzag):
    """The two of 2·world_size sequence chunks that ``rank`` holds.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    return [rank, 2 * world_size - 1 - rank] if zigzag else [2 * rank, 2 * rank + 1]


def positions(rank, world_size, T, zigzag):
    """The token positions ``rank`` holds, in order. Introduced in notebooks/23-context-parallel.ipynb."""
    c = T // (2 * world_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks_of(rank, world_size, zigzag)])


def blocks(rank, source, world_size, zigzag):
    """(query half, key half, diagonal) of each causal score block.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    theirs = chunks_of(source, world_size, zigzag)
    return [(a, b, i == j) for a, i in enumerate(chunks_of(rank, world_size, zigzag))
            for b, j in enumerate(theirs) if j <= i]  # j > i: every key after every query, skipped


def scores(q, k, diagonal):
    """Scaled scores q·kᵀ, the future masked on a diagonal block.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def merge(out, lse, block_out, block_lse):
    """Fold one block's attention into the running one. Introduced in notebooks/23-context-parallel.ipynb."""
    new = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new


def post(t, group=None):
    """Start sending ``t`` right and receiving the left's: (incoming, requests).

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(r + 1) % W),
           dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % W)]
    return incoming, dist.batch_isend_irecv(ops)  # posted together, as in notebook 03's ring


def exchange(t, group=None):
    """Send ``t`` right, receive the left's, wait. Introduced in notebooks/23-context-parallel.ipynb."""
    incoming, requests = post(t, group)
    for request in requests:
        request.wait()
    return incoming


def fold(q, kv, out, lse, rank, source, world_size, zigzag):
    """Fold the score blocks of ``source``'s K/V into (out, lse).

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    for a, b, diagonal in blocks(rank, source, world_size, zigzag):
        s = scores(q.chunk(2, 2)[a], kv[0].chunk(2, 2)[b], diagonal)
        block_lse = s.logsumexp(-1, keepdim=True)
        block_out = torch.exp(s - block_lse) @ kv[1].chunk(2, 2)[b]
        out[a], lse[a] = (block_out, block_lse) if out[a] is None else merge(out[a], lse[a], block_out, block_lse)


def ring_forward(q, k, v, zigzag, group=None):
    """Causal attention of this rank's queries over every rank's K/V: (out, lse).

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
    out, lse, kv = [None, None], [None, None], torch.stack([k, v])
    for step in range(W):
        fold(q, kv, out, lse, r, (r - step) % W, W, zigzag)
        if step < W - 1:
            kv = exchange(kv, group)  # pass the K/V on; wait for those of rank r - step - 1
    return torch.cat(out, 2), torch.cat(lse, 2)


def ring_backward(q, k, v, out, lse, dout, zigzag, group=None):
    """(dq, dk, dv) of ring_forward, K/V and dK/dV passed around the ring.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
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
            kv = exchange(kv, group)
        dkv = exchange(dkv, group)  # travels with its K/V; the last hand-off brings it home
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd op. Introduced in notebooks/23-context-parallel.ipynb."""

    @staticmethod
    def forward(ctx, q, k, v, zigzag, group=None):
        out, lse = ring_forward(q, k, v, zigzag, group)
        ctx.save_for_backward(q, k, v, out, lse)  # no scores kept: backward recomputes them block by block
        ctx.zigzag, ctx.group = zigzag, group
        return out

    @staticmethod
    def backward(ctx, dout):
        return *ring_backward(*ctx.saved_tensors, dout.contiguous(), ctx.zigzag, ctx.group), None, None


class RingSelfAttention(nn.Module):
    """The GPT's Attention, RingAttention in place of SDPA. Introduced in notebooks/23-context-parallel.ipynb."""

    def __init__(self, attn, group):
        super().__init__()
        self.q, self.k, self.v, self.o, self.head_dim, self.group = attn.q, attn.k, attn.v, attn.o, attn.head_dim, group

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = RingAttention.apply(q, k, v, True, self.group)  # was: F.scaled_dot_product_attention(..., is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def cp_step(model, optimizer, x, y, pos, n_tokens):
    """One AdamW step on this rank's tokens; returns its share of the loss.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    logits = model(x, positions=pos)  # pos: these tokens' places in the whole sequence
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / n_tokens  # a share of the mean
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # over every rank, dp and cp: the whole batch's gradient
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_rank(rank, world_size, x, y, steps, dp=1, ring=True, dtype=torch.float64, seed=0):
    """The GPT trained CP (× dp): (losses, parameters). Introduced in notebooks/23-context-parallel.ipynb."""
    device = rank_device()  # this launch's plan: a GPU of its own, or the CPU
    mesh = init_device_mesh(device.type, (dp, world_size // dp), mesh_dim_names=("dp", "cp"))
    cp, batch, T = mesh["cp"], x.shape[0] // dp, x.shape[1]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=T)).to(device, dtype)
    for block in model.blocks if ring else []:
        block.attn = RingSelfAttention(block.attn, cp.get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = slice(mesh["dp"].get_local_rank() * batch, (mesh["dp"].get_local_rank() + 1) * batch)  # dp: sequences
    pos = positions(cp.get_local_rank(), cp.size(), T, zigzag=True)  # cp: places in them
    mine_x, mine_y, pos = x[rows][:, pos].to(device), y[rows][:, pos].to(device), pos.to(device)
    losses = [cp_step(model, optimizer, mine_x, mine_y, pos, y.numel()) for _ in range(steps)]
    return losses, [p.detach().cpu() for p in model.parameters()]


def ring_forward_overlapped(q, k, v, zigzag, group=None):
    """ring_forward with each hand-off posted before the step's compute.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
    out, lse, kv = [None, None], [None, None], torch.stack([k, v])
    for step in range(W):
        if step < W - 1:
            incoming, requests = post(kv, group)  # the next step's K/V travel while this step computes
        fold(q, kv, out, lse, r, (r - step) % W, W, zigzag)
        if step < W - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return torch.cat(out, 2), torch.cat(lse, 2)
# ---- end of export from notebooks/23-context-parallel.ipynb ----


def time_rings(rank, world_size, T, cfg, rings, repeats, zigzag=True, sizes=()):
    """Run under launch: each ring's median (CPU s, wall s), whether their outputs agree, and hand-offs' fastest s.

    Machinery, not the lesson: it times what notebooks/23-context-parallel.ipynb writes on its page and passes in
    (ring_forward, ring_forward_overlapped; "compute alone" is the page's fold without the hand-offs, and the lone
    hand-offs are the page's exchange), with the course's honest-timing habits (bench.py, notebook 03's
    time_collectives): a barrier before each run, the device synchronised before the clock is read, a warm-up,
    medians. ``rings`` maps a name to a function like ring_forward; "compute alone" (every step's blocks, no
    hand-off) is added. Random float32 q, k, v of a (1, heads, T, head_dim) sequence, this rank's positions; the
    rings alternate within a repeat, the first repeat warms up. CPU s is this thread's time (the rank's own work,
    whichever core ran it); on a GPU both clocks read the synchronised wall. ``sizes``: bytes of lone hand-offs
    (exchange) to time as notebook 03 does, fastest of 20, for the α–β fit.

    Introduced in notebooks/23-context-parallel.ipynb.
    """
    device = rank_device()
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    g = torch.Generator().manual_seed(0)
    pos = positions(rank, world_size, T, zigzag)
    q, k, v = (torch.randn(1, cfg.n_head, T, cfg.head_dim, generator=g)[:, :, pos].to(device) for _ in range(3))

    def compute_alone(q, k, v, zigzag):  # the ring's blocks on this rank's own K/V, never moved: the compute alone
        out, lse, kv = [None, None], [None, None], torch.stack([k, v])
        for step in range(world_size):
            fold(q, kv, out, lse, rank, (rank - step) % world_size, world_size, zigzag)
        return torch.cat(out, 2), torch.cat(lse, 2)

    rings = dict(rings, **{"compute alone": compute_alone})
    seconds = {name: ([], []) for name in rings}
    outputs = {}
    with torch.no_grad():
        for repeat in range(repeats + 1):
            for name, ring in rings.items():
                dist.barrier()
                c0, t0 = clock(), time.perf_counter()
                outputs[name] = ring(q, k, v, zigzag)[0]
                sync(device)
                if repeat:
                    seconds[name][0].append(clock() - c0)
                    seconds[name][1].append(time.perf_counter() - t0)
    first = outputs[next(iter(rings))]
    same = all(torch.equal(outputs[name], first) for name in rings if name != "compute alone")  # its K/V: its own
    medians = {name: (statistics.median(c), statistics.median(w)) for name, (c, w) in seconds.items()}
    return medians, same, {n: _fastest_exchange(n, device) for n in sizes}


def _fastest_exchange(n, device, repeats=20):
    t = torch.zeros(n // 4, device=device)  # n bytes of float32
    for _ in range(3):
        exchange(t)  # warm-up: connections made, buffers allocated
    runs = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        exchange(t)
        sync(device)
        runs.append(time.perf_counter() - t0)
    return min(runs)
