"""The reader view: what a staged chapter page shows, and the pages built from every chapter's records.

An executed notebook keeps every cell (the downloadable `.ipynb` is the whole run). The page built from
it hides the plumbing, by tags Sphinx/MyST-NB understands, added when the notebook is staged:

- the `parameters` cell and papermill's injected one: `remove-cell` (the page's one-line run summary,
  from `notebook.hardware_notice`, says what was run);
- code cells with no visible output (glue, imports, set-up): `remove-cell` — glued values are still
  read from them;
- every other code cell: `hide-input` (a "show code" toggle), unless the chapter tagged it
  `show-input`; what such a cell shows (kernel listings, checks, tables, charts) stays;
- stderr streams (library warnings) are dropped.

Above the page's first section sits a box naming the seed section (English and Chinese), the upstream
changes the seed cites (plain links), the commit and preset the page was executed from, and the chapter's
source and executed notebook as downloads; under it, the chapter's headline result, the same text the
results page shows (one function, `headline_text`, makes both), with an anchor the results page links to.

Charts that `charts.show` rendered carry their caption and alt text in the output's metadata; staging
turns them into numbered MyST-NB figures (`mystnb.figure` / `mystnb.image` cell metadata).
"""
from __future__ import annotations

import copy
import html
from pathlib import Path

from . import toc
from .words import count

REMOVE, HIDE, SHOW = "remove-cell", "hide-input", "show-input"
PLUMBING_TAGS = {"parameters", "injected-parameters"}
DOWNLOADS = "downloads"  # folder of the stage dir holding each chapter's .md and executed .ipynb


def _tags(cell) -> list[str]:
    return cell.setdefault("metadata", {}).setdefault("tags", [])


def _is_glue_only(output) -> bool:
    """A display output that only carries a glued value (myst-nb keeps it for `{glue:...}` roles)."""
    return output.get("output_type") == "display_data" and "scrapbook" in output.get("metadata", {})


