"""Notebooks 24 and 25's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).
(notebooks/24-mixture-of-experts.ipynb, notebooks/25-expert-parallel.ipynb)

22, "All experts in one computation": the experts as one padded ``baddbmm`` (``Experts``) against a loop over the
experts, in float64, < 1e-10 of the output's scale. 25, "The same numbers, checked": one step of the MoE-GPT under
EP × FSDP on an ("edp", "ep") mesh (2 × 2; and ep = 1, exercise 1; and with a capacity, exercise 3) against the same
model in one process on every rank's batch, in float64: the loss and every gradient < 1e-10, the same routes, and a
margin between ranked router probabilities far above rounding. Each runs here with the notebooks' own code (exported
to helpers/moe.py) at 25's smoke sizes, for every rounding in ``ROUNDINGS``. The last tests show the bound and the
margin can fail (float32, no gradient divide factor, a tied router), and that the hand-written ``AllToAll`` equals
torch's ``all_to_all_single_autograd`` (which 25 names but, its module being private, does not call).
"""

import pytest
from perturb import ROUNDINGS, nudge_, perturbed, run_check

TOL, MARGIN = 1e-10, 1e-9  # notebooks 24 and 25
E, K, HIDDEN, SHARED, EP, W, BATCH, SEQ = 4, 2, 32, 64, 2, 4, 2, 16  # 25's smoke sizes (d 32, 2 layers, 2 heads)


def _data():
    import torch

    from helpers import text

    windows = text.random_windows(text.byte_splits(text.load_corpus()[0])[0], W * BATCH, SEQ,
                                  torch.Generator().manual_seed(0))
    return [t.view(W, BATCH, SEQ) for t in windows]


def _make_moe_gpt(tied=False, capacity_factor=None):
    """A builder of 25's smoke-size MoE-GPT, as ``make_moe_gpt`` is there."""
    import torch

    from helpers import gpt, moe

    def make():
        model = gpt.GPT(gpt.GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=SEQ))
        for block in model.blocks:
            block.mlp = moe.MoE(32, E, K, HIDDEN, SHARED, capacity_factor=capacity_factor)
        if tied:  # experts 0 and 1 get the same router row in block 0: every token ties them
            with torch.no_grad():
                model.blocks[0].mlp.router.weight[1] = model.blocks[0].mlp.router.weight[0]
        return model

    return make


def _run(threads=1, ulps=0, ep_size=EP, make=None, **kwargs):
    import functools

    from helpers import moe
    from helpers.launch import launch

    xs, ys = _data()
    fn = functools.partial(moe.ep_fsdp_rank, **kwargs)
    return launch(perturbed(fn, threads, ulps), W, make or _make_moe_gpt(), xs, ys, ep_size, quiet=True,
                  progress=False, backend="gloo")


def _summary(runs):
    return {"gap": max(max(r["gaps"].values()) for r in runs), "same routes": all(r["same routes"] for r in runs),
            "margin": min(r["margin"] for r in runs), "sent": sum(sum(r["sent"][0]) for r in runs)}


def _grouped_against_loop(threads, ulps):
    """24's check: Experts' padded baddbmm against a loop over experts; the loop's weights nudged ``ulps``."""
    import copy

    import torch
    import torch.nn.functional as F

    from helpers.moe import Experts

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    experts = Experts(E, 64, 128).to(torch.float64)
    looped = copy.deepcopy(experts)
    nudge_(looped, ulps)
    counts = torch.tensor([5, 0, 9, 2])
    rows = torch.randn(int(counts.sum()), 64, dtype=torch.float64)
    with torch.no_grad():
        grouped = experts(rows, counts)
        loop = torch.cat([F.gelu(r @ looped.up[i] + looped.up_bias[i]) @ looped.down[i] + looped.down_bias[i]
                          for i, r in enumerate(rows.split(counts.tolist()))])
    return ((grouped - loop).abs().max() / loop.abs().max()).item()


