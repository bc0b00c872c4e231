"""The GPT cut in stages (exported from notebook 10), the stage planners (GPU counts mocked), schedules on paper."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import schedules, stages  # noqa: E402
from helpers.gpt import GPT, GPTConfig  # noqa: E402


@pytest.mark.parametrize("n_gpus, expect, kind", [
    (0, ["cpu", "cpu"], "cpu"),
    (1, ["cuda:0", "cuda:0"], "one-gpu"),
    (2, ["cuda:0", "cuda:1"], "multi-gpu"),
    (4, ["cuda:0", "cuda:1"], "multi-gpu"),
])
def test_stage_planner_puts_stages_where_gpus_exist(n_gpus, expect, kind):
    plan = stages.plan_stages(2, n_gpus=n_gpus)
    assert [str(d) for d in plan.devices] == expect and plan.kind == kind
    assert ("cannot overlap" in plan.sentence) == (kind != "multi-gpu"), plan.sentence


def test_stage_planner_for_four_stages_and_bad_counts():
    assert [str(d) for d in stages.plan_stages(4, n_gpus=4).devices] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert stages.plan_stages(4, n_gpus=2).kind == "one-gpu"
    with pytest.raises(ValueError, match="n_stages"):
        stages.plan_stages(0, n_gpus=2)
    with pytest.raises(ValueError, match="n_gpus"):
        stages.plan_stages(2, n_gpus=-1)


@pytest.mark.parametrize("n_gpus, expect, backend", [
    (0, [["cpu", "cpu"], ["cpu", "cpu"]], "gloo"),
    (1, [["cuda:0", "cuda:0"], ["cuda:0", "cuda:0"]], "gloo"),
    (2, [["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]], "nccl"),
    (3, [["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]], "nccl"),
    (4, [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], "nccl"),
])
def test_hybrid_planner_gives_each_rank_its_stage_devices(n_gpus, expect, backend):
    plan = stages.plan_hybrid(2, 2, n_gpus=n_gpus)
    assert [[str(d) for d in rank] for rank in plan.devices] == expect
    assert plan.backend == backend and plan.world_size == 2
    # NCCL only where no GPU belongs to two ranks
    owners = {}
    for r, devs in enumerate(plan.devices):
        for d in devs:
            owners.setdefault(d, set()).add(r)
    assert (backend == "nccl") == all(d.type == "cuda" and len(rs) == 1 for d, rs in owners.items())
    assert ("real model parallelism" in plan.sentence) == (n_gpus >= 4), plan.sentence


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, d_model=16, seq_len=8))


def test_two_stage_forward_equals_the_gpt_without_autograd():
    model = _gpt().eval()
    x = torch.randint(0, 256, (3, 8))
    with torch.no_grad():
        ref = model(x)
        for k in range(5):  # every split: embeddings + blocks 0..k−1 | the rest + head
            two = stages.TwoStage(model, k)
            assert torch.equal(two(x), ref), k
            assert {n: v.shape for n, v in two.gpt_state().items()} == {n: p.shape for n, p in model.named_parameters()}


def test_a_gpt_stage_keeps_its_blocks_and_its_gpt_names():
    model = _gpt()
    middle = stages.gpt_stage(model, range(1, 3), first=False, last=False)
    assert middle.tok is None and middle.pos is None and middle.norm is None and middle.head is None
    assert [type(b).__name__ for b in middle.blocks] == ["Identity", "Block", "Block", "Identity"]
    assert {k for k, _ in middle.named_parameters()} == {k for k, _ in model.named_parameters()
                                                         if k.startswith(("blocks.1.", "blocks.2."))}
    first = stages.gpt_stage(model, range(0), first=True, last=False)  # the embeddings alone: still parameters
    assert {k.split(".")[0] for k, _ in first.named_parameters()} == {"tok", "pos"}
    assert model.blocks[1] is not middle.blocks[1], "a copy: the model keeps its own blocks"


def test_two_stage_refuses_bad_splits():
    for bad, error in ((-1, ValueError), (5, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="split must be"):
            stages.TwoStage(_gpt(), bad)


@pytest.mark.parametrize("n_gpus, expect, kind", [
    (0, ["cpu", "cpu"], "cpu"),
    (1, ["cpu", "cpu"], "cpu"),
    (2, ["cuda:0", "cuda:1"], "multi-gpu"),
    (3, ["cuda:0", "cuda:1"], "multi-gpu"),
])
def test_pipeline_ranks_and_their_stage_times_share_one_device(n_gpus, expect, kind, monkeypatch):
    """Issue: on one GPU the pipeline ranks ran on the CPU while the stage times behind the "perfect pipeline"
    came from cuda:0. Now each rank times its own stage on the device the plan gives it; with one GPU that is the
    CPU for both the pipeline and its stage times, never a mix."""
    plan = stages.plan_pipeline(2, n_gpus=n_gpus)
    assert [str(d) for d in plan.devices] == expect and plan.kind == kind
    monkeypatch.setattr(stages, "gpu_count", lambda: n_gpus)
    assert stages.plan_pipeline(2).devices == plan.devices  # what pp_rank reads in each rank
    if n_gpus == 1:
        assert "CPU" in plan.sentence and "measured on CPU" in plan.sentence
        # the one-process plan of notebook 10 would put both stages on the GPU: a different device
        assert stages.plan_stages(2).devices != plan.devices


def test_stage_seconds_times_a_stage_on_its_device():
    two = stages.TwoStage(_gpt(), 2)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        h = two.stage0(x)
    assert stages.stage_seconds(two.stage0, x, None, "cpu", rounds=2) > 0
    assert stages.stage_seconds(two.stage1, h, x, "cpu", rounds=2) > 0
    assert two.stage1.head.weight.grad is not None


def test_plot_sweep_draws_rows_as_11_builds_them():
    rows = [dict(m=m, ms=ms, lo=lo, hi=hi, bubble=schedules.bubble_fraction(2, m), ideal=ideal, with_cost=ideal + m)
            for m, ms, lo, hi, ideal in [(1, 31.0, 30.0, 32.0, 30.0), (4, 21.0, 20.0, 22.0, 18.75)]]
    fig = schedules.plot_sweep(rows, "test")
    assert fig.axes and fig.axes[0].get_title() == "test"


def test_bubble_formula_is_the_simulated_idle_time():
    for S in (2, 3, 4):
        for M in (1, 2, 4, 8):
            slots = schedules.simulate(schedules.programs("gpipe", S, M), fwd=1, bwd=2)
            assert schedules.idle_fraction(slots) == pytest.approx(schedules.bubble_fraction(S, M))
            assert schedules.makespan(slots) == pytest.approx(3 * (M + S - 1))
            one = schedules.simulate(schedules.programs("1f1b", S, M), fwd=1, bwd=2)
            assert schedules.makespan(one) == pytest.approx(schedules.makespan(slots)), "same bubble"
            assert schedules.predict_step([3.0] * S, M) == pytest.approx(3.0 * (M + S - 1) / M)


def test_in_flight_activations_gpipe_holds_all_1f1b_holds_stages():
    S, M = 4, 8
    assert schedules.in_flight(schedules.simulate(schedules.programs("gpipe", S, M))) == [M] * S
    assert schedules.in_flight(schedules.simulate(schedules.programs("1f1b", S, M))) == [S - s for s in range(S)]


def test_programs_each_micro_batch_once_and_deadlock_detected():
    for kind in schedules.KINDS:
        for prog in schedules.programs(kind, 3, 5):
            assert sorted(prog) == sorted([("F", i) for i in range(5)] + [("B", i) for i in range(5)])
    with pytest.raises(ValueError, match="deadlock"):
        schedules.simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="kind"):
        schedules.programs("zero-bubble", 2, 2)


def test_table_and_timeline_show_the_schedule():
    slots = schedules.simulate(schedules.programs("gpipe", 2, 2), fwd=1, bwd=1)
    text = schedules.table(slots)
    rows = [line.split()[2:] for line in text.splitlines()]
    assert rows == [["F0", "F1", ".", ".", "B0", "B1"], [".", "F0", "F1", "B0", "B1", "."]], text
    ax = schedules.draw_timeline(slots, "GPipe")
    assert len(ax.collections) == len(slots) and "idle" in ax.get_title()


def test_notebook_10_header_says_where_its_ranks_run_with_one_gpu(monkeypatch):
    """Issue 26.11: the header said "1 GPU ✓ (stages on the CPU)" while the DDP replicas share cuda:0. The header
    now names both routes; with one GPU (mocked) the planners must give exactly what it says."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / "11-pipelines.ipynb").read_text())
    runs_on = next(line for line in "".join(nb["cells"][0]["source"]).splitlines() if line.startswith("Runs on:"))
    assert "1 GPU ✓ (pipeline ranks on the CPU; the two DDP replicas share the GPU)" in runs_on, runs_on
    monkeypatch.setattr(stages, "gpu_count", lambda: 1)
    assert {d.type for d in stages.plan_pipeline(2).devices} == {"cpu"}
    hybrid = stages.plan_hybrid(2, 2)
    assert {str(d) for rank in hybrid.devices for d in rank} == {"cuda:0"} and hybrid.backend == "gloo"


