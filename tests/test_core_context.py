"""The context: budgets per chapter and preset, optional packages said in one line, and records
saved as they fill in, so a run killed mid-way keeps what it measured."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import inferbook
from inferbook import context, measure, presets
from inferbook.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_budget_from_table_env_and_argument(monkeypatch, results_env):
    monkeypatch.delenv("INFERBOOK_BUDGET_S", raising=False)
    m, c = presets.BUDGETS_S["gpu"]["upgrade-record"]
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="gpu")
    assert ctx.budget_s == m + c and ctx.compile_budget_s == c
    assert inferbook.setup("upgrade-record", device="cpu", preset="smoke").budget_s is None
    assert inferbook.setup("upgrade-record", device="cpu", preset="gpu", budget_s="none").budget_s is None
    monkeypatch.setenv("INFERBOOK_BUDGET_S", "7.5")
    assert inferbook.setup("upgrade-record", device="cpu", preset="smoke").budget_s == 7.5
    for bad in ("-1", "nan", "soon", "1e9"):
        with pytest.raises(UserError, match="budget must be"):
            inferbook.setup("upgrade-record", device="cpu", preset="smoke", budget_s=bad)


def test_measure_runs_inside_the_budget(monkeypatch, results_env):
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke", budget_s=30)
    seen = {}

    def fake_measure(c, **params):
        seen["left"] = c.budget_left()
        return []

    monkeypatch.setattr(ctx.module, "measure", fake_measure)
    ctx.measure()
    assert 0 < seen["left"] <= 30 and measure.budget_left() is None


def test_missing_optional_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    with pytest.raises(UserError) as e:
        inferbook.setup("omni-h3-workflows", device="cpu", preset="smoke")
    assert "needs the Python package 'av'" in str(e.value) and "\n" not in str(e.value)


def test_records_are_saved_as_they_fill_in(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    monkeypatch.setattr(context, "AUTOSAVE_INTERVAL_S", 0.0)
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke")
    path = ctx.partial_results_path()

    def interrupted(c, **params):
        r = c.new_record("first")
        r.add("x", 1.0, "s")
        assert json.loads(path.read_text())["records"][0]["measurements"][0]["value"] == 1.0
        c.new_record("second").add_check("ok", True)
        raise KeyboardInterrupt

    monkeypatch.setattr(ctx.module, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctx.measure()
    data = json.loads(path.read_text())
    assert data["complete"] is False and [r["name"] for r in data["records"]] == ["first", "second"]
    assert not ctx.results_path().exists(), "a stopped run must not write the complete results file"
    assert data["records"][1]["checks"][0]["passed"] is True


def test_killed_measure_keeps_what_it_measured(tmp_path):
    script = textwrap.dedent(f"""
        import time, inferbook
        ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke")
        def slow(c, **params):
            r = c.new_record("done")
            r.add("t", 2.0, "s")
            time.sleep(1.2)           # past the autosave interval
            r.add("u", 3.0, "s")
            open({str(tmp_path / 'marker')!r}, "w").write("1")
            time.sleep(60)
        ctx.module.measure = slow
        ctx.measure()
    """)
    env = dict(os.environ, INFERBOOK_RESULTS=str(tmp_path / "res"), PYTHONPATH=str(ROOT / "src"))
    env.pop("INFERBOOK_SAVE_REFERENCE", None)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    t0 = time.time()
    while not (tmp_path / "marker").exists():
        assert proc.poll() is None and time.time() - t0 < 120
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = json.loads((tmp_path / "res" / "upgrade-record.partial.json").read_text())
    assert not (tmp_path / "res" / "upgrade-record.json").exists()
    assert data["complete"] is False
    assert [m["name"] for m in data["records"][0]["measurements"]] == ["t", "u"]


def test_git_state_from_the_environment_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(context, "repo_root", lambda: tmp_path)
    context.git_state.cache_clear()
    try:
        monkeypatch.setenv("INFERBOOK_GIT_COMMIT", "abc123")
        monkeypatch.setenv("INFERBOOK_GIT_DIRTY", "0")
        monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
        g = context.git_state()
        assert g["commit"] == "abc123" and g["dirty"] is False and g["from"] == "INFERBOOK_GIT_COMMIT"
        context.git_state.cache_clear()
        monkeypatch.delenv("INFERBOOK_GIT_COMMIT")
        (tmp_path / ".git-commit").write_text("fedcba\n")
        assert context.git_state()["commit"] == "fedcba"
    finally:
        context.git_state.cache_clear()


def test_records_made_after_measure_do_not_replace_the_saved_run(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    monkeypatch.setattr(context, "AUTOSAVE_INTERVAL_S", 0.0)
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke")

    def one(c, **params):
        r = c.new_record("kept")
        r.add("x", 1.0, "s")
        return [r]

    monkeypatch.setattr(ctx.module, "measure", one)
    ctx.measure()
    before = ctx.results_path().read_text()
    ctx.new_record("page's own").add("y", 2.0, "s")
    assert ctx.results_path().read_text() == before and json.loads(before)["complete"] is True
