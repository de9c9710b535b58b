"""Workflow files as a careless or hostile user writes them: each refused with exit 2 and one line naming the
value and what is allowed, before the work it would cost (no traceback, no hang, nothing written)."""
import json
import os

import pytest

from inferbook.workflow import cli
from inferbook.workflow.executor import MAX_FILE_BYTES
from inferbook.workflow.loops import content_key


def chain(n, cls, inputs_of):
    g = {"0": {"class_type": "Int", "inputs": {"value": 1}}} if cls == "MakeList" else \
        {"0": {"class_type": "String", "inputs": {"value": "ab"}}}
    for i in range(1, n + 1):
        g[str(i)] = {"class_type": cls, "inputs": inputs_of(str(i - 1))}
    return g


def nested_loops(n):
    g = {}
    for i in range(n):
        g[f"s{i}"] = {"class_type": "StartLoop", "inputs": {"num_iterations": 1,
                                                             **({"parent_iteration": [f"s{i - 1}", 0]} if i else {})}}
    for i in reversed(range(n)):
        g[f"e{i}"] = {"class_type": "EndLoop", "inputs": {"loop": [f"s{i}", 5], "output_value":
                                                           [f"e{i + 1}", 0] if i + 1 < n else [f"s{i}", 0]}}
    return g


SCENE = {"c": {"class_type": "ToyScene", "inputs": {"width": 32, "height": 32, "prompt": "x"}}}
LOOP = lambda n, body: {"s": {"class_type": "StartLoop", "inputs": {"num_iterations": n}},  # noqa: E731
                        **body, "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 5], "output_value": ["g", 0]}}}
deep_value = 1
for _ in range(200):
    deep_value = [deep_value]

# (id, file content: str, bytes, dict, or a special kind; expected text; refused already by `validate`)
CASES = [
    ("duplicate-node-id", '{"1": {"class_type": "Int", "inputs": {"value": 1}}, '
                          '"1": {"class_type": "Int", "inputs": {"value": 2}}}', "the key '1' twice", True),
    ("duplicate-input", '{"1": {"class_type": "Int", "inputs": {"value": 1, "value": 2}}}', "the key 'value' twice",
     True),
    ("superscript-digit", {"s": {"class_type": "StartLoop", "inputs": {}},
                           "1": {"class_type": "EndLoop", "inputs": {"loop": ["s", 5], "termination\u00b2": ["s", 0]}}},
     "'termination\\xb2' is not an input of EndLoop", True),
    ("nesting-200", {"1": {"class_type": "Preview", "inputs": {"value": deep_value}}}, "at most 64 are allowed", True),
    ("fifo", "FIFO", "is a FIFO; only regular files are read", True),
    ("dev-zero", "/dev/zero", "is a device; only regular files are read", True),
    ("folder", "DIR", "is a folder, not a file", True),
    ("too-big", "BIG", f"at most {MAX_FILE_BYTES} are read", True),
    ("not-utf8", b'{"1": {"class_type": "String", "inputs": {"value": "\xff"}}}', "is not UTF-8", True),
    ("too-many-nodes", {str(i): {"class_type": "Int", "inputs": {"value": i}} for i in range(10_001)},
     "at most 10000 are allowed", True),
    ("segment-frames-x-steps", {**SCENE, "g": {"class_type": "GenerateSegment", "inputs": {
        "context": ["c", 0], "prompt": "x", "frames": 10_000, "steps": 10_000}}}, "at most 100000 per node", True),
    ("workflow-work-cap", {**LOOP(500, {"g": {"class_type": "GenerateSegment", "inputs": {
        "context": ["c", 0], "prompt": "x", "frames": 100, "steps": 100, "index": ["s", 0]}}}), **SCENE}, "at most 1000000 per workflow",
     True),
    ("loop-too-long", {"s": {"class_type": "StartLoop", "inputs": {"num_iterations": 5000}},
                       "e": {"class_type": "EndLoop", "inputs": {"loop": ["s", 5], "output_value": ["s", 0]}}},
     "more than the limit of 1000", True),
    ("nested-loops-multiply", {"a": {"class_type": "StartLoop", "inputs": {"num_iterations": 200}},
                               "b": {"class_type": "StartLoop", "inputs": {"num_iterations": 200,
                                                                           "parent_iteration": ["a", 0]}},
                               "eb": {"class_type": "EndLoop", "inputs": {"loop": ["b", 5], "output_value": ["b", 0]}},
                               "ea": {"class_type": "EndLoop", "inputs": {"loop": ["a", 5], "output_value": ["eb", 0]}}},
     "more than the total limit of 10000", True),
    ("format-text-doubling", chain(40, "FormatText", lambda p: {"template": "{}{}", "value": [p, 0]}),
     "at most 1000000 are allowed", True),
    ("shared-makelist-60", chain(60, "MakeList", lambda p: {"a": [p, 0], "b": [p, 0]}), "at most 100000 are allowed",
     True),
    ("value-depth-at-run", {**chain(80, "MakeList", lambda p: {"a": [p, 0]}),
                            "p": {"class_type": "Preview", "inputs": {"value": ["80", 0]}}}, "at most 64 are allowed",
     True),
    ("nan-constant", '{"1": {"class_type": "Float", "inputs": {"value": NaN}}}', "not a JSON value", True),
]


def _write(tmp_path, content):
    if content == "FIFO":
        p = tmp_path / "wf.json"
        os.mkfifo(p)
        return p
    if content == "DIR":
        (tmp_path / "wf.json").mkdir()
        return tmp_path / "wf.json"
    if content == "BIG":
        p = tmp_path / "wf.json"
        p.write_text(" " * (MAX_FILE_BYTES + 1) + "{}")
        return p
    if isinstance(content, str) and content.startswith("/dev/"):
        return content
    p = tmp_path / "wf.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_workflow_exits_2_with_one_line(case, command, tmp_path, capsys):
    _, content, expected, static = case
    if command == "validate" and not static:
        pytest.skip("bounded while running: a value's size is known when it is made")
    path = _write(tmp_path, content)
    out_dir = tmp_path / "out"
    argv = [command, str(path)] + (["--output-dir", str(out_dir), "--device", "cpu"] if command == "run" else [])
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expected in err[0], err
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_content_key_of_shared_lists_is_memoised():
    v = 1
    for _ in range(60):
        v = [v, v]            # 2^60 leaves if walked naively
    assert content_key(v) == content_key(v) and content_key(v) != content_key([v])
    assert content_key([[1, 2], [1, 2]]) == content_key([[1, 2]] * 2)
