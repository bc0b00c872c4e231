"""The machinery around notebook 15's FSDP2 ranks: shared batches, a memory probe, and the CPU fallback.

The lesson (``fully_shard``, ``MixedPrecisionPolicy``, the training step and the
``torch.distributed.checkpoint`` save and load) is written in
notebooks/15-fsdp.ipynb. What stays here is what its ranks need around it: the
global batches every mode trains on, the bytes of parameters held between
forward and backward, and ``launch_fsdp``, which moves the ranks to the CPU
where FSDP2 over gloo cannot use GPUs that ranks share.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import devices
from .launch import RankFailed, launch
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


def launch_fsdp(fn, world_size: int, *args, **kw):
    """``launch(fn, world_size, *args, **kw)``; where ranks share a GPU over gloo and that fails, again on the CPU.

    NCCL refuses two ranks on one GPU, so shared GPUs mean gloo, and whether
    FSDP2's all-gather and reduce-scatter run over gloo on CUDA tensors depends
    on the torch build. Rather than guess, try it; on failure print the error's
    first line and rerun with ``on_cpu=True`` (``fn`` must accept it). Returns
    ``(results, where)``, ``where`` a sentence saying which devices were used.
    Introduced in notebooks/15-fsdp.ipynb.
    """
    plan = devices.plan(world_size)
    try:
        return launch(fn, world_size, *args, **kw), plan.sentence
    except RankFailed as e:
        if plan.kind not in ("shared-gpu", "partly-shared"):
            raise
        first = next((line for line in str(e).splitlines() if "Error" in line), str(e).splitlines()[0])
        print(f"FSDP2 over gloo on shared GPUs failed here ({first.strip()[:200]}); running the ranks on the CPU")
    kw.setdefault("quiet", True)
    return launch(functools.partial(fn, on_cpu=True), world_size, *args, **kw), (
        f"{world_size} ranks on CPU (gloo), because FSDP2 over gloo failed on the shared GPU")
