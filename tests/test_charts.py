import re
import pytest

from inferbook import charts
from inferbook.measure import Ceilings


def test_bar_renders_offline_svg_and_png():
    rows = [{"phase": "ttft", "value": 0.1, "record": "eager"}, {"phase": "ttft", "value": 0.05, "record": "compiled"}]
    out = charts.show(charts.bar(rows, x="phase", y="value", color="record", title="t", hardware="CPU: X"),
                      caption="Each phase per record; read the cold start apart.")
    assert out.svg.lstrip().startswith("<svg") and "CPU: X" in out.svg
    assert out.svg.count('aria-roledescription="bar"') == 2, "both bars drawn"
    assert out.png[:8] == b"\x89PNG\r\n\x1a\n"
    data, meta = out._repr_mimebundle_()
    assert set(data) == {"image/svg+xml", "image/png"}
    # the chapter's caption and the alt text made from the chart's spec travel with the output
    assert meta["inferbook_chart"]["caption"] == "Each phase per record; read the cold start apart."
    assert meta["inferbook_chart"]["alt"] == "Chart, t: value against phase (CPU: X)."
    assert "http" not in out.svg.replace("http://www.w3.org", ""), "no external references in a chart"


def test_every_chart_names_its_hardware():
    with pytest.raises(ValueError, match="hardware"):
        charts.bar([{"a": "x", "b": 1}], x="a", y="b", title="t", hardware="")


def test_sweep_roofline_heatmap_render():
    ceil = Ceilings(copy_gbps=50.0, matmul_tflops=1.0, matmul_dtype="float32", copy_bytes=1, matmul_shape=(1, 1, 1),
                    timer="perf_counter")
    pts = [{"intensity_flop_per_byte": 0.5, "achieved_tflops": 0.02, "label": "k1"},
           {"intensity_flop_per_byte": 100.0, "achieved_tflops": 0.8, "label": "k2"}]
    assert "<svg" in charts.render(charts.roofline(pts, ceil=ceil, title="r", hardware="CPU: X")).svg
    rows = [{"n": n, "t": 1.0 / n, "lo": 0.9 / n, "hi": 1.1 / n, "k": "a"} for n in (1, 2, 4)]
    assert "<svg" in charts.render(charts.sweep(rows, x="n", y="t", color="k", band=("lo", "hi"), log_x=True,
                                                title="s", hardware="CPU: X")).svg
    cells = [{"hd": 64, "case": "causal", "passed": True}, {"hd": 96, "case": "causal", "passed": False}]
    svg = charts.render(charts.heatmap(cells, x="hd", y="case", title="m", hardware="CPU: X")).svg
    assert "FAIL" in svg and "pass" in svg


def test_log_scale_values_are_dots_not_floating_bars():
    """A bar on a log axis has no baseline: such charts are dot plots, one dot per value."""
    rows = [{"phase": p, "value": v, "record": r} for p, v in (("load", 0.002), ("total", 3.0)) for r in ("a", "b")]
    svg = charts.render(charts.bar(rows, x="phase", y="value", color="record", log_y=True, title="t",
                                   hardware="CPU: X")).svg
    assert svg.count('aria-roledescription="bar"') == 0
    assert svg.count('aria-roledescription="point"') == 4


def test_linear_bars_start_at_zero_and_many_categories_fit_the_page():
    rows = [{"expert": i, "tokens": (i * 7) % 13 + 1} for i in range(200)]
    chart = charts.bar(rows, x="expert", y="tokens", title="t", hardware="CPU: X")
    svg = charts.render(chart).svg
    width = float(re.search(r'<svg[^>]*width="([0-9.]+)"', svg).group(1))
    assert width < 800
    assert svg.count('aria-roledescription="bar"') == 200


def test_small_multiples_and_full_legend_labels():
    long = "mxfp4 (e2m1, e8m0 per 32 along K, decoded in the kernel)"
    rows = [{"step": s, "loss": 1 / (s + 1 + i), "run": name} for i, name in enumerate([long, "bf16"]) for s in range(5)]
    svg = charts.render(charts.sweep(rows, x="step", y="loss", color="run", title="t", hardware="CPU: X")).svg
    assert long in svg and "…" not in svg
    faceted = charts.sweep(rows, x="step", y="loss", color="run", facet="run", title="t", hardware="CPU: X")
    assert "facet" in faceted.to_dict()


def test_charts_have_a_transparent_background():
    spec = charts.bar([{"a": "x", "b": 1}], x="a", y="b", title="t", hardware="CPU: X").to_dict()
    assert spec["config"].get("background") is None


