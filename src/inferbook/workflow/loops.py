"""Generic loops: paired StartLoop / EndLoop, projected into ordinary nodes.

ComfyUI v0.36.0's Generic Loops (#16227) pair a Start Loop with an End Loop, iterate a fixed
number of times, over a range or over a list, and carry one value — which may be a mixed list
of images and text — from each iteration to the next. Each iteration is projected into ordinary
scheduled nodes run by the existing queue; `cache_iterations` decides whether iteration bodies
may be reused from the cache; side effects (save, preview) must be wired to the end boundary
so that each iteration completes. This module is our implementation of those rules.

The loop's *body* is every node that depends on the StartLoop and leads to its EndLoop (plus
any inner loop whose EndLoop is in the body). When the StartLoop's own inputs are ready,
`expand` replaces the body by one copy per iteration:

    <start>#i   a _LoopHead: outputs (loop, value, index, item) for iteration i
    <node>#i    a copy of each body node, its links re-pointed into iteration i
    <end>#i     a _LoopTail: the value carried out of iteration i, and the list so far
    <end>       becomes a _LoopExit: the last carried value and the list of all of them

Ids are deterministic ("7#2" is body node 7 in iteration 2; "7#2#1" is the same node in
iteration 1 of an inner loop inside outer iteration 2), and cache keys depend on content,
not ids: a run with one more iteration reuses the iterations it already computed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .executor import Input, Spec, WorkflowError, _where, is_link, links, node

MODES = ("count", "range", "list")


@node("StartLoop", inputs={
    "mode": Input("STRING", default="count", choices=MODES, help="count, range or list"),
    "initial": Input("ANY", optional=True, help="the value carried into iteration 0 (may be a mixed list)"),
    "count": Input("INT", optional=True, help="count mode: number of iterations"),
    "start": Input("INT", default=0, help="range mode: first value"),
    "stop": Input("INT", optional=True, help="range mode: stop (exclusive)"),
    "step": Input("INT", default=1, help="range mode: step, not 0"),
    "items": Input("LIST", optional=True, help="list mode: one iteration per item"),
    "cache_iterations": Input("BOOLEAN", default=True, help="may iteration bodies be reused from the cache"),
    "max_iterations": Input("INT", optional=True, min=0, help="refuse loops longer than this"),
}, outputs=(("loop", "LOOP"), ("value", "ANY"), ("index", "INT"), ("item", "ANY")))
def start_loop(**_):
    """Opens a loop. Never run: the executor projects it (see `expand`)."""
    raise RuntimeError("StartLoop is projected by the executor, never run")


@node("EndLoop", inputs={"loop": "LOOP", "value": "ANY"},
      outputs=(("value", "ANY"), ("collected", "LIST")))
def end_loop(**_):
    """Closes the loop whose handle it receives; `value` is carried to the next iteration.
    Outputs the last carried value and the list of the values of every iteration."""
    raise RuntimeError("EndLoop is replaced by the executor, never run")


@node("_LoopHead", inputs={"value": Input("ANY", optional=True), "index": "INT", "item": Input("ANY", optional=True),
                           "items": Input("LIST", optional=True)},
      outputs=(("loop", "ANY"), ("value", "ANY"), ("index", "INT"), ("item", "ANY")), internal=True)
def loop_head(value, index, item, items):
    """Iteration `index`: the carried value, the index and the current item."""
    return None, value, index, (items[index] if items is not None else item)


@node("_LoopTail", inputs={"value": Input("ANY", optional=True), "collected": "LIST"},
      outputs=(("value", "ANY"), ("collected", "LIST")), internal=True)
def loop_tail(value, collected):
    """The value carried out of one iteration, appended to those before it."""
    return value, collected + [value]


@node("_LoopExit", inputs={"value": Input("ANY", optional=True), "collected": "LIST"},
      outputs=(("value", "ANY"), ("collected", "LIST")), internal=True)
def loop_exit(value, collected):
    """What the EndLoop outputs once every iteration has run."""
    return value, collected


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


def end_of(graph: dict[str, Spec], sid: str) -> str:
    """The EndLoop paired with StartLoop `sid` (exactly one must take its loop handle)."""
    ends = [n for n, s in graph.items() if s.class_type == "EndLoop" and s.inputs.get("loop") == [sid, 0]]
    if not ends:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} has no EndLoop: link an EndLoop's 'loop' input to "
                            f"[{sid!r}, 0]", node=sid)
    if len(ends) > 1:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} is closed by {len(ends)} EndLoops ({', '.join(map(repr, ends))}); "
                            "a loop has exactly one", node=sid)
    return ends[0]


def loop_body(graph: dict[str, Spec], sid: str, rev: dict[str, set[str]] | None = None) -> tuple[str, set[str]]:
    """(end id, body ids) of the loop opened by `sid` in the current graph."""
    rev = _reverse(graph) if rev is None else rev
    eid = end_of(graph, sid)
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
                    _, inner_body = loop_body(graph, inner, rev)
                    body |= {inner} | inner_body
                    changed = True
    return eid, body


@dataclass
class Loop:
    start: str
    end: str
    body: set[str]
    parent: str | None = None


@dataclass
class LoopPlan:
    loops: dict[str, Loop] = field(default_factory=dict)

    def apply_schedule(self, graph: dict[str, Spec]) -> None:
        """An inner StartLoop waits for its outer one, so the outer loop is projected first."""
        for lp in self.loops.values():
            if lp.parent is not None:
                spec = graph[lp.start]
                if lp.parent not in spec.after:
                    spec.after = spec.after + (lp.parent,)


def plan_loops(graph: dict[str, Spec], registry=None) -> LoopPlan:
    """Check every loop of a workflow before anything runs: pairs, crossings, what reads the
    body from outside, and the literal iteration settings. Returns the nesting."""
    rev = _reverse(graph)
    plan = LoopPlan()
    starts = [n for n, s in graph.items() if s.class_type == "StartLoop"]
    for nid, spec in graph.items():
        if spec.class_type == "EndLoop":
            v = spec.inputs.get("loop")
            if not (is_link(v) and graph.get(v[0]) is not None and graph[v[0]].class_type == "StartLoop"):
                raise WorkflowError(f"{_where(nid, 'EndLoop', 'loop')} must link to output 0 of a StartLoop", node=nid,
                                    input="loop")
    for sid in starts:
        check_literal_settings(sid, graph[sid])
        eid, body = loop_body(graph, sid, rev)
        plan.loops[sid] = Loop(sid, eid, body)
    for a in plan.loops.values():
        inside = a.body | {a.start, a.end}
        for n in a.body:                                   # a loop half inside another: crossed pairs
            if graph[n].class_type == "StartLoop" and plan.loops[n].end not in a.body:
                raise WorkflowError(f"loops cross: StartLoop {n!r} is inside loop {a.start!r}..{a.end!r} but its "
                                    f"EndLoop {plan.loops[n].end!r} is not; nest loops whole", node=n)
        for b in plan.loops.values():
            if b is not a and b.start in a.body and a.start in b.body:
                raise WorkflowError(f"loops cross: {a.start!r}..{a.end!r} and {b.start!r}..{b.end!r} each contain the "
                                    "other's StartLoop", node=b.start)
        for nid, spec in graph.items():                    # reading the body from outside it
            if nid in inside:
                continue
            for name, (src, _) in links(spec).items():
                if src in inside and src != a.end:
                    cls = spec.class_type
                    raise WorkflowError(
                        f"{_where(nid, cls, name)} reads node {src!r} inside loop {a.start!r}..{a.end!r} but does not "
                        f"lead to EndLoop {a.end!r}: wire it into the end boundary (route its output into the EndLoop's "
                        f"'value'; save and preview nodes pass their input through for this) or read the loop's result "
                        f"from EndLoop {a.end!r}", node=nid, input=name)
    for b in plan.loops.values():                          # innermost enclosing loop
        enclosing = [a for a in plan.loops.values() if a is not b and b.start in a.body]
        if enclosing:
            b.parent = min(enclosing, key=lambda a: len(a.body)).start
    return plan


def check_literal_settings(sid: str, spec: Spec) -> None:
    """Mode-specific rules for literal inputs (linked ones are checked when the loop expands)."""
    ins = spec.inputs
    mode = ins.get("mode", "count")

    def literal(name):
        v = ins.get(name)
        return None if is_link(v) else v

    if mode == "count":
        if "count" not in ins or ins["count"] is None:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'count')} is required in count mode", node=sid, input="count")
        c = literal("count")
        if c is not None and c < 0:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'count')} must be >= 0, got {c}", node=sid, input="count")
    elif mode == "range":
        if "stop" not in ins or ins["stop"] is None:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'stop')} is required in range mode", node=sid, input="stop")
        if literal("step") == 0:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'step')} must not be 0 (range mode)", node=sid, input="step")
    elif mode == "list":
        if "items" not in ins or ins["items"] is None:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'items')} is required in list mode", node=sid, input="items")


def iterations(sid: str, values: dict) -> tuple[range | list, bool]:
    """The iteration items from StartLoop's resolved inputs (a range stays lazy, so a huge one
    is refused by its length, not by building it). Errors name the node and input."""
    mode = values.get("mode") or "count"
    if mode == "count":
        c = values.get("count")
        if isinstance(c, bool) or not isinstance(c, int):
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'count')} must be an integer, got {c!r}", node=sid, input="count")
        if c < 0:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'count')} must be >= 0, got {c}", node=sid, input="count")
        return range(c), False
    if mode == "range":
        start, stop, step = values.get("start", 0), values.get("stop"), values.get("step", 1)
        for name, v in (("start", start), ("stop", stop), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise WorkflowError(f"{_where(sid, 'StartLoop', name)} must be an integer, got {v!r}", node=sid, input=name)
        if step == 0:
            raise WorkflowError(f"{_where(sid, 'StartLoop', 'step')} must not be 0 (range mode)", node=sid, input="step")
        return range(start, stop, step), False
    items = values.get("items")
    if not isinstance(items, list):
        raise WorkflowError(f"{_where(sid, 'StartLoop', 'items')} must be a list in list mode, got "
                            f"{type(items).__name__}", node=sid, input="items")
    return items, True


def expand(graph: dict[str, Spec], sid: str, values: dict, plan: LoopPlan, registry, *,
           max_iterations: int) -> tuple[list[str], dict]:
    """Project the loop opened by `sid` into ordinary nodes, in place. Returns the new ids (in
    queue order) and a summary. `values` are the StartLoop's resolved inputs."""
    eid, body = loop_body(graph, sid)
    items, is_list = iterations(sid, values)
    limit = max_iterations
    if values.get("max_iterations") is not None:
        limit = min(limit, values["max_iterations"])
    n = len(items)
    if n > limit:
        raise WorkflowError(f"{_where(sid, 'StartLoop')} would run {n} iterations, more than the limit of {limit} "
                            "(StartLoop 'max_iterations', or the executor's max_iterations)", node=sid)
    start_spec, end_spec = graph[sid], graph[eid]
    flag = bool(values.get("cache_iterations", True))
    items_link = start_spec.inputs.get("items") if is_list and is_link(start_spec.inputs.get("items")) else None
    initial = start_spec.inputs.get("initial")
    order = [b for b in graph if b in body]   # file order, so the queue's tie-break stays stable
    new: list[str] = []

    def rewrite(value, mapping):
        return [mapping[value[0]], value[1]] if is_link(value) and value[0] in mapping else value

    for i in range(n):
        hid = f"{sid}#{i}"
        head = {"value": initial if i == 0 else [f"{eid}#{i - 1}", 0], "index": i}
        if items_link is not None:
            head["items"] = items_link
        else:
            head["item"] = items[i]
        graph[hid] = Spec("_LoopHead", head, cache=start_spec.cache and flag, origin=sid)
        new.append(hid)
        mapping = {sid: hid, **{b: f"{b}#{i}" for b in body}}
        for b in order:
            s = graph[b]
            graph[mapping[b]] = Spec(s.class_type, {k: rewrite(v, mapping) for k, v in s.inputs.items()},
                                     after=tuple(mapping.get(a, a) for a in s.after if a != sid),
                                     cache=s.cache and flag, origin=s.origin or b)
            new.append(mapping[b])
        tid = f"{eid}#{i}"
        graph[tid] = Spec("_LoopTail", {"value": rewrite(end_spec.inputs["value"], mapping),
                                        "collected": [] if i == 0 else [f"{eid}#{i - 1}", 1]},
                          cache=end_spec.cache and flag, origin=eid)
        new.append(tid)
    for b in body:
        del graph[b]
    graph[eid] = Spec("_LoopExit", {"value": [f"{eid}#{n - 1}", 0] if n else initial,
                                    "collected": [f"{eid}#{n - 1}", 1] if n else []}, origin=eid)
    new.append(eid)
    info = {"start": sid, "end": eid, "iterations": n, "body": sorted(body), "cache_iterations": flag,
            "projected_nodes": len(new)}
    return new, info
