import math
import warnings

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
    # one definition (exported from 08): a scaler for fp16 on any device, none for bf16 and fp32
    assert isinstance(train.make_scaler("cpu", "fp16"), torch.amp.GradScaler)
    assert train.make_scaler("cpu", "bf16") is None and train.make_scaler("cuda:0", None) is None


def test_time_it_reports_medians():
    calls = []
    result = bench.time_it(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(result["all"]) == 3
    assert result["min"] <= result["median"]
    assert bench.ratio(3.0, 2.0) == 1.5
    with pytest.raises(ValueError):
        bench.ratio(1.0, 0.0)


def test_stop_ends_training_between_steps_with_what_was_done():
    import threading

    from helpers import Stopped

    x, y = toy_data()
    loader = data.DeviceLoader((x, y), batch_size=32, seed=0)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stop = threading.Event()
    with pytest.raises(Stopped) as info:
        train.train_one_epoch(model, loader, opt, "cpu", stop=stop,
                              on_step=lambda step, loss: step == 2 and stop.set())
    assert info.value.partial.samples == 3 * 32, "three steps ran before the stop was seen"
    stop.clear()
    test_loader = data.DeviceLoader((x, y), batch_size=64, shuffle=False)
    rows = []

    def after_epoch(row):
        rows.append(row)
        stop.set()  # clicked during epoch 2
    with pytest.raises(Stopped, match="epoch 2 of 3") as info:
        train.fit(model, loader, test_loader, opt, "cpu", 3, progress=False, on_epoch=after_epoch, stop=stop)
    assert info.value.partial == rows and len(rows) == 1


def test_fit_steps_the_scheduler_after_every_optimizer_step():
    x, y = toy_data(n=128)
    loader = data.DeviceLoader((x, y), batch_size=32, seed=0)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=2 * len(loader))
    train.fit(model, loader, loader, opt, "cpu", 2, scheduler=sched, progress=False)
    assert sched.last_epoch == 2 * len(loader)


def test_full_fp32_turns_tf32_off_and_restores_it():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True  # a GPU's likely defaults
    try:
        with train.full_fp32():
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        torch.get_float32_matmul_precision()  # still readable: full_fp32 left torch's precision API consistent
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_sync_waits_for_every_gpu_of_a_list(monkeypatch):
    """nn.DataParallel's step runs on several GPUs: a clock read after syncing the first one alone stops early."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(str(d)))
    train.sync([torch.device("cuda", 0), torch.device("cuda", 1), "cpu"])
    assert synced == ["cuda:0", "cuda:1"]
    synced.clear()
    bench.compare({"step": lambda: None}, device=["cuda:0", "cuda:1"], warmup=0, rounds=1)
    assert synced == ["cuda:0", "cuda:1"] * 2, "before and after the timed call, every device"
    train.sync("cpu")
    assert len(synced) == 4


def test_compare_alternates_the_order_and_reports_median_and_spread():
    calls = []
    out = bench.compare({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"], "warm-up each, then a b / b a / a b"
    assert set(out) == {"a", "b"} and len(out["a"]["all"]) == 3
    assert out["a"]["min"] <= out["a"]["median"] <= out["a"]["max"]


def test_a_step_skipped_by_the_grad_scaler_does_not_advance_the_schedule():
    """fp16's GradScaler skips a step whose gradients overflowed; the LR schedule must stay where it was."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # the CPU scaler behaves as the CUDA one
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)]
    calls = []

    def loss_fn(out, y):  # the second step's gradients overflow, as fp16's can
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(out, y)
        return loss * float("inf") if len(calls) == 2 else loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        train.train_one_epoch(model, data, opt, "cpu", scaler=scaler, scheduler=sched, loss_fn=loss_fn)
    assert sched.last_epoch == 3, "4 steps, one skipped: the schedule advanced 3 times"
    assert scaler.get_scale() == 2.0**7, "the scaler halved its scale at the overflow"


def test_the_loop_and_the_model_are_the_ones_written_in_notebook_01():
    """Tally, train_one_epoch, evaluate and ConvNet are exported from 01's cells (scripts/export.py): the same text."""
    import inspect
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / "01-single-gpu.ipynb").read_text())
    cells = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for obj in (train.Tally, train.train_one_epoch, train.evaluate, models.ConvNet):
        assert inspect.getsource(obj) in cells, f"{obj.__name__} is not the code notebook 01 writes"


def test_the_schedule_hook_steps_after_each_step_and_the_stop_hook_raises():
    import threading

    from helpers import Stopped

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with train.schedule_after_step(opt, None):
        opt.step()  # no scheduler: nothing hangs on the optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with train.schedule_after_step(opt, sched):
        opt.step()
    opt.step()  # after the with: the hook is gone
    assert sched.last_epoch == 1
    tally = train.Tally("cpu")
    stop = threading.Event()
    train.stop_if_asked(stop, tally, 0)  # not set: nothing happens
    stop.set()
    with pytest.raises(Stopped, match="after 3 steps") as info:
        train.stop_if_asked(stop, tally, 3)
    assert info.value.partial is None, "nothing seen yet: no partial pass"


def test_the_schedule_skips_the_steps_fp16_skips_and_never_reads_the_scale(monkeypatch):
    """A GradScaler that finds an overflow skips optimizer.step(): the post-hook schedule must not advance then."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    monkeypatch.setattr(scaler, "get_scale", lambda: pytest.fail("get_scale() is a CPU-GPU sync"))
    with train.schedule_after_step(opt, sched):
        for x in (torch.ones(1, 2), torch.full((1, 2), float("inf")), torch.ones(1, 2)):
            opt.zero_grad()
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)  # the inf step: skipped
            scaler.update()
    assert sched.last_epoch == 2, "the schedule advanced on a skipped step"
