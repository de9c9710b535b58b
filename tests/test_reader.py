"""The reader view's pieces, without building the book: the headline a page and the results page share,
the provenance line, charts as numbered figures, kernels in view, counts and verdicts as prose."""
import nbformat
import pytest

from inferbook import notebook as nb
from inferbook import reader
from inferbook.measure import compare_timings
from inferbook.record import RunRecord


def _record(**kw):
    r = RunRecord(chapter="chord-w4a16", name="routing-e48", preset="cpu", git={"commit": "0123456789abcdef"},
                  hardware={"cpu_model": "Test CPU", "cores": 2}, parameters={"seed": 0}, **kw)
    return r


class _Module:
    HEADLINE = ("routing", "tokens_per_expert_median", "Median tokens per expert at decode")


def test_headline_is_one_sentence_shared_by_page_and_results_page():
    r = _record()
    r.add("tokens_per_expert_median", 12.0, "tokens")
    what, value, spread = reader.headline(_Module, [r])
    assert (what, value, spread) == ("Median tokens per expert at decode", "12 tokens", "")
    box = reader.headline_box("chord-w4a16", _Module, [r])
    assert box.startswith("(headline-chord-w4a16)=")  # the anchor the results page links to
    assert reader.headline_text(what, value, spread) in box


def test_headline_of_a_timing_carries_its_spread_and_readable_names():
    r = _record()
    r.add("first_token_time", 0.012, "s", p10_s=0.011, p90_s=0.014, n=20)
    what, value, spread = reader.headline(None, [r])
    assert value == "12.0 ms" and spread == "p10–p90 11.0 ms to 14.0 ms"
    assert what == "first token time (routing-e48)"  # no internal ids with underscores


def test_provenance_names_commit_preset_and_device():
    line = reader.provenance([_record()])
    assert "commit `0123456789`" in line and "preset `cpu`" in line and "seed 0" in line
    assert reader.provenance([]) == ""


def test_reader_notebook_puts_box_headline_and_figures_in_place():
    page = nbformat.v4.new_notebook()
    chart = nbformat.v4.new_code_cell("charts.show(c)")
    chart.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "AAAA"},
                                            metadata={"inferbook_chart": {"caption": "Time per backend.",
                                                                          "alt": "Chart, t."}})]
    page.cells = [nbformat.v4.new_markdown_cell("# Title"), chart]
    r = _record()
    r.add("tokens_per_expert_median", 12.0, "tokens")
    out = reader.reader_notebook(page, "chord-w4a16", [r])
    box = out.cells[1].source
    assert "About this chapter" in box and "commit `0123456789`" in box and "(headline-chord-w4a16)=" in box
    md = out.cells[2].metadata["mystnb"]
    assert md["figure"] == {"caption": "Time per backend.", "name": "fig-chord-w4a16-1"}
    assert md["image"]["alt"] == "Chart, t."


def _helper(a, b):
    """A helper of more than fifteen lines."""
    x = a
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    x = x + b
    return x


def test_kernels_stay_in_view_helpers_fold():
    from inferbook.moe import w4a16

    kernels = [getattr(w4a16, n) for n in dir(w4a16) if nb.is_kernel(getattr(w4a16, n))]
    assert kernels, "the W4A16 module has Triton kernels"
    for k in kernels:
        assert ":class: dropdown" not in nb.show_source(k).text, "a kernel listing never folds"
    assert ":class: dropdown" in nb.show_source(_helper).text
    assert ":class: dropdown" not in nb.show_source(_helper, fold=False).text
    assert not nb.is_kernel(_helper)


def test_folded_table_hides_its_rows_behind_a_summary():
    df = nb.table([{"launch": "a <b>", "x_us": 1.5}, {"launch": "c", "x_us": 2.0}])
    html = nb.folded_table("Rows & more", df)._repr_html_()
    assert html.startswith("<details><summary>Rows &amp; more (2 rows)</summary>") and html.endswith("</details>")
    assert html.count("<tr>") == 3 and "a &lt;b&gt;" in html, "a header, two rows, cells escaped"


@pytest.mark.parametrize("n, noun, plural, shown", [
    (1, "launch", None, "1 launch"), (3, "launch", None, "3 launches"), (0, "token", None, "0 tokens"),
    (2, "time", None, "2 times"), (2, "matrix", "matrices", "2 matrices"), (1, "matrix", "matrices", "1 matrix")])
def test_count_agrees_with_its_noun(n, noun, plural, shown):
    assert nb.count(n, noun, plural) == shown


def test_verdict_is_prose_with_its_interval():
    fast, slow = [1.0, 1.01, 0.99, 1.02, 0.98] * 4, [2.0, 2.02, 1.98, 2.01, 1.99] * 4
    text = nb.verdict(compare_timings(fast, slow), "the fused kernel", "eager")._repr_markdown_()
    assert text.startswith("The fused kernel is faster than eager") and "90 % interval" in text
    assert text.endswith(".")


def test_a_chart_sharing_its_cell_becomes_a_figure_of_its_own():
    page = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("display(table); charts.show(a); charts.show(b)")
    chart = lambda cap: nbformat.v4.new_output("display_data", data={"image/png": "AAAA"},
                                                metadata={"inferbook_chart": {"caption": cap, "alt": "Chart, x."}})
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/html": "<table></table>"}),
                    chart("A."), chart("B.")]
    page.cells = [nbformat.v4.new_markdown_cell("# Title"), cell]
    out = reader.reader_notebook(page, "chord-w4a16")
    code = [c for c in out.cells if c.cell_type == "code"]
    assert [len(c.outputs) for c in code] == [1, 1, 1]
    assert "mystnb" not in code[0].metadata, "the table's cell is no figure"
    assert [c.metadata["mystnb"]["figure"]["caption"] for c in code[1:]] == ["A.", "B."]
    assert [c.metadata["mystnb"]["figure"]["name"] for c in code[1:]] == ["fig-chord-w4a16-1", "fig-chord-w4a16-2"]
    assert all(c.metadata["tags"] == ["remove-input"] for c in code[1:])


def test_refusal_reasons_read_as_a_list_with_values_as_code():
    md = nb.differences("a vs b: refused", ["local shapes for 'attention' differ: {'q': [1, 2]} vs {'q': [3]}",
                                            "hardware differs", "odd: a `tick`"])._repr_markdown_()
    lines = md.splitlines()
    assert lines[0] == "a vs b: refused" and lines[1] == ""
    assert lines[2] == "- local shapes for 'attention' differ: `{'q': [1, 2]} vs {'q': [3]}`"
    assert lines[3] == "- hardware differs"
    assert lines[4] == "- odd: `a 'tick'`"      # a backtick inside a value cannot break the code span
    assert nb.differences("t", []).text.endswith("No differences.")
