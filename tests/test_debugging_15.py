"""Notebook 15's Flight Recorder cells, at test size: the variables of NCCL's recorder (on by default), and the command
line of torch's analyzer (exported from notebooks/15-debugging-distributed.ipynb into helpers.torchrun). The NCCL
hang that uses them (exercise 6's solution) runs only with two GPUs; these checks run everywhere."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import torchrun


def test_flight_recorder_env_names_nccl_s_three_variables_and_a_file_per_rank(tmp_path):
    env = torchrun.flight_recorder_env(tmp_path / "fr", buffer_size=500)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr" / "rank_")}
    assert all(isinstance(v, str) for v in env.values())  # subprocess environments take strings only
    assert torchrun.flight_recorder_env(tmp_path)["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"  # torch's default


@pytest.mark.parametrize("size", [0, -1])
def test_flight_recorder_env_refuses_a_buffer_that_turns_the_recorder_off(tmp_path, size):
    with pytest.raises(ValueError, match="buffer_size"):
        torchrun.flight_recorder_env(tmp_path, buffer_size=size)


def test_the_variables_are_the_ones_torch_s_nccl_process_group_reads():
    import torch

    headers = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    if not headers.is_dir():
        pytest.skip("this torch install has no C++ headers")
    nccl = (headers / "ProcessGroupNCCL.hpp").read_text()
    assert '"TORCH_NCCL_TRACE_BUFFER_SIZE"' in nccl and '"TORCH_NCCL_DUMP_ON_TIMEOUT"' in nccl
    assert '"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)' in (headers / "FlightRecorder.hpp").read_text()


def test_fr_trace_command_runs_torch_s_analyzer_with_the_dump_prefix(tmp_path):
    cmd = torchrun.fr_trace_command(tmp_path, "--allow-incomplete-ranks", python="py")
    assert cmd == ["py", "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path), "--prefix", "rank_",
                   "--allow-incomplete-ranks"]
    out = subprocess.run(torchrun.fr_trace_command(tmp_path, "--help"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "trace_dir" in out.stdout and "--prefix" in out.stdout
    assert (Path(sys.executable).parent / "torchfrtrace").exists()


_LOADER = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset


class Reads(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 0:  # the first read: no batch is in flight when the worker goes
            if sys.argv[1] == "dies":
                os._exit(1)  # the worker dies (killed for memory, a crash in a decoder)
            time.sleep(120)  # the worker is stuck (a read that never returns)
        return torch.tensor(i)


for batch in DataLoader(Reads(), batch_size=2, num_workers=1, timeout=float(sys.argv[2])):
    pass
"""


@pytest.mark.parametrize("mode, timeout, message", [("dies", 0, "exited unexpectedly"),
                                                     ("stuck", 2, "DataLoader timed out after 2")])
def test_a_dead_dataloader_worker_raises_and_a_stuck_one_raises_only_with_a_timeout(tmp_path, mode, timeout, message):
    """Notebook 15, section 4: a worker that died is an error in the main process within seconds (dataloader.py
    checks its workers every MP_STATUS_CHECK_INTERVAL = 5 s), so that rank crashes and its peers wait; a stuck worker
    hangs the rank unless DataLoader(timeout=...) is set, which turns it into an error."""
    from torch.utils.data import _utils

    script = tmp_path / "loader.py"
    script.write_text(_LOADER)
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script), mode, str(timeout)], capture_output=True, text=True,
                         timeout=60)  # a hang here fails the test instead of stalling it
    assert time.monotonic() - start < 30  # an error within seconds, not the sleeping worker's 120 s
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert _utils.MP_STATUS_CHECK_INTERVAL == 5.0


def test_the_flight_recorder_records_by_default_and_on_2_15_gloo_records_too():
    """Notebook 15, section 5: 2000 entries unless TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE say otherwise,
    and on torch 2.15 gloo's collectives land in the recorder as well (only the dump on timeout is NCCL's)."""
    script = (
        "import json, os, torch, torch.distributed as dist\n"
        "from torch._C._distributed_c10d import _dump_fr_trace_json\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "t = torch.ones(3); dist.all_reduce(t); dist.broadcast(t, 0)\n"
        "entries = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False)).get('entries', [])\n"
        "print(sorted({e['profiling_name'] for e in entries}))\n"
        "dist.destroy_process_group()\n")
    import torch

    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15):
        pytest.skip("gloo's own Flight Recorder entries are checked on torch 2.15")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TORCH_FR_BUFFER_SIZE",
                                                                          "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gloo:all_reduce" in out.stdout and "gloo:broadcast" in out.stdout  # recorded with no variable set
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**env, "TORCH_FR_BUFFER_SIZE": "0"})
    assert off.returncode == 0 and "gloo:all_reduce" not in off.stdout  # 0 turns it off
