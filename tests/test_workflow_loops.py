"""Generic loops as ComfyUI has them: the three modes, EndLoop's inputs, loop state, caching, nesting,
projection ids, errors and bounds."""
import json
import random

import pytest

from inferbook.workflow import Executor, WorkflowError
from inferbook.workflow import loops

IDX, FIRST, LAST, ITEM, VALUE, HANDLE = range(6)


def sum_loop(settings, initial=0, cache_iterations=None, preview=True, accumulate=True):
    """carried += item (or index), with a preview hanging on the EndLoop's terminations."""
    ins = {**settings, "initial_iteration_value": initial}
    if cache_iterations is not None:
        ins["cache_iterations"] = cache_iterations
    b = ["s", ITEM] if settings.get("mode") == "List" else ["s", IDX]
    wf = {"s": {"class_type": "StartLoop", "inputs": ins},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", VALUE], "b": b}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["add", 0],
                                                    "next_iteration_value": ["add", 0], "accumulate": accumulate}}}
    if preview:
        wf["show"] = {"class_type": "Preview", "inputs": {"value": ["add", 0], "label": "it"}}
        wf["e"]["inputs"]["termination0"] = ["show", 0]
    return wf


def python_items(settings):
    mode = settings.get("mode", "simple")
    if mode == "simple":
        return list(range(settings.get("num_iterations", 4)))
    if mode == "For":
        return list(range(settings.get("start_iteration_index", 0), settings.get("max_iteration", 4),
                          settings.get("step", 1)))
    return list(settings["list"])


def random_settings(rng):
    mode = rng.choice(["simple", "For", "List"])
    if mode == "simple":
        return {"mode": "simple", "num_iterations": rng.randint(0, 6)}
    if mode == "For":
        return {"mode": "For", "start_iteration_index": rng.randint(-6, 6), "max_iteration": rng.randint(-6, 6),
                "step": rng.choice([1, 2, 3])}
    return {"mode": "List", "list": [rng.randint(-20, 20) for _ in range(rng.randint(0, 5))]}


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
    assert r.output("e", 0) == running
    assert [e["summary"] for e in r.events] == running        # the termination ran once per iteration, in order
    assert [e["node"] for e in r.events] == [f"show#{i}" for i in range(len(items))]
    last = Executor(output_dir=tmp_path).run(sum_loop(settings, x0, accumulate=False)).output("e")
    assert last == (running[-1] if running else None)


def test_default_mode_is_simple_with_four_iterations_and_cache_off(tmp_path):
    wf = {"s": {"class_type": "StartLoop", "inputs": {"initial_iteration_value": 0}},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", VALUE], "b": ["s", IDX]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["add", 0],
                                                    "next_iteration_value": ["add", 0], "accumulate": True}}}
    r = Executor().run(wf)
    assert r.output("e") == [0, 1, 3, 6]
    assert r.loops[0]["cache_iterations"] is False


def test_output_value_and_next_iteration_value_are_separate():
    # carried: x -> x * 2 (as x + x); returned: the index of each iteration plus 100
    wf = {"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 3, "initial_iteration_value": 1}},
          "dbl": {"class_type": "AddInt", "inputs": {"a": ["s", VALUE], "b": ["s", VALUE]}},
          "out": {"class_type": "AddInt", "inputs": {"a": ["s", IDX], "b": 100}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["out", 0],
                                                    "next_iteration_value": ["dbl", 0], "accumulate": True}},
          "carried": {"class_type": "MakeList", "inputs": {"a": ["e", 0]}}}
    r = Executor().run(wf)
    assert r.output("e") == [100, 101, 102]
    assert [r.output(f"dbl#{i}") for i in range(3)] == [2, 4, 8]


