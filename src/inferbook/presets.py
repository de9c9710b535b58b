"""Presets (problem sizes per device class) and typed chapter parameters.

- `smoke`: seconds; what the tests and CI run.
- `cpu`:   the default on CPU; the whole book in minutes on 2 cores.
- `gpu`:   realistic shapes for one modern GPU.
- `auto`:  `gpu` on a CUDA device, else `cpu`.

Each chapter's measure module declares `PARAMETERS` (name -> Param) and `PRESETS`
(preset -> {name: value}); `resolve_params` merges them and rejects bad input with a
message naming the value and what is allowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from .errors import UserError, choices

PRESETS = ("smoke", "cpu", "gpu")
PRESET_CHOICES = ("auto",) + PRESETS


def resolve_preset(preset: str, device_type: str) -> str:
    if not isinstance(preset, str) or preset not in PRESET_CHOICES:
        raise UserError(f"unknown preset {preset!r}; choose {choices(PRESET_CHOICES)}")
    if preset == "auto":
        return "gpu" if device_type == "cuda" else "cpu"
    return preset


# Bounds a Param does not declare are derived from the chapter's presets (`Param.bounds`): an int knob
# whose presets are all >= 1 must be >= 1, one whose presets are all >= 0 must be >= 0; a number may be
# at most this many times the largest preset value (a typo such as 10000000000 is refused before it
# allocates anything). A chapter that means a wider range declares `min`/`max` on the Param.
PRESET_HEADROOM = 64
INT_LIMIT = 2**31 - 1   # beyond any size a kernel grid or a tensor dimension here accepts


@dataclass(frozen=True)
class Param:
    """A chapter knob: its type, default (None: taken from the preset) and meaning.

    `min`/`max` bound numbers (for a tuple, each element); unset, they are derived from the presets
    (see `bounds`). `check(value)` is a chapter's own test of one value (e.g. that a comma list
    parses); it raises `UserError` (a plain ValueError is turned into one naming the parameter).
    `item` is the element type of a tuple knob (inferred from the presets when unset).
    """

    type: type
    default: Any = None
    help: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    check: Callable[[Any], Any] | None = None
    item: type | None = None

    def coerce(self, name: str, value: Any) -> Any:
        """Check (and for CLI strings, convert) `value`; raise UserError naming it."""
        t = self.type
        if isinstance(value, str) and t is not str:
            value = _parse_text(name, value, t, self.item)
        elif t in (list, tuple) and self.item in (int, float) and isinstance(value, (list, tuple)):
            value = t(_parse_text(name, v, self.item) if isinstance(v, str) else v for v in value)
        ok = (isinstance(value, bool) if t is bool else
              isinstance(value, int) and not isinstance(value, bool) if t is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if t is float else
              isinstance(value, t))
        if not ok:
            raise UserError(f"parameter {name!r} must be {t.__name__}, got {value!r} ({type(value).__name__})")
        if t is float:
            value = float(value)
            if not math.isfinite(value):
                raise UserError(f"parameter {name!r} must be a finite number, got {value!r}")
        if t is int and abs(value) > INT_LIMIT:
            raise UserError(f"parameter {name!r} = {value} is out of range (|value| <= {INT_LIMIT})")
        if self.choices is not None and value not in self.choices:
            raise UserError(f"parameter {name!r} must be one of {choices(self.choices)}, got {value!r}")
        return value

    def bounds(self, preset_values: list) -> tuple[float | None, float | None]:
        """(min, max) for a number or each element of a tuple: declared, else derived from the presets."""
        nums = [v for v in _flat(preset_values + [self.default]) if isinstance(v, (int, float))
                and not isinstance(v, bool)]
        lo, hi = self.min, self.max
        if nums and lo is None:
            lo = 1 if min(nums) >= 1 and self._integral() else 0 if min(nums) >= 0 else None
        if nums and hi is None and max(nums) > 0:
            hi = PRESET_HEADROOM * max(nums)
        return lo, hi

    def _integral(self) -> bool:
        return self.type is int or self.item is int

    def check_value(self, name: str, value: Any, preset_values: list) -> Any:
        """Bounds, then the chapter's own `check`; UserError (one line) naming the value."""
        if self.type in (int, float) or (self.type in (list, tuple) and self.item in (int, float)):
            lo, hi = self.bounds(preset_values)
            for v in _flat([value]):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if not math.isfinite(v):
                    raise UserError(f"parameter {name!r} must be finite, got {v!r}")
                if lo is not None and v < lo:
                    raise UserError(f"parameter {name!r} must be >= {_num(lo)}, got {_num(v)}")
                if hi is not None and v > hi:
                    derived = "" if self.max is not None else (
                        f" ({PRESET_HEADROOM}x the largest preset value; the chapter declares no larger max)")
                    raise UserError(f"parameter {name!r} must be <= {_num(hi)}, got {_num(v)}{derived}")
        if self.check is not None:
            try:
                self.check(value)
            except UserError:
                raise
            except (ValueError, TypeError, KeyError) as e:
                raise UserError(f"parameter {name!r}: {e}") from None
        return value


