"""RunRecord: what ran, where, how — and when two runs may be set side by side.

A record is plain JSON (versioned by `SCHEMA`). One chapter run writes one results file
holding a list of records: `_build/results/<chapter>.json` for local runs,
`data/results/<hardware-slug>/<chapter>.json` for committed reference runs.

The seed's checklist ("commit, model revision, quantization format, hardware, request
lengths, real backend; for video also frames, resolution, steps and audio") is the
`workload` schema below plus the `git`, `hardware` and `backends` fields.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from .errors import IncomparableRecords, UserError

SCHEMA = 1

# The seed's checklist, as workload fields. Values are free-form but named the same everywhere.
CHECKLIST = {
    "model": "model name or architecture (ours are small, defined here)",
    "model_revision": "weights file hash or training command",
    "quantization": "weight/activation format, e.g. 'none (bf16)', 'w4a16 g32', 'int8 weight-only'",
    "input_len": "prompt tokens per request",
    "output_len": "generated tokens per request",
    "batch": "requests or sequences per step",
    "frames": "video frames",
    "resolution": "video width x height",
    "steps": "sampling steps",
    "audio": "audio track: codec, sample rate, channels",
}
# Fields whose difference makes two records incomparable.
_COMPARABILITY_WORKLOAD = ("model", "model_revision", "quantization", "input_len", "output_len",
                           "batch", "frames", "resolution", "steps", "audio", "dtype", "shapes")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """One measured configuration of one chapter.

    `variant` names what this record is one side of (e.g. 'eager' vs 'compiled', 'old' vs
    'new commit'); it is the difference a comparison is *about*, so it may differ.
    Everything else that shapes the numbers — hardware, quantization, topology, workload,
    the backend chosen for each operation and the local shapes it saw — must match.
    """

    chapter: str
    name: str
    variant: str = ""
    created: str = field(default_factory=_now)
    git: dict = field(default_factory=dict)          # {"commit": str, "dirty": bool}
    packages: dict = field(default_factory=dict)     # {"torch": ..., "triton": ..., ...}
    hardware: dict = field(default_factory=dict)     # device.hardware_info()
    device: str = ""
    preset: str = ""
    parameters: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)     # CHECKLIST keys, plus chapter-specific ones
    topology: dict = field(default_factory=dict)     # {"tp": 4, "ep": 1, "ranks": 1, ...}
    backends: dict = field(default_factory=dict)     # op -> {"backend", "reason", "shapes", "dtype"}
    measurements: list = field(default_factory=list)  # [{"name", "value", "unit", "phase", ...}]
    checks: list = field(default_factory=list)        # [{"name", "passed", "error", "tolerance"}]
    source: str = "measured"                          # or "quoted: <where>" for a seed's numbers
    notes: str = ""
    schema: int = SCHEMA

    # -- filling in -------------------------------------------------------------
    def set_backend(self, op: str, backend: str, *, reason: str = "", shapes: dict | None = None,
                    dtype: str | None = None) -> None:
        """Record the backend actually selected for `op` and the local tensor shapes it saw."""
        entry = {"backend": backend, "reason": reason, "shapes": _jsonable(shapes or {})}
        if dtype is not None:
            entry["dtype"] = dtype
        self.backends[op] = entry

    def add(self, name: str, value: float, unit: str, *, phase: str = "steady", **extra) -> None:
        """Add one measured number. `phase`: cold_start, load, steady, ttft, decode, total, ..."""
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"measurement {name!r} is NaN")
        self.measurements.append({"name": name, "value": float(value), "unit": unit, "phase": phase,
                                  **_jsonable(extra)})

    def add_timing(self, name: str, timing, *, phase: str = "steady", **extra) -> None:
        """Add a `measure.Timing` as seconds (median) with its p10/p90/n and the samples themselves,
        so `measure.compare_timings` can compare two records' numbers with the run's own spread."""
        s = timing.summary()
        self.add(name, s.pop("median_s"), "s", phase=phase, **s, samples_s=list(timing.samples_s), **extra)

    def add_check(self, name: str, passed: bool, *, error: float | None = None,
                  tolerance: float | None = None, **extra) -> None:
        self.checks.append({"name": name, "passed": bool(passed), "error": error, "tolerance": tolerance,
                            **_jsonable(extra)})

    def get(self, name: str, phase: str | None = None) -> dict:
        for m in self.measurements:
            if m["name"] == name and (phase is None or m["phase"] == phase):
                return m
        raise KeyError(f"record {self.name!r} has no measurement {name!r}" + (f" in phase {phase!r}" if phase else ""))

    def value(self, name: str, phase: str | None = None) -> float:
        return self.get(name, phase)["value"]

    # -- (de)serialising -------------------------------------------------------
    def to_dict(self) -> dict:
        return _jsonable(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "RunRecord":
        if not isinstance(d, dict):
            raise UserError(f"a run record must be a JSON object, got {type(d).__name__}")
        schema = d.get("schema")
        if schema != SCHEMA:
            raise UserError(f"run record schema {schema!r} is not supported (this inferbook reads schema {SCHEMA})")
        known = {f.name for f in fields(cls)}
        missing = {"chapter", "name"} - d.keys()
        if missing:
            raise UserError(f"run record lacks required field(s) {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in known})


def _jsonable(x: Any) -> Any:
    """Turn tuples, torch sizes/dtypes and numpy scalars into plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, bool, int)) or x is None:
        return x
    if isinstance(x, float):
        return x
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 0) == 0:
        return x.item()
    if hasattr(x, "__iter__"):
        return [_jsonable(v) for v in x]
    return str(x)