def test_loop_state_is_first_is_last_and_list_item(tmp_path):
    wf = {"s": {"class_type": "StartLoop", "inputs": {"mode": "List", "list": ["a", "b", "c"]}},
          "m": {"class_type": "MakeList", "inputs": {"a": ["s", IDX], "b": ["s", FIRST], "c": ["s", LAST],
                                                     "d": ["s", ITEM]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["m", 0], "accumulate": True}}}
    assert Executor().run(wf).output("e") == [[0, True, False, "a"], [1, False, False, "b"], [2, False, True, "c"]]


def test_unused_position_flags_stay_false_so_a_longer_loop_keeps_its_keys(tmp_path):
    ex = Executor(output_dir=tmp_path)
    ex.run(sum_loop({"num_iterations": 3}, cache_iterations=True))
    more = ex.run(sum_loop({"num_iterations": 4}, cache_iterations=True))
    assert more.ran == ["s#3", "add#3", "show#3", "e"]
    # A body that reads is_last changes the last iteration's key when the loop grows, as in ComfyUI.
    wf = sum_loop({"num_iterations": 3}, cache_iterations=True)
    wf["flag"] = {"class_type": "MakeList", "inputs": {"a": ["add", 0], "b": ["s", LAST]}}
    wf["e"]["inputs"]["termination1"] = ["flag", 0]
    ex = Executor(output_dir=tmp_path)
    ex.run(wf)
    wf["s"]["inputs"]["num_iterations"] = 4
    grown = ex.run(wf)
    assert {"s#2", "s#3"} <= set(grown.ran) and "s#1" in grown.cached


def test_projected_ids_are_deterministic():
    r1 = Executor().run(sum_loop({"num_iterations": 3}))
    r2 = Executor().run(sum_loop({"num_iterations": 3}))
    ids = [x.id for x in r1.log]
    assert ids == [x.id for x in r2.log]
    assert ids == ["s#0", "add#0", "show#0", "s#1", "add#1", "show#1", "s#2", "add#2", "show#2", "e"]
    assert r1.loops[0]["iterations"] == 3


def test_empty_list_returns_nothing(tmp_path):
    r = Executor(output_dir=tmp_path).run(sum_loop({"mode": "List", "list": []}, initial=41))
    assert r.output("e") == [] and r.events == []
    r = Executor(output_dir=tmp_path).run(sum_loop({"mode": "List", "list": []}, initial=41, accumulate=False))
    assert r.output("e") is None


def test_mixed_list_is_carried():
    wf = {"s": {"class_type": "StartLoop", "inputs": {"mode": "List", "list": ["a", "b"],
                                                      "initial_iteration_value": [0, "x"]}},
          "n": {"class_type": "ListGet", "inputs": {"list": ["s", VALUE], "index": 0}},
          "t": {"class_type": "ListGet", "inputs": {"list": ["s", VALUE], "index": 1}},
          "n1": {"class_type": "AddInt", "inputs": {"a": ["n", 0], "b": 1}},
          "t1": {"class_type": "FormatText", "inputs": {"template": "{}+", "value": ["t", 0]}},
          "m": {"class_type": "MakeList", "inputs": {"a": ["n1", 0], "b": ["t1", 0], "c": ["s", ITEM]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["m", 0],
                                                    "next_iteration_value": ["m", 0]}}}
    assert Executor().run(wf).output("e") == [2, "x++", "b"]


def test_linked_list_and_count():
    wf = {"l": {"class_type": "MakeList", "inputs": {"a": 3, "b": 4}},
          "c": {"class_type": "ListLength", "inputs": {"list": ["l", 0]}},
          "s": {"class_type": "StartLoop", "inputs": {"mode": "List", "list": ["l", 0], "initial_iteration_value": 0}},
          "add": {"class_type": "AddInt", "inputs": {"a": ["s", VALUE], "b": ["s", ITEM]}},
          "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": ["add", 0],
                                                    "next_iteration_value": ["add", 0]}},
          "s2": {"class_type": "StartLoop", "inputs": {"num_iterations": ["c", 0], "initial_iteration_value": ["e", 0]}},
          "add2": {"class_type": "AddInt", "inputs": {"a": ["s2", VALUE], "b": 10}},
          "e2": {"class_type": "EndLoop", "inputs": {"loop": ["s2", HANDLE], "output_value": ["add2", 0],
                                                     "next_iteration_value": ["add2", 0]}}}
    assert Executor().run(wf).output("e2") == 27


