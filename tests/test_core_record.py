import json
import os

import pytest

from inferbook import record as rec
from inferbook.errors import IncomparableRecords, UserError

HW = {"device_type": "cpu", "cpu_model": "Test CPU", "cpu_cores": 2}


def make(name="a", variant="eager", **over):
    r = rec.RunRecord(chapter="upgrade-record", name=name, variant=variant, hardware=dict(HW),
                      git={"commit": "abc", "dirty": False}, packages={"torch": "2.13"},
                      workload={"model": "tiny", "quantization": "none", "input_len": 16, "output_len": 8, "batch": 2})
    r.set_backend("attention", "sdpa", shapes={"q": (2, 4, 16, 16)})
    r.add("ttft", 0.01, "s", phase="ttft")
    r.add("throughput", 100.0, "output tok/s", phase="total")
    for k, v in over.items():
        setattr(r, k, v)
    return r


def test_roundtrip(tmp_path):
    r = make()
    r.add_check("tokens equal", True, error=0.0, tolerance=0.0)
    path = rec.save_records(tmp_path / "x.json", [r, make("b")])
    back = rec.load_records(path)
    assert [b.to_dict() for b in back] == [r.to_dict(), make("b").to_dict()]
    assert back[0].backends["attention"]["shapes"]["q"] == [2, 4, 16, 16]


def test_nan_measurement_rejected():
    with pytest.raises(ValueError, match="NaN"):
        make().add("x", float("nan"), "s")


def test_compare_comparable_pair_gives_ratio_and_context():
    a, b = make("a", "eager"), make("b", "compiled")
    b.measurements[0]["value"] = 0.005
    b.git = {"commit": "def", "dirty": True}
    c = rec.compare(a, b)
    ttft = [row for row in c.rows if row["metric"] == "ttft"][0]
    assert ttft["b/a"] == pytest.approx(0.5)
    assert any("variant" in x for x in c.context) and any("git" in x for x in c.context)


@pytest.mark.parametrize("change,why", [
    (lambda r: r.hardware.update(cpu_model="Other CPU"), "hardware differs"),
    (lambda r: r.hardware.update(device_type="cuda", gpu_name="NVIDIA H200"), "hardware differs"),
    (lambda r: r.workload.update(quantization="int8"), "quantization differs: 'none' vs 'int8'"),
    (lambda r: r.workload.update(input_len=32), "workload 'input_len' differs"),
    (lambda r: r.set_backend("attention", "math", shapes={"q": (2, 4, 16, 16)}), "backend for 'attention' differs"),
    (lambda r: r.set_backend("attention", "sdpa", shapes={"q": (1, 4, 16, 16)}), "local shapes for 'attention' differ"),
    (lambda r: r.set_backend("moe", "triton"), "backend for 'moe' recorded on one side only"),
    (lambda r: setattr(r, "topology", {"tp": 2}), "topology differs: tp None vs 2"),
    (lambda r: r.measurements[1].update(unit="total tok/s"), "unit of 'throughput' differs"),
])
def test_compare_refuses_with_reason(change, why):
    a, b = make("a"), make("b")
    change(b)
    with pytest.raises(IncomparableRecords) as e:
        rec.compare(a, b)
    assert any(why in r for r in e.value.reasons), e.value.reasons


def test_atomic_write_survives_crash(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    rec.save_records(path, [make("old")])
    before = path.read_bytes()

    real_dump = json.dump

    def crash_midway(obj, f, **kw):
        f.write('{"inferbook_results": 1, "records": [')  # a torn write...
        raise KeyboardInterrupt("killed")                  # ...then the process is killed

    monkeypatch.setattr(rec.json, "dump", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        rec.save_records(path, [make("new")])
    monkeypatch.setattr(rec.json, "dump", real_dump)
    assert path.read_bytes() == before
    assert rec.load_records(path)[0].name == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "temporary file left behind"


def test_atomic_write_failed_replace_keeps_old(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    rec.save_records(path, [make("old")])

    def fail(*a):
        raise OSError("disk gone")

    monkeypatch.setattr(rec.os, "replace", fail)
    with pytest.raises(OSError):
        rec.save_records(path, [make("new")])
    assert rec.load_records(path)[0].name == "old"
    assert len(os.listdir(tmp_path)) == 1


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    ('{"schema": 99, "chapter": "x", "name": "y"}', "schema 99 is not supported"),
    ('{"schema": 1}', "lacks required field"),
    ("[1, 2]", "neither a record nor a list"),
])
def test_load_bad_files(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(UserError, match=match):
        rec.load_records(p)


def test_load_missing_file(tmp_path):
    with pytest.raises(UserError, match="no results file"):
        rec.load_records(tmp_path / "none.json")