def test_measured_bars_carry_their_spread_as_error_bars():
    rows = [{"k": k, "median_s": m, "p10_s": m * 0.9, "p90_s": m * 1.2} for k, m in (("a", 1.0), ("b", 2.0))]
    svg = charts.render(charts.bar(rows, x="k", y="median_s", title="t", hardware="CPU: X")).svg
    assert svg.count('aria-roledescription="bar"') == 2
    assert svg.count('aria-roledescription="rule mark"') == 2, "one error bar per measured bar"
    plain = charts.render(charts.bar([{"k": "a", "v": 1}], x="k", y="v", title="t", hardware="CPU: X")).svg
    assert 'aria-roledescription="rule mark"' not in plain, "no spread, no error bar"


def test_small_multiples_wrap_in_numeric_order():
    rows = [{"k": "a", "v": 1.0, "c": c} for c in (16, 1, 4, 64)]
    chart = charts.bar(rows, x="k", y="v", column="c", title="t", hardware="CPU: X")
    spec = chart.to_dict()
    assert spec["facet"]["type"] == "ordinal" and spec["columns"] == 3
    svg = charts.render(chart).svg
    order = [int(m) for m in re.findall(r'aria-label="c: (\d+)"|>(\d+)</text>', svg) for m in m if m]
    shown = [v for v in order if v in (1, 4, 16, 64)]
    assert shown[:4] == [1, 4, 16, 64], shown


def test_caption_given_by_the_chapter_wins():
    out = charts.show(charts.bar([{"k": "a", "v": 1}], x="k", y="v", title="t", hardware="CPU: X"),
                      caption="Time per backend; lower is better.")
    assert out._repr_mimebundle_()[1]["inferbook_chart"]["caption"] == "Time per backend; lower is better."


def test_a_wide_chart_fits_the_column_with_its_text_unshrunk():
    """Five wide panels would be drawn scaled down on the page, text with them: the plot areas shrink
    instead, so every font stays at 11 px or more as drawn."""
    rows = [{"T": t, "v": float(t), "variant": f"variant number {i}", "p": p}
            for t in (1, 8, 64, 512) for i in range(4) for p in "abcde"]
    svg = charts.render(charts.sweep(rows, x="T", y="v", color="variant", facet="p", columns=5, title="wide",
                                     hardware="CPU: X")).svg
    assert charts._svg_width(svg) <= charts.COLUMN_PX
    assert min(float(x) for x in re.findall(r'font-size="([\d.]+)px"', svg)) >= 11


def test_a_heatmap_of_long_case_names_wraps_them_and_keeps_its_text_readable():
    """The acceptance matrix's grid: dozens of cases named by every axis value. The names wrap onto
    lines (broken between parts, never inside one), so the grid stays inside the column at 11 px."""
    parts = ["bwd", "bf16", "d576/dv512", "causal", "varlen", "paged-128", "GQA+pack", "1023x1024", "sinks",
             "window-band", "softcap"]
    rows = [{"case": f"backward {i}: " + " · ".join(parts[i % 3:]), "check": check, "passed": (i + j) % 9 != 0}
            for i in range(40) for j, check in enumerate(("out", "lse", "dq", "dk", "dv", "dsinks"))]
    lines = charts.wrap_label(rows[0]["case"])
    assert len(lines) > 1 and all(len(line) <= charts.LABEL_CHARS for line in lines)
    assert " ".join(lines).replace("  ", " ").split() == rows[0]["case"].split()
    svg = charts.render(charts.heatmap(rows, x="check", y="case", title="grid", hardware="CPU: X")).svg
    assert charts._svg_width(svg) <= charts.COLUMN_PX
    assert min(float(x) for x in re.findall(r'font-size="([\d.]+)px"', svg)) >= 11
    assert "<tspan" in svg  # the names are drawn on several lines, not cut with an ellipsis
    assert "…" not in svg


def test_a_chart_needs_a_caption_that_is_not_its_title():
    chart = charts.bar([{"k": "a", "v": 1}], x="k", y="v", title="Time per backend", hardware="CPU: X")
    with pytest.raises(ValueError, match="caption"):
        charts.show(chart, caption="")
    with pytest.raises(ValueError, match="repeats the chart's title"):
        charts.show(chart, caption="Time per backend.")
    out = charts.show(chart, caption="Median time per backend on this device; the lowest bar is the fastest path.")
    meta = out._repr_mimebundle_()[1]["inferbook_chart"]
    assert meta["caption"] != "Time per backend" and meta["alt"].startswith("Chart, Time per backend")
