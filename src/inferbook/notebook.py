"""Small display helpers chapters share: real source from `src/`, glued numbers, tables,
the hardware notice and committed reference runs. Nothing here computes results."""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any, Iterable

from .device import hardware_label
from .record import RunRecord


class _Markdown:
    def __init__(self, text: str):
        self.text = text

    def _repr_markdown_(self):
        return self.text

    def __repr__(self):
        return self.text


def show_source(obj: Any, *, note: str = "") -> _Markdown:
    """The source of a function, class or Triton kernel, as it is in `src/` (not a copy)."""
    fn = getattr(obj, "fn", obj)  # triton JITFunction / InterpretedFunction keep the python fn in .fn
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    path = Path(inspect.getsourcefile(fn) or "?")
    parts = path.parts
    rel = "/".join(parts[parts.index("src"):]) if "src" in parts else path.name
    head = f"`{rel}`, lines {start}–{start + len(lines) - 1}" + (f" — {note}" if note else "")
    return _Markdown(head + "\n\n```python\n" + textwrap.dedent("".join(lines)).rstrip() + "\n```\n")


def glue(name: str, value: Any, fmt: str | None = None, *, display: bool = False) -> None:
    """Glue a number for prose (`{glue:text}` in MyST); outside a notebook, does nothing.

    `fmt` formats the value first (e.g. '.2f'), so prose shows exactly what the run measured.
    Returns None so a cell ending in a glue call shows no stray output.
    """
    shown = format(value, fmt) if fmt else value
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return None
    _glue(name, shown, display=display)


def table(rows: Iterable[dict] | Iterable[RunRecord], columns: list[str] | None = None):
    """A DataFrame of rows (or of records' measurements)."""
    import pandas as pd

    rows = list(rows)
    if rows and isinstance(rows[0], RunRecord):
        from .charts import records_rows

        rows = records_rows(rows)
    df = pd.DataFrame(rows)
    return df[columns] if columns else df


def hardware_notice(ctx) -> _Markdown:
    """The admonition every chapter shows above its numbers: which device, which preset,
    and, on CPU, what the numbers can and cannot mean."""
    if ctx.device.type == "cuda":
        body = (f"Measured on **{ctx.hardware_label}** (`preset={ctx.preset}`, seed {ctx.seed}). "
                "Triton kernels are compiled and timed with CUDA events.")
    else:
        import os

        try:
            load = f" The load average was {os.getloadavg()[0]:.1f} when this page executed: CPU times swing with it."
        except (OSError, AttributeError):
            load = ""
        body = (f"Measured on **{ctx.hardware_label}** (`preset={ctx.preset}`, seed {ctx.seed}). "
                "There is no GPU here: Triton kernels ran in the Triton interpreter, which checks "
                "correctness only and is never timed. Times on this page are of PyTorch paths on this CPU, "
                "labelled as such; GPU numbers come from committed reference runs, each with its record." + load)
    return _Markdown(f":::{{admonition}} Hardware\n:class: note\n{body}\n:::\n")


def references_table(chapter: str, names: list[str] | None = None):
    """Committed reference runs of `chapter` (data/results/*/<chapter>.json) as one table."""
    from .context import reference_records

    rows = []
    for slug, records in reference_records(chapter).items():
        for r in records:
            for m in r.measurements:
                if names is None or m["name"] in names:
                    rows.append({"hardware": hardware_label(r.hardware), "record": r.name, "variant": r.variant,
                                 "metric": m["name"], "phase": m["phase"], "value": m["value"], "unit": m["unit"],
                                 "commit": (r.git or {}).get("commit", "")[:10], "created": r.created})
    return table(rows)
