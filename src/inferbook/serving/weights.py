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
    return _build_config(cls, values, path, what)


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


# ---------------------------------------------------------------------------
# Model files that say what they are: kind, role, config and digest in the safetensors metadata.
#
#   save_model_file(path, state, cfg, kind="draft", extra={...}) -> digest
#   meta, names = open_model_file(path, kind="draft", rebuild="python -m ...")
#   cfg = model_config(DraftConfig, meta, path, kind="draft", required=(...))
#   load_model_file(module, path, meta, kind="draft")       # names, shapes, finite, digest, role
#
# `kind` is what a loader reads ("target", "draft", or a new one such as a parallel draft); `role` is
# the name the file was saved under (its stem, e.g. 'dspark-draft-small'), so the large draft copied
# over the small one's file is refused; `digest` is `record.tensors_revision` of the tensors.

KIND_KEY = "inferbook_kind"
ROLE_KEY = "inferbook_role"
CONFIG_KEY = "inferbook_config"
DIGEST_KEY = "inferbook_digest"
PROVENANCE_KEYS = (KIND_KEY, ROLE_KEY, CONFIG_KEY, DIGEST_KEY)


def role_of(path: str | Path) -> str:
    """A model file's role: its name without `.safetensors` ('dspark-draft-small')."""
    name = Path(path).name
    return name[:-len(".safetensors")] if name.endswith(".safetensors") else Path(path).stem


def model_file_metadata(path: str | Path, state: dict[str, torch.Tensor], cfg, *, kind: str,
                        extra: dict | None = None) -> dict[str, str]:
    """The metadata `save_model_file` writes: each config field flat (as older readers expect), the
    config as JSON, kind, role (from `path`), digest, then `extra` (e.g. training steps)."""
    import json
    from dataclasses import asdict

    from ..record import tensors_revision

    fields = asdict(cfg)
    meta = {k: str(v) for k, v in fields.items()}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    meta.update({KIND_KEY: kind, ROLE_KEY: role_of(path), CONFIG_KEY: json.dumps(fields, sort_keys=True),
                 DIGEST_KEY: "sha256:" + tensors_revision(state)})
    return meta


def save_model_file(path: str | Path, state: dict[str, torch.Tensor], cfg, *, kind: str,
                    extra: dict | None = None) -> str:
    """Write `state` (name -> tensor) to `path` with `model_file_metadata`, atomically (temporary in the
    same folder, fsync, os.replace). Returns the digest (hex of `record.tensors_revision`)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    meta = model_file_metadata(path, state, cfg, kind=kind, extra=extra)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(state, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return meta[DIGEST_KEY].split(":", 1)[1]


def open_model_file(path: str | Path, *, kind: str, rebuild: str | None = None) -> tuple[dict, list[str]]:
    """(metadata, tensor names) of a model file, or one UserError line: a missing file names the
    command that rebuilds it (`rebuild`), never starts one; anything but a regular safetensors file
    (a folder, a FIFO, a truncated file) is refused."""
    import stat

    from safetensors import safe_open

    path = Path(path)
    what = f"{kind} model file {path}"
    try:
        st = path.stat()
    except FileNotFoundError:
        how = f"; rebuild it with `{rebuild}`" if rebuild else ""
        raise UserError(f"{what} does not exist{how}") from None
    except OSError as e:
        raise UserError(f"{what} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} is not a regular file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {}), list(f.keys())
    except Exception as e:
        raise UserError(f"{what} cannot be read as safetensors: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_config(cls, meta: dict, path: str | Path, *, kind: str, required: tuple[str, ...]):
    """The config dataclass a model file describes: from its JSON config (`inferbook_config`), else
    from the flat fields; the dataclass's own checks refuse impossible values (zero heads, negative
    sizes, NaN or negative eps and theta) by name."""
    import json

    what = f"{kind} model"
    if CONFIG_KEY in meta:
        try:
            values = json.loads(meta[CONFIG_KEY])
        except ValueError:
            raise UserError(f"{what} file {path}: metadata {CONFIG_KEY} is not JSON") from None
        if not isinstance(values, dict):
            raise UserError(f"{what} file {path}: metadata {CONFIG_KEY} must be a JSON object")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise UserError(f"{what} file {path}: config fields {unknown} are not {cls.__name__}'s")
        absent = [k for k in required if k not in values]
        if absent:
            raise UserError(f"{what} file {path} lacks config metadata: {', '.join(absent)}")
        for k, v in values.items():
            want = fields[k].type
            ok = (isinstance(v, str) if want == "str" else
                  isinstance(v, (int, float)) and not isinstance(v, bool) if want == "float" else
                  isinstance(v, int) and not isinstance(v, bool))
            if not ok:
                raise UserError(f"{what} file {path}: config {k}={v!r} is not a{'n int' if want == 'int' else ' ' + want}")
        values = {k: (float(v) if fields[k].type == "float" else v) for k, v in values.items()}
        cfg = _build_config(cls, values, path, what)
    else:
        cfg = config_from_metadata(cls, meta, path, what, required)
    return cfg


def _build_config(cls, values: dict, path, what: str):
    try:
        return cls(**values)
    except UserError as e:
        raise UserError(f"{what} file {path}: {e}") from None
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise UserError(f"{what} file {path}: impossible config ({type(e).__name__}: {e})") from None


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or infinity."""
    return sorted(n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))


def load_model_file(module: nn.Module, path: str | Path, meta: dict, *, kind: str) -> None:
    """Load a model file into `module` (built from `model_config`), refusing, each by name: a file of
    another kind; missing, unexpected or wrongly shaped tensors; NaN or infinite weights; tensors that
    do not hash to the digest in the metadata; a file whose role (the name it was saved under) is not
    its name now; and a file without that provenance metadata."""
    from safetensors.torch import load_file

    from ..record import tensors_revision

    what = f"{kind} model file {path}"
    found_kind = meta.get(KIND_KEY)
    if found_kind is not None and found_kind != kind:
        raise UserError(f"{what} holds a {found_kind!r} model, not a {kind!r} one")
    try:
        found = load_file(str(path))
    except Exception as e:
        raise UserError(f"{what} cannot be read as safetensors: {_first_line(e)}") from None
    expected = module.state_dict()
    problems = state_dict_problems(expected, found)
    if problems:
        raise UserError(f"{what} does not match the model its metadata describes: " + "; ".join(problems))
    bad = non_finite_tensors(found)
    if bad:
        raise UserError(f"{what} has non-finite weights (NaN or infinity) in {_listing(bad, 4)}")
    absent = [k for k in PROVENANCE_KEYS if k not in meta]
    if absent:
        raise UserError(f"{what} lacks the metadata {', '.join(absent)} (kind, role, config, digest); save it "
                        "again with inferbook.serving.weights.save_model_file")
    digest = "sha256:" + tensors_revision(found)
    if meta[DIGEST_KEY] != digest:
        raise UserError(f"{what}: its tensors hash to {digest[:23]}..., not to the digest in its metadata "
                        f"({str(meta[DIGEST_KEY])[:23]}...): the weights were changed after it was saved")
    if meta[ROLE_KEY] != role_of(path):
        raise UserError(f"{what} was saved as {meta[ROLE_KEY]!r} but is named {role_of(path)!r}: a model file "
                        "is loaded under the name it was saved with")
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(found[name].to(tensor.dtype))
