"""Executor semantics: order, cache, side effects, validation errors, JSON parsing, the CLI."""
import json
import random

import pytest

from inferbook.workflow import Executor, WorkflowError, parse_workflow
from inferbook.workflow.executor import Input, as_graph, node


def chain(values):
    """Int a0 -> AddInt a1 -> AddInt a2 ...: a sum in a chain of nodes."""
    wf = {"n0": {"class_type": "Int", "inputs": {"value": values[0]}}}
    for i, v in enumerate(values[1:], 1):
        wf[f"n{i}"] = {"class_type": "AddInt", "inputs": {"a": [f"n{i - 1}", 0], "b": v}}
    return wf


def test_chain_sums_in_topological_order():
    rng = random.Random()
    values = [rng.randint(-1000, 1000) for _ in range(rng.randint(2, 12))]
    wf = chain(values)
    items = list(wf.items())
    rng.shuffle(items)                       # file order must not matter for correctness
    r = Executor().run(dict(items))
    assert r.output(f"n{len(values) - 1}") == sum(values)
    pos = {x.id: i for i, x in enumerate(r.log)}
    for i in range(1, len(values)):
        assert pos[f"n{i - 1}"] < pos[f"n{i}"]


def test_ties_follow_file_order():
    wf = {k: {"class_type": "Int", "inputs": {"value": i}} for i, k in enumerate(["z", "a", "m"])}
    assert [x.id for x in Executor().run(wf).log] == ["z", "a", "m"]


def test_cache_reuses_unchanged_subgraph_and_reruns_changed_descendants():
    values = [random.randint(0, 50) for _ in range(6)]
    ex = Executor()
    first = ex.run(chain(values))
    assert first.cached == [] and len(first.ran) == 6
    again = ex.run(chain(values))
    assert again.ran == [] and len(again.cached) == 6
    changed = list(values)
    changed[3] += 1
    third = ex.run(chain(changed))
    assert third.cached == ["n0", "n1", "n2"] and third.ran == ["n3", "n4", "n5"]
    assert third.output("n5") == sum(changed)


def test_signature_ignores_node_ids_but_not_ancestors():
    a = as_graph({"x": {"class_type": "Int", "inputs": {"value": 1}}, "y": {"class_type": "AddInt", "inputs": {"a": ["x", 0], "b": 2}}})
    b = as_graph({"p": {"class_type": "Int", "inputs": {"value": 1}}, "q": {"class_type": "AddInt", "inputs": {"a": ["p", 0], "b": 2}}})
    ra, rb = Executor().run(a), Executor().run(b)
    assert ra.signatures["y"] == rb.signatures["q"]
    c = as_graph({"p": {"class_type": "Int", "inputs": {"value": 5}}, "q": {"class_type": "AddInt", "inputs": {"a": ["p", 0], "b": 2}}})
    assert Executor().run(c).signatures["q"] != ra.signatures["y"]


def test_output_nodes_are_cached_as_in_comfyui(tmp_path):
    """ComfyUI's executor caches output nodes too: an unchanged Preview is not run again, and what it
    showed is re-emitted from the cache; a changed input runs it again."""
    wf = {"v": {"class_type": "Int", "inputs": {"value": 3}},
          "show": {"class_type": "Preview", "inputs": {"value": ["v", 0], "label": "x"}},
          "after": {"class_type": "AddInt", "inputs": {"a": ["show", 0], "b": 1}}}
    ex = Executor(output_dir=tmp_path)
    first = ex.run(wf)
    assert first.side_effects == ["show"] and [e["summary"] for e in first.events] == [3]
    for _ in range(2):
        r = ex.run(wf)
        assert r.side_effects == [] and r.cached == ["v", "show", "after"]
        assert [(e["summary"], e["cached"]) for e in r.events] == [(3, True)]
    wf["v"]["inputs"]["value"] = 4
    r = ex.run(wf)
    assert r.side_effects == ["show"] and [e["summary"] for e in r.events] == [4]


def test_cache_off_runs_everything():
    ex = Executor(cache=False)
    ex.run(chain([1, 2, 3]))
    assert ex.run(chain([1, 2, 3])).cached == []


BASE = {"a": {"class_type": "Int", "inputs": {"value": 2}}}


@pytest.mark.parametrize("patch, node_id, input_name, fragment", [
    ({"b": {"class_type": "NoSuchNode", "inputs": {}}}, "b", None, "unknown class_type"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": 1}}}, "b", "b", "missing"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": 1, "b": 2, "c": 3}}}, "b", "c", "not an input"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": 1, "b": "two"}}}, "b", "b", "expects INT"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": 1, "b": True}}}, "b", "b", "expects INT"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": ["nope", 0], "b": 1}}}, "b", "a", "does not exist"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": ["a", 3], "b": 1}}}, "b", "a", "has 1 output"),
    ({"b": {"class_type": "LastFrames", "inputs": {"images": ["a", 0]}}}, "b", "images", "expects IMAGE but output 0"),
    ({"b": {"class_type": "LastFrames", "inputs": {"images": 5}}}, "b", "images", "must come from a link"),
    ({"b": {"class_type": "AddInt", "inputs": {"a": 1, "b": 1}, "extra": 1}}, "b", None, "unknown key"),
    ({"b#1": {"class_type": "Int", "inputs": {"value": 1}}}, "b#1", None, "reserved"),
    ({"b": {"class_type": "_LoopHead", "inputs": {"index": 0}}}, "b", None, "unknown class_type"),
    ({"b": {"class_type": "AddAudio", "inputs": {}}}, "b", None, "known classes are"),
])
def test_validation_errors_name_node_and_input(patch, node_id, input_name, fragment):
    ex = Executor()
    with pytest.raises(WorkflowError) as e:
        ex.run({**BASE, **patch})
    assert e.value.node == node_id and e.value.input == input_name
    assert fragment in str(e.value) and repr(node_id) in str(e.value)


