"""The tree's own contracts: sources without outputs, a TOC that matches the chapters,
environment.yml mirroring pyproject.toml, README's first commands."""
import re
import sys
from pathlib import Path

import pytest

from inferbook import toc

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "chapters").glob("*.md"))


def test_no_ipynb_beside_sources():
    assert not list((ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_chapter_source_is_text_without_outputs(src):
    import jupytext

    nb = jupytext.read(src)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") for c in code), "chapter sources hold no outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged parameters"
    # nothing above the parameters cell computes
    assert code.index(params[0]) == 0
    text = params[0].source
    for name in ("device", "preset", "seed"):
        assert re.search(rf"^{name} = ", text, re.M), f"parameters cell lacks {name}"
    info = toc.get_chapter(src.stem)
    module = toc.load_module(info)
    declared = set(re.findall(r"^(\w+) = ", text, re.M)) - {"device", "preset", "seed"}
    assert declared == set(module.PARAMETERS), "parameters cell and PARAMETERS differ"
    assert f'setup("{src.stem}"' in src.read_text()


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_no_typed_speedups(src):
    """Math is fine (MathJax ships with the book; the browser test proves no request leaves); typed
    speed-ups are not: they are glued from the run."""
    text = src.read_text()
    prose = "\n".join(line for line in text.splitlines() if not line.startswith(("    ", "```")))
    assert not re.search(r"\b\d+(\.\d+)?[x×] (faster|slower|speedup)", prose), "glue numbers from the run"


def test_toc_lists_exactly_the_written_chapters_in_book_order():
    import yaml

    toc_yml = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc_yml["parts"] for c in part["chapters"]]
    listed = [f.split("/", 1)[1] for f in files if f.startswith("chapters/")]
    written = [c.slug for c in toc.CHAPTERS.values() if (ROOT / "chapters" / f"{c.slug}.md").exists()]
    assert listed == written
    assert "status" in files
    captions = [part["caption"] for part in toc_yml["parts"]]
    for slug in listed:
        assert toc.PARTS[toc.CHAPTERS[slug].part] in captions


def test_sixteen_chapters_in_six_parts():
    assert len(toc.CHAPTERS) == 16 and len(toc.PARTS) == 6
    assert {c.part for c in toc.CHAPTERS.values()} == set(toc.PARTS)
    intro = (ROOT / "intro.md").read_text()
    for slug in toc.CHAPTERS:
        assert f"{{doc}}`chapters/{slug}`" in intro  # a link, not a code-formatted slug
    listed = {line.split("file: ")[1].strip() for line in (ROOT / "_toc.yml").read_text().splitlines() if "file:" in line}
    for part in toc.PARTS:
        assert f"parts/{part}" in listed and (ROOT / "parts" / f"{part}.md").is_file()
        page = (ROOT / "parts" / f"{part}.md").read_text()
        for info in toc.CHAPTERS.values():
            if info.part == part:
                assert f"{{doc}}`../chapters/{info.slug}`" in page, (part, info.slug)
    for info in toc.CHAPTERS.values():
        assert info.seed_section in toc.SEED_SECTIONS and info.slug in toc.UPSTREAM


def _pyproject_deps():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = list(data["project"]["dependencies"])
    for extra in data["project"]["optional-dependencies"].values():
        deps += extra
    return sorted(deps)


def test_environment_yml_mirrors_pyproject():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert sorted(d for d in pip if d != "-e .") == _pyproject_deps()


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:12]
    assert any(line.startswith("make book") for line in head) and any(line.startswith("make test") for line in head)


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_chapter_titles_match_the_table_of_contents():
    for info in toc.CHAPTERS.values():
        heading = next(line for line in (ROOT / "chapters" / f"{info.slug}.md").read_text().splitlines()
                       if line.startswith("# "))
        assert heading[2:].strip() == info.title, (info.slug, heading)


def test_cjk_font_covers_every_character_the_pages_quote():
    """The seed's Chinese renders offline: the committed subset font has every CJK character a page's source
    holds (rerun scripts/subset_cjk_font.py after adding Chinese text)."""
    import importlib.util

    pytest.importorskip("fontTools")
    pytest.importorskip("brotli")
    from fontTools.ttLib import TTFont

    spec = importlib.util.spec_from_file_location("subset_cjk_font", ROOT / "scripts" / "subset_cjk_font.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    font = TTFont(script.OUT)
    cmap = font.getBestCmap()
    missing = sorted(ch for ch in script.used_characters() if ord(ch) not in cmap)
    assert not missing, f"the CJK font lacks {''.join(missing[:40])}: run scripts/subset_cjk_font.py"
    assert script.OUT.stat().st_size < 400_000, "a subset, not the whole font"
    css = (ROOT / "_static" / "inferbook.css").read_text()
    assert 'url("fonts/inferbook-cjk.woff2")' in css and "unicode-range" in css


def test_glossary_and_bibliography_are_in_the_book():
    import yaml

    files = [c["file"] for part in yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"] for c in part["chapters"]]
    assert {"glossary", "bibliography"} <= set(files)
    assert all(part.get("numbered") for part in yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"][:6])
    assert "{bibliography}" in (ROOT / "bibliography.md").read_text()
    assert "@misc{vllm51725" in (ROOT / "references.bib").read_text()
