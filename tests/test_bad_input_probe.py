"""A probe of bad inputs across classes (knobs, duplicates, budgets, parts, record files, build
folders): each is exit 2, exactly one line on stderr, no traceback, and nothing written. In-process
CLI calls; the work functions refuse to run, so "before any work" is checked too."""
import json
import os

import pytest

from inferbook import cli, context, record


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    import papermill

    def refuse(*a, **k):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(papermill, "execute_notebook", refuse)
    monkeypatch.setattr(context.Context, "measure", refuse)
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("INFERBOOK_RESULTS", raising=False)
    monkeypatch.setenv("INFERBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    files = tmp_path / "files"
    files.mkdir()
    good = record.RunRecord(chapter="upgrade-record", name="a", hardware={"device_type": "cpu", "cpu_model": "x"})
    good.add("t", 1.0, "s")
    base = {"inferbook_results": 1, "complete": True, "records": [good.to_dict()]}

    def variant(name, edit):
        d = json.loads(json.dumps(base))
        edit(d["records"][0])
        (files / name).write_text(json.dumps(d))

    variant("huge-int.json", lambda r: r["measurements"][0].__setitem__("value", 10 ** 400))
    variant("list-name.json", lambda r: r.__setitem__("name", ["a"]))
    variant("dict-unit.json", lambda r: r["measurements"][0].__setitem__("unit", {"s": 1}))
    variant("list-commit.json", lambda r: r.__setitem__("git", {"commit": ["x"]}))
    variant("list-lifecycle.json", lambda r: r["measurements"][0].__setitem__("lifecycle", ["steady"]))
    (files / "deep.json").write_text("[" * 100 + "]" * 100)
    (files / "random.json").write_bytes(os.urandom(4096))
    (files / "big.json").write_bytes(b" " * (record.MAX_RESULTS_BYTES + 1))
    os.mkfifo(files / "fifo.json")
    (files / "good.json").write_text(json.dumps(base))
    return tmp_path, files


def _cases(files):
    f = lambda n: str(files / n)  # noqa: E731
    return [
        (["run", "upgrade-record", "-p", "batch", "1", "-p", "batch", "2"], "given twice"),
        (["measure", "upgrade-record", "-p", "batch", "1", "-p", "batch", "2"], "given twice"),
        (["measure", "upgrade-record", "--preset", "bogus", "-p", "preset", "smoke"], "preset given twice"),
        (["run", "upgrade-record", "--device", "cpu", "-p", "device", "cuda"], "device given twice"),
        (["measure", "upgrade-record", "--budget", "0"], "budget"),
        (["measure", "upgrade-record", "--budget", "-5"], "budget"),
        (["measure", "upgrade-record", "--budget", "nan"], "budget"),
        (["measure", "upgrade-record", "--budget", "inf"], "budget"),
        (["measure", "kimi-dspark-acceptance", "--preset", "smoke", "-p", "output_len", "1"], "output_len"),
        (["measure", "kimi-dspark-acceptance", "--preset", "smoke", "-p", "prompts_per_task", "500"], "prompts_per_task"),
        (["measure", "kimi-dspark-acceptance", "--preset", "smoke", "-p", "output_len", "250"], "context"),
        (["measure", "deterministic-attention", "--preset", "smoke", "-p", "batch_sizes", ","], "batch_sizes"),
        (["measure", "deterministic-attention", "--preset", "smoke", "-p", "target_len", "999"], "max_seqlen"),
        (["run", "tiered-kv-offload", "--preset", "smoke", "-p", "host_sweep", "nan"], "host_sweep"),
        (["budgets", "--part=1/1000000000"], "N must be"),
        (["budgets", "--part=0/2"], "K must be"),
        (["results", "--compare", f("huge-int.json"), f("good.json")], "out of range"),
        (["results", "--compare", f("list-name.json"), f("good.json")], "'name' must be a string"),
        (["results", "--compare", f("dict-unit.json"), f("good.json")], "unit"),
        (["results", "--compare", f("list-commit.json"), f("good.json")], "git.commit"),
        (["results", "--compare", f("list-lifecycle.json"), f("good.json")], "lifecycle"),
        (["results", "--compare", f("deep.json"), f("good.json")], "deeper than"),
        (["results", "--compare", f("random.json"), f("good.json")], "results file"),
        (["results", "--compare", f("big.json"), f("good.json")], "at most"),
        (["results", "--compare", f("fifo.json"), f("good.json")], "is a FIFO"),
        (["results", "--compare", "/dev/zero", f("good.json")], "is a device"),
        (["results", "--compare", str(files), f("good.json")], "is a folder"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_nothing_written(sandbox, capsys):
    tmp_path, files = sandbox
    before = sorted(p.name for p in files.iterdir())
    failures = []
    for argv, needle in _cases(files):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if not (code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err):
            failures.append((argv, code, err))
    assert not failures, failures
    assert not (tmp_path / "build").exists() and not (tmp_path / "ref").exists(), "something was written"
    assert sorted(p.name for p in files.iterdir()) == before


def test_nan_workload_is_comparable_with_itself_and_names_print_escaped(tmp_path, capsys):
    r = record.RunRecord(chapter="upgrade-record", name="x\n\x1b[31mred", variant="é",
                         hardware={"device_type": "cpu", "cpu_model": "x"}, workload={"steps": float("nan")})
    r.add("t", 1.0, "s")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"inferbook_results": 1, "records": [r.to_dict()]}, allow_nan=True))
    assert cli.main(["results", "--compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b" in out


def test_output_is_encodable_under_lang_c(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    r = record.RunRecord(chapter="upgrade-record", name="naïve—名", hardware={"device_type": "cpu", "cpu_model": "x"})
    record.save_complete(tmp_path / "res" / "upgrade-record.json", [r])
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": "ascii",
           "PYTHONPATH": str(root / "src"), "INFERBOOK_RESULTS": str(tmp_path / "res"),
           "INFERBOOK_REFERENCE_DIR": str(tmp_path / "ref"), "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "inferbook.cli", "results"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "na\\xefve" in p.stdout
