"""Generic loops: paired StartLoop / EndLoop, projected into ordinary nodes, as ComfyUI does them.

ComfyUI v0.36.0's Generic Loops (#16227, `comfy_extras/nodes_loop.py`) pair a Start Loop with an
End Loop, iterate `num_iterations` times ("simple"), over `range(start_iteration_index,
max_iteration, step)` ("For") or over a list ("List"), and carry one value from each iteration to
the next. This module follows that code:

- StartLoop outputs `iteration_index`, `is_first`, `is_last`, `list_item` and
  `current_iteration_value` (ComfyUI's five outputs, same indices 0-4), plus output 5, `loop`: the
  handle our EndLoop links to (ComfyUI pairs them by graph structure in `validate_loops`; we pair them
  by this explicit link). `parent_iteration` takes an outer loop's `iteration_index` to nest a loop.
- EndLoop has ComfyUI's separate inputs: `output_value` (what the loop returns: the last iteration's,
  or every iteration's when `accumulate`), `next_iteration_value` (carried into the next iteration's
  `current_iteration_value`), and `termination0`, `termination1`, ... : the outputs of side effects
  (save, preview) that must run on every iteration; their values are not returned.
- `cache_iterations` defaults to off. Off, every iteration's head gets a fresh cache key (ComfyUI's
  `LoopIteration.fingerprint_inputs` returns NaN), so each body runs again. On, an iteration's key is
  its index, its position flags, its own item and its carried value: adding an item re-runs only the
  new iteration. As in ComfyUI, `is_first` / `is_last` are True only when some node reads them, so that
  a loop that grows keeps its iterations' keys. The StartLoop itself is always fresh (NaN in ComfyUI),
  so the EndLoop and what follows it run on every execution.

When the StartLoop's own inputs are ready, `expand` replaces the body (computed once, by
`plan_loops`) by one copy per iteration:

    <start>#i   a _LoopHead: ComfyUI's LoopIteration for iteration i
    <node>#i    a copy of each body node, its links re-pointed into iteration i
    <end>       becomes a _LoopExit: ComfyUI's LoopResult + EndLoop (the returned value)

Ids are deterministic ("7#2" is body node 7 in iteration 2; "7#2#1" is the same node in
iteration 1 of an inner loop inside outer iteration 2). Each iteration's head depends on the previous
iteration's output, carried value and terminations, so iterations run in order.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field

from .executor import Input, Spec, WorkflowError, _where, ascii_index, is_link, links, node

MODES = ("simple", "For", "List")
# StartLoop output indices (ComfyUI's order; the handle is ours, last)
INDEX, IS_FIRST, IS_LAST, ITEM, VALUE, HANDLE = range(6)
MAX_TERMINATIONS = 50          # ComfyUI's Autogrow max for EndLoop terminations


def _plan(graph, registry):
    """The executor's `plan` hook of StartLoop and EndLoop (one function: the executor calls it once)."""
    return plan_loops(graph, registry)


def _expand(graph, sid, values, registry, **kw):
    """The executor's `expand` hook of StartLoop."""
    return expand(graph, sid, values, registry, **kw)


@node("StartLoop", inputs={
    "mode": Input("STRING", default="simple", choices=MODES, help="simple, For or List (ComfyUI's names)"),
    "num_iterations": Input("INT", default=4, min=0, help="simple mode: number of iterations"),
    "start_iteration_index": Input("INT", default=0, help="For mode: first iteration_index"),
    "max_iteration": Input("INT", default=4, help="For mode: exclusive stop of iteration_index"),
    "step": Input("INT", default=1, min=1, help="For mode: step (ComfyUI allows >= 1 only)"),
    "list": Input("LIST", optional=True, help="List mode: one iteration per item"),
    "cache_iterations": Input("BOOLEAN", default=False, help="reuse unchanged iterations from earlier runs"),
    "parent_iteration": Input("INT", optional=True, help="an outer StartLoop's iteration_index, to nest this loop"),
    "initial_iteration_value": Input("ANY", optional=True, help="current_iteration_value on the first iteration"),
    "max_iterations": Input("INT", optional=True, min=0, help="refuse loops longer than this (ours, not ComfyUI's)"),
}, outputs=(("iteration_index", "INT"), ("is_first", "BOOLEAN"), ("is_last", "BOOLEAN"), ("list_item", "ANY"),
            ("current_iteration_value", "ANY"), ("loop", "LOOP")), plan=_plan, expand=_expand)
