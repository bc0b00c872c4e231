"""Model parallelism's machinery: the ConvNet's places to cut, where stages go on this machine, what they hold.

``TwoStage`` (the two ``nn.Sequential`` halves and the activation hand-off) is
written in notebooks/09-model-parallel.ipynb and exported into the region at
the end of this file. Here: the flat list of layers a cut chooses from, the
planners that say which device each stage (or each pipeline rank) gets with
the GPUs that exist (counts can be mocked), and the measurements of a stage:
the bytes it holds, the time it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .bench import compare
from .checks import positive_int
from .devices import gpu_count
from .models import ConvNet
from .train import sync


def convnet_layers(net: ConvNet) -> list[tuple[str, nn.Module]]:
    """The ConvNet as one flat list of (name, layer), a Flatten before fc: the places a split can go.

    Introduced in notebooks/09-model-parallel.ipynb.
    """
    flat = [(f"{block}.{i}", layer) for block in ("layer1", "layer2")
            for i, layer in enumerate(getattr(net, block))]
    return flat + [("flatten", nn.Flatten(1)), ("fc", net.fc)]


def split_names(net: ConvNet | None = None) -> dict[int, str]:
    """Every valid split index k (stage 0 = layers[:k]) with a readable name: 'after layer1.3 | before layer2.0'.

    Introduced in notebooks/10-pipelines.ipynb.
    """
    names = [n for n, _ in convnet_layers(net or ConvNet(batch_norm=False))]
    return {k: f"after {names[k - 1]} | before {names[k]}" for k in range(1, len(names))}


@dataclass(frozen=True)
class StagePlan:
    """Where each stage of one model goes (or each pipeline rank runs), and a sentence saying what is real."""

    devices: tuple[torch.device, ...]
    kind: str       # "cpu", "one-gpu", "multi-gpu"
    sentence: str


def plan_stages(n_stages: int = 2, n_gpus: int | None = None) -> StagePlan:
    """Stage s → cuda:s when there is a GPU per stage; else all stages on cuda:0, or on the CPU.

    ``n_gpus`` overrides the count (for tests and "what if").
    Introduced in notebooks/09-model-parallel.ipynb.
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
    Introduced in notebooks/10-pipelines.ipynb.
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
    Introduced in notebooks/10-pipelines.ipynb.
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
    Machinery behind stages' memory figures; no notebook calls it directly.
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


def stage_memory(model, x: torch.Tensor) -> list[dict]:
    """Per stage of a ``TwoStage``: its layers, parameters (count, bytes), activation bytes saved, output bytes.

    Introduced in notebooks/09-model-parallel.ipynb.
    """
    rows, h = [], x
    for s, (stage, device) in enumerate(zip((model.stage0, model.stage1), model.devices)):
        h, act = saved_bytes(stage, h.to(device))
        params = list(stage.parameters())
        rows.append({"stage": s, "device": str(device), "layers": list(model.names[s]),
                     "params": sum(p.numel() for p in params),
                     "param_bytes": sum(p.numel() * p.element_size() for p in params), "activation_bytes": act,
                     "output_bytes": h.numel() * h.element_size()})
    return rows


def stage_seconds(stage: nn.Module, inputs: torch.Tensor, target: torch.Tensor | None, device,
                  rounds: int = 5) -> float:
    """One stage's forward + backward time on a whole batch (median of ``rounds``), on ``device``, synchronised.

    With ``target`` (the last stage) the loss is the cross-entropy and the
    gradient of the input is computed too (it is what a later stage sends
    back); without, a stand-in gradient (``.sum()``) of the same work.
    Introduced in notebooks/09-model-parallel.ipynb.
    """
    device = torch.device(device)
    inputs = inputs.detach().to(device).requires_grad_(target is not None)
    target = None if target is None else target.to(device)

    def run():
        out = stage(inputs)
        (F.cross_entropy(out, target) if target is not None else out.sum()).backward()
        sync(device)

    return compare({"stage": run}, device=device, rounds=rounds)["stage"]["median"]


def own_stage_seconds(rank: int, world_size: int, stage: nn.Module, inputs, target, device, rounds: int = 5) -> float:
    """In a pipeline rank: time this rank's own stage on its own device, one rank at a time (barriers between).

    Taking turns keeps one rank's timing from sharing cores with another's.
    Introduced in notebooks/10-pipelines.ipynb.
    """
    seconds = None
    for r in range(world_size):
        if r == rank:
            seconds = stage_seconds(stage, inputs, target, device, rounds)
        dist.barrier()
    return seconds


# ---- exported from notebooks/09-model-parallel.ipynb: edit it there, then run `make export` ----
class TwoStage(nn.Module):
    """The ConvNet cut in two stages on two devices. Introduced in notebooks/09-model-parallel.ipynb."""

    # split = k: the first k layers of convnet_layers(net) in stage 0, the rest in stage 1 (net's own modules, moved)

    def __init__(self, net, split=4, devices=("cpu", "cpu")):
        super().__init__()
        layers = convnet_layers(net)  # [(name, module), ...] in the order forward runs them
        if isinstance(split, bool) or not isinstance(split, int) or not 0 < split < len(layers):
            raise ValueError(f"split must be an int from 1 to {len(layers) - 1}, got {split!r}")
        if len(devices) != 2:
            raise ValueError(f"need 2 devices, got {devices!r}")
        self.devices = tuple(torch.device(d) for d in devices)
        self.stage0 = nn.Sequential(*[m for _, m in layers[:split]]).to(self.devices[0])
        self.stage1 = nn.Sequential(*[m for _, m in layers[split:]]).to(self.devices[1])
        self.names = ([n for n, _ in layers[:split]], [n for n, _ in layers[split:]])  # each layer's ConvNet name

    @property
    def output_device(self):
        return self.devices[1]

    def forward(self, x):
        h = self.stage0(x.to(self.devices[0]))
        return self.stage1(h.to(self.devices[1]))  # the hand-off: the activation is copied to the next device

    def convnet_name(self, stage, key):  # (1, "0.weight") → "layer2.0.weight": the unsplit ConvNet's name
        index, _, param = key.partition(".")
        return f"{self.names[stage][int(index)]}.{param}"

    def convnet_state(self, grads=False):  # parameters (or their gradients) on the CPU, by ConvNet's names
        return {self.convnet_name(s, k): (p.grad if grads else p).detach().cpu()
                for s, stage in enumerate((self.stage0, self.stage1)) for k, p in stage.named_parameters()}
# ---- end of export from notebooks/09-model-parallel.ipynb ----
