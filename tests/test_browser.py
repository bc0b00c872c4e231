"""The course as a learner meets it: JupyterLab in a real browser, Run All, then the panels clicked.

Starts JupyterLab on 127.0.0.1 with a token on a temporary copy of notebooks/
(nothing it saves can touch the repository), drives Debian's chromium through
the ``playwright`` package (no browser download), and for every notebook: opens
it with ``?reset``, runs all cells, and fails on any error output. Where a
notebook has a panel (``PANELS``: 01, 03, 05, 08, 09) it then pushes a control
to its end, clicks Run, sees the progress move, clicks Stop mid-run (the rank
processes must be gone), sets the control to its start and runs again to the
end (drawn, no error, no process left).
Screenshots go to $BROWSER_ARTEFACTS (default .pytest_cache/browser/). The
notebooks run in smoke mode; BROWSER_SMOKE=0 runs them at full size. For a
learner's read, BROWSER_NOTEBOOKS=all BROWSER_PAGES=1 also pages through each
notebook a screen at a time (<name>-pNN.png) and keeps the executed notebook.
Skipped when no chromium or playwright is installed, unless $REQUIRE_BROWSER_TEST=1
(.ci/run sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARTEFACTS = Path(os.environ.get("BROWSER_ARTEFACTS", ROOT / ".pytest_cache" / "browser"))
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
# Which notebooks this test runs: "panels" (default: the notebooks with a panel, which only a browser can click;
# `make test` runs the others with nbmake), "all" (every notebook: the screenshots a learner-read needs), or names.
BROWSER_NOTEBOOKS = os.environ.get("BROWSER_NOTEBOOKS", "panels")
# Where to record each notebook that ran clean (tests/ran_in_browser.py), so that nbmake does not run it again.
RAN_CLEAN = os.environ.get("BROWSER_RAN_CLEAN")
# Smoke mode unless BROWSER_SMOKE=0: then the notebooks run at full size, as a learner runs them (slower).
BROWSER_SMOKE = os.environ.get("BROWSER_SMOKE", "1")
RUN_ALL_TIMEOUT = 300 if BROWSER_SMOKE != "0" else 900  # seconds per notebook; smoke: each well under 2 minutes
# BROWSER_PAGES=1: after Run All, screenshot the notebook a screen at a time (<name>-pNN.png) and keep the executed
# notebook as JupyterLab saved it (<name>): what a learner reads top to bottom, outputs included.
BROWSER_PAGES = os.environ.get("BROWSER_PAGES") == "1"


def _why_no_browser() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"no browser at {CHROMIUM}: apt-get install chromium (or set $CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed: pip install -e '.[dev]'"
    return None


def _skip_or_fail(reason: str):
    if os.environ.get("REQUIRE_BROWSER_TEST") == "1":
        pytest.fail(f"REQUIRE_BROWSER_TEST=1 but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on a copy of the notebooks, and the REST calls the test needs."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        shutil.copytree(ROOT / "notebooks", workdir / "notebooks")
        settings = workdir / "settings"
        self._write(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})  # no news pop-up over the notebook
        self._write(settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings", {"autosave": False})
        # every cell in the page, so that no error output hides in a cell scrolled out of view
        self._write(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"})
        self.token = os.urandom(16).hex()
        env = {**os.environ, "SMOKE_TEST": BROWSER_SMOKE, "JUPYTERLAB_SETTINGS_DIR": str(settings),
               "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"), "PYTHONUNBUFFERED": "1"}
        self.log = open(workdir / "jupyter.log", "w")
        for attempt in range(3):
            # the port is free now, but another program may take it before Lab binds it: with no port retries,
            # Lab then exits at once (instead of moving to a port this test would not know), and starts again
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1",
                   f"--port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={workdir}", f"--LabApp.workspaces_dir={workdir / 'workspaces'}"]
            if os.geteuid() == 0:
                cmd.append("--allow-root")  # containers often run as root; Jupyter refuses it otherwise
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT)
            if self._started(timeout=60):
                return
        raise RuntimeError(f"JupyterLab did not start in 3 tries; see {workdir / 'jupyter.log'}")

    def _started(self, timeout: float) -> bool:
        """True once Lab answers; False when it exited (its port was taken); an error after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api("status", timeout=5)  # short: on a taken port, another program may never answer
                return True
            except OSError:
                if self.proc.poll() is not None:
                    return False
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer in {timeout:g} s; see {self.workdir}/jupyter.log")
                time.sleep(0.3)

    @staticmethod
    def _write(path: Path, obj) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    def api(self, path: str, method: str = "GET", timeout: float = 60):  # a kernel's DELETE waits for it to exit
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children() if _alive_and(p, lambda p: any(
            "ipykernel" in part for part in p.cmdline()))]

    def shutdown_kernels(self) -> None:
        for kernel in self.api("kernels"):
            self.api(f"kernels/{kernel['id']}", method="DELETE")

    def stop(self) -> None:
        """Stop the server by its PID (and any kernel it leaves behind)."""
        leftovers = psutil.Process(self.proc.pid).children(recursive=True)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for p in leftovers:
            if p.is_running():
                p.kill()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _why_no_browser()
    if reason:
        _skip_or_fail(reason)
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []  # chromium's sandbox refuses root
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield chromium
        chromium.close()


