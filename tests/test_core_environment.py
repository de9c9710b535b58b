"""One reading of the environment: TRITON_INTERPRET as Triton reads it, the profiler's USDT chatter
silenced, a failed check makes `inferbook measure` fail, unwritable output folders are one line."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inferbook import cli, context, device, toc
from inferbook.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
VALUES = ["1", "0", "", "true", "True", "TRUE", "on", "ON", "yes", "Yes", "y", "Y", "off", "false", "no", "2",
          " 1", "1 ", "t", "enable", "01"]


@pytest.mark.parametrize("value", VALUES)
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    ours = device.triton_interpreted()
    assert ours == device.env_flag_as_triton_reads_it(value)
    knobs = pytest.importorskip("triton.knobs")
    assert ours == bool(knobs.runtime.interpret), value


def test_interpreter_off_on_cpu_falls_back_and_says_so(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "off")
    ok, why = device.triton_backend_for(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET is off" in why


def test_profiler_start_and_stop_print_nothing():
    code = textwrap.dedent("""
        import inferbook, torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.ones(3) + 1
    """)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT / "src")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "USDT" not in p.stderr and "profiler_start" not in p.stderr, p.stderr


def test_measure_exits_1_when_a_check_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    module = toc.load_module(toc.get_chapter("upgrade-record"))

    def measure(ctx, **params):
        r = ctx.new_record("probe")
        r.add_check("kernel matches reference", False, error=1.0, tolerance=1e-3)
        r.add_check("other", True)
        return [r]

    monkeypatch.setattr(module, "measure", measure)
    assert cli.main(["measure", "upgrade-record", "--device", "cpu", "--preset", "smoke"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["inferbook: upgrade-record: 1 of 2 checks failed (first: probe: kernel matches reference)"]
    assert (tmp_path / "upgrade-record.json").is_file(), "the records are kept: they say what failed"


@pytest.mark.parametrize("argv", [["measure", "upgrade-record", "--preset", "smoke"],
                                  ["run", "upgrade-record", "--preset", "smoke"], ["book"],
                                  ["ceilings", "--device", "cpu"]])
def test_build_dir_that_is_a_file_is_one_line(argv, tmp_path, monkeypatch, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(f / "sub"))
    monkeypatch.delenv("INFERBOOK_RESULTS", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err and str(f) in err, err
    assert f.read_text() == "x"


def test_unwritable_results_folder_is_one_line(tmp_path, monkeypatch):
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(tmp_path / "b"))
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(UserError, match="is not writable: Read-only file system"):
        context.check_output_dirs()


def test_write_errors_of_a_place_are_one_line(monkeypatch, capsys):
    def cmd(args):
        raise PermissionError(13, "Permission denied", "/ro/x.json")

    monkeypatch.setattr(cli, "cmd_list", cmd)
    assert cli.main(["list"]) == 2
    assert capsys.readouterr().err == "inferbook: error: cannot write '/ro/x.json': Permission denied\n"


@pytest.mark.parametrize("part", ["1/1000000000", "0/2", "3/2", "1/0", "a/b", "1/17", "-1/2"])
def test_budget_parts_are_bounded(part, capsys):
    assert cli.main(["budgets", f"--part={part}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
