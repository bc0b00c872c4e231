"""What the notebooks draw and what DDP ranks run, at test size."""

import functools
import itertools
import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from helpers import ddp, devices, models, plots  # noqa: E402
from helpers.launch import RankFailed, free_port, launch, prewarm, rank_device, report  # noqa: E402
from helpers.procs import child_stderr  # noqa: E402


def toy_set(n=512):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def test_plots_draw_what_they_are_given():
    history = [dict(epoch=1, train_loss=2.0, test_acc=0.5), dict(epoch=2, train_loss=1.0, test_acc=0.7)]
    ax = plots.plot_history(history)
    assert list(ax.lines[0].get_ydata()) == [2.0, 1.0]
    ax = plots.plot_bars({"a": 1.0, "b": 3.0}, "rate")
    assert [round(p.get_height()) for p in ax.patches] == [1, 3]
    ax = plots.plot_bars({"a": 2.0, "b": 3.0}, "rate", spread={"a": (1.0, 2.5), "b": (3.0, 3.0)})
    (whiskers,) = ax.collections
    assert [tuple(seg[:, 1]) for seg in whiskers.get_segments()] == [(1.0, 2.5), (3.0, 3.0)]
    ax = plots.plot_curves({"x": [(0, 1.0), (1, 0.5)], "empty": []}, "step", "loss")
    assert len(ax.lines) == 1


def test_step_curve_bins_each_epoch_and_one_epoch_plots_as_a_curve():
    rows = [dict(epoch=1, train_loss=1.5, test_acc=0.6, step_losses=[2.0, 1.0, 1.0, 0.0]),
            dict(epoch=2, train_loss=0.5, test_acc=0.8, step_losses=[1.0, 0.0])]
    assert plots.step_curve(rows, points_per_epoch=2) == [(0.5, 1.5), (1.0, 0.5), (1.5, 1.0), (2.0, 0.0)]
    assert plots.step_curve(rows[:1], points_per_epoch=20) == [(0.25, 2.0), (0.5, 1.0), (0.75, 1.0), (1.0, 0.0)]
    ax = plots.plot_history(rows[:1])
    assert len(ax.lines[0].get_xdata()) == 5, "one epoch: a loss curve from its first step, not a single point"
    low, high = ax.figure.axes[1].get_ylim()
    assert low <= 0.6 <= high and high <= 1.0 and high - low > 0.1, "accuracy axis is not a band around one point"


def test_live_plot_keeps_every_point_of_the_ranks_asked_for(monkeypatch):
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    live = plots.LivePlot("loss", ranks=[0], every=0.0)
    for step in range(3):
        live(0, {"step": step, "loss": 1.0 / (step + 1)})
        live(1, {"step": step, "loss": 9.0})
    live(0, {"other": 1})
    assert live.finish() == {"rank 0": [(0, 1.0), (1, 0.5), (2, 1 / 3)]}
    assert bytes(live.image.value).startswith(b"\x89PNG"), "the widget holds the latest drawing"


F64 = dict(dtype=torch.float64)  # the equivalence rule (helpers/README.md): float64 on both sides, < 1e-10


def test_ddp_steps_match_one_process_with_the_big_batch():
    """The reference runs in a launched child: a backward here would poison later GPU forks (FACTS)."""
    data = toy_set()
    quiet = dict(quiet=True, progress=False)
    out = launch(functools.partial(ddp.ddp_steps, **F64), 2, data, 3, 16, 0.1, **quiet)
    ref = launch(functools.partial(ddp.reference_rank, **F64), 1, data, 3, 32, 0.1, **quiet)[0]
    assert all(v.dtype == torch.float64 for v in ref["params"].values() if v.is_floating_point())
    assert models.max_param_diff(out[0]["params"], ref["params"]) < 1e-10
    assert models.max_param_diff(out[0]["params"], out[1]["params"]) == 0.0
    assert len(out[0]["losses"]) == 3 and out[0]["samples_per_s"] > 0
    with_bn = launch(functools.partial(ddp.ddp_steps, batch_norm=True, **F64), 2, data, 3, 16, 0.1, **quiet)
    bn_ref = launch(functools.partial(ddp.reference_rank, batch_norm=True, **F64), 1, data, 3, 32, 0.1, **quiet)[0]
    assert models.max_param_diff(with_bn[0]["params"], bn_ref["params"]) > 1e-4
    default = launch(ddp.reference_rank, 1, data, 3, 32, 0.1, **quiet)[0]
    assert default["params"]["fc.weight"].dtype == torch.float32, "float32 stays the default"
    with pytest.raises(RankFailed, match="launch it with world_size=1"):
        launch(ddp.reference_rank, 2, data, 3, 32, 0.1, **quiet)


def test_ddp_steps_match_one_process_across_epochs_and_warm_up_counts_untimed():
    """Steps go on past an epoch (set_epoch reshuffles on both sides); the epoch's end needs no batch boundary."""
    data = toy_set(3 * 16 * 2 + 5)  # 2 steps an epoch for 3 ranks of 16, 5 samples left over
    quiet = dict(quiet=True, progress=False)
    out = launch(functools.partial(ddp.ddp_steps, **F64), 3, data, 5, 16, 0.1, **quiet)
    ref = launch(functools.partial(ddp.reference_rank, **F64), 1, data, 5, 48, 0.1, **quiet)[0]
    assert models.max_param_diff(out[0]["params"], ref["params"]) < 1e-10
    warm = launch(functools.partial(ddp.ddp_steps, warmup=2, **F64), 3, data, 3, 16, 0.1, **quiet)
    assert len(warm[0]["losses"]) == 3
    assert models.max_param_diff(warm[0]["params"], out[0]["params"]) < 1e-10, "2 untimed + 3 timed = 5 steps"


