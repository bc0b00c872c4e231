"""scripts/train_ddp.py under torchrun (1 node x 2, 2 nodes x 1, a worker killed) and helpers.torchrun."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import types
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import wait_until
from helpers import torchrun
from helpers.launch import free_port

SCRIPT = str(torchrun.SCRIPT)
STEPS = 30
ARGS = ["--smoke", "--steps", STEPS, "--save-every", 5]


def _script_processes(path) -> list:
    """Processes still running the script on ``path`` (a test's own checkpoint: other runs may be going on)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if SCRIPT in proc.cmdline() and str(path) in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _params(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item():.2e}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("ref") / "one-node.pt"
    out = torchrun.run({"node": torchrun.torchrun_command(ARGS + ["--checkpoint", path], nproc=2)},
                       timeout=180, echo=False)
    assert f"done: {STEPS} steps" in out["node"].text
    assert not _script_processes(path), "workers left behind"
    return {"path": path, "params": _params(path)}


def test_two_nodes_on_loopback_equal_one_node(reference, tmp_path):
    path = tmp_path / "two-nodes.pt"
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = {f"node{i}": torchrun.torchrun_command(ARGS + ["--checkpoint", path], nproc=1, nnodes=2, node_rank=i,
                                                  endpoint=endpoint) for i in range(2)}
    out = torchrun.run(cmds, timeout=180, echo=False)
    text = out["node0"].text + out["node1"].text
    assert "WORLD_SIZE=2" in text and "GROUP_RANK=1" in text
    _assert_equal(reference["params"], _params(path))
    assert not _script_processes(path)


def test_worker_killed_mid_run_restarts_and_ends_equal(reference, tmp_path):
    path = tmp_path / "restart.pt"
    killer = torchrun.kill_worker_after("step 10/", index=1)
    cmd = torchrun.torchrun_command(ARGS + ["--checkpoint", path, "--pause", 0.2], nproc=2, max_restarts=1)
    out = torchrun.run({"node": cmd}, timeout=180, echo=False, on_line=killer,
                       env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert len(killer.killed) == 1, "no worker was killed"
    text = out["node"].text
    assert "TORCHELASTIC_RESTART_COUNT=1" in text and "resumed at step" in text
    assert "TORCHELASTIC_USE_AGENT_STORE=False" in text, "each attempt's rank 0 serves a store of its own"
    _assert_equal(reference["params"], _params(path))
    assert not _script_processes(path)


def test_a_killed_kernel_takes_torchrun_along(tmp_path):
    # a stand-in for a notebook kernel that dies (a restart, an OOM kill) while a node waits for its peer: alone,
    # that node would wait for the rendezvous for up to 600 s
    path = tmp_path / "orphan.pt"
    cmd = torchrun.torchrun_command(["--smoke", "--checkpoint", path], nproc=1, nnodes=2,
                                    endpoint=f"127.0.0.1:{free_port()}")
    code = (f"import sys; sys.path.insert(0, {str(torchrun.SCRIPT.parent.parent)!r}); from helpers import torchrun; "
            f"torchrun.run({{'node0': {[str(a) for a in cmd]!r}}}, timeout=300)")
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def started():  # what the kernel started, not the kernel (its own command line names the path too)
        return [p for p in _script_processes(path) if p.pid != kernel.pid]

    try:
        wait_until(lambda: any("torch.distributed.run" in p.cmdline() for p in started()), 60, "torchrun to start")
        time.sleep(2)  # torchrun's agent reaches the rendezvous and waits there
        assert started(), "torchrun did not start"
    finally:
        kernel.kill()
        kernel.wait()
    try:
        wait_until(lambda: not started(), 15, "what the kernel started to die with it", 0.2)
    finally:
        for proc in started():  # what outlived its kernel goes now, so that no test leaves it behind
            proc.kill()


def _plain(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _script_module():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, words", [
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-sise", "3"], "unrecognized arguments"),
    (["--save-every", "5"], "--save-every needs --checkpoint"),
    (["--lr", "-1"], "--lr"),
    (["--backend", "mpi"], "invalid choice"),
])
def test_bad_options_exit_nonzero_with_a_message(args, words, capsys):
    # in-process: the same argparse code as `python train_ddp.py ...`, without a torch import per case
    with pytest.raises(SystemExit) as exit_:
        _script_module().main(args)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_missing_or_empty_data_folder_is_a_clear_error(tmp_path, capsys):
    script = _script_module()
    assert script.main(["--data", str(tmp_path / "nowhere"), "--smoke"]) == 2
    assert f"--data {tmp_path / 'nowhere'}: no such folder" in capsys.readouterr().err
    assert script.main(["--data", str(tmp_path), "--smoke"]) == 2
    assert "no Fashion-MNIST IDX files there" in capsys.readouterr().err
    res = _plain("--data", tmp_path, "--smoke")  # and as a command: exit code 2, one line, no traceback
    assert res.returncode == 2 and "no Fashion-MNIST IDX files there" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_without_torchrun_one_process_and_a_foreign_checkpoint_refused(reference, tmp_path):
    res = _plain("--smoke", "--steps", 3)
    assert res.returncode == 0 and "world size 1" in res.stdout and "done: 3 steps" in res.stdout, res.stderr
    foreign = tmp_path / "two-ranks.pt"
    shutil.copy(reference["path"], foreign)
    res = _plain("--smoke", "--steps", 3, "--checkpoint", foreign)
    assert res.returncode == 2 and "'world_size': 2" in res.stderr and str(foreign) in res.stderr, res.stderr
    foreign.write_bytes(foreign.read_bytes()[:1000])  # what a copy cut short leaves
    res = _plain("--smoke", "--steps", 3, "--checkpoint", foreign)
    assert res.returncode == 2 and "truncated or corrupt" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_commands():
    one = torchrun.torchrun_command(["--smoke"], nproc=2, python="py")
    assert one[:4] == ["py", "-m", "torch.distributed.run", "--nproc-per-node=2"] and "--standalone" in one
    assert one[-2:] == [SCRIPT, "--smoke"]
    c10d = torchrun.torchrun_command([], nnodes=2, endpoint="h:29500", max_restarts=3)
    assert "--rdzv-endpoint=h:29500" in c10d and "--max-restarts=3" in c10d and "--standalone" not in c10d
    static = torchrun.torchrun_command([], nnodes=2, node_rank=1, endpoint="h:29500", rdzv="static")
    assert "--node-rank=1" in static and "--master-addr=h" in static and "--master-port=29500" in static
    with pytest.raises(ValueError, match="endpoint"):
        torchrun.torchrun_command([], nnodes=2)
    with pytest.raises(ValueError, match="rdzv"):
        torchrun.torchrun_command([], nnodes=2, endpoint="h:1", rdzv="etcd")


def test_run_streams_lines_and_kills_the_whole_tree_on_timeout(capsys):
    # a child in its own session, like torchrun's workers: killpg of the parent alone would miss it
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
            "print('child', p.pid, flush=True)\n"
            "print('partial line without newline', end='', flush=True)\n"
            "time.sleep(300)\n")
    seen = []
    start = time.monotonic()
    with pytest.raises(torchrun.RunFailed, match="still running after 15 s"):
        torchrun.run({"a": [sys.executable, "-c", code]}, timeout=15, on_line=lambda n, line, p: seen.append(line))
    assert time.monotonic() - start < 40
    child = int(seen[0].split()[1])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert "child" in capsys.readouterr().out


