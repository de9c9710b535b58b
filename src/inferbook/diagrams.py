"""Diagrams drawn by code, where prose struggles: a small SVG writer and the book's few figures.

Each figure is computed from the same numbers the chapter runs (tile grids from the tiler, split plans
from the planner), so it cannot drift from the code. Figures are SVG, displayed in a notebook like a
chart (`image/svg+xml`), transparent so the page's dark mode can invert them.

We write SVG by hand rather than through altair: these are box-and-arrow and grid figures, not data
plots, and a hundred lines of plain SVG are easier to read than a Vega spec that fights its axes.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
INK, MUTED = "#222", "#666"
FILLS = ["#3b6ea5", "#e07b39", "#5a9e6f", "#b5535b", "#7d6bb0", "#8c7a5b", "#d4a017", "#6b8e9e"]
MAX_WIDTH = 660  # px: fits the book's content column (charts.COLUMN_PX)
MIN_TEXT_PX = 11  # no text smaller than this as the page draws it


@dataclass
class Svg:
    width: float
    height: float
    parts: list[str] = field(default_factory=list)

    def rect(self, x, y, w, h, *, fill="none", stroke=INK, opacity=1.0, width=1.0, dash: str | None = None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" '
                          f'fill-opacity="{opacity}" stroke="{stroke}" stroke-width="{width}"{d}/>')

    def text(self, x, y, s, *, size=12, anchor="start", color=INK, weight="normal"):
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-family="{FONT}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{color}" font-weight="{weight}">{html.escape(str(s))}</text>')

    def arrow(self, x1, y1, x2, y2, *, color=INK, label: str = "", dash: str | None = None, above=True):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
                          f'stroke-width="1.5" marker-end="url(#head)"{d}/>')
        if label:
            self.text((x1 + x2) / 2, (y1 + y2) / 2 + (-6 if above else 14), label, size=11, anchor="middle",
                      color=MUTED)

    def render(self) -> str:
        scale = min(1.0, MAX_WIDTH / self.width)
        parts = self.parts
        if scale < 1:  # drawn smaller than written: enlarge the text by as much, so it still reads
            grow = lambda m: f'font-size="{max(float(m.group(1)), MIN_TEXT_PX / scale):.1f}"'
            parts = [re.sub(r'font-size="([\d.]+)"', grow, part) for part in parts]
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width * scale:.0f}" '
                f'height="{self.height * scale:.0f}" viewBox="0 0 {self.width:.0f} {self.height:.0f}">'
                '<defs><marker id="head" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
                f'<path d="M0,0 L8,4 L0,8 z" fill="{INK}"/></marker></defs>' + "".join(parts) + "</svg>")


class Figure:
    """What a notebook cell displays: the SVG (and its caption as alt text for plain-text views)."""

    def __init__(self, svg: Svg, caption: str):
        self.svg, self.caption = svg.render(), caption

    def _repr_mimebundle_(self, include=None, exclude=None):
        # the caption and alt text travel in the output's metadata: the book stages the cell as a numbered figure
        return ({"image/svg+xml": self.svg, "text/plain": self.caption},
                {"inferbook_chart": {"caption": self.caption, "alt": f"Diagram, {self.caption}"}})


def tiles_over_latent(height: int, width: int, tiles: list[tuple[int, int, int, int]], *, overlap: int,
                      batches: list[list[int]] | None = None, title: str = "") -> Figure:
    """Tiles (y0, x0, h, w) over a latent of `height`×`width`, overlaps shaded, batches coloured.

    `batches`: lists of tile indices decoded together (e.g. up to four per tile row)."""
    cell = max(4.0, min(24.0, 520 / max(width, 1), 360 / max(height, 1)))
    pad, top = 20, 36
    svg = Svg(width * cell + 2 * pad + 170, height * cell + top + pad)
    svg.text(pad, 18, title or f"{len(tiles)} tiles over a {height}×{width} latent, overlap {overlap}", size=13,
             weight="bold")
    svg.rect(pad, top, width * cell, height * cell, fill="#f4f4f4", stroke=MUTED)
    color_of = {}
    for b, members in enumerate(batches or [[i] for i in range(len(tiles))]):
        for i in members:
            color_of[i] = FILLS[b % len(FILLS)]
    for i, (y0, x0, h, w) in enumerate(tiles):
        svg.rect(pad + x0 * cell, top + y0 * cell, w * cell, h * cell, fill=color_of.get(i, FILLS[0]), opacity=0.22,
                 stroke=color_of.get(i, FILLS[0]), width=1.5)
        svg.text(pad + x0 * cell + 4, top + y0 * cell + 13 + 13 * (i % 2), f"tile {i}", size=11)
    legend_x = pad + width * cell + 16
    svg.text(legend_x, top + 12, "darker = decoded twice", size=11, color=MUTED)
    svg.text(legend_x, top + 28, "(the overlap, blended)", size=11, color=MUTED)
    for b, members in enumerate(batches or []):
        svg.rect(legend_x, top + 44 + 18 * b, 12, 12, fill=FILLS[b % len(FILLS)], opacity=0.5, stroke="none")
        svg.text(legend_x + 18, top + 54 + 18 * b, f"batch {b}: tiles {', '.join(map(str, members))}", size=11)
    return Figure(svg, f"tiles over a {height}x{width} latent")


def kv_data_path() -> Figure:
    """The host-centred KV data path of tiered offloading: GPU → host DRAM (a cache) → slow tiers, and back."""
    svg = Svg(760, 330)
    svg.text(20, 22, "Host-centred KV tiers: every transfer goes through host DRAM", size=13, weight="bold")
    boxes = {"gpu": (20, 95, 170, 90, "GPU HBM", ["KV blocks of", "running requests"]),
             "host": (300, 95, 200, 90, "Host DRAM", ["a cache with an eviction policy,", "one layout for all TP ranks"]),
             "file": (590, 40, 150, 55, "File system", ["checksummed block files"]),
             "object": (590, 113, 150, 55, "Object store", ["(not built here)"]),
             "peer": (590, 186, 150, 55, "Remote peer", ["a loopback service"])}
    for key, (x, y, w, h, name, sub) in boxes.items():
        svg.rect(x, y, w, h, fill=FILLS[{"gpu": 0, "host": 2}.get(key, 5)], opacity=0.15, stroke=INK)
        svg.text(x + w / 2, y + 22, name, size=12, anchor="middle", weight="bold")
        for i, line in enumerate(sub):
            svg.text(x + w / 2, y + 40 + 14 * i, line, size=10, anchor="middle", color=MUTED)
    svg.arrow(190, 125, 300, 125, label="D2H copy (1)")
    svg.arrow(300, 160, 190, 160, label="reload (3)", dash="4 3", above=False)
    for key in ("file", "object", "peer"):
        x, y, w, h = boxes[key][:4]
        svg.arrow(500, 140, x, y + h / 2, dash="2 3" if key == "object" else None)
    svg.text(545, 262, "writes (2)", size=11, anchor="middle", color=MUTED)
    notes = ["(1) on its own stream; the GPU blocks are freed when the copy's event completes",
             "(2) slow-tier writes continue from the host copy; admission into slow tiers is gated on reuse",
             "(3) GPU blocks are allocated only when the data is ready on the host; the engine keeps stepping"]
    for i, note in enumerate(notes):
        svg.text(20, 282 + 16 * i, note, size=11, color=INK)
    return Figure(svg, "host-centred KV data path")


def split_plans(plans: dict[str, list[list[int]]], *, tile: int, title: str = "") -> Figure:
    """Split-KV plans side by side: for each plan name, one row per sequence, its KV cut into chunks.

    `plans[name][b]` lists the chunk lengths (in tokens) of sequence `b` under that plan; `tile` is the
    KV tile size, drawn as faint ticks, so a reader sees where floating-point partial sums start."""
    rows = max(len(v) for v in plans.values())
    longest = max(sum(c) for v in plans.values() for c in v)
    scale = 520 / max(longest, 1)
    row_h, gap = 16, 6
    block_h = rows * (row_h + gap) + 34
    svg = Svg(720, 30 + block_h * len(plans))
    svg.text(20, 20, title or "How each plan cuts the KV of every sequence into partial sums", size=13, weight="bold")
    for p, (name, seqs) in enumerate(plans.items()):
        y0 = 30 + p * block_h
        svg.text(20, y0 + 16, name, size=12, weight="bold")
        for b, chunks in enumerate(seqs):
            y = y0 + 24 + b * (row_h + gap)
            svg.text(130, y + 12, f"seq {b}", size=10, anchor="end", color=MUTED)
            x = 140.0
            for j, n in enumerate(chunks):
                svg.rect(x, y, n * scale, row_h, fill=FILLS[j % len(FILLS)], opacity=0.35, stroke=INK, width=0.8)
                x += n * scale
            for t in range(tile, sum(chunks), tile):
                svg.rect(140 + t * scale, y, 0.01, row_h, stroke=MUTED, width=0.4)
    return Figure(svg, "split-KV plans")


def w4a16_packings(layouts: dict[str, list[tuple[int, list[str]]]], *, title: str = "") -> Figure:
    """Some 32-bit words of each layout's buffer: which eight 4-bit weights (labelled like 'n0 k3')
    each word holds, nibble by nibble from bit 0. `layouts[name]` lists (word index in memory order,
    eight labels), as the layout's own pack function placed them."""
    words = max(len(w) for w in layouts.values())
    row_h = 34
    block_h = 28 + row_h * words
    svg = Svg(720, 34 + block_h * len(layouts))
    svg.text(20, 22, title or "Words of each buffer by memory index (nibble 0 = bits 0–3, on the left)",
             size=13, weight="bold")
    for i, (name, ws) in enumerate(layouts.items()):
        y0 = 34 + block_h * i
        svg.text(20, y0 + 16, name, size=12, weight="bold")
        for row, (index, nibbles) in enumerate(ws):
            y = y0 + 24 + row_h * row
            svg.text(150, y + 19, f"word {index}", size=10, anchor="end", color=MUTED)
            for j, label in enumerate(nibbles):
                x = 160 + 68 * j
                svg.rect(x, y, 64, 28, fill=FILLS[i % len(FILLS)], opacity=0.2, stroke=INK)
                svg.text(x + 32, y + 18, label, size=11, anchor="middle")
    return Figure(svg, "W4A16 packings")
