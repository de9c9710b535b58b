"""The command line: user errors are one line and exit 2, never a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferbook import cli
from inferbook import record as rec

ROOT = Path(__file__).resolve().parents[1]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "inferbook.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_on_cpu_machine_is_one_clear_line():
    p = run("run", "upgrade-record", "-p", "device", "cuda")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "device 'cuda'" in lines[0] and "no usable CUDA GPU" in lines[0]


@pytest.mark.parametrize("args,needle", [
    (["run", "nope"], "unknown chapter 'nope'"),
    (["measure", "upgrade-record", "--preset", "huge"], "unknown preset 'huge'"),
    (["run", "upgrade-record", "-p", "batch", "many"], "parameter 'batch' must be int, got 'many'"),
    (["run", "upgrade-record", "-p", "nothing", "1"], "unknown parameter 'nothing'"),
    (["run", "upgrade-record", "--device", "tpu"], "unknown device 'tpu'"),
    (["results", "--compare", "missing.json", "other.json"], "no results file"),
])
def test_user_errors(args, needle, capsys):
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_results_compare_and_refusal(tmp_path, capsys):
    def r(name, quant):
        x = rec.RunRecord(chapter="upgrade-record", name=name, variant=name,
                          hardware={"device_type": "cpu", "cpu_model": "T", "cpu_cores": 2},
                          workload={"quantization": quant})
        x.add("total", 2.0 if name == "b" else 1.0, "s", phase="total")
        return x

    rec.save_records(tmp_path / "r.json", [r("a", "none"), r("b", "none"), r("c", "int8")])
    assert cli.main(["results", "--compare", f"{tmp_path}/r.json#a", f"{tmp_path}/r.json#b"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "2.0" in out
    assert cli.main(["results", "--compare", f"{tmp_path}/r.json#a", f"{tmp_path}/r.json#c"]) == 2
    assert "quantization differs" in capsys.readouterr().err
    assert cli.main(["results", "--compare", f"{tmp_path}/r.json", f"{tmp_path}/r.json#c"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_list_shows_every_chapter(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    from inferbook.toc import CHAPTERS

    assert all(slug in out for slug in CHAPTERS)


def test_measure_without_jupyter_saves_reference_with_every_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("INFERBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    monkeypatch.delenv("INFERBOOK_SAVE_REFERENCE", raising=False)
    code = cli.main(["measure", "upgrade-record", "--preset", "smoke", "--device", "cpu", "-p", "compile", "false",
                     "--save-reference"])
    assert code == 0, capsys.readouterr().err
    refs = list((tmp_path / "ref").glob("*/upgrade-record.json"))
    assert len(refs) == 1
    records = rec.load_records(refs[0])
    assert {r.name for r in records} == {"eager", "int8", "math-attention", "serving-open-loop"}
    for r in records:
        assert r.git["commit"] and "dirty" in r.git
        assert r.packages["torch"] and "triton" in r.packages
        assert r.hardware["cpu_model"] and r.hardware["cpu_cores"]
        assert r.parameters["compile"] is False and r.parameters["seed"] == 0 and r.preset == "smoke"
        assert {"model", "model_revision", "quantization", "input_len", "output_len"} <= set(r.workload)
        if r.name == "serving-open-loop":   # the load test: vLLM bench-JSON names, the arrival process kept
            assert {"request_rate", "burstiness", "max_concurrency"} <= set(r.workload)
            assert r.value("p99_ttft_ms") >= r.value("p50_ttft_ms") > 0 and r.value("mean_itl_ms") > 0
            continue
        assert r.backends["attention"]["backend"] and r.backends["attention"]["shapes"]["q"]
        phases = {m["phase"] for m in r.measurements}
        assert {"load", "cold_start", "ttft", "decode", "total"} <= phases
        assert all(m["unit"] for m in r.measurements)
