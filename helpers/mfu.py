"""Model FLOPs utilisation (MFU): the peak a device is measured against, and the capstone's sizes per device.

MFU = achieved FLOP/s ÷ peak FLOP/s, the achieved rate counted from the model (``helpers.gpt.train_flops_per_token``
× tokens per second), not from what the kernels happen to run (PaLM, appendix B: https://arxiv.org/abs/2204.02311).
The peak of a GPU is its datasheet's dense (no 2:4 sparsity) figure *for the precision its matmuls run in*: the
BF16 tensor-core figure for a bf16 run (as the Playbook and torchtitan quote it), and for a float32 run the plain
FP32 figure, because torch leaves TF32 off for float32 matmuls unless asked (then the TF32 tensor-core figure). A
CPU has no datasheet figure the course can rely on, so its peak is *measured*: the median rate of a large float32
matmul on all its cores, labelled as such.

Introduced in notebooks/22-gpt-capstone-run.ipynb (and scripts/train_gpt.py).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass

import torch

from . import devices

# Dense TFLOP/s from NVIDIA's datasheets, per precision: "bf16" (BF16 tensor cores; the T4, a Turing GPU, has none:
# its mixed-precision figure is "fp16"), "tf32" (TF32 tensor cores: float32 matmuls with TF32 allowed) and "fp32"
# (plain FP32, no tensor cores: float32 matmuls under torch's default). Where a datasheet prints a 2:4-sparse figure
# (with an asterisk), the dense one is half of it; each source quotes the datasheet's own figures.
DATASHEET_TFLOPS = [
    # (model, as whole words of the NVML name; {precision: dense TFLOP/s}; source)
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
     "https://www.nvidia.com/en-us/data-center/h100/ (datasheet, H100 PCIe: FP32 51, TF32 756 sparse, "
     "BF16 1,513 sparse)"),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
     "https://www.nvidia.com/en-us/data-center/h100/ (datasheet, H100 NVL: FP32 60, TF32 835 sparse, "
     "BF16 1,671 sparse)"),
    ("H100", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
     "https://www.nvidia.com/en-us/data-center/h100/ (datasheet, H100 SXM: FP32 67, TF32 989 sparse, "
     "BF16 1,979 sparse)"),
    ("H200 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
     "https://www.nvidia.com/en-us/data-center/h200/ (datasheet, H200 NVL: FP32 60, TF32 835 sparse, "
     "BF16 1,671 sparse)"),
    ("H200", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
     "https://www.nvidia.com/en-us/data-center/h200/ (datasheet, H200 SXM: FP32 67, TF32 989 sparse, "
     "BF16 1,979 sparse)"),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
     "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
     "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (FP32 19.5; TF32 156 dense, 312 sparse; BF16 312 dense, "
     "624 sparse)"),
    ("L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6},
     "https://www.nvidia.com/en-us/data-center/l40s/ (datasheet: FP32 91.6, TF32 183 dense, 366 sparse, "
     "BF16 362.05 dense, 733 sparse)"),
    ("L40", {"bf16": 181.05, "tf32": 90.5, "fp32": 90.5},
     "https://www.nvidia.com/en-us/data-center/l40/ (datasheet: FP32 90.5, TF32 90.5 dense, 181 sparse, "
     "BF16 181.05 dense, 362.1 sparse)"),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
     "https://www.nvidia.com/en-us/data-center/l4/ (datasheet: FP32 30.3, TF32 120 sparse, BF16 242 sparse)"),
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
     "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/"
     "datasheet-new/nvidia-a10-datasheet.pdf (FP32 31.2, TF32 62.5 dense, 125 sparse, BF16 125 dense, 250 sparse)"),
    ("RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6},
     "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP32 82.6; TF32 "
     "82.6 dense, 165.2 sparse; BF16 with FP32 accumulate 165.2 dense, 330.4 sparse)"),
    ("T4", {"fp16": 65.0, "fp32": 8.1},
     "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
     "t4-tensor-core-datasheet-951643.pdf (single precision FP32 8.1, mixed precision FP16/FP32 65; no BF16, no TF32)"),
]
# "A10G" (AWS g5) is not an "A10" (another word), and NVIDIA publishes no A10G datasheet: refused, not guessed. So
# are "RTX A1000" (not an A100) and "T400" (not a T4).


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[\s\-_/]+", name.upper()) if w]


def datasheet_peak(gpu_name: str, precision: str = "bf16") -> tuple[float, str, str] | None:
    """(peak FLOP/s, precision, source) of a GPU named as NVML names it; None where no datasheet figure is known.

    A model matches when its words are whole words of the name, in order: "NVIDIA A100-SXM4-40GB" is an A100,
    "NVIDIA RTX A1000" is not, nor is "NVIDIA T400" a T4. ``precision`` is the datasheet row the run's matmuls use
    (``matmul_precision``): "bf16", "fp16", "tf32" or "fp32".
    Introduced in notebooks/22-gpt-capstone-run.ipynb.
    """
    words = _words(gpu_name)
    for model, tflops, source in DATASHEET_TFLOPS:
        key = _words(model)
        if any(words[i:i + len(key)] == key for i in range(len(words) - len(key) + 1)):
            return (tflops[precision] * 1e12, precision, source) if precision in tflops else None
    return None


def matmul_precision(dtype: torch.dtype) -> str:
    """The datasheet row a GPU's matmuls run at when training in ``dtype``: "bf16", "fp16", "tf32", "fp32" or "fp64".

    float32 is "fp32" unless TF32 is allowed for CUDA matmuls in this process: torch's default is off ("none",
    which falls back to IEEE float32), switched on by ``torch.backends.cuda.matmul.fp32_precision = "tf32"``, the
    legacy ``allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``; the ``fp32_precision`` getter
    reads all three (torch/backends/cuda/__init__.py).
    Machinery behind plan_capstone and scripts/train_gpt.py's peak; no notebook calls it directly.
    """
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    if dtype not in names:
        raise ValueError(f"no datasheet precision for {dtype}")
    return names[dtype]


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

    Introduced in notebooks/22-gpt-capstone-run.ipynb.
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


def run_peak(device: torch.device, world: int, dtype: torch.dtype, given: float | None = None
             ) -> tuple[float | None, str]:
    """(peak FLOP/s of a run's devices together, its label): every GPU's datasheet figure for ``dtype``'s precision.

    float32 is divided by plain FP32 unless TF32 is on (``matmul_precision``), never by the bf16 figure. CPU workers
    share one machine, whose rate only ``given`` (one device's peak, scripts/train_gpt.py's --peak-flops) supplies.
    Machinery behind scripts/train_gpt.py's MFU; no notebook calls it directly.
    """
    gpus = world if device.type == "cuda" else 1
    if given:
        return given * gpus, f"given (--peak-flops) x {gpus}"
    if device.type != "cuda":
        return None, "not given"
    precision = matmul_precision(dtype)
    found = datasheet_peak(torch.cuda.get_device_name(device), precision)
    return (found[0] * gpus, f"datasheet dense {precision} x {gpus}") if found else (None, f"no {precision} datasheet")


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: tokens/s x FLOPs per token (the model's count) over the peak FLOP/s.

    Machinery behind scripts/train_gpt.py's per-step MFU (22 computes the same ratio in a cell);
    no notebook calls it directly.
    """
    if tokens_per_s < 0 or flops_per_token <= 0 or peak_flops <= 0:
        raise ValueError(f"tokens/s {tokens_per_s}, FLOPs/token {flops_per_token}, peak {peak_flops}: "
                         "need tokens/s >= 0 and positive FLOPs")
    return tokens_per_s * flops_per_token / peak_flops


# The capstone's sizes. "cpu": the whole notebook at full size (the checks of section 2, 48 steps on 8 ranks as
# pp=2 x dp=2 x tp=2 in float64 over 2 cores, a resumed run on 4) ends within 5 minutes on 2 quiet cores.
# "gpu-16g" (T4, L4, A10, ~16-24 GiB) and "gpu-40g" (A100, H100, H200, ...): large enough that each step's matmuls
# (batch x seq_len rows of d_model-wide weights) keep the tensor cores busy rather than waiting for kernel launches,
# with room for AdamW's state and the activations of one checkpointed block. batch is the GLOBAL batch.
SIZES = {
    "smoke": dict(n_layer=2, n_head=4, d_model=64, seq_len=64, batch=8, steps=12, lr=3e-3),
    "cpu": dict(n_layer=4, n_head=4, d_model=64, seq_len=64, batch=16, steps=48, lr=3e-3),
    "gpu-16g": dict(n_layer=8, n_head=8, d_model=512, seq_len=512, batch=32, steps=400, lr=1e-3),
    "gpu-40g": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=64, steps=400, lr=6e-4),
}


