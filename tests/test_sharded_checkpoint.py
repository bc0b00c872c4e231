"""helpers.sharded_checkpoint: a full state dict to rank 0 for one device, and a DCP save/load that resumes exactly.

Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest

from helpers import checkpoint, fsdp, models, sharded_checkpoint
from conftest import QUIET, TINY
from helpers.launch import launch





def test_checkpoint_both_ways_resumes_exactly(dataset, tmp_path):
    fn = functools.partial(sharded_checkpoint.checkpoint_rank, **TINY)
    res = launch(fn, 2, dataset, str(tmp_path), 5, 2, 32, 0.05, **QUIET)
    assert models.max_param_diff(res[0]["resumed"], res[0]["uninterrupted"]) == 0
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    plain = fsdp.BlockStack(**TINY)
    assert checkpoint.load(res[0]["full_path"], plain) == {"step": 2}
    assert models.max_param_diff(plain.state_dict(), res[0]["full_at_resume"]) == 0




def test_resume_step_must_be_inside_the_run(dataset):
    with pytest.raises(ValueError, match="resume_at"):
        sharded_checkpoint.checkpoint_rank(0, 2, dataset, "/nonexistent", 3, 3, 32, 0.1)
