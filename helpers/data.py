"""Fashion-MNIST and MNIST: find the files, load them, serve batches.

The IDX files are read directly (gzipped or raw), so the same code works on
torchvision's download, on Debian's ``dataset-fashion-mnist`` package and on
the small files the tests write. Two ways to serve batches: the standard
``DataLoader`` (what most tutorials use) and ``DeviceLoader``, which keeps the
whole split on the device and hands out shuffled index batches.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from .checks import positive_int

DATA_ENV = "MULTIGPU_DATA"
PROJECT_DATA = Path(__file__).resolve().parent.parent / "data"
DEBIAN_DIRS = {"fashion": Path("/usr/share/datasets/fashion-mnist")}
TORCHVISION_DIRS = {"fashion": "FashionMNIST", "mnist": "MNIST"}
# Mean and std of the training pixels in [0, 1], from the datasets' papers/common use.
NORMALIZE = {"fashion": (0.2860, 0.3530), "mnist": (0.1307, 0.3081)}
SMOKE_SIZES = {"train": 2048, "test": 1024}


class DatasetNotFound(FileNotFoundError):
    """Raised when no place holds the dataset and downloading failed too."""


class CorruptFile(ValueError):
    """A file ``helpers`` reads is damaged or is not what its name says; the message names it and the fix."""


def _idx_name(split: str, what: str) -> str:
    prefix = "train" if split == "train" else "t10k"
    return f"{prefix}-{what}-idx{3 if what == 'images' else 1}-ubyte"


def _candidates(name: str, root: str | os.PathLike | None) -> list[Path]:
    places: list[Path] = []
    for base in (root, os.environ.get(DATA_ENV), PROJECT_DATA):
        if base:
            base = Path(base).expanduser()
            places += [base, base / TORCHVISION_DIRS[name] / "raw"]
    if name in DEBIAN_DIRS:
        places.append(DEBIAN_DIRS[name])
    return places


def _has_files(folder: Path) -> bool:
    return all(
        (folder / _idx_name(split, what)).exists() or (folder / (_idx_name(split, what) + ".gz")).exists()
        for split in ("train", "test")
        for what in ("images", "labels")
    )


def find_dataset(name: str = "fashion", root: str | os.PathLike | None = None, download: bool = True) -> Path:
    """Folder holding the four IDX files of ``name`` ('fashion' or 'mnist').

    Looks in: ``root``; $MULTIGPU_DATA; the project's ``data/``; Debian's
    /usr/share/datasets/fashion-mnist; then downloads with torchvision into
    the first writable of those. Raises DatasetNotFound listing every place.

    Machinery behind data.get_datasets; no notebook calls it directly.
    """
    if name not in TORCHVISION_DIRS:
        raise ValueError(f"dataset must be one of {sorted(TORCHVISION_DIRS)}, got {name!r}")
    places = _candidates(name, root)
    for folder in places:
        if _has_files(folder):
            return folder
    tried = "\n".join(f"  - {p}" for p in places)
    error = ""
    if download:
        target = Path(root or os.environ.get(DATA_ENV) or PROJECT_DATA).expanduser()
        try:
            return _download(name, target)
        except Exception as e:  # any download failure becomes part of the one message below
            error = f"\nDownloading into {target} failed: {type(e).__name__}: {e}"
    raise DatasetNotFound(
        f"{name} IDX files not found. Looked in:\n{tried}{error}\n"
        f"Fix: put train/t10k images/labels IDX files (.gz or raw) in one of these, "
        f"set {DATA_ENV}=/path/to/folder, or (Debian/Ubuntu) `sudo apt install dataset-fashion-mnist`."
    )


def _download(name: str, target: Path) -> Path:
    from torchvision import datasets

    cls = datasets.FashionMNIST if name == "fashion" else datasets.MNIST
    for train in (True, False):
        cls(str(target), train=train, download=True)
    folder = target / TORCHVISION_DIRS[name] / "raw"
    if not _has_files(folder):
        raise DatasetNotFound(f"torchvision's download left no IDX files in {folder}")
    return folder


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (``.gz`` or raw) into a numpy array of its shape.

    Machinery behind data.get_datasets; no notebook calls it directly.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    fix = "Fix: delete it (and its siblings) and let helpers.data download a fresh copy, or copy it again."
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # bad header, cut short, damaged stream
        raise CorruptFile(f"{path} is not a readable gzip file ({type(e).__name__}: {e}). {fix}") from e
    except IsADirectoryError as e:
        raise CorruptFile(f"{path} is a folder, not an IDX file") from e
    if not data:
        raise CorruptFile(f"{path} is empty. {fix}")
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise CorruptFile(f"{path} is not an unsigned-byte IDX file (magic {data[:4].hex()}, expected "
                          f"000008xx). {fix}")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise CorruptFile(f"{path} ends inside its IDX header ({len(data)} bytes). {fix}")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != math.prod(shape):
        raise CorruptFile(f"{path}: IDX header says {shape} ({math.prod(shape)} bytes), body has {body.size} "
                          f"bytes: the file is cut short or padded. {fix}")
    return body.reshape(shape)


def _read(folder: Path, split: str, what: str) -> np.ndarray:
    raw = folder / _idx_name(split, what)
    return read_idx(raw if raw.exists() else raw.with_name(raw.name + ".gz"))


def load_split(
    name: str = "fashion", split: str = "train", root=None, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as normalised float32 (N, 1, 28, 28) and labels as int64 (N,).

    ``limit`` keeps the first N examples (smoke mode uses this).
    Introduced in notebooks/12-data-loading.ipynb.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None:
        positive_int("limit", limit)
    folder = find_dataset(name, root)
    images, labels = _read(folder, split, "images"), _read(folder, split, "labels")
    if images.ndim != 3 or labels.ndim != 1:
        raise CorruptFile(f"{folder}: the {split} files hold arrays of shape {images.shape} (images) and "
                          f"{labels.shape} (labels); expected (N, H, W) and (N,): are two files swapped?")
    if len(images) != len(labels):
        raise CorruptFile(f"{folder}: {len(images)} {split} images but {len(labels)} labels")
    if images.shape[1:] != (28, 28):
        raise CorruptFile(f"{folder}: the {split} images are {images.shape[1]}x{images.shape[2]} pixels; MNIST and "
                          "Fashion-MNIST are 28x28, which the course's models expect. Is this another data set?")
    if labels.size and labels.max() >= 10:
        bad = int((labels >= 10).sum())
        # caught here: on a GPU an out-of-range label fails inside the loss kernel ("device-side assert"), which
        # leaves that process's CUDA context unusable until it restarts
        raise CorruptFile(f"{folder}: {bad} {split} label(s) outside 0-9 (largest {int(labels.max())}): the labels "
                          "file is damaged or belongs to another data set")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    mean, std = NORMALIZE[name]
    x = (torch.from_numpy(images.copy()).float().div_(255).sub_(mean).div_(std)).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def get_datasets(name: str = "fashion", root=None, smoke: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """Train and test TensorDatasets; ``smoke`` keeps a small prefix of each.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    sizes = SMOKE_SIZES if smoke else {"train": None, "test": None}
    return tuple(TensorDataset(*load_split(name, s, root, sizes[s])) for s in ("train", "test"))


