"""Model parallelism: the course's ConvNet cut into two stages, and where stages go on this machine.

A stage is a run of consecutive layers on one device. ``TwoStage`` moves the
activation between the stages and leaves the labels to the caller (they
belong on ``output_device``). ``plan_stages`` and ``plan_hybrid`` say which
device each stage gets with the GPUs that exist (counts can be mocked), and
what that stands in for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .checks import positive_int
from .devices import gpu_count
from .models import ConvNet


def convnet_layers(net: ConvNet) -> list[tuple[str, nn.Module]]:
    """The ConvNet as one flat list of (name, layer), a Flatten before fc: the places a split can go.

    Introduced in notebooks/06-model-parallel.ipynb.
    """
    flat = [(f"{block}.{i}", layer) for block in ("layer1", "layer2")
            for i, layer in enumerate(getattr(net, block))]
    return flat + [("flatten", nn.Flatten(1)), ("fc", net.fc)]


def split_names(net: ConvNet | None = None) -> dict[int, str]:
    """Every valid split index k (stage 0 = layers[:k]) with a readable name: 'after layer1.3 | before layer2.0'.

    Introduced in notebooks/06-model-parallel.ipynb.
    """
    names = [n for n, _ in convnet_layers(net or ConvNet(batch_norm=False))]
    return {k: f"after {names[k - 1]} | before {names[k]}" for k in range(1, len(names))}


class TwoStage(nn.Module):
    """The ConvNet's layers in two stages on two devices; forward moves the activation between them.

    ``split`` = k puts layers[:k] (see ``convnet_layers``) in stage 0 and the
    rest in stage 1. The layers are ``net``'s own modules, moved, so
    ``convnet_state`` gives parameters and gradients under ConvNet's names.
    The loss's labels must be on ``output_device``.
    Introduced in notebooks/06-model-parallel.ipynb.
    """

    def __init__(self, net: ConvNet, split: int = 4, devices=("cpu", "cpu")):
        super().__init__()
        layers = convnet_layers(net)
        if isinstance(split, bool) or not isinstance(split, int) or not 0 < split < len(layers):
            raise ValueError(f"split must be an int from 1 to {len(layers) - 1} (see split_names()), got {split!r}")
        if len(devices) != 2:
            raise ValueError(f"a two-stage model needs 2 devices, got {devices!r}")
        self.split = split
        self.devices = tuple(torch.device(d) for d in devices)
        self.stage0 = nn.Sequential(*[m for _, m in layers[:split]]).to(self.devices[0])
        self.stage1 = nn.Sequential(*[m for _, m in layers[split:]]).to(self.devices[1])
        # Sequential numbers its children; remember which ConvNet layer each one was
        self._names = {f"stage0.{i}": n for i, (n, _) in enumerate(layers[:split])}
        self._names.update({f"stage1.{i}": n for i, (n, _) in enumerate(layers[split:])})

    @property
    def output_device(self) -> torch.device:
        return self.devices[1]

    def forward(self, x):
        h = self.stage0(x.to(self.devices[0]))
        return self.stage1(h.to(self.devices[1]))  # the hand-off: a copy between devices

    def convnet_name(self, key: str) -> str:
        """'stage1.0.weight' → 'layer2.0.weight': a parameter's name in the unsplit ConvNet.

        Introduced in notebooks/06-model-parallel.ipynb.
        """
        child, _, param = key.rpartition(".")
        return f"{self._names[child]}.{param}"

    def convnet_state(self, grads: bool = False) -> dict:
        """Parameters (or, with ``grads``, their gradients) on the CPU, keyed by ConvNet's names.

        Introduced in notebooks/06-model-parallel.ipynb.
        """
        return {self.convnet_name(k): (p.grad if grads else p).detach().cpu() for k, p in self.named_parameters()}


@dataclass(frozen=True)
class StagePlan:
    """Where each stage of one model goes, and a sentence saying what is real."""

    devices: tuple[torch.device, ...]
    kind: str       # "cpu", "one-gpu", "multi-gpu"
    sentence: str


def plan_stages(n_stages: int = 2, n_gpus: int | None = None) -> StagePlan:
    """Stage s → cuda:s when there is a GPU per stage; else all stages on cuda:0, or on the CPU.

    ``n_gpus`` overrides the count (for tests and "what if").
    Introduced in notebooks/06-model-parallel.ipynb.
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
    Introduced in notebooks/06-model-parallel.ipynb.
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


def saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run ``module(x)`` with autograd on; return the output and the bytes autograd saved for backward.

    This is a stage's activation memory per batch: what it must hold until
    the backward pass (tensors saved twice are counted once).
    Introduced in notebooks/06-model-parallel.ipynb.
    """
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else (id(t),)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    # parameters are saved too (a conv saves its weight); they are not activation memory
    params = {(p.device, p.untyped_storage().data_ptr()) for p in module.parameters()}
    return out, sum(b for k, b in seen.items() if k not in params)


def stage_memory(model: TwoStage, x: torch.Tensor) -> list[dict]:
    """Per stage: its layers, parameters (count, bytes), activation bytes saved for backward, output bytes.

    Introduced in notebooks/06-model-parallel.ipynb.
    """
    rows, h = [], x
    for s, (stage, device) in enumerate(zip((model.stage0, model.stage1), model.devices)):
        h, act = saved_bytes(stage, h.to(device))
        params = list(stage.parameters())
        names = [model._names[f"stage{s}.{i}"] for i in range(len(stage))]
        rows.append({"stage": s, "device": str(device), "layers": names, "params": sum(p.numel() for p in params),
                     "param_bytes": sum(p.numel() * p.element_size() for p in params), "activation_bytes": act,
                     "output_bytes": h.numel() * h.element_size()})
    return rows
