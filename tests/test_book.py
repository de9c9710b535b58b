"""The runner and the build: caching, invalidation, failures named by chapter and cell, keep-going."""
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from inferbook import book, toc
from inferbook.toc import ChapterInfo

ROOT = Path(__file__).resolve().parents[1]

HEADER = textwrap.dedent("""\
    ---
    jupytext:
      text_representation:
        extension: .md
        format_name: myst
    kernelspec:
      display_name: Python 3
      language: python
      name: python3
    ---
    """)


def chapter_md(title, body):
    return HEADER + f"\n# {title}\n\n```{{code-cell}} ipython3\n:tags: [parameters]\n\ndevice = \"auto\"\npreset = \"auto\"\nseed = 0\n```\n\n" + \
        "".join(f"```{{code-cell}} ipython3\n{cell}\n```\n\n" for cell in body)


@pytest.fixture
def fake_book(tmp_path, monkeypatch):
    """A two-chapter book in a temporary checkout: `good` runs, `bad` raises in its third cell."""
    root = tmp_path / "repo"
    (root / "chapters").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "data" / "input.txt").write_text("v1")
    shutil.copy(ROOT / "_config.yml", root / "_config.yml")
    shutil.copy(ROOT / "references.bib", root / "references.bib")  # the config names it
    (root / "intro.md").write_text("# Fake book\n\nIntro.\n")
    (root / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: chapters/good\n"
                                   "  - file: chapters/bad\n  - file: status\n")
    (root / "chapters" / "good.md").write_text(chapter_md("Good", ["x = 6 * 7", "print('answer', x)"]))
    (root / "chapters" / "bad.md").write_text(chapter_md("Bad", ["y = 1", "raise ValueError('boom in cell')"]))
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "fakechap.py").write_text("PARAMETERS = {}\nPRESETS = {}\ndef measure(ctx):\n    return []\n")
    monkeypatch.syspath_prepend(str(mod))
    monkeypatch.setenv("PYTHONPATH", str(mod))
    monkeypatch.setattr(toc, "CHAPTERS", {
        s: ChapterInfo(s, "upgrade", s.title(), "-", "fakechap") for s in ("good", "bad")})
    monkeypatch.setattr(book, "repo_root", lambda: root)
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(root / "_build"))
    monkeypatch.delenv("INFERBOOK_RESULTS", raising=False)
    return root


def test_failure_is_named_then_keep_going_builds_the_rest(fake_book):
    logs = []
    with pytest.raises(book.ChapterFailed) as e:
        book.build_book(device="cpu", preset="smoke", progress=False, log=logs.append)
    err = e.value
    assert err.slug == "bad" and err.cell == 3 and err.ename == "ValueError" and "boom in cell" in err.evalue
    assert "chapter 'bad' failed in code cell 3: ValueError: boom in cell" in str(err)
    meta = book.read_meta("bad")
    assert meta["status"] == "failed" and meta["cell"] == 3
    assert book.read_meta("good")["status"] == "ok"
    assert not (fake_book / "_build" / "html" / "index.html").exists(), "no book without --keep-going"

    logs.clear()
    with pytest.raises(book.ChapterFailed):
        book.build_book(device="cpu", preset="smoke", keep_going=True, progress=False, log=logs.append)
    assert any("good: cached, reused" in line for line in logs), logs
    html = fake_book / "_build" / "html"
    assert "answer 42" in (html / "chapters" / "good.html").read_text()
    bad_page = (html / "chapters" / "bad.html").read_text()
    assert "This chapter failed to execute" in bad_page and "boom in cell" in bad_page
    status = (html / "status.html").read_text()
    assert "failed (code cell 3" in status and "ok" in status