def choose_size(device_type: str, memory_gib: float | None = None, smoke: bool = False) -> str:
    """The name of the size in SIZES for a device: "smoke" when asked, "cpu", or a GPU's by its memory.

    Machinery behind mfu.plan_capstone and scripts/train_gpt.py; no notebook calls it directly.
    """
    if smoke:
        return "smoke"
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        raise ValueError(f"no size for device type {device_type!r}")
    return "gpu-40g" if (memory_gib or 0) >= 39 else "gpu-16g"


@dataclass(frozen=True)
class CapstoneRun:
    """What notebook 21 trains on this machine: workers, mesh, size, dtype, and the peak its MFU divides by."""

    world: int                # torchrun's workers: one per usable GPU (a power of two, at most 8), or 8 on the CPU
    pp: int                   # pipeline stages
    tp: int                   # tensor-parallel degree; dp = world / (pp * tp)
    size: str                 # a key of SIZES
    device: str               # "cuda" or "cpu"
    dtype: str                # "bfloat16" on GPUs with BF16, else "float32"; "float64" on the CPU (exact checks)
    gpu: str | None           # the GPUs' NVML name
    peak: float | None        # one GPU's datasheet peak FLOP/s for that dtype; None: measure it (CPU) or unknown
    peak_source: str          # where the peak comes from, in words


