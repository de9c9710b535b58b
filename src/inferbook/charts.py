"""One altair theme and the few chart kinds the book uses, rendered offline.

Charts are rendered by vl-convert (no browser, no network) to SVG for HTML and PNG for
PDF; `show(chart)` returns an object Jupyter displays as both. We never use altair's
`mimetype` renderer: it embeds a Vega spec that needs a script from a CDN and, with
altair 6, breaks notebook validation.

Every chart takes a `hardware` label that goes into its title: a plot that does not
say which device made it is not shown.
"""
from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Iterable, Sequence

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
PALETTE = ["#3b6ea5", "#e07b39", "#5a9e6f", "#b5535b", "#7d6bb0", "#8c7a5b", "#d4a017", "#6b8e9e"]
WIDTH, HEIGHT = 520, 260


def _alt():
    import altair as alt

    theme = {
        "config": {
            "font": FONT,
            "view": {"continuousWidth": WIDTH, "continuousHeight": HEIGHT, "stroke": None},
            "range": {"category": PALETTE},
            "axis": {"labelFontSize": 11, "titleFontSize": 12, "gridColor": "#e8e8e8", "domainColor": "#888",
                     "labelLimit": 400},  # long case labels (e.g. a test matrix) stay readable
            # full legend labels: a truncated "mxfp4 (e2m1, e8m0 per 3…" says nothing
            "legend": {"labelFontSize": 11, "titleFontSize": 12, "labelLimit": 0, "titleLimit": 0},
            "title": {"fontSize": 13, "anchor": "start", "subtitleFontSize": 11, "subtitleColor": "#555"},
            # facet headers and text marks default to 10 px in Vega-Lite: never below 11 here
            "header": {"labelFontSize": 11, "titleFontSize": 12},
            "text": {"fontSize": 11},
            # transparent: the page's CSS inverts charts in dark mode, so they read in both themes
            "background": None,
        }
    }
    # altair >= 5.5 has alt.theme; older ones alt.themes.
    if hasattr(alt, "theme") and hasattr(alt.theme, "register"):
        if "inferbook" not in alt.theme.names():
            alt.theme.register("inferbook", enable=True)(lambda: theme)
        else:
            alt.theme.enable("inferbook")
    else:  # pragma: no cover - older altair
        alt.themes.register("inferbook", lambda: theme)
        alt.themes.enable("inferbook")
    return alt


def _title(title: str, hardware: str):
    if not hardware:
        raise ValueError("every chart names the hardware that made its numbers (hardware=...)")
    return {"text": title, "subtitle": [hardware]}


def _facet_type(df, name: str) -> str:
    """Ordinal for numbers (panels in numeric order: 1, 4, 16, not 1, 16, 4), nominal otherwise."""
    import pandas as pd

    return "O" if pd.api.types.is_numeric_dtype(df[name]) else "N"


def _data(rows):
    import pandas as pd

    return rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))


def _interval_columns(df, y: str, err) -> tuple[str, str] | None:
    """The (low, high) columns of `y`'s spread: given, or found by name (`y_lo`/`y_hi`, `y_p10`/`y_p90`,
    `p10_s`/`p90_s` for seconds)."""
    if err:
        return tuple(err)
    for lo, hi in ((f"{y}_lo", f"{y}_hi"), (f"{y}_p10", f"{y}_p90"), ("p10_s", "p90_s") if y.endswith("_s") or y == "value" else ("", "")):
        if lo and lo in df.columns and hi in df.columns:
            return lo, hi
    return None


