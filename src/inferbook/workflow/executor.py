"""A workflow executor in the ComfyUI API format: registry, validation, one queue, a cache.

A workflow is a JSON object of nodes::

    {"3": {"class_type": "GenerateSegment", "inputs": {"seed": 7, "context": ["2", 0]}}}

An input is either a literal (a JSON value) or a *link* ``[node_id, output_index]`` to another
node's output. Node classes live in a registry (`REGISTRY`, filled by `@node(...)`), each with
typed inputs and outputs. `Executor.run(workflow)`:

1. validates the whole graph before any node runs (unknown class, missing or extra input, a
   literal of the wrong type, a link to a missing node or output, a type mismatch, a cycle,
   and the loop rules of `loops.py`) and raises `WorkflowError` naming the node and input;
2. runs nodes from one ready queue in topological order (ties broken by the order nodes
   appear in the file, so runs are reproducible);
3. keys every output by a *signature*: a hash of the node's class, its literal inputs and the
   signatures of the outputs it links to, hence of all its ancestors. An unchanged sub-graph
   has an unchanged signature and is taken from the cache on the next run;
4. caches output (side-effect) nodes like any other, as ComfyUI's executor does: an unchanged
   save or preview is not run again, and the events it recorded are re-emitted from the cache
   (ComfyUI re-sends the cached UI output). A node whose spec is `fresh` (ComfyUI: a
   `fingerprint_inputs` of NaN) gets a new signature every run, so it and its descendants run.

A node class with an `expand` hook (`StartLoop`) is not run (and is always fresh): when its own inputs
are ready the queue hands it to the hook (`loops.expand`), which projects every iteration into ordinary
nodes with deterministic ids and puts them on the same queue; its `plan` hook (`loops.plan_loops`) checks
the structure before the run. The executor sits below the node classes it runs: it imports none of them
(`loops.py`, `nodes.py` and the server import it; the package's `__init__` registers the classes).

Bounds: integers fit in 64 bits, JSON nests at most `MAX_JSON_DEPTH` levels, one loop runs at most `max_iterations` and all loops of a run together
at most `max_total_iterations` (checked from literals before anything runs, and again as loops expand).

Nothing here evaluates code from a workflow: it is parsed with `json` and dispatched by
class name through the registry.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError, choices
from ..record import json_depth
from ..words import count

# ---------------------------------------------------------------------------
# Types

# Value types a node input or output can have. ANY accepts and produces anything; LOOP is the
# handle from StartLoop to its EndLoop and only those two nodes use it.
TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "LIST", "IMAGE", "AUDIO", "LATENT", "REFS", "MODEL", "LORA", "LOOP",
         "SAMPLING_PARAMS", "VIDEO_PARAMS", "ANY")
# Types a literal in the JSON may have (the others must come from a link).
LITERAL_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "LIST", "ANY")
RESERVED = "#"  # projected loop nodes are named "<id>#<iteration>"; user ids may not contain it


class WorkflowError(UserError):
    """A workflow that cannot run: names the node, its class and the input, and what is allowed."""

    def __init__(self, message: str, *, node: str | None = None, input: str | None = None):
        self.node, self.input = node, input
        super().__init__(message)


def _where(node_id: str, class_type: str | None = None, input: str | None = None) -> str:
    # ascii(): a name with a newline, an escape sequence or non-ASCII text prints escaped, under any locale
    s = f"node {ascii(node_id)}" + (f" ({class_type})" if class_type else "")
    return s + (f" input {ascii(input)}" if input else "")


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def value_matches(type_: str, value: Any) -> bool:
    """Does a Python value have the workflow type `type_`? (Used for literals and for values
    arriving through an ANY link, where the type is only known when the node runs.)"""
    if type_ == "ANY":
        return True
    if type_ == "INT":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ == "FLOAT":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if type_ == "STRING":
        return isinstance(value, str)
    if type_ == "BOOLEAN":
        return isinstance(value, bool)
    if type_ == "LIST":
        return isinstance(value, list)
    if type_ == "IMAGE":  # frames: float tensor [T, H, W, 3] in [0, 1] (ComfyUI's IMAGE batch)
        import torch
        return isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[-1] == 3
    if type_ == "AUDIO":  # {"waveform": float tensor [C, N], "sample_rate": int}
        return isinstance(value, dict) and "waveform" in value and "sample_rate" in value
    return value is not None


# ---------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Input:
    type: str
    default: Any = None        # None: required
    optional: bool = False     # may be absent (the node receives None)
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    help: str = ""


# Literal integers are bounded as ComfyUI's INT widgets are (signed 64-bit), so that a count, seed or
# size of 10**30 is refused by validation instead of overflowing somewhere inside a node.
INT_BOUND = 2 ** 63 - 1
# JSON nesting deeper than this is refused (Python's json would raise RecursionError near 1000).
MAX_JSON_DEPTH = 64
# What one workflow may ask for. Each is checked before the work it bounds: the file's size and kind before it
# is read, the node count when it is parsed, every value a node produces before the next node sees it, and the
# declared work of a node (frames x steps) before it runs and, from literals, before the run starts.
MAX_FILE_BYTES = 4 * 2 ** 20        # a workflow file (ours are a few kB; ComfyUI's API files rarely pass 1 MB)
MAX_NODES = 10_000                  # nodes in a workflow file
MAX_STRING_CHARS = 1_000_000        # characters of one string value
MAX_VALUE_ITEMS = 100_000           # items of one value, nested lists counted as often as they appear
MAX_TENSOR_ELEMENTS = 2 ** 28       # elements of one tensor value (1 GiB of float32)
MAX_NODE_WORK = 100_000             # declared work units (frames x denoising steps) of one node
MAX_WORKFLOW_WORK = 1_000_000       # the same, summed over one run (loop iterations multiply)
_VARIADIC = Input("ANY", optional=True)


def ascii_index(text: str) -> bool:
    """Is `text` a non-empty run of ASCII digits? (`str.isdigit` also accepts '²', which int() refuses.)"""
    return bool(text) and text.isascii() and text.isdigit()


@dataclass(frozen=True)
class NodeClass:
    """A registered node class: its typed inputs and outputs and the function that runs it."""

    name: str
    inputs: dict[str, Input]
    outputs: tuple[tuple[str, str], ...]    # (name, type)
    fn: Callable[..., tuple]
    side_effect: bool = False
    internal: bool = False                  # made by the executor; a workflow file may not name it
    context: bool = False                   # fn also receives `run=` (a RunContext: output folder, events)
    help: str = ""
    variadic: str | None = None             # inputs named <variadic><k> (k = 0, 1, ...) are accepted as optional ANY
    work: Callable[[dict], int | None] | None = None   # declared work (frames x steps) from its inputs; None: unknown
    # A node class that opens a structure (StartLoop): `plan(graph, registry)` checks the structure before the run
    # and returns its plan; `expand(graph, nid, values, registry, max_iterations=, budget=)` projects it into
    # ordinary nodes instead of running. The executor calls these hooks and never imports the classes.
    plan: Callable | None = None
    expand: Callable | None = None
    # `check(inputs)` raises ValueError for inputs the node would refuse when it runs (None: a linked input, not
    # known yet): called on the literals before the run, so `validate` refuses what `run` would
    check: Callable[[dict], None] | None = None
    # `size(sizes, literals)` predicts its outputs' sizes before the run (`predict_sizes`): `sizes` maps each input
    # to its `value_size` (a literal's, or the predicted size of the output it links to; None: not known before
    # the run), `literals` each input written as a literal or left to its default (a linked input is not in it). Returns one size dict (or None: not known) per output,
    # each a lower bound of what the run will make, or None when nothing is known.
    size: Callable[[dict, dict], tuple | None] | None = None

    def required(self) -> list[str]:
        return [k for k, i in self.inputs.items() if i.default is None and not i.optional]

    def input(self, name: str) -> Input | None:
        """The declared input `name`, or the variadic ANY input it names, or None."""
        if name in self.inputs:
            return self.inputs[name]
        if self.variadic and name.startswith(self.variadic) and ascii_index(name[len(self.variadic):]):
            return _VARIADIC
        return None


REGISTRY: dict[str, NodeClass] = {}


def node(name: str, *, inputs: dict[str, Input | str], outputs: tuple = (), side_effect: bool = False,
         internal: bool = False, context: bool = False, registry: dict | None = None, variadic: str | None = None,
         work: Callable[[dict], int | None] | None = None, plan: Callable | None = None,
         expand: Callable | None = None, check: Callable[[dict], None] | None = None,
         size: Callable[[dict, dict], tuple | None] | None = None):
    """Register `fn` as node class `name`. `inputs`: name -> Input or a bare type name;
    `outputs`: (name, type) pairs. `fn(**inputs)` returns a tuple with one value per output.
    `work(inputs)` declares what a call costs (frames x steps; None while an input is unknown, i.e. linked):
    checked against MAX_NODE_WORK and MAX_WORKFLOW_WORK before the run and again before the node runs."""
    reg = REGISTRY if registry is None else registry
    ins = {k: (v if isinstance(v, Input) else Input(v)) for k, v in inputs.items()}
    for k, i in ins.items():
        if i.type not in TYPES:
            raise TypeError(f"node class {name}: input {k!r} has unknown type {i.type!r}")
    for oname, otype in outputs:
        if otype not in TYPES:
            raise TypeError(f"node class {name}: output {oname!r} has unknown type {otype!r}")

    def deco(fn):
        reg[name] = NodeClass(name=name, inputs=ins, outputs=tuple(outputs), fn=fn, side_effect=side_effect,
                              internal=internal, context=context, variadic=variadic, work=work,
                              plan=plan, expand=expand, check=check, size=size, help=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "")
        return fn
    return deco


# ---------------------------------------------------------------------------
# Parsing


@dataclass
class Spec:
    """One node of a workflow as written (or as projected by a loop)."""

    class_type: str
    inputs: dict[str, Any]
    after: tuple[str, ...] = ()      # scheduling-only dependencies (an inner StartLoop waits for its outer one)
    cache: bool = True                # False: never read from or written to the cache
    origin: str | None = None         # for a projected node: the id it was copied from
    fresh: bool = False               # its signature is new on every run (ComfyUI: fingerprint_inputs -> NaN)
    extra: dict = field(default_factory=dict)   # resolved values handed to fn but keyed by a literal input
    loop_body: tuple[str, ...] | None = None    # StartLoop only: its body ids in file order (from the plan)
    loop_end: str | None = None                 # StartLoop only: its EndLoop id


def describe_inputs(inputs: dict) -> str:
    """A node's inputs as a reader reads them: literals as values, a link as `node.slot` (the JSON
    `["node", slot]` of a workflow file)."""
    return ", ".join(f"{name}={f'{v[0]}.{v[1]}' if is_link(v) else v}" for name, v in inputs.items())


def is_link(value: Any) -> bool:
    """`[node_id, output_index]` (ComfyUI's link form). A literal list shaped like this is a link."""
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], int) and not isinstance(value[1], bool))


