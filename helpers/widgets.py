"""Experiment panels: controls → Run → the notebook draws the result.

A panel runs in the notebook (the parent); when its experiment launches
ranks, they report through a queue and the panel draws, since children cannot
touch widgets. Stop a run with the notebook's interrupt (■): a running
callback keeps the kernel busy, so no Stop button could be heard, and the
launcher turns the interrupt into a clean stop of every rank.
"""

from __future__ import annotations

import traceback

import ipywidgets as w
from IPython.display import clear_output, display


class ExperimentPanel:
    """Widgets for the knobs, a Run button, and an output area the run draws into.

    ``run_fn(**values)`` receives each control's current value by name and may
    print, plot or return a result; ``panel.run(**overrides)`` does the same
    from code (CI uses this) and re-raises errors, where a click shows them.
    Every run's values and result are kept in ``panel.history``.
    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, title: str, controls: dict[str, w.Widget], run_fn, note: str = ""):
        self.controls = controls
        self.run_fn = run_fn
        self.history: list[tuple[dict, object]] = []
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.status = w.HTML()
        self.output = w.Output()
        self.button.on_click(self._on_click)
        header = f"<b>{title}</b>" + (f"<br><small>{note}</small>" if note else "")
        for name, control in controls.items():
            if not control.description:
                control.description = name
            control.style = {"description_width": "initial"}
        self.widget = w.VBox([w.HTML(header), w.HBox(list(controls.values()), layout=w.Layout(flex_flow="row wrap")),
                              w.HBox([self.button, self.status]), self.output])

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def run(self, **overrides):
        values = {**self.values(), **overrides}
        unknown = set(overrides) - set(self.controls)
        if unknown:
            raise ValueError(f"no control named {sorted(unknown)}; controls are {sorted(self.controls)}")
        self.button.disabled = True
        self.status.value = "running… (interrupt the kernel ■ to stop)"
        try:
            with self.output:
                clear_output(wait=True)
                result = self.run_fn(**values)
            self.status.value = "done"
        except BaseException as e:
            self.status.value = f"<span style='color:#b00'>{type(e).__name__}</span>"
            raise
        finally:
            self.button.disabled = False
        self.history.append((values, result))
        return result

    def _on_click(self, _button) -> None:
        try:
            self.run()
        except Exception:  # a click has no cell to raise into: show the error where the run draws
            with self.output:
                traceback.print_exc()

    def _ipython_display_(self) -> None:
        display(self.widget)
