"""Pipeline schedules on paper: who runs which micro-batch when, the bubble, the activations in flight.

A schedule is one *program* per stage: the order in which that stage runs
forward (F) and backward (B) passes of micro-batches. ``simulate`` plays the
programs with the real dependencies (F of stage s needs stage s-1's F of the
same micro-batch; B needs the next stage's B) and given durations, which gives
the timeline, the idle time and the peak number of micro-batches whose
activations a stage holds.
"""

from __future__ import annotations

from typing import NamedTuple

from .checks import positive_int

# KINDS and programs (the GPipe and 1F1B orders) are written in notebooks/10-model-parallel.ipynb and exported into
# the region at the end of this file.

class Slot(NamedTuple):
    """One pass of one micro-batch on one stage, with its start and end time.

    Machinery behind simulate's timelines; no notebook calls it directly.
    """

    stage: int
    op: str      # "F" or "B"
    mb: int
    start: float
    end: float
    chunk: int = 0  # the model stage it ran, where a rank holds several (simulate_ranks); else 0


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """(S−1)/(M+S−1): the share of a balanced GPipe step each device spends idle.

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    positive_int("n_stages", n_stages)
    positive_int("n_micro", n_micro)
    return (n_stages - 1) / (n_micro + n_stages - 1)


def _per_stage(value, n_stages: int) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n_stages
    if len(values) != n_stages:
        raise ValueError(f"need one duration per stage ({n_stages}), got {values}")
    return [float(v) for v in values]


def simulate(progs, fwd=1.0, bwd=2.0) -> list[Slot]:
    """Play the stages' programs; ``fwd``/``bwd`` are one micro-batch's durations (one number, or one per stage).

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    S = len(progs)
    fwd, bwd = _per_stage(fwd, S), _per_stage(bwd, S)
    done: dict[tuple[str, int, int], float] = {}   # (op, stage, mb) -> end time
    free = [0.0] * S                               # when each stage is next idle
    nxt = [0] * S                                  # index of each stage's next pass
    slots = []
    while any(nxt[s] < len(progs[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while nxt[s] < len(progs[s]):
                op, mb = progs[s][nxt[s]]
                if op == "F":
                    dep = ("F", s - 1, mb) if s > 0 else None
                else:
                    dep = ("B", s + 1, mb) if s < S - 1 else ("F", s, mb)
                if dep is not None and dep not in done:
                    break  # waits for another stage
                start = max(free[s], done.get(dep, 0.0))
                end = start + (fwd[s] if op == "F" else bwd[s])
                done[(op, s, mb)] = free[s] = end
                slots.append(Slot(s, op, mb, start, end))
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("these programs deadlock: a pass waits for one that never runs before it")
    return sorted(slots, key=lambda t: (t.start, t.stage))


def simulate_ranks(orders, durations) -> list[Slot]:
    """Play each rank's order of passes (stage, op, micro-batch), op in F, B, I (input grad), W (weight grad).

    ``orders``: {rank: [(stage, op, mb), ...]}, e.g. a torch schedule's ``pipeline_order``; ``durations``: one pass of
    one stage, per op. F needs the previous stage's F; B or I needs the next stage's B or I (the last stage: its
    own F); W needs its own stage's I. A Slot's ``stage`` is the rank, its ``chunk`` the model stage.
    Introduced in notebooks/11-pipelines.ipynb.
    """
    ranks = sorted(orders)
    last = max(s for r in ranks for s, _, _ in orders[r])
    done: dict[tuple[str, int, int], float] = {}   # ("F" or "G" (input grad) or "W", stage, mb) -> end time
    free, nxt, slots = dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0), []
    while any(nxt[r] < len(orders[r]) for r in ranks):
        progressed = False
        for r in ranks:
            while nxt[r] < len(orders[r]):
                s, op, mb = orders[r][nxt[r]]
                dep = {"F": ("F", s - 1, mb) if s > 0 else None, "W": ("G", s, mb)}.get(
                    op, ("F", s, mb) if s == last else ("G", s + 1, mb))
                if dep is not None and dep not in done:
                    break  # waits for another pass
                start = max(free[r], done.get(dep, 0.0))
                free[r] = end = start + durations[op]
                done[("G" if op in "BI" else op, s, mb)] = end
                slots.append(Slot(r, op, mb, start, end, s))
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("these orders deadlock: a pass waits for one that never runs before it")
    return sorted(slots, key=lambda t: (t.start, t.stage))


def makespan(slots: list[Slot]) -> float:
    """The time the last pass ends: one training step.

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    return max(t.end for t in slots)


def idle_fraction(slots: list[Slot]) -> float:
    """Share of (stages × step time) in which a stage waits: the measured bubble of a timeline.

    Machinery behind draw_timeline's title (09 computes the same share on its page); no notebook calls it directly.
    """
    n_stages = 1 + max(t.stage for t in slots)
    busy = sum(t.end - t.start for t in slots)
    return 1 - busy / (n_stages * makespan(slots))


def in_flight(slots: list[Slot]) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once (forward done, backward not).

    Machinery behind the schedule tests (09 reads the same count off each program); no notebook calls it directly.
    """
    n_stages = 1 + max(t.stage for t in slots)
    peaks = []
    for s in range(n_stages):
        held = peak = 0
        for t in sorted((t for t in slots if t.stage == s), key=lambda t: t.start):
            held += 1 if t.op == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def table(slots: list[Slot], tick: float = 1.0) -> str:
    """The schedule written out: one row per stage, one column per ``tick``, 'F3' / 'B3' / '.' (idle).

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    n_stages = 1 + max(t.stage for t in slots)
    cols = round(makespan(slots) / tick)
    grid = [["." for _ in range(cols)] for _ in range(n_stages)]
    for t in slots:
        for c in range(round(t.start / tick), round(t.end / tick)):
            grid[t.stage][c] = f"{t.op}{t.mb}"
    width = max(len(cell) for row in grid for cell in row)
    return "\n".join(f"stage {s}: " + " ".join(cell.ljust(width) for cell in row) for s, row in enumerate(grid))


def predict_step(stage_seconds, n_micro: int, kind: str = "gpipe", backward_share: float = 2 / 3) -> float:
    """Step time a perfect pipeline would take, from each stage's time for the whole batch.

    Each stage's time is split into M equal micro-batch passes (a
    ``backward_share`` of it backward) and the schedule simulated; with equal
    stages this is T·(M+S−1)/(M·S), the bubble formula.
    Introduced in notebooks/10-model-parallel.ipynb.
    """
    per = [t / n_micro for t in stage_seconds]
    slots = simulate(programs(kind, len(per), n_micro), [p * (1 - backward_share) for p in per],
                     [p * backward_share for p in per])
    return makespan(slots)


def draw_timeline(slots: list[Slot], title: str = "", ax=None, unit: str = "time", row: str = "stage"):
    """A Gantt chart: one row per stage, forward passes blue, backward orange, micro-batch numbers inside.

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * (1 + max(t.stage for t in slots))))
    colours = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    for t in slots:  # a rank's second model stage (chunk) drawn hatched
        ax.broken_barh([(t.start, t.end - t.start)], (t.stage - 0.4, 0.8), facecolors=colours[t.op],
                       edgecolor="white", hatch="//" if t.chunk >= 1 + max(u.stage for u in slots) else None)
        ax.text((t.start + t.end) / 2, t.stage, f"{t.op}{t.mb}", ha="center", va="center", fontsize=7, color="white")
    n_stages = 1 + max(t.stage for t in slots)
    ax.set_yticks(range(n_stages), [f"{row} {s}" for s in range(n_stages)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(f"{title}  (idle {idle_fraction(slots):.0%})".strip())
    ax.figure.tight_layout()
    return ax


def plot_sweep(rows: list[dict], title: str):
    """Measured step time per M (median and range) beside the perfect pipeline and the bubble fraction.

    Introduced in notebooks/11-pipelines.ipynb.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ms = [r["m"] for r in rows]
    spread = [[r["ms"] - r["lo"] for r in rows], [r["hi"] - r["ms"] for r in rows]]
    ax.errorbar(ms, [r["ms"] for r in rows], yerr=spread, fmt="o-", capsize=3, label="measured step (median, range)")
    ax.plot(ms, [r["ideal"] for r in rows], "s--", label="perfect pipeline, one device per stage")
    if "with_cost" in rows[0]:
        ax.plot(ms, [r["with_cost"] for r in rows], "d-.", color="tab:red", label="perfect + fixed cost per micro-batch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    bub = ax.twinx()
    bub.plot(ms, [r["bubble"] for r in rows], "^:", color="tab:green", label="bubble (S−1)/(M+S−1)")
    bub.set_ylim(0, 1)
    bub.set_ylabel("bubble fraction")
    ax.set_title(title)
    fig.legend(loc="lower center", ncol=2, fontsize="small")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig


# ---- exported from notebooks/10-model-parallel.ipynb: edit it there, then run `make export` ----
KINDS = ("gpipe", "1f1b")


def programs(kind, n_stages, n_micro):
    """Each stage's order of passes, [("F", 0), ...]: GPipe or 1F1B. Introduced in notebooks/10-model-parallel.ipynb."""
    if kind not in KINDS or n_stages < 1 or n_micro < 1:
        raise ValueError(f"need a kind in {KINDS} and counts ≥ 1, got {kind!r}, {n_stages}, {n_micro}")
    progs = []
    for s in range(n_stages):
        if kind == "gpipe":
            prog = [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
        else:
            warm = min(n_stages - 1 - s, n_micro)  # forwards that fill the pipe
            prog = [("F", i) for i in range(warm)]
            for i in range(n_micro - warm):
                prog += [("F", warm + i), ("B", i)]
            prog += [("B", i) for i in range(n_micro - warm, n_micro)]  # drain
        progs.append(prog)
    return progs
# ---- end of export from notebooks/10-model-parallel.ipynb ----
