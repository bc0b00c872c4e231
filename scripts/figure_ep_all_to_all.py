#!/usr/bin/env python
"""Draw notebooks/figures/ep-all-to-all.svg from helpers.moe.route's own output (notebook 25's figure).

Two ranks, four experts (0, 1 on rank 0; 2, 3 on rank 1), four tokens a rank, top-2 with capacity factor 1: each
rank's router logits come from a seeded generator, ``route()`` says which expert each (token, slot) goes to and
which assignments its capacity drops, and every square, cross and count in the figure is read from that. So the
figure cannot show a drop that one capacity would not make. ``python scripts/figure_ep_all_to_all.py`` rewrites the
file; tests/test_moe.py checks that the committed figure is what this script draws.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from helpers.moe import route  # noqa: E402

OUT = ROOT / "notebooks" / "figures" / "ep-all-to-all.svg"
RANKS, EXPERTS, TOKENS, K, CAPACITY_FACTOR, SEED = 2, 4, 4, 2, 1.0, 6
COLOURS = ["#2f5f98", "#8fb5de", "#c0601a", "#f2b37f"]  # experts 0, 1 (blue: rank 0); 2, 3 (orange: rank 1)
HOME = [e * RANKS // EXPERTS for e in range(EXPERTS)]  # the rank that holds expert e
BOX, GAP = 16, 3


def routed(seed: int = SEED):
    """Per rank: (experts (T, k), keep (T, k), capacity) from route() on seeded logits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(RANKS):
        logits = torch.randn(TOKENS, EXPERTS, generator=g)
        _, experts, keep, _ = route(logits, K, CAPACITY_FACTOR)
        out.append((experts, keep))
    return out


def send_counts(experts, keep) -> list[int]:
    """Rows this rank sends to each rank: its kept assignments whose expert lives there."""
    kept = experts[keep].tolist()
    return [sum(HOME[e] == r for e in kept) for r in range(RANKS)]


def svg() -> str:
    capacity = -(-int(CAPACITY_FACTOR * TOKENS * K) // EXPERTS)
    ranks = routed()
    sends = [send_counts(e, k) for e, k in ranks]
    recvs = [[sends[src][dst] for src in range(RANKS)] for dst in range(RANKS)]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="900" height="450" viewBox="0 0 900 450" '
             f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
             '<rect width="900" height="450" fill="#ffffff"/>',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555555"/></marker></defs>',
             '<text x="450" y="24" text-anchor="middle" font-size="16" font-weight="bold">Expert parallelism on 2 '
             'ranks: experts 0, 1 (blue) on rank 0; 2, 3 (orange) on rank 1</text>',
             '<text x="24" y="52" font-weight="bold">route(): slot 1, slot 2 of each token</text>',
             '<text x="240" y="52" font-weight="bold">kept, sorted by expert</text>',
             '<text x="560" y="52" font-weight="bold">received, by sender</text>',
             '<text x="745" y="52" font-weight="bold">then</text>']

    def box(x, y, expert):
        parts.append(f'<rect x="{x}" y="{y}" width="{BOX}" height="{BOX}" fill="{COLOURS[expert]}" '
                     f'stroke="#333333" stroke-width="0.6"/>')

    def column(x, y, experts):  # a stack of boxes; returns its middle
        for i, e in enumerate(experts):
            box(x, y + i * (BOX + GAP), e)
        return y + max(len(experts), 1) * (BOX + GAP) / 2

    top = [70, 245]  # each rank's band
    middles = {}
    for r, (experts, keep) in enumerate(ranks):
        y0 = top[r]
        parts.append(f'<text x="10" y="{y0 + 40}" font-weight="bold" transform="rotate(-90 10 {y0 + 40})" '
                     f'text-anchor="middle">rank {r}</text>')
        for slot in range(K):
            for t in range(TOKENS):
                x, y = 30 + t * (BOX + GAP), y0 + slot * (BOX + GAP)
                box(x, y, int(experts[t, slot]))
                if not keep[t, slot]:
                    parts.append(f'<path d="M {x - 2} {y - 2} L {x + BOX + 2} {y + BOX + 2} M {x + BOX + 2} {y - 2} '
                                 f'L {x - 2} {y + BOX + 2}" stroke="#d62728" stroke-width="2.5"/>')
        dropped = int((~keep).sum())
        parts.append(f'<text x="30" y="{y0 + 52}" font-size="11" fill="#d62728">top-{K}; capacity {capacity} per '
                     f'expert: {dropped} dropped ✗</text>')
        parts.append(f'<line x1="112" y1="{y0 + 18}" x2="230" y2="{y0 + 18}" stroke="#555555" '
                     f'marker-end="url(#arrow)"/>')
        kept = sorted(experts[keep].tolist())
        y = y0
        for dst in range(RANKS):
            rows = [e for e in kept if HOME[e] == dst]
            middles[r, dst] = column(240, y, rows)
            parts.append(f'<text x="264" y="{middles[r, dst] + 4}" font-size="11">{len(rows)} → rank {dst}</text>')
            y += max(len(rows), 1) * (BOX + GAP) + 10
    for dst in range(RANKS):
        y = top[dst]
        for src in range(RANKS):
            experts, keep = ranks[src]
            rows = sorted(e for e in experts[keep].tolist() if HOME[e] == dst)
            mid = column(560, y, rows)
            a, b = middles[src, dst], mid
            parts.append(f'<path d="M 330 {a} C 445 {a}, 445 {b}, 550 {b}" fill="none" stroke="#555555" '
                         f'marker-end="url(#arrow)"/>')
            parts.append(f'<text x="584" y="{mid + 4}" font-size="11">from rank {src}</text>')
            y += max(len(rows), 1) * (BOX + GAP) + 10
        names = ", ".join(str(e) for e in range(EXPERTS) if HOME[e] == dst)
        parts.append(f'<text x="665" y="{top[dst] + 20}" font-size="11" font-weight="bold">experts {names}</text>')
        parts.append(f'<text x="665" y="{top[dst] + 36}" font-size="11">run on their rows</text>')
        for i, line in enumerate(("the outputs go back by the", "same call, splits swapped;",
                                  "each is weighted and added", "into its token's place")):
            parts.append(f'<text x="745" y="{top[dst] + 86 + 16 * i}" font-size="11">{line}</text>')
    said = "; ".join(f"rank {r} sends {sends[r]} rows and receives {recvs[r]}" for r in range(RANKS))
    parts.append('<text x="450" y="415" text-anchor="middle" font-size="12">all_to_all_single(out, rows, '
                 'output_split_sizes=recv, input_split_sizes=send): uneven splits, after an all_to_all of the '
                 'counts</text>')
    parts.append(f'<text x="450" y="435" text-anchor="middle" font-size="12" fill="#555555">{said} (route() on '
                 f'seeded logits, seed {SEED}); the router decides them anew every step</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(svg())
    print(f"wrote {OUT}")
