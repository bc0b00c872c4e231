"""Run each notebook at full size, time it, and write the time into its header (`make timings`).

The header's last "Runs on:" part is the one place a notebook's run time lives; `make readme` copies it into the
README's table. A time is written only from a run that finished without an error, and says what it was measured on:

    Runs on: CPU-only ✓ · 1 GPU ✓ · ~3 min (measured: 171 s on 2 CPU cores, no bf16, torch 2.14.1)

Run it on a machine with nothing else running. The 1-minute load average printed before each notebook still counts
the previous notebook's own ranks (1–2 on 2 cores is normal); well above the core count, other jobs shared the
machine and the times are longer than a learner's. The executed copies are kept (``--keep DIR``) so every printed
number can be read against the text beside it.

    python scripts/time_notebooks.py [--only 04 05] [--keep /tmp/full] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from course_audit import write_readme  # noqa: E402

TIME_PART = re.compile(r"(^Runs on:.*·\s*)(~[^·\n]*?)(\s*$)", re.M)


def machine() -> str:
    """'2 CPU cores, no bf16, torch 2.14.1' (GPUs named when the run could see them)."""
    from helpers import devices
    import torch

    gpus = devices.gpu_count()
    where = f"{os.cpu_count()} CPU cores, {'bf16' if devices.cpu_has_bf16() else 'no bf16'}"
    if gpus > 0:
        where += f", {gpus} GPU{'s' if gpus > 1 else ''}"
    return f"{where}, torch {torch.__version__.split('+')[0]}"


def minutes(seconds: float) -> str:
    """The rounded figure a reader plans by: ~10 s steps below 45 s, half minutes below 3 min, then minutes."""
    if seconds < 45:
        return f"~{max(10, 10 * int(seconds / 10 + 0.5))} s"
    m = seconds / 60
    if m < 3:
        return f"~{int(2 * m + 0.5) / 2:g} min"
    return f"~{int(m + 0.5)} min"


def set_time(path: Path, text: str) -> None:
    nb = json.loads(path.read_text())
    first = "".join(nb["cells"][0]["source"])
    new, n = TIME_PART.subn(lambda m: m.group(1) + text + m.group(3), first, count=1)
    if n != 1:
        raise SystemExit(f"{path.name}: no 'Runs on: … · ~N min' line in the first cell")
    nb["cells"][0]["source"] = new.splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def run(path: Path, keep: Path | None) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        where = {"metadata": {"path": str(path.parent)}}  # run in notebooks/, as JupyterLab does
        NotebookClient(nb, timeout=900, kernel_name="python3", resources=where).execute()
    finally:
        seconds = time.perf_counter() - start
        if keep:
            keep.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, keep / path.name)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="notebook numbers, e.g. 04 05")
    ap.add_argument("--keep", type=Path, help="where to keep the executed copies")
    ap.add_argument("--dry-run", action="store_true", help="time and print; change no header")
    args = ap.parse_args()
    for smoke in ("SMOKE_TEST", "CI"):  # the kernels inherit this environment: full size
        os.environ.pop(smoke, None)
    where = machine()
    paths = sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")
                   if not args.only or p.name[:2] in args.only)
    failed = []
    for path in paths:
        load = os.getloadavg()[0]
        try:
            seconds = run(path, args.keep)
        except Exception as e:  # noqa: BLE001 - reported, and that notebook's header is left as it was
            failed.append(path.name)
            print(f"{path.name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", flush=True)
            continue
        seconds = round(seconds)  # the header shows whole seconds; the rounded figure must follow from them
        text = f"{minutes(seconds)} (measured: {seconds} s on {where})"
        print(f"{path.name}: {seconds} s (load average before: {load:.2f}) → {text}", flush=True)
        if not args.dry_run:
            set_time(path, text)
    if not args.dry_run:
        write_readme()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