def links(spec: Spec) -> dict[str, tuple[str, int]]:
    return {k: (v[0], v[1]) for k, v in spec.inputs.items() if is_link(v)}


def parse_workflow(text: str, *, source: str = "workflow") -> dict[str, Spec]:
    """Parse API-format JSON with `json` (never eval). Malformed JSON raises `WorkflowError`
    with the line and column; the shape of every node is checked (types come in `validate`)."""
    def no_constant(name):  # Python's json reads NaN and Infinity; JSON has neither
        raise WorkflowError(f"{source} contains {name}, which is not a JSON value")

    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise WorkflowError(f"{source} nests JSON {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")
    def no_duplicates(pairs):  # json keeps the last of two equal keys; a second node "3" would silently win
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise WorkflowError(f"{source} has the key {k!r} twice in one object (a node id or input name must "
                                    "be unique)")
            seen.add(k)
        return dict(pairs)

    try:
        data = json.loads(text, parse_constant=no_constant, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise WorkflowError(f"{source} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise WorkflowError(f"{source} nests JSON too deeply to parse") from None
    return workflow_from_dict(data, source=source)


def value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON-like value (lists and dicts), iteratively; stops counting past `limit`."""
    best, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, tuple, dict)):
            best = max(best, d)
            if d > limit:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return best


def load_workflow(path: str | Path) -> dict[str, Spec]:
    """Read a workflow file defensively, through the one bounded reader (`record.read_file_bounded`): a regular
    file only (a FIFO or device would block or never end; opened non-blocking and checked before one byte is
    read), at most MAX_FILE_BYTES (checked before reading, and again while reading), UTF-8."""
    from ..record import read_file_bounded

    path = Path(path)
    name = ascii(str(path))
    try:
        raw = read_file_bounded(path, what="workflow file", max_bytes=MAX_FILE_BYTES)
    except WorkflowError:
        raise
    except UserError as e:
        raise WorkflowError(str(e)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkflowError(f"workflow file {name} is not UTF-8 text (byte {e.start})") from None
    return parse_workflow(text, source=f"workflow file {name}")


def workflow_from_dict(data: Any, *, source: str = "workflow") -> dict[str, Spec]:
    if isinstance(data, dict) and "nodes" in data and "links" in data and isinstance(data["nodes"], list):
        raise WorkflowError(f"{source} is in ComfyUI's UI format (nodes + links); export it in the API format "
                            "(a JSON object of node id -> {class_type, inputs})")
    if not isinstance(data, dict):
        raise WorkflowError(f"{source} must be a JSON object of node id -> node, got {type(data).__name__}")
    if not data:
        raise WorkflowError(f"{source} has no nodes")
    if len(data) > MAX_NODES:
        raise WorkflowError(f"{source} has {len(data)} nodes; at most {MAX_NODES} are allowed")
    depth = value_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise WorkflowError(f"{source} nests values more than {MAX_JSON_DEPTH} levels deep")
    graph = {}
    for nid, body in data.items():
        if RESERVED in nid:
            raise WorkflowError(f"node id {nid!r} contains {RESERVED!r}, which is reserved for loop iterations", node=nid)
        if not isinstance(body, dict):
            raise WorkflowError(f"{_where(nid)} must be an object with 'class_type' and 'inputs', got "
                                f"{type(body).__name__}", node=nid)
        extra = sorted(set(body) - {"class_type", "inputs", "_meta"})
        if extra:
            raise WorkflowError(f"{_where(nid)} has unknown key(s) {extra}; a node has 'class_type', 'inputs' "
                                "and optionally '_meta'", node=nid)
        ct = body.get("class_type")
        if not isinstance(ct, str):
            raise WorkflowError(f"{_where(nid)} lacks a string 'class_type'", node=nid)
        inputs = body.get("inputs", {})
        if not isinstance(inputs, dict):
            raise WorkflowError(f"{_where(nid, ct)}: 'inputs' must be an object, got {type(inputs).__name__}", node=nid)
        graph[nid] = Spec(class_type=ct, inputs=dict(inputs))
    return graph


def as_graph(workflow) -> dict[str, Spec]:
    """Accept a parsed graph, a dict in API format, a JSON string or a path."""
    if isinstance(workflow, dict) and workflow and all(isinstance(v, Spec) for v in workflow.values()):
        return {k: replace(v, inputs=dict(v.inputs), extra=dict(v.extra)) for k, v in workflow.items()}
    if isinstance(workflow, dict):
        if value_depth(workflow) > MAX_JSON_DEPTH:
            raise WorkflowError(f"workflow nests values more than {MAX_JSON_DEPTH} levels deep")
        try:
            copied = json.loads(json.dumps(workflow, allow_nan=False))  # deep copy, JSON values only
        except (TypeError, ValueError) as e:
            raise WorkflowError(f"workflow holds a value that is not JSON: {e}") from None
        return workflow_from_dict(copied)
    if isinstance(workflow, Path):
        return load_workflow(workflow)
    if isinstance(workflow, str):
        if workflow.lstrip().startswith("{"):
            return parse_workflow(workflow)
        return load_workflow(workflow)
    raise WorkflowError(f"a workflow is a JSON object, JSON text or a file path, got {type(workflow).__name__}")


# ---------------------------------------------------------------------------
# Validation (before any node runs)


class NoStructure:
    """The plan of a workflow with no structure-opening node (no loop): nothing to schedule or bound."""

    loops: dict = {}

    def apply_schedule(self, graph) -> None:
        pass

    def check_total(self, limit, per_loop, graph) -> None:
        pass


def validate(graph: dict[str, Spec], registry: dict[str, NodeClass] | None = None):
    """Check every node, input and link, then the graph (cycles) and the structures (loops) through their
    classes' `plan` hook.

    Returns the structure's plan (`loops.LoopPlan` when the workflow has loops, else `NoStructure`). Raises
    `WorkflowError` at the first problem, naming the node id, its class and the input."""
    reg = REGISTRY if registry is None else registry
    for nid, spec in graph.items():
        cls = reg.get(spec.class_type)
        if cls is None or (cls.internal and spec.origin is None):
            public = sorted(k for k, c in reg.items() if not c.internal)
            raise WorkflowError(f"{_where(nid)}: unknown class_type {spec.class_type!r}; known classes are "
                                f"{choices(public)}", node=nid)
        for name in cls.required():
            if name not in spec.inputs:
                raise WorkflowError(f"{_where(nid, cls.name, name)} is missing (required, type {cls.inputs[name].type})",
                                    node=nid, input=name)
        for name, value in spec.inputs.items():
            want = cls.input(name)
            if want is None:
                extra = f" and {cls.variadic}0, {cls.variadic}1, ..." if cls.variadic else ""
                raise WorkflowError(f"{_where(nid, cls.name, name)} is not an input of {cls.name}; its inputs are "
                                    f"{choices(list(cls.inputs))}{extra}", node=nid, input=name)
            if is_link(value):
                src, idx = value
                if src not in graph:
                    raise WorkflowError(f"{_where(nid, cls.name, name)} links to node {src!r}, which does not exist",
                                        node=nid, input=name)
                scls = reg.get(graph[src].class_type)
                if scls is None:
                    continue  # reported when `src` itself is checked
                if not 0 <= idx < len(scls.outputs):
                    raise WorkflowError(
                        f"{_where(nid, cls.name, name)} links to output {idx} of node {src!r} ({scls.name}), which has "
                        f"{count(len(scls.outputs), 'output')}" + (f": {', '.join(f'{i} {n} ({t})' for i, (n, t) in enumerate(scls.outputs))}"
                                                            if scls.outputs else ""), node=nid, input=name)
                have = scls.outputs[idx][1]
                if not (have == want.type or "ANY" in (have, want.type)) or (("LOOP" in (have, want.type)) and have != want.type):
                    raise WorkflowError(f"{_where(nid, cls.name, name)} expects {want.type} but output {idx} of node "
                                        f"{src!r} ({scls.name}) is {have}", node=nid, input=name)
            else:
                if want.type not in LITERAL_TYPES:
                    raise WorkflowError(f"{_where(nid, cls.name, name)} expects {want.type}, which must come from a link "
                                        f"[node_id, output_index]; got the literal {_describe(value)}", node=nid, input=name)
                if want.optional and value is None:
                    continue
                if not value_matches(want.type, value):
                    raise WorkflowError(f"{_where(nid, cls.name, name)} expects {want.type}, got {_describe(value)}",
                                        node=nid, input=name)
                if want.choices is not None and value not in want.choices:
                    raise WorkflowError(f"{_where(nid, cls.name, name)} must be one of {choices(want.choices)}, got "
                                        f"{value!r}", node=nid, input=name)
                check_bounds(want, value, nid, cls.name, name)
    cycle = find_cycle(graph)
    if cycle:
        raise WorkflowError("the workflow has a cycle: " + " -> ".join(cycle + [cycle[0]]) +
                            " (a node cannot depend on its own output; use StartLoop/EndLoop to iterate)", node=cycle[0])
    planners = []
    for spec in graph.values():
        fn = reg[spec.class_type].plan
        if fn is not None and fn not in planners:
            planners.append(fn)
    if len(planners) > 1:
        raise TypeError(f"node classes with {len(planners)} different structure planners in one registry")
    return planners[0](graph, reg) if planners else NoStructure()


def check_bounds(want: Input, value: Any, nid: str, cls_name: str, name: str) -> None:
    """min / max of a number, and the signed 64-bit range of every INT (a literal or a linked value)."""
    if want.type == "INT" and isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_BOUND:
        raise WorkflowError(f"{_where(nid, cls_name, name)} must fit in a signed 64-bit integer (|x| <= 2**63 - 1), "
                            f"got {_describe(value)}", node=nid, input=name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if want.min is not None and value < want.min:
        raise WorkflowError(f"{_where(nid, cls_name, name)} must be >= {want.min:g}, got {value!r}", node=nid, input=name)
    if want.max is not None and value > want.max:
        raise WorkflowError(f"{_where(nid, cls_name, name)} must be <= {want.max:g}, got {_describe(value)}",
                            node=nid, input=name)


def find_cycle(graph: dict[str, Spec]) -> list[str]:
    """One cycle of links (as a list of node ids), or [] when the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    for root in graph:
        if color[root] != WHITE:
            continue
        stack = [(root, iter(sorted({s for s, _ in links(graph[root]).values() if s in graph})))]
        path = [root]
        color[root] = GREY
        while stack:
            nid, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[nid] = BLACK
                stack.pop()
                path.pop()
            elif color[nxt] == GREY:
                return path[path.index(nxt):]
            elif color[nxt] == WHITE:
                color[nxt] = GREY
                path.append(nxt)
                stack.append((nxt, iter(sorted({s for s, _ in links(graph[nxt]).values() if s in graph}))))
    return []


def value_size(value: Any) -> dict:
    """{"items", "chars", "elements", "depth"} of a value a node produced: list/tuple/dict items (a sub-list
    shared by several parents counted once per parent, as anything that walks the value would see it), string
    characters, tensor/array elements and nesting depth. Each container is measured once (memoised by
    identity), so 60 levels of a list holding the previous one twice cost 60 steps, not 2^60."""
    memo: dict[int, tuple[int, int, int, int]] = {}
    keep = []   # containers measured, kept alive so their ids stay unique
    todo = [(value, False)]
    out = (0, 0, 0, 0)

    def leaf(v) -> tuple[int, int, int, int]:
        if isinstance(v, str):
            return 0, len(v), 0, 0
        numel = getattr(v, "numel", None)
        if callable(numel):
            return 0, 0, int(numel()), 0
        size = getattr(v, "size", None)
        if isinstance(size, int) and hasattr(v, "dtype"):
            return 0, 0, size, 0
        return 0, 0, 0, 0

    while todo:
        v, done = todo.pop()
        if not isinstance(v, (list, tuple, dict)):
            continue
        key = id(v)
        if key in memo and not done:
            continue
        kids = list(v.items()) if isinstance(v, dict) else list(v)
        kids = [x for kv in kids for x in (kv if isinstance(v, dict) else (kv,))]
        if not done:
            memo[key] = None  # in progress
            keep.append(v)
            todo.append((v, True))
            todo.extend((k, False) for k in kids if isinstance(k, (list, tuple, dict)) and id(k) not in memo)
            continue
        items, chars, elements, depth = len(v), 0, 0, 0
        for k in kids:
            sub = memo.get(id(k)) if isinstance(k, (list, tuple, dict)) else leaf(k)
            if sub is None:   # a container inside itself: refuse rather than loop
                raise WorkflowError("a value contains itself")
            items, chars, elements = items + sub[0], chars + sub[1], elements + sub[2]
            depth = max(depth, sub[3])
        memo[key] = (min(items, 2 ** 62), min(chars, 2 ** 62), min(elements, 2 ** 62), depth + 1)
    out = memo.get(id(value)) if isinstance(value, (list, tuple, dict)) else leaf(value)
    return dict(zip(("items", "chars", "elements", "depth"), out))


def check_value(value: Any, nid: str, cls_name: str, what: str) -> None:
    """Refuse a value over the per-value bounds (one line naming the node, the size and the bound)."""
    size = value_size(value)
    for key, cap, unit in (("chars", MAX_STRING_CHARS, "characters"), ("items", MAX_VALUE_ITEMS, "list items"),
                           ("elements", MAX_TENSOR_ELEMENTS, "tensor elements"), ("depth", MAX_JSON_DEPTH, "levels")):
        if size[key] > cap:
            raise WorkflowError(f"{_where(nid, cls_name)} {what} holds {size[key]} {unit}; at most {cap} are allowed",
                                node=nid)


SIZE_BOUNDS = (("chars", MAX_STRING_CHARS, "characters"), ("items", MAX_VALUE_ITEMS, "list items"),
               ("elements", MAX_TENSOR_ELEMENTS, "tensor elements"), ("depth", MAX_JSON_DEPTH, "levels"))
SCALAR_TYPES = ("INT", "FLOAT", "BOOLEAN")
_NO_SIZE = {"items": 0, "chars": 0, "elements": 0, "depth": 0}


def topological_order(graph: dict[str, Spec]) -> list[str]:
    """Node ids, each after every node it links to (file order among the ready ones); no recursion. The graph
    is acyclic (`validate` refused cycles); links to missing nodes are ignored."""
    deps = {nid: {s for s, _ in links(spec).values() if s in graph and s != nid} for nid, spec in graph.items()}
    users: dict[str, list[str]] = {nid: [] for nid in graph}
    for nid, ds in deps.items():
        for d in ds:
            users[d].append(nid)
    index = {nid: i for i, nid in enumerate(graph)}
    ready = [(index[n], n) for n, ds in deps.items() if not ds]
    heapq.heapify(ready)
    left = {n: len(ds) for n, ds in deps.items()}
    out = []
    while ready:
        _, nid = heapq.heappop(ready)
        out.append(nid)
        for u in users[nid]:
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, (index[u], u))
    return out


def predict_sizes(graph: dict[str, Spec], registry: dict[str, NodeClass]) -> dict[tuple[str, int], dict]:
    """Before the run: every output's size as far as the graph fixes it (literals, and what linked outputs are
    predicted to hold), through the node classes' `size` hooks; INT / FLOAT / BOOLEAN outputs hold nothing. A
    predicted size is a lower bound of what the run makes (exact where every input is known), so a node whose
    output would be over a per-value bound (`check_value`: characters, list items, tensor elements, nesting) is
    refused here, before anything runs: a chain of 40 string doublings, 60 levels of a list holding the previous
    one twice, 80 levels of nested lists. What a loop makes is not predicted (its outputs are unknown here) and
    stays bounded as the run makes it. Returns {(node id, output index): size}."""
    pred: dict[tuple[str, int], dict] = {}
    for nid in topological_order(graph):
        spec = graph[nid]
        cls = registry.get(spec.class_type)
        if cls is None:
            continue
        for k, (_, otype) in enumerate(cls.outputs):
            if otype in SCALAR_TYPES:
                pred[(nid, k)] = dict(_NO_SIZE)
        if cls.size is None:
            continue
        values = {**{k: i.default for k, i in cls.inputs.items()}, **spec.inputs}
        sizes, literals = {}, {}
        for name, v in values.items():
            if is_link(v):
                sizes[name] = pred.get((v[0], v[1]))
            else:
                sizes[name], literals[name] = (None if v is None else value_size(v)), v
        try:
            outs = cls.size(sizes, literals)
        except ValueError as e:
            raise WorkflowError(f"{_where(nid, cls.name)} would be refused: {e}", node=nid) from None
        for k, size in enumerate(outs or ()):
            if size is None:
                continue
            for key, cap, unit in SIZE_BOUNDS:
                if size.get(key, 0) > cap:
                    raise WorkflowError(f"{_where(nid, cls.name)} output {k} would hold {size[key]} {unit} (predicted "
                                        f"from the graph before the run); at most {cap} are allowed", node=nid)
            pred[(nid, k)] = size
    return pred


def declared_work(cls: "NodeClass", values: dict) -> int | None:
    """The work `cls` declares for these inputs (None: not declared, or an input is not known yet)."""
    if cls.work is None:
        return None
    try:
        return cls.work(values)
    except (TypeError, ValueError):
        return None


def check_work(graph: dict[str, Spec], plan, registry: dict[str, NodeClass], *, per_node: int = MAX_NODE_WORK,
               per_workflow: int = MAX_WORKFLOW_WORK) -> int:
    """Before the run: each node's declared work from its literal inputs, times the literal iteration counts of
    the loops around it, against the per-node and per-workflow caps. Returns the total known."""
    inside: dict[str, int] = {}
    for lp in getattr(plan, "loops", {}).values():
        for n in lp.body:
            inside[n] = inside.get(n, 1) * (lp.count if lp.count is not None else 1)
    total = 0
    for nid, spec in graph.items():
        cls = registry[spec.class_type]
        literals = {k: (None if is_link(v) else v) for k, v in
                    {**{k: i.default for k, i in cls.inputs.items()}, **spec.inputs}.items()}
        if cls.check is not None:
            try:
                cls.check(literals)
            except ValueError as e:
                raise WorkflowError(f"{_where(nid, cls.name)} would be refused: {e}", node=nid) from None
        w = declared_work(cls, literals)
        if w is None:
            continue
        if w > per_node:
            raise WorkflowError(f"{_where(nid, cls.name)} asks for {w} work units (frames x steps); at most {per_node} "
                                "per node", node=nid)
        total += w * inside.get(nid, 1)
        if total > per_workflow:
            raise WorkflowError(f"{_where(nid, cls.name)} brings the workflow to {total} work units (frames x steps, "
                                f"loop iterations multiply); at most {per_workflow} per workflow", node=nid)
    return total


def preflight(graph: dict[str, Spec], registry: dict[str, NodeClass] | None = None, *, max_iterations: int = 1000,
              max_total_iterations: int = 10_000, max_work: int = MAX_WORKFLOW_WORK):
    """Every check a run makes before its first node: `validate`, the loop schedule and iteration limits, the
    declared work. `Executor.run`, `Executor.validate` and `inferbook workflow validate` all call this, so a
    workflow that validates is one that starts."""
    reg = REGISTRY if registry is None else registry
    plan = validate(graph, reg)
    plan.apply_schedule(graph)
    plan.check_total(max_total_iterations, max_iterations, graph)
    check_work(graph, plan, reg, per_workflow=max_work)
    predict_sizes(graph, reg)
    return plan


# ---------------------------------------------------------------------------
# Signatures: the cache key of a node's outputs


def _literal_key(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError):
        raise WorkflowError(f"literal {_describe(value)} is not a JSON value") from None


def signature(spec: Spec, input_sigs: dict[str, tuple[str, int]]) -> str:
    """Hash of the class, the literal inputs and, for each link, the signature of the source
    node and the output index: so it covers every ancestor, and nothing about node ids."""
    body = {"class": spec.class_type, "inputs": {}}
    for name in sorted(spec.inputs):
        v = spec.inputs[name]
        body["inputs"][name] = ({"link": list(input_sigs[name])} if is_link(v) else {"value": _literal_key(v)})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------
# Running


class IterationBudget:
    """Iterations and projected nodes one run may still create, across all loops (nested loops
    multiply: a 1000-iteration loop inside a 1000-iteration loop asks for 1001000 iterations)."""

    def __init__(self, max_iterations: int, max_nodes: int):
        self.max_iterations, self.max_nodes = max_iterations, max_nodes
        self.iterations = self.nodes = 0

    def take(self, sid: str, iterations: int, nodes: int) -> None:
        if self.iterations + iterations > self.max_iterations:
            raise WorkflowError(f"{_where(sid, 'StartLoop')} would bring this run to {self.iterations + iterations} "
                                f"loop iterations in total (nested loops multiply), more than the total limit of "
                                f"{self.max_iterations} (the executor's max_total_iterations)", node=sid)
        if self.nodes + nodes > self.max_nodes:
            raise WorkflowError(f"{_where(sid, 'StartLoop')} would bring this run to {self.nodes + nodes} projected "
                                f"nodes, more than the limit of {self.max_nodes} (the executor's max_projected_nodes)",
                                node=sid)
        self.iterations += iterations
        self.nodes += nodes


@dataclass
class RunContext:
    """What a node may touch besides its inputs: the input and output folders (relative paths in a
    workflow are read from `input_dir`, files are written under `output_dir`), the device and dtype
    models are made on, and the run's event log."""

    output_dir: Path
    input_dir: Path = Path(".")
    device: Any = "cpu"
    dtype: Any = None
    events: list[dict] = field(default_factory=list)
    node_id: str = ""

    def event(self, kind: str, **data) -> None:
        self.events.append({"node": self.node_id, "kind": kind, **data})


@dataclass
class NodeRun:
    id: str
    class_type: str
    status: str            # "ran", "cached", "side_effect"
    seconds: float
    origin: str | None = None


@dataclass
class RunResult:
    """What one `Executor.run` did: outputs by node id, the order, cache hits, timings."""

    outputs: dict[str, tuple]
    log: list[NodeRun]
    signatures: dict[str, str]
    seconds: float
    loops: list[dict] = field(default_factory=list)   # one entry per expanded loop: ids, iterations
    events: list[dict] = field(default_factory=list)  # what side-effect nodes did, in order

    def output(self, node_id: str, index: int = 0) -> Any:
        if node_id not in self.outputs:
            raise KeyError(f"no node {node_id!r} ran in this workflow")
        return self.outputs[node_id][index]

    @property
    def ran(self) -> list[str]:
        return [r.id for r in self.log if r.status in ("ran", "side_effect")]

    @property
    def cached(self) -> list[str]:
        return [r.id for r in self.log if r.status == "cached"]

    @property
    def side_effects(self) -> list[str]:
        return [r.id for r in self.log if r.status == "side_effect"]

    def seconds_by_class(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.log:
            out[r.class_type] = out.get(r.class_type, 0.0) + r.seconds
        return out


class Executor:
    """Runs workflows; keeps the output cache between runs.

    `cache=False` disables caching altogether (every node runs every time).
    `max_iterations` caps the iterations one loop may project (a workflow can lower it
    per loop with StartLoop's `max_iterations` input, not raise it); `max_total_iterations`
    caps the iterations of all loops of one run together (nested loops multiply), and
    `max_projected_nodes` the nodes their projection may create.
    `sync` is called after every node (e.g. `torch.cuda.synchronize`) so node times are
    device times, not launch times.
    """

    def __init__(self, registry: dict[str, NodeClass] | None = None, *, cache: bool = True,
                 max_iterations: int = 1000, max_total_iterations: int = 10_000,
                 max_projected_nodes: int = 200_000, sync: Callable[[], None] | None = None,
                 output_dir: str | Path | None = None, input_dir: str | Path | None = None,
                 device: Any = "cpu", dtype: Any = None, max_work: int = MAX_WORKFLOW_WORK):
        self.registry = REGISTRY if registry is None else registry
        self.use_cache = cache
        self.cache: dict[str, tuple] = {}
        self.max_iterations = max_iterations
        self.max_total_iterations = max_total_iterations
        self.max_projected_nodes = max_projected_nodes
        self.max_work = max_work
        self.sync = sync or (lambda: None)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.input_dir = Path(input_dir) if input_dir is not None else Path.cwd()
        import torch
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else torch.float32

    def clear_cache(self) -> None:
        self.cache.clear()

    def validate(self, workflow) -> dict[str, Spec]:
        """Every check `run` makes before its first node (`preflight`), with this executor's limits."""
        graph = as_graph(workflow)
        self.preflight(graph)
        return graph

    def preflight(self, graph: dict[str, Spec]):
        return preflight(graph, self.registry, max_iterations=self.max_iterations,
                         max_total_iterations=self.max_total_iterations, max_work=self.max_work)

    def run(self, workflow) -> RunResult:
        t_start = time.perf_counter()
        graph = as_graph(workflow)
        self.preflight(graph)
        work_done = 0

        order = {nid: i for i, nid in enumerate(graph)}   # file order breaks ties
        seq = len(order)
        outputs: dict[str, tuple] = {}
        sigs: dict[str, str] = {}
        waiting: dict[str, set[str]] = {}
        dependents: dict[str, set[str]] = {}
        ready: list[tuple[int, str]] = []
        log: list[NodeRun] = []
        loops_log: list[dict] = []
        if self.output_dir is None:
            from ..context import results_dir
            out_dir = results_dir() / "workflow-outputs"
        else:
            out_dir = self.output_dir
        run_ctx = RunContext(output_dir=out_dir, input_dir=self.input_dir, device=self.device, dtype=self.dtype)

        def add_node(nid: str) -> None:
            spec = graph[nid]
            deps = {s for s, _ in links(spec).values()} | set(spec.after)
            pending = {d for d in deps if d not in outputs}
            waiting[nid] = pending
            for d in pending:
                dependents.setdefault(d, set()).add(nid)
            if not pending:
                heapq.heappush(ready, (order[nid], nid))

        for nid in graph:
            add_node(nid)

        def finish(nid: str, outs: tuple, sig: str) -> None:
            outputs[nid] = outs
            sigs[nid] = sig
            for d in sorted(dependents.pop(nid, ())):
                if d in waiting and nid in waiting[d]:
                    waiting[d].discard(nid)
                    if not waiting[d]:
                        heapq.heappush(ready, (order[d], d))

        budget = IterationBudget(self.max_total_iterations, self.max_projected_nodes)
        while ready:
            _, nid = heapq.heappop(ready)
            if nid not in waiting or waiting[nid]:
                continue  # removed by a loop expansion, or re-queued
            del waiting[nid]
            spec = graph[nid]
            cls = self.registry[spec.class_type]
            values = dict(spec.extra)
            input_sigs = {}
            for name, v in spec.inputs.items():
                if is_link(v):
                    src, idx = v
                    values[name] = outputs[src][idx]
                    input_sigs[name] = (sigs[src], idx)
                    want = cls.input(name)
                    if not value_matches(want.type, values[name]):
                        raise WorkflowError(f"{_where(nid, cls.name, name)} expects {want.type} but node {src!r} output "
                                            f"{idx} produced {_describe(values[name])}", node=nid, input=name)
                    check_bounds(want, values[name], nid, cls.name, name)
                else:
                    values[name] = v
            # ComfyUI's StartLoop (and LoopIteration with cache_iterations off) fingerprint as NaN: a key
            # that never equals an earlier one, so they and everything downstream of them run again.
            sig = uuid.uuid4().hex if (spec.fresh or cls.expand is not None) else signature(spec, input_sigs)

            if cls.expand is not None:
                # A loop is not run but projected: new ordinary nodes go on this queue.
                new_ids, removed, info = cls.expand(graph, nid, values, self.registry,
                                                    max_iterations=self.max_iterations, budget=budget)
                loops_log.append(info)
                for k in removed:           # the body as written: replaced by its copies
                    waiting.pop(k, None)
                for k in new_ids:
                    order[k] = seq
                    seq += 1
                for k in new_ids:
                    if k in waiting:   # the EndLoop id is reused for the loop's exit node
                        for d in waiting.pop(k):
                            dependents.get(d, set()).discard(k)
                    add_node(k)
                finish(nid, tuple(None for _ in cls.outputs), sig)
                continue

            for name, inp in cls.inputs.items():
                if name not in values:
                    values[name] = inp.default
            w = declared_work(cls, values)
            if w is not None:   # before the node runs: its own cap, and the run's so far
                if w > MAX_NODE_WORK:
                    raise WorkflowError(f"{_where(nid, cls.name)} asks for {w} work units (frames x steps); at most "
                                        f"{MAX_NODE_WORK} per node", node=nid)
                work_done += w
                if work_done > self.max_work:
                    raise WorkflowError(f"{_where(nid, cls.name)} brings this run to {work_done} work units (frames x "
                                        f"steps); at most {self.max_work} per workflow", node=nid)
            # Output (side-effect) nodes are cached like any other node, as in ComfyUI's executor: an
            # unchanged SaveVideo or Preview is not run again; what it showed is re-emitted from the cache.
            use_cache = self.use_cache and spec.cache
            t0 = time.perf_counter()
            if use_cache and sig in self.cache:
                outs, events = self.cache[sig]
                status = "cached"
                for e in events:
                    run_ctx.events.append({**e, "node": nid, "cached": True})
            else:
                if cls.context:
                    run_ctx.node_id = nid
                    values["run"] = run_ctx
                first_event = len(run_ctx.events)
                try:
                    outs = cls.fn(**values)
                except WorkflowError:
                    raise
                except (ValueError, TypeError, OSError, RuntimeError, KeyError, IndexError, ImportError,
                        OverflowError, MemoryError) as e:
                    raise WorkflowError(f"{_where(nid, cls.name)} failed: {e}", node=nid) from e
                self.sync()
                if not isinstance(outs, tuple) or len(outs) != len(cls.outputs):
                    raise TypeError(f"node class {cls.name} returned {type(outs).__name__} "
                                    f"of length {len(outs) if hasattr(outs, '__len__') else '?'}, "
                                    f"expected a tuple of {len(cls.outputs)}")
                for k, v in enumerate(outs):   # bounded before any other node sees it
                    check_value(v, nid, cls.name, f"output {k}")
                status = "side_effect" if cls.side_effect else "ran"
                if use_cache:
                    self.cache[sig] = (outs, [dict(e) for e in run_ctx.events[first_event:]])
            log.append(NodeRun(nid, cls.name, status, time.perf_counter() - t0, spec.origin))
            finish(nid, outs, sig)

        if waiting:  # only possible with a bug in loop projection: say so plainly
            raise RuntimeError(f"workflow stalled with nodes waiting: {sorted(waiting)[:10]}")
        return RunResult(outputs=outputs, log=log, signatures=sigs, seconds=time.perf_counter() - t_start,
                         loops=loops_log, events=run_ctx.events)


def run_workflow(workflow, **kwargs) -> RunResult:
    """Validate and run once with a fresh executor."""
    return Executor(**kwargs).run(workflow)