def bar(rows, *, x: str, y: str, color: str | None = None, title: str, hardware: str,
        x_title: str | None = None, y_title: str | None = None, log_y: bool = False, column: str | None = None,
        err: tuple[str, str] | None = None):
    """Grouped bars: one bar per `x` (and `color`), e.g. time per backend. A measured value's spread
    (`err=(low column, high column)`, or columns found by name, see `_interval_columns`) is drawn as
    an error bar on it."""
    alt = _alt()
    df = _data(rows)
    spread = _interval_columns(df, y, err)
    enc = {
        "x": alt.X(f"{x}:N", title=x_title or x, sort=None),
        "y": alt.Y(f"{y}:Q", title=y_title or y, scale=alt.Scale(type="log") if log_y else alt.Undefined),
        "tooltip": list(df.columns),
    }
    if color:
        enc["color"] = alt.Color(f"{color}:N", title=color)
        enc["xOffset"] = alt.XOffset(f"{color}:N")
    # A bar's length means nothing on a log axis (there is no zero to start from): a dot plot there.
    mark = alt.Chart().mark_point(filled=True, size=80) if log_y else alt.Chart().mark_bar()
    layers = [mark.encode(**enc)]
    if spread:
        rule = {"x": enc["x"], "y": alt.Y(f"{spread[0]}:Q", title=y_title or y), "y2": f"{spread[1]}:Q"}
        if color:
            rule["xOffset"] = enc["xOffset"]
        layers.append(alt.Chart().mark_rule(color="#333", strokeWidth=1.5).encode(**rule))
    chart = alt.layer(*layers, data=df)
    if df[x].nunique() > 24 and not column:
        # many categories: fit the page width instead of one 20-px step per category
        chart = chart.properties(width=WIDTH)
    if column:
        # small multiples wrap (three a row) instead of running past the column in one long row
        n = df[column].nunique()
        per_row = min(3, n)
        chart = chart.properties(width=max(140, WIDTH // per_row - 30)).facet(
            facet=alt.Facet(f"{column}:{_facet_type(df, column)}", title=column), columns=per_row)
    return chart.properties(title=_title(title, hardware))


def sweep(rows, *, x: str, y: str, color: str | None = None, title: str, hardware: str,
          x_title: str | None = None, y_title: str | None = None, log_x: bool = False, log_y: bool = False,
          band: tuple[str, str] | None = None, facet: str | None = None, columns: int = 3):
    """Lines with points over a swept parameter; `band=(lo, hi)` draws a p10-p90 area.
    `facet` draws small multiples, one panel per value of that column, instead of overlapping series."""
    alt = _alt()
    df = _data(rows)
    xs = alt.X(f"{x}:Q", title=x_title or x, scale=alt.Scale(type="log") if log_x else alt.Undefined)
    ys = alt.Y(f"{y}:Q", title=y_title or y, scale=alt.Scale(type="log") if log_y else alt.Undefined)
    col = alt.Color(f"{color}:N", title=color) if color else alt.Undefined
    line = alt.Chart(df).mark_line(point=True).encode(x=xs, y=ys, color=col, tooltip=list(df.columns))
    if band:
        area = alt.Chart(df).mark_area(opacity=0.2).encode(x=xs, y=f"{band[0]}:Q", y2=f"{band[1]}:Q", color=col)
        line = area + line
    if facet:
        panel_w = max(160, WIDTH // columns - 20)
        # each panel keeps its own y scale: panels of different units (ms, MiB) never share an axis
        return line.properties(width=panel_w, height=HEIGHT // 2).facet(
            facet=alt.Facet(f"{facet}:{_facet_type(df, facet)}", title=facet), columns=columns).resolve_scale(y="independent").properties(
            title=_title(title, hardware))
    return line.properties(title=_title(title, hardware))


def roofline(points, *, ceil, title: str, hardware: str, label: str = "label"):
    """Achieved TFLOP/s against arithmetic intensity, under the measured copy and matmul roofs.

    `points`: rows with `intensity_flop_per_byte`, `achieved_tflops` and `label`.
    `ceil`: a `measure.Ceilings` measured on the same device in the same run.
    """
    import numpy as np

    alt = _alt()
    df = _data(points)
    lo = float(min(df["intensity_flop_per_byte"].min(), 0.1)) / 2
    hi = float(max(df["intensity_flop_per_byte"].max(), ceil.matmul_tflops * 1e3 / ceil.copy_gbps)) * 4
    xs = np.geomspace(lo, hi, 64)
    roof = [{"intensity_flop_per_byte": float(v), "roof_tflops": float(min(ceil.matmul_tflops, ceil.copy_gbps * v / 1e3))}
            for v in xs]
    roof_chart = alt.Chart(_data(roof)).mark_line(color="#999", strokeDash=[4, 3]).encode(
        x=alt.X("intensity_flop_per_byte:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (flop/byte)"),
        y=alt.Y("roof_tflops:Q", scale=alt.Scale(type="log"), title="TFLOP/s"))
    pts = alt.Chart(df).mark_point(filled=True, size=70).encode(
        x="intensity_flop_per_byte:Q", y="achieved_tflops:Q", color=alt.Color(f"{label}:N", title=label),
        tooltip=list(df.columns))
    sub = (f"{hardware} · roofs measured here: copy {ceil.copy_gbps:.0f} GB/s, "
           f"{ceil.matmul_dtype} matmul {ceil.matmul_tflops:.2f} TFLOP/s")
    return (roof_chart + pts).properties(title={"text": title, "subtitle": [sub]})


LABEL_CHARS = 56  # a heatmap's row label longer than this wraps onto more lines (11 px text: about 370 px)


def wrap_label(label: str, width: int = LABEL_CHARS) -> list[str]:
    """A long category label as lines of at most about `width` characters, broken after a case's name
    (": ") or between its " · "-separated parts, never inside a word."""
    label = str(label)
    if len(label) <= width:
        return [label]
    parts = []
    for head_i, chunk in enumerate(label.split(": ")):
        pieces = chunk.split(" · ")
        parts += [(p, " · ") for p in pieces[:-1]] + [(pieces[-1], ": " if head_i < label.count(": ") else "")]
    lines, line = [], ""
    for piece, sep in parts:
        if line and len(line.rstrip()) + len(piece) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece + sep
    if line.strip():
        lines.append(line.rstrip())
    return lines


def heatmap(rows, *, x: str, y: str, passed: str = "passed", title: str, hardware: str, text: str | None = None):
    """Pass/fail grid: one cell per (x, y); failing cells are red and can carry a `text` label.
    Row labels longer than `LABEL_CHARS` wrap onto several lines (each row as tall as its lines), so a
    grid of long case names stays inside the page's column with its text at full size."""
    alt = _alt()
    df = _data(rows).copy()
    if df[x].nunique() > 24 and df[x].nunique() > df[y].nunique():
        # many cases: run them down the page, not across it (a wide grid is drawn too small to read)
        x, y = y, x
    df["result"] = df[passed].map({True: "pass", False: "FAIL"})
    lines = max((len(wrap_label(v)) for v in df[y].astype(str).unique()), default=1)
    y_axis = alt.Undefined
    if lines > 1:
        df[y] = df[y].astype(str).map(lambda v: "\n".join(wrap_label(v)))
        y_axis = alt.Axis(labelExpr="split(datum.label, '\\n')", labelLineHeight=13)
    base = alt.Chart(df).encode(x=alt.X(f"{x}:N", title=x, sort=None),
                                y=alt.Y(f"{y}:N", title=y, sort=None, axis=y_axis))
    cells = base.mark_rect(stroke="white").encode(
        color=alt.Color("result:N", scale=alt.Scale(domain=["pass", "FAIL"], range=["#5a9e6f", "#c0392b"]), title="result"),
        tooltip=list(df.columns))
    layers = cells
    if text:
        layers = cells + base.mark_text(fontSize=11, color="white").encode(text=f"{text}:N")
    if lines > 1:
        layers = layers.properties(height=alt.Step(13 * lines + 5))
    return layers.properties(title=_title(title, hardware))


class Rendered:
    """A chart rendered to SVG (HTML) and PNG (PDF); Jupyter shows whichever it prefers. Its caption
    and alt text travel in the output's metadata, which the book's staging turns into a numbered figure."""

    def __init__(self, svg: str, png: bytes, caption: str = "", alt: str = ""):
        self.svg, self.png, self.caption, self.alt = svg, png, caption, alt

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {"image/svg+xml": self.svg, "image/png": base64.b64encode(self.png).decode("ascii")}
        if not (self.caption or self.alt):
            return data
        return data, {"inferbook_chart": {"caption": self.caption, "alt": self.alt or self.caption}}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".png":
            path.write_bytes(self.png)
        else:
            path.write_text(self.svg)
        return path


# The page's content column is about 670 px wide (jupyter-book's theme at desktop width): a wider chart is
# drawn scaled down, and its text with it.
COLUMN_PX = 660
_SIZE_KEYS = ("width", "height", "continuousWidth", "continuousHeight", "discreteWidth", "step")


def _shrink_plots(spec, factor: float):
    """A copy of a Vega-Lite spec whose plot areas (widths, heights, discrete steps) are `factor` as
    large; text keeps its size."""
    if isinstance(spec, dict):
        out = {}
        for k, v in spec.items():
            if k in _SIZE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = max(8, round(v * factor))
            elif k in _SIZE_KEYS and isinstance(v, dict) and isinstance(v.get("step"), (int, float)):
                out[k] = {**v, "step": max(4, round(v["step"] * factor))}
            else:
                out[k] = _shrink_plots(v, factor)
        return out
    if isinstance(spec, list):
        return [_shrink_plots(v, factor) for v in spec]
    return spec


def _svg_width(svg: str) -> float:
    import re

    m = re.search(r'<svg[^>]*\swidth="([\d.]+)', svg)
    return float(m.group(1)) if m else 0.0


def render(chart, *, png_scale: float = 2.0, caption: str = "", alt: str = "") -> Rendered:
    """Render an altair chart offline with vl-convert. A chart wider than the page's column would be
    drawn scaled down there, text included: its plot areas are shrunk until it fits, so its text reads
    at the theme's sizes (11 px and up) as the page draws it."""
    import vl_convert as vlc

    spec = chart.to_dict()
    spec.setdefault("config", {}).setdefault("view", {}).setdefault("continuousWidth", WIDTH)
    spec["config"]["view"].setdefault("continuousHeight", HEIGHT)
    spec["config"]["view"].setdefault("step", 20)  # Vega-Lite's default band per category, made shrinkable
    svg = vlc.vegalite_to_svg(spec)
    for _ in range(8):  # axes, legends and titles do not shrink: settle in a few rounds
        width = _svg_width(svg)
        if width <= COLUMN_PX:
            break
        spec = _shrink_plots(spec, max(0.3, 0.95 * COLUMN_PX / width))
        svg = vlc.vegalite_to_svg(spec)
    return Rendered(svg, vlc.vegalite_to_png(spec, scale=png_scale), caption, alt)


def _title_text(spec: dict) -> tuple[str, str]:
    title = spec.get("title") or {}
    if isinstance(title, str):
        return title, ""
    sub = title.get("subtitle") or []
    return str(title.get("text", "")), " · ".join(sub) if isinstance(sub, list) else str(sub)


def describe(chart) -> str:
    """Alt text from the chart's own spec: its title, device, and what is drawn against what."""
    spec = chart.to_dict()
    text, sub = _title_text(spec)
    inner = spec.get("spec") or spec  # a faceted chart keeps its panels' spec inside
    enc = inner.get("encoding") or (inner.get("layer") or [{}])[0].get("encoding", {})
    def axis(k):
        e = enc.get(k) or {}
        return e.get("title") or e.get("field") or ""
    x, y = axis("x"), axis("y")
    drawn = f": {y} against {x}" if x and y else ""
    return f"Chart, {text}{drawn}" + (f" ({sub})" if sub else "") + "."


def _same_words(a: str, b: str) -> bool:
    norm = lambda t: " ".join(re.findall(r"\w+", t.lower()))  # noqa: E731
    return norm(a) == norm(b)


def show(chart, caption: str) -> Rendered:
    """What a chapter calls to display a chart (the last expression of a cell). `caption` is required:
    what the chart shows and what to read from it for this chapter (the page numbers it as a figure).
    A caption that only repeats the chart's title is refused: the title names the chart, the caption
    says what it tells the reader."""
    spec_title, _ = _title_text(chart.to_dict())
    caption = (caption or "").strip()
    if not caption:
        raise ValueError("charts.show needs a caption: what the chart shows and what to read from it")
    if _same_words(caption, spec_title):
        raise ValueError(f"the caption repeats the chart's title ({spec_title!r}): say what to read from the chart")
    return render(chart, caption=caption, alt=describe(chart))


def records_rows(records: Iterable, names: Sequence[str] | None = None) -> list[dict]:
    """Flatten records' measurements into rows for tables and charts."""
    from .device import hardware_label

    rows = []
    for r in records:
        for m in r.measurements:
            if names is not None and m["name"] not in names:
                continue
            rows.append({"record": r.name, "variant": r.variant, "hardware": hardware_label(r.hardware),
                         **{k: v for k, v in m.items()}})
    return rows