def _shot(page, name: str) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"{name}.png"), full_page=False)


def _wait(condition, timeout: float, what: str, page=None, interval: float = 0.2):
    """wait_until, with a screenshot of the page when it times out."""
    shot = None if page is None else lambda: _shot(page, "timeout-" + re.sub(r"\W+", "-", what)[:60])
    return wait_until(condition, timeout, what, interval, shot)


def _prompts(page) -> list[str]:
    # text content, not inner text: a solution cell's collapsed input hides its prompt ("[*]:" included) from
    # inner text, and Run All would look finished while the solutions still run
    return page.locator(".jp-Notebook .jp-CodeCell .jp-InputPrompt").all_text_contents()


def _panel_errors(page) -> list[str]:
    """Tracebacks shown in a panel (a clicked run that failed prints its traceback there) or an error status."""
    texts = page.locator(".experiment-panel .jp-OutputArea-output").all_inner_texts()
    status = page.locator(".experiment-panel-status").all_inner_texts()
    return [t[:2000] for t in texts if "Traceback (most recent call last)" in t] + \
        [t for t in status if re.match(r"\w*(Error|Exception|Interrupt)\b", t)]


def _saved_errors(page, lab: Lab, name: str) -> list[str]:
    """Save the notebook from the browser (into the server's copy) and list its error outputs and unrun cells.

    Error outputs and stderr look alike on the page, and a notebook may print an
    error's text on purpose; the saved file says which outputs are errors.
    """
    path = lab.workdir / "notebooks" / name
    before = path.stat().st_mtime_ns
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    _wait(lambda: path.stat().st_mtime_ns != before, 30, f"{name} to be saved", page)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    problems = [f"cell {i}: {o['ename']}: {o['evalue']}\n" + "\n".join(o.get("traceback", []))[-1500:]
                for i, c in enumerate(cells) for o in c["outputs"] if o["output_type"] == "error"]
    return problems + [f"cell {i} did not run" for i, c in enumerate(cells)
                       if "".join(c["source"]).strip() and c.get("execution_count") is None]


def _page_through(page, name: str) -> None:
    """Screenshots from the notebook's top to its end, one screen each (JupyterLab scrolls its own panel)."""
    scroller = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
    scroller.evaluate("el => el.scrollTo(0, 0)")
    for i in range(200):
        page.wait_for_timeout(300)  # let windowed cells render
        _shot(page, f"{name}-p{i:02d}")
        moved = scroller.evaluate("el => { const top = el.scrollTop; el.scrollBy(0, el.clientHeight - 60); "
                                  "return el.scrollTop > top; }")
        if not moved:
            break


def _open_and_run_all(page, lab: Lab, name: str) -> None:
    page.goto(f"{lab.url}/lab/tree/notebooks/{name}?reset&token={lab.token}")
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
    _wait(lambda: page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                               ".jp-DebuggerBugButton, .jp-KernelStatus").count() > 0 and lab.kernels(),
          60, "the kernel to start", page)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    start = time.monotonic()
    idle_polls = []

    def finished():  # Run All stops at the first error and leaves the cells after it unrun: no "[*]" either way
        prompts = _prompts(page)
        shown = "[*]:" not in prompts and any(re.match(r"\[\d+\]:", p) for p in prompts)
        # and the kernel idle in three polls running: a prompt can hide (a solution cell's collapsed input)
        idle_polls.append(shown and all(k["execution_state"] == "idle" for k in lab.api("kernels")))
        return len(idle_polls) >= 3 and all(idle_polls[-3:])

    _wait(lambda: "[*]:" in _prompts(page) or finished(), 30, "Run All to start", page, 0.05)
    _wait(finished, RUN_ALL_TIMEOUT, f"{name} to run", page, 0.5)
    print(f"{name}: Run All took {time.monotonic() - start:.0f} s")
    _shot(page, f"{name}-run-all")
    errors = _saved_errors(page, lab, name)
    if BROWSER_PAGES:
        _page_through(page, name)
        shutil.copy(lab.workdir / "notebooks" / name, ARTEFACTS / name)
    assert not errors, f"{name} has error output:\n" + "\n---\n".join(errors)


