"""Mixed precision: which precisions a device computes in hardware.

The autocast/GradScaler training step and the rank that times and compares precisions are written in
notebooks/07-large-batch.ipynb. Its rule below is exported from there, so that the unit tests can check it: bf16
offered only where the hardware has it (never ``torch.cuda.is_bf16_supported()``, which counts emulation and starts
CUDA), fp16 only on GPUs. ``make_scaler`` (a GradScaler for fp16) is exported from the same notebook into train.py.
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
# ---- end of export from notebooks/07-large-batch.ipynb ----