def start_loop(**_):
    """Opens a loop. Never run: the executor projects it (see `expand`)."""
    raise RuntimeError("StartLoop is projected by the executor, never run")


@node("EndLoop", inputs={
    "loop": "LOOP",
    "output_value": Input("ANY", optional=True, help="returned: the last iteration's, or all with accumulate"),
    "next_iteration_value": Input("ANY", optional=True, help="carried into the next iteration"),
    "accumulate": Input("BOOLEAN", default=False, help="return output_value of every iteration (a list)"),
}, outputs=(("outputs", "ANY"),), variadic="termination", plan=_plan)
def end_loop(**_):
    """Closes the loop whose handle it receives. termination0, termination1, ...: side effects that
    must run on every iteration (their values are not returned)."""
    raise RuntimeError("EndLoop is replaced by the executor, never run")


@node("_LoopHead", inputs={"index": "INT", "is_first": "BOOLEAN", "is_last": "BOOLEAN",
                           "item_key": Input("STRING", optional=True), "value": Input("ANY", optional=True)},
      outputs=(("iteration_index", "INT"), ("is_first", "BOOLEAN"), ("is_last", "BOOLEAN"), ("list_item", "ANY"),
               ("current_iteration_value", "ANY"), ("loop", "ANY")), internal=True, variadic="dependency")
def loop_head(index, is_first, is_last, item_key, value, item=None, **_dependencies):
    """Iteration `index`: its position flags, its own item (keyed by `item_key`) and the carried value.
    The dependency inputs only order the iterations (and enter the cache key)."""
    return index, is_first, is_last, item, value, None


@node("_LoopExit", inputs={"start": Input("ANY", optional=True), "accumulate": "BOOLEAN"},
      outputs=(("outputs", "ANY"),), internal=True, variadic="output")
def loop_exit(start, accumulate, **outputs):
    """What the EndLoop returns once every iteration has run: the list of every iteration's
    output_value (accumulate), or the last one's (None when the loop ran no iteration)."""
    ordered = [outputs[f"output{k}"] for k in range(len(outputs))]
    if accumulate:
        return (ordered,)
    return (ordered[0] if ordered else None,)


def content_key(value) -> str:
    """A hash of an item's content (JSON values, tensors, arrays, nested lists and dicts of them), so an
    iteration's key depends on its own item even when the list arrives through a link. Anything else
    gets a fresh key and is never reused (ComfyUI's to_hashable makes it Unhashable; ComfyUI does the
    same to tensors, which we hash by dtype, shape and bytes instead).

    A container's key is the hash of its children's keys, each container hashed once (memoised by
    identity): a list that holds the previous level twice, 60 levels deep, costs 60 hashes, not 2^60."""
    import numpy as np
    import torch

    memo: dict[int, str] = {}
    keep = []   # containers hashed, kept alive so their ids stay unique during the walk

    def leaf(v) -> str:
        h = hashlib.sha256()
        if v is None or isinstance(v, (bool, int, float, str)):
            h.update(f"{type(v).__name__}:{v!r};".encode())
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"tensor:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            h.update(f"ndarray:{a.dtype}:{a.shape};".encode())
            h.update(a.tobytes())
        else:
            h.update(uuid.uuid4().bytes)
        return h.hexdigest()

    def children(v) -> list:
        if isinstance(v, dict):
            keys = sorted(v, key=repr)
            return [x for k in keys for x in (k, v[k])]
        return list(v)

    def key_of(v) -> str:
        return memo[id(v)] if isinstance(v, (list, tuple, dict)) else leaf(v)

    todo = [(value, False)]
    while todo:
        v, done = todo.pop()
        if not isinstance(v, (list, tuple, dict)) or (id(v) in memo and not done):
            continue
        if not done:
            memo[id(v)] = ""   # in progress (a value that holds itself hashes its inner copy as "")
            keep.append(v)
            todo.append((v, True))
            todo.extend((c, False) for c in children(v) if isinstance(c, (list, tuple, dict)) and id(c) not in memo)
            continue
        h = hashlib.sha256(f"{type(v).__name__}[{len(v)}];".encode())
        for c in children(v):
            h.update(key_of(c).encode())
        memo[id(v)] = h.hexdigest()
    return key_of(value)[:32]


