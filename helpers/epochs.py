"""Epochs under DDP: reshuffling with ``set_epoch``, and training that checkpoints and resumes exactly.

``train_epochs`` is what each rank runs: rank 0 saves a checkpoint after
every epoch (everyone waits at a barrier), and a later launch with
``resume=True`` loads it on every rank, onto that rank's own device, and
carries on. To continue *exactly*, a checkpoint needs more than the weights:
the optimizer's momentum, the epoch (which fixes the sampler's shuffle) and
every rank's random generators (here they drive a random flip of each batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from . import checkpoint
from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .ddp import shard_sampler
from .models import ConvNet
from .train import full_fp32, train_one_epoch


def epoch_orders(n: int, world_size: int, epochs: int, *, set_epoch: bool = True, seed: int = 0) -> list:
    """The sample indices each rank reads in each epoch: ``orders[epoch][rank]``.

    With ``set_epoch`` the sampler is told the epoch before each pass (as a
    training loop should); without, it deals the same shuffle every epoch.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("epochs", epochs)
    samplers = [shard_sampler(range(n), r, world_size, seed) for r in range(world_size)]
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(epoch)
        orders.append([list(s) for s in samplers])
    return orders


class RandomFlip:
    """A loader wrapper that mirrors each image left-right with probability 1/2, drawing from torch's RNG.

    It stands for any random augmentation: it makes the run depend on each
    rank's random generator, which a checkpoint must therefore save.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            flip = torch.rand(x.shape[0]) < 0.5
            yield torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x), y


def train_epochs(rank: int, world_size: int, dataset, epochs: int, batch_size: int, lr: float, path, *,
                 resume: bool = False, stop_after: int | None = None, restore_rng: bool = True,
                 seed: int = 0) -> dict:
    """Train a DDP ConvNet for ``epochs`` epochs, rank 0 checkpointing to ``path`` after each one.

    ``resume`` first loads ``path`` on every rank (``map_location`` = the
    rank's device) and continues from the epoch saved there; ``stop_after``
    ends the run after that many epochs, as a crash would. With
    ``restore_rng=False`` the random generators are not restored (to show
    why they are saved). Full float32. Returns the final parameters, the
    epochs this launch trained and their mean losses.
    Introduced in notebooks/04-ddp-habits.ipynb.
    """
    positive_int("epochs", epochs)
    positive_number("lr", lr)
    device = rank_device()
    # cuDNN may otherwise pick kernels that add in a different order from run to run (GPU only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    with full_fp32():
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = ConvNet().to(device)
        ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        sampler = shard_sampler(dataset, rank, world_size, seed)
        loader = RandomFlip(DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True))
        torch.manual_seed(seed + 1 + rank)  # each rank its own augmentation stream
        start = 0
        if resume:
            start = _resume(path, ddp, opt, device, rank, world_size, seed, restore_rng)
        done, losses = [], []
        for epoch in range(start, epochs):
            if stop_after is not None and epoch >= stop_after:
                break
            sampler.set_epoch(epoch)
            stats = train_one_epoch(ddp, loader, opt, device)
            done.append(epoch + 1)
            losses.append(stats.loss)
            report(step=epoch, total=epochs, loss=stats.loss)
            _save(path, ddp, opt, epoch + 1, rank, world_size, seed)
    return {"params": {k: v.detach() for k, v in model.state_dict().items()}, "epochs": done, "losses": losses}


def _save(path, ddp, opt, epoch, rank, world_size, seed) -> None:
    rngs = [None] * world_size
    dist.all_gather_object(rngs, checkpoint.rng_state())  # every rank's generators, in rank 0's file
    if rank == 0:  # one writer: W ranks writing one file would race
        checkpoint.save(path, ddp, opt, epoch=epoch, world_size=world_size, sampler_seed=seed, rng=rngs)
    dist.barrier()  # nobody reads or moves on before the file is complete


def _resume(path, ddp, opt, device, rank, world_size, seed, restore_rng) -> int:
    state = checkpoint.load(path, ddp, opt, map_location=device)
    if state["world_size"] != world_size or state["sampler_seed"] != seed:
        raise ValueError(f"{path} was written by {state['world_size']} ranks with sampler seed "
                         f"{state['sampler_seed']}; this run has {world_size} and {seed}, so its shards differ")
    if restore_rng:
        checkpoint.set_rng_state(state["rng"][rank])
    return state["epoch"]
