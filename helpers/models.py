"""The course's models: the seeds' small ConvNet for 28x28 grey images."""

from __future__ import annotations

from torch import nn


class ConvNet(nn.Module):
    """Conv(1→16,k5)+BN+ReLU+MaxPool, Conv(16→32,k5)+BN+ReLU+MaxPool, Linear(7·7·32→10).

    ``batch_norm=False`` drops the BatchNorm layers: each replica or rank then
    computes exactly what one big batch would, which notebooks 02 and 03 assert
    (BatchNorm's per-replica statistics are the one honest difference).
    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, num_classes: int = 10, batch_norm: bool = True):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            norm = nn.BatchNorm2d(c_out) if batch_norm else nn.Identity()
            return nn.Sequential(nn.Conv2d(c_in, c_out, kernel_size=5, padding=2), norm,
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.layer1 = block(1, 16)
        self.layer2 = block(16, 32)
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def max_param_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two dicts of tensors (state dicts, gradients).

    Introduced in notebooks/02-data-parallel.ipynb.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())
