"""The two ways to install (pip and conda) ask for the same packages; notebooks are committed clean."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pip_names_in_environment_yml() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    items = [line.strip()[2:].strip() for line in lines[start + 1:] if line.strip().startswith("- ")]
    return {item for item in items if not item.startswith("-e")}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    assert _pip_names_in_environment_yml() == wanted


def test_environment_yml_installs_the_project():
    assert "- -e ." in (ROOT / "environment.yml").read_text()


def test_notebooks_have_no_outputs_and_a_timeout():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    for path in notebooks:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        dirty = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count")]
        assert not dirty, f"{path.name}: code cells {dirty} carry outputs; clear them (make clean-outputs)"
        assert nb["metadata"]["execution"]["timeout"] > 0, f"{path.name} sets no timeout"
        assert re.match(r"\d\d-[a-z0-9-]+\.ipynb$", path.name), f"{path.name}: use NN-one-idea.ipynb"


def test_notebooks_open_with_the_house_header():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert "What you will learn" in first and "Runs on:" in first, path.name
        # the solution cells come after the exercises; before them, the notebook ends with Summary and Exercises
        cells = [c for c in json.loads(path.read_text())["cells"]
                 if "solution" not in c.get("metadata", {}).get("tags", [])]
        last = "".join(c for cell in cells[-3:] for c in cell["source"])
        assert "Summary" in last and "Exercises" in last, path.name