# ---------------------------------------------------------------------------
# Structure: pairs, bodies, nesting


def _reverse(graph: dict[str, Spec]) -> dict[str, set[str]]:
    rev: dict[str, set[str]] = {n: set() for n in graph}
    for nid, spec in graph.items():
        for src, _ in links(spec).values():
            if src in rev:
                rev[src].add(nid)
    return rev


def _closure(start: str, step) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def end_of(graph: dict[str, Spec], sid: str, ends_by_start: dict[str, list[str]] | None = None) -> str:
    """The EndLoop paired with StartLoop `sid` (exactly one must take its loop handle)."""
    if ends_by_start is None:
        ends_by_start = _ends_by_start(graph)
    ends = ends_by_start.get(sid, [])
    if not ends:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} has no EndLoop: link an EndLoop's 'loop' input to "
                            f"{json.dumps([sid, HANDLE])}", node=sid)
    if len(ends) > 1:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} is closed by {len(ends)} EndLoops ({', '.join(map(repr, ends))}); "
                            "a loop has exactly one", node=sid)
    return ends[0]


def _ends_by_start(graph: dict[str, Spec]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n, s in graph.items():
        v = s.inputs.get("loop") if s.class_type == "EndLoop" else None
        if is_link(v):
            out.setdefault(v[0], []).append(n)
    return out


def loop_body(graph: dict[str, Spec], sid: str, rev: dict[str, set[str]] | None = None,
              ends_by_start: dict[str, list[str]] | None = None) -> tuple[str, set[str]]:
    """(end id, body ids) of the loop opened by `sid`: what depends on the StartLoop and leads to the
    EndLoop, plus every inner loop whose EndLoop is in it, whole."""
    rev = _reverse(graph) if rev is None else rev
    ends_by_start = _ends_by_start(graph) if ends_by_start is None else ends_by_start
    eid = end_of(graph, sid, ends_by_start)
    desc = _closure(sid, lambda n: rev.get(n, ()))
    anc = _closure(eid, lambda n: [s for s, _ in links(graph[n]).values() if s in graph])
    body = (desc & anc) - {sid, eid}
    # An inner loop whose EndLoop is in the body belongs to it whole, even when its StartLoop
    # reads nothing from this loop (it still runs once per outer iteration).
    changed = True
    while changed:
        changed = False
        for n in list(body):
            if graph[n].class_type == "EndLoop":
                inner = graph[n].inputs["loop"][0]
                if inner not in body and inner != sid:
                    _, inner_body = loop_body(graph, inner, rev, ends_by_start)
                    body |= {inner} | inner_body
                    changed = True
    return eid, body


@dataclass
class Loop:
    start: str
    end: str
    body: set[str]
    parent: str | None = None
    count: int | None = None      # iterations, when the settings are literals


@dataclass
class LoopPlan:
    loops: dict[str, Loop] = field(default_factory=dict)

    def apply_schedule(self, graph: dict[str, Spec]) -> None:
        """An inner StartLoop waits for its outer one, so the outer loop is projected first; every
        StartLoop carries its body (in file order) and end, so expanding it never scans the graph."""
        position = {n: i for i, n in enumerate(graph)}
        for lp in self.loops.values():
            spec = graph[lp.start]
            spec.loop_body = tuple(sorted(lp.body, key=position.__getitem__))
            spec.loop_end = lp.end
            if lp.parent is not None and lp.parent not in spec.after:
                spec.after = spec.after + (lp.parent,)

    def check_total(self, limit: int, per_loop: int, graph: dict[str, Spec]) -> None:
        """Refuse, before anything runs, a literal loop longer than `per_loop` (or its own
        max_iterations), and nested literal loops whose iterations together exceed `limit`
        (a 1000-iteration loop inside a 1000-iteration loop is 1001000 iterations)."""
        for lp in self.loops.values():
            own = _literal(graph[lp.start].inputs, "max_iterations")
            cap = per_loop if own is None else min(per_loop, own)
            if lp.count is not None and lp.count > cap:
                raise WorkflowError(f"{_where(lp.start, 'StartLoop')} would run {lp.count} iterations, more than the "
                                    f"limit of {cap} (StartLoop 'max_iterations', or the executor's max_iterations)",
                                    node=lp.start)
        total = 0
        for lp in self.loops.values():
            product, cur = 1, lp
            while cur is not None:
                if cur.count is None:
                    product = None
                    break
                product *= cur.count
                cur = self.loops.get(cur.parent) if cur.parent else None
            if product is None:
                continue
            total += product
            if total > limit:
                raise WorkflowError(f"{_where(lp.start, 'StartLoop')}: the loops of this workflow would run at least "
                                    f"{total} iterations in total (nested loops multiply), more than the total limit of "
                                    f"{limit} (the executor's max_total_iterations)", node=lp.start)


def plan_loops(graph: dict[str, Spec], registry=None) -> LoopPlan:
    """Check every loop of a workflow before anything runs: pairs, crossings, what reads the
    body from outside, the EndLoop's inputs and the literal iteration settings. Returns the nesting."""
    rev = _reverse(graph)
    ends_by_start = _ends_by_start(graph)
    plan = LoopPlan()
    starts = [n for n, s in graph.items() if s.class_type == "StartLoop"]
    for nid, spec in graph.items():
        if spec.class_type == "EndLoop":
            v = spec.inputs.get("loop")
            if not (is_link(v) and graph.get(v[0]) is not None and graph[v[0]].class_type == "StartLoop"
                    and v[1] == HANDLE):
                raise WorkflowError(f"{_where(nid, 'EndLoop', 'loop')} must link to output {HANDLE} ('loop') of a "
                                    "StartLoop", node=nid, input="loop")
            for name in spec.inputs:
                if (name.startswith("termination") and ascii_index(name[len("termination"):])
                        and int(name[len("termination"):]) >= MAX_TERMINATIONS):
                    raise WorkflowError(f"{_where(nid, 'EndLoop', name)}: at most {MAX_TERMINATIONS} terminations "
                                        f"(termination0 .. termination{MAX_TERMINATIONS - 1})", node=nid, input=name)
            if is_link(spec.inputs.get("accumulate")):
                raise WorkflowError(f"{_where(nid, 'EndLoop', 'accumulate')} must be a literal true or false here "
                                    "(the loop's wiring depends on it)", node=nid, input="accumulate")
    for sid in starts:
        count = check_literal_settings(sid, graph[sid])
        eid, body = loop_body(graph, sid, rev, ends_by_start)
        plan.loops[sid] = Loop(sid, eid, body, count=count)
    inside_of = {a.start: a.body | {a.start, a.end} for a in plan.loops.values()}
    for a in plan.loops.values():
        inside = inside_of[a.start]
        for n in a.body:                                   # a loop half inside another: crossed pairs
            if graph[n].class_type == "StartLoop" and plan.loops[n].end not in a.body:
                raise WorkflowError(f"loops cross: StartLoop {n!r} is inside loop {a.start!r}..{a.end!r} but its "
                                    f"EndLoop {plan.loops[n].end!r} is not; nest loops whole", node=n)
        for b in plan.loops.values():
            if b is not a and b.start in a.body and a.start in b.body:
                raise WorkflowError(f"loops cross: {a.start!r}..{a.end!r} and {b.start!r}..{b.end!r} each contain the "
                                    "other's StartLoop", node=b.start)
        for src in inside:                                 # reading the body from outside it
            if src == a.end:
                continue
            for nid in rev.get(src, ()):
                if nid in inside:
                    continue
                spec = graph[nid]
                for name, (s2, _) in links(spec).items():
                    if s2 == src:
                        raise WorkflowError(
                            f"{_where(nid, spec.class_type, name)} reads node {src!r} inside loop {a.start!r}..{a.end!r} "
                            f"but does not lead to EndLoop {a.end!r}: wire side effects (save, preview) into the "
                            f"EndLoop's termination inputs, carried values into 'next_iteration_value', or read the "
                            f"loop's result from EndLoop {a.end!r}", node=nid, input=name)
    for b in plan.loops.values():                          # innermost enclosing loop
        enclosing = [a for a in plan.loops.values() if a is not b and b.start in a.body]
        if enclosing:
            b.parent = min(enclosing, key=lambda a: len(a.body)).start
    return plan


def _literal(ins: dict, name: str, default=None):
    v = ins.get(name, default)
    return None if is_link(v) else v


def check_literal_settings(sid: str, spec: Spec) -> int | None:
    """Mode-specific rules for literal inputs (linked ones are checked when the loop expands).
    Returns the number of iterations when it is known from literals, else None."""
    ins = spec.inputs
    mode = ins.get("mode", "simple")
    if is_link(mode):
        return None
    if mode == "List":
        if ins.get("list") is None:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'list')} is required in List mode", node=sid, input="list")
        items = _literal(ins, "list")
        return len(items) if isinstance(items, list) else None
    values = {k: _literal(ins, k) for k in ("num_iterations", "start_iteration_index", "max_iteration", "step")}
    if any(values[k] is None and k in ins for k in values):
        return None
    return iteration_count(sid, {"mode": mode, **{k: v for k, v in values.items() if v is not None}})


