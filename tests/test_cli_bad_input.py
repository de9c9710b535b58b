"""Bad input through the CLI, for both `run` and `measure`: exit 2, one line, no traceback, and no
work started (no notebook executed, no measure function called, nothing written)."""
import subprocess
import sys
from pathlib import Path

import pytest

from inferbook import cli, context

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    ("upgrade-record", ["-p", "batch", "-3"], "'batch' must be >= 1, got -3"),
    ("upgrade-record", ["-p", "batch", "0"], "'batch' must be >= 1, got 0"),
    ("upgrade-record", ["-p", "batch", "10000000000"], "'batch' = 10000000000 is out of range"),
    ("upgrade-record", ["-p", "batch", "100000"], "'batch' must be <= 512"),
    ("upgrade-record", ["-p", "reps", "0"], "'reps' must be >= 1"),
    ("upgrade-record", ["-p", "new_tokens", "0"], "'new_tokens' must be >= 1"),
    ("upgrade-record", ["-p", "n_heads", "3"], "'n_heads' = 3 must divide 'd_model' = 64"),
    ("upgrade-record", ["-p", "n_kv_heads", "3"], "'n_kv_heads' = 3 must divide 'n_heads'"),
    ("upgrade-record", ["--seed", "99999999999999999999999"], "seed must be in [0, 4294967295]"),
    ("upgrade-record", ["--seed", "-1"], "seed must be in [0, 4294967295]"),
    ("upgrade-record", ["-p", "seed", "x"], "seed must be an int"),
    ("upgrade-record", ["-p", "batch", " "], "'batch' must be int"),
    ("kimi-dspark-acceptance", ["-p", "temperature", "-1"], "'temperature' must be >= 0"),
    ("kimi-dspark-acceptance", ["-p", "temperature", "nan"], "'temperature' must be a finite number"),
    ("kimi-dspark-acceptance", ["-p", "temperature", "inf"], "'temperature' must be a finite number"),
    ("kimi-dspark-acceptance", ["-p", "confidence_threshold", "1.5"], "'confidence_threshold' must be <= 1"),
    ("chord-w4a16", ["-p", "skew", "nan"], "'skew' must be a finite number"),
    ("chord-w4a16", ["-p", "m_sweep", "1,x"], "m_sweep must be comma-separated positive ints"),
    ("chord-w4a16", ["-p", "hidden", "65"], "multiples of the group size 32"),
    ("chord-w4a16", ["-p", "top_k", "9"], "top_k must be in [1, experts=8]"),
    ("attention-test-matrix", ["-p", "head_dims", "7"], "axis 'head_dim' got [7]"),
    ("gdn-backward-check", ["-p", "gates", "bogus"], "gates 'bogus'"),
    ("gdn-backward-check", ["-p", "head_dims", "0"], "head_dims must be comma-separated positive ints"),
    ("h3-vae-fusion", ["-p", "ch_mult", "a,b"], "ch_mult must be comma-separated integers"),
    ("h3-vae-fusion", ["-p", "video", "5,18,16"], "must be multiples"),
    ("h3-tiled-decode", ["-p", "channels", "a,b"], "channels must be comma-separated integers"),
    ("h3-tiled-decode", ["-p", "overlap", "6"], "overlap must be in [0, tile=6)"),
    ("kimi-spec-budget", ["-p", "concurrencies", "1,0"], "concurrencies='1,0'"),
    ("kimi-spec-budget", ["-p", "concurrencies", "64"], "exceeds max_num_seqs"),
    ("kimi-topk-tail-fusion", ["-p", "formats", "fp3"], "formats must be a comma-separated subset"),
    ("minimax-m3-moe", ["-p", "tps", "3"], "tp = 3"),
    ("te-mxfp8-recipes", ["-p", "recipes", "nope"], "unknown recipe(s)"),
    ("te-mxfp8-recipes", ["-p", "lr", "nan"], "'lr' must be a finite number"),
    ("upgrade-record", ["-p", "batch"], "argument -p/--param: expected 2 arguments"),
    ("sglang-fused-comm", ["-p", "batches", "a,b"], "'batches' must be comma-separated int values"),
    ("deterministic-attention", ["-p", "batch_sizes", "1,0"], "'batch_sizes' must be >= 1"),
    ("deterministic-attention", ["-p", "kv_heads", "3"], "'kv_heads' = 3 must divide 'heads' = 4"),
    ("tiered-kv-offload", ["-p", "host_sweep", "x"], "host_sweep='x'"),
]


@pytest.fixture
def no_work(tmp_path, monkeypatch):
    """Any start of work fails the test: executing a notebook, or calling a measure function."""
    import papermill

    def refuse(*a, **k):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(papermill, "execute_notebook", refuse)
    monkeypatch.setattr(context.Context, "measure", refuse)
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path / "build" / "results"))
    return tmp_path / "build"


@pytest.mark.parametrize("command", ["run", "measure"])
@pytest.mark.parametrize("chapter,args,needle", BAD, ids=[f"{c}:{' '.join(a)}" for c, a, _ in BAD])
def test_bad_input_is_one_line_exit_2_before_any_work(command, chapter, args, needle, no_work, capsys):
    try:
        code = cli.main([command, chapter, "--device", "cpu", "--preset", "smoke", *args])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("inferbook: error: ") and needle in lines[0], lines
    assert "Traceback" not in captured.err
    assert not (no_work / "executed" / f"{chapter}.ipynb").exists()
    assert not (no_work / "results").exists() or not any((no_work / "results").iterdir())


@pytest.mark.parametrize("command", ["run", "measure"])
def test_bad_input_in_a_real_process_has_no_traceback(command, tmp_path):
    env = {"INFERBOOK_BUILD_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "inferbook.cli", command, "upgrade-record", "--preset", "smoke",
                        "--device", "cpu", "-p", "batch", "-3", "--seed", "1"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == "inferbook: error: parameter 'batch' must be >= 1, got -3"
    assert not any(tmp_path.iterdir())