def linked_list_loop(items):
    """A List loop whose list arrives through a link (a JSON list literal held by a node)."""
    wf = {"items": {"class_type": "MakeList", "inputs": {k: v for k, v in zip("abcd", items)}},
          **sum_loop({"mode": "List", "list": ["items", 0]}, cache_iterations=True)}
    return wf


def test_appending_one_item_reruns_only_the_new_iteration(tmp_path):
    """Each iteration's key depends on its own item and index, even when the list arrives through a
    link; before, every head took the whole list link and all iterations ran again."""
    ex = Executor(output_dir=tmp_path)
    first = ex.run(linked_list_loop([5, 7, 11]))
    assert first.output("e") == [5, 12, 23]
    grown = ex.run(linked_list_loop([5, 7, 11, 13]))
    assert grown.output("e") == [5, 12, 23, 36]
    loop_nodes_ran = [i for i in grown.ran if "#" in i]
    assert loop_nodes_ran == ["s#3", "add#3", "show#3"]             # the new item's head, body and preview
    assert set(grown.cached) >= {f"{n}#{i}" for n in ("s", "add", "show") for i in range(3)}
    changed = ex.run(linked_list_loop([5, 8, 11, 13]))                 # a changed item re-runs from there on
    assert [i for i in changed.ran if "#" in i][:3] == ["s#1", "add#1", "show#1"] and "s#0" in changed.cached


def test_cache_iterations_on_reuses_iterations_and_reemits_cached_side_effects(tmp_path):
    ex = Executor(output_dir=tmp_path)
    ex.run(sum_loop({"num_iterations": 4}, cache_iterations=True))
    again = ex.run(sum_loop({"num_iterations": 4}, cache_iterations=True))
    # ComfyUI: the StartLoop's fingerprint is NaN, so EndLoop (and what follows it) runs every time;
    # the iterations, previews included, come from the cache, and the previews' output is re-sent.
    assert again.ran == ["e"] and again.side_effects == []
    assert [e["node"] for e in again.events] == [f"show#{i}" for i in range(4)]
    assert all(e["cached"] for e in again.events)


def test_cache_iterations_off_reruns_bodies_and_their_side_effects(tmp_path):
    wf = sum_loop({"num_iterations": 3})                    # cache_iterations left at its default: off
    wf["x"] = {"class_type": "Int", "inputs": {"value": 7}}
    wf["s"]["inputs"]["initial_iteration_value"] = ["x", 0]
    ex = Executor(output_dir=tmp_path)
    ex.run(wf)
    again = ex.run(wf)
    assert "x" in again.cached
    assert again.ran == ["s#0", "add#0", "show#0", "s#1", "add#1", "show#1", "s#2", "add#2", "show#2", "e"]
    assert again.side_effects == ["show#0", "show#1", "show#2"]
    assert again.output("e") == [7, 8, 10]


def nested(outer, inner, x0):
    b_in = ["i", ITEM] if inner.get("mode") == "List" else ["i", IDX]
    b_out = ["o", ITEM] if outer.get("mode") == "List" else ["o", IDX]
    return {"x0": {"class_type": "Int", "inputs": {"value": x0}},
            "o": {"class_type": "StartLoop", "inputs": {**outer, "initial_iteration_value": ["x0", 0]}},
            "i": {"class_type": "StartLoop", "inputs": {**inner, "initial_iteration_value": ["o", VALUE],
                                                        "parent_iteration": ["o", IDX]}},
            "m": {"class_type": "AddInt", "inputs": {"a": b_in, "b": b_out}},
            "acc": {"class_type": "AddInt", "inputs": {"a": ["i", VALUE], "b": ["m", 0]}},
            "ie": {"class_type": "EndLoop", "inputs": {"loop": ["i", HANDLE], "output_value": ["acc", 0],
                                                       "next_iteration_value": ["acc", 0]}},
            "keep": {"class_type": "MakeList", "inputs": {"a": ["ie", 0], "b": ["o", VALUE]}},
            # an inner loop of 0 iterations returns None: MakeList drops it, so the carried value passes on
            "pick": {"class_type": "ListGet", "inputs": {"list": ["keep", 0], "index": 0}},
            "oe": {"class_type": "EndLoop", "inputs": {"loop": ["o", HANDLE], "output_value": ["pick", 0],
                                                       "next_iteration_value": ["pick", 0]}}}