def test_cycle_is_reported_with_its_nodes():
    wf = {"a": {"class_type": "AddInt", "inputs": {"a": ["c", 0], "b": 1}},
          "b": {"class_type": "AddInt", "inputs": {"a": ["a", 0], "b": 1}},
          "c": {"class_type": "AddInt", "inputs": {"a": ["b", 0], "b": 1}},
          "d": {"class_type": "Int", "inputs": {"value": 1}}}
    with pytest.raises(WorkflowError, match=r"cycle: a -> c -> b -> a|cycle: a -> b -> c -> a"):
        Executor().run(wf)


def test_validation_happens_before_any_node_runs(tmp_path):
    wf = {"v": {"class_type": "Int", "inputs": {"value": 3}},
          "show": {"class_type": "Preview", "inputs": {"value": ["v", 0]}},
          "bad": {"class_type": "AddInt", "inputs": {"a": ["show", 0], "b": "x"}}}
    ex = Executor(output_dir=tmp_path)
    with pytest.raises(WorkflowError):
        ex.run(wf)
    assert ex.cache == {}


def test_runtime_type_of_any_link_is_checked():
    wf = {"l": {"class_type": "MakeList", "inputs": {"a": "text"}},
          "g": {"class_type": "ListGet", "inputs": {"list": ["l", 0], "index": 0}},
          "s": {"class_type": "AddInt", "inputs": {"a": ["g", 0], "b": 1}}}
    with pytest.raises(WorkflowError, match=r"node 's' \(AddInt\) input 'a' expects INT but node 'g' output 0 produced 'text'"):
        Executor().run(wf)


def test_node_failure_names_the_node():
    wf = {"l": {"class_type": "MakeList", "inputs": {"a": 1}},
          "g": {"class_type": "ListGet", "inputs": {"list": ["l", 0], "index": 5}}}
    with pytest.raises(WorkflowError, match=r"node 'g' \(ListGet\) failed: index 5 is out of range"):
        Executor().run(wf)


@pytest.mark.parametrize("text, line, col", [
    ('{"a": {"class_type": "Int", "inputs": {"value": 1,}}}', 1, 51),
    ('{\n "a": {\n  "class_type": "Int"\n  "inputs": {}}}', 4, 3),
    ('{"a": ', 1, 7),
])
def test_malformed_json_reports_line_and_column(text, line, col):
    with pytest.raises(WorkflowError, match=rf"line {line}, column {col}"):
        parse_workflow(text)


def test_workflow_text_is_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    wf = {"a": {"class_type": "String", "inputs": {"value": f"__import__('os').mkdir({str(marker)!r})"}},
          "b": {"class_type": "FormatText", "inputs": {"template": "{}", "value": ["a", 0]}}}
    r = Executor().run(json.dumps(wf))
    assert not marker.exists() and r.output("b").startswith("__import__")
    with pytest.raises(WorkflowError, match="unknown class_type"):
        Executor().run({"a": {"class_type": "__import__('os').system('true')", "inputs": {}}})


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2]", "must be a JSON object"), ("{}", "has no nodes"),
    ('{"nodes": [], "links": []}', "UI format"), ('{"a": 3}', "must be an object"),
    ('{"a": {"inputs": {}}}', "class_type"),
])
def test_bad_workflow_shapes(text, fragment):
    with pytest.raises(WorkflowError, match=fragment):
        parse_workflow(text)


def test_custom_registry_and_node_decorator():
    reg = {}

    @node("Twice", inputs={"x": Input("FLOAT", min=0)}, outputs=(("y", "FLOAT"),), registry=reg)
    def twice(x):
        return (2 * x,)

    r = Executor(registry=reg).run({"t": {"class_type": "Twice", "inputs": {"x": 1.5}}})
    assert r.output("t") == 3.0
    with pytest.raises(WorkflowError, match=">= 0"):
        Executor(registry=reg).run({"t": {"class_type": "Twice", "inputs": {"x": -1}}})


def test_cli_runs_a_file_and_reports_bad_ones_without_traceback(tmp_path, capsys):
    from inferbook.workflow.cli import main

    good = tmp_path / "good.json"
    good.write_text(json.dumps(chain([1, 2, 3])))
    assert main(["run", str(good), "--device", "cpu", "--output-dir", str(tmp_path / "out")]) == 0
    assert "ok, 3 node(s) ran" in capsys.readouterr().out
    assert main(["validate", str(good)]) == 0
    bad_cases = {"malformed.json": '{"a": 1,,}', "cycle.json": json.dumps(
        {"a": {"class_type": "AddInt", "inputs": {"a": ["a", 0], "b": 1}}}),
        "type.json": json.dumps({"a": {"class_type": "Int", "inputs": {"value": "x"}}})}
    for name, text in bad_cases.items():
        (tmp_path / name).write_text(text)
        assert main(["run", str(tmp_path / name), "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("inferbook: error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["run", str(tmp_path / "missing.json")]) == 2


def test_nan_and_infinity_are_not_json():
    with pytest.raises(WorkflowError, match="NaN, which is not a JSON value"):
        parse_workflow('{"a": {"class_type": "Float", "inputs": {"value": NaN}}}')
    with pytest.raises(WorkflowError, match="Infinity"):
        parse_workflow('{"a": {"class_type": "Float", "inputs": {"value": -Infinity}}}')


def test_shipped_workflow_files_validate():
    from pathlib import Path

    from inferbook.workflow.cli import main

    files = sorted((Path(__file__).resolve().parents[1] / "data" / "workflows").glob("*.json"))
    assert len(files) >= 4
    for f in files:
        assert main(["validate", str(f)]) == 0, f
