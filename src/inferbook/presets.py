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

from dataclasses import dataclass
from typing import Any

from .errors import UserError, choices

PRESETS = ("smoke", "cpu", "gpu")
PRESET_CHOICES = ("auto",) + PRESETS


def resolve_preset(preset: str, device_type: str) -> str:
    if not isinstance(preset, str) or preset not in PRESET_CHOICES:
        raise UserError(f"unknown preset {preset!r}; choose {choices(PRESET_CHOICES)}")
    if preset == "auto":
        return "gpu" if device_type == "cuda" else "cpu"
    return preset


@dataclass(frozen=True)
class Param:
    """A chapter knob: its type, default (None: taken from the preset) and meaning."""

    type: type
    default: Any = None
    help: str = ""
    choices: tuple | None = None

    def coerce(self, name: str, value: Any) -> Any:
        """Check (and for CLI strings, convert) `value`; raise UserError naming it."""
        t = self.type
        if isinstance(value, str) and t is not str:
            value = _parse_text(name, value, t)
        ok = (isinstance(value, bool) if t is bool else
              isinstance(value, int) and not isinstance(value, bool) if t is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if t is float else
              isinstance(value, t))
        if not ok:
            raise UserError(f"parameter {name!r} must be {t.__name__}, got {value!r} ({type(value).__name__})")
        if t is float:
            value = float(value)
        if self.choices is not None and value not in self.choices:
            raise UserError(f"parameter {name!r} must be one of {choices(self.choices)}, got {value!r}")
        return value


def _parse_text(name: str, text: str, t: type) -> Any:
    try:
        if t is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if t is int:
            return int(text)
        if t is float:
            return float(text)
        if t in (list, tuple):
            return t(x.strip() for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"parameter {name!r} must be {t.__name__}, got {text!r}") from None
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
        value = given.get(name)
        if value is None:
            value = sizes.get(name, p.default)
        if value is None:
            raise TypeError(f"parameter {name!r} of {chapter!r} has no value in preset {preset!r} and no default")
        out[name] = p.coerce(name, value)
    return out
