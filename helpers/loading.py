"""The DataLoader benchmark's machinery: a dataset with real per-item CPU work, and honest timing.

``AugmentedFashion`` decodes each Fashion-MNIST image to a PIL image and
augments it with torchvision's transforms v2, as image pipelines do: per item,
in Python, on the CPU. That work is what DataLoader workers parallelise.
``measure`` times one loader: samples/s, and per step the time spent waiting
for the next batch against the time spent computing on it; ``sweep`` repeats
that over settings. The DataLoaders themselves, the DDP rank with workers and
the timed step are written in notebooks/12-data-loading.ipynb; the step
(``forward_step``, at the end) is exported from there (``make export``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from . import Stopped, data
from .bench import alternating
from .checks import positive_int


def _raw_split(split: str, root=None) -> tuple[np.ndarray, np.ndarray]:
    """The split's images as uint8 (N, 28, 28) and labels, undecoded (the dataset does the work per item)."""
    folder = data.find_dataset("fashion", root)
    arrays = []
    for what in ("images", "labels"):
        path = folder / f"{'train' if split == 'train' else 't10k'}-{what}-idx{3 if what == 'images' else 1}-ubyte"
        arrays.append(data.read_idx(path if path.exists() else path.with_name(path.name + ".gz")))
    return arrays[0], arrays[1].astype(np.int64)


def augmentation(size: int = 28) -> v2.Compose:
    """Random resized crop and flip on the PIL image, then tensor, float and normalise (transforms v2).

    Introduced in notebooks/12-data-loading.ipynb.
    """
    mean, std = data.NORMALIZE["fashion"]
    return v2.Compose([v2.RandomResizedCrop(size, scale=(0.6, 1.0), antialias=True), v2.RandomHorizontalFlip(),
                       v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([mean], [std])])


class AugmentedFashion(Dataset):
    """Fashion-MNIST items made per request: uint8 array → PIL image → transforms v2 → normalised tensor.

    ``images``/``labels`` (uint8 (N, H, W) and int) replace the files, for tests.
    Introduced in notebooks/12-data-loading.ipynb.
    """

    def __init__(self, split: str = "train", limit: int | None = None, root=None, images=None, labels=None,
                 transform=None):
        if images is None:
            if split not in ("train", "test"):
                raise ValueError(f"split must be 'train' or 'test', got {split!r}")
            images, labels = _raw_split(split, root)
        if limit is not None:
            positive_int("limit", limit)
            images, labels = images[:limit], labels[:limit]
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = np.ascontiguousarray(images, dtype=np.uint8), np.asarray(labels)
        self.transform = transform or augmentation(self.images.shape[-1])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image = Image.fromarray(self.images[i], mode="L")  # the decode step a JPEG pipeline would do
        return self.transform(image), int(self.labels[i])


@dataclass(frozen=True)
class LoaderRun:
    """One timed pass: samples, seconds, and the seconds spent waiting for batches vs computing on them."""

    settings: dict
    samples: int
    steps: int
    seconds: float
    wait_s: float
    compute_s: float
    first_batch_s: float  # from asking for the first batch to having it: worker start-up included
    timeline: tuple = ()  # (seconds since start, samples done) after every step, for plots

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def wait_fraction(self) -> float:
        """Share of the time the step sat waiting for data (0: the loader keeps up)."""
        return self.wait_s / self.seconds if self.seconds > 0 else 0.0


