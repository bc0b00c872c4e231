"""The course's GPT: a small decoder-only transformer, written in notebooks/09-memory.ipynb and exported here.

From notebook 09 on, the course's model is this GPT (pipelines 10-11, FSDP2 16-18, tensor parallelism 19, compile
20, the capstone 21-22, context and expert parallelism 23-25). Its layout is torchtitan's Llama with shorter names: separate ``q``, ``k``, ``v`` and ``o``
projections (torchtitan's ``wq`` ... ``wo``; tensor parallelism shards heads by splitting q/k/v by columns and o by
rows), a pre-norm ``Block`` of attention and an MLP of ``up`` and ``down`` (``w1``, ``w2``; torchtitan's SwiGLU adds
``w3``), a final norm and an untied ``head`` (``output``). nanoGPT instead fuses q, k, v into one ``c_attn`` and ties
its head to the token embedding. Attention runs
through ``F.scaled_dot_product_attention(is_causal=True)``; reshapes use ``-1`` heads so that a rank holding some of
the heads runs the same forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


# ---- exported from notebooks/09-memory.ipynb: edit it there, then run `make export` ----
@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128  # the longest context (position embeddings)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class Attention(nn.Module):
    """Causal self-attention, heads through F.scaled_dot_product_attention. Introduced in notebooks/09-memory.ipynb."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "n_head must divide d_model"
        self.head_dim = cfg.head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, heads, head_dim) → (B, heads, T, head_dim); -1: as many heads as this rank holds
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """d → 4·d, GELU, → d. Introduced in notebooks/09-memory.ipynb."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(x)). Introduced in notebooks/09-memory.ipynb."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, n_layer blocks, a final norm and an untied head.

    Introduced in notebooks/09-memory.ipynb.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpointing = False  # True: each block keeps only its input and reruns its forward in backward
        self.init_weights()

    def init_weights(self):  # GPT-2's: N(0, 0.02); the projections into the residual stream 1/√(2·n_layer) less
        for name, p in self.named_parameters():
            if "norm" in name:  # LayerNorm: scale 1, shift 0
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                into_residual = name.endswith((".o.weight", ".down.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer) if into_residual else 0.02)

    def forward(self, idx, positions=None):  # token ids (B, T) → logits (B, T, vocab)
        # positions: each token's place in the whole sequence (a rank holding part of it passes its own, 21)
        positions = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        # A pipeline stage (10, 11) drops what it does not hold: without `tok` it takes activations, without `head`
        x = self.tok(idx) + self.pos(positions) if self.tok is not None else idx  # it returns them
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def gpt_loss(model, x, y):
    """Mean cross-entropy of the next byte over every position. Introduced in notebooks/09-memory.ipynb."""
    logits = model(x).flatten(0, 1)
    return F.cross_entropy(logits.float() if logits.dtype.itemsize < 4 else logits, y.flatten())  # 16 bits: in 32


def matmul_params(model: GPT) -> int:
    """Parameters that multiply: every Linear's weight. Introduced in notebooks/09-memory.ipynb."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def train_flops_per_token(cfg: GPTConfig, T: int, n_matmul: int, *, fused_attention: bool = True) -> int:
    """Forward + backward FLOPs a token at context T, as FlopCounterMode counts them.

    Introduced in notebooks/09-memory.ipynb.
    """
    # 6 a multiplying parameter: 2 forward, 4 backward. Attention: products of 2·T·d FLOPs a token and layer,
    # counted whole (the half the causal mask skips too): QKᵀ and PV forward; dP, dV, dQ, dK backward. A fused
    # kernel (flash, memory-efficient, cuDNN, the CPU's flash) keeps no T×T P, so its backward recomputes QKᵀ
    # first: 7 products, as FlopCounterMode's sdpa_backward_flop_count counts ("Step 1: We recompute the scores",
    # https://github.com/pytorch/pytorch/blob/v2.11.0/torch/utils/flop_counter.py#L492-L518). The math path
    # (fused_attention=False, SDPBackend.MATH) saves P and recomputes nothing: 6 products.
    products = 7 if fused_attention else 6
    return 6 * n_matmul + 2 * products * cfg.n_layer * T * cfg.d_model
# ---- end of export from notebooks/09-memory.ipynb ----


@torch.no_grad()
def generate(model, prompt, new_tokens: int, temperature: float = 0.8, generator=None):
    """Sample ``new_tokens`` bytes after ``prompt`` (1-D ids). Introduced in notebooks/09-memory.ipynb."""
    idx = prompt[None].to(next(model.parameters()).device)
    for _ in range(new_tokens):
        logits = model(idx[:, -model.cfg.seq_len:])[:, -1].float() / temperature
        nxt = torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0, len(prompt):]