@pytest.mark.parametrize("trial", range(6))
def test_nested_loops_match_python(trial):
    rng = random.Random()
    outer, inner, x0 = random_settings(rng), random_settings(rng), rng.randint(-50, 50)
    expected = x0
    for o in python_items(outer):
        for i in python_items(inner):
            expected += i + o
    got = Executor().run(nested(outer, inner, x0)).output("oe")
    assert got == (expected if python_items(outer) else None)


def test_nested_ids_and_inner_loop_independent_of_outer_start():
    # the inner StartLoop reads nothing from the outer loop; its body does, so it belongs to the outer body
    wf = {"o": {"class_type": "StartLoop", "inputs": {"num_iterations": 2, "initial_iteration_value": 0}},
          "i": {"class_type": "StartLoop", "inputs": {"num_iterations": 2, "initial_iteration_value": 100}},
          "a": {"class_type": "AddInt", "inputs": {"a": ["i", VALUE], "b": ["o", IDX]}},
          "ie": {"class_type": "EndLoop", "inputs": {"loop": ["i", HANDLE], "output_value": ["a", 0],
                                                     "next_iteration_value": ["a", 0]}},
          "s": {"class_type": "AddInt", "inputs": {"a": ["o", VALUE], "b": ["ie", 0]}},
          "oe": {"class_type": "EndLoop", "inputs": {"loop": ["o", HANDLE], "output_value": ["s", 0],
                                                     "next_iteration_value": ["s", 0]}}}
    r = Executor().run(wf)
    assert r.output("oe") == (100 + 0 + 0) + (100 + 1 + 1)
    assert "a#1#0" in [x.id for x in r.log]


def end(extra=None):
    return {"class_type": "EndLoop", "inputs": {"loop": ["s", HANDLE], "output_value": 1, **(extra or {})}}


@pytest.mark.parametrize("wf, fragment", [
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}}}, "has no EndLoop"),
    ({"x": {"class_type": "Int", "inputs": {"value": 1}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["x", 0], "output_value": 1}}}, "expects LOOP"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}},
      "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", IDX]}}}, "expects LOOP"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}}, "e1": end(), "e2": end()},
     "closed by 2 EndLoops"),
    ({"a": {"class_type": "StartLoop", "inputs": {"num_iterations": 2, "initial_iteration_value": 0}},
      "b": {"class_type": "StartLoop", "inputs": {"num_iterations": 2, "initial_iteration_value": ["a", VALUE]}},
      "ea": {"class_type": "EndLoop", "inputs": {"loop": ["a", HANDLE], "output_value": ["b", VALUE]}},
      "eb": {"class_type": "EndLoop", "inputs": {"loop": ["b", HANDLE], "output_value": ["ea", 0]}}}, "loops cross"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "For", "max_iteration": 5, "step": 0}}, "e": end()},
     "'step' must be >= 1"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2.5}}, "e": end()}, "'num_iterations' expects INT"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": -1}}, "e": end()}, "must be >= 0"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "List", "list": "abc"}}, "e": end()}, "'list' expects LIST"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "List"}}, "e": end()}, "'list' is required"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "while"}}, "e": end()}, "must be one of"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 20, "max_iterations": 10}}, "e": end()},
     "more than the limit of 10"),
    ({"s": {"class_type": "StartLoop", "inputs": {"mode": "For", "max_iteration": 10**12}}, "e": end()},
     "more than the limit of 1000"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}}, "e": end({"termination50": 1})},
     "at most 50 terminations"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}}, "e": end({"terminator": 1})},
     "'terminator' is not an input of EndLoop"),
    ({"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 2}},
      "b": {"class_type": "Int", "inputs": {"value": 1}},
      "e": end({"accumulate": ["b", 0]})}, "'accumulate' expects BOOLEAN"),
])
def test_loop_errors(wf, fragment, tmp_path):
    with pytest.raises(WorkflowError, match=fragment):
        Executor(output_dir=tmp_path).run(wf)


