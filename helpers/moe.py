"""A mixture-of-experts MLP for the course's GPT and expert parallelism over ranks, written in
notebooks/22-expert-parallel.ipynb and exported here (tests/test_moe.py, tests/test_equivalence_22.py).

``route`` is the router's decision (top-k, renormalised weights, the capacity cut, Switch's load-balancing loss);
``MoE`` holds E copies of ``gpt.MLP`` and a router; ``AllToAll`` and ``ep_forward`` dispatch a rank's tokens to the
ranks of their experts and combine the outputs with ``all_to_all_single`` and uneven splits; ``ep_rank`` checks a
(dp, ep) mesh against the same MoE in one process.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from helpers import gpt
from helpers._rank import rank_device


# ---- exported from notebooks/22-expert-parallel.ipynb: edit it there, then run `make export` ----
def route(logits, k, capacity_factor):
    """Top-k experts per token, their renormalised weights, what capacity keeps, and Switch's balancing loss.

    Introduced in notebooks/22-expert-parallel.ipynb.
    """
    T, E = logits.shape
    probs = logits.softmax(-1)
    weights, experts = probs.topk(k, dim=-1)  # (T, k), the most probable first
    weights = weights / weights.sum(-1, keepdim=True)  # Mixtral's convention
    capacity = math.ceil(capacity_factor * T * k / E)
    one_hot = F.one_hot(experts.T.reshape(-1), E)  # slot-major: every first choice before any second
    place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # each assignment's place in its expert's queue
    keep = (place < capacity).view(k, T).T
    f, P = one_hot.to(probs.dtype).mean(0), probs.mean(0)  # share of assignments, mean probability
    return weights, experts, keep, E * (f * P).sum()


class MoE(nn.Module):
    """E copies of the GPT's MLP and a router that sends each token to k of them; a drop-in for Block.mlp.

    Introduced in notebooks/22-expert-parallel.ipynb.
    """

    def __init__(self, cfg, n_experts, k, capacity_factor):
        super().__init__()
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        self.router = nn.Linear(cfg.d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(gpt.MLP(cfg) for _ in range(n_experts))

    def route(self, tokens):
        weights, experts, keep, self.aux_loss = route(self.router(tokens), self.k, self.capacity_factor)
        self.routed = experts.masked_fill(~keep, -1)  # each (token, slot)'s expert; -1: dropped by capacity
        return weights, self.routed

    def forward(self, x):  # one group of tokens, every expert in this process
        tokens = x.reshape(-1, x.shape[-1])
        weights, routed = self.route(tokens)
        y = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            t, s = torch.nonzero(routed == e, as_tuple=True)  # the tokens (and slots) expert e keeps
            y = y.index_add(0, t, weights[t, s, None] * expert(tokens[t]))
        return y.view_as(x)


class AllToAll(torch.autograd.Function):
    """Rows to ranks with uneven splits; backward sends each row's gradient back to where the row came from.

    Introduced in notebooks/22-expert-parallel.ipynb.
    """

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def ep_forward(moe, x, group):
    """The MoE whose moe.experts are this rank's E/W: tokens dispatched to their experts' ranks, combined back.

    Introduced in notebooks/22-expert-parallel.ipynb.
    """
    W, n = dist.get_world_size(group), len(moe.experts)
    tokens = x.reshape(-1, x.shape[-1])
    weights, routed = moe.route(tokens)
    t, s = torch.nonzero(routed >= 0, as_tuple=True)  # the kept (token, slot) assignments
    order = torch.argsort(routed[t, s], stable=True)  # by expert, so by the expert's rank
    t, s = t[order], s[order]
    counts = torch.bincount(routed[t, s], minlength=moe.n_experts)  # rows for each expert, from this rank
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # rows for each of my experts, from each rank: (W·n,)
    send, recv = counts.view(W, n).sum(1).tolist(), got.view(W, n).sum(1).tolist()
    rows = AllToAll.apply(tokens[t], send, recv, group)  # arrive by sender, then by expert
    local = torch.arange(n, device=x.device).repeat(W).repeat_interleave(got)  # each arrived row's expert on this rank
    by_expert = torch.argsort(local, stable=True)
    chunks = rows[by_expert].split(torch.bincount(local, minlength=n).tolist())
    out = torch.cat([expert(c) for expert, c in zip(moe.experts, chunks)])[torch.argsort(by_expert)]
    back = AllToAll.apply(out, recv, send, group)  # each output to its token's rank, in the order it left
    moe.sent = send, recv
    return torch.zeros_like(tokens).index_add(0, t, weights[t, s, None] * back).view_as(x)


def rel(a, b):
    """The largest difference, relative to the reference's largest entry (0 where both are zero).

    Introduced in notebooks/22-expert-parallel.ipynb.
    """
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def ep_rank(rank, world_size, make_moe, tokens, ep_size, dtype=torch.float64, alpha=0.01, seed=0):
    """One process's MoE on every group (the reference), then this rank's experts on a (dp, ep) mesh; the gaps.

    Introduced in notebooks/22-expert-parallel.ipynb.
    """
    torch.manual_seed(seed)  # the same MoE and the same tokens on every rank
    device = rank_device()  # this launch's plan: a GPU of its own, or the CPU
    moe = make_moe().to(device, dtype)
    x = torch.randn(world_size, tokens, moe.router.in_features, dtype=dtype).to(device)  # group g: rank g's tokens
    mesh = init_device_mesh(device.type, (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
    n = moe.n_experts // ep_size
    first = mesh["ep"].get_local_rank() * n  # this rank's experts: first … first + n − 1
    mine = copy.deepcopy(moe)  # before the reference runs
    mine.experts = mine.experts[first:first + n]
    x_ref = x.clone().requires_grad_()
    ys, routes, loss = [], [], 0
    for g in range(world_size):  # one process: every group, every expert
        ys.append(moe(x_ref[g]))
        routes.append(moe.routed)
        loss = loss + (ys[-1].square().mean() + alpha * moe.aux_loss) / world_size
    loss.backward()
    x_mine = x[rank].clone().requires_grad_()
    with CommDebugMode() as forward:
        y = ep_forward(mine, x_mine, mesh["ep"].get_group())
    with CommDebugMode() as backward:
        ((y.square().mean() + alpha * mine.aux_loss) / world_size).backward()
        dist.all_reduce(mine.router.weight.grad)  # every rank's tokens
        for p in mine.experts.parameters():
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())  # every dp row's tokens
    top = moe.router(x[rank]).softmax(-1).topk(moe.k + 1).values  # this rank's ranked probabilities
    pairs = zip(mine.experts.parameters(), moe.experts[first:first + n].parameters())
    gaps = {"output": rel(y, ys[rank]), "input grad": rel(x_mine.grad, x_ref.grad[rank]),
            "router grad": rel(mine.router.weight.grad, moe.router.weight.grad),
            "expert grads": max(rel(p.grad, q.grad) for p, q in pairs)}
    calls = [{str(op): c for op, c in mode.get_comm_counts().items()} for mode in (forward, backward)]
    return {"gaps": gaps, "same routes": torch.equal(mine.routed, routes[rank]),
            "dropped": int((mine.routed < 0).sum()), "margin": (top[:, :-1] - top[:, 1:]).min().item(),
            "sent": mine.sent, "calls": calls}
# ---- end of export from notebooks/22-expert-parallel.ipynb ----