def _visible_outputs(cell) -> list:
    return [o for o in cell.get("outputs", [])
            if not _is_glue_only(o) and not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def tag_cells(nb) -> None:
    """Tag the cells of an executed notebook for the page (in place); see the module docstring."""
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        cell["outputs"] = [o for o in cell.get("outputs", [])
                           if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        tags = _tags(cell)
        if PLUMBING_TAGS & set(tags) or not _visible_outputs(cell):
            if REMOVE not in tags:
                tags.append(REMOVE)
        elif not {SHOW, HIDE, "remove-input", REMOVE} & set(tags):
            tags.append(HIDE)


def provenance(records) -> str:
    """'commit abc1234 (uncommitted changes), preset cpu, seed 0, on <device>' of a page's measured records."""
    from .device import hardware_label

    measured = [r for r in records or [] if not str(r.source).startswith("quoted")]
    if not measured:
        return ""
    r = measured[0]
    git = r.git or {}
    commit = str(git.get("commit") or "")[:10] or "unknown"
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    seed = (r.parameters or {}).get("seed")
    seed = f", seed {seed}" if seed is not None else ""
    hw = r.hardware or {}
    beside = ""
    if isinstance(hw.get("book_jobs"), int) and hw["book_jobs"] > 1:  # `inferbook book --jobs N` on CPU
        others = hw["book_jobs"] - 1
        threads = hw.get("torch_threads")
        threads = count(threads, "torch thread") if isinstance(threads, int) else "torch threads unknown"
        beside = (f", executed beside up to {count(others, 'other chapter')} ({threads}): "
                  "its timings shared the cores")
    return f"commit `{commit}`{dirty}, preset `{r.preset}`{seed}, on {hardware_label(r.hardware)}{beside}"


def chapter_box(slug: str, records=None) -> str:
    """Markdown for the box above a chapter: seed section, upstream links, the commit and preset the
    page was executed from, downloads, the command."""
    info = toc.CHAPTERS[slug]
    en, zh = toc.SEED_SECTIONS.get(info.seed_section, (info.seed_section, info.seed_section))
    links = ", ".join(f"[{name}]({url})" for name, url in toc.UPSTREAM.get(slug, []))
    lines = [f"**Seed section:** {en} ({zh}).",
             f"**Upstream changes the seed cites:** {links}." if links else
             "**Upstream:** the seed cites an engineering write-up here, no pull request or release.",
             f"**Take it home:** {{download}}`chapter source (.md) <../{DOWNLOADS}/{slug}.md>` · "
             f"{{download}}`executed notebook (.ipynb) <../{DOWNLOADS}/{slug}.ipynb>` · "
             f"re-run it on your GPU with `inferbook run {slug} --device cuda --preset gpu`."]
    built = provenance(records)
    if built:
        lines.insert(2, f"**This page was executed from** {built}.")
    return ":::{admonition} About this chapter\n:class: tip\n" + "\n\n".join(lines) + "\n:::\n"


def headline_anchor(slug: str) -> str:
    return f"headline-{slug}"


def headline_box(slug: str, module, records) -> str:
    """The page's headline result, under its box: the same words the results page shows."""
    head = headline(module, records) if records else None
    if head is None:
        return ""
    what, value, spread = head
    text = headline_text(what, value, spread)
    return (f"({headline_anchor(slug)})=\n:::{{admonition}} Headline result of this run\n:class: important\n"
            f"{text}\n:::\n")


def _chart_info(output) -> dict | None:
    return (output.get("metadata") or {}).get("inferbook_chart")


def _figure_metadata(nb, slug: str) -> None:
    """Charts rendered by `charts.show` carry {caption, alt} in their output metadata: each becomes a
    numbered MyST-NB figure (`mystnb.figure` / `mystnb.image` cell metadata) with its caption and alt
    text. MyST-NB applies a cell's figure metadata to every output of the cell, so a chart that shares
    its cell with a table or another chart moves into a cell of its own (input removed) first."""
    import nbformat

    cells = []
    for cell in nb.cells:
        outputs = cell.get("outputs", []) if cell.get("cell_type") == "code" else []
        charts = [o for o in outputs if _chart_info(o)]
        if not charts or len([o for o in _visible_outputs(cell)]) == 1:
            cells.append(cell)
            continue
        cell["outputs"] = [o for o in outputs if not _chart_info(o)]
        cells.append(cell)
        for o in charts:
            moved = nbformat.v4.new_code_cell("", outputs=[o])
            moved.metadata["tags"] = ["remove-input"]
            cells.append(moved)
    nb.cells = cells
    n = 0
    for cell in nb.cells:
        charts = [_chart_info(o) for o in cell.get("outputs", [])] if cell.get("cell_type") == "code" else []
        charts = [c for c in charts if c]
        if not charts:
            continue
        info = charts[0]
        n += 1
        md = cell.setdefault("metadata", {}).setdefault("mystnb", {})
        md["figure"] = {"caption": info.get("caption", ""), "name": f"fig-{slug}-{n}"}
        md["image"] = {"alt": info.get("alt", info.get("caption", "chart"))}


def reader_notebook(nb, slug: str, records=None):
    """A copy of an executed notebook as its page shows it: tagged cells, the box and the headline
    after the title cell, charts as numbered figures, and a download link under "Run it yourself".
    `records`: the run's RunRecords (for the commit, preset and headline); None shows neither."""
    import nbformat

    out = copy.deepcopy(nb)
    tag_cells(out)
    _figure_metadata(out, slug)
    first_md = next((i for i, c in enumerate(out.cells) if c.cell_type == "markdown"), -1)
    try:
        module = toc.load_module(toc.CHAPTERS[slug])
    except Exception:
        module = None
    box = chapter_box(slug, records)
    head = headline_box(slug, module, records)
    out.cells.insert(first_md + 1, nbformat.v4.new_markdown_cell(box + ("\n" + head if head else "")))
    for cell in out.cells:
        if cell.cell_type == "markdown" and "Run it yourself" in cell.source and cell.source.lstrip().startswith("#"):
            head, _, rest = cell.source.partition("\n")
            cell.source = (f"{head}\n\nThe executed notebook of this page is "
                           f"{{download}}`{slug}.ipynb <../{DOWNLOADS}/{slug}.ipynb>`; the one command is "
                           f"`inferbook run {slug} --device cuda --preset gpu`.\n{rest}")
            break
    return out


# --- results at a glance ------------------------------------------------------------------------------

def _shown(m: dict, value: float | None = None) -> str:
    from .measure import significant

    unit, value = m.get("unit", ""), m["value"] if value is None else value
    if unit == "s":
        return f"{significant(value * 1e3)} ms"
    if unit == "fraction":
        return f"{significant(100 * value)} %"
    shown = str(int(value)) if float(value).is_integer() else significant(value)
    return f"{shown} {unit}".strip()


def _spread(m: dict) -> str:
    """The measurement's own spread, where it kept one: a timing's p10-p90, or a comparison's interval."""
    for lo_key, hi_key, what in (("p10_s", "p90_s", "p10–p90"), ("lo", "hi", "90 % interval"),
                                 ("interval_lo", "interval_hi", "90 % interval")):
        lo, hi = m.get(lo_key), m.get(hi_key)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo != hi:
            return f"{what} {_shown(m, lo)} to {_shown(m, hi)}"
    n = m.get("n")
    return f"{n} samples" if isinstance(n, int) and n > 1 else ""


def _readable(name: str) -> str:
    return str(name).replace("_", " ").strip()


def headline_text(what: str, value: str, spread: str) -> str:
    """The one sentence a page and the results page both show for a chapter's headline."""
    return f"{what}: **{value}**" + (f" ({spread})" if spread else "") + "."


def headline(module, records) -> tuple[str, str, str] | None:
    """(what, value, spread) of the chapter's headline measurement: the one its measure module names in
    `HEADLINE = (record name prefix, measurement name[, what it is in words])` (names carry the preset's
    shapes, e.g. 'shared-fused-c1-<tiles>'), else the first timed measurement of its first measured (not
    quoted) record, else its first measurement. `what` is the chapter's words where it gives them."""
    measured = [r for r in records if not str(r.source).startswith("quoted")]
    spec = getattr(module, "HEADLINE", None)
    candidates = ([(r, m) for r in measured for m in r.measurements
                   if spec and r.name.startswith(spec[0]) and m["name"] == spec[1]]
                  + [(r, m) for r in measured for m in r.measurements if m.get("unit") in ("s", "ms")]
                  + [(r, m) for r in measured for m in r.measurements])
    if not candidates:
        return None
    r, m = candidates[0]
    named = spec and r.name.startswith(spec[0]) and m["name"] == spec[1]
    what = spec[2] if named and len(spec) > 2 else f"{_readable(m['name'])} ({_readable(r.name)})"
    return what, _shown(m), _spread(m)


def _partial_note(good: Path, records: list) -> str:
    """What a results row says about a partial run: the complete file itself marked incomplete
    (written before partial files existed), or a later run that stopped (`<slug>.partial.json`),
    whose records are never shown in place of the complete ones."""
    from .record import partial_path, results_complete

    if records and not results_complete(good):
        return " (partial: the run was stopped)"
    partial = partial_path(good)
    try:
        later = partial.is_file() and (not good.is_file() or partial.stat().st_mtime >= good.stat().st_mtime)
    except OSError:
        later = False
    if later:
        return " (a later run was stopped; its partial records are not shown)" if records else \
            " (only a stopped run: partial records, not shown)"
    return ""


def results_page(results_dir: Path) -> str:
    """One row per chapter: the headline measurement with its device and preset, the checks that
    passed, and which hardware has committed GPU reference runs."""
    from .context import reference_records
    from .device import hardware_label
    from .record import load_records

    rows, wheres = [], []
    for info in toc.CHAPTERS.values():
        link = f"{{doc}}`{info.title} <chapters/{info.slug}>`"
        good = Path(results_dir) / f"{info.slug}.json"
        try:
            records = load_records(good)
        except Exception:
            records = []
        note = _partial_note(good, records)
        try:
            module = toc.load_module(info)
        except Exception:
            module = None
        head = headline(module, records) if records else None
        measured = [r for r in records if not str(r.source).startswith("quoted")]
        checks = [c for r in measured for c in r.checks]
        passed = sum(1 for c in checks if c.get("passed"))
        where = (f"{hardware_label(measured[0].hardware)}, preset `{measured[0].preset}`" if measured else "not executed")
        wheres.append(where)
        try:
            refs = sorted({hardware_label(r.hardware) for recs in reference_records(info.slug).values() for r in recs})
        except Exception:
            refs = []
        value = (f"{{ref}}`{head[1]} <{headline_anchor(info.slug)}>`" + (f" ({head[2]})" if head[2] else "")
                 if head else "—")
        cells = [link, html.escape(head[0]) if head else "—", value + note, where,
                 f"{passed} of {len(checks)}" if checks else "—", ", ".join(refs) if refs else "none yet"]
        rows.append(cells)
    # one device and preset for the whole build is said once, not in every row
    same = len(set(wheres)) == 1
    header = ["Chapter", "Headline measurement", "Value", "Executed on", "Checks passed", "GPU reference runs"]
    keep = [i for i in range(len(header)) if not (same and i == 3)]
    table = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    table += ["| " + " | ".join(r[i].replace("|", "\\|") for i in keep) + " |" for r in rows]
    where_line = [f"Every chapter below was executed on {wheres[0]}.", ""] if same and wheres else []
    # a container the page's CSS stacks into one block per chapter on a narrow screen
    table = [":::{container} ib-results", *table, ":::"]
    return "\n".join([
        "# Results at a glance", "",
        "One row per chapter: its headline measurement as this build executed it (device and preset named; "
        "each value links to the place on its chapter's page that shows it), "
        "how many of its recorded checks passed, and the hardware of the committed GPU reference runs under "
        "`data/results/`. CPU times are of PyTorch paths only (Triton kernels run in the interpreter there and "
        "are never timed). Each chapter page says what the number means.", "", *where_line, *table, ""])
