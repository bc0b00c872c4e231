#!/usr/bin/env python
"""Check a GPU machine in one command (`make gpu-check`): one table of what the course's GPU routes do there.

    python scripts/gpu_check.py                 # on the GPU machine; about 5 minutes on one GPU
    python scripts/gpu_check.py --plan 8        # what it would run on 8 GPUs, on any machine (no GPU needed)

Rows: torch, the driver and the kernel checks (helpers.devices.plan); the class `init_process_group("nccl")` builds
(torch 2.15: ProcessGroupNCCL2 unless TORCH_DIST_USE_NCCL2=0; 2.11: ProcessGroupNCCL); two NCCL ranks on one GPU
refused fast ("Duplicate GPU detected"); every notebook's first code cell (its imports and set-up) leaves CUDA
uninitialised, so its later launches can fork; notebooks 00, 02, 05, 08, 09 and 24 in smoke mode (and, with two GPUs or
more, 11, 15, 16, 17, 18, 19, 23 and 25 on NCCL); 21's script for 25 steps in bf16 with compile and in float32, with the
MFU it prints and the peak it divides by; compiled = eager in float64 on CUDA.

It runs where there is no Jupyter and no network (the lent GPU machine: torch 2.11 and no pip access): the notebook
rows need nbmake and ipykernel importable, e.g. from the wheel folder that ../shared/gpu/README.md describes
(`--target /tmp/site`, PYTHONPATH=/tmp/site:$PWD); without them those rows say so and the rest still runs. It never
installs torch. On a machine without a usable GPU it stops at once with exit status 2 and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NOTEBOOKS_ONE_GPU = ("00", "02", "05", "08", "09", "24")
NOTEBOOKS_TWO_GPUS = ("11", "15", "16", "17", "18", "19", "23", "25")  # their NCCL routes need a GPU per rank
NO_GPU = 2  # exit status: nothing to check here


def planned(n_gpus: int) -> list[str]:
    """The checks this script runs on a machine with ``n_gpus`` usable GPUs, in order (what `--plan` prints)."""
    if n_gpus < 1:
        raise ValueError("no usable GPU: nothing to check (run it on a GPU machine)")
    rows = ["torch, driver and kernels", "NCCL backend class", "two NCCL ranks on one GPU refused",
            "first cells leave CUDA uninitialised"]
    rows += [f"notebook {n} (smoke)" for n in NOTEBOOKS_ONE_GPU]
    rows += ["21's script, bf16 + compile, 25 steps", "21's script, float32, 25 steps", "compiled = eager, float64"]
    if n_gpus >= 2:
        rows += [f"notebook {n} (smoke, NCCL)" for n in NOTEBOOKS_TWO_GPUS]
    return rows


def _run(cmd, timeout, env=None, cwd=ROOT):
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out + f"\n(timed out after {timeout} s)", time.monotonic() - start


NCCL_RANK = r"""
import os, time, torch, torch.distributed as dist
dev = torch.device("cuda", 0)
start = time.monotonic()
try:
    dist.init_process_group("nccl", device_id=dev)
    x = torch.ones(1, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("CLASS", type(dist.group.WORLD._get_backend(dev)).__name__, "SUM", x.item())
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
"""


def _nccl(world: int, timeout: float):
    from helpers.launch import free_port

    port = str(free_port())
    procs, start = [], time.monotonic()
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-c", NCCL_RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    return [p.returncode for p in procs], outs, time.monotonic() - start


FIRST_CELLS = r"""
import json, sys, torch
for path in sys.argv[1:]:
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    code = "\n".join(l for l in "".join(cells[0]["source"]).splitlines() if not l.lstrip().startswith(("%", "!")))
    exec(compile(code, path, "exec"), {"__name__": "__main__"})
    if torch.cuda.is_initialized():
        print("INITIALISED", path)
        break
else:
    print("CLEAN", len(sys.argv) - 1)
"""

F64 = r"""
import torch
from helpers.gpt import GPT, GPTConfig, gpt_loss
torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64)).to("cuda", torch.float64)
x = torch.randint(0, 256, (4, 65), device="cuda")
def grads(m):
    m.zero_grad(set_to_none=True)
    loss = gpt_loss(m, x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]