def test_cache_reuse_and_invalidation(fake_book, monkeypatch):
    (fake_book / "chapters" / "bad.md").unlink()
    monkeypatch.setattr(toc, "CHAPTERS", {"good": toc.CHAPTERS["good"]})
    (fake_book / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: chapters/good\n  - file: status\n")
    rp = book.run_parameters("cpu", "smoke")
    assert book.chapter_status("good", rp) == "not executed"
    book.build_book(device="cpu", preset="smoke", progress=False, log=lambda *_: None)
    assert book.chapter_status("good", rp) == "cached"
    logs = []
    book.build_book(device="cpu", preset="smoke", progress=False, log=logs.append)
    assert any("cached, reused" in line for line in logs)
    # a changed data input, parameter or source invalidates the cache
    (fake_book / "data" / "input.txt").write_text("v2")
    assert book.chapter_status("good", rp) == "stale"
    book.build_book(device="cpu", preset="smoke", progress=False, log=lambda *_: None)
    assert book.chapter_status("good", rp) == "cached"
    assert book.chapter_status("good", book.run_parameters("cpu", "cpu")) == "stale"
    src = fake_book / "src" / "inferbook"
    src.mkdir(parents=True)
    (src / "kernel.py").write_text("# touched\n")
    assert book.chapter_status("good", rp) == "stale"


def test_hash_covers_src_inferbook_of_the_real_checkout():
    rp = book.run_parameters("cpu", "smoke")
    h1 = book.input_hash("upgrade-record", rp)
    probe = ROOT / "src" / "inferbook" / "_cache_probe_test.py"
    try:
        probe.write_text("# probe\n")
        assert book.input_hash("upgrade-record", rp) != h1
    finally:
        probe.unlink()
    assert book.input_hash("upgrade-record", rp) == h1


def test_status_page_lists_every_planned_chapter():
    page = book.status_page({"upgrade-record": {"status": "ok", "device": "CPU: X (2 cores)", "seconds": 1.5,
                                                "date": "2026-11-29T10:00:00+00:00", "parameters": {"preset": "cpu"}}})
    for slug in toc.CHAPTERS:
        assert slug in page
    assert "| ok | CPU: X (2 cores) | cpu | 1.5 | 2026-11-29 10:00:00+00:00 |" in page


def test_missing_optional_package_refuses_or_keeps_going(fake_book, monkeypatch, tmp_path):
    from inferbook.errors import MissingRequirement

    mods = tmp_path / "mods"
    (mods / "fakeneeds.py").write_text("REQUIRES = {'no_such_package_xyz': 'writing MP4'}\n"
                                       "PARAMETERS = {}\nPRESETS = {}\ndef measure(ctx):\n    return []\n")
    monkeypatch.setitem(toc.CHAPTERS, "bad", ChapterInfo("bad", "upgrade", "Bad", "-", "fakeneeds"))
    with pytest.raises(MissingRequirement, match="needs the Python package 'no_such_package_xyz'"):
        book.build_book(device="cpu", preset="smoke", progress=False, log=lambda *_: None)
    assert not (fake_book / "_build" / "executed").exists(), "refused before executing anything"
    logs = []
    with pytest.raises(book.ChapterFailed, match="MissingRequirement"):
        book.build_book(device="cpu", preset="smoke", keep_going=True, progress=False, log=logs.append)
    html = fake_book / "_build" / "html"
    assert "answer 42" in (html / "chapters" / "good.html").read_text()
    assert "was not executed" in (html / "chapters" / "bad.html").read_text()
    assert any("bad: not executed" in line for line in logs), logs


def test_a_failed_run_never_replaces_the_last_good_notebook(fake_book, monkeypatch):
    """A run that fails in a cell (a knob that passed validation, a changed input) keeps the last
    good executed notebook and its meta byte-identical; the failure is kept beside them and the
    staged page is the good one with a warning, the status page says both."""
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT / "src")]))
    executed = fake_book / "_build" / "executed"
    save = ("import os\nfrom inferbook import record\nr = record.RunRecord(chapter='good', name={!r})\n"
            "record.save_complete(os.path.join(os.environ['INFERBOOK_RESULTS'], 'good.json'), [r])")
    good_md = fake_book / "chapters" / "good.md"
    source = good_md.read_text()
    good_md.write_text(chapter_md("Good", [save.format("good-run"), "x = 6 * 7", "print('answer', x)"]))
    book.execute("good", device="cpu", preset="smoke", progress=False)
    nb, meta = executed / "good.ipynb", executed / "good.meta.json"
    results = fake_book / "_build" / "results" / "good.json"
    before = (nb.read_bytes(), meta.read_bytes(), results.read_bytes())
    # the measure cell completes and saves its records, then a later cell fails
    good_md.write_text(chapter_md("Good", [save.format("failed-run"), "raise RuntimeError('knob broke a cell')"]))
    with pytest.raises(book.ChapterFailed):
        book.execute("good", device="cpu", preset="smoke", progress=False)
    assert (nb.read_bytes(), meta.read_bytes(), results.read_bytes()) == before, \
        "the failed run replaced the good notebook, its meta or its results"
    assert '"failed-run"' in (fake_book / "_build" / "results" / "good.partial.json").read_text()
    assert not list(results.parent.glob(".*.tmp"))
    failed = book.read_failed_meta("good")
    assert failed["status"] == "failed" and "knob broke a cell" in failed["error"]
    assert book.executed_ok("good", book.read_meta("good"))
    metas = {"good": {**book.read_meta("good"), "latest_failure": failed}}
    staged = (book.stage(metas) / "chapters" / "good.ipynb").read_text()
    assert "The latest execution of this chapter failed" in staged and "answer 42" in staged
    assert "a later run failed (code cell 3" in book.status_page(metas)
    assert "a later measurement was stopped" in book.status_page(metas)
    # a good run again: it replaces the notebook, and the kept failure goes
    good_md.write_text(source)
    book.execute("good", device="cpu", preset="smoke", progress=False)
    assert book.read_failed_meta("good") is None and not book.failed_paths("good")[0].exists()
