"""FSDP2 as notebook 15 teaches it, and the machinery its ranks need around it.

The lesson (the model, ``shard`` with ``fully_shard`` and ``MixedPrecisionPolicy``,
the meta-device build, the training step) is written in notebooks/15-fsdp.ipynb
and exported below, so that notebook 16 (distributed checkpoints) and the tests
reuse the same code. Above the export: the global batches every mode trains on,
and the bytes of parameters held between forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .memory import local_bytes


def global_batches(n: int, steps: int, global_batch: int, seed: int = 0) -> torch.Tensor:
    """Sample indices of ``steps`` global batches from one seeded shuffle, shape (steps, global_batch).

    Introduced in notebooks/15-fsdp.ipynb.
    """
    if steps * global_batch > n:
        raise ValueError(f"{steps} steps of {global_batch} samples need more than the {n} samples")
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[: steps * global_batch].view(steps, global_batch)


def params_after_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Parameter bytes this rank holds right after a forward pass, before the backward (then runs that backward).

    FSDP2 swaps a unit's registered parameters for full plain tensors while it is
    unsharded and back to DTensor shards when it reshards, so the parameters
    seen between forward and backward say what ``reshard_after_forward`` freed.
    The backward runs so that every rank's collectives stay in step; the
    gradients it leaves are zeroed. Call it in a rank, never in the notebook.
    Introduced in notebooks/15-fsdp.ipynb.
    """
    out = model(x)
    held = sum(local_bytes(p) for p in model.parameters())
    F.cross_entropy(out, y).backward()
    model.zero_grad(set_to_none=False)
    return held


# ---- exported from notebooks/15-fsdp.ipynb: edit it there, then run `make export` ----
class Block(nn.Module):
    """x + W2·gelu(W1·LayerNorm(x)): a pre-norm residual MLP block.

    Introduced in notebooks/15-fsdp.ipynb.
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

    Introduced in notebooks/15-fsdp.ipynb.
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


def shard(model, mesh, *, reshard_after_forward=None, param_dtype=None):
    """fully_shard each block, then the root; param_dtype: gather and compute in it, reduce in float32.

    Introduced in notebooks/15-fsdp.ipynb.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:  # one unit per block
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)  # embed, head
    return model


def sharded_model(width, blocks, mesh, device, *, seed=0, dtype=torch.float32, **shard_kw):
    """BlockStack built on the meta device in `dtype`, sharded, given storage for this rank's slices, initialised.

    Introduced in notebooks/15-fsdp.ipynb.
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

    Introduced in notebooks/15-fsdp.ipynb.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # FSDP: gathers each block again, then reduce-scatters its gradients into the slices
    optimizer.step()  # FSDP: this rank's slices only
    return loss.detach()


def rank_slice(dataset, batches, k, rank, world_size, device, dtype=None):
    """This rank's equal slice of global batch k (row k of `batches`), the images cast to `dtype` if given.

    Introduced in notebooks/15-fsdp.ipynb.
    """
    b = batches.shape[1] // world_size
    images, labels = dataset.tensors
    idx = batches[k, rank * b:(rank + 1) * b]
    return images[idx].to(device, dtype), labels[idx].to(device)
# ---- end of export from notebooks/15-fsdp.ipynb ----
