"""What notebook 07 exports: which precisions a device offers, and how the mixed-precision check is sized.

The autocast/GradScaler step, the LR warm-up and the race are defined and asserted in
notebooks/07-large-batch.ipynb itself (CI runs it); what stays here are its two exported rules, checked without a
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
        assert amp.precisions("cpu") == expected, "fp16 autocast on a CPU is emulated: never offered there"


def test_a_gpu_offers_bf16_from_compute_capability_8_and_always_fp16(monkeypatch):
    _no_emulation_question(monkeypatch)
    for capability, expected in (((7, 5), ["fp32", "fp16"]),          # T4: fp16 + GradScaler
                                 ((7, 0), ["fp32", "fp16"]),          # V100
                                 ((8, 0), ["fp32", "bf16", "fp16"]),  # A100
                                 ((9, 0), ["fp32", "bf16", "fp16"]),  # H100
                                 (None, ["fp32", "fp16"])):           # unreadable: no bf16
        monkeypatch.setattr(devices, "gpu_capability", lambda index, c=capability: c)
        assert amp.precisions("cuda:0") == expected, capability


def test_the_sizing_gives_fewer_steps_when_the_bf16_step_is_slow():
    budget, most = 45, 300
    fast_bf16 = {"fp32": 0.05, "bf16": 0.033}  # a CPU with AVX512-BF16: bf16 ~1.5x fp32
    slow_bf16 = {"fp32": 0.1, "bf16": 0.55}    # emulated bf16: ~5.5x slower than fp32
    fast = amp.affordable_steps(fast_bf16, budget, most=most, least=50)
    slow = amp.affordable_steps(slow_bf16, budget, most=most, least=50)
    assert fast == most, "where every step is quick the check trains its full length"
    assert slow == int(budget / 0.65) < fast, "a slow bf16 step buys fewer steps for every precision"
    assert slow * sum(slow_bf16.values()) <= budget, "and the sized check fits its budget"


def test_the_sizing_keeps_to_its_least_and_most():
    assert amp.affordable_steps({"fp32": 10.0, "bf16": 60.0}, 45, most=300, least=50) == 50
    assert amp.affordable_steps({"fp32": 1e-4}, 45, most=300) == 300
    assert amp.affordable_steps({"fp32": 1.0, "bf16": 5.0}, 5, most=300) == 1, "least defaults to one step"
