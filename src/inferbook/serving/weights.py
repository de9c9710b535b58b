"""Strict loading of model files: a safetensors file must hold exactly the tensors the model has.

`load_state_dict(strict=False)` accepts a file with renamed, missing or extra tensors and leaves the
missing ones at their initial values — an untrained draft would then pass for a trained one. Here
every difference is named: missing names, unexpected names, and names whose shape differs, and the
file is refused (`UserError`, exit 2 in the CLI) before anything is copied into the model.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UserError


def _listing(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def state_dict_problems(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with `found` against `expected` (name -> tensor): [] when they match.
    Compares names and shapes (dtype may differ: the loader casts)."""
    problems = []
    missing = set(expected) - set(found)
    extra = set(found) - set(expected)
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    shapes = [f"{n} {tuple(found[n].shape)} (expected {tuple(expected[n].shape)})"
              for n in sorted(set(expected) & set(found)) if tuple(found[n].shape) != tuple(expected[n].shape)]
    if shapes:
        problems.append("wrong shapes: " + "; ".join(shapes[:8]) + (f" and {len(shapes) - 8} more" if len(shapes) > 8 else ""))
    non_float = [n for n in sorted(set(expected) & set(found)) if not found[n].is_floating_point()]
    if non_float:
        problems.append(f"non-floating-point tensors: {_listing(non_float)}")
    return problems


def load_strict(module: nn.Module, path: str | Path, what: str) -> None:
    """Load a safetensors file into `module`, refusing any difference in names or shapes.

    `what` names the file's role in the message ("target model", "draft model")."""
    from safetensors.torch import load_file

    try:
        found = load_file(str(path))
    except Exception as e:   # a truncated or non-safetensors file
        raise UserError(f"{what} file {path} cannot be read as safetensors: {e}") from None
    expected = module.state_dict()
    problems = state_dict_problems(expected, found)
    if problems:
        raise UserError(f"{what} file {path} does not match the model its metadata describes: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(found[name].to(tensor.dtype))


def config_from_metadata(cls, meta: dict, path: str | Path, what: str, required: tuple[str, ...]):
    """Build a config dataclass from safetensors string metadata; refuse missing or non-numeric fields."""
    fields = cls.__dataclass_fields__
    absent = [k for k in required if k not in meta]
    if absent:
        raise UserError(f"{what} file {path} lacks config metadata: {', '.join(absent)}")
    values = {}
    for k, v in meta.items():
        if k not in fields:
            continue
        try:
            kind = fields[k].type
            values[k] = float(v) if kind == "float" else (str(v) if kind == "str" else int(v))
        except ValueError:
            raise UserError(f"{what} file {path}: metadata {k}={v!r} is not a number") from None
    return cls(**values)


def refuse_format(meta: dict, names, path: str | Path, what: str, *, key: str, expected: str,
                  old_markers: tuple[str, ...], old_what: str) -> None:
    """Refuse a file whose metadata `key` is not `expected`, naming the tensors that mark it as the
    older format (`old_markers`: exact names or name prefixes ending in '.') when it has them."""
    if meta.get(key) == expected:
        return
    old = [n for n in names if any(n == m or (m.endswith(".") and n.startswith(m)) for m in old_markers)]
    found = f"{key}={meta[key]!r}" if key in meta else f"no {key} in its metadata"
    msg = f"{what} file {path} has {found}, expected {key}={expected!r}"
    if old:
        msg += f"; its tensors {_listing(old, 4)} mark it as {old_what}"
    raise UserError(msg)
