"""The whole book, as `make book` makes it and as a reader sees it.

Every written chapter executes end to end through the same runner as `make book`, at preset=smoke on
CPU (a chapter whose correctness check fails fails here), then Sphinx builds the book, and headless
Chromium reads every page: what a reader sees, with no request leaving the machine. One build serves
every test of this module (`make test` runs pytest with `--dist loadfile`, so one worker builds it).
Needs Debian's chromium for the browser half (.ci/run installs it)."""
import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from inferbook import book, toc
from inferbook.book import ChapterFailed
from inferbook.record import load_records

WRITTEN = [c.slug for c in book.built_chapters()]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# a tag that would make the browser fetch from another host; a plain <a href> link is fine (upstream PRs)
EXTERNAL = re.compile(r"""<(\w+)\b[^>]*?\b(?:src|href|action|poster|data)\s*=\s*["'](?:https?:)?//""", re.I)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every chapter executed at smoke on CPU and the book built; returns (build dir, metas).
    INFERBOOK_TEST_BUILD=DIR reuses a build made this way (for working on the page checks only)."""
    reuse = os.environ.get("INFERBOOK_TEST_BUILD")
    build = Path(reuse) if reuse else tmp_path_factory.mktemp("build")
    if reuse and (build / "html" / "index.html").is_file():
        return build, {slug: book.read_meta(slug, build / "executed") for slug in WRITTEN}
    old = os.environ.get("INFERBOOK_BUILD_DIR")
    os.environ["INFERBOOK_BUILD_DIR"] = str(build)
    try:
        try:
            book.build_book(device="cpu", preset="smoke", keep_going=True, progress=False, log=lambda *_: None,
                            jobs=2)   # as `make book` runs them on CPU: two chapters side by side
        except ChapterFailed:
            pass  # each chapter's own test below names its failure
        except RuntimeError as e:  # the Sphinx build: the execution tests still report chapter by chapter
            (build / "sphinx-error.txt").write_text(str(e))
        metas = {slug: book.read_meta(slug, build / "executed") for slug in WRITTEN}
    finally:
        if old is None:
            os.environ.pop("INFERBOOK_BUILD_DIR")
        else:
            os.environ["INFERBOOK_BUILD_DIR"] = old
    return build, metas


@pytest.mark.chapter
@pytest.mark.parametrize("slug", WRITTEN)
def test_chapter_executes_at_smoke(slug, built):
    build, metas = built
    meta = metas[slug]
    assert meta and meta["status"] == "ok", meta
    records = load_records(build / "results" / f"{slug}.json")
    assert records, "a chapter run writes at least one RunRecord"
    assert any(r.source == "measured" for r in records)
    for r in records:
        assert r.chapter == slug
        if r.source == "measured":
            assert r.preset == "smoke" and r.git.get("commit") and r.hardware.get("cpu_model")
            assert r.measurements or r.checks, "a measured record holds numbers or checks"
        else:  # a news item's own numbers, kept as a record so compare() can refuse bad pairs
            assert r.source.startswith("quoted: ") and r.hardware, r.source
        assert all(c["passed"] for c in r.checks), [c for c in r.checks if not c["passed"]]


def _html(built) -> Path:
    error = built[0] / "sphinx-error.txt"
    if error.is_file():
        pytest.fail(f"the book did not build: {error.read_text()[:3000]}")
    return built[0] / "html"


def test_no_page_names_an_external_host(built):
    html = _html(built)
    pages = list(html.rglob("*.html"))
    assert len(pages) >= 3 + len(WRITTEN)
    for page in pages:
        text = page.read_text()
        found = [tag for tag in EXTERNAL.findall(text) if tag.lower() != "a"]
        found += re.findall(r"<script[^>]*>[^<]*https?://", text)
        assert not found, f"{page.relative_to(html)} references an external host: {found[:3]}"
    for css in html.rglob("*.css"):
        assert not re.search(r"(@import|url\()\s*['\"]?(https?:)?//", css.read_text()), css.name


def test_results_page_lists_every_chapter(built):
    text = (_html(built) / "results.html").read_text()
    for info in toc.CHAPTERS.values():
        assert f'href="chapters/{info.slug}.html"' in text, info.slug


# --- what a reader sees, in a real browser ----------------------------------------------------------

@pytest.fixture(scope="module")
def server(built):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(_html(built)))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser_page(server):
    """A Chromium page whose every request outside the local server is refused and remembered."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it with apt-get")
        pytest.skip("chromium not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    left_machine, failed = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})

        def guard(route):
            if route.request.url.startswith(server):
                route.continue_()
            else:  # outside network refused, and remembered
                left_machine.append(route.request.url)
                route.abort()

        page.route("**/*", guard)
        page.on("requestfailed", lambda r: failed.append(r.url))
        yield page, left_machine, failed
        browser.close()


# One pass over the page's content column: what would be wrong for a reader.
READER_CHECK = r"""() => {
  const art = document.querySelector('article.bd-article') || document.querySelector('main');
  const col = art.getBoundingClientRect();
  const scrolls = el => { for (let p = el.parentElement; p && p !== art; p = p.parentElement) {
      if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(p).overflowX)) return true; } return false; };
  const wide = [];
  for (const el of art.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > col.right + 2 && !scrolls(el)) wide.push(el.tagName + '.' + el.className);
  }
  const visibleCode = [...art.querySelectorAll('div.cell')].filter(c => c.offsetParent !== null)
      .map(c => c.querySelector('div.cell_input'))
      .filter(i => i && i.offsetParent !== null).map(i => i.innerText.trim());
  const badCells = [...art.querySelectorAll('table td')].map(td => td.innerText.trim())
      .filter(t => /^(-?nan|NaN|None|null)$/.test(t) || t.includes("{'") || t.includes("['"));
  const charts = [...art.querySelectorAll('.cell_output img')].filter(i => i.src.endsWith('.svg'))
      .map(i => ({src: i.src, w: i.getBoundingClientRect().width, drawn: i.complete && i.naturalWidth > 50}));
  const downloads = [...art.querySelectorAll('a.download, a.reference.download')].map(a => a.href);
  return {colWidth: col.width, wide, visibleCode, badCells, charts, downloads,
          math: art.querySelectorAll('mjx-container').length};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("slug", WRITTEN)
def test_chapter_page_reads_as_a_page(slug, server, browser_page):
    page, left_machine, failed = browser_page
    page.goto(f"{server}/chapters/{slug}.html", wait_until="networkidle")
    assert toc.CHAPTERS[slug].title in page.title()
    seen = page.evaluate(READER_CHECK)
    # no plumbing: no visible cell of `knob = None` lines (the parameters cell is removed)
    for code in seen["visibleCode"]:
        lines = [ln for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        assert not (lines and all(re.fullmatch(r"\s*\w+\s*=\s*None\s*", ln) for ln in lines)), code[:200]
    assert not seen["badCells"], f"table cells a reader should not see: {seen['badCells'][:5]}"
    assert not seen["wide"], f"elements wider than the content column: {seen['wide'][:5]}"
    for chart in seen["charts"]:
        assert chart["drawn"], f"chart not drawn: {chart['src']}"
        assert chart["w"] <= seen["colWidth"] + 1, f"chart wider than the column: {chart}"
    # the chapter goes home: its source and its executed notebook, both served
    names = {Path(u).name for u in seen["downloads"]}
    assert {f"{slug}.md", f"{slug}.ipynb"} <= names, seen["downloads"]
    for url in seen["downloads"]:
        assert page.request.get(url).ok, url
    assert json.loads(page.request.get([u for u in seen["downloads"] if u.endswith(".ipynb")][0]).text())["cells"]
    assert not left_machine, f"requests left the machine: {left_machine}"
    assert not failed, f"requests failed: {failed}"


@pytest.mark.browser
def test_math_is_typeset_from_local_assets(server, browser_page):
    page, left_machine, failed = browser_page
    page.goto(f"{server}/intro.html", wait_until="networkidle")
    page.wait_for_selector("mjx-container", timeout=20_000)
    scripts = page.eval_on_selector_all("script[src]", "els => els.map(e => e.src)")
    assert any("_static/mathjax/" in s for s in scripts), scripts
    assert all(s.startswith(server) for s in scripts)
    assert not left_machine and not failed, (left_machine, failed)


@pytest.mark.browser
def test_upgrade_record_chart_is_drawn(server, browser_page):
    page, _, _ = browser_page
    page.goto(f"{server}/chapters/upgrade-record.html", wait_until="networkidle")
    charts = page.eval_on_selector_all(
        ".cell_output img", "els => els.filter(e => e.src.endsWith('.svg')).map(e => e.src)")
    assert charts, "no chart image in the chapter's outputs"
    svg = page.request.get(charts[0]).text()
    assert "Phases kept apart" in svg
    assert svg.count('aria-roledescription="bar"') + svg.count('aria-roledescription="point"') >= 12


# --- a book a reader trusts at a glance ----------------------------------------------------------------

# Template leftovers and garbled glue, looked for in a page's prose (code listings excluded).
LEFTOVERS_CHECK = r"""() => {
  const art = (document.querySelector('article.bd-article') || document.querySelector('main')).cloneNode(true);
  art.querySelectorAll('pre, div.highlight, script, style, mjx-container, button, summary, .toggle-button')
      .forEach(e => e.remove());
  // inline code stands as one unique word: removing it would glue its neighbours into false repeats
  art.querySelectorAll('code').forEach((e, i) => e.replaceWith('codeword' + i));
  // one string per paragraph: a phrase doubled across two paragraphs is no garble
  const prose = [...art.querySelectorAll('p, li, dd')].filter(e => !e.closest('table') && !e.querySelector('p'))
      .map(e => e.textContent.replace(/\s+/g, ' '));
  return [art.textContent.replace(/\s+/g, ' '), prose];
}"""
LEFTOVERS = [
    (re.compile(r"\w\((s|es)\)"), "a plural left as '(s)' / '(es)': use notebook.count"),
    (re.compile(r"(?<![\w.])nan(?![\w.])"), "'nan' shown to a reader"),
    (re.compile(r"\{'|\['"), "a dict or list repr"),
    (re.compile(r"`"), "a raw backtick (Markdown not rendered)"),
    (re.compile(r"\b((?:\w+[ ,;:]+){2,}\w+)[ ,;:]+\1\b"), "a phrase said twice in a row"),
    (re.compile(r"this book's issue tracker"), "a sentence about the project's own tracker"),
]

# Every chart's smallest text, in CSS pixels at the width the page draws it.
CHART_TEXT = r"""async () => {
  const out = [];
  for (const img of document.querySelectorAll('article .cell_output img')) {
    if (!img.src.endsWith('.svg') || img.offsetParent === null) continue;
    const svg = await (await fetch(img.src)).text();
    const doc = new DOMParser().parseFromString(svg, 'image/svg+xml').documentElement;
    const natural = parseFloat(doc.getAttribute('width'));
    const sizes = [...doc.querySelectorAll('text')].map(t => parseFloat(t.getAttribute('font-size')
        || (t.getAttribute('style') || '').replace(/.*font-size:\s*([\d.]+).*/, '$1'))).filter(x => x > 0);
    const scale = img.getBoundingClientRect().width / natural;
    out.push({src: img.src.split('/').pop(), min_px: Math.min(...sizes) * scale, alt: img.alt,
              caption: (img.closest('figure') || {}).innerText || '',
              title: [...doc.querySelectorAll('.role-title-text')].map(t => t.textContent).join(' ')});
  }
  return out;
}"""

# Known, not yet fixed: a chapter's chart that still draws text under 11 px, and why (none now: the
# acceptance matrix's pass/fail grid wraps its case names, charts.heatmap).
KNOWN_SMALL_TEXT: dict[str, str] = {}

# Rows of the compiler section's tables a reader sees without opening a fold.
COMPILER_ROWS = r"""() => {
  const sec = [...document.querySelectorAll('section')].find(s => {
      const h = s.querySelector('h2, h3'); return h && /What the compiler made of it/.test(h.innerText); });
  if (!sec) return null;
  return [...sec.querySelectorAll('tr')].filter(tr => tr.offsetParent !== null
      && !tr.closest('details, .dropdown, .toggle-hidden')).length;
}"""


def _prose(page) -> str:
    return page.evaluate(LEFTOVERS_CHECK)


@pytest.mark.browser
@pytest.mark.parametrize("slug", WRITTEN)
def test_chapter_page_has_no_leftovers_and_says_where_it_came_from(slug, server, browser_page):
    page, _, _ = browser_page
    page.goto(f"{server}/chapters/{slug}.html", wait_until="networkidle")
    text, prose = _prose(page)
    for pattern, what in LEFTOVERS:
        # tables repeat units by design: a doubled phrase is looked for within each paragraph
        for where in (prose if what.startswith("a phrase said twice") else [text]):
            m = pattern.search(where)
            if m:
                break
        text_of = where
        assert not m, f"{what}: …{text_of[max(0, m.start() - 80):m.end() + 80]}…"
    assert "This page was executed from commit" in text, "every page shows its commit and preset"
    rows = page.evaluate(COMPILER_ROWS)
    assert rows is None or rows <= 30, f"the compiler section shows {rows} table rows unfolded"


@pytest.mark.browser
@pytest.mark.parametrize("slug", WRITTEN)
def test_charts_read_at_the_column_width(slug, server, browser_page):
    page, _, _ = browser_page
    page.goto(f"{server}/chapters/{slug}.html", wait_until="networkidle")
    for chart in page.evaluate(CHART_TEXT):
        if chart["min_px"] < 10.9 and slug in KNOWN_SMALL_TEXT:
            pytest.xfail(KNOWN_SMALL_TEXT[slug])
        assert chart["min_px"] >= 10.9, f"chart text under 11 px as drawn: {chart}"
        assert chart["alt"].startswith(("Chart, ", "Diagram, ")) and ".svg" not in chart["alt"], chart
        assert re.match(r"Fig\. \d", chart["caption"]), f"a chart is a numbered figure with a caption: {chart}"
        # the caption says what to read from the chart: not its title again
        words = lambda t: " ".join(re.findall(r"\w+", t.lower()))  # noqa: E731
        caption = re.sub(r"^Fig\. [\d.]+\s*", "", chart["caption"].strip())
        if chart["alt"].startswith("Chart, "):  # a diagram (inferbook.diagrams) has no title to repeat
            assert chart["title"] and words(caption) != words(chart["title"]), f"the caption repeats the title: {chart}"


@pytest.mark.browser
def test_every_results_value_is_found_on_its_chapter_page(server, browser_page):
    page, _, _ = browser_page
    page.goto(f"{server}/results.html", wait_until="networkidle")
    links = page.eval_on_selector_all("a[href*='#headline-']", "els => els.map(a => [a.href, a.innerText.trim()])")
    executed = [s for s in WRITTEN]
    assert len(links) == len(executed), links
    for href, value in links:
        page.goto(href, wait_until="networkidle")
        anchor = href.split("#", 1)[1]
        box = page.evaluate(f"""() => {{ const a = document.getElementById('{anchor}');
            if (!a) return null; let n = a; while (n && !(n.classList && n.classList.contains('admonition'))) n = n.nextElementSibling || n.parentElement;
            return n ? n.innerText : null; }}""")
        assert box and value in box, f"{href}: the results page's {value!r} is not in the page's headline box {box!r}"


@pytest.mark.browser
def test_results_page_stacks_on_a_phone(server, browser_page):
    page, _, _ = browser_page
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.goto(f"{server}/results.html", wait_until="networkidle")
        wide = page.evaluate("""() => { const t = document.querySelector('div.ib-results table');
            return t ? t.getBoundingClientRect().right > document.documentElement.clientWidth + 2 : null; }""")
        assert wide is False
    finally:
        page.set_viewport_size({"width": 1280, "height": 1000})


@pytest.mark.browser
def test_glossary_bibliography_and_chinese_render(server, browser_page):
    page, left_machine, failed = browser_page
    page.goto(f"{server}/glossary.html", wait_until="networkidle")
    assert page.eval_on_selector_all("dl.glossary dt", "els => els.length") >= 20
    page.goto(f"{server}/bibliography.html", wait_until="networkidle")
    assert page.eval_on_selector_all("div.citation, dl.citation > dt, li.citation, .bibliography dt, "
                                     "div[role=list] div.citation", "els => els.length") >= 20
    page.goto(f"{server}/chapters/kimi-spec-budget.html", wait_until="networkidle")
    loaded = page.evaluate("""async () => (await document.fonts.load('16px "inferbook CJK"', '二')).length""")
    assert loaded >= 1, "the bundled CJK font serves the seed's quotes"
    assert not left_machine and not failed, (left_machine, failed)


# Cross-references a reader follows from a chapter page: {doc}, {ref} and {term} links (downloads apart).
INTERNAL_LINKS = r"""() => [...(document.querySelector('article.bd-article') || document.querySelector('main'))
    .querySelectorAll('a.reference.internal')].filter(a => !a.classList.contains('download')).map(a => a.href)"""


@pytest.mark.browser
@pytest.mark.parametrize("slug", WRITTEN)
def test_cross_references_resolve(slug, server, browser_page):
    """Every chapter links another chapter, the compile check's explanation and the glossary, and every
    such link lands on a page that exists, at an anchor that exists there."""
    page, left_machine, failed = browser_page
    page.goto(f"{server}/chapters/{slug}.html", wait_until="networkidle")
    links = sorted(set(page.evaluate(INTERNAL_LINKS)))
    here = f"{server}/chapters/{slug}.html"
    others = {u.split("#")[0] for u in links if "/chapters/" in u and u.split("#")[0] != here}
    assert others, f"{slug} links no other chapter: {links}"
    assert f"{server}/intro.html#compile-check" in links, f"{slug} does not link the compile check"
    assert any(u.startswith(f"{server}/glossary.html#") for u in links), f"{slug} links no glossary term"
    pages: dict[str, str] = {}
    for url in links:
        target, _, anchor = url.partition("#")
        if target not in pages:
            response = page.request.get(target)
            assert response.ok, f"{slug}: {url} does not resolve ({response.status})"
            pages[target] = response.text()
        if anchor:
            assert re.search(rf'\bid="{re.escape(anchor)}"', pages[target]), f"{slug}: no anchor #{anchor} in {target}"
    assert not left_machine and not failed, (left_machine, failed)
