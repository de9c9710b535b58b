"""The last complete results file survives every interruption: a real `inferbook measure` process,
sent SIGINT or SIGKILL at its first autosave (the record just made) or at a later one (past the
autosave interval), leaves `<chapter>.json` byte-identical and keeps what it measured in
`<chapter>.partial.json`; SIGINT ends with one line and no traceback. A run that completes
replaces the good file and removes the partial one."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inferbook import cli, record

ROOT = Path(__file__).resolve().parents[1]

# `upgrade-record`'s measure replaced by one that says where it is (a marker file per autosave point)
# and then waits; `FAKE_FAST=1` returns at once (a complete run).
SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from inferbook import cli, toc
    module = toc.load_module(toc.get_chapter("upgrade-record"))
    marks = Path(os.environ["FAKE_MARKS"])

    def measure(ctx, **params):
        r = ctx.new_record("probe-" + os.environ["FAKE_TAG"])
        r.add("t", 1.0, "s")                      # first autosave: new_record forces one
        if os.environ.get("FAKE_FAST") == "1":
            return [r]
        (marks / "first").write_text("1")
        time.sleep(float(os.environ.get("FAKE_HOLD_FIRST", "0")))
        time.sleep(1.2)                           # past AUTOSAVE_INTERVAL_S
        r.add("u", 2.0, "s")                      # a later autosave
        (marks / "later").write_text("1")
        time.sleep(120)
        return [r]

    module.measure = measure
    sys.exit(cli.main(["measure", "upgrade-record", "--device", "cpu", "--preset", "smoke"]))
""")


def _start(tmp_path: Path, tag: str, preexec, fast: bool = False, hold_first: float = 0.0):
    marks = tmp_path / f"marks-{tag}"
    marks.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), INFERBOOK_RESULTS=str(tmp_path / "res"),
               FAKE_MARKS=str(marks), FAKE_TAG=tag, FAKE_FAST="1" if fast else "0",
               FAKE_HOLD_FIRST=str(hold_first), OMP_NUM_THREADS="1")
    env.pop("INFERBOOK_SAVE_REFERENCE", None)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec)
    return proc, marks


def _wait(marker: Path, proc, timeout=120):
    t0 = time.time()
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout
        time.sleep(0.05)


@pytest.mark.parametrize("point", ["first", "later"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_measure_keeps_the_last_complete_results(tmp_path, sig, point, sigint_as_a_shell_hands_it):
    good, _ = _start(tmp_path, "good", sigint_as_a_shell_hands_it, fast=True)
    out, err = good.communicate(timeout=120)
    assert good.returncode == 0, err
    path = tmp_path / "res" / "upgrade-record.json"
    before = path.read_bytes()
    assert json.loads(before)["complete"] is True
    assert not record.partial_path(path).exists(), "a complete run removes the partial file"

    proc, marks = _start(tmp_path, "stopped", sigint_as_a_shell_hands_it)
    _wait(marks / point, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert path.read_bytes() == before, "the last complete results file changed"
    partial = json.loads(record.partial_path(path).read_text())
    assert partial["complete"] is False and partial["records"][0]["name"] == "probe-stopped"
    # SIGINT saves once more on the way out; SIGKILL keeps the last autosave (the record made, and
    # anything added more than AUTOSAVE_INTERVAL_S later)
    want = ["t", "u"] if point == "later" else [] if sig == signal.SIGKILL else ["t"]
    assert [m["name"] for m in partial["records"][0]["measurements"]] == want
    if sig != signal.SIGKILL:
        assert proc.returncode == (130 if sig == signal.SIGINT else 143)
        assert err.strip() == ("inferbook: interrupted" if sig == signal.SIGINT else "inferbook: terminated"), err
    assert not list((tmp_path / "res").glob(".*.tmp")), "a temporary was left behind"

    # `results` lists both, the partial one as partial; the complete run is what a chapter's name means
    env_res = str(tmp_path / "res")
    os.environ["INFERBOOK_RESULTS"] = env_res
    try:
        assert cli._resolve_record("upgrade-record").name == "probe-good"
    finally:
        os.environ.pop("INFERBOOK_RESULTS")

    again, _ = _start(tmp_path, "again", sigint_as_a_shell_hands_it, fast=True)
    assert again.communicate(timeout=120) and again.returncode == 0
    assert json.loads(path.read_text())["records"][0]["name"] == "probe-again"
    assert not record.partial_path(path).exists()


def test_results_listing_shows_a_partial_run_as_partial(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path))
    monkeypatch.setenv("INFERBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    r = record.RunRecord(chapter="upgrade-record", name="good", hardware={"device_type": "cpu", "cpu_model": "x"})
    record.save_complete(tmp_path / "upgrade-record.json", [r])
    s = record.RunRecord(chapter="upgrade-record", name="stopped", hardware={"device_type": "cpu", "cpu_model": "x"})
    assert record.save_partial(tmp_path / "upgrade-record.json", [s]) == tmp_path / "upgrade-record.partial.json"
    assert cli.main(["results", "--chapter", "upgrade-record"]) == 0
    lines = capsys.readouterr().out.splitlines()
    good = [line for line in lines if " good " in line]
    stopped = [line for line in lines if " stopped " in line]
    assert good and "partial" not in good[0] and "incomplete" not in good[0]
    assert stopped and "(partial: a run that was stopped; the last complete run is upgrade-record.json)" in stopped[0]
    assert not record.results_complete(tmp_path / "upgrade-record.partial.json")
    assert record.results_complete(tmp_path / "upgrade-record.json")


def test_results_page_never_shows_a_partial_run_in_place_of_the_complete_one(tmp_path):
    from inferbook import reader

    hw = {"device_type": "cpu", "cpu_model": "x"}
    good = record.RunRecord(chapter="upgrade-record", name="good-run", hardware=hw, preset="smoke")
    good.add("t", 1.0, "s")
    stopped = record.RunRecord(chapter="upgrade-record", name="stopped-run", hardware=hw, preset="smoke")
    stopped.add("t", 9.0, "s")
    record.save_complete(tmp_path / "upgrade-record.json", [good])
    record.save_partial(tmp_path / "upgrade-record.json", [stopped])
    page = reader.results_page(tmp_path)
    row = next(line for line in page.splitlines() if "chapters/upgrade-record" in line)
    assert "good-run" in row and "stopped-run" not in row
    assert "a later run was stopped; its partial records are not shown" in row
    (tmp_path / "upgrade-record.json").unlink()
    row = next(line for line in reader.results_page(tmp_path).splitlines() if "chapters/upgrade-record" in line)
    assert "stopped-run" not in row and "only a stopped run" in row
