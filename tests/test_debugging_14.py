"""Notebook 14's Flight Recorder cells, at test size: the variables that switch NCCL's recorder on, and the command
line of torch's analyzer (exported from notebooks/14-debugging-distributed.ipynb into helpers.torchrun). The GPU
cell that uses them runs only with two GPUs; these checks run everywhere."""

import subprocess
import sys
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
