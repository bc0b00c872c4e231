"""helpers.collectives: notebook 03's exported ring all-reduce, timings, α–β fit and nccl-tests bandwidths.

The lesson is in notebooks/03-collectives.ipynb, whose asserts check it on 4 ranks; these tests check the exported
code on its own, including the cases the notebook does not run (3 ranks, sizes that do not divide, noisy timings).
"""

import pytest
import torch
import torch.distributed as dist

from conftest import QUIET
from helpers.collectives import BUS_FACTOR, bus_bandwidth, fit_alpha_beta, ring_all_reduce, time_collectives
from helpers.launch import launch


def _ring_rank(rank, world_size, numel):
    torch.manual_seed(rank)
    x = torch.randint(-100, 100, (numel,)).float()  # integers: any order of adding gives the same bits
    reference = x.clone()
    dist.all_reduce(reference)
    out = ring_all_reduce(x)
    return out is x, torch.equal(x, reference)


@pytest.mark.parametrize("world_size, numel", [(2, 8), (3, 10), (3, 2)])
def test_ring_all_reduce_equals_all_reduce_in_place(world_size, numel):
    """Any W, sizes W does not divide, and fewer elements than ranks (empty chunks)."""
    for in_place, equal in launch(_ring_rank, world_size, numel, **QUIET):
        assert in_place and equal


def test_fit_recovers_alpha_and_beta_despite_jitter_and_an_outlier():
    sizes = torch.tensor([2.0**k for k in range(3, 26)], dtype=torch.float64)
    alpha, beta = 50e-6, 1 / 2e9
    g = torch.Generator().manual_seed(0)
    seconds = (alpha + sizes * beta) * (1 + 0.1 * torch.rand(len(sizes), generator=g, dtype=torch.float64))
    seconds[4] *= 20  # one call the scheduler delayed
    a, b = fit_alpha_beta(sizes.tolist(), seconds)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.1)


def test_fit_is_exact_on_exact_data_to_the_grid_spacing():
    sizes = [2**k for k in range(3, 24)]
    a, b = fit_alpha_beta(sizes, [1e-4 + n * 1e-9 for n in sizes])
    assert a == pytest.approx(1e-4, rel=0.025) and b == pytest.approx(1e-9, rel=0.025)


def test_bus_bandwidth_uses_nccl_tests_factors():
    algbw, busbw = bus_bandwidth("all_reduce", 2**20, 1e-3, 4)
    assert algbw == 2**20 / 1e-3 and busbw == pytest.approx(algbw * 2 * 3 / 4)
    assert bus_bandwidth("all_gather", 100, 1.0, 2) == (100.0, 50.0)
    assert bus_bandwidth("reduce_scatter", 100, 1.0, 4)[1] == pytest.approx(75.0)
    assert bus_bandwidth("broadcast", 100, 1.0, 8)[1] == 100.0
    assert BUS_FACTOR["all_reduce"](1) == 0.0  # one rank sends nothing
    with pytest.raises(KeyError):
        bus_bandwidth("gather", 100, 1.0, 2)


def test_time_collectives_gives_each_op_its_fastest_call_per_size():
    """Notebook 04 refits α and β with it: every op, every size, a positive time, the same keys on every rank."""
    sizes = [64, 2**16]
    out = launch(time_collectives, 2, sizes, 5, 2**20, backend="gloo", **QUIET)
    for rank in out:
        assert set(rank) == {"all_reduce", "all_gather", "reduce_scatter"}
        assert all(sorted(rank[op]) == sizes and all(0 < s < 5 for s in rank[op].values()) for op in rank)
    a, b = fit_alpha_beta(sizes, [max(r["all_reduce"][s] for r in out) for s in sizes])
    assert a > 0 and b > 0
