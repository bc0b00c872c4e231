"""Notebook 22's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

"The same numbers, checked" and "EP × DP on a 2-D mesh" compare the MoE with its experts sharded over ranks (2 ranks of
plain EP; a 2 × 2 ("dp", "ep") mesh) with the same MoE in one process, in float64, and assert < 1e-10 on the output,
the input's gradient, the router's and every expert's; they also assert the same routes (drops included) and a
margin between ranked router probabilities far above rounding. Each runs here with the notebook's own ``ep_rank``
(exported to helpers/moe.py) at the notebook's smoke sizes, for every rounding in ``ROUNDINGS``: the reference's
weights nudged one ulp cannot move a route. The last tests show the bound and the margin can fail: float32's rounding
and a missing all-reduce over ``dp`` exceed the bound; a tied router is caught by the margin.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOL, MARGIN = 1e-10, 1e-9  # notebook 22
E, K, CF, TOKENS, EP, W = 4, 2, 1.0, 32, 2, 4  # notebook 22's smoke parameters


def _make_moe(tied=False):
    """A builder of the notebook's smoke-size MoE, as ``functools.partial(MoE, CFG, E, K, CF)`` is there."""
    import torch

    from helpers import gpt, moe

    def make():
        layer = moe.MoE(gpt.GPTConfig(n_layer=2, n_head=2, d_model=32), E, K, CF)
        if tied:  # experts 0 and 1 get the same router row: every token ties them
            with torch.no_grad():
                layer.router.weight[1] = layer.router.weight[0]
        return layer

    return make


def _run(world_size, threads=1, ulps=0, ep_rank=None, **kwargs):
    import functools

    from helpers import moe
    from helpers.launch import launch

    fn = functools.partial(ep_rank or moe.ep_rank, **kwargs)
    return launch(perturbed(fn, threads, ulps), world_size, _make_moe(), TOKENS, EP, quiet=True, progress=False,
                  backend="gloo")


def _summary(runs):
    return {"gap": max(max(r["gaps"].values()) for r in runs), "same routes": all(r["same routes"] for r in runs),
            "margin": min(r["margin"] for r in runs), "dropped": sum(r["dropped"] for r in runs)}


def check(threads, ulps):
    return {"EP": _summary(_run(EP, threads, ulps)), "2-D": _summary(_run(W, threads, ulps))}


def _without_dp_all_reduce(*args, **kwargs):
    """ep_rank with the experts' all-reduce over dp left out (the router's, over every rank, kept)."""
    import torch.distributed as dist

    from helpers import moe

    class Dist:
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_reduce(self, tensor, group=None):
            if group is None:
                dist.all_reduce(tensor)

    moe.dist = Dist()  # this forked rank's module only
    return moe.ep_rank(*args, **kwargs)


def check_what_the_bound_catches(threads, ulps):
    import torch

    return {"float32": _summary(_run(EP, dtype=torch.float32)),
            "no dp all-reduce": _summary(_run(W, ep_rank=_without_dp_all_reduce)),
            "tied router": _summary(_launch_tied())}


def _launch_tied():
    from helpers import moe
    from helpers.launch import launch

    return launch(moe.ep_rank, EP, _make_moe(tied=True), TOKENS, EP, quiet=True, progress=False, backend="gloo")


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_expert_parallel_equals_one_process_in_float64(threads, ulps):
    out = run_check(__file__, "check", threads, ulps)
    print(f"{threads} thread(s), {ulps} ulp:", out)
    for name, r in out.items():
        assert r["same routes"] and r["margin"] > MARGIN, (name, r)
        assert r["gap"] < TOL, (name, r)
    assert out["EP"]["dropped"] > 0, "the smoke sizes must drop something, or capacity goes unchecked"


def test_the_bound_fails_for_float32_and_a_missing_dp_all_reduce_and_the_margin_for_a_tie():
    out = run_check(__file__, "check_what_the_bound_catches", 1, 0)
    print(out)
    assert out["float32"]["gap"] > TOL, "float32's rounding alone exceeds the bound"
    assert out["no dp all-reduce"]["gap"] > 1e-2, "a missing all-reduce moves gradients by their own size"
    assert out["tied router"]["margin"] < MARGIN, "an exact tie shows as a zero margin, which the notebook refuses"