eager_loss, eager = grads(model)
compiled_loss, compiled = grads(torch.compile(model))
print("DIFF", max((a - b).abs().max().item() for a, b in zip(eager, compiled)), abs(eager_loss - compiled_loss).item())
"""


def _nbmake(number: str, timeout: float):
    path = sorted((ROOT / "notebooks").glob(f"{number}-*.ipynb"))[0]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        code, out, seconds = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
                                   f"--nbmake-timeout={int(timeout)}", str(path)], timeout + 30,
                                  env={"SMOKE_TEST": "1", "PYTHONPATH": os.pathsep.join(
                                      [str(ROOT), os.environ.get("PYTHONPATH", "")])}, cwd=tmp)
    ok = code == 0
    return ok, ("passed" if ok else "FAILED: " + _last_error(out)), seconds


def _last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    hits = [line for line in lines if "Error" in line or "error" in line or "FAILED" in line]
    return (hits[-1] if hits else lines[-1] if lines else "no output").strip()[:160]


def _train(args: list[str], n_gpus: int, timeout: float):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_gpus}",
           str(ROOT / "scripts" / "train_gpt.py"), "--steps", "25", "--tp", "1", *args]
    code, out, seconds = _run(cmd, timeout)
    events = [json.loads(line) for line in out.splitlines() if line.startswith('{"event"')]
    steps = [e for e in events if e["event"] == "step"][3:]  # the first steps compile and warm up
    start = next((e for e in events if e["event"] == "start"), None)
    if code != 0 or not steps or start is None:
        return False, "FAILED: " + _last_error(out), seconds
    rate = statistics.median(e["tokens_per_s"] for e in steps)
    mfu = statistics.median(e["mfu"] for e in steps) if "mfu" in steps[0] else None
    peak = f"{start.get('peak_flops', 0) / 1e12:.0f} TFLOP/s ({start.get('peak', '?')})"
    return True, (f"{rate:,.0f} tokens/s (median of {len(steps)} steps), MFU "
                  f"{'?' if mfu is None else f'{mfu:.1%}'} of {peak}, size {start['size']['name']}"), seconds


def check(n_gpus: int, table: list) -> None:
    import torch

    from helpers import devices

    def row(name, ok, result, seconds):
        table.append((name, "ok" if ok else "FAIL", result, seconds))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {result} ({seconds:.0f} s)", flush=True)

    start = time.monotonic()
    machine = devices.describe()
    plan = devices.plan(1)
    row("torch, driver and kernels", plan.kind != "cpu",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); {n_gpus} x {machine.gpus[0].name}; "
        f"driver check: {devices.driver_check() or 'ok'}; kernels: {devices.kernel_check() or 'ok'}",
        time.monotonic() - start)

    codes, outs, seconds = _nccl(1, 120)
    found = [line.split()[1] for line in outs[0].splitlines() if line.startswith("CLASS")]
    row("NCCL backend class", codes == [0] and bool(found),
        f"init_process_group('nccl') builds {found[0]}" if found else "FAILED: " + _last_error(outs[0]), seconds)

    codes, outs, seconds = _nccl(2, 90)
    refused = all(c not in (0, None) for c in codes) and any("Duplicate GPU" in o for o in outs)
    row("two NCCL ranks on one GPU refused", refused and seconds < 60,
        f"refused in {seconds:.0f} s: Duplicate GPU detected" if refused else
        f"exit codes {codes}: " + _last_error(" ".join(outs)), seconds)

    paths = [str(p) for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))]
    code, out, seconds = _run([sys.executable, "-c", FIRST_CELLS, *paths], 300, env={"PYTHONPATH": str(ROOT)},
                              cwd=ROOT / "notebooks")
    clean = code == 0 and "CLEAN" in out
    row("first cells leave CUDA uninitialised", clean,
        f"{len(paths)} notebooks' first cells: CUDA not initialised" if clean else
        next((line for line in out.splitlines() if line.startswith("INITIALISED")), "FAILED: " + _last_error(out)),
        seconds)

    try:
        import ipykernel  # noqa: F401
        import nbmake  # noqa: F401
        have_nbmake = True
    except ImportError:
        have_nbmake = False
    for number in NOTEBOOKS_ONE_GPU + (NOTEBOOKS_TWO_GPUS if n_gpus >= 2 else ()):
        name = f"notebook {number} (smoke{', NCCL' if number in NOTEBOOKS_TWO_GPUS else ''})"
        if have_nbmake:
            row(name, *_nbmake(number, 300))
        else:
            row(name, False, "not run: nbmake/ipykernel not importable (../shared/gpu/README.md: the wheels)", 0.0)

    row("21's script, bf16 + compile, 25 steps", *_train(["--dtype", "bfloat16", "--compile"], n_gpus, 300))
    row("21's script, float32, 25 steps", *_train(["--dtype", "float32"], n_gpus, 300))

    code, out, seconds = _run([sys.executable, "-c", F64], 300, env={"PYTHONPATH": str(ROOT)})
    diffs = [line.split()[1:] for line in out.splitlines() if line.startswith("DIFF")]
    ok = code == 0 and bool(diffs) and float(diffs[0][0]) < 1e-10 and float(diffs[0][1]) < 1e-10
    row("compiled = eager, float64", ok, f"max |grad diff| {float(diffs[0][0]):.1e}, |loss diff| "
        f"{float(diffs[0][1]):.1e} (bound 1e-10)" if diffs else "FAILED: " + _last_error(out), seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=int, metavar="N_GPUS", help="print the checks for N_GPUS GPUs and stop")
    args = parser.parse_args(argv)
    if args.plan is not None:
        for name in planned(args.plan):
            print(name)
        return 0
    from helpers import devices

    n_gpus = min(8, devices.gpu_count())  # usable GPUs (driver and kernels checked), counted without CUDA
    if n_gpus < 1:
        reason = devices.gpu_problem() or "no GPU is visible (NVML counts none)"
        print(f"gpu-check: no usable GPU here: {reason}. Run it on a GPU machine (the lent one: "
              f"../shared/gpu/README.md); `--plan N` shows what it runs on N GPUs.", file=sys.stderr)
        return NO_GPU
    table: list = []
    started = time.monotonic()
    try:
        check(n_gpus, table)
    finally:
        width = max((len(r[0]) for r in table), default=10)
        print(f"\n{'check':{width}s}  result  seconds  what it found")
        for name, status, result, seconds in table:
            print(f"{name:{width}s}  {status:6s}  {seconds:7.0f}  {result}")
        print(f"{len(table)} checks in {time.monotonic() - started:.0f} s; "
              f"{sum(r[1] == 'FAIL' for r in table)} failed")
    return 1 if any(r[1] == "FAIL" for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
