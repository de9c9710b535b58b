"""Record files under abuse: every malformed record is one UserError line (through the CLI: exit 2,
one line), never a traceback; results files are 0644; `results` works with the build dir outside
the checkout; an empty hardware slug never writes into data/results/ itself; model revisions hash
tensors, not files; compare keeps two same-named sides apart and refuses what changes results."""
import json
import os
import stat

import pytest
import torch

from inferbook import cli, device as dev, record as rec
from inferbook.errors import IncomparableRecords, UserError

HW = {"device_type": "cpu", "cpu_model": "Test CPU", "cpu_cores": 2}


def good() -> dict:
    r = rec.RunRecord(chapter="upgrade-record", name="a", variant="eager", hardware=dict(HW))
    r.add("ttft", 0.01, "s", phase="ttft")
    r.add_check("ok", True)
    return r.to_dict()


def with_(**over):
    d = good()
    for k, v in over.items():
        if v is KeyError:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps({"records": [d]}).encode()


def meas(**over):
    d = good()
    d["measurements"][0].update(over)
    return json.dumps(d).encode()


MALFORMED = {
    "empty file": b"",
    "not json": b"{nope",
    "truncated": json.dumps({"records": [good()]}).encode()[:50],
    "not utf-8": b"\xff\xfe{\x00",
    "latin-1 text": '{"chapter": "caf\u00e9"}'.encode("latin-1"),
    "a number": b"5",
    "a list": b"[1, 2]",
    "a string": b'"records"',
    "null": b"null",
    "records is 5": b'{"records": 5}',
    "records is an object": b'{"records": {"a": 1}}',
    "records holds a number": b'{"records": [5]}',
    "records holds null": b'{"records": [null]}',
    "no schema": with_(schema=KeyError),
    "schema 2": with_(schema=2),
    "schema true": with_(schema=True),
    "schema as text": with_(schema="1"),
    "no chapter": with_(chapter=KeyError),
    "chapter is a number": with_(chapter=5),
    "empty name": with_(name=""),
    "name is null": with_(name=None),
    "hardware is {}": with_(hardware={}),
    "hardware is a list": with_(hardware=[]),
    "hardware is text": with_(hardware="H200"),
    "hardware without cpu_model": with_(hardware={"device_type": "cpu"}),
    "cuda hardware without gpu_name": with_(hardware={"device_type": "cuda"}),
    "device_type tpu": with_(hardware={"device_type": "tpu", "cpu_model": "x"}),
    "workload is a list": with_(workload=[1]),
    "git is text": with_(git="abc"),
    "backends entry is text": with_(backends={"attention": "sdpa"}),
    "measurements is an object": with_(measurements={"ttft": 1}),
    "measurement is a number": with_(measurements=[3]),
    "measurement value is text": meas(value="fast"),
    "measurement value is null": meas(value=None),
    "measurement value is NaN": meas(value=float("nan")),
    "measurement value is bool": meas(value=True),
    "measurement without unit": meas(unit=None),
    "measurement phase is a number": meas(phase=1),
    "samples are text": meas(samples_s="1,2"),
    "checks holds text": with_(checks=["ok"]),
    "check passed is text": with_(checks=[{"name": "x", "passed": "yes"}]),
    "deeply nested": b"[" * 100000 + b"]" * 100000,
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_record_is_one_clear_line(tmp_path, content, capsys):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        rec.load_records(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and len(msg) < 300, msg
    assert cli.main(["results", "--compare", f"{path}#a", f"{path}#a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("inferbook: error: "), err


def test_folder_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        rec.load_records(tmp_path)
    with pytest.raises(UserError, match="no results file"):
        rec.load_records(tmp_path / "none.json")


def test_listing_skips_a_bad_file_and_works_outside_the_checkout(tmp_path, monkeypatch, capsys):
    build = tmp_path / "elsewhere" / "build"
    monkeypatch.setenv("INFERBOOK_BUILD_DIR", str(build))
    monkeypatch.delenv("INFERBOOK_RESULTS", raising=False)
    monkeypatch.setenv("INFERBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    (build / "results").mkdir(parents=True)
    (build / "results" / "upgrade-record.json").write_bytes(with_())
    (build / "results" / "broken.json").write_bytes(b'{"records": 5}')
    rec.save_records(build / "results" / "te-mxfp8-recipes.json", [rec.RunRecord.from_dict(good())], complete=False)
    assert cli.main(["results"]) == 0
    out, err = capsys.readouterr()
    assert str(build / "results" / "upgrade-record.json") in out and "eager" in out
    assert {("te-mxfp8" in line, "(partial: a run that was stopped" in line) for line in out.splitlines()} == \
        {(True, True), (False, False)}
    assert err.count("\n") == 1 and "broken.json" in err and "'records' must be a list" in err


def test_result_files_are_0644(tmp_path):
    path = rec.save_records(tmp_path / "r.json", [rec.RunRecord.from_dict(good())])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


@pytest.mark.parametrize("name", ["", "(TM)", "®", "  ", "@ 2GHz", None])
def test_empty_gpu_slug_never_names_the_reference_folder_itself(name, tmp_path, monkeypatch):
    info = {"device_type": "cuda", "gpu_name": name, "gpu_capability": "9.0"}
    slug = dev.hardware_slug(info)
    assert slug == "gpu-unnamed-sm90"
    assert dev.hardware_slug({"device_type": "cpu", "cpu_model": "(R)", "cpu_cores": 2}) == "cpu-unknown-2c"
    assert dev.hardware_label(info) == ((name or "").strip() or "unnamed CUDA GPU")


def test_context_saves_under_a_non_empty_slug(tmp_path, monkeypatch):
    import inferbook

    monkeypatch.setenv("INFERBOOK_RESULTS", str(tmp_path / "res"))
    monkeypatch.setenv("INFERBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    monkeypatch.setenv("INFERBOOK_SAVE_REFERENCE", "1")
    ctx = inferbook.setup("upgrade-record", device="cpu", preset="smoke")
    ctx.hardware = {"device_type": "cuda", "gpu_name": "(TM)"}
    r = ctx.new_record("x")
    r.hardware = {"device_type": "cuda", "gpu_name": "(TM)"}
    ctx.save([r])
    assert not list((tmp_path / "ref").glob("*.json")), "a record landed in the reference folder itself"
    assert (tmp_path / "ref" / "gpu-unnamed" / "upgrade-record.json").is_file()


def test_model_revision_hashes_tensors_not_the_file(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(3, generator=g).bfloat16()}
    save_file(state, str(tmp_path / "one.safetensors"), metadata={"x": "1", "y": "2"})
    save_file(dict(reversed(list(state.items()))), str(tmp_path / "two.safetensors"), metadata={"y": "2", "x": "1", "z": "3"})
    assert (tmp_path / "one.safetensors").read_bytes() != (tmp_path / "two.safetensors").read_bytes()
    r1, r2 = (rec.safetensors_revision(tmp_path / f) for f in ("one.safetensors", "two.safetensors"))
    assert r1 == r2 == rec.tensors_revision(state)
    # any change to a name, dtype, shape or byte changes it
    assert rec.tensors_revision({**state, "a.bias": state["a.bias"].float()}) != r1
    assert rec.tensors_revision({"b.weight": state["b.weight"].reshape(3, 4), "a.bias": state["a.bias"]}) != r1
    assert rec.tensors_revision({"c.weight": state["b.weight"], "a.bias": state["a.bias"]}) != r1
    bumped = state["b.weight"].clone()
    bumped[0, 0] = torch.nextafter(bumped[0, 0], torch.tensor(9.0))
    assert rec.tensors_revision({**state, "b.weight": bumped}) != r1


def test_serving_weights_revision_is_stable_across_saves(tmp_path):
    from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights, save_weights

    cfg = TinyConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn=64, max_seq=32)
    a = save_weights(init_weights(TinyDecoder(cfg), 0), tmp_path / "a.safetensors")
    b = save_weights(init_weights(TinyDecoder(cfg), 0), tmp_path / "b.safetensors")
    c = save_weights(init_weights(TinyDecoder(cfg), 1), tmp_path / "c.safetensors")
    assert a == b != c and a == rec.safetensors_revision(tmp_path / "a.safetensors")


def _pair():
    a, b = rec.RunRecord.from_dict(good()), rec.RunRecord.from_dict(good())
    b.name = "b"
    b.measurements[0]["value"] = 0.02
    return a, b


def test_compare_keeps_two_sides_sharing_a_variant_apart():
    a, b = _pair()
    assert a.variant == b.variant
    row = rec.compare(a, b).rows[0]
    values = [v for k, v in row.items() if k.startswith(("a: ", "b: "))]
    assert values == [0.01, 0.02] and row["b/a"] == pytest.approx(2.0)
    a.name = b.name  # same variant and same name: still two columns
    row = rec.compare(a, b).rows[0]
    assert len([k for k in row if k.startswith(("a: ", "b: "))]) == 2


@pytest.mark.parametrize("change,why", [
    (lambda r: r.hardware.update(device_type="cuda", gpu_name="H200", driver="570.1", cuda_runtime="12.8"), None),
    (lambda r: r.workload.update(prefix_caching=True), "workload 'prefix_caching' differs"),
    (lambda r: r.workload.update(cuda_graphs=True), "workload 'cuda_graphs' differs"),
    (lambda r: r.workload.update(determinism="batch-invariant"), "workload 'determinism' differs"),
    (lambda r: r.runtime.update(deterministic_algorithms=True), "runtime setting 'deterministic_algorithms'"),
    (lambda r: r.runtime.update(attention_backend="flash"), "runtime setting 'attention_backend'"),
])
def test_settings_that_change_results_are_comparability_fields(change, why):
    a, b = _pair()
    a.runtime, b.runtime = {"deterministic_algorithms": False, "attention_backend": "math"}, \
        {"deterministic_algorithms": False, "attention_backend": "math"}
    if why is None:  # driver and CUDA version on GPUs
        for r in (a, b):
            r.hardware.update(device_type="cuda", gpu_name="H200", driver="570.1", cuda_runtime="12.8")
        rec.compare(a, b)
        b.hardware["driver"] = "580.2"
        with pytest.raises(IncomparableRecords, match="driver differs: '570.1' vs '580.2'"):
            rec.compare(a, b)
        b.hardware["driver"], b.hardware["cuda_runtime"] = "570.1", "13.0"
        with pytest.raises(IncomparableRecords, match="CUDA version differs"):
            rec.compare(a, b)
        return
    change(b)
    with pytest.raises(IncomparableRecords, match=why):
        rec.compare(a, b)


def test_old_records_without_runtime_still_compare():
    a, b = _pair()
    a.runtime = {"deterministic_algorithms": True}
    b.runtime = {}
    rec.compare(a, b)


def test_phase_axes_and_old_records():
    r = rec.RunRecord(chapter="c", name="n", hardware=dict(HW))
    r.add("load", 1.0, "s", phase="load")
    r.add("first ttft", 0.5, "s", phase="ttft", lifecycle="cold_start")
    r.add("ttft", 0.1, "s", phase="ttft")
    r.add("decode", 0.2, "s", phase="decode")
    r.add("compile", 3.0, "s", phase="compile")
    assert [m["name"] for m in r.select(lifecycle="cold_start")] == ["first ttft", "compile"]
    assert [m["name"] for m in r.select(lifecycle="steady", request_phase="ttft")] == ["ttft"]
    assert [m["name"] for m in r.select(request_phase="ttft")] == ["first ttft", "ttft"]
    with pytest.raises(ValueError, match="lifecycle"):
        r.add("x", 1.0, "s", lifecycle="warm")
    old = r.to_dict()
    for m in old["measurements"]:  # as written before the axes existed
        m.pop("lifecycle"), m.pop("request_phase", None)
    back = rec.RunRecord.from_dict(old)
    assert [m["name"] for m in back.select(lifecycle="steady", request_phase="decode")] == ["decode"]
    assert [m["name"] for m in back.select(lifecycle="load")] == ["load"]
    # old and new records of the same run still line up in compare (first ttft is cold-start in one only)
    rows = rec.compare(back, r).rows
    assert {row["metric"] for row in rows} == {"load", "ttft", "decode", "compile"}
