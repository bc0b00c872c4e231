"""What notebook 08 exports: which precisions a device offers; and fp16's underflow, which its text and figure state.

The autocast/GradScaler step, the LR warm-up and the race are defined and asserted in
notebooks/08-large-batch.ipynb itself (CI runs it); what stays here is its exported rule, checked without a
GPU: capabilities are mocked, CPU flags read from a file that $MULTIGPU_CPUINFO points to.
"""

import torch

from helpers import amp, devices

NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n"


def _no_emulation_question(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("is_bf16_supported counts emulation and starts CUDA: never ask it in the notebook")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", refuse)


def test_a_cpu_offers_bf16_only_with_bf16_instructions(tmp_path, monkeypatch):
    _no_emulation_question(monkeypatch)
    for text, expected in ((NO_BF16, ["fp32"]), (WITH_BF16, ["fp32", "bf16"])):
        (tmp_path / "cpuinfo").write_text(text)
        monkeypatch.setenv("MULTIGPU_CPUINFO", str(tmp_path / "cpuinfo"))
        assert amp.precisions("cpu") == expected, "fp16 on GPUs only: x86 CPUs emulate it, bar those with AVX512-FP16, which have bf16 too"


def test_a_gpu_offers_bf16_from_compute_capability_8_and_always_fp16(monkeypatch):
    _no_emulation_question(monkeypatch)
    for capability, expected in (((7, 5), ["fp32", "fp16"]),          # T4: fp16 + GradScaler
                                 ((7, 0), ["fp32", "fp16"]),          # V100
                                 ((8, 0), ["fp32", "bf16", "fp16"]),  # A100
                                 ((9, 0), ["fp32", "bf16", "fp16"]),  # H100
                                 (None, ["fp32", "fp16"])):           # unreadable: no bf16
        monkeypatch.setattr(devices, "gpu_capability", lambda index, c=capability: c)
        assert amp.precisions("cuda:0") == expected, capability


def test_fp16_underflows_below_half_its_smallest_subnormal_and_a_scaled_gradient_survives():
    """08's claim, and its figure's: fp16's smallest number is 2**-24; above 2**-25 rounds up to it, 2**-25 and below to 0."""
    tiny = 2.0**-24
    assert torch.tensor(tiny).half().item() == tiny == torch.finfo(torch.float16).smallest_normal * 2.0**-10
    assert torch.tensor(2**-25 * 1.01).half().item() == tiny
    assert torch.tensor(2**-25).half().item() == 0 and torch.tensor(6e-8 / 2.5).half().item() == 0
    assert torch.tensor(1e-8 * 2**16).half().item() > 0