def iteration_count(sid: str, values: dict) -> int:
    """Iterations of a simple or For loop, computed arithmetically (len(range(10**30)) overflows)."""
    mode = values.get("mode") or "simple"

    def get(name, default):
        v = values.get(name)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int):
            raise WorkflowError(f"{_where(sid, 'StartLoop', name)} must be an integer, got {v!r}", node=sid, input=name)
        return v

    if mode == "simple":
        n = get("num_iterations", 4)
        if n < 0:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'num_iterations')} must be >= 0, got {n}", node=sid,
                                input="num_iterations")
        return n
    start, stop, step = get("start_iteration_index", 0), get("max_iteration", 4), get("step", 1)
    if step < 1:
        raise WorkflowError(f"{_where(sid, 'StartLoop', 'step')} must be >= 1 (For mode), got {step}", node=sid,
                            input="step")
    return max(0, -(-(stop - start) // step))


def iterations(sid: str, values: dict, limit: int) -> tuple[range | list, bool]:
    """The iteration values (iteration_index per iteration) and whether it is a List loop. The count is
    checked against `limit` before anything is built. Errors name the node and input."""
    mode = values.get("mode") or "simple"
    if mode == "List":
        items = values.get("list")
        if not isinstance(items, list):
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'list')} must be a list in List mode, got "
                                f"{type(items).__name__}", node=sid, input="list")
        n = len(items)
    else:
        n = iteration_count(sid, values)
    if n > limit:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} would run {n} iterations, more than the limit of {limit} "
                            "(StartLoop 'max_iterations', or the executor's max_iterations)", node=sid)
    if mode == "List":
        return items, True
    if mode == "simple":
        return range(n), False
    start = values.get("start_iteration_index")
    start = 0 if start is None else start
    step = values.get("step") or 1
    return range(start, start + n * step, step), False


