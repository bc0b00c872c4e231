"""`make test` runs each notebook once: nbmake skips what the browser test ran clean, and only that (ran_in_browser)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ran_in_browser import record

TESTS = Path(__file__).resolve().parent


def _notebook(path: Path, source: str) -> None:
    cell = {"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": [],
            "source": [source]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {"kernelspec": {"name": "python3", "display_name": "P",
                                                                              "language": "python"}},
                                "nbformat": 4, "nbformat_minor": 5}))


def _nbmake(tmp_path: Path, *names: str) -> str:
    env = {**os.environ, "SMOKE_TEST": "1", "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ran_in_browser",
                          "--ran-in-browser", str(tmp_path / "ran.tsv"), "--nbmake", *names],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return run.stdout + run.stderr


def test_nbmake_skips_exactly_the_notebooks_that_ran_clean(tmp_path):
    ok, edited, other = (tmp_path / f"{n}.ipynb" for n in ("01-ok", "02-edited", "03-other"))
    for nb in (ok, edited, other):
        _notebook(nb, "x = 1")
    # 01 ran clean here; 02 ran clean, then was edited; 03 ran clean in full mode (BROWSER_SMOKE=0), not smoke
    lines = [record(ok.name, ok, "1"), record(edited.name, edited, "1"), record(other.name, other, "0")]
    (tmp_path / "ran.tsv").write_text("\n".join(lines) + "\n")
    _notebook(edited, "x = 2")
    out = _nbmake(tmp_path, ok.name, edited.name, other.name)
    assert "2 passed, 1 deselected" in out, out
    assert "not run again here: 1 notebooks the browser test ran clean on this torch (01)" in out, out
