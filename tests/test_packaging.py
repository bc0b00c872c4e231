"""The two ways to install (pip and conda) ask for the same packages; notebooks are committed clean."""

import json
import re
import tomllib
from pathlib import Path

import pytest

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


def test_installing_the_course_keeps_the_platform_s_torch(tmp_path):
    """Kaggle, Colab or a GPU image already has a torch: `pip install <course>` there must not fetch another.

    A fresh environment sees this interpreter's packages (torch among them) the way a platform's Python sees its
    preinstalled ones, then installs the course with no package index at all: a wish for another torch (or any
    download) fails the install. Afterwards torch is the same file and version, and notebooks/ imports helpers.
    """
    import os
    import shutil
    import site
    import subprocess
    import sys
    import sysconfig

    import setuptools
    import torch

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} cannot build the course (>= 77); `make` upgrades it")
    env_dir = tmp_path / "platform"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    preinstalled = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    Path(purelib, "platform.pth").write_text("\n".join(dict.fromkeys(preinstalled)) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONSTRAINT": "/dev/null"}
    course = tmp_path / "course"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT / "helpers", course / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, course / name)
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                          "--no-build-isolation", str(course)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    probe = "import torch, helpers; print(torch.__version__, torch.__file__, helpers.__file__, sep='|')"
    seen = subprocess.run([str(python), "-c", probe], cwd=ROOT / "notebooks", capture_output=True, text=True,
                          env=env | {"PYTHONNOUSERSITE": "1"})
    assert seen.returncode == 0, seen.stderr
    version, torch_file, helpers_file = seen.stdout.strip().split("|")
    assert (version, torch_file) == (torch.__version__, torch.__file__), "the install replaced the platform's torch"
    assert helpers_file.startswith(purelib), f"helpers came from {helpers_file}, not the installed course"
