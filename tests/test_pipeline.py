"""Pipelines that run, at test size: the code of notebooks 10 and 11 (exported into helpers.pipeline), on the GPT.
Every backward pass happens in a launched rank: a backward here would poison later GPU forks."""

import ast
import functools
import inspect
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import models, pipeline, schedules
from helpers.gpt import GPT, GPTConfig
from helpers.launch import RankFailed, launch
from helpers.stages import lm_loss

QUIET = dict(quiet=True, progress=False)
EXACT, TOLERANCE = torch.float64, 1e-10  # the course's equivalence rule (helpers/README.md): float64, < 1e-10
CFG = GPTConfig(n_layer=4, n_head=2, d_model=16, seq_len=8)
ROOT = Path(__file__).resolve().parent.parent
ZBV = ["zbv"] if torch.__version__ >= "2.15" else []  # torch 2.11's ZB-V sends to its own rank: gloo refuses


def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def batch(n=12, steps=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, CFG.vocab_size, (steps, n, CFG.seq_len + 1), generator=g)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in t]


def unsplit_train(rank, world_size, batches, lr):
    torch.manual_seed(0)
    model = GPT(CFG).to(EXACT)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {k: p.detach() for k, p in model.named_parameters()}


def test_split_equals_unsplit_and_every_schedule_equals_it():
    (x, y), = batch()
    for split in (0, 1, 2, 4):  # 0: stage 0 holds only the embeddings; 4: stage 1 only norm and head
        out = launch(functools.partial(pipeline.check_split, split=split, dtype=EXACT), 1, gpt(), x, y, **QUIET)[0]
        assert out["forward_diff"] < TOLERANCE and out["grad_diff"] < TOLERANCE, (split, out)
        assert out["wrong_labels_error"] is None, "both stages share a device here"
        assert sum(r["params"] for r in out["memory"]) == sum(p.numel() for p in gpt().parameters())
        assert out["memory"][0]["sent"] == x.numel() * CFG.d_model * 4  # a float32 (B, T, d) activation
        diffs = launch(functools.partial(pipeline.check_schedules, split=split, micro_counts=(1, 2, 5, 12),
                                         dtype=EXACT), 1, gpt(), x, y, **QUIET)[0]["diffs"]
        assert set(diffs) == {(k, m) for k in schedules.KINDS for m in (1, 2, 5, 12)}
        for key, diff in diffs.items():
            assert diff < TOLERANCE, (split, key, diff)


def test_schedule_gradients_are_not_trivially_equal():
    """The check above can fail: a schedule that drops a micro-batch's loss weight is caught."""
    (x, y), = batch()

    def unweighted(rank, world_size):
        ref, model = pipeline.split_pair(gpt(), 2, ("cpu", "cpu"))
        lm_loss(ref(x), y).backward()
        grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        pipeline.pipeline_step(model, x, y, 4, loss_fn=lambda out, t: lm_loss(out, t) * 4)
        return models.max_param_diff(grads, model.gpt_state(grads=True))

    assert launch(unweighted, 1, **QUIET)[0] > 1e-3


def test_a_split_training_step_equals_the_unsplit_one_and_bad_counts_are_refused():
    (x, y), = batch(8)
    out = launch(functools.partial(pipeline.check_schedules, micro_counts=(1, 4), dtype=EXACT), 1, gpt(), x, y,
                 **QUIET)[0]
    assert out["step_diff"] < TOLERANCE and max(out["diffs"].values()) < TOLERANCE
    with pytest.raises(RankFailed, match="n_micro must be"):
        launch(functools.partial(pipeline.check_schedules, micro_counts=(4,)), 1, gpt(), x[:2], y[:2], **QUIET)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero-bubble", *ZBV])
def test_torch_pipelining_on_two_ranks_trains_as_one_process(schedule):
    batches = batch(8, steps=2)
    ref = launch(unsplit_train, 1, batches, 0.1, **QUIET)[0]
    out = launch(functools.partial(pipeline.pp_train, schedule=schedule), 2, CFG, batches, 0.1, **QUIET)
    assert not set(out[0]) & set(out[1]), "no parameter on both ranks"
    assert models.max_param_diff(ref, {**out[0], **out[1]}) < TOLERANCE  # a missing name raises KeyError
    blocks = [{int(k.split(".")[1]) for k in r if k.startswith("blocks.")} for r in out]
    if schedule in ("gpipe", "1f1b"):
        assert blocks == [{0, 1}, {2, 3}]
    else:  # four stages of one block each: every stage holds parameters
        assert blocks == ([{0, 3}, {1, 2}] if schedule == "zbv" else [{0, 2}, {1, 3}])


def test_cut_gives_every_stage_its_blocks_and_the_ends_to_the_right_ranks():
    model = gpt()
    n, parts = pipeline.cut(model, 0, 2, "zbv")
    assert n == 4 and sorted(parts) == [0, 3]
    assert parts[0].tok is not None and parts[0].head is None and parts[3].head is not None and parts[3].tok is None
    n, parts = pipeline.cut(model, 1, 2, "gpipe", split=3)
    assert n == 2 and list(parts) == [1] and [type(b).__name__ for b in parts[1].blocks][-2:] == ["Identity", "Block"]


