"""Model parallelism's machinery: the GPT's places to cut, where stages go on this machine, what they hold.

``gpt_stage`` (a copy of the GPT that keeps only some blocks), ``TwoStage``
(two such stages on two devices and the activation hand-off) and ``lm_loss``
are written in notebooks/10-model-parallel.ipynb and exported into the region
at the end of this file. Here: the names of the places a two-stage cut can go,
the planners that say which device each stage (or each pipeline rank) gets
with the GPUs that exist (counts can be mocked), and the measurements of a
stage: the bytes it holds, the time it takes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .bench import compare
from .checks import positive_int
from .devices import gpu_count
from .train import sync


@dataclass(frozen=True)
class StagePlan:
    """Where each stage of one model goes (or each pipeline rank runs), and a sentence saying what is real."""

    devices: tuple[torch.device, ...]
    kind: str       # "cpu", "one-gpu", "multi-gpu"
    sentence: str


def plan_stages(n_stages: int = 2, n_gpus: int | None = None) -> StagePlan:
    """Stage s → cuda:s when there is a GPU per stage; else all stages on cuda:0, or on the CPU.

    ``n_gpus`` overrides the count (for tests and "what if").
    Introduced in notebooks/10-model-parallel.ipynb.
    """
    positive_int("n_stages", n_stages)
    n = gpu_count() if n_gpus is None else positive_int("n_gpus", n_gpus, minimum=0)
    if n >= n_stages:
        devices = tuple(torch.device("cuda", s) for s in range(n_stages))
        return StagePlan(devices, "multi-gpu", f"{n_stages} stages on {n_stages} GPUs "
                         f"({', '.join(map(str, devices))}): real model parallelism, activations cross between GPUs")
    if n >= 1:
        return StagePlan((torch.device("cuda", 0),) * n_stages, "one-gpu",
                         f"{n_stages} stages, all on cuda:0 (this machine has {n} GPU{'s' if n > 1 else ''}): "
                         "the split, "
                         "the hand-off and the schedules are real; the stages share one GPU, so they cannot overlap")
    return StagePlan((torch.device("cpu"),) * n_stages, "cpu",
                     f"{n_stages} stages, all on the CPU (no GPU here): the split, the hand-off and the schedules are "
                     "real; the stages share the same cores, so they cannot overlap")


def plan_pipeline(n_stages: int = 2, n_gpus: int | None = None) -> StagePlan:
    """One rank per stage: rank s → cuda:s (NCCL) with a GPU per stage; otherwise every rank on the CPU (gloo).

    With fewer GPUs than stages the ranks would share one GPU, which shows
    nothing two CPU processes do not; the stage times that predict a perfect
    pipeline must then be measured on the CPU too (a rank measures its own).
    ``n_gpus`` overrides the count (for tests and "what if").
    Introduced in notebooks/11-pipelines.ipynb.
    """
    positive_int("n_stages", n_stages)
    n = gpu_count() if n_gpus is None else positive_int("n_gpus", n_gpus, minimum=0)
    if n >= n_stages:
        devices = tuple(torch.device("cuda", s) for s in range(n_stages))
        return StagePlan(devices, "multi-gpu", f"{n_stages} pipeline ranks on {n_stages} GPUs (nccl): real model "
                         "parallelism; the stage times are measured on those GPUs")
    where = f"{n} GPU for {n_stages} stages" if n else "no GPU"
    return StagePlan((torch.device("cpu"),) * n_stages, "cpu",
                     f"{n_stages} pipeline ranks on the CPU (gloo; {where} here): the stages and their times are "
                     "measured on CPU cores, so the pipeline is real and the speed is the CPU's")


@dataclass(frozen=True)
class HybridPlan:
    """Model + data parallel: each DDP rank's stage devices, the backend, and a sentence."""

    devices: tuple[tuple[torch.device, ...], ...]  # devices[rank][stage]
    backend: str
    kind: str       # "cpu", "shared-gpu", "multi-gpu"
    sentence: str

    @property
    def world_size(self) -> int:
        return len(self.devices)


