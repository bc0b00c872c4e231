import ipywidgets as w
import pytest

from helpers.widgets import ExperimentPanel


def test_panel_runs_with_control_values_and_overrides():
    panel = ExperimentPanel("t", {"a": w.IntSlider(value=2), "b": w.Text(value="x")}, lambda a, b: a * b)
    assert panel.run() == "xx"
    assert panel.run(a=3) == "xxx"
    assert [values["a"] for values, _ in panel.history] == [2, 3]
    assert panel.controls["a"].description == "a"
    assert not panel.button.disabled and panel.status.value == "done"


def test_panel_errors_raise_from_code_and_are_shown_on_click():
    def broken(a):
        raise RuntimeError("bad setting")
    panel = ExperimentPanel("t", {"a": w.IntSlider()}, broken)
    with pytest.raises(RuntimeError, match="bad setting"):
        panel.run()
    assert "RuntimeError" in panel.status.value and not panel.button.disabled
    panel.button.click()  # must not raise
    assert "RuntimeError" in panel.status.value
    with pytest.raises(ValueError, match="no control"):
        panel.run(c=1)