def test_torch_s_interleaved_order_has_the_papers_bubble():
    """The order torch runs for interleaved 1F1B (rank r holds stages r and r + 2), played with the paper's durations,
    idles (p−1)/(v·m) of the ideal time; zero bubble idles less."""

    def orders(rank, world_size, schedule):
        n, parts = pipeline.cut(gpt(), rank, world_size, schedule)
        pipe = pipeline.make_schedule(parts, n, torch.device("cpu"), schedule, 4)
        return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                    if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
                for r, acts in pipe.pipeline_order.items()}

    bubbles = {}
    for schedule in ("interleaved", "zero-bubble"):
        order = launch(functools.partial(orders, schedule=schedule), 2, **QUIET)[0]
        assert {r: sorted({st for st, _, _ in acts}) for r, acts in order.items()} == {0: [0, 2], 1: [1, 3]}
        slots = schedules.simulate_ranks(order, {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5})
        busy = sum(t.end - t.start for t in slots)
        bubbles[schedule] = (2 * schedules.makespan(slots) - busy) / busy
    assert bubbles["interleaved"] == pytest.approx((2 - 1) / (2 * 4))
    assert bubbles["zero-bubble"] < bubbles["interleaved"]


def test_the_interleaved_schedule_refuses_a_micro_batch_count_that_is_no_multiple_of_its_rounds():
    with pytest.raises(RankFailed, match="multiple of the number of rounds"):
        launch(functools.partial(pipeline.pp_train, schedule="interleaved", n_micro=5), 2, CFG, batch(10), 0.1,
               **QUIET)


def test_unscaled_gradients_are_the_sum_over_micro_batches():
    """scale_grads=False adds the M micro-batch gradients: one SGD step at lr / M equals the scaled step at lr."""
    batches = batch(8)
    scaled = launch(functools.partial(pipeline.pp_train, split=2), 2, CFG, batches, 0.1, **QUIET)
    summed = launch(functools.partial(pipeline.pp_train, split=2, scale_grads=False), 2, CFG, batches, 0.1 / 4, **QUIET)
    assert models.max_param_diff({**scaled[0], **scaled[1]}, {**summed[0], **summed[1]}) < TOLERANCE
    wrong = launch(functools.partial(pipeline.pp_train, split=2, scale_grads=False), 2, CFG, batches, 0.1, **QUIET)
    assert models.max_param_diff({**scaled[0], **scaled[1]}, {**wrong[0], **wrong[1]}) > 1e-4


def test_model_and_data_parallel_equal_one_big_batch():
    (x, y), = batch(3 * 4 * 2)  # 3 steps of 2 ranks × 4 sequences
    data = TensorDataset(x, y)
    out = launch(functools.partial(pipeline.hybrid_steps, cfg=CFG, split=2, dtype=EXACT), 2, data, 3, 4, 0.1,
                 init=False, **QUIET)
    ref = launch(unsplit_train, 1, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)], 0.1, **QUIET)[0]
    assert models.max_param_diff(ref, out[0]["params"]) < TOLERANCE
    assert models.max_param_diff(out[0]["params"], out[1]["params"]) == 0.0


def test_hybrid_steps_is_the_notebook_s_solution_word_for_word():
    """helpers.pipeline.hybrid_steps is a copy of notebook 11's solution to exercise 4 (a solution is not exported)."""
    cells = json.loads((ROOT / "notebooks" / "11-pipelines.ipynb").read_text())["cells"]
    src = next("".join(c["source"]) for c in cells if "def hybrid_steps" in "".join(c["source"]))
    in_cell = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "hybrid_steps")
    in_helpers = ast.parse(inspect.getsource(pipeline.hybrid_steps)).body[0]
    assert ast.dump(in_cell) == ast.dump(in_helpers), "edit the solution cell, then copy it into helpers/pipeline.py"


def test_the_perfect_pipeline_formula_on_11_s_page_is_the_simulated_gpipe_step():
    """11 writes a perfect pipeline's step as (sum of stage times + (M − 1) × slowest) / M; the simulator of notebook
    10 (predict_step: stage times split into M passes, a third forward) must give the same for any stage times."""
    cells = json.loads((ROOT / "notebooks" / "11-pipelines.ipynb").read_text())["cells"]
    assert any("(sum(t_stage) + (m - 1) * max(t_stage)) / m" in "".join(c["source"]) for c in cells)
    g = torch.Generator().manual_seed(0)
    for stages in (2, 3, 4):
        for m in (1, 2, 3, 8, 16):
            t = (torch.rand(stages, generator=g, dtype=torch.float64) * 0.05 + 1e-3).tolist()
            assert (sum(t) + (m - 1) * max(t)) / m == pytest.approx(schedules.predict_step(t, m), rel=1e-12)
    # a wrong formula (the slowest stage times M, say) is told apart
    assert (0.01 + 0.03) / 4 != pytest.approx(schedules.predict_step([0.01, 0.03], 4), rel=1e-12)


def test_cut_ignores_split_where_a_rank_holds_two_stages():
    """11's first check passes split=2 to every schedule: with two stages a rank the blocks are shared out equally."""
    for schedule in ("interleaved", "zbv"):
        n, parts = pipeline.cut(gpt(), 0, 2, schedule, split=2)
        held = sorted(i for part in parts.values() for i, b in enumerate(part.blocks) if not isinstance(b, torch.nn.Identity))
        assert n == 4 and len(held) == 2
    n, parts = pipeline.cut(gpt(), 0, 2, "gpipe", split=1)
    assert [i for i, b in enumerate(parts[0].blocks) if not isinstance(b, torch.nn.Identity)] == [0]
