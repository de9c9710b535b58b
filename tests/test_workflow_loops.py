"""Generic loops: the three modes, nesting, projection ids, cache_iterations, side effects, errors."""
import random

import pytest

from inferbook.workflow import Executor, WorkflowError


def sum_loop(settings, initial=0, cache_iterations=True, preview=True):
    """carried += item, with a preview on the end boundary."""
    wf = {"s": {"class_type": "StartLoop", "inputs": {**settings, "initial": initial, "cache_iterations": cache_iterations}},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", 1], "b": ["s", 3]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": ["add", 0]}}}
    if preview:
        wf["show"] = {"class_type": "Preview", "inputs": {"value": ["add", 0], "label": "it"}}
        wf["e"]["inputs"]["value"] = ["show", 0]
    return wf


def python_items(settings):
    mode = settings.get("mode", "count")
    if mode == "count":
        return list(range(settings["count"]))
    if mode == "range":
        return list(range(settings.get("start", 0), settings["stop"], settings.get("step", 1)))
    return list(settings["items"])


def random_settings(rng):
    mode = rng.choice(["count", "range", "list"])
    if mode == "count":
        return {"mode": "count", "count": rng.randint(0, 6)}
    if mode == "range":
        return {"mode": "range", "start": rng.randint(-6, 6), "stop": rng.randint(-6, 6), "step": rng.choice([-2, -1, 1, 3])}
    return {"mode": "list", "items": [rng.randint(-20, 20) for _ in range(rng.randint(0, 5))]}


@pytest.mark.parametrize("trial", range(8))
def test_modes_match_python(trial, tmp_path):
    rng = random.Random()
    settings, x0 = random_settings(rng), rng.randint(-100, 100)
    items = python_items(settings)
    r = Executor(output_dir=tmp_path).run(sum_loop(settings, x0))
    running, acc = [], x0
    for it in items:
        acc += it
        running.append(acc)
    assert r.output("e", 0) == acc and r.output("e", 1) == running
    assert [e["summary"] for e in r.events] == running        # side effect once per iteration, in order
    assert [e["node"] for e in r.events] == [f"show#{i}" for i in range(len(items))]


def test_count_default_mode_and_index_output():
    wf = {"s": {"class_type": "StartLoop", "inputs": {"count": 4, "initial": 0}},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", 1], "b": ["s", 2]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": ["add", 0]}}}
    assert Executor().run(wf).output("e", 1) == [0, 1, 3, 6]


def test_projected_ids_are_deterministic():
    r1 = Executor().run(sum_loop({"count": 3}))
    r2 = Executor().run(sum_loop({"count": 3}))
    ids = [x.id for x in r1.log]
    assert ids == [x.id for x in r2.log]
    assert ids == ["s#0", "add#0", "show#0", "e#0", "s#1", "add#1", "show#1", "e#1", "s#2", "add#2", "show#2", "e#2", "e"]
    assert r1.loops[0]["iterations"] == 3


def test_empty_list_passes_initial_value_through(tmp_path):
    r = Executor(output_dir=tmp_path).run(sum_loop({"mode": "list", "items": []}, initial=41))
    assert r.output("e", 0) == 41 and r.output("e", 1) == [] and r.events == []


