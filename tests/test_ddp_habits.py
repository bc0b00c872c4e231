"""The machinery notebook 06 keeps in helpers: the CPU SyncBatchNorm stand-in (torch's refuses CPU tensors).

The rank functions 06 teaches (set_epoch, the rank-0 save and resume, no_sync accumulation, convert_sync_batchnorm)
are defined in its cells and checked by its asserts, which CI runs. Training runs in launched ranks only: a
backward pass in pytest's process would break later GPU forks.
"""

import torch
from torch import nn

from helpers import models, syncbn
from helpers.launch import launch

QUIET = dict(quiet=True, progress=False)


def batch_and_weights(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 5, 5, generator=g) * 2 + 1, torch.randn(n, 3, 5, 5, generator=g)


def bn_rank(rank, world_size, x, w):
    """This rank's share of x through BatchNorm (the stand-in when W > 1); a loss that weighs every output."""
    torch.manual_seed(0)
    bn = syncbn.CPUSyncBatchNorm(3) if world_size > 1 else nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    shard = x.chunk(world_size)[rank].clone().requires_grad_()
    y = bn(shard)
    (y * w.chunk(world_size)[rank]).sum().backward()
    return {"y": y.detach(), "x_grad": shard.grad, "w_grad": bn.weight.grad, "mean": bn.running_mean,
            "var": bn.running_var, "kind": type(bn).__name__}


def test_cpu_sync_batchnorm_is_batchnorm_on_the_global_batch_forward_and_backward():
    x, w = batch_and_weights()
    synced = launch(bn_rank, 2, x, w, **QUIET)
    one = launch(bn_rank, 1, x, w, **QUIET)[0]
    assert synced[0]["kind"] == "CPUSyncBatchNorm" and one["kind"] == "BatchNorm2d"
    close = dict(atol=1e-5, rtol=1e-5)
    assert torch.allclose(torch.cat([r["y"] for r in synced]), one["y"], **close)
    # the backward flows through the other rank's statistics: the input gradients are the global batch's
    assert torch.allclose(torch.cat([r["x_grad"] for r in synced]), one["x_grad"], **close)
    assert torch.allclose(synced[0]["w_grad"] + synced[1]["w_grad"], one["w_grad"], **close)
    for r in synced:  # running statistics (unbiased variance) as one process on the whole batch
        assert torch.allclose(r["mean"], one["mean"], **close) and torch.allclose(r["var"], one["var"], **close)


def test_cpu_sync_batchnorm_is_plain_batchnorm_outside_a_process_group_and_in_eval():
    x, _ = batch_and_weights()
    plain, stand_in = nn.BatchNorm2d(3), syncbn.CPUSyncBatchNorm(3)
    with torch.no_grad():
        assert torch.equal(stand_in(x), plain(x))
        stand_in.eval(), plain.eval()
        assert torch.equal(stand_in(x), plain(x))


def test_convert_sync_batchnorm_swaps_every_batchnorm_and_keeps_its_state():
    model = models.ConvNet()
    model.layer1[1].running_mean.fill_(0.5)
    model.eval()
    converted = syncbn.CPUSyncBatchNorm.convert_sync_batchnorm(model)
    norms = [m for m in converted.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 2 and all(isinstance(m, syncbn.CPUSyncBatchNorm) for m in norms)
    assert torch.all(converted.layer1[1].running_mean == 0.5) and not converted.layer1[1].training
    bn = nn.BatchNorm2d(4)
    assert isinstance(syncbn.CPUSyncBatchNorm.convert_sync_batchnorm(bn), syncbn.CPUSyncBatchNorm)
    # a float64 model stays float64: float32 BatchNorm weights fail notebook 06's float64 check (test_equivalence_06)
    wide = syncbn.CPUSyncBatchNorm.convert_sync_batchnorm(models.ConvNet().double())
    assert {t.dtype for t in [*wide.parameters(), *wide.buffers()] if t.is_floating_point()} == {torch.float64}
    # torch's own conversion, which the notebook calls on GPU ranks, needs no GPU to convert
    gpu = nn.SyncBatchNorm.convert_sync_batchnorm(models.ConvNet())
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in gpu.modules()) == 2