def _flat(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_flat(list(v)))
        elif v is not None:
            out.append(v)
    return out


def _num(x) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def _parse_text(name: str, text: str, t: type, item: type | None = None) -> Any:
    try:
        if t is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if t is int:
            return int(text.strip())
        if t is float:
            return float(text)
        if t in (list, tuple):
            parts = [x.strip() for x in text.split(",") if x.strip()]
            if item in (int, float):
                parts = [_parse_text(name, x, item) for x in parts]
            return t(parts)
    except (ValueError, UserError):
        what = f"comma-separated {item.__name__} values" if item in (int, float) else t.__name__
        raise UserError(f"parameter {name!r} must be {what}, got {text!r}") from None
    return text


def resolve_params(chapter: str, declared: dict[str, Param], presets: dict[str, dict],
                   preset: str, given: dict[str, Any]) -> dict[str, Any]:
    """Preset values, overridden by explicit (non-None) `given` values; every name declared."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise UserError(f"unknown parameter {unknown[0]!r} for chapter {chapter!r}; "
                        f"its parameters are {choices(sorted(declared)) or 'none'}")
    sizes = presets.get(preset, {})
    undeclared = sorted(set(sizes) - set(declared))
    if undeclared:  # a programming error in the chapter module, caught by tests
        raise TypeError(f"preset {preset!r} of {chapter!r} sets undeclared parameters {undeclared}")
    out = {}
    for name, p in declared.items():
        p = _with_item_type(p, [ps[name] for ps in presets.values() if name in ps])
        value = given.get(name)
        if value is None:
            value = sizes.get(name, p.default)
        if value is None:
            raise TypeError(f"parameter {name!r} of {chapter!r} has no value in preset {preset!r} and no default")
        value = p.coerce(name, value)
        out[name] = p.check_value(name, value, [ps[name] for ps in presets.values() if name in ps])
    check_relations(out)
    return out


def coerce_param(declared: dict[str, Param], presets: dict[str, dict], name: str, value: Any) -> Any:
    """One explicit value converted to its declared type (CLI strings to ints, `1,8` to a tuple of
    ints), as `resolve_params` would; bounds are checked there."""
    p = _with_item_type(declared[name], [ps[name] for ps in presets.values() if name in ps])
    return p.coerce(name, value)


def _with_item_type(p: Param, preset_values: list) -> Param:
    """A tuple knob whose presets hold ints (floats) parses `1,8` to ints (floats)."""
    if p.type not in (list, tuple) or p.item is not None:
        return p
    items = _flat(preset_values + [p.default])
    for t in (int, float):
        if items and all(isinstance(v, t) and not isinstance(v, bool) for v in items):
            return replace(p, item=t)
    return p


# Relations between knobs that many chapters share, checked before any work (a chapter adds its own
# in `check_params(params)`, which `setup` calls).
_DIVIDES = (("n_heads", "d_model"), ("n_kv_heads", "n_heads"), ("kv_heads", "heads"))


def check_relations(params: dict[str, Any]) -> None:
    for small, big in _DIVIDES:
        a, b = params.get(small), params.get(big)
        if isinstance(a, int) and isinstance(b, int) and a > 0 and b % a:
            raise UserError(f"parameter {small!r} = {a} must divide {big!r} = {b}")
    # Every chapter with d_model and n_heads builds the tiny decoder (`serving.model.TinyConfig`), whose
    # rotary embedding turns pairs of dimensions: its head dim d_model / n_heads must be even.
    d, h = params.get("d_model"), params.get("n_heads")
    if isinstance(d, int) and isinstance(h, int) and h > 0 and d % h == 0 and (d // h) % 2:
        raise UserError(f"parameter 'd_model' = {d} with 'n_heads' = {h} gives head dim {d // h}, which must be even "
                        "(RoPE rotates pairs of dimensions); choose d_model a multiple of 2 x n_heads")


# ---------------------------------------------------------------------------
# Time budgets: what each chapter may spend at --preset gpu on one H200, so that
# `scripts/gpu_measure.sh` runs all sixteen in GPU_RUN_TOTAL_S. A chapter's budget is
# (measure_s, compile_s): benchmarks share the sum (`measure.time_budget`); compile_s is the part
# set aside for compilation (torch.compile, Triton autotuning) that compile-heavy chapters read as
# `ctx.compile_budget_s`. The script gives each chapter budget + STARTUP_ALLOWANCE_S, then SIGINT
# (partial records are saved) and KILL_GRACE_S later SIGKILL; a test asserts that all of it, with
# the ceilings run, fits GPU_RUN_TOTAL_S (`worst_case_total_s`).

GPU_RUN_TOTAL_S = 720
STARTUP_ALLOWANCE_S = 10   # interpreter start, imports, CUDA context, setup: before any budget runs
KILL_GRACE_S = 3           # after SIGINT at the timeout (partial records saved), SIGKILL this much later
CEILINGS_S = 20            # `inferbook ceilings` before the chapters
PACKING_S = 5              # the tarball at the end
# The warm step before the chapters (each part's kernel chapters' gpu launches compiled ahead, on every core,
# into the Triton cache the chapters read): its timeout; `inferbook budgets` predicts its length.
WARM_TIMEOUT_S = 45


RUN_PARTS = 2              # the run is two device calls (one may run 600 s at most): PART=1/2 and PART=2/2


def worst_case_total_s(preset: str = "gpu", parts: int = 1) -> float:
    """The longest `scripts/gpu_measure.sh` can take at `preset` if every chapter runs to its timeout, run in
    `parts` calls (each measures the ceilings, warms the Triton cache and packs its own tarball)."""
    return parts * (CEILINGS_S + PACKING_S + WARM_TIMEOUT_S) + sum(
        sum(b) + STARTUP_ALLOWANCE_S + KILL_GRACE_S for b in BUDGETS_S.get(preset, {}).values())

# Each budget holds the chapter's predicted wall time (`inferbook budgets --preset gpu`, from the CPU dry run
# in data/budgets/gpu-dry-run.json) with a margin; compile_s holds the predicted compile part (Triton's
# cache loads after the warm step, kernels the compile tables do not list, torch.compile's cold graphs).
BUDGETS_S: dict[str, dict[str, tuple[float, float]]] = {"gpu": {
    "h3-vae-fusion": (10, 50),            # three torch.compile graphs (encoder, decoder, block), cold
    "h3-tiled-decode": (14, 0),
    "comfy-generic-loops": (18, 0),
    "omni-h3-workflows": (5, 0),
    "kimi-spec-budget": (26, 0),          # 2K-token prompts through the engine, two policies
    "kimi-dspark-acceptance": (28, 0),
    "kimi-topk-tail-fusion": (7, 2),
    "chord-w4a16": (4, 2),                # Triton W4A16 kernels at every decode M, warmed ahead
    "minimax-m3-moe": (4, 1),
    "tiered-kv-offload": (15, 0),
    "sglang-fused-comm": (7, 1),
    "deterministic-attention": (18, 50),  # the engine's RMSNorm and linear kernels at its own shapes compile cold
    "te-mxfp8-recipes": (14, 2),
    "gdn-backward-check": (29, 2),       # the harness's Python per case and head dim binds it
    "attention-test-matrix": (5, 4),      # ~90 flash specialisations, compiled ahead by the warm step
    "upgrade-record": (6, 48),            # three torch.compile graphs of the decoder, cold
}}


def budget_parts(preset: str, n: int) -> list[list[str]]:
    """The chapters with budgets at `preset`, in book order, cut into `n` contiguous parts of about
    equal worst-case time: one `scripts/gpu_measure.sh` call each where one command may run at most
    10 minutes (the lent machine's limit) but the whole run takes 12."""
    table = BUDGETS_S.get(preset, {})
    if n < 1:
        raise UserError(f"parts must be >= 1, got {n}")
    slugs = list(table)
    cost = [sum(table[s]) + STARTUP_ALLOWANCE_S + KILL_GRACE_S for s in slugs]
    total, parts, acc, cur = sum(cost), [], 0.0, []
    for slug, c in zip(slugs, cost):
        cur.append(slug)
        acc += c
        if len(parts) < n - 1 and acc >= total * (len(parts) + 1) / n:
            parts.append(cur)
            cur = []
    parts.append(cur)
    return parts + [[] for _ in range(n - len(parts))]


def budget_for(chapter: str, preset: str) -> tuple[float, float] | None:
    """(measure_s, compile_s) for `chapter` at `preset`, or None where the preset has no budgets."""
    return BUDGETS_S.get(preset, {}).get(chapter)


def parse_budget(text: str | float | None) -> float | None:
    """A --budget / INFERBOOK_BUDGET_S value: seconds (> 0), or 'none' for no budget."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        value = text
    elif str(text).strip().lower() in ("none", "off"):
        return None
    else:
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"budget must be seconds or 'none', got {text!r}") from None
    if value is not None and (not math.isfinite(value) or value <= 0 or value > 86400):
        raise UserError(f"budget must be in (0, 86400] seconds or 'none', got {text!r}")
    return value
