"""helpers.memory: the DDP / ZeRO formulas against sizes worked out by hand, and bytes measured from tensors.

No backward pass runs in this process (it would poison later GPU forks): gradients are set by hand.
"""

import pytest
import torch
from torch import nn

from helpers import memory


def test_per_rank_bytes_by_hand():
    # 10 float32 parameters, momentum SGD (1 slot), 4 ranks: 40 bytes each whole, 10 bytes a shard
    t = memory.per_rank_bytes(10, 4, optimizer="momentum")
    assert t["DDP"] == {"params": 40, "grads": 40, "optimizer": 40, "total": 120}
    assert t["ZeRO-1"] == {"params": 40, "grads": 40, "optimizer": 10, "total": 90}
    assert t["ZeRO-2"] == {"params": 40, "grads": 10, "optimizer": 10, "total": 60}
    assert t["ZeRO-3 / FSDP"] == {"params": 10, "grads": 10, "optimizer": 10, "total": 30}


def test_per_rank_bytes_rounds_shards_up_and_counts_adam_twice():
    t = memory.per_rank_bytes(10, 3, optimizer="adam")  # 40 bytes over 3 ranks: 14, 14, 12 -> the largest is 14
    assert t["ZeRO-3 / FSDP"]["params"] == 14
    assert t["DDP"]["optimizer"] == 80 and t["ZeRO-1"]["optimizer"] == 27
    assert memory.per_rank_bytes(10, 1, optimizer="sgd")["ZeRO-3 / FSDP"] == {
        "params": 40, "grads": 40, "optimizer": 0, "total": 80}


def test_per_rank_bytes_refuses_bad_input():
    with pytest.raises(ValueError):
        memory.per_rank_bytes(10, 0)
    with pytest.raises(ValueError, match="optimizer"):
        memory.per_rank_bytes(10, 2, optimizer="lion")


def test_comm_bytes_by_hand():
    # 100 parameters, 4 bytes, W=4: all-reduce 2*3/4*400 = 600; all-gather or reduce-scatter 3/4*400 = 300
    c = memory.comm_bytes_per_step(100, 4)
    assert c["DDP"] == 600 and c["FSDP"] == 900 and c["FSDP/DDP"] == 1.5
    assert memory.comm_bytes_per_step(100, 4, reshard_after_forward=False)["FSDP"] == 600
    assert memory.comm_bytes_per_step(100, 4, param_bytes=2, reshard_after_forward=False)["FSDP"] == 450
    assert memory.comm_bytes_per_step(100, 1)["DDP"] == 0


def test_transformer_params_by_hand():
    assert memory.transformer_params(2, 3, vocab=5) == 12 * 4 * 3 + 10
    assert memory.transformer_params(768, 12, vocab=50257) == 123_532_032  # GPT-2 small without biases and norms


def test_state_bytes_measured_from_tensors():
    model = nn.Linear(3, 2)  # 8 float32 parameters = 32 bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert memory.state_bytes(model, opt) == {"params": 32, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert memory.state_bytes(model, opt) == {"params": 32, "grads": 32, "optimizer": 32}
    adam = torch.optim.Adam(model.parameters())
    adam.step()  # two moments of 32 bytes plus one float32 step counter per parameter tensor (2 tensors)
    assert memory.state_bytes(model, adam)["optimizer"] == 2 * 32 + 2 * 4
    assert memory.local_bytes(torch.zeros(5, dtype=torch.bfloat16)) == 10
