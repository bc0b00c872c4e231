"""Every public helper says what it does and where the course introduces it: a notebook that calls it by name, or
"machinery" that no notebook calls directly (d2l's back-pointer, kept true)."""

import importlib
import json
import inspect
import pkgutil
import re
from pathlib import Path

import helpers

ROOT = Path(__file__).resolve().parent.parent


def public_functions():
    for info in pkgutil.iter_modules(helpers.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"helpers.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or (inspect.isclass(obj) and not issubclass(obj, BaseException)
                                           and not hasattr(obj, "__dataclass_fields__")):
                yield f"{module.__name__}.{name}", obj


def test_public_helpers_point_back_to_an_existing_notebook():
    found = list(public_functions())
    assert len(found) > 30
    for qualname, obj in found:
        doc = inspect.getdoc(obj) or ""
        assert doc and doc.splitlines()[0].strip(), f"{qualname} has no one-line docstring"
        if "no notebook calls it directly" in doc:
            assert re.search(r"Machinery behind \S", doc), f"{qualname}: say what it is the machinery behind"
            continue
        match = re.search(r"Introduced in (notebooks/\S+\.ipynb)", doc)
        assert match, f"{qualname}: docstring lacks 'Introduced in notebooks/NN-...'"
        assert (ROOT / match.group(1)).exists(), f"{qualname} points to a missing {match.group(1)}"
        name = qualname.rsplit(".", 1)[1]
        assert re.search(rf"\b{re.escape(name)}\b", notebook_code(match.group(1))), (
            f"{qualname} says it is introduced in {match.group(1)}, whose cells never call it")


def notebook_code(path: str) -> str:
    cells = json.loads((ROOT / path).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
