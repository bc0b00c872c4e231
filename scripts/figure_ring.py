#!/usr/bin/env python
"""Draw notebooks/figures/ring-attention.svg from helpers.ring_attention's own assignment (notebook 23's figure).

Four ranks, 2·4 = 8 sequence chunks. For each layout (contiguous, zig-zag) the figure shows which rank holds each
chunk (``chunks_of``), then the causal score blocks as a grid of query chunk × key chunk: a square for every block
that some rank computes, coloured by that rank and numbered by the ring step at which the K/V it needs arrive. The
squares come from ``blocks(rank, source, W, zigzag)`` with source = (rank − step) mod W, the loop ring_forward runs,
and the per-rank totals beside each grid are those blocks counted. So the figure cannot show a block the ring does
not compute. ``python scripts/figure_ring.py`` rewrites the file; tests/test_ring_attention.py checks that the
committed figure is what this script draws.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers.ring_attention import blocks, chunks_of  # noqa: E402

OUT = ROOT / "notebooks" / "figures" / "ring-attention.svg"
W = 4
COLOURS = ["#2f5f98", "#4c9a4c", "#c0601a", "#8e5aa8"]  # rank 0, 1, 2, 3
CELL = 26


def computed(zigzag: bool) -> dict[tuple[int, int], tuple[int, int, bool]]:
    """{(query chunk, key chunk): (rank, ring step, diagonal)} of every score block the ring computes."""
    out = {}
    for rank in range(W):
        for step in range(W):
            source = (rank - step) % W  # the rank whose K/V this rank holds at this step
            for a, b, diagonal in blocks(rank, source, W, zigzag):
                key = chunks_of(rank, W, zigzag)[a], chunks_of(source, W, zigzag)[b]
                assert key not in out, f"block {key} computed twice"
                out[key] = rank, step, diagonal
    return out


def panel(x0: int, zigzag: bool) -> list[str]:
    name = "zig-zag: rank r holds chunks r and 2W−1−r" if zigzag else "contiguous: rank r holds chunks 2r, 2r+1"
    parts = [f'<text x="{x0}" y="58" font-weight="bold">{name}</text>',
             f'<text x="{x0}" y="80" font-size="11">the sequence, 8 chunks, by the rank that holds them</text>']
    owner = {c: r for r in range(W) for c in chunks_of(r, W, zigzag)}
    for c in range(2 * W):
        x = x0 + 30 + c * CELL
        parts.append(f'<rect x="{x}" y="88" width="{CELL - 2}" height="{CELL - 2}" fill="{COLOURS[owner[c]]}"/>')
        parts.append(f'<text x="{x + 12}" y="105" text-anchor="middle" fill="#ffffff" font-size="11">{c}</text>')
    top = 150
    parts.append(f'<text x="{x0 + 30 + W * CELL}" y="{top - 8}" text-anchor="middle" font-size="11">key chunk</text>')
    parts.append(f'<text x="{x0 + 12}" y="{top + W * CELL}" text-anchor="middle" font-size="11" '
                 f'transform="rotate(-90 {x0 + 12} {top + W * CELL})">query chunk</text>')
    for i in range(2 * W):
        parts.append(f'<text x="{x0 + 24}" y="{top + i * CELL + 17}" text-anchor="end" font-size="10">{i}</text>')
    cells = computed(zigzag)
    for (i, j), (rank, step, diagonal) in sorted(cells.items()):
        x, y = x0 + 30 + j * CELL, top + i * CELL
        parts.append(f'<rect x="{x}" y="{y}" width="{CELL - 2}" height="{CELL - 2}" fill="{COLOURS[rank]}"/>')
        if diagonal:  # masked above its diagonal: the future of each query
            parts.append(f'<path d="M {x} {y} L {x + CELL - 2} {y} L {x + CELL - 2} {y + CELL - 2} z" '
                         f'fill="#ffffff" fill-opacity="0.55"/>')
        parts.append(f'<text x="{x + 8}" y="{y + 19}" text-anchor="middle" fill="#ffffff" font-size="11">'
                     f'{step}</text>')
    for j in range(2 * W):
        parts.append(f'<text x="{x0 + 42 + j * CELL}" y="{top + 2 * W * CELL + 14}" text-anchor="middle" '
                     f'font-size="10">{j}</text>')
    counts = [sum(1 for rank, _, _ in cells.values() if rank == r) for r in range(W)]
    bx = x0 + 30 + 2 * W * CELL + 24
    parts.append(f'<text x="{bx}" y="{top + 6}" font-size="11">blocks a rank computes</text>')
    for r, n in enumerate(counts):
        y = top + 18 + r * 24
        parts.append(f'<rect x="{bx}" y="{y}" width="{n * 7}" height="16" fill="{COLOURS[r]}"/>')
        parts.append(f'<text x="{bx + n * 7 + 4}" y="{y + 12}" font-size="11">rank {r}: {n}</text>')
    return parts


def svg() -> str:
    width, height = 920, 460
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="{width // 2}" y="26" text-anchor="middle" font-size="16" font-weight="bold">Ring attention on '
             f'{W} ranks: who computes each causal score block, and at which ring step</text>']
    parts += panel(20, zigzag=False) + panel(470, zigzag=True)
    y = 150 + 2 * W * CELL + 40
    for i, line in enumerate(("A square: one chunk of queries against one chunk of keys, coloured by the rank that holds "
                              "the queries.",
                              "Its number: the ring step s at which that rank r holds the K/V of rank r − s (step 0: "
                              "its own).",
                              "Pale triangle: a diagonal block's masked future. Blank: every key after every query, "
                              "skipped.")):
        parts.append(f'<text x="{width // 2}" y="{y + 18 * i}" text-anchor="middle">{line}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(svg())
    print(f"wrote {OUT}")
