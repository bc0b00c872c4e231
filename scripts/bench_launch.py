"""Launch overhead and CPU scaling of helpers.launch, one run, ratios printed.

1. Time from asking for 2 ranks to their first finished DDP step: fork via
   helpers.launch (first launch in a fresh process, then a later one) against
   torch.multiprocessing spawn with the worker in a module (target: fork >= 2x sooner).
2. CPU samples/s: DDP 2 ranks x 1 thread against 1 process x 1 thread (target >= 1.6x).
Both measure the CPU, so the GPUs are hidden from this process first: on a GPU machine the plan would otherwise put
these CPU models under NCCL ("No backend type associated with device type cpu"), and the one-process baseline's
backward pass here would leave later forked ranks unable to start CUDA.
    python scripts/bench_launch.py            # the benchmark
    python scripts/bench_launch.py --plan     # only the plan it would use
"""

import functools
import os
import sys
import time

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch or helpers look at the GPUs

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import data, ddp, models, train  # noqa: E402
from helpers.launch import free_port, launch  # noqa: E402

BATCH = 32


def first_step(rank, world_size):
    """A DDP rank's start-up: build, wrap, one step; returns the wall clock at that point."""
    model = torch.nn.parallel.DistributedDataParallel(models.ConvNet())
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return time.time()


def spawned_worker(rank, world_size, port, times):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    times[rank] = first_step(rank, world_size)
    dist.destroy_process_group()


def fork_first_step() -> float:
    start = time.time()
    return max(launch(first_step, 2, quiet=True, progress=False)) - start


def spawn_first_step() -> float:
    times = torch.zeros(2, dtype=torch.float64).share_memory_()
    start = time.time()
    tmp.start_processes(spawned_worker, args=(2, free_port(), times), nprocs=2, start_method="spawn")
    return times.max().item() - start


def main():
    if "--plan" in sys.argv:
        from helpers import devices
        print(devices.plan(2))
        return
    fresh = fork_first_step()
    warm = min(fork_first_step() for _ in range(3))
    spawn = spawn_first_step()
    print(f"launch → first step, 2 ranks on CPU: fork {warm:.3f} s (first in this process: {fresh:.3f} s), "
          f"spawn {spawn:.3f} s")
    print(f"fork is {spawn / warm:.1f}x sooner than spawn ({spawn / fresh:.1f}x counting the first launch's "
          "one-time import of DDP's modules) (target >= 2x)")

    train_set, _ = data.get_datasets("fashion", smoke=False)
    steps = 120
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = data.make_loader(train_set, batch_size=BATCH)
    train.train_one_epoch(model, loader, opt, "cpu", max_steps=2)
    single = train.train_one_epoch(model, loader, opt, "cpu", max_steps=steps).samples_per_s
    torch.set_num_threads(threads)
    ranks = launch(functools.partial(ddp.ddp_steps, warmup=2), 2, train_set, steps, BATCH, 0.05,
                   quiet=True, progress=False)
    both = sum(r["samples_per_s"] for r in ranks)
    print(f"CPU, batch {BATCH} per process: 1 process x 1 thread {single:.0f} samples/s; "
          f"DDP 2 ranks x 1 thread {both:.0f} samples/s")
    print(f"DDP 2 ranks / 1 process: {both / single:.2f}x on {os.cpu_count()} cores (target >= 1.6x)")


if __name__ == "__main__":
    main()
