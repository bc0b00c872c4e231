"""The course's model and what compares models.

``ConvNet``, the small network for 28x28 grey images that every notebook trains, is written in
notebooks/01-single-gpu.ipynb and exported here (the first region at the end of this file); ``max_param_diff``, which
compares two models' weights or gradients, is written in notebooks/02-data-parallel.ipynb (the second region).
"""

from __future__ import annotations

from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---- exported from notebooks/01-single-gpu.ipynb: edit it there, then run `make export` ----
class ConvNet(nn.Module):
    """Two convolution blocks and a linear layer; ``batch_norm=False`` drops BatchNorm.

    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, num_classes: int = 10, batch_norm: bool = True):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            norm = nn.BatchNorm2d(c_out) if batch_norm else nn.Identity()
            return nn.Sequential(nn.Conv2d(c_in, c_out, kernel_size=5, padding=2), norm,
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.layer1 = block(1, 16)   # 28x28 → 14x14
        self.layer2 = block(16, 32)  # 14x14 → 7x7
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).flatten(1))
# ---- end of export from notebooks/01-single-gpu.ipynb ----


# ---- exported from notebooks/02-data-parallel.ipynb: edit it there, then run `make export` ----
def max_param_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two dicts of tensors (state dicts, gradients).

    Introduced in notebooks/02-data-parallel.ipynb.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())  # float64 stays float64
# ---- end of export from notebooks/02-data-parallel.ipynb ----
