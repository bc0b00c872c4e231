"""The course's GPT (helpers/gpt.py, written in notebooks/09-memory.ipynb): shapes, causality, parameter and FLOP
counts against FlopCounterMode, checkpointing, meta-device initialisation and seeded sampling."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers.gpt import GPT, GPTConfig, generate, gpt_loss, matmul_params, train_flops_per_token

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=32)
DEFAULT = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return GPT(cfg)


def tokens(batch, length, seed=1):
    return torch.randint(0, CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_the_loss_of_an_untrained_model():
    m, x = model(), tokens(3, 20)
    assert m(x).shape == (3, 20, CFG.vocab_size)
    assert CFG.head_dim == 8
    # N(0, 0.02) weights: nearly uniform predictions, a loss near ln 256
    assert abs(gpt_loss(m, x, x).item() - math.log(256)) < 0.05


@pytest.mark.parametrize("backend", [SDPBackend.MATH, DEFAULT], ids=["math", "default"])
def test_a_future_token_never_changes_an_earlier_logit(backend):
    m, x = model(), tokens(2, 24)
    for t in (5, 17, 23):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % CFG.vocab_size
        with torch.no_grad(), sdpa_kernel(backend):
            a, b = m(x), m(y)
        assert torch.equal(a[:, :t], b[:, :t]), f"position {t} leaked backwards"
        assert not torch.equal(a[:, t], b[:, t]), "the changed position itself must change"


def test_parameter_count_formula():
    for cfg in (CFG, GPTConfig(), GPTConfig(vocab_size=100, seq_len=16, n_layer=3, n_head=2, d_model=24)):
        V, T, L, h = cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.d_model
        m = model(cfg)
        assert sum(p.numel() for p in m.parameters()) == 2 * V * h + T * h + L * (12 * h**2 + 9 * h) + 2 * h
        assert matmul_params(m) == L * 12 * h**2 + V * h


def _counted(m, x, backend):
    with sdpa_kernel(backend), FlopCounterMode(display=False) as counter:
        gpt_loss(m, x, x).backward()
    return counter.get_total_flops(), {str(op) for op in counter.get_flop_counts()["Global"]}


def test_flops_per_token_equal_flop_counter_mode_on_the_math_path():
    m, x = model(), tokens(2, CFG.seq_len)
    total, ops = _counted(m, x, SDPBackend.MATH)
    assert "aten.bmm" in ops
    assert total == x.numel() * train_flops_per_token(CFG, CFG.seq_len, matmul_params(m), fused_attention=False)


def test_flops_per_token_equal_flop_counter_mode_for_the_kernel_sdpa_picks():
    """A fused kernel's backward is counted with a recompute of QKᵀ: 14·L·T·d a token, not 12. torch 2.11 has no
    formula for the CPU's flash kernel and counts it as 0: then 6N alone."""
    m, x = model(), tokens(2, CFG.seq_len)
    total, ops = _counted(m, x, DEFAULT)
    n = matmul_params(m)
    if any("scaled_dot_product" in op for op in ops):
        want = train_flops_per_token(CFG, CFG.seq_len, n, fused_attention=True)
        assert want - train_flops_per_token(CFG, CFG.seq_len, n, fused_attention=False) == \
            2 * CFG.n_layer * CFG.seq_len * CFG.d_model
    else:
        assert "aten.bmm" not in ops
        want = 6 * n
    assert total == x.numel() * want


def test_checkpointing_gives_the_same_logits_and_keeps_only_block_inputs():
    m, x = model(), tokens(2, 16)
    plain = m(x)
    m.checkpointing = True
    assert torch.equal(m(x), plain)  # the forward itself is the same computation


def test_meta_build_then_init_weights_equals_a_normal_build():
    normal = model()
    with torch.device("meta"):
        fresh = GPT(CFG)
    fresh.to_empty(device="cpu")
    for m in (normal, fresh):
        torch.manual_seed(3)
        m.init_weights()
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), normal.parameters()))
    deep = [w.std().item() for b in normal.blocks for w in (b.attn.o.weight, b.mlp.down.weight)]
    assert max(deep) < 0.02 / math.sqrt(2 * CFG.n_layer) * 1.3  # the projections into the residual stream: smaller
    assert all(torch.equal(b.norm1.weight, torch.ones(CFG.d_model)) for b in normal.blocks)


def test_generate_is_deterministic_for_a_seeded_generator():
    m, prompt = model(), tokens(1, 5)[0]
    runs = [generate(m, prompt, 40, generator=torch.Generator().manual_seed(seed)) for seed in (7, 7, 8)]
    assert runs[0].shape == (40,) and runs[0].dtype == torch.long
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    # a prompt longer than seq_len: the context is cut, generation goes on
    assert generate(m, tokens(1, CFG.seq_len + 10)[0], 3, generator=torch.Generator().manual_seed(0)).shape == (3,)
