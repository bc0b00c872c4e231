"""Notebook 24's mixture of experts in one process (helpers/moe.py): the router's top-k and weights, the capacity
cut and its order, dropless routing, DeepSeek-V3's bias, Switch's load-balancing loss, the grouped experts against a
loop, the MoE's output against a per-token sum, and the bias update."""

import math

import torch

from helpers import gpt
from helpers.moe import MoE, Experts, route, update_bias


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


def test_no_drops_when_the_capacity_covers_every_token_or_dropless_and_drops_counted_otherwise():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) + torch.linspace(0, 4, 8)
    assert route(logits, 2, 8 / 2)[2].all()  # capacity ⌈T⌉: every expert can take every token
    assert route(logits, 2)[2].all()  # dropless
    _, experts, keep, _ = route(logits, 2, 1.0)
    routed, kept = torch.bincount(experts.flatten(), minlength=8), torch.bincount(experts[keep], minlength=8)
    assert torch.equal(kept, routed.clamp(max=math.ceil(64 * 2 / 8))) and (~keep).sum() == (routed - kept).sum() > 0
    assert torch.equal(route(logits, 2)[1], experts)  # the cut changes what is kept, not what is chosen


def test_the_bias_picks_the_experts_and_never_weighs_them():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 4, dtype=torch.float64, generator=g)
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0], dtype=torch.float64)  # more than any probability difference
    weights, experts, _, aux = route(logits, 2, bias=bias)
    probs = logits.softmax(-1)
    assert (experts[:, 0] == 3).all()
    assert torch.equal(experts[:, 1], probs[:, :3].argmax(1))  # the second: the most probable of the rest
    chosen = probs.gather(1, experts)
    assert torch.allclose(weights, chosen / chosen.sum(1, keepdim=True), rtol=1e-15, atol=0)
    f = torch.bincount(experts.T.reshape(-1), minlength=4).double() / 80
    assert abs(aux.item() - 4 * (f * probs.mean(0)).sum().item()) < 1e-14  # the loss counts the biased choice


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


def _loop(experts, rows, counts):
    """Each expert's rows through its own matmuls, one expert after another."""
    return torch.cat([torch.nn.functional.gelu(r @ experts.up[i] + experts.up_bias[i]) @ experts.down[i]
                      + experts.down_bias[i] for i, r in enumerate(rows.split(counts.tolist()))])


def test_the_grouped_experts_equal_a_loop_forward_and_backward_with_an_idle_expert():
    torch.manual_seed(0)
    experts = Experts(5, 16, 24).to(torch.float64)
    counts = torch.tensor([3, 0, 7, 1, 4])
    rows = torch.randn(int(counts.sum()), 16, dtype=torch.float64, requires_grad=True)
    grouped = experts(rows, counts)
    grads = torch.autograd.grad(grouped.square().sum(), [rows, *experts.parameters()])
    loop = _loop(experts, rows, counts)
    loop_grads = torch.autograd.grad(loop.square().sum(), [rows, *experts.parameters()])
    assert (grouped - loop).abs().max() < 1e-13 * loop.abs().max()
    for a, b in zip(grads, loop_grads):
        assert (a - b).abs().max() <= 1e-13 * b.abs().max()
    assert grads[1][1].abs().max() == 0  # expert 1 got no rows: no gradient from the padding


def test_the_grouped_experts_are_initialised_as_nn_linear_is():
    torch.manual_seed(0)
    experts = Experts(64, 16, 48)
    assert experts.up.abs().max() <= 16**-0.5 and experts.down.abs().max() <= 48**-0.5
    assert experts.up.abs().max() > 0.9 * 16**-0.5  # uniform up to the bound, as nn.Linear's kaiming_uniform(a=√5)


