"""A Keras 3 model (torch backend) trained under DistributedDataParallel: what the ranks of notebook 26 run.

Notebook 26 defines the model, the ranks' loop and its probes (the region at the end of this file is written from
its cells by `make export`); above it is the machinery they use. The model and loop follow the Keras guide
"Multi-GPU distributed training with PyTorch": a small convnet with BatchNormalization and Dropout, wrapped in
``torch.nn.parallel.DistributedDataParallel``, fed by a DistributedSampler, trained by a plain torch loop. Under the
torch backend a Keras model *is* a ``torch.nn.Module`` whose variables (trainable or not) are ``nn.Parameter``\\s,
which is why DDP can wrap it at all.

Keras picks its backend once, at its first import, from ``KERAS_BACKEND``: ``keras_torch()`` sets it (unless already
set) and checks what Keras chose, and importing this module never imports Keras, so importing ``helpers`` never fixes
the backend behind a learner's back. The functions notebook 26 writes say ``import keras``: they run where Keras was
already imported on torch (the notebook's first cell or ``keras_torch()``; forked ranks inherit it). It also keeps
TensorFlow out where it is installed (Kaggle, Colab): Keras would import it to seed and to save a model, in the
notebook and in every rank (``seed_all``; tests/test_keras_ddp.py).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from torch.utils.data import DistributedSampler

from . import devices
from ._rank import rank_device, report
from .checks import positive_int, positive_number
from .train import full_fp32


def keras_torch():
    """Import Keras with the torch backend and return it; refuse clearly when another backend is set or loaded.

    Machinery behind keras_ddp's tests and 26's unit checks; no notebook calls it directly (26 imports keras itself).
    """
    wanted = os.environ.setdefault("KERAS_BACKEND", "torch")
    if wanted != "torch":
        raise RuntimeError(f"KERAS_BACKEND={wanted!r}; this course runs Keras on torch: set KERAS_BACKEND='torch' "
                           "before the first `import keras` (restart the kernel if Keras is already imported)")
    import keras

    if keras.backend.backend() != "torch":  # imported earlier, before the variable was set
        raise RuntimeError(f"Keras was imported with the {keras.backend.backend()!r} backend before KERAS_BACKEND "
                           "was set; the backend cannot change after the first import: restart the kernel")
    _keep_tensorflow_out()
    return keras


def _keep_tensorflow_out() -> None:
    """Saving or loading a model asks ``tf.available``, which imports all of TensorFlow wherever it is installed
    (serialization_lib.py): answer it "no" unless TensorFlow is already loaded."""
    from keras.src.utils import module_utils

    if "tensorflow" not in sys.modules:
        module_utils.tensorflow._available = False


def seed_all(seed: int) -> None:
    """Seed what ``keras.utils.set_random_seed`` seeds on the torch backend, without importing TensorFlow.

    ``set_random_seed`` (keras/src/utils/rng_utils.py) also calls ``tf.random.set_seed`` wherever TensorFlow is
    installed (Kaggle, Colab), which imports all of TensorFlow into the notebook and into every rank for a seed the
    torch backend never reads. This sets the rest: Python's ``random`` (Keras draws each layer's initializer and
    Dropout seed from it), NumPy's and torch's generators, and Keras's global seed, whose ``SeedGenerator`` is dropped
    so that Keras rebuilds it from the new seed, as ``set_random_seed`` does.
    Introduced in notebooks/26-keras-on-torch.ipynb.
    """
    import numpy as np
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, not {seed!r}")
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    _keep_tensorflow_out()  # every process that builds the model (get_model seeds it) may save or load it later


def channels_last(dataset: TensorDataset) -> TensorDataset:
    """The same images as (N, 28, 28, 1) for Keras (``helpers.data`` serves torch's (N, 1, 28, 28)).

    Machinery behind 26's unit checks; no notebook calls it directly (26 writes the permute on its page).
    """
    x, y = dataset.tensors
    return TensorDataset(x.permute(0, 2, 3, 1).contiguous(), y)


def save_atomic(model, path) -> Path:
    """Save a Keras model to ``path`` (``.keras``) through a temporary file and a rename, so no reader sees half a file.

    Introduced in notebooks/26-keras-on-torch.ipynb.
    """
    path = Path(path)
    if path.suffix != ".keras":
        raise ValueError(f"Keras saves whole models to a '.keras' file, got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.keras")  # same folder: os.replace stays one rename
    try:
        model.save(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_sizes(dataset, world_size: int, batch_size: int, steps: int, lr: float, epochs: int = 1,
                use_ddp: bool = True) -> None:
    """Refuse counts and rates that cannot work, by name, before a rank builds anything.

    ``steps`` steps of ``world_size`` x ``batch_size`` samples must fit in one epoch of ``dataset``; without DDP
    (the one-process reference) there is one rank. Introduced in notebooks/26-keras-on-torch.ipynb.
    """
    if not use_ddp and world_size != 1:
        raise ValueError(f"use_ddp=False needs world_size=1, not {world_size}")
    positive_int("epochs", epochs)
    positive_int("steps", steps)
    positive_int("batch_size", batch_size)
    positive_number("lr", lr)
    if steps > len(dataset) // (world_size * batch_size):
        raise ValueError(f"{steps} steps of {world_size}x{batch_size} need more than one epoch of {len(dataset)} "
                         "samples; use fewer steps or a smaller batch")


def guide_rank(current_gpu_index, num_gpus, dataset, port, results, steps=8, batch_size=64, fail_rank=None,
               hang_rank=None):
    """The guide's ``per_device_launch_fn``; ``fail_rank`` raises, ``hang_rank`` sleeps an hour.

    Introduced in notebooks/26-keras-on-torch.ipynb.
    """
    torch.set_num_threads(1)  # a rank forked after the notebook used torch's thread pool hangs with more
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    gpus = devices.gpu_count() >= num_gpus
    device = torch.device(f"cuda:{current_gpu_index}" if gpus else "cpu")
    if gpus:
        torch.cuda.set_device(device)
    # device_id binds NCCL to this GPU: without it torch 2.15 binds GPU (LOCAL_RANK, else the rank) % GPU count
    dist.init_process_group(backend="nccl" if gpus else "gloo", init_method="env://", world_size=num_gpus,
                            rank=current_gpu_index, device_id=device if gpus else None)
    if current_gpu_index == fail_rank:
        raise RuntimeError(f"rank {current_gpu_index} failed on purpose")
    if current_gpu_index == hang_rank:
        time.sleep(3600)
    out = keras_steps(current_gpu_index, num_gpus, dataset, steps, batch_size, 1e-3, device=device)
    results[current_gpu_index] = out["losses"][-1]
    dist.destroy_process_group()
    sys.stdout.flush()


# ---- exported from notebooks/26-keras-on-torch.ipynb: edit it there, then run `make export` ----
def get_model(dropout: float = 0.5, seed: int = 0):
    """The Keras guide's convnet; equal seeds give equal weights. Introduced in notebooks/26-keras-on-torch.ipynb."""
    import keras  # on torch: the first cell imported it after setting KERAS_BACKEND, and ranks fork from it

    layers = keras.layers
    seed_all(seed)  # keras.utils.set_random_seed's seeds, without its `import tensorflow`
    inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False, name="conv1")(inputs)
    x = layers.BatchNormalization(scale=False, center=True, name="bn1")(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(filters=24, kernel_size=6, use_bias=False, strides=2, name="conv2")(x)
    x = layers.BatchNormalization(scale=False, center=True, name="bn2")(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(filters=32, kernel_size=6, padding="same", strides=2, name="large_k")(x)
    x = layers.BatchNormalization(scale=False, center=True, name="bn3")(x)
    x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(256, activation="relu", name="dense")(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs)


def weights(model, trainable: bool) -> dict:
    """The model's float variables by path (``'dense/kernel'``) as torch tensors: the trainable ones, or the rest
    (BatchNormalization's moving statistics; the Dropout's integer seed state left out).

    Introduced in notebooks/26-keras-on-torch.ipynb.
    """
    chosen = model.trainable_variables if trainable else model.non_trainable_variables
    return {v.path: v.value.detach().clone() for v in chosen if v.value.is_floating_point()}


def train_epochs(net, opt, loader, sampler, device, steps, epochs, training):
    """The guide's torch loop: the rank's losses. Introduced in notebooks/26-keras-on-torch.ipynb."""
    kwargs = {} if training is None else {"training": training}  # None: the guide's model(x)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a fresh shuffle per epoch, the same on every rank
        for x, y in itertools.islice(loader, steps):
            loss = F.cross_entropy(net(x.to(device), **kwargs), y.to(device))
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            losses.append(loss.item())
            report(step=len(losses), total=steps * epochs, loss=losses[-1])
    return losses


def keras_steps(rank, world_size, dataset, steps, batch_size, lr, *, training=True, dropout=0.5, seed=0,
                epochs=1, use_ddp=True, save_to=None, device=None, optimizer="adam"):
    """The guide's model, DDP and sampler around train_epochs. Introduced in notebooks/26-keras-on-torch.ipynb."""
    check_sizes(dataset, world_size, batch_size, steps, lr, epochs, use_ddp)  # refused by name before any work
    import keras

    device = torch.device(device) if device is not None else rank_device()
    with full_fp32(), keras.device(str(device)):  # Keras's own default device would be "cuda" wherever one exists
        model = get_model(dropout, seed).to(device)
        net = DDP(model, device_ids=[device] if device.type == "cuda" else None) if use_ddp else model
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                     drop_last=True)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
        opt = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer](net.parameters(), lr=lr)  # trainable only
        losses = train_epochs(net, opt, loader, sampler, device, steps, epochs, training)
        if save_to is not None and rank == 0:
            save_atomic(model, save_to)
        return {"params": weights(model, True), "moving": weights(model, False), "losses": losses,
                "saved": str(save_to) if rank == 0 and save_to else None}


