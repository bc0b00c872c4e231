"""helpers.fsdp: notebook 15's exported FSDP2 code (the meta-device build, shards, the step) and its machinery.

The FSDP lesson itself is written in notebooks/15-fsdp.ipynb, whose asserts check it.
Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import fsdp
from conftest import QUIET
from helpers.launch import launch


def test_global_batches_are_disjoint_and_seeded():
    with pytest.raises(ValueError, match="samples"):
        fsdp.global_batches(10, 3, 4)
    b = fsdp.global_batches(10, 2, 4, seed=1)
    assert b.shape == (2, 4) and len(set(b.flatten().tolist())) == 8
    assert torch.equal(b, fsdp.global_batches(10, 2, 4, seed=1))


def _held_rank(rank, world_size, *, reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    if reshard is not None:  # None: a plain model, no FSDP
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    held = fsdp.params_after_forward(model, x, y)
    grads_zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    return held, grads_zeroed


def test_params_after_forward_sees_what_resharding_frees():
    whole = (8 * 16 + 16 + 16 * 4 + 4) * 4
    plain = launch(functools.partial(_held_rank, reshard=None), 1, **QUIET)[0]
    kept = launch(functools.partial(_held_rank, reshard=False), 2, **QUIET)[0]
    freed = launch(functools.partial(_held_rank, reshard=True), 2, **QUIET)[0]
    assert plain == (whole, True) and kept == (whole, True)
    assert freed[0] < whole and freed[1]


def _sharded_rank(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = fsdp.sharded_model(8, 2, mesh, torch.device("cpu"), param_dtype=torch.bfloat16)
    shards = {n: (p.placements[0].dim, p.to_local().shape[0], p.shape[0], p.dtype) for n, p in model.named_parameters()}
    images, labels = torch.randn(4, 784), torch.randint(0, 10, (4,))
    loss = fsdp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), images, labels)
    return shards, float(loss)


def test_sharded_model_is_built_on_meta_and_holds_slices_of_dim_0():
    shards, loss = launch(_sharded_rank, 2, **QUIET)[0]
    assert loss > 0
    for name, (dim, local, full, dtype) in shards.items():
        assert dim == 0 and local == -(-full // 2) and dtype == torch.float32, name  # bf16 only for compute


def test_rank_slice_cuts_a_global_batch_into_equal_parts():
    images, labels = torch.arange(12.0).view(6, 2), torch.arange(6)
    dataset = torch.utils.data.TensorDataset(images, labels)
    batches = torch.tensor([[5, 4, 3, 2]])
    x, y = fsdp.rank_slice(dataset, batches, 0, 1, 2, torch.device("cpu"))
    assert y.tolist() == [3, 2] and torch.equal(x, images[[3, 2]])