def plan_hybrid(world_size: int = 2, n_stages: int = 2, n_gpus: int | None = None) -> HybridPlan:
    """Rank r, stage s → cuda:(r·S+s) with W·S GPUs; with fewer, each rank's stages share what exists.

    NCCL when no GPU is used by two ranks; gloo otherwise (NCCL refuses two
    ranks on one GPU) and on the CPU.
    Introduced in notebooks/11-pipelines.ipynb.
    """
    positive_int("world_size", world_size)
    positive_int("n_stages", n_stages)
    n = gpu_count() if n_gpus is None else positive_int("n_gpus", n_gpus, minimum=0)
    W, S = world_size, n_stages
    if n == 0:
        devices = tuple((torch.device("cpu"),) * S for _ in range(W))
        return HybridPlan(devices, "gloo", "cpu", f"{W} ranks × {S} stages, all on the CPU (gloo): DDP across ranks "
                          "and the split inside each rank are real; nothing here is a GPU's speed")
    if n >= W * S:
        devices = tuple(tuple(torch.device("cuda", r * S + s) for s in range(S)) for r in range(W))
        return HybridPlan(devices, "nccl", "multi-gpu", f"{W} ranks × {S} stages on {W * S} GPUs (nccl): real model "
                          "parallelism inside each rank and real data parallelism across ranks")
    if n >= W:
        # each rank keeps its own GPUs (stages round-robin over them), so NCCL still sees one owner per GPU
        per = n // W
        devices = tuple(tuple(torch.device("cuda", r * per + s % per) for s in range(S)) for r in range(W))
        return HybridPlan(devices, "nccl", "multi-gpu", f"{W} ranks on {n} GPUs (nccl): real data parallelism; "
                          f"each rank's {S} stages share {per} GPU{'s' if per > 1 else ''}, so the model split is "
                          f"planned, not spread (it needs {W * S} GPUs)")
    devices = tuple(tuple(torch.device("cuda", (r * S + s) % n) for s in range(S)) for r in range(W))
    return HybridPlan(devices, "gloo", "shared-gpu", f"{W} ranks × {S} stages on {n} GPU{'s' if n > 1 else ''} "
                      "(gloo: NCCL refuses two ranks on one GPU): the mechanics are real, no speed-up is expected")


def stage_seconds(stage: nn.Module, inputs: torch.Tensor, target: torch.Tensor | None, device,
                  rounds: int = 5) -> float:
    """One stage's forward + backward time on a whole batch (median of ``rounds``), on ``device``, synchronised.

    With ``target`` (the last stage) the loss is the GPT's (``lm_loss``); an
    activation input (a float tensor) gets its gradient computed too (what a
    stage sends back); without a target, a stand-in gradient (``.sum()``) of
    the same work.
    Introduced in notebooks/10-model-parallel.ipynb.
    """
    device = torch.device(device)
    inputs = inputs.detach().to(device).requires_grad_(inputs.is_floating_point())
    target = None if target is None else target.to(device)

    def run():
        out = stage(inputs)
        (lm_loss(out, target) if target is not None else out.sum()).backward()
        sync(device)

    return compare({"stage": run}, device=device, rounds=rounds)["stage"]["median"]


# ---- exported from notebooks/10-model-parallel.ipynb: edit it there, then run `make export` ----
def lm_loss(logits, targets):
    """Mean cross-entropy of the next byte over every position. Introduced in notebooks/10-model-parallel.ipynb."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_stage(model, blocks, *, first, last):
    """A copy of the GPT holding only `blocks`, the embeddings if first, norm and head if last.

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    stage = copy.deepcopy(model)
    for i in range(len(stage.blocks)):
        if i not in blocks:
            stage.blocks[i] = nn.Identity()  # not held here; its place, and every later block's name, kept
    if not first:
        stage.tok = stage.pos = None  # forward then takes the activation sent by the previous stage
    if not last:
        stage.norm = stage.head = None  # forward then returns the activation to send on
    return stage


class TwoStage(nn.Module):
    """The GPT cut in two stages on two devices. Introduced in notebooks/10-model-parallel.ipynb."""

    def __init__(self, model, split=2, devices=("cpu", "cpu")):  # split = k: blocks 0 … k−1 in stage 0
        super().__init__()
        n = len(model.blocks)
        if positive_int("split", split, minimum=0) > n:  # refuses 2.5 and True too
            raise ValueError(f"split must be from 0 to {n}, got {split}")
        self.devices = tuple(torch.device(d) for d in devices)
        self.stage0 = gpt_stage(model, range(split), first=True, last=False).to(self.devices[0])
        self.stage1 = gpt_stage(model, range(split, n), first=False, last=True).to(self.devices[1])

    def forward(self, idx):
        h = self.stage0(idx.to(self.devices[0]))
        return self.stage1(h.to(self.devices[1]))  # the hand-off: the activation is copied to the next device

    def gpt_state(self, grads=False):  # parameters (or gradients) on the CPU, by their GPT names
        return {k: (p.grad if grads else p).detach().cpu()
                for stage in (self.stage0, self.stage1) for k, p in stage.named_parameters()}
# ---- end of export from notebooks/10-model-parallel.ipynb ----
