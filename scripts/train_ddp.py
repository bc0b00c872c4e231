#!/usr/bin/env python
"""Train the course's ConvNet with DDP under torchrun: the training of notebooks 04/06 as a script.

    torchrun --standalone --nproc_per_node=2 scripts/train_ddp.py --epochs 1 --checkpoint run.pt --save-every 50

    # with --max-restarts, in torchrun's (the agent's) environment: each restart gets a store of its own
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --max-restarts=3 --nproc_per_node=4 scripts/train_ddp.py --checkpoint run.pt --save-every 50

Every rank reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from
torchrun's environment; NCCL when every rank of this node has its own GPU,
gloo otherwise. The model, the data search, the sampler and the step loop are
``helpers``' (``ddp.ddp_steps`` in notebook 04 computes the same steps). With
``--checkpoint`` rank 0 saves atomically every ``--save-every`` steps and at
the end, and a start finds the file and resumes from the step saved there, so
that a run restarted at any point ends with exactly the parameters of an
uninterrupted one (CPU, same world size). ``--dtype float64`` makes runs
comparable to 1e-10 where float32's rounding could tell them apart (GPUs).
Introduced in notebooks/14-torchrun-and-clusters.ipynb.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the helpers package sits next to scripts/

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from helpers import checkpoint, data, devices  # noqa: E402
from helpers.ddp import shard_sampler  # noqa: E402
from helpers.models import ConvNet  # noqa: E402
from helpers.train import full_fp32, train_one_epoch  # noqa: E402


class SetupError(Exception):
    """A problem with the options, the data or the checkpoint: printed as one line, exit code 2."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP training of the course's ConvNet (run it with torchrun).")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training set (default 1)")
    p.add_argument("--steps", type=int, default=None, help="stop after N optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the sampler's shuffle")
    p.add_argument("--data", type=Path, default=None,
                   help="folder with the Fashion-MNIST IDX files (default: helpers.data's search)")
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    p.add_argument("--smoke", action="store_true", help="a small prefix of the data (what CI runs)")
    p.add_argument("--batch-norm", action="store_true", help="ConvNet with BatchNorm (04's runs use none)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="weights and images; float64 to compare runs exactly (notebook 14)")
    p.add_argument("--checkpoint", type=Path, default=None, help="save here; resume from here when it exists")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints a progress line every N steps")
    p.add_argument("--pause", type=float, default=0.0,
                   help="sleep S seconds after each step (demos: time to kill a worker mid-run)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL when every rank of a node has its own GPU, gloo otherwise")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait before failing")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("steps", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.save_every < 0 or args.pause < 0 or args.timeout <= 0:
        p.error("--lr and --timeout must be > 0; --save-every and --pause must be >= 0")
    if args.save_every and args.checkpoint is None:
        p.error("--save-every needs --checkpoint PATH")
    return args


def load_data(args) -> TensorDataset:
    """The training split, from --data when given (and only from there), else helpers.data's search."""
    if args.data is not None:
        if not args.data.is_dir():
            raise SetupError(f"--data {args.data}: no such folder")
        found = data.find_dataset("fashion", args.data, download=False)
        if found.resolve() != args.data.resolve():  # the search fell through to another place
            raise SetupError(f"--data {args.data}: no Fashion-MNIST IDX files there (train-images-idx3-ubyte ...)")
    limit = data.SMOKE_SIZES["train"] if args.smoke else args.limit
    if args.smoke and args.limit is not None:
        limit = min(limit, args.limit)
    images, labels = data.load_split("fashion", "train", args.data, limit)
    return TensorDataset(images.to(getattr(torch, args.dtype)), labels)  # the model's dtype: no cast per step


def init_distributed(timeout: float, backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join torchrun's group (or a group of one without torchrun); returns rank, world size, device."""
    # >>> set-up
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this worker's index on its node: which GPU
    # the notebooks' planner: a GPU per worker -> NCCL; workers sharing GPUs, or no GPU -> gloo
    plan = devices.plan(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend=None if backend == "auto" else backend)
    device, backend = plan.devices[local_rank], plan.backend
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # device_id binds NCCL to this worker's GPU from the start (without it barrier() guesses and warns)
    device_id = device if backend == "nccl" else None
    if "RANK" not in os.environ:  # plain `python train_ddp.py`: one process, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    else:  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (env://)
        check_restartable()
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id)
    # <<< set-up
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), device


def check_restartable() -> None:
    """Refuse restarts on torchrun's shared store: a restarted group would meet the keys of the previous one."""
    # The agent's TCPStore outlives the workers (dynamic_rendezvous.py, next_rendezvous), so a restarted group
    # would find the last group's keys; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round gets a
    # fresh MASTER_PORT and rank 0 serves a new store there. TORCHELASTIC_RESTART_COUNT cannot name the attempt:
    # it counts per agent, and an agent that restarts for another node's failure does not count it.
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise SetupError("--max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                         "(a restarted group would meet the previous group's keys in torchrun's shared store); "
                         "with a static rendezvous (--master-addr) this script cannot restart")


def save(args, model, opt, step, epoch, in_epoch, rank, world) -> None:
    rngs = [None] * world
    dist.all_gather_object(rngs, checkpoint.rng_state())  # every rank's generators, in rank 0's file
    if rank == 0:  # one writer; save() writes a temporary file and renames it, so a kill never leaves half
        checkpoint.save(args.checkpoint, model, opt, step=step, epoch=epoch, step_in_epoch=in_epoch,
                        world_size=world, seed=args.seed, batch_size=args.batch_size, lr=args.lr, dtype=args.dtype,
                        rng=rngs)
    dist.barrier()  # nobody moves on (or dies happily) before the file is complete


