"""helpers/README.md is the design note: it must name every module that exists, and nothing that does not."""

import re
from pathlib import Path

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


def test_every_helpers_module_is_in_the_design_note():
    note = (HELPERS / "README.md").read_text()
    modules = {p.name for p in HELPERS.glob("*.py")}
    named = set(re.findall(r"^  (\w+\.py) ", note, flags=re.M))
    assert modules - named == set(), f"modules missing from helpers/README.md: {sorted(modules - named)}"
    assert named - modules == set(), f"helpers/README.md names modules that do not exist: {sorted(named - modules)}"
