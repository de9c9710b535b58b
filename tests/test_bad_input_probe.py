"""A probe of bad inputs across classes (knobs, duplicates, budgets, parts, record files, build
folders): each is exit 2, exactly one line on stderr, no traceback, and nothing written. In-process
CLI calls; the work functions refuse to run, so "before any work" is checked too."""
import json

import pytest

from inferbook import cli, context, record


def _probe():
    """scripts/probe_bad_input.py as a module (the subprocess probe of the same inputs)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "probe_bad_input.py"
    spec = importlib.util.spec_from_file_location("probe_bad_input", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    _probe().record_files(files)        # the probe script's own hostile files
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
        # data-dependent and shape rules, before any work (issue 27: head dim, one KV block, eps, ranks, layouts)
        *[([cmd, ch, "--preset", "smoke", "-p", "d_model", "66", "-p", "n_heads", "2", "-p", "n_kv_heads", "1"],
           "head dim 33, which must be even") for ch in ("upgrade-record", "kimi-spec-budget", "tiered-kv-offload")
          for cmd in ("run", "measure")],
        (["measure", "kimi-spec-budget", "--preset", "smoke", "-p", "max_num_batched_tokens", "8"], "one KV block"),
        (["run", "tiered-kv-offload", "--preset", "smoke", "-p", "max_num_batched_tokens", "8"], "one KV block"),
        (["measure", "minimax-m3-moe", "--preset", "smoke", "-p", "eps", "0"], "eps must be"),
        (["measure", "minimax-m3-moe", "--preset", "smoke", "-p", "eps", "3"], "ep = 3"),
        (["measure", "sglang-fused-comm", "--preset", "smoke", "-p", "world_size", "1"], "'world_size' must be in 2..8"),
        (["run", "sglang-fused-comm", "--preset", "smoke", "-p", "vocabs", "1"], "vocab size 1 cannot be split"),
        (["measure", "upgrade-record", "--preset", "smoke", "-p", "request_rate", "0"], "'request_rate' must be > 0"),
        (["measure", "upgrade-record", "--preset", "smoke", "-p", "burstiness", "0"], "'burstiness' must be > 0"),
        (["measure", "te-mxfp8-recipes", "--preset", "smoke", "-p", "ep_experts", "3"], "experts=3"),
        (["measure", "h3-vae-fusion", "--preset", "smoke", "-p", "reps", "1"], "reps must be >= 2"),
        (["measure", "h3-tiled-decode", "--preset", "smoke", "-p", "reps", "1"], "reps must be >= 2"),
        (["measure", "h3-vae-fusion", "--preset", "smoke", "-p", "check_video", "3,4,4"], "check_video"),
        (["measure", "comfy-generic-loops", "--preset", "smoke", "-p", "width", "30"], "multiples of"),
        (["measure", "omni-h3-workflows", "--preset", "smoke", "-p", "width", "100"], "none of its presets"),
        (["measure", "chord-w4a16", "--preset", "smoke", "-p", "decode_m", "0"], "decode_m"),
        (["measure", "kimi-dspark-acceptance", "--preset", "smoke", "-p", "num_spec_tokens", "4"],
         "the committed parallel draft drafts 8"),
        # the environment, read before any work
        (["measure", "gdn-backward-check", "--preset", "smoke", "--device", "cpu"], "TRITON_INTERPRET='off'",
         {"TRITON_INTERPRET": "off"}),
        (["measure", "upgrade-record", "--preset", "smoke", "--device", "cpu"], "TRITON_INTERPRET=' 1' is read",
         {"TRITON_INTERPRET": " 1"}),
        (["run", "upgrade-record", "--preset", "smoke"], "is a file", {"INFERBOOK_BUILD_DIR": f("good.json")}),
        (["measure", "upgrade-record", "--preset", "smoke"], "not writable",
         {"INFERBOOK_BUILD_DIR": "/proc/inferbook-probe", "INFERBOOK_RESULTS": "/proc/inferbook-probe/results"}),
        (["budgets", "--part=1/1000000000"], "N must be"),
        (["budgets", "--part=0/2"], "K must be"),
        (["results", "--compare", f("huge-int.json"), f("good.json")], "out of range"),
        (["results", "--compare", f("list-name.json"), f("good.json")], "'name' must be a string"),
        (["results", "--compare", f("dict-unit.json"), f("good.json")], "unit"),
        (["results", "--compare", f("list-commit.json"), f("good.json")], "git.commit"),
        (["results", "--compare", f("list-lifecycle.json"), f("good.json")], "lifecycle"),
        (["results", "--compare", f("deep.json"), f("good.json")], "deeper than"),
        (["results", "--compare", f("deeper.json"), f("good.json")], "nested deeper than 32 levels"),
        (["results", "--compare", f("random-4k.json"), f("good.json")], "results file"),
        (["results", "--compare", f("big.json"), f("good.json")], "at most"),
        (["results", "--compare", f("fifo.json"), f("good.json")], "is a FIFO"),
        (["results", "--compare", "/dev/zero", f("good.json")], "is a device"),
        (["results", "--compare", str(files), f("good.json")], "is a folder"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_nothing_written(sandbox, capsys):
    tmp_path, files = sandbox
    before = sorted(p.name for p in files.iterdir())
    failures = []
    for argv, needle, *env in _cases(files):
        with pytest.MonkeyPatch.context() as mp:
            for k, v in (env[0] if env else {}).items():
                mp.setenv(k, v)
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


@pytest.mark.parametrize("args,needle", [(["--port", "99999"], "--port 99999 must be in 1..65535"),
                                         (["--port", "0"], "--port 0 must be in 1..65535"),
                                         (["--max-connections", "0"], "--max-connections 0 must be at least 1"),
                                         (["--capacity-bytes", "-1"], "--capacity-bytes -1 must be at least 0"),
                                         (["--port", "x"], "invalid int value: 'x'")])
def test_kv_peer_cli_bounds_are_one_line_exit_2(args, needle, capsys):
    from inferbook.serving.kv_offload import peer

    with pytest.raises(SystemExit) as e:
        peer.main(["peer", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and needle in err[0], err