def broadcast_probe(rank, world_size, dataset, batch_size, *, seed=0):
    """Moving mean and bias after DDP(...) and after a step. Introduced in notebooks/26-keras-on-torch.ipynb."""
    import keras

    device = rank_device()
    with keras.device(str(device)):
        model = get_model(0.0, seed).to(device)
        by_path = {v.path: v for v in model.variables}
        moving, bias = by_path["bn1/moving_mean"], by_path["logits/bias"]
        for v in (moving, bias):
            v.assign(torch.full(tuple(v.shape), rank + 1.0))
        net = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        seen = {"wrapped": (moving.value[0].item(), bias.value[0].item())}
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, drop_last=True)
        x, y = next(iter(DataLoader(dataset, batch_size=batch_size, sampler=sampler)))
        F.cross_entropy(net(x.to(device), training=True), y.to(device)).backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        seen["stepped"] = (moving.value[0].item(), bias.value[0].item())
        return seen


def fit_rank(rank, world_size, dataset, steps, batch_size, lr, *, seed=0):
    """Keras's model.fit in a DDP rank. Introduced in notebooks/26-keras-on-torch.ipynb."""
    check_sizes(dataset, world_size, batch_size, steps, lr)
    import keras

    device = rank_device()
    with keras.device(str(device)):
        model = get_model(0.0, seed).to(device)
        ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        model.compile(optimizer=keras.optimizers.SGD(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                     drop_last=True)
        idx = list(sampler)[: steps * batch_size]
        x, y = (t[idx].numpy() for t in dataset.tensors)
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return {"params": weights(model, True), "has_fit": hasattr(ddp_model, "fit")}
# ---- end of export from notebooks/26-keras-on-torch.ipynb ----
