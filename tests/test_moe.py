"""Notebook 22's mixture of experts in one process (helpers/moe.py): the router's top-k and weights, the capacity
cut and its order, Switch's load-balancing loss, and the MoE's output against a per-token sum."""

import math

import torch

from helpers import gpt
from helpers.moe import MoE, route


def test_weights_are_the_renormalised_top_k_probabilities():
    logits = torch.randn(50, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weights, experts, keep, _ = route(logits, 2, 10.0)
    probs = logits.softmax(-1)
    top = probs.gather(1, experts)
    assert torch.allclose(weights, top / top.sum(1, keepdim=True), atol=0, rtol=1e-15)
    assert torch.allclose(weights.sum(1), torch.ones(50, dtype=torch.float64))
    assert torch.equal(experts[:, 0], probs.argmax(1)) and keep.all()  # capacity 10·50·2/6 ≥ 50: nothing dropped


def test_capacity_keeps_first_choices_first_then_token_order():
    T, E, k, cf = 8, 4, 2, 1.0
    capacity = math.ceil(cf * T * k / E)  # 4
    logits = torch.zeros(T, E, dtype=torch.float64)
    logits[:, 0] = torch.tensor([2.0] * 4 + [1.0] * 4)  # expert 0: first choice of tokens 0-3 ...
    logits[:4, 1] = 1.0  # ... whose second choice is expert 1
    logits[4:, 1] = 2.0  # tokens 4-7: expert 1 first, expert 0 second
    weights, experts, keep, _ = route(logits, k, cf)
    assert experts[:4, 0].eq(0).all() and experts[4:, 1].eq(0).all()
    kept = torch.bincount(experts[keep], minlength=E)
    assert kept.tolist() == [capacity, capacity, 0, 0]
    assert keep[:, 0].all() and not keep[:, 1].any()  # 8 first choices fill both queues; every second is dropped


def test_no_drops_when_the_capacity_covers_every_token_and_drops_counted_otherwise():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) + torch.linspace(0, 4, 8)
    assert route(logits, 2, 8 / 2)[2].all()  # capacity ⌈T⌉: every expert can take every token
    _, experts, keep, _ = route(logits, 2, 1.0)
    routed, kept = torch.bincount(experts.flatten(), minlength=8), torch.bincount(experts[keep], minlength=8)
    assert torch.equal(kept, routed.clamp(max=math.ceil(64 * 2 / 8))) and (~keep).sum() == (routed - kept).sum() > 0


def test_the_balancing_loss_is_one_when_uniform_and_more_when_skewed():
    assert abs(route(torch.zeros(40, 8, dtype=torch.float64), 2, 1.0)[3].item() - 1) < 1e-12
    g = torch.Generator().manual_seed(2)
    assert route(torch.randn(40, 8, generator=g) + torch.linspace(0, 3, 8), 2, 1.0)[3] > 1
    one_expert = torch.randn(40, 8, dtype=torch.float64, generator=g)
    one_expert[:, 0] += 60
    assert abs(route(one_expert, 1, 1.0)[3].item() - 8) < 1e-9  # f₀ = P₀ = 1: E


def test_the_balancing_loss_has_a_gradient_through_the_probabilities_only():
    logits = torch.zeros(10, 4, dtype=torch.float64, requires_grad=True)
    route(logits, 2, 1.0)[3].backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_the_moe_adds_each_kept_expert_s_output_times_its_weight():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(d_model=16, n_head=2)
    moe = MoE(cfg, 4, 2, 0.75).to(torch.float64)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        y = moe(x).reshape(-1, 16)
        weights, experts, keep, _ = route(moe.router(x.reshape(-1, 16)), 2, 0.75)
        expected = torch.zeros_like(y)
        for t, token in enumerate(x.reshape(-1, 16)):
            for s in range(2):
                if keep[t, s]:
                    expected[t] += weights[t, s] * moe.experts[experts[t, s]](token)
    assert (~keep).any(), "capacity 0.75 must drop something here"
    assert torch.equal(moe.routed, experts.masked_fill(~keep, -1))
    assert (y - expected).abs().max() < 1e-14


def test_the_moe_replaces_the_gpt_s_mlp():
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)
    model = gpt.GPT(cfg)
    for block in model.blocks:
        block.mlp = MoE(cfg, 4, 2, 1.0)
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256) and all(b.mlp.aux_loss > 0 for b in model.blocks)


def test_the_all_to_all_figure_is_what_route_draws():
    """notebooks/figures/ep-all-to-all.svg is scripts/figure_ep_all_to_all.py's drawing of route()'s own output."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "figure_ep_all_to_all.py"
    spec = importlib.util.spec_from_file_location("figure_ep_all_to_all", script)
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    assert figure.OUT.read_text() == figure.svg(), "run: python scripts/figure_ep_all_to_all.py"
    for experts, keep in figure.routed():  # the figure shows drops, and every one of them is a capacity's
        assert (~keep).sum() >= 1
        capacity = -(-int(figure.CAPACITY_FACTOR * figure.TOKENS * figure.K) // figure.EXPERTS)
        kept = experts[keep]
        assert all((kept == e).sum() <= capacity for e in range(figure.EXPERTS))
