"""A mixture-of-experts MLP for the course's GPT (notebooks/24-mixture-of-experts.ipynb) and expert parallelism with
FSDP (notebooks/25-expert-parallel.ipynb), exported here (tests/test_moe.py, tests/test_equivalence_24.py).

``route`` is the router's decision (top-k, renormalised weights, the optional capacity cut, DeepSeek-V3's bias for the
choice, Switch's load-balancing loss); ``Experts`` runs E stacked MLPs as one padded batched matmul; ``MoE`` is a
router, routed experts (dropless unless given a capacity) and a shared expert; ``update_bias`` is DeepSeek-V3's
balancing without a loss. ``AllToAll`` and ``ExpertParallel`` send a rank's rows to the ranks of their experts and
back with ``all_to_all_single`` and uneven splits; ``shard_experts`` lays the MoE-GPT out as EP × FSDP on an
(edp, ep) mesh; ``ep_fsdp_rank`` runs one step of it (``moe_loss``) beside one process (``reference``) and
``compare`` measures the gaps.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from helpers import gpt
from helpers._rank import rank_device


# ---- exported from notebooks/24-mixture-of-experts.ipynb: edit it there, then run `make export` ----
def route(logits, k, capacity_factor=None, bias=None):
    """Top-k experts per token, their renormalised weights, what capacity keeps (all: dropless), Switch's loss.

    Introduced in notebooks/24-mixture-of-experts.ipynb.
    """
    T, E = logits.shape
    probs = logits.softmax(-1)
    experts = (probs if bias is None else probs + bias).topk(k, dim=-1).indices  # the bias picks, never weighs
    weights = probs.gather(1, experts)
    weights = weights / weights.sum(-1, keepdim=True)  # Mixtral's convention
    one_hot = F.one_hot(experts.T.reshape(-1), E)  # slot-major: every first choice before any second
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:  # GShard's and Switch's cut; None: dropless
        capacity = math.ceil(capacity_factor * T * k / E)
        place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # each assignment's place in its expert's queue
        keep = (place < capacity).view(k, T).T
    f, P = one_hot.to(probs.dtype).mean(0), probs.mean(0)  # share of assignments, mean probability
    return weights, experts, keep, E * (f * P).sum()


class Experts(nn.Module):
    """E MLPs (d → h, GELU, → d) with stacked weights, run as one padded batched matmul on rows sorted by expert.

    Introduced in notebooks/24-mixture-of-experts.ipynb.
    """

    def __init__(self, n_experts, d_model, hidden):
        super().__init__()
        def init(fan_in, *shape):  # nn.Linear's default: uniform in ±1/√fan_in
            return nn.Parameter(torch.empty(n_experts, *shape).uniform_(-fan_in**-0.5, fan_in**-0.5))
        self.up, self.up_bias = init(d_model, d_model, hidden), init(d_model, 1, hidden)
        self.down, self.down_bias = init(hidden, hidden, d_model), init(hidden, 1, d_model)

    def forward(self, rows, counts):
        n = len(self.up)
        expert = torch.arange(n, device=rows.device).repeat_interleave(counts)  # each row's expert
        slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[expert]  # its place
        padded = rows.new_zeros(n, int(counts.max()), rows.shape[-1]).index_put((expert, slot), rows)
        hidden = F.gelu(torch.baddbmm(self.up_bias, padded, self.up))  # every expert at once
        return torch.baddbmm(self.down_bias, hidden, self.down)[expert, slot]


class MoE(nn.Module):
    """A router, E routed experts (dropless unless capacity_factor) and a shared one: a drop-in for Block.mlp.

    Introduced in notebooks/24-mixture-of-experts.ipynb.
    """

    def __init__(self, d_model, n_experts, k, hidden, shared_hidden=0, capacity_factor=None, bias_rate=0.0):
        super().__init__()
        self.k, self.capacity_factor, self.bias_rate = k, capacity_factor, bias_rate
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, hidden)
        self.shared = Experts(1, d_model, shared_hidden) if shared_hidden else None
        self.register_buffer("bias", torch.zeros(n_experts))  # DeepSeek-V3's; moved by update_bias only
        self.register_buffer("load", torch.zeros(n_experts))  # rows per expert since the last update_bias

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts, keep, self.aux_loss = route(self.router(tokens), self.k, self.capacity_factor,
                                                      self.bias if self.bias_rate else None)
        self.routed = experts.masked_fill(~keep, -1)  # each (token, slot)'s expert; -1: dropped
        t, s = torch.nonzero(keep, as_tuple=True)
        order = torch.argsort(experts[t, s], stable=True)  # by expert
        t, s = t[order], s[order]
        counts = torch.bincount(experts[t, s], minlength=len(self.load))
        self.load += counts
        y = torch.zeros_like(tokens).index_add(0, t, weights[t, s, None] * self.experts(tokens[t], counts))
        if self.shared is not None:  # every token, one expert
            y = y + self.shared(tokens, counts.new_tensor([len(tokens)]))
        return y.view_as(x)


@torch.no_grad()
def update_bias(moe):
    """DeepSeek-V3's balancing, torchtitan's rule: each expert's bias steps toward the mean load; load reset.

    Introduced in notebooks/24-mixture-of-experts.ipynb.
    """
    step = moe.bias_rate * torch.sign(moe.load.mean() - moe.load)
    moe.bias += step - step.mean()
    moe.load.zero_()
# ---- end of export from notebooks/24-mixture-of-experts.ipynb ----


# ---- exported from notebooks/25-expert-parallel.ipynb: edit it there, then run `make export` ----
class AllToAll(torch.autograd.Function):
    """Rows to ranks with uneven splits; backward sends each row's gradient back to where the row came from.

    Introduced in notebooks/25-expert-parallel.ipynb.
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


