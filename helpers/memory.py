"""Memory accounting for data parallelism: what each rank holds under DDP and the ZeRO stages / FSDP.

Training state comes in three parts per parameter: the parameter itself, its
gradient, and the optimizer's state (0 slots for plain SGD, 1 for momentum, 2
for Adam). DDP keeps all three whole on every rank; ZeRO-1 shards the optimizer
state over the W ranks, ZeRO-2 the gradients too, ZeRO-3 (= FSDP's full
sharding) the parameters too. The formulas here say what that costs in bytes;
``state_bytes`` measures it from the tensors a rank actually holds.
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import positive_int

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP")
PARTS = ("params", "grads", "optimizer")
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2}  # float32 tensors per parameter the optimizer keeps


def per_rank_bytes(n_params: int, world_size: int, *, optimizer: str = "momentum", dtype_bytes: int = 4) -> dict:
    """Bytes per rank of parameters, gradients and optimizer state for DDP and each ZeRO stage.

    Returns ``{stage: {"params", "grads", "optimizer", "total"}}``; a sharded part
    is divided by ``world_size`` (rounded up, as a rank holds whole elements).
    Activations are left out: they depend on the batch, not on the sharding.
    Introduced in notebooks/16-fsdp.ipynb.
    """
    positive_int("n_params", n_params)
    w = positive_int("world_size", world_size)
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    whole = {"params": n_params * dtype_bytes, "grads": n_params * dtype_bytes,
             "optimizer": n_params * dtype_bytes * OPTIMIZER_SLOTS[optimizer]}
    sharded_parts = {"DDP": (), "ZeRO-1": ("optimizer",), "ZeRO-2": ("optimizer", "grads"),
                     "ZeRO-3 / FSDP": ("optimizer", "grads", "params")}
    table = {}
    for stage in STAGES:
        row = {part: (-(-whole[part] // w) if part in sharded_parts[stage] else whole[part]) for part in PARTS}
        row["total"] = sum(row.values())
        table[stage] = row
    return table


def comm_bytes_per_step(n_params: int, world_size: int, *, param_bytes: int = 4, grad_bytes: int = 4,
                        reshard_after_forward: bool = True) -> dict:
    """Bytes each rank sends per training step with ring collectives: DDP's all-reduce vs FSDP's.

    A ring all-reduce of N bytes sends 2·(W−1)/W·N per rank; an all-gather or a
    reduce-scatter sends (W−1)/W·N. FSDP all-gathers the parameters (``param_bytes``
    each, 2 under a 16-bit ``param_dtype``) for the forward, again for the backward
    when every unit resharded after the forward, and reduce-scatters the gradients
    (``grad_bytes`` each: 4 under ``reduce_dtype=torch.float32``). Returns ``{"DDP": ..., "FSDP": ..., "FSDP/DDP": ...}``.
    Introduced in notebooks/16-fsdp.ipynb.
    """
    positive_int("n_params", n_params)
    w = positive_int("world_size", world_size)
    share = (w - 1) / w
    ddp = 2 * share * n_params * grad_bytes
    gathers = 2 if reshard_after_forward else 1
    fsdp = gathers * share * n_params * param_bytes + share * n_params * grad_bytes
    return {"DDP": ddp, "FSDP": fsdp, "FSDP/DDP": fsdp / ddp if ddp else float("nan")}


def transformer_params(d_model: int, layers: int, vocab: int = 32_000) -> int:
    """Parameters of a GPT-style decoder: 12·d² per layer (attention 4·d², MLP 8·d²) plus the embedding.

    Biases and norms are left out (under 0.1 % at these sizes); the output layer
    shares the embedding's weights, as in GPT-2.
    Introduced in notebooks/16-fsdp.ipynb.
    """
    positive_int("d_model", d_model)
    positive_int("layers", layers)
    positive_int("vocab", vocab)
    return 12 * d_model * d_model * layers + vocab * d_model


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t``: its local shard when ``t`` is a DTensor (FSDP2), else all of it.

    Machinery behind memory.state_bytes; no notebook calls it directly.
    """
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer=None) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer state, measured from the tensors.

    Gradients not yet created (or set to None) count 0; the optimizer's tensors
    are those in ``optimizer.state`` (momentum buffers, Adam's moments; scalar
    step counters included).
    Introduced in notebooks/09-memory.ipynb.
    """
    params = list(model.parameters())
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": opt}


def cuda_peak(step, device) -> int | None:
    """The most the CUDA caching allocator held during one call of ``step()`` on ``device``, whatever was resident
    before included (``reset_peak_memory_stats``, then ``max_memory_allocated``); None on any other device.

    09's launched rank reads it for a plain and a checkpointed step. Introduced in notebooks/09-memory.ipynb.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return torch.cuda.max_memory_allocated(device)
