"""`inferbook book --jobs N`: chapters execute side by side on CPU, the log and the failures stay in
book order, each record says it ran beside others, and a GPU run stays sequential."""
import json
import os
import signal
import sys

import pytest

from inferbook import book, cli, device, reader, toc
from inferbook.errors import UserError
from inferbook.toc import ChapterInfo

from test_book import ROOT, chapter_md, fake_book  # noqa: F401 -- the fixture

# `first` waits (60 s at most) for `second` to start: it ends only if the two ran at the same time.
WAIT_FOR_SECOND = ("import os, time\nfrom pathlib import Path\nm = Path(os.environ['FAKE_MARKERS'])\n"
                   "(m / 'first').write_text('started')\nt0 = time.time()\n"
                   "while not (m / 'second').exists() and time.time() - t0 < 60:\n    time.sleep(0.05)\n"
                   "print('overlapped', (m / 'second').exists())")
SECOND = "import os\nfrom pathlib import Path\n(Path(os.environ['FAKE_MARKERS']) / 'second').write_text('started')"
RECORD = ("import os, torch\nfrom inferbook import record\nfrom inferbook.device import hardware_info\n"
          "r = record.RunRecord(chapter={slug!r}, name='r', hardware=hardware_info(torch.device('cpu')))\n"
          "record.save_complete(os.path.join(os.environ['INFERBOOK_RESULTS'], {file!r}), [r])\n"
          "print('threads', os.environ.get('OMP_NUM_THREADS'), 'jobs', os.environ.get('INFERBOOK_BOOK_JOBS'))")


