"""FSDP2 (``fully_shard``) next to DDP: the sharded model builder and what each rank runs.

``train_rank`` trains a ``BlockStack`` with DDP, FSDP, or in one process on the
global batch, from the same seed on the same batches (step k's global batch is
split into W equal contiguous slices, one per rank), and returns the final full
parameters, per-step losses, step times, and the bytes the rank held. Only APIs
present in torch 2.11 and 2.14 are used: ``torch.distributed.fsdp.fully_shard``,
``MixedPrecisionPolicy``, ``torch.distributed.checkpoint`` and its ``state_dict``
helpers. ``launch_fsdp`` runs it on the plan's devices and says so when FSDP2
over gloo cannot use GPUs that ranks share (then the ranks run on the CPU).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from . import devices
from ._rank import rank_device, report
from .launch import RankFailed, launch
from .checks import positive_int, positive_number
from .memory import local_bytes, state_bytes
from .train import full_fp32, sync


class Block(nn.Module):
    """A pre-norm residual MLP block, x + W2·gelu(W1·LayerNorm(x)): a transformer block without attention.

    Introduced in notebooks/11-fsdp.ipynb.
    """

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    """Flattened 28x28 image → Linear to ``width`` → ``blocks`` Blocks → Linear to 10 classes.

    Introduced in notebooks/11-fsdp.ipynb.
    """

    def __init__(self, width: int = 128, blocks: int = 4, d_in: int = 784, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def block_stack_params(width: int, blocks: int, d_in: int = 784, classes: int = 10) -> int:
    """``BlockStack``'s parameter count by hand: embed, blocks of 8·w² + 7·w (two Linears + LayerNorm), head.

    Introduced in notebooks/11-fsdp.ipynb.
    """
    return (d_in + 1) * width + blocks * (8 * width * width + 7 * width) + (width + 1) * classes


def shard(model: BlockStack, mesh, *, reshard_after_forward: bool = True, mixed: bool = False) -> BlockStack:
    """``fully_shard`` each block, then the root (embed and head), over ``mesh``; returns the model, now FSDP.

    One unit per block lets FSDP gather one block's parameters at a time (and
    free them after, with ``reshard_after_forward``). ``mixed`` computes in
    bfloat16 (parameters gathered in bf16) and reduces gradients in float32.
    Introduced in notebooks/11-fsdp.ipynb.
    """
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed
              else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def global_batches(n: int, steps: int, global_batch: int, seed: int = 0) -> torch.Tensor:
    """Sample indices of ``steps`` global batches from one seeded shuffle, shape (steps, global_batch).

    Introduced in notebooks/11-fsdp.ipynb.
    """
    if steps * global_batch > n:
        raise ValueError(f"{steps} steps of {global_batch} samples need more than the {n} samples")
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[: steps * global_batch].view(steps, global_batch)


def _build(mode, world_size, device, width, blocks, seed, reshard, mixed):
    torch.manual_seed(seed)  # every rank (and the reference) starts from the same weights
    model = BlockStack(width, blocks).to(device)
    if mode == "fsdp":
        return shard(model, init_device_mesh(device.type, (world_size,)), reshard_after_forward=reshard,
                     mixed=mixed)
    if mode == "ddp":
        return DDP(model, device_ids=[device] if device.type == "cuda" else None)
    return model


def _full_params(model, mode) -> dict:
    if mode == "fsdp":  # a collective: every rank calls it; rank 0 gets the dict, the others {}
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    inner = model.module if mode == "ddp" else model
    return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}


def _step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def train_rank(rank: int, world_size: int, dataset, steps: int, global_batch: int, lr: float, *,
               mode: str = "fsdp", width: int = 128, blocks: int = 4, reshard: bool = True, mixed: bool = False,
               seed: int = 0, warmup: int = 0, on_cpu: bool = False) -> dict:
    """Train ``mode`` ("fsdp", "ddp" or "single": one process, the whole global batch) for ``steps`` steps.

    Each rank takes its slice of every global batch; ``warmup`` untimed steps
    come first, on the batches after the timed ones. Returns the full final
    parameters (on rank 0), losses, median/all step seconds, the bytes of
    parameters, gradients and optimizer state this rank holds after the last
    step, the parameter bytes held in full right after a forward pass, and peak
    GPU memory (None on CPU). Full float32 (TF32 off) unless ``mixed``.
    ``on_cpu`` keeps the rank on the CPU whatever the plan says.
    Introduced in notebooks/11-fsdp.ipynb.
    """
    if mode not in ("fsdp", "ddp", "single"):
        raise ValueError(f"mode must be 'fsdp', 'ddp' or 'single', got {mode!r}")
    if mode == "single" and world_size != 1:
        raise ValueError(f"mode='single' is one process: launch it with world_size=1, not {world_size}")
    positive_int("steps", steps)
    positive_number("lr", lr)
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} does not split into {world_size} equal slices")
    with full_fp32():
        return _train(rank, world_size, dataset, steps, global_batch, lr, mode, width, blocks, reshard, mixed,
                      seed, warmup, on_cpu)


def _train(rank, world_size, dataset, steps, global_batch, lr, mode, width, blocks, reshard, mixed, seed, warmup,
           on_cpu):
    device = torch.device("cpu") if on_cpu else rank_device()
    model = _build(mode, world_size, device, width, blocks, seed, reshard, mixed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    images, labels = dataset.tensors
    batches = global_batches(len(dataset), steps + warmup, global_batch, seed)
    b = global_batch // world_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def batch(k):
        idx = batches[k, rank * b:(rank + 1) * b]
        return images[idx].to(device), labels[idx].to(device)

    for k in range(steps, steps + warmup):  # untimed warm-up on batches the timed steps do not use
        _step(model, opt, *batch(k))
    if warmup:  # back to the start, so the timed steps train exactly what the reference trains
        model = _build(mode, world_size, device, width, blocks, seed, reshard, mixed)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, seconds = [], []
    for k in range(steps):
        x, y = batch(k)
        sync(device)
        start = time.perf_counter()
        loss = _step(model, opt, x, y)
        sync(device)
        seconds.append(time.perf_counter() - start)
        if mode == "ddp" or mode == "fsdp":  # the global batch's loss: the mean of the equal slices' losses
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
        report(step=k, total=steps, loss=losses[-1])
    held = state_bytes(model, opt)
    held["after_forward"] = _after_forward_bytes(model, *batch(0))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"params": _full_params(model, mode), "losses": losses, "seconds": seconds,
            "median_s": statistics.median(seconds), "bytes": held, "peak_gpu_bytes": peak, "device": str(device)}


def _after_forward_bytes(model, x, y) -> int:
    """Parameter bytes held right after a forward pass, before the backward: what ``reshard_after_forward`` frees.

    FSDP2 swaps a unit's registered parameters for full plain tensors while it is
    unsharded and back to DTensor shards when it reshards, so the parameters
    seen between forward and backward say what is held.
    """
    out = model(x)
    held = sum(local_bytes(p) for p in model.parameters())
    F.cross_entropy(out, y).backward()  # finish the step's collectives so every rank stays in step
    model.zero_grad(set_to_none=False)
    return held



def launch_fsdp(fn, world_size: int, *args, **kw):
    """``launch(fn, world_size, *args, **kw)``; where ranks share a GPU over gloo and that fails, again on the CPU.

    NCCL refuses two ranks on one GPU, so shared GPUs mean gloo, and whether
    FSDP2's all-gather and reduce-scatter run over gloo on CUDA tensors depends
    on the torch build. Rather than guess, try it; on failure print the error's
    first line and rerun with ``on_cpu=True`` (``fn`` must accept it). Returns
    ``(results, where)``, ``where`` a sentence saying which devices were used.
    Introduced in notebooks/11-fsdp.ipynb.
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
