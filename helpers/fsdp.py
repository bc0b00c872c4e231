"""FSDP2 as notebook 15 teaches it, and what notebooks 16 and 17 reuse around it.

The lesson is written in notebooks/15-fsdp.ipynb: ``shard`` (``fully_shard`` per block and at the root, a
``MixedPrecisionPolicy``, per-block activation checkpointing, explicit prefetching) is exported below from there, so
that the capstone, notebook 16 and the tests shard with the same code. Above the export: the small image model that
notebook 16 checkpoints (``BlockStack``, its meta-device build ``sharded_model``, ``train_step``) and the global
batches and per-rank slices that 16 and 17 train on.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


def global_batches(n: int, steps: int, global_batch: int, seed: int = 0) -> torch.Tensor:
    """Sample indices of ``steps`` global batches from one seeded shuffle, shape (steps, global_batch).

    Introduced in notebooks/16-distributed-checkpoints.ipynb.
    """
    if steps * global_batch > n:
        raise ValueError(f"{steps} steps of {global_batch} samples need more than the {n} samples")
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[: steps * global_batch].view(steps, global_batch)


class Block(nn.Module):
    """x + W2·gelu(W1·LayerNorm(x)): a pre-norm residual MLP block, BlockStack's.

    Introduced in notebooks/17-tensor-parallel.ipynb.
    """

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    """A flattened 28x28 image → Linear to width → `blocks` Blocks → Linear to 10 classes.

    Introduced in notebooks/16-distributed-checkpoints.ipynb.
    """

    def __init__(self, width=128, blocks=4):
        super().__init__()
        self.embed = nn.Linear(784, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def sharded_model(width, blocks, mesh, device, *, seed=0, dtype=torch.float32, **shard_kw):
    """BlockStack built on the meta device in `dtype`, sharded by ``shard``, given storage for its slices, initialised.

    Introduced in notebooks/16-distributed-checkpoints.ipynb.
    """
    with torch.device("meta"):
        model = BlockStack(width, blocks).to(dtype)  # shapes only, whatever the size
    shard(model, mesh, **shard_kw)  # DTensor parameters, still on meta
    model.to_empty(device=device)  # this rank's slices only, contents arbitrary
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def train_step(model, optimizer, x, y):
    """zero_grad, forward, backward, step; the loss, detached.

    Introduced in notebooks/16-distributed-checkpoints.ipynb.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # FSDP: gathers each block again, then reduce-scatters its gradients into the slices
    optimizer.step()  # FSDP: this rank's slices only
    return loss.detach()


def rank_slice(dataset, batches, k, rank, world_size, device, dtype=None):
    """This rank's equal slice of global batch k (row k of `batches`), the images cast to `dtype` if given.

    Introduced in notebooks/16-distributed-checkpoints.ipynb.
    """
    b = batches.shape[1] // world_size
    images, labels = dataset.tensors
    idx = batches[k, rank * b:(rank + 1) * b]
    return images[idx].to(device, dtype), labels[idx].to(device)


# ---- exported from notebooks/15-fsdp.ipynb: edit it there, then run `make export` ----
def shard(model, mesh, *, reshard_after_forward=None, param_dtype=None, checkpointing=False, prefetch=False):
    """fully_shard each block, then the root; optionally checkpoint blocks, compute in param_dtype, prefetch.

    param_dtype: gather and compute in it, reduce gradients in float32. Introduced in notebooks/15-fsdp.ipynb.
    """
    low = dict(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else {}
    for block in model.blocks:
        if checkpointing:  # keep the block's input only; run its forward again in backward
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy(**low))
    root = MixedPrecisionPolicy(**low, output_dtype=torch.float32 if param_dtype else None)  # float32 logits
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root)  # tok, pos, norm, head
    if prefetch:  # block i asks for block i+1's weights (backward: i−1's) before it computes
        for before, after in zip(model.blocks, model.blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return model
# ---- end of export from notebooks/15-fsdp.ipynb ----