class ExpertParallel(nn.Module):
    """This rank's experts behind two all-to-alls: a drop-in for MoE.experts.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """

    def __init__(self, local, n_local, group):
        super().__init__()
        self.local, self.n, self.group = local, n_local, group

    def forward(self, rows, counts):  # counts: this rank's rows for each of the E experts
        W, n = dist.get_world_size(self.group), self.n
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # rows for each of my experts, from each rank: (W·n,)
        send, recv = counts.view(W, n).sum(1).tolist(), got.view(W, n).sum(1).tolist()
        arrived = AllToAll.apply(rows, send, recv, self.group)  # by sender, then by expert
        expert = torch.arange(n, device=rows.device).repeat(W).repeat_interleave(got)  # each row's local expert
        order = torch.argsort(expert, stable=True)  # by expert, as Experts wants them
        out = self.local(arrived[order], torch.bincount(expert, minlength=n))[torch.argsort(order)]
        self.sent = send, recv
        return AllToAll.apply(out, recv, send, self.group)  # each output to its token's rank, in the order it left


def shard_experts(model, mesh, dp, divide=True):
    """EP × FSDP: this rank's experts, sharded over "edp"; everything else over dp.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    ep = mesh["ep"]
    for block in model.blocks:
        local = block.mlp.experts
        n = len(local.up) // ep.size()
        first = ep.get_local_rank() * n  # this rank's experts: first … first + n − 1
        for name, p in list(local.named_parameters()):
            setattr(local, name, nn.Parameter(p.detach()[first:first + n].clone()))
        fully_shard(local, mesh=mesh["edp"])
        if divide:
            local.set_gradient_divide_factor(dp.size())  # the mean over every rank's tokens
        block.mlp.experts = ExpertParallel(local, n, ep.get_group())
    fully_shard(model, mesh=dp)  # the rest; the experts, already sharded, are left out
    return model


def rel(a, b):
    """The largest difference, relative to the reference's largest entry (0 where both are zero).

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def moe_loss(model, x, y, alpha):
    """The GPT's loss + alpha × the balancing losses.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    return gpt.gpt_loss(model, x, y) + alpha * sum(block.mlp.aux_loss for block in model.blocks)


def reference(model, xs, ys, rank, alpha):
    """One process, every rank's batch: backward of the mean loss; this rank's loss and routes.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    device, total = rank_device(), 0
    for r in range(len(xs)):
        loss = moe_loss(model, xs[r].to(device), ys[r].to(device), alpha)
        total = total + loss / len(xs)
        if r == rank:
            mine, routes = loss.detach(), [block.mlp.routed for block in model.blocks]
    total.backward()
    return mine, routes


def ep_fsdp_rank(rank, world_size, make_model, xs, ys, ep_size, alpha=0.01, seed=0, dtype=torch.float64, **shard):
    """The reference, then one EP × FSDP step on an (edp, ep) mesh.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    torch.manual_seed(seed)  # the same model on every rank
    device = rank_device()  # this launch's plan: a GPU of its own, or the CPU
    model = make_model().to(device, dtype)
    ref = copy.deepcopy(model)
    ref_loss, ref_routes = reference(ref, xs, ys, rank, alpha)
    mesh = init_device_mesh(device.type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    dp = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    shard_experts(model, mesh, dp, **shard)
    warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # the logits are a view; nothing here edits them in place
    logits = []  # each router's, in this rank's forward
    for block in model.blocks:
        block.mlp.router.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    with CommDebugMode() as comms:  # torch's count of the collectives in this step
        loss = moe_loss(model, xs[rank].to(device), ys[rank].to(device), alpha)
        loss.backward()
    calls = {str(k): v for k, v in comms.get_comm_counts().items()}
    return {**compare(model, ref, mesh, (loss.detach(), ref_loss), ref_routes, logits), "calls": calls}


def compare(model, ref, mesh, losses, ref_routes, logits):
    """Gaps to the reference, routes, margin, block 0's splits.

    Introduced in notebooks/25-expert-parallel.ipynb.
    """
    ranked = [z.softmax(-1).topk(model.blocks[0].mlp.k + 1).values for z in logits]
    refs, n = dict(ref.named_parameters()), model.blocks[0].mlp.experts.n
    first = mesh["ep"].get_local_rank() * n  # this rank's experts in the reference's stack
    gaps = {"loss": rel(*losses)}
    for name, p in model.named_parameters():
        want = refs[name.replace(".local.", ".")].grad
        gaps[name] = rel(p.grad.full_tensor(), want[first:first + n] if ".local." in name else want)
    return {"gaps": gaps, "same routes": all(torch.equal(b.mlp.routed, r) for b, r in zip(model.blocks, ref_routes)),
            "margin": min((t[:, :-1] - t[:, 1:]).min().item() for t in ranked),
            "sent": model.blocks[0].mlp.experts.sent}
# ---- end of export from notebooks/25-expert-parallel.ipynb ----