def test_the_moe_adds_each_kept_expert_s_output_times_its_weight_and_the_shared_expert():
    torch.manual_seed(0)
    for cf in (None, 0.75):
        moe = MoE(16, 4, 2, 32, 24, capacity_factor=cf).to(torch.float64)
        x = torch.randn(2, 12, 16, dtype=torch.float64)
        with torch.no_grad():
            y = moe(x).reshape(-1, 16)
            tokens = x.reshape(-1, 16)
            weights, experts, keep, _ = route(moe.router(tokens), 2, cf)
            expected = _loop(moe.shared, tokens, torch.tensor([24]))
            for t, token in enumerate(tokens):
                for s in range(2):
                    if keep[t, s]:
                        e = int(experts[t, s])
                        one = torch.zeros(4, dtype=torch.long)
                        one[e] = 1
                        expected[t] += weights[t, s] * _loop(moe.experts, token[None], one)[0]
        assert (cf is None) == bool(keep.all()), "capacity 0.75 must drop something here; dropless nothing"
        assert torch.equal(moe.routed, experts.masked_fill(~keep, -1))
        assert torch.equal(moe.load, torch.bincount(experts[keep], minlength=4).double())
        assert (y - expected).abs().max() < 1e-13


def test_update_bias_steps_each_expert_toward_the_mean_load_and_resets_it():
    moe = MoE(8, 4, 1, 8, bias_rate=0.5)
    moe.load.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5: expert 0 above, the rest below
    update_bias(moe)
    step = 0.5 * torch.tensor([-1.0, 1.0, 1.0, 1.0])
    assert torch.allclose(moe.bias, step - step.mean()) and abs(moe.bias.sum()) < 1e-7
    assert moe.load.abs().sum() == 0
    moe.bias_rate = 0.0
    before = moe.bias.clone()
    moe.load.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    update_bias(moe)
    assert torch.equal(moe.bias, before) and moe.load.abs().sum() == 0


def test_the_bias_balances_a_skewed_router_over_steps():
    """The controller alone, no gradient: a router that prefers expert 0 is evened out by the bias."""
    torch.manual_seed(0)
    moe = MoE(16, 4, 1, 8, bias_rate=0.02)
    with torch.no_grad():
        moe.router.weight[0] += 0.2
        x = torch.randn(128, 16) + 1.0
        loads = []
        for _ in range(100):
            moe(x)
            loads.append(moe.load.clone())
            update_bias(moe)
    first, last = loads[0], torch.stack(loads[-20:]).mean(0)  # the controller dithers by a step: a mean over 20
    assert first.max() / first.mean() > 2 and last.max() / last.mean() < 1.2, (first, last)


def test_no_shared_expert_unless_given_a_width():
    assert MoE(8, 4, 2, 8).shared is None and len(MoE(8, 4, 2, 8, 12).shared.up) == 1


def test_the_moe_replaces_the_gpt_s_mlp():
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)
    model = gpt.GPT(cfg)
    for block in model.blocks:
        block.mlp = MoE(cfg.d_model, 4, 2, 32, 16)
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256) and all(b.mlp.aux_loss > 0 for b in model.blocks)
    assert all(int(b.mlp.load.sum()) == 2 * 8 * 2 for b in model.blocks)  # dropless: every assignment counted


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


def test_torch_s_public_grouped_mm_equals_the_loop_in_float32_and_refuses_float64():
    """Notebook 24 pads instead of calling F.grouped_mm (public since 2.11) because its checks run in float64."""
    import pytest
    import torch.nn.functional as F

    torch.manual_seed(0)
    rows, weights = torch.randn(16, 8), torch.randn(4, 8, 8)
    counts = torch.tensor([5, 0, 9, 2])
    out = F.grouped_mm(rows, weights, offs=counts.cumsum(0).to(torch.int32))
    loop = torch.cat([r @ weights[i] for i, r in enumerate(rows.split(counts.tolist()))])
    assert torch.allclose(out, loop, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="Double"):
        F.grouped_mm(rows.double(), weights.double(), offs=counts.cumsum(0).to(torch.int32))