def _panel(page):
    panels = page.locator(".experiment-panel")
    assert panels.count() >= 1, "no panel rendered"
    return panels.last


def _status(panel) -> str:
    return panel.locator(".experiment-panel-status").inner_text()


def _set_slider(panel, label: str, key: str) -> str:
    """Move the slider named ``label`` with the keyboard (End: its maximum, Home: its minimum); return its readout."""
    slider = panel.locator(".widget-slider", has=panel.page.locator("label", has_text=label))
    slider.locator(".noUi-handle").first.focus()
    slider.page.keyboard.press(key)
    return slider.locator(".widget-readout").inner_text()


def _choose_last(panel, label: str) -> str:
    """Pick the last option of the dropdown named ``label``, as a click would; return that option's text."""
    menu = panel.locator(".widget-dropdown", has=panel.page.locator("label", has_text=label)).locator("select")
    options = menu.locator("option").all_inner_texts()
    menu.select_option(label=options[-1])
    return options[-1].replace("\xa0", " ")  # ipywidgets shows an option's spaces as no-break spaces


def _progress(panel) -> str:
    """What the run has drawn so far in the panel's output area: text (tqdm bars, prints) and images' sizes."""
    area = panel.locator(".widget-output").first
    images = area.locator("img").evaluate_all("els => els.map(e => (e.src || '').length)")
    return f"{area.inner_text()} {images}" if area.inner_text().strip() or images else ""


def _ranks(lab: Lab, before: set[int]) -> list[psutil.Process]:
    kernel = _wait(lab.kernels, 10, "the kernel process")[0]
    return [p for p in kernel.children(recursive=True)
            if p.pid not in before and _alive_and(p, lambda p: p.status() != psutil.STATUS_ZOMBIE)]


def _alive_and(p: psutil.Process, check) -> bool:
    """check(p), or False for a process that ended in the meantime (10's DataLoader workers come and go)."""
    try:
        return check(p)
    except psutil.Error:
        return False


@dataclass(frozen=True)
class PanelCheck:
    """How the browser test clicks one notebook's panel.

    ``controls``: the sliders pushed to their end (End) for the run that gets
    stopped, and to their start (Home) for the run that must finish; ``ranks``:
    the run forks processes that Stop must kill; ``moves``: the run draws while
    it runs (tqdm bars, printed lines), so the test can see it going before it
    clicks Stop; ``menus``: dropdowns set to their last option for the run that
    finishes (its output must name that option).
    """

    controls: tuple[str, ...]
    ranks: bool
    moves: bool = True
    menus: tuple[str, ...] = ()


PANELS = {
    "01-single-gpu.ipynb": PanelCheck(("epochs",), ranks=False),
    "04-ddp.ipynb": PanelCheck(("steps", "batch"), ranks=True),
    "08-large-batch.ipynb": PanelCheck(("steps",), ranks=True, menus=("precision",)),
    # 11's run is one launch whose lines come when it ends (moves=False); at the most micro-batches and rounds it
    # lasts seconds even in smoke mode, long enough to Stop it
    "11-pipelines.ipynb": PanelCheck(("micro-batches", "rounds"), ranks=True, moves=False, menus=("split",)),
    # 12's run is one launched child measuring a loader, which prints its numbers when it ends; the longest run
    # (most workers, most epochs) lasts seconds, long enough to Stop it: the child and its workers must go
    "12-data-loading.ipynb": PanelCheck(("num_workers", "epochs"), ranks=True, moves=False),
}