def make_loader(dataset, batch_size: int = 100, shuffle: bool = True, num_workers: int = 0,
                pin_memory: bool = False, sampler=None, seed: int = 0, *, persistent_workers: bool | None = None,
                prefetch_factor: int | None = None) -> DataLoader:
    """A standard DataLoader, seeded so that runs repeat.

    ``persistent_workers`` defaults to keeping workers between epochs when
    there are any; it and ``prefetch_factor`` are ignored without workers
    (DataLoader refuses them then).
    Introduced in notebooks/01-single-gpu.ipynb.
    """
    positive_int("batch_size", batch_size)
    positive_int("num_workers", num_workers, minimum=0)
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": True if persistent_workers is None else persistent_workers,
                 "prefetch_factor": prefetch_factor or 2}
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False,
                      sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, generator=gen, **extra)


class DeviceLoader:
    """The whole split as one tensor on ``device``; yields shuffled index batches.

    No worker processes, no per-item Python, no host-to-device copies per
    step: on a GPU this keeps the GPU busy where a DataLoader cannot.
    ``set_epoch`` reshuffles like DistributedSampler does.
    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, dataset_or_tensors, batch_size: int, device="cpu", shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0):
        positive_int("batch_size", batch_size)
        x, y = dataset_or_tensors.tensors if isinstance(dataset_or_tensors, TensorDataset) else dataset_or_tensors
        self.device = torch.device(device)
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.batch_size, self.shuffle, self.drop_last, self.seed = batch_size, shuffle, drop_last, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next pass with seed + epoch, as DistributedSampler.set_epoch does."""
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        n = len(self.x)
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).to(self.device)
        else:
            order = torch.arange(n, device=self.device)
        self.epoch += 1  # a fresh order next time, unless set_epoch says otherwise
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]