def check(threads, ulps):
    out = {"2-D": _summary(_run(threads, ulps)), "ep 1": _summary(_run(threads, ulps, ep_size=1)),
           "capacity": _summary(_run(threads, ulps, make=_make_moe_gpt(capacity_factor=1.0)))}
    # last: with 2 threads it starts this process's OpenMP pool, which ranks forked after it could not use
    out["grouped"] = {"gap": _grouped_against_loop(threads, ulps), "same routes": True, "margin": 1.0}
    return out


def check_what_the_bound_catches(threads, ulps):
    import torch

    from helpers.launch import RankFailed

    try:  # 25's claim: in float32 FSDP folds the divisor into a PREMUL_SUM reduce-scatter, which gloo lacks
        _run(dtype=torch.float32)
        premul = "ran"
    except RankFailed as e:
        premul = str(e)
    return {"float32": _summary(_run(ep_size=1, dtype=torch.float32)),  # edp = dp: FSDP's own divisor, no PREMUL_SUM
            "float32 with a divide factor on gloo": premul,
            "no divide factor": _summary(_run(divide=False)),
            "tied router": _summary(_run(make=_make_moe_gpt(tied=True)))}


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_grouped_experts_and_ep_fsdp_equal_one_process_in_float64(threads, ulps):
    out = run_check(__file__, "check", threads, ulps)
    print(f"{threads} thread(s), {ulps} ulp:", out)
    for name, r in out.items():
        assert r["same routes"] and r["margin"] > MARGIN, (name, r)
        assert r["gap"] < TOL, (name, r)
    assert out["capacity"]["sent"] < W * BATCH * SEQ * K == out["2-D"]["sent"], "capacity drops, dropless not"


def test_the_bound_fails_for_float32_and_no_divide_factor_and_the_margin_for_a_tie():
    out = run_check(__file__, "check_what_the_bound_catches", 1, 0)
    print({k: v if isinstance(v, dict) else v[:200] for k, v in out.items()})
    assert out["float32"]["gap"] > TOL, "float32's rounding alone exceeds the bound"
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in out["float32 with a divide factor on gloo"]
    assert abs(out["no divide factor"]["gap"] - (EP - 1)) < 1e-9, "experts' gradients EP times too large"
    assert out["tied router"]["margin"] < MARGIN, "an exact tie shows as a zero margin, which the notebook refuses"


def _all_to_all_both_ways(rank, world_size):
    """The same uneven exchange and its backward through AllToAll and through all_to_all_single_autograd."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from helpers.moe import AllToAll

    send = [[1, 3], [2, 0]][rank]  # rows this rank sends to ranks 0 and 1
    recv = [send_of[rank] for send_of in ([1, 3], [2, 0])]
    rows = torch.arange(sum(send) * 3, dtype=torch.float64).view(-1, 3).add(100 * rank).requires_grad_()
    weight = torch.randn(sum(recv), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    mine = AllToAll.apply(rows, send, recv, dist.group.WORLD)
    (grad_mine,) = torch.autograd.grad((mine * weight).sum(), rows)
    theirs = all_to_all_single_autograd(rows, recv, send, dist.group.WORLD)
    (grad_theirs,) = torch.autograd.grad((theirs * weight).sum(), rows)
    return {"rows": torch.equal(mine, theirs), "grads": torch.equal(grad_mine, grad_theirs),
            "received": mine[:, 0].tolist(), "grad zero": bool((grad_mine == 0).all())}


def test_the_hand_written_all_to_all_equals_torch_s_autograd_functional_collective():
    from helpers.launch import launch

    out = launch(_all_to_all_both_ways, 2, quiet=True, progress=False, backend="gloo")
    print(out)
    for r in out:
        assert r["rows"] and r["grads"] and not r["grad zero"], r
    assert out[0]["received"] == [0.0, 100.0, 103.0]  # rank 0's first row, then rank 1's two
    assert out[1]["received"] == [3.0, 6.0, 9.0]  # rank 0's last three rows; rank 1 keeps none of its own
