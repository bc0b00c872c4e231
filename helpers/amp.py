"""Mixed precision with ``torch.amp``: the same training in fp32, bf16 and (on a GPU) fp16, side by side.

Under ``torch.autocast`` matrix multiplies and convolutions run in a 16-bit
type while the weights, the optimizer and reductions stay float32 (what
apex's O1 did; apex's O2 kept fp16 weights, which autocast does not need).
bf16 has float32's range, so it needs no loss scaling; fp16 does not, so its
small gradients would underflow without ``GradScaler``. Whether 16 bits are
faster depends on the hardware *and* on the model having enough arithmetic
per step for the faster units to matter: the course's 29k-parameter ConvNet
is launch-bound on an H100 (FACTS.md), so a GPU gets a wide MLP here.
"""

from __future__ import annotations

import torch
from torch import nn

from . import bench
from ._rank import rank_device, report
from .checks import positive_int
from .data import DeviceLoader
from .models import ConvNet
from .train import evaluate, full_fp32, make_scaler, train_one_epoch


class WideMLP(nn.Module):
    """784 → hidden → … → 10 with ReLUs: big matrix multiplies, the work 16-bit units speed up.

    Introduced in notebooks/04-ddp-habits.ipynb.
    """

    def __init__(self, hidden: int = 4096, layers: int = 3):
        super().__init__()
        sizes = [28 * 28] + [hidden] * layers
        body = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        self.net = nn.Sequential(nn.Flatten(), *body, nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


def bench_model(device) -> tuple[nn.Module, str]:
    """The model the AMP comparison trains on ``device``, and why that one.

    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    if torch.device(device).type == "cuda":
        return WideMLP(), ("a wide MLP (3 x 4096 hidden, ~37M parameters): the course's ConvNet is launch-bound on a "
                           "GPU (each step is too small to keep it busy), so 16-bit arithmetic would have nothing "
                           "to speed up")
    return ConvNet(), "the course's ConvNet: on a CPU its convolutions are real work for one core"


def modes_for(device) -> list[str]:
    """The precisions worth running on ``device``: fp32 and bf16; fp16 + GradScaler on a GPU only.

    fp16 autocast on a CPU ran ~125x slower than fp32 (FACTS.md), and a GPU
    without bf16 support (before Ampere) skips bf16.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return ["fp32", "bf16"]
    return ["fp32"] + (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16"]


def _amp(mode: str):
    return None if mode == "fp32" else mode


def _fresh(device, mode, seed, lr):
    torch.manual_seed(seed)
    model = bench_model(device)[0].to(device)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), make_scaler(device, _amp(mode))


def _train(model, opt, scaler, loader, device, mode, steps) -> None:
    done = 0
    while done < steps:  # as many passes as the steps need
        n = min(steps - done, len(loader))
        train_one_epoch(model, loader, opt, device, amp=_amp(mode), scaler=scaler, max_steps=n)
        done += n


def _speeds(device, modes, loader, seed, lr, batch_size, bench_steps, rounds) -> dict:
    """Samples/s per mode: median, and the slowest and fastest round, from alternating rounds."""
    runs = {mode: _fresh(device, mode, seed, lr) for mode in modes}
    fns = {mode: (lambda m=mode: _train(*runs[m], loader, device, m, bench_steps)) for mode in modes}
    timed = bench.compare(fns, device=device, warmup=1, rounds=rounds)
    rate = bench_steps * batch_size
    return {m: {"median": rate / t["median"], "low": rate / t["max"], "high": rate / t["min"]}
            for m, t in timed.items()}


def amp_compare(rank: int, world_size: int, train_set, test_set, steps: int, batch_size: int, lr: float, *,
                bench_steps: int = 20, rounds: int = 5, seed: int = 0) -> dict:
    """Train the device's bench model in each of ``modes_for(device)``; accuracy, speed, peak memory per mode.

    Accuracy: ``steps`` steps from the same seed, then the test set. Speed:
    ``bench_steps`` steps per round, the modes alternating over ``rounds``
    rounds (median and spread). Memory (GPU only): peak allocated during a few
    steps. Meant for ``launch(amp_compare, 1, ...)``. fp32 means full fp32
    (TF32 off).
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("steps", steps)
    device = rank_device()
    modes = modes_for(device)
    loader = DeviceLoader(train_set, batch_size, device, drop_last=True, seed=seed)
    test_loader = DeviceLoader(test_set, 1000, device, shuffle=False)
    out = {"device": str(device), "model": bench_model(device)[1], "modes": modes, "accuracy": {}, "memory": {}}
    with full_fp32():
        for i, mode in enumerate(modes):
            model, opt, scaler = _fresh(device, mode, seed, lr)
            _train(model, opt, scaler, loader, device, mode, steps)
            out["accuracy"][mode] = evaluate(model, test_loader, device, amp=_amp(mode)).accuracy
            report(step=i, total=len(modes) * 2, loss=0.0)
            del model, opt, scaler
        out["samples_per_s"] = _speeds(device, modes, loader, seed, lr, batch_size, bench_steps, rounds)
        if device.type == "cuda":
            for mode in modes:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                model, opt, scaler = _fresh(device, mode, seed, lr)
                _train(model, opt, scaler, loader, device, mode, 3)
                out["memory"][mode] = torch.cuda.max_memory_allocated(device)
                del model, opt, scaler
    return out