def _termination_names(inputs: dict) -> list[str]:
    names = [k for k in inputs if k.startswith("termination") and ascii_index(k[len("termination"):])]
    return sorted(names, key=lambda k: int(k[len("termination"):]))


def expand(graph: dict[str, Spec], sid: str, values: dict, registry, *, max_iterations: int,
           budget=None) -> tuple[list[str], list[str], dict]:
    """Project the loop opened by `sid` into ordinary nodes, in place, touching only the loop's own
    nodes (the body and end were planned before the run). Returns (new ids in queue order, the
    removed body ids, a summary). `values` are the StartLoop's resolved inputs."""
    start_spec = graph[sid]
    eid, body_order = start_spec.loop_end, start_spec.loop_body
    limit = max_iterations
    if values.get("max_iterations") is not None:
        limit = min(limit, values["max_iterations"])
    items, is_list = iterations(sid, values, limit)
    n = len(items)
    if budget is not None:
        budget.take(sid, n, n * (len(body_order) + 1) + 1)
    end_spec = graph[eid]
    close = end_spec.inputs
    output_src, next_src = close.get("output_value"), close.get("next_iteration_value")
    terminations = [close[k] for k in _termination_names(close) if is_link(close[k])]
    accumulate = bool(close.get("accumulate", False))
    flag = bool(values.get("cache_iterations", False))
    body = set(body_order)
    # Unused position flags stay False so that a change in loop length keeps the iterations' keys.
    used = {v[1] for b in (*body_order, eid) for v in graph[b].inputs.values() if is_link(v) and v[0] == sid}
    carry = start_spec.inputs.get("initial_iteration_value")
    deps: list = []
    exit_inputs: dict = {}
    new: list[str] = []

    for pos, index in enumerate(items if not is_list else range(n)):
        hid = f"{sid}#{pos}"
        head = {"index": int(index), "is_first": IS_FIRST in used and pos == 0,
                "is_last": IS_LAST in used and pos == n - 1}
        extra = {}
        if is_list:
            head["item_key"] = content_key(items[pos])
            extra["item"] = items[pos]
        if carry is not None:
            head["value"] = carry
        for k, d in enumerate(deps):
            head[f"dependency{k}"] = d
        graph[hid] = Spec("_LoopHead", head, cache=start_spec.cache and flag, fresh=not flag, origin=sid, extra=extra)
        new.append(hid)
        mapping = {b: f"{b}#{pos}" for b in body_order}

        def rewrite(value, mapping=mapping, hid=hid):
            if not is_link(value):
                return value
            if value[0] == sid:
                return [hid, value[1]]
            if value[0] in mapping:
                return [mapping[value[0]], value[1]]
            return value

        for b in body_order:
            s = graph[b]
            copy = Spec(s.class_type, {k: rewrite(v) for k, v in s.inputs.items()},
                        after=tuple(mapping.get(a, a) for a in s.after if a != sid),
                        cache=s.cache and flag, fresh=s.fresh, origin=s.origin or b, extra=dict(s.extra))
            if s.loop_body is not None:        # an inner loop: its plan, re-pointed into this iteration
                copy.loop_body = tuple(mapping[x] for x in s.loop_body)
                copy.loop_end = mapping[s.loop_end]
            graph[mapping[b]] = copy
            new.append(mapping[b])
        deps = []
        if is_link(output_src):
            out = rewrite(output_src)
            if accumulate:
                exit_inputs[f"output{pos}"] = out
            elif pos == n - 1:
                exit_inputs["output0"] = out
            deps.append(out)
        if is_link(next_src):
            carry = rewrite(next_src)
            deps.append(carry)
        deps.extend(rewrite(t) for t in terminations)
    for b in body_order:
        del graph[b]
    graph[eid] = Spec("_LoopExit", {"start": [sid, HANDLE], "accumulate": accumulate, **exit_inputs},
                      after=tuple(d[0] for d in deps), cache=False, origin=eid)
    new.append(eid)
    info = {"start": sid, "end": eid, "iterations": n, "body": sorted(body), "cache_iterations": flag,
            "projected_nodes": len(new)}
    return new, list(body_order), info

