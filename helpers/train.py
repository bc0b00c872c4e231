"""One device, one process: train an epoch, evaluate, fit over epochs.

``train_one_epoch`` and ``evaluate`` are written in notebooks/01-single-gpu.ipynb and exported here (the region at
the end of this file); every DDP rank in later notebooks runs them. The loop keeps its running loss and accuracy on
the device (``Tally``) and reads them once per pass, so it never waits on the GPU inside a step (a
``loss.item()`` per step would). Around them: full-fp32 and autocast contexts, the Stop and LR-schedule hooks, and
``fit`` (epochs with a progress bar). ``make_scaler`` is exported from notebooks/08-large-batch.ipynb (the second
region at the end), and ``sync``, the wait before a clock read, from notebooks/03-collectives.ipynb (the third).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Stopped
from .checks import positive_int

AMP_DTYPES = {None: None, "off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Stats:
    """One pass's mean loss, accuracy, sample count and seconds (device synchronised)."""

    loss: float
    accuracy: float
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")


@contextlib.contextmanager
def full_fp32():
    """Run float32 work in true float32: TF32 off for cuDNN convolutions and CUDA matmuls, restored after.

    Ampere and later GPUs may run float32 convolutions in TF32 (10-bit mantissa),
    which this torch does by default for cuDNN. Two computations compared to
    float32 precision (DDP against one big batch, say) must both run inside this,
    or they differ by ~1e-3 on a GPU (measured on an H100). Setting these flags
    creates no CUDA context, so it is safe in the notebook before forking ranks.
    Introduced in notebooks/02-data-parallel.ipynb.
    """
    # Only the two flags that torch 2.4 to 2.14 all read: mixing them with set_float32_matmul_precision leaves
    # torch 2.14 in a "mix of legacy and new APIs" state where get_float32_matmul_precision() raises.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def autocast(device, amp: str | None):
    """``torch.autocast`` for 'bf16'/'fp16', or a no-op context for None/'off'.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {list(AMP_DTYPES)}, got {amp!r}")
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def stop_if_asked(stop, tally: Tally, step: int) -> None:
    """Raise ``helpers.Stopped`` (with the pass so far as ``partial``) once ``stop`` (a threading.Event) is set.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if stop is not None and stop.is_set():
        raise Stopped(f"stopped on request after {step} steps of this pass",
                      partial=tally.stats() if tally.seen else None)


@contextlib.contextmanager
def schedule_after_step(optimizer, scheduler):
    """Within the ``with``, step ``scheduler`` after every ``optimizer.step()`` that runs (a step post-hook).

    fp16's GradScaler skips ``optimizer.step()`` when a gradient overflowed, so the hook does not fire and the
    schedule advances only on the steps taken, without reading the scale back (``scaler.get_scale()`` is a CPU-GPU
    sync). An optimizer built with ``fused=True`` runs its step and skips inside it: there the schedule advances.
    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if scheduler is None:
        yield
        return
    handle = optimizer.register_step_post_hook(lambda *_: scheduler.step())
    try:
        yield
    finally:
        handle.remove()  # the optimizer outlives the pass; the next pass hangs its own


def _set_epoch(loader, epoch: int) -> None:
    """Reshuffle per epoch: DeviceLoader and DistributedSampler both need telling."""
    for obj in (loader, getattr(loader, "sampler", None)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def fit(model, train_loader, test_loader, optimizer, device, epochs: int, *, amp=None, scheduler=None,
        progress: bool = True, on_epoch=None, stop=None) -> list[dict]:
    """Train for ``epochs`` with a tqdm bar; returns one dict of figures per epoch.

    Each dict holds epoch, train_loss, train_acc, test_loss, test_acc,
    samples_per_s (training), seconds (training), elapsed (wall time since
    the start, evaluation included) and step_losses (each step's training loss,
    read once per epoch so no step waits for the GPU). ``on_epoch(row)`` sees each dict as it
    is made (a live plot, say). ``scheduler`` steps after every optimizer
    step. ``stop`` (a ``threading.Event``) ends training between steps by
    raising ``helpers.Stopped``, whose ``partial`` is the rows done so far.
    Introduced in notebooks/01-single-gpu.ipynb.
    """
    from tqdm.auto import tqdm

    positive_int("epochs", epochs)
    scaler = make_scaler(device, amp)
    history = []
    start = time.perf_counter()
    with tqdm(total=epochs * len(train_loader), disable=not progress, desc="train", unit="step") as bar:
        for epoch in range(epochs):
            _set_epoch(train_loader, epoch)
            losses = []

            def on_step(step, loss):
                losses.append(loss.detach())  # kept on the device; one read after the epoch
                bar.update(1)

            try:
                train = train_one_epoch(model, train_loader, optimizer, device, amp=amp, scaler=scaler,
                                        scheduler=scheduler, on_step=on_step, stop=stop)
            except Stopped as e:
                raise Stopped(f"stopped on request in epoch {epoch + 1} of {epochs}", partial=history) from e
            test = evaluate(model, test_loader, device, amp=amp)
            row = dict(epoch=epoch + 1, train_loss=train.loss, train_acc=train.accuracy,
                       test_loss=test.loss, test_acc=test.accuracy,
                       samples_per_s=train.samples_per_s, seconds=train.seconds,
                       elapsed=time.perf_counter() - start,
                       step_losses=torch.stack(losses).float().tolist())
            history.append(row)
            bar.set_postfix(loss=f"{train.loss:.3f}", test_acc=f"{test.accuracy:.3f}")
            if on_epoch is not None:
                on_epoch(row)
    return history


# ---- exported from notebooks/01-single-gpu.ipynb: edit it there, then run `make export` ----
class Tally:
    """Running loss and accuracy kept on the device. Introduced in notebooks/01-single-gpu.ipynb."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.loss = torch.zeros((), device=self.device)  # sums, on the device
        self.correct = torch.zeros((), dtype=torch.long, device=self.device)
        self.seen = 0  # a Python int: the batch sizes are known without asking the device
        if self.device.type == "cuda":  # start the clock once queued work is done
            torch.cuda.synchronize(self.device)
        self.start = time.perf_counter()

    def add(self, loss_sum, out, y) -> None:  # queues two additions on the device; waits for nothing
        self.loss += loss_sum
        self.correct += (out.argmax(1) == y).sum()
        self.seen += y.shape[0]

    def stats(self) -> Stats:  # the one wait of a pass: read the sums
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.start
        if self.seen == 0:
            raise ValueError("the loader produced no batches")
        return Stats(self.loss.item() / self.seen, self.correct.item() / self.seen, self.seen, seconds)


