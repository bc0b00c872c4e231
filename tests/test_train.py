import math

import pytest
import torch

from helpers import bench, data, models, train


def toy_data(n=256, seed=0):
    """Separable 28x28 images: the class decides which row is bright."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    x[torch.arange(n), 0, y * 2 + 4, :] += 2.0
    return x, y


def test_convnet_output_shape_and_size():
    model = models.ConvNet()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert models.count_parameters(model) == 29034
    plain = models.ConvNet(batch_norm=False)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())


def test_training_makes_the_loss_fall():
    torch.manual_seed(0)
    x, y = toy_data()
    loader = data.DeviceLoader((x, y), batch_size=32, seed=0)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = train.evaluate(model, loader, "cpu")
    history = train.fit(model, loader, loader, opt, "cpu", epochs=3, progress=False)
    after = train.evaluate(model, loader, "cpu")
    assert after.loss < before.loss * 0.5
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert after.accuracy > 0.9
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert all(r["samples_per_s"] > 0 and r["elapsed"] >= r["seconds"] for r in history)


def test_train_one_epoch_counts_and_stops_early():
    x, y = toy_data(100)
    loader = data.DeviceLoader((x, y), batch_size=30, shuffle=False)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    stats = train.train_one_epoch(model, loader, opt, "cpu", on_step=lambda s, loss: steps.append(loss.item()))
    assert stats.samples == 100 and len(steps) == 4
    assert math.isclose(stats.loss, sum(l * n for l, n in zip(steps, [30, 30, 30, 10])) / 100, rel_tol=1e-5)
    assert train.train_one_epoch(model, loader, opt, "cpu", max_steps=2).samples == 60


def test_bf16_autocast_runs_on_cpu():
    x, y = toy_data(64)
    loader = data.DeviceLoader((x, y), batch_size=32)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = train.train_one_epoch(model, loader, opt, "cpu", amp="bf16")
    assert math.isfinite(stats.loss)
    with pytest.raises(ValueError, match="amp"):
        train.autocast("cpu", "fp8")
    assert train.make_scaler("cpu", "fp16") is None


def test_time_it_reports_medians():
    calls = []
    result = bench.time_it(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(result["all"]) == 3
    assert result["min"] <= result["median"]
    assert bench.ratio(3.0, 2.0) == 1.5
    with pytest.raises(ValueError):
        bench.ratio(1.0, 0.0)
