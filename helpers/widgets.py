"""Experiment panels: controls → Run → a run draws into the panel; Stop ends it; runs are kept and overlaid.

A click's handler runs in the kernel, and the kernel hears no other click until
it returns (measured in JupyterLab 4.6 with ipykernel 7.4: a second click waited
for the first). Some setups handle clicks in a subshell thread, where the
notebook's interrupt ■ never arrives. So a click on Run starts the run in a
thread the panel owns and returns at once: the kernel stays free to hear Stop,
and ■ does not stop a clicked run, Stop does. Stop sets a ``threading.Event``
that the panel passes to ``run_fn`` as ``stop`` when ``run_fn`` has a parameter
of that name; ``run_fn`` hands it to ``launch(..., stop=stop)``, which kills
every rank, or ``train.fit(..., stop=stop)``, which ends between steps. Both
raise ``helpers.Stopped``; the panel shows "stopped", keeps what was done, and
Run works again. A ``run_fn`` without ``stop`` cannot be stopped (the panel
says so). What the run's thread prints or displays goes to the panel.

``panel.run(**overrides)`` from code is an ordinary synchronous call: it runs in
the calling cell, prints there, returns ``run_fn``'s result and raises its errors
(CI uses it); ■ interrupts it as any cell, and Stop works there too.
"""

from __future__ import annotations

import inspect
import threading
import time
import traceback
from dataclasses import dataclass

import ipywidgets as w
from IPython.display import display

from . import Stopped
from ._output import routed_to


@dataclass
class Run:
    """One run of a panel: the controls' values, what came back, whether Stop ended it, seconds taken."""

    values: dict
    result: object
    stopped: bool = False
    seconds: float = 0.0


def compare_title(curves: dict[str, list]) -> str:
    """The comparison plot's title: the runs drawn, and those kept but stopped before their first point.

    Machinery behind the panels' plots; no notebook calls it directly.
    """
    empty = sum(not points for points in curves.values())  # stopped inside its first epoch, say: nothing to draw
    return f"{len(curves) - empty} run(s) compared" + (f"; {empty} stopped before a first point" if empty else "")


def run_labels(runs: list[Run]) -> list[str]:
    """A label per run naming only the settings that differ between the runs (``run N`` when none do).

    Machinery behind ExperimentPanel; no notebook calls it directly.
    """
    keys = [k for k in (runs[0].values if runs else {}) if len({repr(r.values.get(k)) for r in runs}) > 1]
    labels = [", ".join(f"{k}={r.values.get(k)}" for k in keys) or f"run {i + 1}" for i, r in enumerate(runs)]
    labels = [f"{label} (run {i + 1})" if labels.count(label) > 1 else label for i, label in enumerate(labels)]
    return [label + (" (stopped)" if r.stopped else "") for label, r in zip(labels, runs)]


