"""Mixed precision: which precisions a device computes in hardware, and how many timed steps a comparison affords.

The autocast/GradScaler training step and the ranks that time and compare precisions are written in
notebooks/07-large-batch.ipynb. Its two small rules below are exported from there, so that the unit tests can
check them: bf16 offered only where the hardware has it (never ``torch.cuda.is_bf16_supported()``, which counts
emulation and starts CUDA), and a run sized from a few timed steps, so that an emulated precision costs seconds.
"""

from __future__ import annotations

import torch

from . import devices


# ---- exported from notebooks/07-large-batch.ipynb: edit it there, then run `make export` ----
def precisions(device) -> list[str]:
    """Precisions ``device`` computes in hardware.

    Introduced in notebooks/07-large-batch.ipynb.
    """
    device = torch.device(device)
    # never torch.cuda.is_bf16_supported() here: it counts emulation (True on a T4) and starts CUDA
    bf16 = ["bf16"] if devices.has_bf16(device) else []
    return ["fp32"] + bf16 + (["fp16"] if device.type == "cuda" else [])  # fp16 on a CPU: emulated, ~100x slower


def affordable_steps(seconds_per_step: dict, budget_s: float, *, most: int, least: int = 1) -> int:
    """Steps per precision that fit ``budget_s``.

    Introduced in notebooks/07-large-batch.ipynb.
    """
    one_step_each = sum(seconds_per_step.values())  # a slow precision buys fewer steps for every precision
    return max(least, min(most, int(budget_s / one_step_each)))
# ---- end of export from notebooks/07-large-batch.ipynb ----
