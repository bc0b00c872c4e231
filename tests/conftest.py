"""Shared by the FSDP tests: a tiny image set and the smallest BlockStack that still has two blocks to shard."""

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
