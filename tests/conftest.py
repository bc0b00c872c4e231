"""Shared by the tests: waiting for something with a deadline; for the FSDP tests, a tiny image set and the
smallest BlockStack that still has two blocks to shard."""

import os
import time

# The tests' launched functions mean CPU ranks (gloo, CPU tensors and models): on a GPU machine the plan would be
# NCCL, which cannot reduce CPU tensors. So the GPUs are hidden before anything asks (children inherit it); tests
# about GPU plans mock torch's answers. MULTIGPU_TEST_GPUS=1 leaves the GPUs visible.
if os.environ.get("MULTIGPU_TEST_GPUS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
from torch.utils.data import TensorDataset

QUIET = dict(quiet=True, progress=False)
TINY = dict(width=16, blocks=2)


@pytest.fixture(scope="module")
def dataset():
    """256 random 28x28 images with labels, seeded."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g))


def wait_until(condition, timeout: float, what: str, interval: float = 0.1, on_timeout=None):
    """condition()'s first truthy value, polled every interval seconds; AssertionError naming what after timeout.

    The deadlines are generous on purpose: CI's two cores are shared with ranks, kernels and a browser."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            if on_timeout is not None:
                on_timeout()
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
