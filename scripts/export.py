"""Write the code that notebooks introduce into helpers/, so that reuse has one source (d2l's #@save, made exact).

A code cell whose first line is ``#| export helpers/<module>.py`` is the source of that code: forked ranks run
what the notebook defines, and later notebooks, scripts and tests import the same code from helpers/. In the
module, each notebook's exported cells sit in one region between two marker lines:

    # ---- exported from notebooks/01-single-gpu.ipynb: edit it there, then run `make export` ----
    ...the cells' code, in notebook order, without their first line...
    # ---- end of export from notebooks/01-single-gpu.ipynb ----

``python scripts/export.py`` rewrites those regions (a region not yet in its module is appended to it; a region
whose notebook no longer exports there is removed). ``--check`` changes nothing and exits 1 naming every module
that differs from its notebooks (tests/test_export.py runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MARK = re.compile(r"^#\|\s*export\s+(\S+\.py)\s*$")
BEGIN = "# ---- exported from {nb}: edit it there, then run `make export` ----"
END = "# ---- end of export from {nb} ----"
REGION = re.compile(r"^# ---- exported from (\S+\.ipynb): .*?^# ---- end of export from \1 ----\n", re.M | re.S)


def exported_cells(notebook: Path) -> dict[str, list[str]]:
    """{target module: [cell source without its marker line, ...]} for one notebook, in cell order."""
    out: dict[str, list[str]] = {}
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        first, _, rest = "".join(cell["source"]).partition("\n")
        m = MARK.match(first.strip())
        if m:
            out.setdefault(m.group(1), []).append(rest.strip("\n"))
    return out


def regions(root: Path) -> dict[Path, dict[str, str]]:
    """{module path: {notebook name: region text}} that the notebooks under ``root`` ask for."""
    wanted: dict[Path, dict[str, str]] = {}
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        name = f"notebooks/{nb.name}"
        for target, sources in exported_cells(nb).items():
            body = "\n\n\n".join(sources)
            text = f"{BEGIN.format(nb=name)}\n{body}\n{END.format(nb=name)}\n"
            wanted.setdefault(root / target, {})[name] = text
    return wanted


def render(path: Path, wanted: dict[str, str]) -> str:
    """The module's text with each wanted region in place (others removed, missing ones appended)."""
    text = path.read_text() if path.exists() else ""
    left = dict(wanted)

    def swap(m: re.Match) -> str:
        return left.pop(m.group(1), "")

    text = REGION.sub(swap, text)
    for region in left.values():
        text = text.rstrip("\n") + ("\n\n\n" if text.strip() else "") + region
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a module differs")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = p.parse_args(argv)
    wanted = regions(args.root)
    # modules that hold a region no notebook exports any more
    for path in sorted((args.root / "helpers").glob("*.py")):
        if path not in wanted and REGION.search(path.read_text()):
            wanted[path] = {}
    stale = []
    for path, regs in sorted(wanted.items()):
        new = render(path, regs)
        old = path.read_text() if path.exists() else None
        if new != old:
            stale.append(path.relative_to(args.root))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("these modules differ from the notebooks they are exported from: "
              + ", ".join(map(str, stale)) + ". Edit the notebook's cell, then run `make export`.")
        return 1
    if not args.check:
        print(f"exported into {len(wanted)} module(s); rewrote {len(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