# ---------------------------------------------------------------------------
# Files: one results file = a list of records. Written atomically.

def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    The temporary file sits in the same folder (same filesystem) and is fsync'ed before
    `os.replace`, which is atomic on POSIX. A crash at any point leaves the previous
    file intact; the temporary file is removed on error.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise
    return path


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def save_records(path: str | os.PathLike, records: Iterable[RunRecord]) -> Path:
    records = list(records)
    chapters = {r.chapter for r in records}
    return write_json_atomic(path, {"inferbook_results": SCHEMA,
                                    "chapter": chapters.pop() if len(chapters) == 1 else None,
                                    "records": [r.to_dict() for r in records]})


def load_records(path: str | os.PathLike) -> list[RunRecord]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no results file at {str(path)!r}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"results file {str(path)!r} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    if isinstance(data, dict) and "records" in data:
        return [RunRecord.from_dict(d) for d in data["records"]]
    if isinstance(data, dict):
        return [RunRecord.from_dict(data)]
    raise UserError(f"results file {str(path)!r} holds neither a record nor a list of records")


# ---------------------------------------------------------------------------
# compare(): a side-by-side table, or a refusal that says why.

def _hardware_key(r: RunRecord) -> str:
    h = r.hardware or {}
    if h.get("device_type") == "cuda":
        return f"{h.get('gpu_name')}"
    return f"CPU {h.get('cpu_model')} x{h.get('cpu_cores')}"


def comparability(a: RunRecord, b: RunRecord) -> list[str]:
    """Reasons `a` and `b` must not be compared as if equal (empty list: comparable)."""
    reasons = []
    if a.chapter != b.chapter:
        reasons.append(f"chapter differs: {a.chapter!r} vs {b.chapter!r}")
    if _hardware_key(a) != _hardware_key(b):
        reasons.append(f"hardware differs: {_hardware_key(a)} vs {_hardware_key(b)}")
    for key in _COMPARABILITY_WORKLOAD:
        va, vb = a.workload.get(key), b.workload.get(key)
        if va != vb:
            label = "quantization" if key == "quantization" else f"workload {key!r}"
            reasons.append(f"{label} differs: {va!r} vs {vb!r}")
    if a.topology != b.topology:
        diff = sorted(k for k in set(a.topology) | set(b.topology) if a.topology.get(k) != b.topology.get(k))
        reasons.append("topology differs: " + ", ".join(f"{k} {a.topology.get(k)!r} vs {b.topology.get(k)!r}" for k in diff))
    for op in sorted(set(a.backends) | set(b.backends)):
        ea, eb = a.backends.get(op), b.backends.get(op)
        if ea is None or eb is None:
            reasons.append(f"backend for {op!r} recorded on one side only")
        elif ea.get("backend") != eb.get("backend"):
            reasons.append(f"backend for {op!r} differs: {ea.get('backend')!r} vs {eb.get('backend')!r}")
        elif ea.get("shapes") != eb.get("shapes"):
            reasons.append(f"local shapes for {op!r} differ: {ea.get('shapes')} vs {eb.get('shapes')}")
    units_a = {(m["name"], m["phase"]): m["unit"] for m in a.measurements}
    for m in b.measurements:
        ua = units_a.get((m["name"], m["phase"]))
        if ua is not None and ua != m["unit"]:
            reasons.append(f"unit of {m['name']!r} differs: {ua!r} vs {m['unit']!r}")
    if a.source != "measured" or b.source != "measured":
        if a.source != b.source:
            reasons.append(f"source differs: {a.source!r} vs {b.source!r}")
    return reasons


@dataclass
class Comparison:
    a: RunRecord
    b: RunRecord
    rows: list[dict]           # metric, phase, unit, a, b, b/a
    context: list[str]         # differences that are allowed but worth seeing (commit, versions)

    def table(self):
        """A pandas DataFrame when pandas is present, else the list of rows."""
        try:
            import pandas as pd
        except ImportError:
            return self.rows
        return pd.DataFrame(self.rows)


def compare(a: RunRecord, b: RunRecord) -> Comparison:
    """Side-by-side measurements of two comparable records; `IncomparableRecords` otherwise.

    The ratio column is b / a. Allowed differences (variant, commit, package versions)
    are listed in `context` so the table never hides them.
    """
    reasons = comparability(a, b)
    if reasons:
        raise IncomparableRecords(reasons)
    rows = []
    b_by_key = {(m["name"], m["phase"]): m for m in b.measurements}
    for m in a.measurements:
        mb = b_by_key.get((m["name"], m["phase"]))
        if mb is None:
            continue
        ratio = mb["value"] / m["value"] if m["value"] else math.nan
        rows.append({"metric": m["name"], "phase": m["phase"], "unit": m["unit"],
                     a.variant or a.name: m["value"], b.variant or b.name: mb["value"], "b/a": ratio})
    context = []
    if a.variant != b.variant:
        context.append(f"variant: {a.variant!r} vs {b.variant!r}")
    if a.git != b.git:
        context.append(f"git: {a.git} vs {b.git}")
    for pkg in sorted(set(a.packages) | set(b.packages)):
        if a.packages.get(pkg) != b.packages.get(pkg):
            context.append(f"{pkg}: {a.packages.get(pkg)} vs {b.packages.get(pkg)}")
    return Comparison(a=a, b=b, rows=rows, context=context)
