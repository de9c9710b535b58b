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
    "model_revision": "hash of the weights' tensors (record.tensors_revision) or the init/training command",
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
                           "batch", "frames", "resolution", "steps", "audio", "dtype", "shapes",
                           # settings that change results, wherever a chapter records them in its workload
                           "determinism", "deterministic", "prefix_caching", "cuda_graphs", "attention_backend")
# Run-time settings (`RunRecord.runtime`, filled by Context.new_record) that change results: a pair that
# differs in one is refused. A key one side lacks (records older than the field) is not compared.
_COMPARABILITY_RUNTIME = ("deterministic_algorithms", "cudnn_deterministic", "cudnn_benchmark",
                          "tf32_matmul", "cuda_graphs", "prefix_caching", "attention_backend")
# Machine facts beyond the device name that change results on a GPU (driver and CUDA version).
_COMPARABILITY_HARDWARE = ("driver", "cuda_runtime")

# Two axes of phases, as the seed names them: where in the process's life a number was taken
# (cold start, model load, steady state), and within the steady state which part of a request
# (time to first token, decode, total). `add(phase=...)` keeps the chapter's own phase name and
# derives both axes from it; records written before the axes existed get them derived on load.
LIFECYCLE = ("cold_start", "load", "steady")
REQUEST_PHASES = ("ttft", "prefill", "decode", "total")
_LIFECYCLE_OF = {"cold_start": "cold_start", "compile": "cold_start", "load": "load"}


def phase_axes(phase: str, lifecycle: str | None = None) -> dict:
    """{'lifecycle': ..., 'request_phase': ...} for a measurement's `phase` (request_phase only
    for ttft / prefill / decode / total)."""
    out = {"lifecycle": lifecycle or _LIFECYCLE_OF.get(phase, "steady")}
    if phase in REQUEST_PHASES:
        out["request_phase"] = phase
    return out


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
    runtime: dict = field(default_factory=dict)      # settings that change results: determinism, CUDA graphs, ...
    measurements: list = field(default_factory=list)  # [{"name", "value", "unit", "phase", ...}]
    checks: list = field(default_factory=list)        # [{"name", "passed", "error", "tolerance"}]
    source: str = "measured"                          # or "quoted: <where>" for a seed's numbers
    notes: str = ""
    schema: int = SCHEMA

    # -- filling in -------------------------------------------------------------
    def _changed(self) -> None:
        """Tell the context that made this record (it saves records as they fill in)."""
        listener = self.__dict__.get("_on_change")
        if listener is not None:
            listener(self)

    def set_backend(self, op: str, backend: str, *, reason: str = "", shapes: dict | None = None,
                    dtype: str | None = None, observed: bool | None = None) -> None:
        """Record the backend actually selected for `op` and the local tensor shapes it saw.
        `observed=True`: seen running (e.g. `inferbook.sdpa.observed_sdpa_kernel`), not taken from configuration."""
        entry = {"backend": backend, "reason": reason, "shapes": _jsonable(shapes or {})}
        if observed is not None:
            entry["observed"] = bool(observed)
        if dtype is not None:
            entry["dtype"] = dtype
        self.backends[op] = entry
        self._changed()

    def add(self, name: str, value: float, unit: str, *, phase: str = "steady", lifecycle: str | None = None,
            **extra) -> None:
        """Add one measured number. `phase`: cold_start, load, steady, ttft, decode, total, or a chapter's
        own name; `lifecycle` (cold_start / load / steady) defaults to what `phase` implies, so the TTFT
        of the first request after load is `add("ttft", t, "s", phase="ttft", lifecycle="cold_start")`."""
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"measurement {name!r} is NaN")
        if lifecycle is not None and lifecycle not in LIFECYCLE:
            raise ValueError(f"lifecycle {lifecycle!r} is not one of {LIFECYCLE}")
        self.measurements.append({"name": name, "value": float(value), "unit": unit, "phase": phase,
                                  **phase_axes(phase, lifecycle), **_jsonable(extra)})
        self._changed()

    def select(self, *, lifecycle: str | None = None, request_phase: str | None = None) -> list[dict]:
        """Measurements on one or both phase axes (derived for records older than the axes)."""
        out = []
        for m in self.measurements:
            axes = {**phase_axes(m["phase"]), **{k: m[k] for k in ("lifecycle", "request_phase") if k in m}}
            if (lifecycle is None or axes["lifecycle"] == lifecycle) and \
                    (request_phase is None or axes.get("request_phase") == request_phase):
                out.append(m)
        return out

    def add_timing(self, name: str, timing, *, phase: str = "steady", **extra) -> None:
        """Add a `measure.Timing` as seconds (median) with its p10/p90/n and the samples themselves,
        so `measure.compare_timings` can compare two records' numbers with the run's own spread."""
        s = timing.summary()
        self.add(name, s.pop("median_s"), "s", phase=phase, **s, samples_s=list(timing.samples_s), **extra)

    def add_check(self, name: str, passed: bool, *, error: float | None = None,
                  tolerance: float | None = None, **extra) -> None:
        self.checks.append({"name": name, "passed": bool(passed), "error": error, "tolerance": tolerance,
                            **_jsonable(extra)})
        self._changed()

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
    def from_dict(cls, d: dict, where: str = "") -> "RunRecord":
        """A record from its JSON object, every field's type checked: one UserError line naming the
        field (and `where`, e.g. 'r.json record 2') for anything malformed."""
        at = f"{where}: " if where else ""
        if not isinstance(d, dict):
            raise UserError(f"{at}a run record must be a JSON object, got {type(d).__name__}")
        schema = d.get("schema")
        if schema != SCHEMA or isinstance(schema, bool):
            raise UserError(f"{at}run record schema {schema!r} is not supported (this inferbook reads schema {SCHEMA})")
        known = {f.name for f in fields(cls)}
        missing = {"chapter", "name"} - d.keys()
        if missing:
            raise UserError(f"{at}run record lacks required {'field' if len(missing) == 1 else 'fields'} {sorted(missing)}")
        _validate(d, at)
        return cls(**{k: v for k, v in d.items() if k in known})