def test_linked_values_are_checked_when_the_loop_expands():
    wf = {"t": {"class_type": "String", "inputs": {"value": "abc"}},
          "s": {"class_type": "StartLoop", "inputs": {"mode": "List", "list": ["t", 0]}}, "e": end()}
    with pytest.raises(WorkflowError, match="expects LIST"):
        Executor().run(wf)
    wf2 = {"l": {"class_type": "MakeList", "inputs": {"a": 1.5}},
           "c": {"class_type": "ListGet", "inputs": {"list": ["l", 0], "index": 0}},
           "s": {"class_type": "StartLoop", "inputs": {"num_iterations": ["c", 0]}}, "e": end()}
    with pytest.raises(WorkflowError, match="'num_iterations' expects INT"):
        Executor().run(wf2)


def test_node_reading_the_body_from_outside_is_refused(tmp_path):
    wf = sum_loop({"num_iterations": 2}, preview=False)
    wf["save"] = {"class_type": "Preview", "inputs": {"value": ["add", 0]}}
    with pytest.raises(WorkflowError, match=r"node 'save' \(Preview\) input 'value' reads node 'add' inside loop"):
        Executor(output_dir=tmp_path).run(wf)
    wf = sum_loop({"num_iterations": 2}, preview=False)
    wf["late"] = {"class_type": "AddInt", "inputs": {"a": ["e", 0], "b": ["s", IDX]}}
    with pytest.raises(WorkflowError, match="does not lead to EndLoop"):
        Executor().run(wf)


# ---------------------------------------------------------------------------
# Bounds: every one of these used to end in OverflowError, RecursionError or minutes of work


@pytest.mark.parametrize("inputs", [{"num_iterations": 10**30}, {"mode": "For", "max_iteration": 10**30},
                                    {"mode": "For", "start_iteration_index": -10**30}])
def test_huge_literal_counts_are_clean_errors(inputs):
    with pytest.raises(WorkflowError, match="signed 64-bit"):
        Executor().run({"s": {"class_type": "StartLoop", "inputs": inputs}, "e": end()})
    # within int64 but still huge: refused by its length, computed without building the range
    big = {k: (2**62 if v == 10**30 else -2**62 if v == -10**30 else v) for k, v in inputs.items()}
    with pytest.raises(WorkflowError, match="more than the limit"):
        Executor().run({"s": {"class_type": "StartLoop", "inputs": big}, "e": end()})


def test_huge_linked_count_is_a_clean_error():
    wf = {"n": {"class_type": "MakeList", "inputs": {"a": 10**30}},
          "c": {"class_type": "ListGet", "inputs": {"list": ["n", 0], "index": 0}},
          "s": {"class_type": "StartLoop", "inputs": {"num_iterations": ["c", 0]}}, "e": end()}
    with pytest.raises(WorkflowError, match="signed 64-bit"):
        Executor().run(wf)