def resume(args, model, opt, device, rank, world) -> tuple[int, int, int]:
    """(step, epoch, step within the epoch) saved in --checkpoint; zeros when there is no file yet."""
    # >>> resume
    if args.checkpoint is None or not args.checkpoint.exists():
        return 0, 0, 0
    state = checkpoint.load(args.checkpoint, model, opt, map_location=device)  # onto this worker's own device
    mine = dict(world_size=world, seed=args.seed, batch_size=args.batch_size, lr=args.lr, dtype=args.dtype)
    theirs = {k: state.get(k) for k in mine}  # a file from before --dtype has none: refused, not a KeyError
    if theirs != mine:
        raise SetupError(f"{args.checkpoint} was written by a run with {theirs}; this run has {mine}: "
                         "its steps would differ. Use another --checkpoint path, or the same settings")
    checkpoint.set_rng_state(state["rng"][rank])  # this rank's generators, as they were at the save
    # <<< resume
    return state["step"], state["epoch"], state["step_in_epoch"]


def train(args, dataset, rank, world, device) -> dict:
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = ConvNet(batch_norm=args.batch_norm).to(device, getattr(torch, args.dtype))
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sampler = shard_sampler(dataset, rank, world, args.seed)
    per_epoch = len(sampler) // args.batch_size
    if per_epoch == 0:
        raise SetupError(f"{len(dataset)} images cannot give {world} ranks a batch of {args.batch_size} each")
    total = args.epochs * per_epoch if args.steps is None else min(args.steps, args.epochs * per_epoch)
    step, epoch, in_epoch = resume(args, ddp, opt, device, rank, world)
    env = {k: os.environ.get(k, "-") for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")}
    # one write for the whole line: the workers of a node share one output, and print's two writes could interleave
    print(f"[rank {rank}] pid {os.getpid()} " + " ".join(f"{k}={v}" for k, v in env.items()) + "\n", end="",
          flush=True)
    if rank == 0:
        where = f"resumed at step {step} (epoch {epoch}, step {in_epoch} in it)" if step else "from scratch"
        print(f"[rank 0] world size {world} on {device} ({dist.get_backend()}); {total} steps of {world}x"
              f"{args.batch_size}, {per_epoch} per epoch; {where}", flush=True)
    start, first = time.perf_counter(), step
    # >>> loop
    while step < total:
        sampler.set_epoch(epoch)  # the epoch's shuffle: the same on every rank, a new one each epoch
        # the epoch's shard from step `in_epoch` on: the same batches an uninterrupted pass would read next
        order = list(sampler)[in_epoch * args.batch_size:]
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=order, drop_last=True)

        def on_step(i, loss):
            nonlocal step
            step += 1
            if args.pause:
                time.sleep(args.pause)
            if rank == 0 and (step % args.log_every == 0 or step == total):
                print(f"[rank 0] step {step}/{total} epoch {epoch + 1} loss {loss.item():.4f}", flush=True)
            if args.save_every and step % args.save_every == 0 and step < total:
                save(args, ddp, opt, step, *divmod(step, per_epoch), rank, world)
            hold_for_a_test(step, first)

        train_one_epoch(ddp, loader, opt, device, max_steps=min(per_epoch - in_epoch, total - step),
                        on_step=on_step)
        epoch, in_epoch = divmod(step, per_epoch)
    if args.checkpoint is not None:
        save(args, ddp, opt, step, epoch, in_epoch, rank, world)
    # <<< loop
    seconds = time.perf_counter() - start
    if rank == 0:
        print(f"[rank 0] done: {step} steps ({step - first} in this attempt, {seconds:.1f} s)"
              + (f"; checkpoint {args.checkpoint}" if args.checkpoint else ""), flush=True)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def hold_for_a_test(step: int, first: int) -> None:
    """Test hook (tests/test_restart_two_nodes.py): with TRAIN_DDP_HOLD_AFTER=K, an attempt that started from
    scratch stops after step K (and its save) and sleeps until it is killed: outside any collective."""
    if first == 0 and step == int(os.environ.get("TRAIN_DDP_HOLD_AFTER", "0") or 0):
        print(f"[rank {os.environ.get('RANK', '0')}] holding after step {step}\n", end="", flush=True)
        time.sleep(3600)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        dataset = load_data(args)  # before joining the group: a missing folder fails fast, on every rank alike
    except (SetupError, data.DatasetNotFound, data.CorruptFile) as e:
        print(f"train_ddp.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    # cuDNN may otherwise pick kernels that add in a different order from run to run (GPU only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        rank, world, device = init_distributed(args.timeout, args.backend)
    except (ValueError, SetupError) as e:  # the planner refusing --backend nccl without a GPU per rank; restarts
        print(f"train_ddp.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        with full_fp32():
            train(args, dataset, rank, world, device)
    except (SetupError, checkpoint.CheckpointError) as e:  # a foreign or damaged --checkpoint: every rank says so
        print(f"train_ddp.py: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown, as the notebooks' forked ranks do. A worker that had finished,
    # saved and destroyed its group was now and then aborted while Python shut down ("terminate called without an
    # active exception", exit -6; 2 of ~250 two-node runs on a busy 2-core machine): a C++ thread that reaches
    # for the GIL during finalization is ended by pthread_exit, which aborts (pytorch/pytorch#38228). torchrun
    # then failed the whole job, or its other node waited for the lost one. Nothing is left to do but flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