_STR_FIELDS = ("chapter", "name", "variant", "created", "device", "preset", "source", "notes")
_DICT_FIELDS = ("git", "packages", "hardware", "parameters", "workload", "topology", "backends", "runtime")


def _validate(d: dict, at: str) -> None:
    def bad(what: str, value, want: str):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise UserError(f"{at}run record field {what} must be {want}, got {shown} ({type(value).__name__})")

    for k in _STR_FIELDS:
        if k in d and not isinstance(d[k], str):
            bad(repr(k), d[k], "a string")
    if not d["chapter"] or not d["name"]:
        raise UserError(f"{at}run record fields 'chapter' and 'name' must not be empty")
    for k in _DICT_FIELDS:
        if k in d and not isinstance(d[k], dict):
            bad(repr(k), d[k], "an object")
    hw = d.get("hardware")
    if hw is not None and d.get("source", "measured") == "measured":
        dt = hw.get("device_type")
        if dt not in ("cpu", "cuda"):
            bad("'hardware.device_type'", dt, "'cpu' or 'cuda'")
        need = ("gpu_name",) if dt == "cuda" else ("cpu_model",)
        for k in need:
            if not isinstance(hw.get(k), str) or not hw.get(k):
                bad(f"'hardware.{k}'", hw.get(k), "a non-empty string")
    elif hw is not None and "device_type" in hw and hw["device_type"] not in ("cpu", "cuda"):
        bad("'hardware.device_type'", hw["device_type"], "'cpu' or 'cuda'")
    scalar = (str, int, float, bool, type(None))
    for k in ("git", "packages"):
        for sub, v in (d.get(k) or {}).items():
            if not isinstance(v, scalar):
                bad(f"'{k}.{sub}'", v, "a string, number, boolean or null")
    for op, e in (d.get("backends") or {}).items():
        if not isinstance(e, dict) or not isinstance(e.get("backend"), str):
            bad(f"'backends.{op}'", e, "an object with a string 'backend'")
    for key, item_fields in (("measurements", {"name": str, "unit": str, "phase": str}),
                             ("checks", {"name": str, "passed": bool})):
        items = d.get(key, [])
        if not isinstance(items, list):
            bad(repr(key), items, "a list")
        for i, m in enumerate(items):
            if not isinstance(m, dict):
                bad(f"'{key}[{i}]'", m, "an object")
            for f, t in item_fields.items():
                if not isinstance(m.get(f), t):
                    bad(f"'{key}[{i}].{f}'", m.get(f), f"a {'boolean' if t is bool else 'string'}")
            for f in ("lifecycle", "request_phase") if key == "measurements" else ():
                if f in m and not isinstance(m[f], str):
                    bad(f"'{key}[{i}].{f}'", m[f], "a string")
            for f in ("error", "tolerance") if key == "checks" else ():
                v = m.get(f)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    bad(f"'{key}[{i}].{f}'", v, "a number or null")
            if key == "measurements":
                v = m.get("value")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    bad(f"'measurements[{i}].value'", v, "a finite number")
                if "samples_s" in m and not (isinstance(m["samples_s"], list) and all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                        for x in m["samples_s"])):
                    bad(f"'measurements[{i}].samples_s'", m["samples_s"], "a list of finite numbers")


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

