"""The CPU stand-in for SyncBatchNorm: every rank normalises with the whole global batch's statistics.

``torch.nn.SyncBatchNorm`` runs on GPU ranks only: on CPU ranks ``DDP(...)`` refuses it ("SyncBatchNorm layers
only work with GPU modules"). ``CPUSyncBatchNorm`` does the same arithmetic on any device: it all-reduces the
per-channel sums and counts, then the squared deviations, with an autograd-aware collective, so the backward pass
also flows through the other ranks' statistics, as torch's does. The collectives differ: torch's forward
all-gathers each rank's mean, inverse std and count and its backward all-reduces two gradient sums (two per layer
per step, ``torch/nn/modules/_functions.py``); this one all-reduces twice in forward, and autograd all-reduces
their two gradients in backward (four per layer per step, counted in notebook 06). Notebook 06 converts with torch's
``nn.SyncBatchNorm.convert_sync_batchnorm`` on GPU ranks and with ``CPUSyncBatchNorm.convert_sync_batchnorm``
(the same call) on CPU ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are all-reduced over the process group: the CPU stand-in.

    It exists because torch's SyncBatchNorm refuses CPU tensors; on GPU ranks use ``nn.SyncBatchNorm``.
    Introduced in notebooks/06-ddp-habits.ipynb.
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

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """Every BatchNorm2d in ``module`` swapped for the stand-in, its state kept (torch's call, for CPU ranks)."""
        if isinstance(module, nn.BatchNorm2d) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            tensors = [*module.parameters(), *module.buffers()]
            if tensors:  # the module's device and floating dtype (float64 in notebook 06's exact checks)
                new = new.to(tensors[0].device, tensors[0].dtype)
            new.load_state_dict(module.state_dict())
            new.train(module.training)
            return new
        for name, child in module.named_children():
            setattr(module, name, cls.convert_sync_batchnorm(child))
        return module


def _all_reduce_sum(t):
    """Sum over ranks, differentiable: the backward pass all-reduces the gradients too."""
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
