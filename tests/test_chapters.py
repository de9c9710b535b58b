"""Every written chapter executes end to end, through the same runner as `make book`,
at preset=smoke on CPU. A chapter whose correctness check fails fails here."""
from pathlib import Path

import pytest

from inferbook import book

ROOT = Path(__file__).resolve().parents[1]
WRITTEN = [c.slug for c in book.built_chapters()]


@pytest.mark.chapter
@pytest.mark.parametrize("slug", WRITTEN)
def test_chapter_executes_at_smoke(slug, tmp_path):
    meta = book.execute(slug, device="cpu", preset="smoke", executed_dir=tmp_path / "executed",
                        results_dir=tmp_path / "results", progress=False)
    assert meta["status"] == "ok"
    from inferbook.record import load_records

    records = load_records(tmp_path / "results" / f"{slug}.json")
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