def test_run_reports_exit_codes_and_last_lines():
    out = torchrun.run({"ok": [sys.executable, "-c", "import os; print(os.environ['X']); print('b', end='')"]},
                       echo=False, env={"X": "all"}, envs={"ok": {"X": "a"}})
    assert out["ok"].returncode == 0 and out["ok"].lines == ["a", "b"]
    with pytest.raises(torchrun.RunFailed, match=r"(?s)bad: code 3.*boom"):
        torchrun.run({"bad": [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]}, echo=False)
    out = torchrun.run({"bad": [sys.executable, "-c", "import sys; sys.exit(3)"]}, echo=False, check=False)
    assert out["bad"].returncode == 3


def test_sbatch_dry_run_renders_one_torchrun_per_node(tmp_path):
    out = torchrun.sbatch_dry_run(2, 4)
    assert out["syntax"] == "ok" and set(out) == {"syntax", "node0", "node1"}
    assert out["node0"] == out["node1"], "every node runs the same command; c10d hands out the ranks"
    for part in ("--nnodes=2", "--nproc-per-node=4", "--rdzv-endpoint=gpu-node-01:29500", "scripts/train_ddp.py",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "srun --kill-on-bad-exit=1 --cpus-per-task=16 "):
        assert part in out["node0"]
    assert "export SRUN_CPUS_PER_TASK" not in torchrun.SBATCH.read_text(), "Slurm 23.11 reads SLURM_CPUS_PER_TASK"
    broken = tmp_path / "broken.sbatch"
    broken.write_text("#!/bin/bash\nif true; then\n")
    assert torchrun.sbatch_dry_run(2, 4, path=broken)["syntax"] != "ok"


@pytest.mark.parametrize("gpus", [2, 0])
def test_init_passes_device_id_under_nccl_only(monkeypatch, gpus):
    # NCCL without device_id makes barrier() guess the GPU (torch warns); gloo on the CPU must not get one
    script = _script_module()
    devices_ = [torch.device("cuda", i) for i in range(2)] if gpus else [torch.device("cpu")] * 2
    monkeypatch.setattr(script.devices, "plan", lambda n, backend=None: types.SimpleNamespace(
        devices=devices_, backend="nccl" if gpus else "gloo"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    seen = {}
    monkeypatch.setattr(script.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.delenv("RANK", raising=False)  # no torchrun: a group of one on a HashStore
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rank, world, device = script.init_distributed(timeout=5.0)
    assert (rank, world, device) == (0, 1, devices_[1])
    assert seen["device_id"] == (torch.device("cuda", 1) if gpus else None), seen


@pytest.mark.parametrize("shared, restarts, refused", [
    ("True", "1", True), ("False", "1", False), ("True", "0", False),
])
def test_restarts_on_torchruns_shared_store_are_refused(monkeypatch, shared, restarts, refused):
    # the agent's store outlives the workers: a restarted group would meet the last group's keys
    script = _script_module()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    if refused:
        with pytest.raises(script.SetupError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            script.check_restartable()
    else:
        script.check_restartable()


def test_marked_parts_the_notebook_prints_are_there():
    text = torchrun.SCRIPT.read_text().splitlines()
    for part in ("set-up", "resume", "loop"):
        marks = [line.strip() for line in text if line.strip() in (f"# >>> {part}", f"# <<< {part}")]
        assert marks == [f"# >>> {part}", f"# <<< {part}"], part


def test_every_torch_load_in_notebook_10_maps_to_the_cpu():
    # a checkpoint a GPU rank wrote, loaded without map_location, starts CUDA in the kernel: every later launch fails
    nb = Path(__file__).resolve().parent.parent / "notebooks" / "14-torchrun-and-clusters.ipynb"
    loads = 0
    for cell in json.loads(nb.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or src.startswith("%%"):  # %%writefile cells are the workers' code
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                loads += 1
                where = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("map_location")
                assert where == "'cpu'", f"torch.load without map_location='cpu': {ast.unparse(node)}"
    assert loads >= 3