def test_simulate_ranks_plays_one_stage_per_rank_as_simulate_does():
    for kind in schedules.KINDS:
        progs = schedules.programs(kind, 3, 5)
        orders = {s: [(s, op, mb) for op, mb in prog] for s, prog in enumerate(progs)}
        got = schedules.simulate_ranks(orders, {"F": 1.0, "B": 2.0})
        want = schedules.simulate(progs, 1.0, 2.0)
        assert [(t.stage, t.op, t.mb, t.start, t.end) for t in got] == [tuple(t)[:5] for t in want]


def test_simulate_ranks_follows_stage_dependencies_across_ranks_and_w_after_i():
    # two stages per rank, interleaved placement (stage s on rank s % 2), one micro-batch, backward split in I and W
    orders = {0: [(0, "F", 0), (2, "F", 0), (2, "I", 0), (2, "W", 0), (0, "I", 0), (0, "W", 0)],
              1: [(1, "F", 0), (3, "F", 0), (3, "I", 0), (1, "I", 0), (3, "W", 0), (1, "W", 0)]}
    slots = {(t.chunk, t.op): t for t in schedules.simulate_ranks(orders, {"F": 1, "I": 1, "W": 1})}
    assert [slots[(s, "F")].start for s in range(4)] == [0, 1, 2, 3]  # the forward crosses the ranks in stage order
    assert slots[(3, "I")].start == 4 and slots[(2, "I")].start == 5  # stage 2's I waits for stage 3's
    assert slots[(1, "I")].start == 6 and slots[(0, "I")].start == 7
    assert all(slots[(s, "W")].start >= slots[(s, "I")].end for s in range(4))
    assert slots[(3, "W")].start == 7  # rank 1 ran 1I at 6, then 3W: a W fills the time the rank would wait
    with pytest.raises(ValueError, match="deadlock"):
        schedules.simulate_ranks({0: [(0, "W", 0), (0, "F", 0), (0, "I", 0)]}, {"F": 1, "I": 1, "W": 1})
