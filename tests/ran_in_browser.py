"""A pytest plugin for `make test`'s notebook phase: skip the notebooks the browser test has just run clean.

`make test` runs every notebook once on the newest torch: the browser test (tests/test_browser.py) runs Run All in
the notebooks that have a panel and clicks the panel; nbmake runs the rest. The browser test writes one line per
notebook it ran without an error output to the file in $BROWSER_RAN_CLEAN: the notebook's name, the sha256 of its
bytes, the torch version and the smoke setting. Loaded with ``-p ran_in_browser --ran-in-browser FILE`` (tests/ on
PYTHONPATH), this plugin deselects a notebook only when all four match this run, so a notebook edited since, another
torch, another size or a browser test that was skipped (no chromium) leaves nbmake running it. Without the option
it does nothing: `make notebooks` runs every notebook.
"""

from __future__ import annotations

import hashlib
import os
from importlib.metadata import version
from pathlib import Path


def record(name: str, path: Path, smoke: str) -> str:
    """The line that says ``path`` ran clean here (tab-separated), as the browser test writes it."""
    return "\t".join((name, hashlib.sha256(path.read_bytes()).hexdigest(), version("torch"), smoke))


def pytest_addoption(parser):
    parser.addoption("--ran-in-browser", default=None, metavar="FILE",
                     help="skip the notebooks FILE lists as run clean by the browser test (tests/ran_in_browser.py)")


def pytest_collection_modifyitems(config, items):
    path = config.getoption("--ran-in-browser")
    if not path or not Path(path).exists():
        return
    ran = set(Path(path).read_text().splitlines())
    smoke = os.environ.get("SMOKE_TEST", "0")
    keep, skipped = [], []
    for item in items:
        nb = Path(str(item.path))
        (skipped if nb.suffix == ".ipynb" and record(nb.name, nb, smoke) in ran else keep).append(item)
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = keep
        config._ran_in_browser = sorted(Path(str(i.path)).name for i in skipped)


def pytest_terminal_summary(terminalreporter, config):
    names = getattr(config, "_ran_in_browser", None)
    if names:
        terminalreporter.write_line(f"not run again here: {len(names)} notebooks the browser test ran clean on this "
                                    f"torch ({', '.join(n.split('-')[0] for n in names)})")