def _click_run_stop_run(page, lab: Lab, name: str, check: PanelCheck) -> None:
    panel = _panel(page)
    panel.scroll_into_view_if_needed()
    kernel = lab.kernels()[0]
    before = {p.pid for p in kernel.children(recursive=True)}
    readout = [_set_slider(panel, control, "End") for control in check.controls]  # the longest run the panel offers
    panel.locator(".experiment-panel-run").click()
    first = _wait(lambda: "running" in _status(panel) and _progress(panel), 30, "the run to start", page)
    if check.moves:
        _wait(lambda: _progress(panel) != first, 60, "the progress to move", page)
    _shot(page, f"{name}-panel-running")
    ranks = _wait(lambda: _ranks(lab, before), 30, "the ranks to appear", page) if check.ranks else []
    assert "running" in _status(panel), f"the run ended before Stop could be clicked ({check.controls}={readout})"
    clicked = time.monotonic()
    panel.locator(".experiment-panel-stop").click()
    _wait(lambda: "stopped" in _status(panel), 15, "the panel to say stopped", page)
    stop_seconds = time.monotonic() - clicked
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"rank processes left after Stop: {[p.pid for p in alive]}"
    print(f"{name}: Stop ended the run in {stop_seconds:.1f} s; {len(gone)} rank process(es) gone")
    _shot(page, f"{name}-panel-stopped")
    assert not _panel_errors(page), _panel_errors(page)
    for control in check.controls:
        _set_slider(panel, control, "Home")  # a short run this time
    chosen = [_choose_last(panel, menu) for menu in check.menus]
    before_click = _status(panel)  # "done in …" of the run that Run All made from code
    panel.locator(".experiment-panel-run").click()
    _wait(lambda: "running" in _status(panel) or _status(panel) != before_click, 30, "the clicked run to start",
          page, 0.02)
    _wait(lambda: _status(panel).startswith("done"), 120, "the clicked run to finish", page)
    _shot(page, f"{name}-panel-done")
    assert not _panel_errors(page), _panel_errors(page)
    assert _progress(panel), "the finished run drew nothing in its panel"
    for option in chosen:
        assert option in _progress(panel), f"the run did not use the chosen {option!r}: {_progress(panel)[:300]}"
    left = psutil.wait_procs(_ranks(lab, before), timeout=10)[1]
    assert not left, f"processes left after the run finished: {[p.pid for p in left]}"


def _chosen(notebooks: list[str], choice: str) -> list[str]:
    """The notebooks BROWSER_NOTEBOOKS asks for: "panels", "all", or comma-separated names or numbers ("04,10")."""
    if choice == "all":
        return notebooks
    if choice == "panels":
        return [n for n in notebooks if n in PANELS]
    wanted = [w.strip() for w in choice.split(",") if w.strip()]
    chosen = [n for n in notebooks if any(n == w or n.startswith(f"{w}-") for w in wanted)]
    if len(chosen) < len(wanted):
        raise ValueError(f"BROWSER_NOTEBOOKS={choice!r}: no notebook for some of {wanted}; use panels, all or names")
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("name", _chosen(NOTEBOOKS, BROWSER_NOTEBOOKS))
def test_notebook_in_the_browser(lab, browser, name):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_and_run_all(page, lab, name)
        if name in PANELS:
            _click_run_stop_run(page, lab, name.removesuffix(".ipynb"), PANELS[name])
    finally:
        page.close()
        lab.shutdown_kernels()
    if RAN_CLEAN:  # reached only when Run All and the panel checks passed
        from ran_in_browser import record

        with open(RAN_CLEAN, "a") as f:
            f.write(record(name, ROOT / "notebooks" / name, BROWSER_SMOKE) + "\n")


def test_browser_notebooks_choice():
    assert _chosen(NOTEBOOKS, "panels") == sorted(PANELS)
    assert _chosen(NOTEBOOKS, "all") == NOTEBOOKS
    assert _chosen(NOTEBOOKS, "04,11-pipelines.ipynb") == ["04-ddp.ipynb", "11-pipelines.ipynb"]
    with pytest.raises(ValueError, match="no notebook"):
        _chosen(NOTEBOOKS, "99")


def test_every_panel_is_clicked_by_this_test():
    """A notebook that gains an ExperimentPanel must get a PanelCheck above, or its buttons go untested."""
    with_panels = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")
                   if any("ExperimentPanel(" in "".join(c["source"])
                          for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code")}
    assert with_panels, "no notebook has a panel: this test reads the wrong place"
    assert with_panels == set(PANELS), f"panels without a PanelCheck: {sorted(with_panels - set(PANELS))}; " \
                                       f"PanelChecks without a panel: {sorted(set(PANELS) - with_panels)}"
