import sys
import threading
import time

import ipywidgets as w
import pytest
import torch
from torch.utils.data import TensorDataset

import helpers
from conftest import wait_until
from helpers import data, models, train
from helpers.widgets import ExperimentPanel, Run, run_labels


STEPPED = threading.Event()  # set by slow_run after its first step


def slow_run(a, stop):
    """Steps until stopped (at most 30 s), like fit checking its event between steps."""
    done = []
    for step in range(3000):
        if stop.is_set():
            raise helpers.Stopped(f"stopped after {step} steps", partial=done)
        done.append((step, float(a)))
        STEPPED.set()
        time.sleep(0.01)
    return done


def once_stepping(action):
    """Calls action (a Stop click, ■) from another thread once slow_run has taken a step, however slow the machine."""
    STEPPED.clear()

    def go():
        if STEPPED.wait(60):
            action()
    threading.Thread(target=go, daemon=True).start()


def test_a_stopped_run_whose_partial_is_not_a_result_is_not_drawn():
    """launch's own Stopped carries the ranks' events ({rank: ...}), not run_fn's result: found in 08 by the browser
    test, where compare(partial) raised KeyError and left the panel saying "stopping…" for good."""
    def stopped_by_launch(a, stop):
        raise helpers.Stopped("stopped on request", partial={0: {"step": 3}, 1: {"step": 3}})
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, lambda a, stop: [(0, 1.0), (1, 0.5)],
                            compare=lambda result: result)
    panel.run()
    panel.run_fn = stopped_by_launch
    panel.button.click()
    assert panel.wait(10)
    assert panel.status.value.startswith("<b>stopped</b>") and "drawn below" not in panel.status.value
    assert [r.stopped for r in panel.runs] == [False], "the finished run is kept, the unfit partial is not"
    assert not panel.button.disabled
    with pytest.raises(helpers.Stopped):
        panel.run()
    assert len(panel.runs) == 1


def test_panel_runs_with_control_values_and_overrides():
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=2), "b": w.Text(value="x")}, lambda a, b: a * b)
    assert panel.run() == "xx"
    assert panel.run(a=3) == "xxx"
    assert [values["a"] for values, _ in panel.history] == [2, 3]
    assert panel.controls["a"].description == "a"
    assert not panel.button.disabled and panel.status.value.startswith("done")
    assert panel.stop_button.disabled, "nothing to stop between runs"


def test_panel_errors_raise_from_code_and_are_shown_on_click():
    def broken(a):
        raise RuntimeError("bad setting")
    panel = ExperimentPanel("t", {"a": w.IntSlider()}, broken)
    with pytest.raises(RuntimeError, match="bad setting"):
        panel.run()
    assert "RuntimeError" in panel.status.value and not panel.button.disabled
    panel.button.click()  # must not raise
    assert panel.wait(10)
    assert "RuntimeError" in panel.status.value and not panel.button.disabled
    with pytest.raises(ValueError, match="no control"):
        panel.run(c=1)


def test_a_click_runs_in_the_panels_thread_and_stop_ends_it():
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, slow_run, compare=lambda points: points)
    STEPPED.clear()
    panel.button.click()  # returns at once: the click's handler must stay free to hear Stop
    assert panel.running and panel.button.disabled and not panel.stop_button.disabled
    assert STEPPED.wait(60), "the run never took a step"
    start = time.monotonic()
    panel.stop_button.click()
    assert panel.wait(20) and time.monotonic() - start < 10, "Stop must end the run within seconds"
    assert "stopped" in panel.status.value and "drawn below" in panel.status.value
    (run,) = panel.runs
    assert run.stopped and 0 < len(run.result) < 3000, "the partial result is kept"
    assert panel.history == [], "a stopped run is not a finished one"
    assert bytes(panel.plot.value).startswith(b"\x89PNG") and panel.plot.layout.display == ""
    assert not panel.button.disabled and panel.stop_button.disabled
    # Run works again, and the next run gets a fresh (unset) stop event
    panel.controls["a"].value = 2
    STEPPED.clear()
    panel.button.click()
    assert panel.running and STEPPED.wait(60), "a stop event left set would end the run before its first step"
    panel.stop()
    assert panel.wait(20) and [r.values["a"] for r in panel.runs] == [1, 2]


def test_stop_reaches_a_run_started_from_code():
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, slow_run)
    once_stepping(panel.stop_button.click)  # a click arrives on another thread (a subshell)
    start = time.monotonic()
    with pytest.raises(helpers.Stopped, match="stopped after"):
        panel.run()
    assert time.monotonic() - start < 10 and "stopped" in panel.status.value and not panel.running


def test_one_run_at_a_time():
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, slow_run)
    panel.button.click()
    with pytest.raises(RuntimeError, match="already running"):
        panel.run()
    panel.button.click()  # a second click while running says so and starts nothing
    assert "already running" in panel.status.value
    panel.stop()
    assert panel.wait(5) and len(panel.runs) == 1


def test_a_run_without_a_stop_parameter_says_it_cannot_be_stopped():
    gate = threading.Event()
    panel = ExperimentPanel("t", {"a": w.IntSlider()}, lambda a: gate.wait(5))
    panel.button.click()
    assert panel.stop_button.disabled and "cannot be stopped" in panel.status.value
    gate.set()
    assert panel.wait(5) and panel.status.value.startswith("done")