RESULT_FILE_MODE = 0o644


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
        os.fchmod(fd, RESULT_FILE_MODE)  # mkstemp makes 0600; results are shared, committed, served
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


PARTIAL_SUFFIX = ".partial.json"


def partial_path(path: str | os.PathLike) -> Path:
    """Where the run that will replace `path` keeps its records until it completes:
    `<chapter>.json` -> `<chapter>.partial.json`, beside it."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        return path
    stem = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    return path.with_name(stem + PARTIAL_SUFFIX)


def is_partial_path(path: str | os.PathLike) -> bool:
    return Path(path).name.endswith(PARTIAL_SUFFIX)


def complete_path(path: str | os.PathLike) -> Path:
    """The good file a partial one stands beside: `<chapter>.partial.json` -> `<chapter>.json`."""
    path = Path(path)
    if not is_partial_path(path):
        return path
    return path.with_name(path.name[:-len(PARTIAL_SUFFIX)] + ".json")


def _results_payload(records: list[RunRecord], complete: bool) -> dict:
    chapters = {r.chapter for r in records}
    return {"inferbook_results": SCHEMA, "chapter": chapters.pop() if len(chapters) == 1 else None,
            "complete": bool(complete), "records": [r.to_dict() for r in records]}


def save_partial(path: str | os.PathLike, records: Iterable[RunRecord]) -> Path:
    """Save the records of a run still in progress (or stopped) to `partial_path(path)`, atomically,
    marked `"complete": false`. `path` itself, the last complete run, is never touched."""
    return write_json_atomic(partial_path(path), _results_payload(list(records), False))


def save_complete(path: str | os.PathLike, records: Iterable[RunRecord]) -> Path:
    """Replace `path` with the records of a run that completed (atomically: temp + fsync + os.replace),
    then remove its partial file. Returns `path`."""
    path = complete_path(path)
    out = write_json_atomic(path, _results_payload(list(records), True))
    with _suppress():
        os.unlink(partial_path(path))
    return out


def save_records(path: str | os.PathLike, records: Iterable[RunRecord], *, complete: bool = True) -> Path:
    """`save_complete(path, records)`, or with `complete=False` `save_partial(path, records)` (which
    writes `<chapter>.partial.json` beside `path` and returns that path)."""
    return save_complete(path, records) if complete else save_partial(path, records)


MAX_RESULTS_BYTES = 32 * 2**20     # the largest results file read (a gpu run's file is well under 1 MiB)
MAX_JSON_DEPTH = 32                 # nesting of objects and lists in one file
MAX_JSON_VALUES = 1_000_000         # scalars, objects and lists in one file
MAX_JSON_INT = 2**63                # |int| above this is no count, size or seed: refused


def read_file_bounded(path: str | os.PathLike, *, what: str = "file", max_bytes: int = MAX_RESULTS_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, or one UserError line naming it.

    Opened with O_NONBLOCK and checked with fstat before one byte is read, so a FIFO, a socket or a
    device (/dev/zero) is refused at once, never waited on or read without end."""
    import stat as _stat

    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"no {what} at {name!r}") from None
    except IsADirectoryError:
        raise UserError(f"{what} path {name!r} is a folder, not a file") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {name!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if _stat.S_ISDIR(st.st_mode):
            raise UserError(f"{what} path {name!r} is a folder, not a file")
        if not _stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if _stat.S_ISFIFO(st.st_mode) else "a socket" if _stat.S_ISSOCK(st.st_mode)
                    else "a device" if _stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode) else "not a regular file")
            raise UserError(f"{what} {name!r} is {kind}; only regular files are read")
        if st.st_size > max_bytes:
            raise UserError(f"{what} {name!r} is {st.st_size} bytes; at most {max_bytes} are read")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while being read
                raise UserError(f"{what} {name!r} is over {max_bytes} bytes; at most {max_bytes} are read")
        return b"".join(chunks)
    except BlockingIOError:
        raise UserError(f"cannot read {what} {name!r}: it would block") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {name!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def json_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text (brackets inside strings ignored): a linear scan, so a
    hostile file cannot make a parser recurse before it is refused. Used for workflow files and the KV
    file tier's block headers, which are checked before `json.loads` sees them."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def check_json_bounds(data: Any, where: str) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, holding more than MAX_JSON_VALUES values, or an
    int beyond MAX_JSON_INT (one UserError line). Iterative: no recursion on hostile input."""
    stack, count = [(data, 1)], 0
    while stack:
        x, depth = stack.pop()
        count += 1
        if count > MAX_JSON_VALUES:
            raise UserError(f"{where}: more than {MAX_JSON_VALUES} JSON values; refused")
        if isinstance(x, dict):
            if depth > MAX_JSON_DEPTH:
                raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused")
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            if depth > MAX_JSON_DEPTH:
                raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused")
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_JSON_INT:
            raise UserError(f"{where}: integer with {len(str(abs(x)))} digits is out of range (|n| <= 2**63)")


def read_json_file(path: str | os.PathLike, *, what: str = "results file", max_bytes: int = MAX_RESULTS_BYTES) -> Any:
    """Parse a JSON file defensively: `read_file_bounded`, UTF-8, JSON, `check_json_bounds`.
    Every failure is one UserError line naming the file."""
    name = str(path)
    raw = read_file_bounded(path, what=what, max_bytes=max_bytes)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {name!r} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {name!r} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    except RecursionError:   # the parser gives up near 1000 levels, far past the bound
        raise UserError(f"{what} {name!r}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused") from None
    except (ValueError, MemoryError) as e:
        raise UserError(f"{what} {name!r} is not valid JSON: {type(e).__name__}") from None
    check_json_bounds(data, f"{what} {name!r}")
    return data


def load_records(path: str | os.PathLike) -> list[RunRecord]:
    """The records of a results file (or a file holding one record). Every failure is one UserError
    line naming the file: missing, not a regular file, too large or deep, not UTF-8, not JSON, or a
    record with a malformed field."""
    path = Path(path)
    name = str(path)
    data = read_json_file(path, what="results file")
    if isinstance(data, dict) and "records" in data:
        records = data["records"]
        if not isinstance(records, list):
            raise UserError(f"results file {name!r}: 'records' must be a list, got {type(records).__name__}")
        return [RunRecord.from_dict(d, f"{name} record {i + 1}") for i, d in enumerate(records)]
    if isinstance(data, dict):
        return [RunRecord.from_dict(data, name)]
    raise UserError(f"results file {name!r} holds neither a record nor a list of records")


def results_complete(path: str | os.PathLike) -> bool:
    """False for a partial file (`<chapter>.partial.json`) and for a file whose run never finished
    (`"complete": false`, as files before the partial file existed were written); True otherwise."""
    if is_partial_path(path):
        return False
    try:
        data = read_json_file(path, what="results file")
    except UserError:
        return True
    return not (isinstance(data, dict) and data.get("complete") is False)


def tensors_revision(tensors) -> str:
    """`model_revision` of a set of weights: sha256 over each tensor's name, dtype, shape and bytes,
    names in sorted order. Unlike a hash of the safetensors file, it does not change with the file's
    metadata order or header padding, so two identical runs compare.

    `tensors`: a mapping name -> torch.Tensor (a state dict), on any device. Returns the hex digest
    (records write it as 'sha256:<first 16>')."""
    import hashlib

    import torch

    h = hashlib.sha256(b"inferbook tensors v1\0")
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}\0{str(t.dtype).replace('torch.', '')}\0{list(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def safetensors_revision(path: str | os.PathLike) -> str:
    """`tensors_revision` of the tensors in a safetensors file (its metadata is not hashed)."""
    from safetensors.torch import load_file

    return tensors_revision(load_file(str(path)))


# ---------------------------------------------------------------------------
# compare(): a side-by-side table, or a refusal that says why.

def _hardware_key(r: RunRecord) -> str:
    h = r.hardware or {}
    if h.get("device_type") == "cuda":
        return f"{h.get('gpu_name')}"
    return f"CPU {h.get('cpu_model')} x{h.get('cpu_cores')}"


def _differ(x: Any, y: Any) -> bool:
    """Values differ as JSON does: NaN equals NaN (a record is comparable with itself), 1 equals 1.0."""
    if x == y:
        return False
    try:
        return json.dumps(x, sort_keys=True, default=str) != json.dumps(y, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError):
        return True


def comparability(a: RunRecord, b: RunRecord) -> list[str]:
    """Reasons `a` and `b` must not be compared as if equal (empty list: comparable)."""
    reasons = []
    if a.chapter != b.chapter:
        reasons.append(f"chapter differs: {a.chapter!r} vs {b.chapter!r}")
    if _hardware_key(a) != _hardware_key(b):
        reasons.append(f"hardware differs: {_hardware_key(a)} vs {_hardware_key(b)}")
    for key in _COMPARABILITY_WORKLOAD:
        va, vb = a.workload.get(key), b.workload.get(key)
        if _differ(va, vb):
            label = "quantization" if key == "quantization" else f"workload {key!r}"
            reasons.append(f"{label} differs: {va!r} vs {vb!r}")
    if a.hardware.get("device_type") == "cuda" or b.hardware.get("device_type") == "cuda":
        for key in _COMPARABILITY_HARDWARE:
            va, vb = a.hardware.get(key), b.hardware.get(key)
            if va != vb:
                reasons.append(f"{'driver' if key == 'driver' else 'CUDA version'} differs: {va!r} vs {vb!r}")
    for key in _COMPARABILITY_RUNTIME:
        if key in a.runtime and key in b.runtime and _differ(a.runtime[key], b.runtime[key]):
            reasons.append(f"runtime setting {key!r} differs: {a.runtime[key]!r} vs {b.runtime[key]!r}")
    if _differ(a.topology, b.topology):
        diff = sorted(k for k in set(a.topology) | set(b.topology) if _differ(a.topology.get(k), b.topology.get(k)))
        reasons.append("topology differs: " + ", ".join(f"{k} {a.topology.get(k)!r} vs {b.topology.get(k)!r}" for k in diff))
    for op in sorted(set(a.backends) | set(b.backends)):
        ea, eb = a.backends.get(op), b.backends.get(op)
        if ea is None or eb is None:
            reasons.append(f"backend for {op!r} recorded on one side only")
        elif ea.get("backend") != eb.get("backend"):
            reasons.append(f"backend for {op!r} differs: {ea.get('backend')!r} vs {eb.get('backend')!r}")
        elif _differ(ea.get("shapes"), eb.get("shapes")):
            reasons.append(f"local shapes for {op!r} differ: {ea.get('shapes')} vs {eb.get('shapes')}")
    units_a = {_key(m): m["unit"] for m in a.measurements}
    for m in b.measurements:
        ua = units_a.get(_key(m))
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


def _key(m: dict) -> tuple:
    """A measurement's identity across two records: name, phase and lifecycle (derived when absent)."""
    return m["name"], m["phase"], m.get("lifecycle") or phase_axes(m["phase"])["lifecycle"]


def column_names(a: RunRecord, b: RunRecord) -> tuple[str, str]:
    """Value-column names for a and b, always two distinct ones: 'a: eager', 'b: compiled' (two
    records sharing a variant name must not collapse into one column)."""
    la, lb = a.variant or a.name, b.variant or b.name
    if la == lb:
        la, lb = f"{la} ({a.name})", f"{lb} ({b.name})"
    return f"a: {la}", f"b: {lb}"


def compare(a: RunRecord, b: RunRecord) -> Comparison:
    """Side-by-side measurements of two comparable records; `IncomparableRecords` otherwise.

    The ratio column is b / a. Allowed differences (variant, commit, package versions)
    are listed in `context` so the table never hides them.
    """
    reasons = comparability(a, b)
    if reasons:
        raise IncomparableRecords(reasons)
    rows = []
    col_a, col_b = column_names(a, b)
    b_by_key = {_key(m): m for m in b.measurements}
    for m in a.measurements:
        mb = b_by_key.get(_key(m))
        if mb is None:
            continue
        ratio = mb["value"] / m["value"] if m["value"] else math.nan
        rows.append({"metric": m["name"], "phase": m["phase"], "lifecycle": phase_axes(m["phase"]).get("lifecycle")
                     if "lifecycle" not in m else m["lifecycle"], "unit": m["unit"],
                     col_a: m["value"], col_b: mb["value"], "b/a": ratio})
    context = []
    if a.variant != b.variant:
        context.append(f"variant: {a.variant!r} vs {b.variant!r}")
    if a.git != b.git:
        context.append(f"git: {a.git} vs {b.git}")
    for pkg in sorted(set(a.packages) | set(b.packages)):
        if a.packages.get(pkg) != b.packages.get(pkg):
            context.append(f"{pkg}: {a.packages.get(pkg)} vs {b.packages.get(pkg)}")
    return Comparison(a=a, b=b, rows=rows, context=context)