@pytest.fixture
def jobs_book(fake_book, monkeypatch, tmp_path):
    """The fake book of test_book with three chapters: first, second (run side by side), bad (fails)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("FAKE_MARKERS", str(markers))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT / "src")]))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(book, "cpu_cores", lambda: 2)
    chapters = fake_book / "chapters"
    (chapters / "good.md").unlink()
    (chapters / "first.md").write_text(chapter_md("First", [RECORD.format(slug="first", file="first.json"),
                                                            WAIT_FOR_SECOND]))
    (chapters / "second.md").write_text(chapter_md("Second", [SECOND, RECORD.format(slug="second", file="second.json")]))
    (fake_book / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: chapters/first\n"
                                        "  - file: chapters/second\n  - file: chapters/bad\n  - file: status\n")
    monkeypatch.setattr(toc, "CHAPTERS", {
        s: ChapterInfo(s, "upgrade", s.title(), "-", "fakechap") for s in ("first", "second", "bad")})
    return fake_book


def test_two_jobs_run_side_by_side_in_book_order_and_say_so(jobs_book):
    logs = []
    with pytest.raises(book.ChapterFailed) as e:
        book.build_book(device="cpu", preset="smoke", keep_going=True, jobs=2, progress=False, log=logs.append)
    assert (e.value.slug, e.value.cell) == ("bad", 3), (str(e.value), logs)  # named as in a sequential build
    executed = jobs_book / "_build" / "executed"
    first = (executed / "first.ipynb").read_text()
    assert "overlapped True" in first, "first ended without second having started: not side by side"
    assert "threads 1 jobs 2" in first and "threads 1 jobs 2" in (executed / "second.ipynb").read_text()
    ends = [line.split(":")[0] for line in logs if " ok in " in line or "failed in" in line]
    assert ends == ["[1/3] first", "[2/3] second", "[3/3] chapter 'bad' failed in code cell 3"], logs
    for slug in ("first", "second"):
        hw = json.loads((jobs_book / "_build" / "results" / f"{slug}.json").read_text())
        hw = (hw["records"] if isinstance(hw, dict) else hw)[0]["hardware"]
        assert hw["book_jobs"] == 2 and hw["torch_threads"] == 1, hw
        assert book.read_meta(slug)["status"] == "ok" and book.read_meta(slug)["cpu_seconds"] > 0
    assert book.read_meta("bad")["status"] == "failed"
    assert "answer" not in first and (jobs_book / "_build" / "html" / "chapters" / "first.html").is_file()
    # the cache does not depend on the job count: a sequential build reuses what two jobs executed
    logs.clear()
    with pytest.raises(book.ChapterFailed):
        book.build_book(device="cpu", preset="smoke", keep_going=True, jobs=1, progress=False, log=logs.append)
    assert any("first: cached, reused" in line for line in logs) and any("second: cached, reused" in line for line in logs)


def test_without_keep_going_the_first_failure_stops_the_build_and_the_chapter_beside_it(jobs_book):
    """`first` fails while `second` runs beside it: `second` is interrupted (its execution commits
    nothing, as a Ctrl-C'd one), `bad` never starts, no book is built, no temporaries are left."""
    import time

    (jobs_book / "chapters" / "first.md").write_text(chapter_md("First", [
        WAIT_FOR_SECOND, "raise ValueError('first breaks')"]))
    (jobs_book / "chapters" / "second.md").write_text(chapter_md("Second", [
        SECOND, "import time\nt0 = time.time()\nwhile time.time() - t0 < 120:\n    time.sleep(0.05)"]))
    logs = []
    t0 = time.monotonic()
    # started as a background command of a non-interactive shell starts it (`make book &`, nohup): SIGINT
    # ignored, which the forked workers inherit; the stop must still reach them (it did not: they were
    # killed after the grace, leaving their temporaries)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(book.ChapterFailed) as e:
            book.build_book(device="cpu", preset="smoke", jobs=2, progress=False, log=logs.append)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert time.monotonic() - t0 < 110, "the build waited for the chapter beside the failure"
    assert e.value.slug == "first" and e.value.cell == 3 and "first breaks" in e.value.evalue
    assert not any(line.startswith("[3/3] bad") for line in logs), logs
    assert book.read_meta("second") is None, "an interrupted execution committed something"
    assert not (jobs_book / "_build" / "html" / "index.html").exists()
    for folder in ("executed", "results"):
        assert not list((jobs_book / "_build" / folder).glob(".*.tmp*")), f"a stopped worker left temporaries in {folder}"


def test_jobs_auto_is_two_on_cpu_and_one_on_a_gpu(monkeypatch):
    monkeypatch.setattr(book, "cpu_cores", lambda: 2)
    assert book.book_jobs("auto", "cpu") == 2 and book.book_jobs(3, "cpu") == 3 and book.book_jobs("1", "cpu") == 1
    monkeypatch.setattr(book, "cpu_cores", lambda: 1)
    assert book.book_jobs("auto", "cpu") == 1
    import torch

    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    assert book.book_jobs("auto", "auto") == 1 and book.book_jobs(4, "cuda") == 1, "GPU timings must not contend"
    for bad in ("0", "-1", "two", 0):
        with pytest.raises(UserError, match="--jobs must be a positive integer"):
            book.book_jobs(bad, "cpu")


def test_bad_jobs_is_one_line_and_exit_2(capsys):
    assert cli.main(["book", "--jobs", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "inferbook: error: --jobs must be a positive integer or 'auto', got 'zero'", err


def test_record_and_page_say_a_chapter_ran_beside_others(monkeypatch):
    import torch

    device._hardware_info.cache_clear()
    monkeypatch.setenv("INFERBOOK_BOOK_JOBS", "2")
    try:
        hw = device.hardware_info(torch.device("cpu"))
    finally:
        device._hardware_info.cache_clear()
    assert hw["book_jobs"] == 2
    from inferbook.record import RunRecord

    line = reader.provenance([RunRecord(chapter="x", name="r", preset="cpu", hardware=hw)])
    assert "executed beside up to 1 other chapter" in line
    monkeypatch.delenv("INFERBOOK_BOOK_JOBS")
    assert "book_jobs" not in device.hardware_info(torch.device("cpu"))
    assert "beside" not in reader.provenance([RunRecord(chapter="x", name="r", preset="cpu",
                                                        hardware=device.hardware_info(torch.device("cpu")))])