def test_what_a_clicked_run_prints_or_displays_lands_in_its_panel_and_nothing_else_does(monkeypatch):
    """In a kernel, a clicked run's thread writes into the panel's outputs; other threads write as before."""
    class Stream:
        def __init__(self):
            self.text = ""

        def write(self, text):
            self.text += text
            return len(text)

    class Publisher:
        def __init__(self):
            self.shown = []

        def publish(self, data, metadata=None, **kwargs):
            self.shown.append(data)

        def clear_output(self, wait=False):
            self.shown.append("cleared")

    class Shell:
        display_pub = Publisher()

    shell, out, err = Shell(), Stream(), Stream()
    monkeypatch.setattr("IPython.get_ipython", lambda: shell)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    gate = threading.Event()

    def chatty(a):
        print("step", a)
        print("done")
        shell.display_pub.publish({"text/plain": "a figure"})
        gate.wait(5)

    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, chatty)
    panel.button.click()
    wait_until(lambda: len(panel.output.outputs) == 2, 30, "both outputs")
    print("a cell's line, meanwhile")
    shell.display_pub.publish({"text/plain": "a cell's figure"})
    gate.set()
    assert panel.wait(5)
    assert panel.output.outputs == ({"output_type": "stream", "name": "stdout", "text": "step 1\ndone\n"},
                                    {"output_type": "display_data", "data": {"text/plain": "a figure"},
                                     "metadata": {}})
    assert out.text == "a cell's line, meanwhile\n" and shell.display_pub.shown == [{"text/plain": "a cell's figure"}]
    panel.button.click()
    assert panel.wait(5) and len(panel.output.outputs) == 2, "each click starts with an empty output area"


def test_runs_are_overlaid_labelled_by_what_differs_and_cleared():
    panel = ExperimentPanel("t", {"lr": w.FloatText(value=0.1), "bs": w.IntText(value=8)},
                            lambda lr, bs: [(0, lr), (1, lr / 2)], compare=lambda points: points)
    assert panel.clear_button.disabled and panel.plot.layout.display == "none"
    panel.run()
    panel.run(lr=0.2)
    panel.run(lr=0.2)
    assert run_labels(panel.runs) == ["lr=0.1", "lr=0.2 (run 2)", "lr=0.2 (run 3)"]
    assert bytes(panel.plot.value).startswith(b"\x89PNG") and not panel.clear_button.disabled
    panel.clear_button.click()
    assert panel.runs == [] and panel.plot.layout.display == "none" and panel.clear_button.disabled


def test_run_labels():
    assert run_labels([Run({"a": 1, "b": 2}, None)]) == ["run 1"]
    assert run_labels([Run({"a": 1, "b": 2}, None), Run({"a": 1, "b": 3}, None, stopped=True)]) == \
        ["b=2", "b=3 (stopped)"]
    assert run_labels([]) == []


def test_a_panel_stops_real_training_between_steps():
    g = torch.Generator().manual_seed(0)
    tiny = TensorDataset(torch.randn(512, 1, 28, 28, generator=g), torch.randint(0, 10, (512,), generator=g))

    def fit_run(epochs, stop):
        torch.manual_seed(0)
        model = models.ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = data.DeviceLoader(tiny, 16, "cpu")
        return train.fit(model, loader, data.DeviceLoader(tiny, 256, "cpu", shuffle=False), opt, "cpu",
                         epochs, progress=False, stop=stop)

    panel = ExperimentPanel("t", {"epochs": w.IntText(value=1000)}, fit_run,
                            compare=lambda rows: [(r["epoch"], r["test_loss"]) for r in rows])
    panel.button.click()
    wait_until(lambda: panel.status.value.startswith("running"), 30, "the run to start")
    time.sleep(1.0)
    start = time.monotonic()
    panel.stop()
    assert panel.wait(30), f"Stop must end training: {panel.status.value}"
    assert time.monotonic() - start < 20, f"Stop took {time.monotonic() - start:.1f} s: {panel.status.value}"
    assert len(panel.runs) == 1, f"{panel.runs}, {panel.status.value}"
    (run,) = panel.runs
    assert run.stopped and isinstance(run.result, list) and "stopped" in panel.status.value, panel.status.value
    assert all(len(r["step_losses"]) == 32 for r in run.result)
    rows = panel.run(epochs=1)
    assert len(rows) == 1 and len(panel.runs) == 2


def test_interrupting_the_cell_that_runs_panel_run_works_and_leaves_the_panel_ready():
    import _thread

    panel = ExperimentPanel("t", {"a": w.IntSlider(value=1)}, slow_run)
    once_stepping(_thread.interrupt_main)  # what ■ does to the cell: SIGINT → KeyboardInterrupt
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        panel.run()
    assert time.monotonic() - start < 10 and "KeyboardInterrupt" in panel.status.value
    assert not panel.running and not panel.button.disabled and panel.stop_button.disabled
    once_stepping(panel.stop)
    with pytest.raises(helpers.Stopped):
        panel.run()  # and the next run starts


def test_a_result_that_compare_cannot_draw_is_an_error_and_the_panel_stays_usable():
    results = iter([[(0, 1.0)], "not points", [(0, 2.0)]])
    panel = ExperimentPanel("t", {"a": w.IntSlider()}, lambda a: next(results), compare=lambda points: points)
    panel.run()
    with pytest.raises(TypeError, match="compare could not turn"):
        panel.run()
    assert "TypeError" in panel.status.value and not panel.running and not panel.button.disabled
    assert len(panel.runs) == 1, "the run that cannot be drawn is not kept, so later plots still draw"
    panel.button.click()  # the next click runs, and its run is kept and drawn
    assert panel.wait(20) and len(panel.runs) == 2 and panel.status.value.startswith("done")


def test_the_comparison_title_counts_what_it_draws():
    from helpers.widgets import compare_title

    assert compare_title({"a": [(1, 2.0)], "b": [(1, 1.5)]}) == "2 run(s) compared"
    # a run stopped inside its first epoch is kept but has no point yet: the title must not count it as drawn
    assert compare_title({"a": [(1, 2.0)], "b (stopped)": []}) == "1 run(s) compared; 1 stopped before a first point"
