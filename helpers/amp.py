"""Mixed precision: which precisions a device computes in hardware.

The autocast/GradScaler training step and the rank that times and compares precisions are written in
notebooks/08-large-batch.ipynb. Its rule below is exported from there, so that the unit tests can check it: bf16
offered only where the hardware has it (never ``torch.cuda.is_bf16_supported()``, which counts emulation and starts
CUDA), fp16 only on GPUs: an x86 CPU emulates fp16 unless it has AVX512-FP16 or AMX-FP16, and the CPUs that have
those (Xeons since Sapphire Rapids) have bf16 too, which needs no GradScaler. Emulated, a 16-bit type still runs,
only slower than float32: a CPU converts to float32 and back around each operation, and a GPU below compute
capability 8.0 (T4, V100) runs bf16 convolutions in torch's own kernels, without cuDNN (``ConvParams::use_cudnn``
in aten/src/ATen/native/Convolution.cpp asks ``supportsBFloat16ConvolutionWithCuDNNv8``, true from 8.0).
``make_scaler`` (a GradScaler for fp16) is exported from the same notebook into train.py.
"""

from __future__ import annotations

import torch

from . import devices


# ---- exported from notebooks/08-large-batch.ipynb: edit it there, then run `make export` ----
def precisions(device) -> list[str]:
    """Precisions ``device`` computes in hardware.

    Introduced in notebooks/08-large-batch.ipynb.
    """
    device = torch.device(device)
    # never torch.cuda.is_bf16_supported() here: it counts emulation (True on a T4) and starts CUDA
    bf16 = ["bf16"] if devices.has_bf16(device) else []
    return ["fp32"] + bf16 + (["fp16"] if device.type == "cuda" else [])  # fp16 on GPUs only
# ---- end of export from notebooks/08-large-batch.ipynb ----