@torch.no_grad()
def evaluate(model, loader, device, *, amp=None, loss_fn=F.cross_entropy) -> Stats:
    """Mean loss and accuracy over ``loader``, without gradients.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    device = torch.device(device)
    model.eval()
    tally = Tally(device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, amp):
            out = model(x)
            loss_sum = loss_fn(out, y, reduction="sum").float()
        tally.add(loss_sum, out, y)
    return tally.stats()


def train_one_epoch(model, loader, optimizer, device, *, amp=None, scaler=None, scheduler=None,
                    loss_fn=F.cross_entropy, on_step=None, max_steps=None, stop=None) -> Stats:
    """One training pass over ``loader``; returns its Stats (mean loss, accuracy, samples, seconds).

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    device = torch.device(device)
    model.train()
    tally = Tally(device)  # loss and accuracy sums, kept on the device
    with schedule_after_step(optimizer, scheduler):  # the schedule steps after every optimizer step taken
        for step, (x, y) in enumerate(loader):
            if step == max_steps:
                break
            stop_if_asked(stop, tally, step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, amp):  # does nothing unless amp is "bf16" or "fp16"
                out = model(x)
                loss = loss_fn(out, y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:  # fp16: scale the loss up so small gradients survive, unscale before the step
                scaler.scale(loss).backward()
                scaler.step(optimizer)  # skips optimizer.step() when a gradient overflowed
                scaler.update()
            tally.add(loss.detach() * y.shape[0], out, y)  # no .item(): nothing waits for the device here
            if on_step is not None:
                on_step(step, loss)
    return tally.stats()
# ---- end of export from notebooks/01-single-gpu.ipynb ----


# ---- exported from notebooks/08-large-batch.ipynb: edit it there, then run `make export` ----
def make_scaler(device, amp):
    """A GradScaler for fp16, whose small gradients underflow; None for bf16 and fp32, which need none.

    Introduced in notebooks/08-large-batch.ipynb.
    """
    return torch.amp.GradScaler(torch.device(device).type) if amp == "fp16" else None
# ---- end of export from notebooks/08-large-batch.ipynb ----


# ---- exported from notebooks/03-collectives.ipynb: edit it there, then run `make export` ----
def sync(device) -> None:
    """Wait for queued GPU work on ``device``, or on each device of a list, so a clock read afterwards is honest.

    Work queued on several GPUs (nn.DataParallel's step) is finished only when every one of them is: a list syncs
    each. Introduced in notebooks/03-collectives.ipynb.
    """
    for d in device if isinstance(device, (list, tuple)) else [device]:
        d = torch.device(d)
        if d.type == "cuda":
            torch.cuda.synchronize(d)
# ---- end of export from notebooks/03-collectives.ipynb ----
