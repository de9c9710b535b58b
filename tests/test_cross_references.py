"""The book links itself together: checked on the MyST sources, without building anything.

Every chapter page links the chapters related to it, the explanation of the compile check (from its
compiler section, where it has one) and glossary terms; every link's target exists. The browser test
(tests/test_book_pages.py) checks the same links resolve in the built book."""
import re
from pathlib import Path

import pytest

from inferbook import toc

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
SOURCES = CHAPTERS + sorted((ROOT / "parts").glob("*.md")) + [ROOT / n for n in ("intro.md", "glossary.md",
                                                                                 "bibliography.md")]
GENERATED = {"results", "status"}  # pages the build writes (book.stage)
ROLE = re.compile(r"\{(doc|ref|term)\}`([^`]+)`")
LABEL = re.compile(r"^\(([\w-]+)\)=\s*$", re.M)
COMPILE_CHECK = "compile-check"
COMPILER_SECTION = "## What the compiler made of it"

# Chapters that must link each other (every pair, both ways): one subject seen from several chapters.
RELATED = [
    ("kimi-spec-budget", "kimi-dspark-acceptance", "upgrade-record", "tiered-kv-offload"),
    ("h3-vae-fusion", "h3-tiled-decode", "omni-h3-workflows", "comfy-generic-loops"),
    ("attention-test-matrix", "deterministic-attention"),
    ("chord-w4a16", "minimax-m3-moe", "kimi-topk-tail-fusion"),
    ("sglang-fused-comm", "te-mxfp8-recipes"),
]


def _target(body: str) -> str:
    """The target of a role's body: `text <target>` or `target`."""
    m = re.fullmatch(r"(?s).*<([^<>]+)>\s*", body)
    return (m.group(1) if m else body).strip()


def _prose(text: str) -> str:
    """The source without code cells and fenced code (a role in a listing is no link)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"\s*(`{3,})(.*)", line)
        if m and fence is None and not m.group(2).startswith(("{admonition", "{note", "{warning")):
            fence = m.group(1)
            continue
        if fence and line.strip() == fence:
            fence = None
            continue
        if fence is None:
            out.append(line)
    return "\n".join(out)


def _links(path: Path) -> list[tuple[str, str]]:
    return [(kind, _target(body)) for kind, body in ROLE.findall(_prose(path.read_text()))]


def _glossary_terms() -> set[str]:
    text = (ROOT / "glossary.md").read_text()
    block = text.split(":::{glossary}", 1)[1].split("\n:::", 1)[0]
    return {line.strip().lower() for line in block.splitlines() if line.strip() and not line.startswith((" ", "\t"))}


def _labels() -> set[str]:
    return {m for src in SOURCES for m in LABEL.findall(src.read_text())}


def test_the_compile_check_is_a_labelled_target_that_explains_inspect_and_the_cost_model():
    intro = (ROOT / "intro.md").read_text()
    assert f"({COMPILE_CHECK})=" in intro
    section = intro.split(f"({COMPILE_CHECK})=", 1)[1].split("\n## ", 2)[1]
    assert "inferbook inspect" in section and "inferbook.compiled.cost" in section
    assert "predicted, not measured" in section


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_links_related_chapters_and_the_compile_check(page):
    slug = page.stem
    links = _links(page)
    docs = {t for k, t in links if k == "doc"}
    others = {d for d in docs if d.removeprefix("../chapters/") in toc.CHAPTERS and d != slug}
    assert others, f"{slug} links no other chapter"
    for group in RELATED:
        if slug in group:
            missing = [s for s in group if s != slug and s not in docs]
            assert not missing, f"{slug} does not link its related chapters {missing}"
    text = _prose(page.read_text())
    assert f"{{ref}}`{COMPILE_CHECK}`" in text or ("ref", COMPILE_CHECK) in links, f"{slug} never links the compile check"
    if COMPILER_SECTION in text:  # linked from the section itself, where a reader meets the table
        section = text.split(COMPILER_SECTION, 1)[1].split("\n## ", 1)[0]
        assert ("ref", COMPILE_CHECK) in [(k, _target(b)) for k, b in ROLE.findall(section)], slug
    assert any(k == "term" for k, _ in links), f"{slug} marks no glossary term"


@pytest.mark.parametrize("page", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_target_exists(page):
    terms, labels = _glossary_terms(), _labels()
    for kind, target in _links(page):
        if kind == "doc":
            path = (page.parent / target) if not target.startswith("/") else ROOT / target.lstrip("/")
            name = path.resolve().relative_to(ROOT).as_posix()
            assert name in GENERATED or path.with_suffix(".md").is_file(), f"{page.name}: no page {target!r}"
        elif kind == "ref":
            assert target in labels, f"{page.name}: no label ({target})= in the book's sources"
        else:
            assert target.lower() in terms, f"{page.name}: {target!r} is not a glossary term"


def test_a_term_is_marked_at_its_first_use_only_once_per_chapter():
    """{term} marks the first use; marking every use would turn the prose into a page of links."""
    for page in CHAPTERS:
        seen = [t.lower() for k, t in _links(page) if k == "term"]
        repeated = {t for t in seen if seen.count(t) > 2}
        assert not repeated, f"{page.stem} links {sorted(repeated)} more than twice"
