"""Model FLOPs utilisation (MFU): the peak a device is measured against, and the capstone's sizes per device.

MFU = achieved FLOP/s ÷ peak FLOP/s, the achieved rate counted from the model (``helpers.gpt.train_flops_per_token``
× tokens per second), not from what the kernels happen to run (PaLM, appendix B: https://arxiv.org/abs/2204.02311).
The peak of a GPU is its datasheet's dense (no 2:4 sparsity) BF16 tensor-core figure (FP16 where the GPU has no
BF16), as the Playbook and torchtitan quote it; a CPU has no datasheet figure the course can rely on, so its peak is
*measured*: the median rate of a large float32 matmul on all its cores, labelled as such.

Introduced in notebooks/20-gpt-capstone.ipynb (and scripts/train_gpt.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

# Dense BF16 tensor-core TFLOP/s (FP16 for the T4, which has no BF16), from NVIDIA's datasheets; where a datasheet
# prints the 2:4-sparse figure (with an asterisk), the dense one is half of it (the T4, a Turing GPU, has no
# sparsity). Matched against the NVML name in order, so the more specific names come first ("L40S", "L40", "L4").
DATASHEET_TFLOPS = [
    # (substring of the NVML name, dense TFLOP/s, dtype, source)
    ("H100 PCIe", 756.0, "bf16", "https://www.nvidia.com/en-us/data-center/h100/ (datasheet: H100 PCIe, 1,513 sparse)"),
    ("H100 NVL", 835.0, "bf16", "https://www.nvidia.com/en-us/data-center/h100/ (datasheet: H100 NVL, 1,671 sparse)"),
    ("H100", 989.0, "bf16", "https://www.nvidia.com/en-us/data-center/h100/ (datasheet: H100 SXM, 1,979 sparse)"),
    ("H200 NVL", 835.0, "bf16", "https://www.nvidia.com/en-us/data-center/h200/ (datasheet: H200 NVL, 1,671 sparse)"),
    ("H200", 989.0, "bf16", "https://www.nvidia.com/en-us/data-center/h200/ (datasheet: H200 SXM, 1,979 sparse)"),
    ("A100", 312.0, "bf16", "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (624 sparse)"),
    ("L40S", 362.0, "bf16", "https://www.nvidia.com/en-us/data-center/l40s/ (datasheet: 733 sparse)"),
    ("L40", 181.0, "bf16", "https://www.nvidia.com/en-us/data-center/l40/ (datasheet: 181.05 dense, 362.1 sparse)"),
    ("L4", 121.0, "bf16", "https://www.nvidia.com/en-us/data-center/l4/ (datasheet: 242 sparse)"),
    ("A10", 125.0, "bf16", "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/"
                           "datasheet-new/nvidia-a10-datasheet.pdf (250 sparse)"),
    ("RTX 4090", 165.2, "bf16", "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
                                "nvidia-ada-gpu-architecture.pdf (BF16 with FP32 accumulate: 165.2 dense, 330.4 sparse)"),
    ("T4", 65.0, "fp16", "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
                         "t4-tensor-core-datasheet-951643.pdf (mixed precision FP16/FP32)"),
]
# "A10G" (AWS g5) is matched by "A10", but NVIDIA publishes no A10G datasheet: it is refused below, not guessed.
NO_DATASHEET = ("A10G",)


def datasheet_peak(gpu_name: str) -> tuple[float, str, str] | None:
    """(peak FLOP/s, dtype, source) of a GPU named as NVML names it; None when the table has no datasheet figure.

    Introduced in notebooks/20-gpt-capstone.ipynb.
    """
    if any(n in gpu_name for n in NO_DATASHEET):
        return None
    for key, tflops, dtype, source in DATASHEET_TFLOPS:
        if key in gpu_name:
            return tflops * 1e12, dtype, source
    return None


@dataclass(frozen=True)
class MatmulRate:
    """A measured matmul rate: median and range of the repeats, in FLOP/s."""

    median: float
    low: float
    high: float
    n: int
    threads: int
    dtype: str

    def __str__(self) -> str:
        return (f"{self.median / 1e9:.1f} GFLOP/s measured ({self.n}x{self.n} {self.dtype} matmul on {self.threads} "
                f"threads; range {self.low / 1e9:.1f}-{self.high / 1e9:.1f})")


def cpu_matmul_rate(n: int = 2048, repeats: int = 7, dtype=torch.float32, threads: int | None = None) -> MatmulRate:
    """The CPU's measured peak: median FLOP/s of an n x n matmul (2n³ FLOPs) on all usable cores, after a warm-up.

    Introduced in notebooks/20-gpt-capstone.ipynb.
    """
    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: the thread pool and the kernel's buffers
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            rates.append(2 * n**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(before)
    return MatmulRate(statistics.median(rates), min(rates), max(rates), n, threads, str(dtype).replace("torch.", ""))


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: tokens/s x FLOPs per token (the model's count) over the peak FLOP/s.

    Introduced in notebooks/20-gpt-capstone.ipynb.
    """
    if tokens_per_s < 0 or flops_per_token <= 0 or peak_flops <= 0:
        raise ValueError(f"tokens/s {tokens_per_s}, FLOPs/token {flops_per_token}, peak {peak_flops}: "
                         "need tokens/s >= 0 and positive FLOPs")
    return tokens_per_s * flops_per_token / peak_flops


# The capstone's sizes. "cpu": the whole notebook at full size (160 steps on 4 ranks over 2 cores, two short
# compile trials, a resumed run) ends within 5 minutes on 2 quiet cores.
# "gpu-16g" (T4, L4, A10, ~16-24 GiB) and "gpu-40g" (A100, H100, H200, ...): large enough that each step's matmuls
# (batch x seq_len rows of d_model-wide weights) keep the tensor cores busy rather than waiting for kernel launches,
# with room for AdamW's state and the activations of one checkpointed block. batch is the GLOBAL batch.
SIZES = {
    "smoke": dict(n_layer=2, n_head=4, d_model=64, seq_len=64, batch=8, steps=12, lr=3e-3),
    "cpu": dict(n_layer=4, n_head=4, d_model=128, seq_len=64, batch=16, steps=160, lr=3e-3),
    "gpu-16g": dict(n_layer=8, n_head=8, d_model=512, seq_len=512, batch=32, steps=400, lr=1e-3),
    "gpu-40g": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=64, steps=400, lr=6e-4),
}


def choose_size(device_type: str, memory_gib: float | None = None, smoke: bool = False) -> str:
    """The name of the size in SIZES for a device: "smoke" when asked, "cpu", or a GPU's by its memory.

    Introduced in notebooks/20-gpt-capstone.ipynb.
    """
    if smoke:
        return "smoke"
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        raise ValueError(f"no size for device type {device_type!r}")
    return "gpu-40g" if (memory_gib or 0) >= 39 else "gpu-16g"
