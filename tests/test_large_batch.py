"""What notebook 05's ranks run: LR scaling and warm-up, time to accuracy, mixed precision.

Training runs in launched ranks only: a backward pass in pytest's process would break later GPU forks (FACTS.md).
"""

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import amp, ddp, models, scaling, to_accuracy
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


def test_warmup_ramps_linearly_then_holds_and_lr_scales_with_world_size():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    sched = scaling.warmup(opt, 4)
    rates = []
    for _ in range(6):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert scaling.scaled_lr(0.05, 4, True) == pytest.approx(0.2) and scaling.scaled_lr(0.05, 4, False) == 0.05
    with pytest.raises(ValueError):
        scaling.warmup(opt, -1)


def test_lr_run_trains_past_an_epoch_with_the_scaled_rate():
    out = launch(functools.partial(scaling.lr_run, warmup_steps=3), 2, toy_set(128), 6, 16, 0.05, **QUIET)
    assert len(out[0]["losses"]) == 6 and out[0]["lr"] == pytest.approx(0.1) and out[0]["global_batch"] == 32
    assert out[0]["precision"] == "fp32" and out[0]["samples_per_s"] > 0


def test_lr_run_in_bf16_and_refuses_a_precision_the_device_lacks():
    bf16 = launch(functools.partial(scaling.lr_run, precision="bf16", seed=1), 2, toy_set(128), 4, 16, 0.05, **QUIET)
    fp32 = launch(functools.partial(scaling.lr_run, seed=1), 2, toy_set(128), 4, 16, 0.05, **QUIET)
    assert bf16[0]["precision"] == "bf16" and len(bf16[0]["losses"]) == 4
    assert bf16[0]["losses"] != fp32[0]["losses"], "bf16 autocast really ran (other rounding)"
    assert bf16[0]["losses"][0] == pytest.approx(fp32[0]["losses"][0], rel=0.05), "the same model and batch"
    with pytest.raises(L.RankFailed, match=r"precision='fp16' is not offered on cpu.*\['fp32', 'bf16'\]"):
        launch(functools.partial(scaling.lr_run, precision="fp16"), 1, toy_set(64), 2, 16, 0.05, **QUIET)


def test_race_stops_at_the_target_and_reports_when():
    train, test = learnable_set(), learnable_set(200)
    out = launch(functools.partial(to_accuracy.race, eval_every=64, max_epochs=5), 2, train, test, 0.5, 16, 0.05,
                 **QUIET)
    r = out[0]
    assert r["reached"] is not None and r["reached"][3] >= 0.5 and r["curve"][-1] == r["reached"]
    assert all(c[3] < 0.5 for c in r["curve"][:-1]), "it stops at the first evaluation at the target"
    assert [c[3] for c in out[1]["curve"]] == [c[3] for c in r["curve"]], "ranks agree on the accuracy"
    never = launch(functools.partial(to_accuracy.race, eval_every=256, max_epochs=1), 1, toy_set(64), toy_set(32),
                   1.0, 16, 0.05, **QUIET)[0]
    assert never["reached"] is None and len(never["curve"]) >= 1
    with pytest.raises(ValueError, match="target"):
        to_accuracy.race(0, 1, train, test, 1.5, 16, 0.05)


def test_amp_models_and_modes_per_device(monkeypatch):
    assert isinstance(amp.bench_model("cpu")[0], models.ConvNet)
    model, why = amp.bench_model("cuda")
    assert isinstance(model, amp.WideMLP) and "launch-bound" in why
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert amp.modes_for("cpu") == ["fp32", "bf16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert amp.modes_for("cuda") == ["fp32", "bf16", "fp16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert amp.modes_for("cuda") == ["fp32", "fp16"]


def test_amp_compare_trains_each_precision_on_the_cpu():
    out = launch(functools.partial(amp.amp_compare, bench_steps=2, rounds=1), 1, learnable_set(256),
                 learnable_set(100), 8, 32, 0.05, **QUIET)[0]
    assert out["modes"] == ["fp32", "bf16"] and out["memory"] == {}
    assert all(0 <= out["accuracy"][m] <= 1 for m in out["modes"])
    for m in out["modes"]:
        s = out["samples_per_s"][m]
        assert 0 < s["low"] <= s["median"] <= s["high"]
