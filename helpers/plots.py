"""Matplotlib figures the notebooks show; the notebook (parent) draws them all."""

from __future__ import annotations

import io
import time

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def step_curve(history: list[dict], points_per_epoch: int = 20) -> list[tuple[float, float]]:
    """Training loss against epochs (fractional) from ``fit``'s per-step losses, averaged into bins.

    Averaging ``points_per_epoch`` bins per epoch makes runs with different batch
    sizes comparable on one axis and keeps small batches' noise readable.
    Introduced in notebooks/01-single-gpu.ipynb.
    """
    points = []
    for row in history:
        losses = row["step_losses"]
        bins = max(1, min(points_per_epoch, len(losses)))
        for b in range(bins):
            chunk = losses[b * len(losses) // bins:(b + 1) * len(losses) // bins]
            points.append((row["epoch"] - 1 + (b + 1) / bins, sum(chunk) / len(chunk)))
    return points


def plot_history(history: list[dict], title: str = "", ax=None):
    """Training loss (per step when ``fit`` recorded it, else per epoch) and test accuracy per epoch.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    epochs = [r["epoch"] for r in history]
    if all("step_losses" in r for r in history):  # a one-epoch run is then a curve, not one point
        xs, ys = zip(*step_curve(history))
        ax.plot((0, *xs), (history[0]["step_losses"][0], *ys), "-", label="train loss")
        ax.set_xlim(0, max(epochs))
    else:
        ax.plot(epochs, [r["train_loss"] for r in history], "o-", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    acc = ax.twinx()
    accuracies = [r["test_acc"] for r in history]
    acc.plot(epochs, accuracies, "s--", color="tab:orange", label="test accuracy")
    # never matplotlib's ±5 % band around a single point
    acc.set_ylim(max(0.0, min(accuracies) - 0.1), min(1.0, max(accuracies) + 0.02))
    acc.set_ylabel("test accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # after twinx, which shares this axis
    ax.set_title(title)
    ax.figure.legend(loc="lower center", ncol=2, fontsize="small")
    ax.figure.tight_layout(rect=(0, 0.08, 1, 1))
    return ax


def plot_bars(values: dict[str, float], ylabel: str, title: str = "", ax=None, spread=None):
    """One labelled bar per entry, value written on top (throughputs, times); ``spread`` adds (low, high) whiskers.

    Introduced in notebooks/01-single-gpu.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    names, heights = list(values), list(values.values())
    yerr = None
    if spread is not None:  # whiskers from the bar's value down to the low and up to the high
        yerr = [[h - spread[n][0] for n, h in zip(names, heights)], [spread[n][1] - h for n, h in zip(names, heights)]]
    bars = ax.bar(names, heights, color=plt.cm.tab10.colors[: len(names)], yerr=yerr, capsize=4 if yerr else 0)
    ax.bar_label(bars, fmt="%.0f")
    ax.margins(y=0.12)  # room for the labels
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


def plot_curves(curves: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
                title: str = "", ax=None):
    """One line per named series of (x, y) points: the runs a panel compares, or 08's race to a test accuracy.

    Introduced in notebooks/08-large-batch.ipynb.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 3 else None, label=name)  # a run stopped early still shows
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.figure.tight_layout()
    if len(ax.lines) > 3:  # many runs: the legend goes below the axes, where it hides no line (laid out after
        # tight_layout, so the axes keep their size; figure_png saves the figure with the legend)
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), borderaxespad=0)
    elif ax.lines:
        ax.legend(fontsize="small")
    return ax


def figure_png(fig, dpi: int = 80) -> bytes:
    """A figure as PNG bytes, for an ``ipywidgets.Image`` (which, unlike display handles, updates in place).

    Machinery behind plots.LivePlot and widgets; no notebook calls it directly.
    """
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi, bbox_inches="tight")  # a legend below the axes stays in
    return png.getvalue()


class LivePlot:
    """A loss-per-step plot that ranks' reports redraw in place (pass it as ``on_event``).

    Ranks cannot draw; the notebook receives their ``report(step=..., loss=...)``
    and this object redraws at most every ``every`` seconds, then once at the end
    (call ``finish()``). It draws into an ``ipywidgets.Image``, because a widget
    updates inside a panel's output area where IPython's display handles do not
    (ipywidgets issue 1844).
    Introduced in notebooks/04-ddp.ipynb.
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

        ax = Figure(figsize=(6, 3.2)).add_subplot()  # not pyplot: a panel may draw this from its own thread
        plot_curves(dict(sorted(self.points.items())), "step", self.key, self.title, ax=ax)
        png = figure_png(ax.figure)
        if self.image is None:
            self.image = ipywidgets.Image(format="png")
            display(self.image)
        self.image.value = png
        self.last_draw = time.monotonic()

    def finish(self) -> dict:
        self.draw()
        return dict(self.points)