@pytest.mark.parametrize("steps, batch, lr, error", [
    (0, 16, 0.1, ValueError), (2.0, 16, 0.1, TypeError), (2, -1, 0.1, ValueError), (2, 16, 0.0, ValueError),
    (2, 16, float("nan"), ValueError), (2, 16, "0.1", TypeError),
])
def test_ddp_helpers_refuse_bad_numbers_up_front(steps, batch, lr, error):
    with pytest.raises(error, match="steps|batch_size|lr"):
        ddp.check_steps(toy_set(), 2, batch, steps, lr)


def test_ddp_steps_refuse_a_dataset_without_a_batch_per_rank():
    with pytest.raises(ValueError, match="cannot give 2 rank"):
        ddp.check_steps(toy_set(60), 2, 32, 1, 0.1)
    ddp.check_steps(toy_set(64), 2, 32, 1000, 0.1)  # many epochs are fine


def test_batches_reshuffle_every_epoch_with_set_epoch():
    data = toy_set(8)
    sampler = ddp.shard_sampler(range(8), 0, 2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    first, second = (x for x, _ in itertools.islice(ddp.batches(sampler, loader), 2))
    sampler.set_epoch(0)
    assert torch.equal(first, data.tensors[0][list(sampler)]), "epoch 0: the sampler's order"
    sampler.set_epoch(1)
    assert torch.equal(second, data.tensors[0][list(sampler)]) and not torch.equal(first, second)


def test_shard_sampler_shards_are_disjoint_and_cover():
    data = toy_set(100)
    shards = [list(ddp.shard_sampler(data, r, 4)) for r in range(4)]
    assert sum(map(len, shards)) == 100 and len(set().union(*map(set, shards))) == 100


def test_outside_a_launch_report_is_silent_and_rank_device_follows_local_rank(monkeypatch):
    report(step=1, loss=0.5)  # no queue: nothing happens, nothing raises
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device() == devices.pick_device(0)


def test_child_stderr_captures_what_children_write_to_fd_2():
    with child_stderr() as captured:
        pid = os.fork()
        if pid == 0:
            os.write(2, b"child says hi\n")
            os._exit(0)
        os.waitpid(pid, 0)
    assert "child says hi" in captured.text()


def test_free_port_and_prewarm():
    assert 1024 <= free_port() < 65536
    prewarm()
    assert prewarm() < 0.5, "the second call finds everything imported"


def test_the_timed_loop_reports_only_when_live_and_reads_losses_after_the_clock():
    """No report (a device wait) inside the timed steps unless live=True; the losses come back as floats either way."""
    data, events = toy_set(), []
    quiet = dict(quiet=True, progress=False, on_event=lambda rank, metrics: events.append((rank, metrics)))
    out = launch(ddp.ddp_steps, 2, data, 3, 16, 0.1, **quiet)
    assert events == [] and all(isinstance(loss, float) for loss in out[0]["losses"])
    live = launch(functools.partial(ddp.ddp_steps, live=True), 2, data, 3, 16, 0.1, **quiet)
    rank0 = [m for rank, m in events if rank == 0]
    assert [m["step"] for m in rank0] == [1, 2, 3] and [m["total"] for m in rank0] == [3, 3, 3]
    assert [m["loss"] for m in rank0] == live[0]["losses"] == out[0]["losses"]


def test_the_step_timeline_draws_a_panel_per_setting_and_counts_buckets():
    spans = [("forward", 0.0, 1.0), ("backward", 1.0, 3.0), ("call", 3.0, 3.1), ("all-reduce", 3.0, 4.0),
             ("step", 4.0, 4.5)]
    fig = ddp.plot_step_timeline({None: [spans, spans], 0.02: [spans + [("call", 2.0, 2.1)], spans]})
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["bucket_cap_mb=None: 1 bucket(s)", "bucket_cap_mb=0.02: 2 bucket(s)"]
    assert len(fig.axes[0].collections) == 2 * 4, "four drawn lanes a rank, 'call' not drawn"
    matplotlib.pyplot.close(fig)


def _one_stream(rank, world_size):
    """A warm-up of 0, then 3 steps, then the next batch, read from one stream (in a launched rank: no autograd here)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = toy_set(64)
    stream = iter(torch.utils.data.DataLoader(data, batch_size=8))
    none, losses = ddp.train_steps(model, optimizer, stream, "cpu", 0), ddp.train_steps(model, optimizer, stream, "cpu", 3)
    return {"none": none, "losses": len(losses), "detached": not any(loss.requires_grad for loss in losses),
            "fourth": torch.equal(next(stream)[0], data.tensors[0][24:32])}


def test_the_clock_counts_the_block_and_train_steps_takes_only_the_batches_it_steps_on():
    """``Clock`` times its block (the device synchronised at both ends); ``train_steps`` draws ``steps`` batches from
    the stream and no more, so a warm-up and the timed steps read one stream as one run would."""
    import time

    with ddp.Clock("cpu") as clock:
        time.sleep(0.05)
    assert 0.05 <= clock.seconds < 5
    out = launch(_one_stream, 1, quiet=True, progress=False)[0]
    assert out == {"none": [], "losses": 3, "detached": True, "fourth": True}, out
