"""Every public helper says what it does and where the course introduces it (and that notebook exists)."""

import importlib
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
        match = re.search(r"Introduced in (notebooks/\S+\.ipynb)", doc)
        assert match, f"{qualname}: docstring lacks 'Introduced in notebooks/NN-...'"
        assert (ROOT / match.group(1)).exists(), f"{qualname} points to a missing {match.group(1)}"