def test_mixed_list_is_carried():
    wf = {"s": {"class_type": "StartLoop", "inputs": {"mode": "list", "items": ["a", "b"], "initial": [0, "x"]}},
          "n": {"class_type": "ListGet", "inputs": {"list": ["s", 1], "index": 0}},
          "t": {"class_type": "ListGet", "inputs": {"list": ["s", 1], "index": 1}},
          "n1": {"class_type": "AddInt", "inputs": {"a": ["n", 0], "b": 1}},
          "t1": {"class_type": "FormatText", "inputs": {"template": "{}+", "value": ["t", 0]}},
          "m": {"class_type": "MakeList", "inputs": {"a": ["n1", 0], "b": ["t1", 0], "c": ["s", 3]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": ["m", 0]}}}
    assert Executor().run(wf).output("e") == [2, "x++", "b"]


def test_linked_items_and_count():
    wf = {"l": {"class_type": "MakeList", "inputs": {"a": 3, "b": 4}},
          "c": {"class_type": "ListLength", "inputs": {"list": ["l", 0]}},
          "s": {"class_type": "StartLoop", "inputs": {"mode": "list", "items": ["l", 0], "initial": 0}},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", 1], "b": ["s", 3]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": ["add", 0]}},
          "s2": {"class_type": "StartLoop", "inputs": {"count": ["c", 0], "initial": ["e", 0]}},
          "add2": {"class_type": "AddInt", "inputs": {"a": ["s2", 1], "b": 10}},
          "e2": {"class_type": "EndLoop", "inputs": {"loop": ["s2", 0], "value": ["add2", 0]}}}
    assert Executor().run(wf).output("e2") == 27


def nested(outer, inner, x0):
    return {"x0": {"class_type": "Int", "inputs": {"value": x0}},
            "o": {"class_type": "StartLoop", "inputs": {**outer, "initial": ["x0", 0]}},
            "i": {"class_type": "StartLoop", "inputs": {**inner, "initial": ["o", 1]}},
            "m": {"class_type": "AddInt", "inputs": {"a": ["i", 3], "b": ["o", 3]}},
            "acc": {"class_type": "AddInt", "inputs": {"a": ["i", 1], "b": ["m", 0]}},
            "ie": {"class_type": "EndLoop", "inputs": {"loop": ["i", 0], "value": ["acc", 0]}},
            "oe": {"class_type": "EndLoop", "inputs": {"loop": ["o", 0], "value": ["ie", 0]}}}


@pytest.mark.parametrize("trial", range(6))
def test_nested_loops_match_python(trial):
    rng = random.Random()
    outer, inner, x0 = random_settings(rng), random_settings(rng), rng.randint(-50, 50)
    expected = x0
    for o in python_items(outer):
        for i in python_items(inner):
            expected += i + o
    assert Executor().run(nested(outer, inner, x0)).output("oe") == expected


def test_nested_ids_and_inner_loop_independent_of_outer_start():
    # the inner StartLoop reads nothing from the outer loop; its body does, so it belongs to the outer body
    wf = {"o": {"class_type": "StartLoop", "inputs": {"count": 2, "initial": 0}},
          "i": {"class_type": "StartLoop", "inputs": {"count": 2, "initial": 100}},
          "a": {"class_type": "AddInt", "inputs": {"a": ["i", 1], "b": ["o", 2]}},
          "ie": {"class_type": "EndLoop", "inputs": {"loop": ["i", 0], "value": ["a", 0]}},
          "s": {"class_type": "AddInt", "inputs": {"a": ["o", 1], "b": ["ie", 0]}},
          "oe": {"class_type": "EndLoop", "inputs": {"loop": ["o", 0], "value": ["s", 0]}}}
    r = Executor().run(wf)
    assert r.output("oe") == (100 + 0 + 0) + (100 + 1 + 1)
    assert "a#1#0" in [x.id for x in r.log]


def test_cache_iterations_on_reuses_iterations_and_extends(tmp_path):
    ex = Executor(output_dir=tmp_path)
    ex.run(sum_loop({"count": 4}))
    again = ex.run(sum_loop({"count": 4}))
    assert again.ran == again.side_effects == [f"show#{i}" for i in range(4)]
    more = ex.run(sum_loop({"count": 5}))
    non_side = [i for i in more.ran if i not in more.side_effects]
    assert non_side == ["s#4", "add#4", "e#4", "e"]
    assert more.side_effects == [f"show#{i}" for i in range(5)]


def test_cache_iterations_off_reruns_bodies_only(tmp_path):
    wf = sum_loop({"count": 3}, initial=0, cache_iterations=False)
    wf["x"] = {"class_type": "Int", "inputs": {"value": 7}}
    wf["s"]["inputs"]["initial"] = ["x", 0]
    ex = Executor(output_dir=tmp_path)
    ex.run(wf)
    again = ex.run(wf)
    assert "x" in again.cached and "e" in again.cached
    assert {"s#0", "add#0", "e#0", "add#2"} <= set(again.ran)
    assert again.output("e") == 7 + 0 + 1 + 2


@pytest.mark.parametrize("wf, fragment", [
    ({"s": {"class_type": "StartLoop", "inputs": {"count": 2}}}, "has no EndLoop"),
    ({"x": {"class_type": "Int", "inputs": {"value": 1}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["x", 0], "value": 1}}}, "expects LOOP"),
    ({"s": {"class_type": "StartLoop", "inputs": {"count": 2}},
      "e1": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}},
      "e2": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 2}}}, "closed by 2 EndLoops"),
    ({"a": {"class_type": "StartLoop", "inputs": {"count": 2, "initial": 0}},
      "b": {"class_type": "StartLoop", "inputs": {"count": 2, "initial": ["a", 1]}},
      "ea": {"class_type": "EndLoop", "inputs": {"loop": ["a", 0], "value": ["b", 1]}},
      "eb": {"class_type": "EndLoop", "inputs": {"loop": ["b", 0], "value": ["ea", 0]}}}, "loops cross"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "range", "stop": 5, "step": 0}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "'step' must not be 0"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "range", "step": 1}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "'stop' is required"),
    ({"s": {"class_type": "StartLoop", "inputs": {"count": 2.5}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "'count' expects INT"),
    ({"s": {"class_type": "StartLoop", "inputs": {"count": -1}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "must be >= 0"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "list", "items": "abc"}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "'items' expects LIST"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "list"}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "'items' is required"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "while", "count": 1}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "must be one of"),
    ({"s": {"class_type": "StartLoop", "inputs": {"count": 20, "max_iterations": 10}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "more than the limit of 10"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "range", "stop": 10**12}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}, "more than the limit of 1000"),
])
def test_loop_errors(wf, fragment, tmp_path):
    with pytest.raises(WorkflowError, match=fragment):
        Executor(output_dir=tmp_path).run(wf)


def test_linked_values_are_checked_when_the_loop_expands():
    wf = {"t": {"class_type": "String", "inputs": {"value": "abc"}},
          "s": {"class_type": "StartLoop", "inputs": {"mode": "list", "items": ["t", 0]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}
    with pytest.raises(WorkflowError, match="expects LIST"):
        Executor().run(wf)
    wf2 = {"l": {"class_type": "MakeList", "inputs": {"a": 1.5}},
           "c": {"class_type": "ListGet", "inputs": {"list": ["l", 0], "index": 0}},
           "s": {"class_type": "StartLoop", "inputs": {"count": ["c", 0]}},
           "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 0], "value": 1}}}
    with pytest.raises(WorkflowError, match="'count' expects INT"):
        Executor().run(wf2)


def test_node_reading_the_body_from_outside_is_refused(tmp_path):
    wf = sum_loop({"count": 2}, preview=False)
    wf["save"] = {"class_type": "Preview", "inputs": {"value": ["add", 0]}}
    with pytest.raises(WorkflowError, match=r"node 'save' \(Preview\) input 'value' reads node 'add' inside loop"):
        Executor(output_dir=tmp_path).run(wf)
    wf = sum_loop({"count": 2}, preview=False)
    wf["late"] = {"class_type": "AddInt", "inputs": {"a": ["e", 0], "b": ["s", 2]}}
    with pytest.raises(WorkflowError, match="does not lead to EndLoop"):
        Executor().run(wf)
