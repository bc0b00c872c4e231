"""CUDA_VISIBLE_DEVICES: check a mask, run code in a child that sees only those GPUs, launch ranks on a subset.

CUDA reads the variable once, when a process first initialises CUDA, and then
renumbers what it lets through from 0: under ``"2,3"`` the process sees
``cuda:0`` and ``cuda:1``, which are physical GPUs 2 and 3. A bad mask is not
an error to CUDA; it silently shows fewer GPUs (``cuda_would_see`` has the rule
measured on one H100 with torch 2.11). So ``check_mask`` refuses bad masks with a clear message
before anything runs. ``start_script``, which builds a child's environment
with the mask, is written in notebooks/13-visible-devices.ipynb and exported
here (the region at the end of this file).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import torch

from .procs import ChildDied, call_in_child

VAR = "CUDA_VISIBLE_DEVICES"
UUID_PREFIXES = ("GPU-", "MIG-")


class MaskError(ValueError):
    """A CUDA_VISIBLE_DEVICES value that would not show the GPUs it names; the message says why and what CUDA does."""


def physical_gpus() -> list[dict]:
    """Every GPU in the box as NVML numbers them (PCI bus order, whatever the mask): index, name, uuid, bus id.

    Introduced in notebooks/13-visible-devices.ipynb.
    """
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no pynvml, no driver, no GPU: NVML raises its own error types or ImportError
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            text = [pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetPciInfo(h).busId]
            name, uuid, bus = (t.decode() if isinstance(t, bytes) else t for t in text)
            out.append({"index": i, "name": name, "uuid": uuid, "bus_id": bus})
        return out
    finally:
        pynvml.nvmlShutdown()


def cuda_would_see(mask: str | None, n_physical: int) -> int:
    """How many devices CUDA shows under ``mask`` on a box with ``n_physical`` GPUs (indices only).

    The rule measured child by child on one H100 with torch 2.11: no mask → all; entries are read
    left to right and the list stops at the first invalid one (not a number,
    negative, or no such GPU); any duplicate hides every GPU. torch's own reading (``_parse_visible_devices``,
    ``_device_count_nvml`` in torch/cuda/__init__.py) agrees on notebook 13's masks, but not on some that
    ``check_mask`` refuses anyway: it reads ``"1x"`` as 1 (strtoul) and shows none for ``"0,5,0"`` on one GPU.
    Introduced in notebooks/13-visible-devices.ipynb.
    """
    if mask is None:
        return n_physical
    items = [s.strip() for s in mask.split(",")] if mask.strip() else []
    seen = []
    for item in items:
        if not item.isdigit() or int(item) >= n_physical:
            break
        seen.append(int(item))
    return 0 if len(set(seen)) < len(seen) else len(seen)


def check_mask(mask: str, n_physical: int | None = None) -> tuple:
    """The GPUs ``mask`` names, as ints (or UUID strings); ``MaskError`` when CUDA would not show them all.

    ``""`` is valid (no GPU). ``n_physical`` defaults to the GPUs NVML finds.
    Introduced in notebooks/13-visible-devices.ipynb.
    """
    if not isinstance(mask, str):
        raise MaskError(f"{VAR} must be a string such as '0,1' (or '' for no GPU), got {mask!r}")
    n = len(physical_gpus()) if n_physical is None else n_physical
    items = [s.strip() for s in mask.split(",")] if mask.strip() else []
    out = []
    for item in items:  # what it is first, then repeats, then whether the GPUs exist
        if not (item.startswith(UUID_PREFIXES) or item.isdigit()):
            raise MaskError(f"{VAR}={mask!r}: {item!r} is not a GPU index (0, 1, ...) or a UUID (GPU-...); CUDA "
                            f"would silently stop reading there and show {cuda_would_see(mask, n)} device(s)")
        out.append(item if item.startswith(UUID_PREFIXES) else int(item))
    dups = sorted({i for i in out if out.count(i) > 1}, key=str)
    if dups:
        raise MaskError(f"{VAR}={mask!r} names {', '.join(map(str, dups))} twice; CUDA would then show no GPU at all")
    for i in out:
        if isinstance(i, int) and i >= n:
            have = f"GPUs 0..{n - 1}" if n else "no GPU"
            raise MaskError(f"{VAR}={mask!r}: there is no GPU {i} (this machine has {have}); CUDA would "
                            f"silently show {cuda_would_see(mask, n)} device(s)")
    return tuple(out)


@contextlib.contextmanager
def masked(mask: str, n_physical: int | None = None):
    """Set CUDA_VISIBLE_DEVICES to ``mask`` in this process for the block, restoring it after.

    Only before CUDA starts: CUDA reads the variable once, and changing it
    afterwards makes ``device_count()`` disagree with the live context (measured:
    the next synchronize fails), so this refuses then. Children forked or
    started inside the block (``launch``'s ranks) see the subset.
    Machinery behind visible.start_script; no notebook calls it directly.
    """
    check_mask(mask, n_physical)
    if torch.cuda.is_initialized():
        raise RuntimeError(f"CUDA is already initialised in this process: setting {VAR} now would not change its "
                           "GPUs and breaks the live context. Restart the kernel and set it before any CUDA call.")
    old = os.environ.get(VAR)
    os.environ[VAR] = mask
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(VAR, None)
        else:
            os.environ[VAR] = old


@dataclass(frozen=True)
class ChildOutput:
    """What a child run under a mask gave back: the mask, its return value (functions) and what it printed."""

    mask: str
    value: object
    output: str
    returncode: int = 0


def run_script(mask: str, command: list[str], timeout: float = 120.0, check: bool = True,
               env: dict | None = None) -> ChildOutput:
    """Run ``command`` (e.g. ``[sys.executable, "job.py"]``) with ``mask``; return its output; raise if it fails.

    ``check=False`` skips the mask check, to see what CUDA does with a bad one.
    Machinery behind start_script (the same, waited for, its output captured); no notebook calls it directly.
    """
    proc = start_script(mask, command, check=check, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise TimeoutError(f"{command} under {VAR}={mask!r} did not finish in {timeout:g} s; output:\n{out}")
    except BaseException:  # ■ on the cell: the script goes too, even one that ignores SIGINT
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{command} under {VAR}={mask!r} failed (exit code {proc.returncode}):\n{out}")
    return ChildOutput(mask, None, out, proc.returncode)


def run_function(mask: str, fn, *args, timeout: float = 120.0, check: bool = True,
                 env: dict | None = None) -> ChildOutput:
    """Run ``fn(*args)`` in a forked child that sees only ``mask``'s GPUs; return its value and what it printed.

    Fork, so a function defined in the notebook works; the child sets the
    mask (and ``env``) before any CUDA call, which is why CUDA must not be initialised here.
    Machinery behind 13's run_under (plus check_mask, captured output, a named error); no notebook calls it directly.
    """
    if check:
        check_mask(mask)
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is initialised in this process; a forked child cannot use it. Restart the kernel "
                           "and keep CUDA calls inside the function you run.")
    name = f"{getattr(fn, '__name__', 'fn')} under {VAR}={mask!r}"
    try:
        ok, value, output = call_in_child(_child, mask, fn, args, env or {}, timeout=timeout, name=name)
    except TimeoutError:
        raise TimeoutError(f"{name} did not finish in {timeout:g} s") from None
    except ChildDied as e:
        raise RuntimeError(f"{name} died (exit code {e.exitcode})") from None
    if not ok:
        raise RuntimeError(f"{name} raised:\n{value}\nits output:\n{output}")
    return ChildOutput(mask, value, output)


def _child(mask, fn, args, env) -> tuple:
    os.environ.update({**env, VAR: mask})  # before the child's first CUDA call, so CUDA reads it
    buffer = io.StringIO()
    sys.stdout = sys.stderr = buffer
    try:
        return True, fn(*args), buffer.getvalue()
    except BaseException:  # every failure goes back to the parent
        return False, traceback.format_exc(), buffer.getvalue()


def launch_on(mask: str, fn, world_size: int, *args, **kwargs):
    """``helpers.launch.launch`` with only ``mask``'s GPUs visible: the plan and the forked ranks see the subset.

    Introduced in notebooks/13-visible-devices.ipynb.
    """
    from .launch import launch

    with masked(mask):
        return launch(fn, world_size, *args, **kwargs)


# ---- exported from notebooks/13-visible-devices.ipynb: edit it there, then run `make export` ----
def start_script(mask: str, command: list[str], check: bool = True, env: dict | None = None) -> subprocess.Popen:
    """Start ``command`` seeing only ``mask``'s GPUs; return its Popen at once (stdout with stderr, as text).

    Introduced in notebooks/13-visible-devices.ipynb.
    """
    if check:
        check_mask(mask)
    child_env = {**os.environ, **(env or {})}
    child_env.update(CUDA_VISIBLE_DEVICES=mask)  # the child's CUDA reads it when it starts
    return subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
# ---- end of export from notebooks/13-visible-devices.ipynb ----
