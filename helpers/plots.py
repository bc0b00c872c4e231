"""Matplotlib figures the notebooks show; the notebook (parent) draws them all."""

from __future__ import annotations

import io
import time

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator


def plot_history(history: list[dict], title: str = "", ax=None):
    """Train loss and test accuracy per epoch from ``fit``'s history.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    epochs = [r["epoch"] for r in history]
    ax.plot(epochs, [r["train_loss"] for r in history], "o-", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    acc = ax.twinx()
    acc.plot(epochs, [r["test_acc"] for r in history], "s--", color="tab:orange", label="test accuracy")
    acc.set_ylabel("test accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # after twinx, which shares this axis
    ax.set_title(title)
    ax.figure.legend(loc="lower center", ncol=2, fontsize="small")
    ax.figure.tight_layout(rect=(0, 0.08, 1, 1))
    return ax


def plot_bars(values: dict[str, float], ylabel: str, title: str = "", ax=None):
    """One labelled bar per entry, value written on top (throughputs, times).

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    names, heights = list(values), list(values.values())
    bars = ax.bar(names, heights, color=plt.cm.tab10.colors[: len(names)])
    ax.bar_label(bars, fmt="%.0f")
    ax.margins(y=0.12)  # room for the labels
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


def plot_curves(curves: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
                title: str = "", ax=None):
    """One line per named series of (x, y) points: loss curves of several runs, say.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if curves:
        ax.legend(fontsize="small")
    ax.figure.tight_layout()
    return ax


class LivePlot:
    """A loss-per-step plot that ranks' reports redraw in place (pass it as ``on_event``).

    Ranks cannot draw; the notebook receives their ``report(step=..., loss=...)``
    and this object redraws at most every ``every`` seconds, then once at the end
    (call ``finish()``). It draws into an ``ipywidgets.Image``, because a widget
    updates inside a panel's output area where IPython's display handles do not
    (ipywidgets issue 1844).
    Introduced in notebooks/03-ddp-fork.ipynb.
    """

    def __init__(self, key: str = "loss", title: str = "", every: float = 0.5, ranks=None):
        self.key, self.title, self.every, self.ranks = key, title, every, ranks
        self.points: dict[str, list] = {}
        self.image = None
        self.last_draw = 0.0

    def __call__(self, rank: int, metrics: dict) -> None:
        if self.key not in metrics or (self.ranks is not None and rank not in self.ranks):
            return
        series = self.points.setdefault(f"rank {rank}", [])
        series.append((metrics.get("step", len(series)), metrics[self.key]))
        if time.monotonic() - self.last_draw > self.every:
            self.draw()

    def draw(self) -> None:
        import ipywidgets
        from IPython.display import display

        fig, ax = plt.subplots(figsize=(6, 3.2))
        plot_curves(dict(sorted(self.points.items())), "step", self.key, self.title, ax=ax)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        plt.close(fig)
        if self.image is None:
            self.image = ipywidgets.Image(format="png")
            display(self.image)
        self.image.value = png.getvalue()
        self.last_draw = time.monotonic()

    def finish(self) -> dict:
        self.draw()
        return dict(self.points)
