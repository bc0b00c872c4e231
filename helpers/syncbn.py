"""SyncBatchNorm: every rank normalises with the whole global batch's statistics.

With plain BatchNorm each DDP rank normalises with the mean and variance of
its own b samples, so W ranks are not one process with batch W·b (notebook
03 measures the gap). ``torch.nn.SyncBatchNorm`` all-reduces the statistics
first, but only on GPUs: on CPU ranks ``DDP(...)`` refuses it ("SyncBatchNorm
layers only work with GPU modules"). ``CPUSyncBatchNorm`` is a stand-in that
does the same arithmetic on any device: it all-reduces the per-channel sums and
counts, then the squared deviations, with an autograd-aware collective, so the backward pass
also flows through the other ranks' statistics, as torch's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .ddp import shard_sampler
from .models import ConvNet
from .train import full_fp32, train_one_epoch


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are all-reduced over the process group: the CPU stand-in.

    It exists because torch's SyncBatchNorm refuses CPU tensors; on GPU ranks
    use ``nn.SyncBatchNorm`` (``convert_sync_batchnorm`` picks).
    Introduced in notebooks/04-ddp-habits.ipynb.
    """

    def forward(self, x):
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        c = x.shape[1]
        local = torch.cat([x.sum((0, 2, 3)), torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)])
        total = _all_reduce_sum(local)
        count = total[-1]
        mean = total[:c] / count
        # Second pass over the centred values: E[x²] − mean² loses all its digits on a channel
        # that is nearly constant (a ReLU's dead channel), and the error then grows step after step.
        var = _all_reduce_sum(((x - mean.view(1, c, 1, 1)) ** 2).sum((0, 2, 3))) / count  # biased, as BN uses
        with torch.no_grad():  # running stats use the unbiased variance, as BatchNorm does
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(m * mean.detach())
            self.running_var.mul_(1 - m).add_(m * var.detach() * count / (count - 1))
            self.num_batches_tracked.add_(1)
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def _all_reduce_sum(t):
    """Sum over ranks, differentiable: the backward pass all-reduces the gradients too."""
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))


def convert_sync_batchnorm(model: nn.Module, device) -> nn.Module:
    """torch's ``nn.SyncBatchNorm`` on a GPU; on the CPU, every BatchNorm2d swapped for the stand-in.

    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, CPUSyncBatchNorm):
            new = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                   child.track_running_stats).to(device)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            convert_sync_batchnorm(child, device)
    return model


def which_sync(device) -> str:
    """Which SyncBatchNorm runs on ``device``, in words (printed so the stand-in is never mistaken for torch's).

    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    if torch.device(device).type == "cuda":
        return "torch.nn.SyncBatchNorm (GPU ranks)"
    return "CPUSyncBatchNorm, this course's stand-in (torch's SyncBatchNorm refuses CPU tensors)"


def bn_steps(rank: int, world_size: int, dataset, steps: int, batch_size: int, lr: float, *,
             sync: bool = True, seed: int = 0) -> dict:
    """DDP ConvNet with BatchNorm for ``steps`` steps; SyncBatchNorm when ``sync``. Full float32.

    Returns final parameters and buffers, the first BatchNorm's running
    statistics after step 1 (they reveal the batch statistics the rank used),
    and which SyncBatchNorm ran. Compare with ``ddp.reference_rank(...,
    batch_norm=True)`` on batch W·b.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("steps", steps)
    positive_number("lr", lr)
    device = rank_device()
    with full_fp32():
        torch.manual_seed(seed)  # the same initial weights as the one-process reference
        model = ConvNet(batch_norm=True).to(device)
        if sync:
            model = convert_sync_batchnorm(model, device)
        ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=shard_sampler(dataset, rank, world_size, seed),
                            drop_last=True)
        first = {}

        def on_step(step, loss):
            if step == 0:
                bn = model.layer1[1]
                first.update(mean=bn.running_mean.detach().clone(), var=bn.running_var.detach().clone())
            report(step=step, total=steps, loss=loss.item())

        train_one_epoch(ddp, loader, opt, device, max_steps=steps, on_step=on_step)
    return {"params": {k: v.detach() for k, v in model.state_dict().items()}, "first_stats": first,
            "kind": which_sync(device) if sync else "plain BatchNorm (per-rank statistics)"}

