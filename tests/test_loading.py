"""helpers.loading: the augmented dataset and the loader benchmark; launch removing the workers of forked ranks.

The DataLoader settings and the DDP rank with workers are written in notebooks/12-data-loading.ipynb, whose
asserts check them (CI runs it); here a plain DataLoader stands in for the notebook's."""

import os
import threading

import numpy as np
import pytest
import torch

import helpers
from helpers import loading, procs
from helpers.launch import launch
from torch.utils.data import DataLoader


def tiny(n=40, size=12):
    rng = np.random.default_rng(0)
    return loading.AugmentedFashion(images=rng.integers(0, 256, (n, size, size), dtype=np.uint8),
                                    labels=np.arange(n) % 10)


def make_loader(dataset, batch_size=8, num_workers=0, persistent_workers=False, prefetch_factor=None):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                      persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)


def test_items_are_augmented_tensors():
    ds = tiny()
    x, y = ds[3]
    assert x.shape == (1, 12, 12) and x.dtype == torch.float32 and y == 3
    torch.manual_seed(0)
    a = torch.stack([ds[0][0] for _ in range(8)])
    assert (a - a[0]).abs().amax() > 0, "random crops and flips: the same item differs between requests"
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        loading.AugmentedFashion(images=np.zeros((3, 4, 4), np.uint8), labels=[0, 1])


def test_real_files_load_with_limit():
    ds = loading.AugmentedFashion("test", limit=5)
    assert len(ds) == 5 and ds[0][0].shape == (1, 28, 28)


def test_measure_counts_samples_steps_and_splits_time():
    ds = tiny(40)
    calls = []
    loader = make_loader(ds)
    run = loading.measure(loader, step=lambda x, y: calls.append(len(y)), epochs=2, settings={"w": 0})
    assert (run.samples, run.steps, sum(calls)) == (80, 10, 80)
    assert run.wait_s > 0 and run.compute_s >= 0 and run.wait_s + run.compute_s <= run.seconds
    assert 0 < run.wait_fraction <= 1 and run.samples_per_s == pytest.approx(80 / run.seconds)
    cut = loading.measure(loader, max_batches=2)
    assert (cut.samples, cut.steps) == (16, 2)


def test_measure_counts_starting_the_workers_as_waiting():
    """iter(loader) starts (or resumes) the workers; that time is waiting for data, and wait + compute cover the
    pass (06 once asserted this and failed when resuming persistent workers took long on a busy machine)."""
    import time

    class SlowStart:  # a loader whose iter() takes 0.2 s, as starting workers can
        def __len__(self):
            return 2

        def __iter__(self):
            time.sleep(0.2)
            return iter([(torch.zeros(4, 1), torch.zeros(4))] * 2)

    run = loading.measure(SlowStart(), step=lambda x, y: None, epochs=2)
    assert run.wait_s >= 0.4 and run.first_batch_s >= 0.2
    assert 0 <= run.seconds - (run.wait_s + run.compute_s) < 0.1, "iter()'s time is counted as waiting"


def test_measure_sees_a_slow_step_as_compute():
    import time
    run = loading.measure(make_loader(tiny(16)), step=lambda x, y: time.sleep(0.5))
    assert run.compute_s >= 1.0 and run.wait_fraction < 0.5


def test_measure_stops_on_request():
    stop = threading.Event()
    stop.set()
    with pytest.raises(helpers.Stopped):
        loading.measure(make_loader(tiny()), stop=stop)


def test_sweep_reports_median_within_spread_and_best():
    settings = [{"num_workers": 0}, {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 4}]
    ds = tiny(32)
    out = loading.sweep(lambda **s: make_loader(ds, **s), settings, repeats=3, warmup=0, epochs=2)
    assert [r["settings"] for r in out] == settings
    for r in out:
        assert len(r["runs"]) == 3 and r["low"] <= r["median"] <= r["high"]
        assert all(run.samples == 64 for run in r["runs"])
    assert loading.best(out)["median"] == max(r["median"] for r in out)
    with pytest.raises(ValueError):
        loading.best([])


def test_forward_step_runs_the_model_without_autograd():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((x.shape, torch.is_grad_enabled()))
            return x

    loading.forward_step(Probe())(torch.ones(4, 3), None)
    assert seen == [((4, 3), False)]


def rank_leaving_workers(rank, world_size, dataset, num_workers):
    """A rank that returns while its persistent DataLoader workers still run, as a crashed rank would leave them."""
    import psutil
    loader = make_loader(dataset, num_workers=num_workers, persistent_workers=True)
    it = iter(loader)
    next(it)
    rank_leaving_workers.kept = (loader, it)
    return {"pid": os.getpid(), "worker_pids": [p.pid for p in psutil.Process().children(recursive=True)],
            "threads": torch.get_num_threads()}


def test_launch_kills_the_dataloader_workers_of_forked_ranks():
    res = launch(rank_leaving_workers, 2, tiny(64), 2, quiet=True, progress=False)
    pids = [p for r in res for p in r["worker_pids"]]
    assert [len(r["worker_pids"]) for r in res] == [2, 2] and len(set(pids)) == 4
    assert all(r["threads"] == 1 for r in res)
    assert procs.alive(pids) == [], "launch must kill every rank's DataLoader workers"


def test_table_aligns_columns(capsys):
    loading.table([{"num_workers": 0, "samples/s": 1234.56}, {"num_workers": 12, "samples/s": 0.5, "note": "x"}])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["num_workers  samples/s  note", "          0      1,235      ", "         12       0.50     x"]