def measure(loader, step=None, epochs: int = 1, max_batches: int | None = None, settings: dict | None = None,
            stop=None) -> LoaderRun:
    """Iterate ``loader`` for ``epochs`` (each cut at ``max_batches``), calling ``step(x, y)`` per batch.

    The clock runs from asking for the first batch, so worker start-up counts
    (once with persistent workers, every epoch without), as waiting: ``wait_s``
    holds starting, resuming and shutting down workers as well as ``next()``. ``stop`` (a
    threading.Event) ends the pass between batches with ``helpers.Stopped``.
    Introduced in notebooks/12-data-loading.ipynb.
    """
    positive_int("epochs", epochs)
    samples = steps = 0
    wait = compute = 0.0
    first = None
    timeline = []
    start = time.perf_counter()
    for _ in range(epochs):
        t0 = time.perf_counter()
        it = iter(loader)  # starts the workers (or, persistent, waits for them to resume): waiting for data too
        wait += time.perf_counter() - t0
        for b in range(len(loader) if max_batches is None else min(max_batches, len(loader))):
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped after {steps} batches", partial=None)
            t0 = time.perf_counter()
            x, y = next(it)
            t1 = time.perf_counter()
            if step is not None:
                step(x, y)
            t2 = time.perf_counter()
            first = t1 - start if first is None else first
            wait, compute = wait + t1 - t0, compute + t2 - t1
            samples, steps = samples + len(y), steps + 1
            timeline.append((t2 - start, samples))
        t0 = time.perf_counter()
        del it  # non-persistent workers shut down here, as at the end of a real epoch; the loop waits for that
        wait += time.perf_counter() - t0
    return LoaderRun(settings or {}, samples, steps, time.perf_counter() - start, wait, compute, first or 0.0,
                     tuple(timeline))


def sweep(make_loader, settings: list[dict], step=None, repeats: int = 3, warmup: int = 1, epochs: int = 1,
          max_batches: int | None = None, stop=None) -> list[dict]:
    """Measure ``make_loader(**setting)`` for each setting ``repeats`` times, rounds alternating; median and spread.

    ``make_loader`` builds a fresh loader from keywords (the notebook's own
    function around ``DataLoader``). Alternating the order keeps a drifting
    machine from favouring whichever setting runs first. Returns one dict per
    setting: the settings, ``median``, ``low`` and ``high`` samples/s,
    ``wait_fraction`` and ``first_batch_s`` (medians) and every run.
    Introduced in notebooks/12-data-loading.ipynb.
    """
    positive_int("repeats", repeats)
    runs: list[list[LoaderRun]] = [[] for _ in settings]

    def once(i):
        return measure(make_loader(**settings[i]), step, epochs, max_batches, settings[i], stop)

    for i in range(len(settings)):
        for _ in range(warmup):
            once(i)
    for i in alternating(list(range(len(settings))), repeats):
        runs[i].append(once(i))
    out = []
    for s, rs in zip(settings, runs):
        rates = sorted(run.samples_per_s for run in rs)
        out.append({"settings": s, "median": statistics.median(rates), "low": rates[0], "high": rates[-1],
                    "wait_fraction": statistics.median(run.wait_fraction for run in rs),
                    "first_batch_s": statistics.median(run.first_batch_s for run in rs), "runs": rs})
    return out


def best(results: list[dict]) -> dict:
    """The fastest setting by median samples/s.

    Introduced in notebooks/12-data-loading.ipynb.
    """
    if not results:
        raise ValueError("no results to choose from")
    return max(results, key=lambda r: r["median"])



def table(rows: list[dict]) -> None:
    """Print dicts as an aligned table: the keys as its header, one row per dict, large floats without decimals.

    Introduced in notebooks/12-data-loading.ipynb.
    """
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
        return str(v)

    lines = [[str(k) for k in keys]] + [[cell(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(keys))]
    for line in lines:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))


# ---- exported from notebooks/12-data-loading.ipynb: edit it there, then run `make export` ----
def forward_step(model, device="cpu"):
    """A step that copies the batch to ``device`` and runs ``model`` forward, without autograd.

    Introduced in notebooks/12-data-loading.ipynb.
    """
    model = model.to(device).eval()

    def step(x, y):
        x = x.to(device, non_blocking=True)  # asynchronous from pinned memory
        with torch.inference_mode():
            model(x)
        if torch.device(device).type == "cuda":  # CUDA calls return before the GPU is done: wait for it, or
            torch.cuda.synchronize(device)  # its work would count as the next batch's wait
    return step
# ---- end of export from notebooks/12-data-loading.ipynb ----
