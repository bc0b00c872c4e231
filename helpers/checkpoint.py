"""Checkpoints that survive a crash mid-write and resume a run exactly.

``save`` writes to a temporary file in the same folder, flushes and fsyncs
it, then ``os.replace``s it over the target: a reader sees the old file or the
new one, never half of one, even if the writer is SIGKILLed. ``load`` reads
with ``torch.load(weights_only=True)``: unpickling a file may otherwise run
code, and a checkpoint is exactly the file people copy between machines. So
the extra state must be made of tensors, numbers, strings, None, lists,
tuples and dicts; ``save`` checks that before it writes anything, and
``rng_state()`` returns the random generators' states in that form.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .data import CorruptFile

FORMAT = "multigpu-notebooks checkpoint"
VERSION = 1


class CheckpointError(CorruptFile):
    """A checkpoint file is missing, damaged, or not one this module wrote; the message names the path.

    A ``helpers.data.CorruptFile``, like every damaged file the helpers read.

    Introduced in notebooks/06-ddp-habits.ipynb.
    """


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel / torch.compile wrappers, whose state_dict has plain names.

    Machinery behind checkpoint.save; no notebook calls it directly.
    """
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _check_state_is_safe(state: dict) -> None:
    """Refuse extra state that ``torch.load(weights_only=True)`` could not read back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)  # a check only: no copy on the saving GPU
    except pickle.UnpicklingError as e:
        raise TypeError(
            "checkpoint.save: the extra state holds an object that load (weights_only=True) would refuse; "
            "keep to tensors, numbers, strings, None, lists, tuples and dicts (convert numpy arrays with "
            f"torch.from_numpy). torch said: {str(e).splitlines()[0]}") from e


def save(path, model: nn.Module, optimizer=None, **state) -> Path:
    """Write model (unwrapped from DDP), optimizer and extra ``state`` to ``path`` atomically.

    A temporary file in the same folder is written, flushed and fsynced, then
    renamed over ``path`` (``os.replace``), so ``path`` always holds a whole
    checkpoint. Only one process should call it (rank 0 in DDP).
    Introduced in notebooks/06-ddp-habits.ipynb.
    """
    path = Path(path)
    _check_state_is_safe(state)
    payload = {"format": FORMAT, "version": VERSION, "model": unwrap(model).state_dict(),
               "optimizer": None if optimizer is None else optimizer.state_dict(), "state": state}
    path.parent.mkdir(parents=True, exist_ok=True)
    # same folder: os.replace is atomic only within one file system
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)  # and the rename itself survives a power cut
    return path


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some file systems (and Windows) cannot open a folder; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # fsync on a folder is refused by some file systems; nothing more can be done there
    finally:
        os.close(fd)


def _read(path: Path, map_location) -> dict:
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the file does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file (a folder?), so it cannot be a checkpoint")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): not a checkpoint. Was it created by something other "
                              "than checkpoint.save, or copied while being written?")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - random bytes reach the legacy unpickler, which can raise anything
        # (IndexError, KeyError, UnicodeDecodeError, ...); each means the same thing here: not a readable checkpoint
        raise CheckpointError(f"{path} ({size} bytes) cannot be read as a torch checkpoint: it is truncated or "
                              f"corrupt ({type(e).__name__}: {_first_sentence(e)})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        what = sorted(payload)[:8] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is a torch file but not a checkpoint written by helpers.checkpoint.save "
                              f"(found {what})")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {payload.get('version')!r}; this code reads {VERSION}")
    return payload


def _first_sentence(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(". ")[0][:200]


def load(path, model: nn.Module, optimizer=None, map_location="cpu") -> dict:
    """Restore model (DDP or plain) and optimizer from ``path``; return the extra state saved with them.

    ``map_location`` puts the tensors on this process's device (each DDP rank
    passes its own). Raises ``CheckpointError`` naming the path when the file
    is missing, empty, truncated, corrupt, not a checkpoint, or does not fit
    the model or optimizer.
    Introduced in notebooks/06-ddp-habits.ipynb.
    """
    path = Path(path)
    payload = _read(path, map_location)
    try:
        unwrap(model).load_state_dict(payload["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit this model: {str(e).splitlines()[0]} ...") from e
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise CheckpointError(f"{path} holds no optimizer state (it was saved without an optimizer)")
        try:
            optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: its optimizer state does not fit this optimizer ({e})") from e
    return payload["state"]


def rng_state() -> dict:
    """This process's random generators (torch CPU, its current GPU, Python, numpy) as weights-only-safe values.

    Introduced in notebooks/06-ddp-habits.ipynb.
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_initialized():  # asking otherwise would create a CUDA context
        # this process's own GPU only: get_rng_state_all would open a context on every GPU from every rank
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what ``rng_state()`` returned, so the run continues with the same random numbers.

    Introduced in notebooks/06-ddp-habits.ipynb.
    """
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu())
