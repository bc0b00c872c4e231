"""What notebook 04's ranks run: set_epoch orders, the CPU SyncBatchNorm stand-in, accumulation with no_sync.

Training runs in launched ranks only: a backward pass in pytest's process would break later GPU forks (FACTS.md).
"""

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import accumulate, ddp, epochs, models, syncbn
from helpers import launch as L
from helpers.launch import launch

QUIET = dict(quiet=True, progress=False)


def toy_set(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def learnable_set(n=512):
    """Class c is a bright c-th row band: a ConvNet learns it in a few steps."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for i, c in enumerate(y.tolist()):
        x[i, 0, 2 * c + 4] += 3.0
    return TensorDataset(x, y)


def test_epoch_orders_repeat_without_set_epoch_and_partition_each_epoch():
    same = epochs.epoch_orders(20, 4, 3, set_epoch=False)
    fresh = epochs.epoch_orders(20, 4, 3)
    assert same[0] == same[1] == same[2]
    assert fresh[0] != fresh[1] != fresh[2]
    for orders in (same, fresh):
        for ranks in orders:
            assert sorted(i for shard in ranks for i in shard) == list(range(20))
    with pytest.raises(ValueError, match="epochs"):
        epochs.epoch_orders(20, 2, 0)


def test_random_flip_flips_some_images_and_keeps_labels():
    x, y = torch.arange(2 * 28.0).view(1, 1, 2, 28).repeat(64, 1, 1, 1), torch.arange(64)
    torch.manual_seed(0)
    (fx, fy), = list(epochs.RandomFlip([(x, y)]))
    flipped = (fx != x).flatten(1).any(1)
    assert 0 < flipped.sum() < 64 and torch.equal(fy, y)
    assert torch.equal(fx[flipped], x[flipped].flip(3))


def test_cpu_sync_batchnorm_matches_the_global_batch_and_closes_the_gap():
    data = toy_set()
    synced = launch(syncbn.bn_steps, 2, data, 2, 16, 0.05, **QUIET)
    plain = launch(functools.partial(syncbn.bn_steps, sync=False), 2, data, 2, 16, 0.05, **QUIET)
    one = launch(functools.partial(ddp.reference_rank, batch_norm=True), 1, data, 1, 32, 0.05, **QUIET)[0]
    ref = launch(functools.partial(ddp.reference_rank, batch_norm=True), 1, data, 2, 32, 0.05, **QUIET)[0]
    for out in synced:
        for s in ("mean", "var"):
            assert torch.allclose(out["first_stats"][s], one["params"][f"layer1.1.running_{s}"], atol=1e-6)
    assert "stand-in" in synced[0]["kind"]
    sync_gap = models.max_param_diff(synced[0]["params"], ref["params"])
    assert sync_gap < 1e-4 and models.max_param_diff(plain[0]["params"], ref["params"]) > 100 * sync_gap


def test_convert_sync_batchnorm_swaps_every_batchnorm_on_the_cpu_and_keeps_its_state():
    model = models.ConvNet()
    model.layer1[1].running_mean.fill_(0.5)
    syncbn.convert_sync_batchnorm(model, "cpu")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 2 and all(isinstance(m, syncbn.CPUSyncBatchNorm) for m in norms)
    assert torch.all(model.layer1[1].running_mean == 0.5)
    gpu = syncbn.convert_sync_batchnorm(models.ConvNet(), "cuda")  # conversion alone needs no GPU
    assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in gpu.modules()) == 2
    assert "torch.nn.SyncBatchNorm" in syncbn.which_sync("cuda:0")


def test_accumulation_counts_all_reduces_and_equals_the_big_batch():
    data = toy_set()
    quiet_way = launch(accumulate.accumulate_steps, 2, data, 2, 3, 8, 0.1, **QUIET)
    loud_way = launch(functools.partial(accumulate.accumulate_steps, no_sync=False), 2, data, 2, 3, 8, 0.1, **QUIET)
    big = launch(ddp.reference_rank, 1, data, 2, 2 * 3 * 8, 0.1, **QUIET)[0]
    assert quiet_way[0]["allreduces_per_step"] == [1, 1] and loud_way[0]["allreduces_per_step"] == [3, 3]
    for out in (quiet_way, loud_way):
        assert models.max_param_diff(out[0]["params"], big["params"]) < 1e-5