class ExperimentPanel:
    """Controls, Run and Stop buttons, an output area, and (with ``compare``) every run overlaid in one plot.

    ``run_fn(**values)`` receives each control's value by name, plus ``stop`` (a
    ``threading.Event``) when its signature has that parameter. ``compare``, if
    given, maps a result to a list of (x, y) points; every kept run is drawn as
    one line labelled by the settings that differ, and Clear forgets them. A
    stopped run is drawn too when its ``Stopped.partial`` has the result's shape.
    ``panel.run(**overrides)`` runs synchronously from code; a click runs in a
    thread the panel owns (see the module docstring for why).
    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, title: str, controls: dict[str, w.Widget], run_fn, note: str = "", compare=None,
                 compare_axes: tuple[str, str] = ("step", "loss")):
        self.controls, self.run_fn, self.compare, self.compare_axes = controls, run_fn, compare, compare_axes
        self.runs: list[Run] = []
        self.takes_stop = "stop" in inspect.signature(run_fn).parameters
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="end the run between steps" if self.takes_stop else
                                    "this panel's run function takes no stop event")
        self.clear_button = w.Button(description="Clear runs", icon="trash", disabled=True,
                                     layout=w.Layout(display="" if compare else "none"))
        self.status = w.HTML()
        self.output = w.Output()
        self.plot = w.Image(format="png", layout=w.Layout(display="none", max_width="560px"))
        self.button.on_click(self._on_run)
        self.stop_button.on_click(lambda _button: self.stop())
        self.clear_button.on_click(lambda _button: self.clear())
        header = f"<b>{title}</b>" + (f"<br><small>{note}</small>" if note else "")
        for name, control in controls.items():
            if not control.description:
                control.description = name
            control.style = {"description_width": "initial"}
        self.widget = w.VBox([w.HTML(header), w.HBox(list(controls.values()), layout=w.Layout(flex_flow="row wrap")),
                              w.HBox([self.button, self.stop_button, self.clear_button, self.status]),
                              self.output, self.plot])
        parts = ((self.widget, ""), (self.status, "-status"), (self.button, "-run"), (self.stop_button, "-stop"))
        for widget, css in parts:
            widget.add_class("experiment-panel" + css)  # the browser test finds panels and their parts by class

    @property
    def history(self) -> list[tuple[dict, object]]:
        """(values, result) of every run that finished, oldest first (stopped runs are in ``runs``)."""
        return [(r.values, r.result) for r in self.runs if not r.stopped]

    @property
    def running(self) -> bool:
        return self._busy

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def run(self, **overrides):
        """Run once with the controls' values and ``overrides``, here and now; return the result."""
        values = self._values(overrides)
        self._begin()
        return self._execute(values)

    def stop(self) -> None:
        """Ask the current run to stop (what the Stop button does)."""
        if self._busy:
            self._stop.set()
            self.status.value = "stopping…"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a clicked run to end; True when the panel is idle."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self._busy

    def _values(self, overrides: dict) -> dict:
        unknown = set(overrides) - set(self.controls)
        if unknown:
            raise ValueError(f"no control named {sorted(unknown)}; controls are {sorted(self.controls)}")
        return {**self.values(), **overrides}

    def _begin(self) -> None:
        with self._lock:
            if self._busy:
                raise RuntimeError("this panel is already running: press Stop, or wait for the run to end")
            self._stop.clear()  # before _busy: a Stop that comes once the run counts as busy is never lost
            self._busy = True
        try:
            self.button.disabled = self.clear_button.disabled = True
            self.stop_button.disabled = not self.takes_stop
            self.status.value = "running… (Stop ends it)" if self.takes_stop else \
                "running… (this panel's run cannot be stopped: its function takes no <code>stop</code>)"
        except BaseException:  # ■ while the widgets update: the panel must not stay "running" for good
            self._busy = False
            self.button.disabled = False
            raise

    def _execute(self, values: dict, show_errors: bool = False):
        """Run, keep and draw the result, set the status; only then is the panel free for the next Run.

        ``show_errors`` (a click's run, which has no cell to raise into): print a stop or an error where the
        run draws, before the panel is free, instead of raising it.
        """
        start = time.perf_counter()
        try:
            kwargs = {**values, "stop": self._stop} if self.takes_stop else values
            result = self.run_fn(**kwargs)
            seconds = time.perf_counter() - start
            if self.compare is not None and self._points(result) is None:
                raise TypeError(f"compare could not turn this run's result into (x, y) points: {str(result)[:100]}")
            self._keep(Run(values, result, False, seconds))
            self.status.value = f"done in {seconds:.1f} s"
            return result
        except Stopped as e:
            seconds = time.perf_counter() - start
            points = self._points(e.partial)
            if e.partial is not None and (self.compare is None or points is not None):
                self._keep(Run(values, e.partial, True, seconds))
            drawn = bool(points)
            self.status.value = f"<b>stopped</b> after {seconds:.1f} s: {e}" + (
                "; what was done so far is drawn below" if drawn else "")
            if not show_errors:
                raise
            print(f"stopped: {e}")
        except BaseException as e:
            self.status.value = f"<span style='color:#b00'>{type(e).__name__}: {str(e)[:200]}</span>"
            if not show_errors or not isinstance(e, Exception):
                raise
            traceback.print_exc()
        finally:
            try:
                self.button.disabled = False
                self.stop_button.disabled = True
                self.clear_button.disabled = not self.runs
            finally:
                self._busy = False  # last, and whatever happened above: the panel is free again

    def _points(self, partial) -> list[tuple[float, float]] | None:
        """A stopped run's partial result as ``compare`` points, or None when it is not shaped as a result.

        ``launch``'s own ``Stopped`` carries the ranks' last events, not the
        run function's result; such a partial is not kept, so it cannot break
        the plot of the runs that are.
        """
        if partial is None or self.compare is None:
            return None
        try:
            return [(float(x), float(y)) for x, y in self.compare(partial)]
        except Exception:  # noqa: BLE001 - any failure means "not this panel's result"
            return None

    def _keep(self, run: Run) -> None:
        self.runs.append(run)
        self.clear_button.disabled = False
        self.draw()

    def draw(self) -> None:
        """Redraw the comparison: one line per kept run (hidden when there is none or no ``compare``)."""
        if self.compare is None or not self.runs:
            self.plot.layout.display = "none"
            return
        from matplotlib.figure import Figure  # not pyplot: safe from the panel's thread, and never auto-shown

        from .plots import figure_png, plot_curves

        curves = {label: list(self.compare(r.result)) for label, r in zip(run_labels(self.runs), self.runs)}
        ax = Figure(figsize=(6.5, 3.2)).add_subplot()
        plot_curves(curves, *self.compare_axes, title=compare_title(curves), ax=ax)
        self.plot.value = figure_png(ax.figure)
        self.plot.layout.display = ""

    def _on_run(self, _button) -> None:
        try:
            values = self._values({})
            self._begin()
        except RuntimeError as e:
            self.status.value = str(e)
            return
        self.output.outputs = ()
        self._thread = threading.Thread(target=self._run_in_panel, args=(values,), name="panel-run", daemon=True)
        self._thread.start()

    def _run_in_panel(self, values: dict) -> None:
        with routed_to(self.output):
            self._execute(values, show_errors=True)

    def clear(self) -> None:
        """Forget the kept runs (what the Clear runs button does)."""
        self.runs.clear()
        self.clear_button.disabled = True
        self.draw()

    def _ipython_display_(self) -> None:
        display(self.widget)
