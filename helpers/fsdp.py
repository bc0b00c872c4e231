"""FSDP2's production recipe as notebook 17 teaches it, for the notebooks, scripts and tests that shard the GPT.

The lesson is written in notebooks/16-fsdp.ipynb (``fully_shard`` per block and at the root) and
notebooks/17-fsdp-in-production.ipynb, whose ``shard`` is exported below: called without options it makes notebook
16's calls; its options add a ``MixedPrecisionPolicy``, per-block activation checkpointing and explicit prefetching.
Notebook 18 shards the GPT it checkpoints with it, and the tests rerun 16's and 17's checks with it.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


# ---- exported from notebooks/17-fsdp-in-production.ipynb: edit it there, then run `make export` ----
def shard(model, mesh, *, reshard_after_forward=None, param_dtype=None, checkpointing=False, prefetch=False):
    """fully_shard each block, then the root; optionally checkpoint blocks, compute in param_dtype, prefetch.

    param_dtype: gather and compute in it, reduce gradients in float32.
    Introduced in notebooks/17-fsdp-in-production.ipynb.
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
# ---- end of export from notebooks/17-fsdp-in-production.ipynb ----
