"""Checkpoints of an FSDP2 model both ways: a full state dict for one device, and sharded files for resuming.

The full state dict is gathered to rank 0 (``get_model_state_dict`` with
``full_state_dict=True``), loaded into a plain model and written with
``helpers.checkpoint.save``: one file any single process can load. The sharded
one is ``torch.distributed.checkpoint``: every rank writes its own shards of the
model and optimizer (no rank ever holds the whole), and loads them back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from . import checkpoint
from ._rank import rank_device
from .fsdp import BlockStack, _build, _full_params, _step, global_batches
from .train import full_fp32


def checkpoint_rank(rank: int, world_size: int, dataset, folder, steps: int, resume_at: int, global_batch: int,
                    lr: float, *, width: int = 128, blocks: int = 4, seed: int = 0, on_cpu: bool = False) -> dict:
    """Train FSDP ``resume_at`` steps, checkpoint both ways, resume from the sharded one, finish ``steps`` steps.

    The full state dict goes to rank 0 (``get_model_state_dict`` with
    ``full_state_dict``), which writes it with ``helpers.checkpoint.save`` into a
    plain ``BlockStack``: a file for inference on one device. The sharded
    checkpoint is ``torch.distributed.checkpoint`` (each rank writes its shards,
    model and optimizer); a fresh sharded model and optimizer load it and train on.
    Returns the resumed run's full parameters (rank 0), the files written, and
    those uninterrupted steps' parameters for comparison. ``on_cpu`` as in
    ``fsdp.train_rank``.
    Introduced in notebooks/11-fsdp.ipynb.
    """
    if not 0 < resume_at < steps:
        raise ValueError(f"resume_at must be between 1 and steps - 1 ({steps - 1}), got {resume_at}")
    with full_fp32():
        return _checkpoint(rank, world_size, dataset, folder, steps, resume_at, global_batch, lr, width, blocks,
                           seed, on_cpu)


def _fresh(world_size, device, width, blocks, seed, lr):
    model = _build("fsdp", world_size, device, width, blocks, seed, True, False)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _checkpoint(rank, world_size, dataset, folder, steps, resume_at, global_batch, lr, width, blocks, seed,
                on_cpu):
    device = torch.device("cpu") if on_cpu else rank_device()
    images, labels = dataset.tensors
    batches = global_batches(len(dataset), steps, global_batch, seed)
    b = global_batch // world_size

    def run(model, opt, ks):
        for k in ks:
            idx = batches[k, rank * b:(rank + 1) * b]
            _step(model, opt, images[idx].to(device), labels[idx].to(device))

    model, opt = _fresh(world_size, device, width, blocks, seed, lr)
    run(model, opt, range(steps))
    uninterrupted = _full_params(model, "fsdp")

    model, opt = _fresh(world_size, device, width, blocks, seed, lr)
    run(model, opt, range(resume_at))
    full = _full_params(model, "fsdp")
    full_path = f"{folder}/full.pt"
    if rank == 0:
        plain = BlockStack(width, blocks)
        plain.load_state_dict(full)
        checkpoint.save(full_path, plain, step=resume_at)
    sharded = f"{folder}/sharded"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=sharded)
    del model, opt  # the resumed run below starts from the files alone

    model, opt = _fresh(world_size, device, width, blocks, seed + 1, lr)  # other weights: the load must overwrite them
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=sharded)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    run(model, opt, range(resume_at, steps))
    dist.barrier()  # every rank's shard files are written before rank 0 lists them
    return {"resumed": _full_params(model, "fsdp"), "uninterrupted": uninterrupted, "full_path": full_path,
            "full_at_resume": full, "sharded_path": sharded}