def nested_counts(outer, inner, linked=False):
    wf = {"o": {"class_type": "StartLoop", "inputs": {"num_iterations": outer, "initial_iteration_value": 0}},
          "i": {"class_type": "StartLoop", "inputs": {"num_iterations": inner, "initial_iteration_value": ["o", VALUE],
                                                      "parent_iteration": ["o", IDX]}},
          "a": {"class_type": "AddInt", "inputs": {"a": ["i", VALUE], "b": 1}},
          "ie": {"class_type": "EndLoop", "inputs": {"loop": ["i", HANDLE], "output_value": ["a", 0],
                                                     "next_iteration_value": ["a", 0]}},
          "oe": {"class_type": "EndLoop", "inputs": {"loop": ["o", HANDLE], "output_value": ["ie", 0],
                                                     "next_iteration_value": ["ie", 0]}}}
    if linked:   # counts known only at run time: refused by the running total
        wf["n"] = {"class_type": "Int", "inputs": {"value": inner}}
        wf["i"]["inputs"]["num_iterations"] = ["n", 0]
    return wf


def test_total_iteration_cap_across_nested_loops():
    assert Executor().run(nested_counts(30, 30)).output("oe") == 900
    with pytest.raises(WorkflowError, match="1001000 iterations in total.*nested loops multiply.*10000"):
        Executor().run(nested_counts(1000, 1000))                   # refused before anything runs
    with pytest.raises(WorkflowError, match="iterations in total.*total limit of 10000"):
        Executor().run(nested_counts(1000, 1000, linked=True))      # refused after ~10 inner expansions
    with pytest.raises(WorkflowError, match="total limit of 50"):
        Executor(max_total_iterations=50).run(nested_counts(5, 10, linked=True))


class CountingDict(dict):
    """A graph that counts how often it is iterated whole."""
    scans = 0

    def __iter__(self):
        CountingDict.scans += 1
        return super().__iter__()

    def items(self):
        CountingDict.scans += 1
        return super().items()

    def values(self):
        CountingDict.scans += 1
        return super().values()

    def keys(self):
        CountingDict.scans += 1
        return super().keys()


def test_expanding_a_loop_does_not_scan_the_graph():
    from inferbook.workflow.executor import as_graph, validate

    wf = sum_loop({"num_iterations": 50})
    for k in range(200):                       # unrelated nodes the expansion must not visit
        wf[f"pad{k}"] = {"class_type": "Int", "inputs": {"value": k}}
    graph = as_graph(wf)
    plan = validate(graph)
    plan.apply_schedule(graph)
    g = CountingDict(graph)
    CountingDict.scans = 0
    new, removed, info = loops.expand(g, "s", {"num_iterations": 50, "initial_iteration_value": 0}, None,
                                      max_iterations=1000)
    assert CountingDict.scans == 0
    assert info["iterations"] == 50 and len(new) == 50 * 3 + 1 and removed == ["add", "show"]


def test_deeply_nested_json_is_a_clean_error(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    text = '{"a": {"class_type": "MakeList", "inputs": {"a": ' + deep + '}}}'
    with pytest.raises(WorkflowError, match="levels deep"):
        Executor().run(text)
    nested_value = []
    for _ in range(3000):
        nested_value = [nested_value]
    with pytest.raises(WorkflowError, match="levels deep"):
        Executor().run({"a": {"class_type": "MakeList", "inputs": {"a": nested_value}}})
    p = tmp_path / "deep.json"
    p.write_text(text)
    from inferbook.workflow.cli import main
    assert main(["validate", str(p)]) == 2


def test_savevideo_fps_is_bounded(tmp_path):
    import torch

    wf = {"img": {"class_type": "ToyScene", "inputs": {"width": 16, "height": 16, "prompt": "x"}},
          "save": {"class_type": "SaveVideo", "inputs": {"images": ["img", 0], "fps": 10**30}}}
    with pytest.raises(WorkflowError, match="signed 64-bit"):
        Executor(output_dir=tmp_path).run(wf)
    wf["save"]["inputs"]["fps"] = 10**6
    with pytest.raises(WorkflowError, match="must be <= 240"):
        Executor(output_dir=tmp_path).run(wf)
    assert not list(tmp_path.glob("*.mp4"))
    del torch