def mesh_shape(world: int) -> tuple[int, int]:
    """(pp, tp) for a world of 1, 2, 4 or 8 workers: tp=2 from 2 workers, pp=2 from 4; dp is the rest.

    Machinery behind plan_capstone; no notebook calls it directly.
    """
    return (2 if world >= 4 else 1), (2 if world >= 2 else 1)


def plan_capstone(smoke: bool = False, max_gpus: int = 8) -> CapstoneRun:
    """Size notebook 21's run from the GPUs that ``devices.plan`` would use, not NVML's raw list.

    GPUs that a driver or kernel check rules out (``devices.gpu_count()`` is 0 then) size nothing: the run is the
    CPU's, 8 workers as pp=2 x dp=2 x tp=2 in float64 (4, dp=1, in smoke mode). Otherwise every usable GPU trains,
    up to ``max_gpus``, rounded down to a power of two so that the batch, the layers and the heads split evenly
    (``mesh_shape``); the peak is the datasheet's for the precision the script's matmuls will run in
    (``matmul_precision`` of its ``--dtype``: bf16 where the GPU has BF16, else float32).
    Introduced in notebooks/22-gpt-capstone-run.ipynb.
    """
    usable = min(devices.gpu_count(), max_gpus)
    if usable == 0:  # smoke: 4 workers (pp=2 x dp=1 x tp=2) start faster than 8
        return CapstoneRun(world=4 if smoke else 8, pp=2, tp=2, size=choose_size("cpu", smoke=smoke), device="cpu",
                           dtype="float64", gpu=None, peak=None,
                           peak_source="measured matmul rate (no datasheet for a CPU)")
    world = 1 << (usable.bit_length() - 1)  # 1, 2, 4 or 8
    gpus = devices.describe().gpus[:world]
    memory = min((g.memory_gib or 0) for g in gpus) if gpus else None
    dtype = torch.bfloat16 if devices.has_bf16(torch.device("cuda", 0)) else torch.float32
    precision = matmul_precision(dtype)
    name = gpus[0].name if gpus else "unknown"
    found = datasheet_peak(name, precision)
    pp, tp = mesh_shape(world)
    return CapstoneRun(world=world, pp=pp, tp=tp, size=choose_size("cuda", memory, smoke=smoke),
                       device="cuda", dtype=str(dtype).replace("torch.", ""), gpu=name,
                       peak=found[0] if found else None,
                       peak_source=f"datasheet, dense {precision}" if found else f"no datasheet {precision} figure")
