"""Learning-rate scaling with world size, and a linear warm-up.

W ranks with batch b each take steps of the global batch W·b: its gradient is
less noisy, so it can afford a larger step. The *linear scaling rule* (Goyal
et al., 2017) multiplies the learning rate by W; because a large rate at the
very start can blow the run up, it is reached by a linear *warm-up* over the
first steps.
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ._rank import rank_device, report
from .amp import modes_for
from .checks import positive_int, positive_number
from .ddp import shard_sampler
from .models import ConvNet
from .train import full_fp32, make_scaler, train_one_epoch


def warmup(optimizer, steps: int):
    """An LR scheduler that ramps the rate linearly from 1/steps of its value to all of it over ``steps`` steps.

    Step it after every optimizer step; ``steps=0`` means no warm-up.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("steps", steps, minimum=0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps) if steps else 1.0)


def scaled_lr(base_lr: float, world_size: int, scale: bool) -> float:
    """``base_lr × world_size`` under the linear scaling rule, else ``base_lr``.

    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_number("base_lr", base_lr)
    return base_lr * world_size if scale else base_lr


def lr_run(rank: int, world_size: int, dataset, steps: int, batch_size: int, base_lr: float, *,
           scale: bool = True, warmup_steps: int = 0, seed: int = 0, precision: str = "fp32") -> dict:
    """DDP ConvNet for ``steps`` steps at the (scaled, warmed-up) rate and ``precision``; the loss per step.

    ``precision``: one of ``amp.modes_for`` this rank's device ("fp32" is full
    fp32, TF32 off; "bf16"/"fp16" autocast, fp16 with a GradScaler). Reports
    each step to the notebook (for a live plot or a progress bar); also returns
    the global samples/s of the training loop as rank 0 timed it.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("steps", steps)
    device = rank_device()
    if precision not in modes_for(device):
        raise ValueError(f"precision={precision!r} is not offered on {device}: choose one of {modes_for(device)} "
                         "(fp16 autocast runs on GPUs only; bf16 needs a GPU that supports it, or the CPU)")
    amp = None if precision == "fp32" else precision
    torch.manual_seed(seed)
    model = ConvNet().to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    lr = scaled_lr(base_lr, world_size, scale)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    sched = warmup(opt, warmup_steps)
    scaler = make_scaler(device, amp)
    sampler = shard_sampler(dataset, rank, world_size, seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    losses = []

    def on_step(step, loss):
        losses.append(loss.item())  # .item() waits for the step, so the clock below times finished work
        report(step=step, total=steps, loss=losses[-1])

    done, epoch = 0, 0
    start = time.perf_counter()
    with full_fp32():
        while done < steps:  # as many epochs as the steps need
            sampler.set_epoch(epoch)
            n = min(steps - done, len(loader))
            train_one_epoch(ddp, loader, opt, device, amp=amp, scaler=scaler, scheduler=sched, max_steps=n,
                            on_step=lambda s, loss: on_step(done + s, loss))
            done, epoch = done + n, epoch + 1
    seconds = time.perf_counter() - start
    return {"losses": losses, "lr": lr, "global_batch": world_size * batch_size, "precision": precision,
            "samples_per_s": steps * world_size * batch_size / seconds}
