"""What a page shows: real source from `src/`, glued numbers, one table formatter, the hardware
notice and committed reference runs. Nothing here computes results.

Importing this module inside a notebook registers the table formatter for every pandas DataFrame
a page displays, and keeps library warnings (Triton's FP-fusion notice, UserWarnings) off the page:
where a warning matters, the chapter says it in prose.
"""
from __future__ import annotations

import html as _html
import inspect
import math
import os
import re
import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterable

from .device import hardware_label
from .record import RunRecord
from .words import count  # noqa: F401  (pages glue counts: nb.count(3, 'launch'))


class _Markdown:
    def __init__(self, text: str):
        self.text = text

    def _repr_markdown_(self):
        return self.text

    def __repr__(self):
        return self.text


HELPER_FOLD_LINES = 15  # a helper (launcher, reference, glue) longer than this folds behind a toggle


def is_kernel(obj: Any) -> bool:
    """A Triton kernel (`@triton.jit`), compiled or interpreted: what a kernel chapter is about."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a core dependency on Linux
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = ()  # noqa: N806
    return isinstance(obj, (JITFunction, InterpretedFunction)) or isinstance(getattr(obj, "fn", None), JITFunction)


def show_source(obj: Any, *, note: str = "", fold: bool | None = None) -> _Markdown:
    """The source of a function, class or Triton kernel, as it is in `src/` (not a copy).
    A Triton kernel is shown in full, whatever its length: it is what the page is about. Helpers
    (launchers, references, plumbing) longer than `HELPER_FOLD_LINES` lines fold instead; `fold`
    forces either way."""
    kernel = is_kernel(obj)
    fn = getattr(obj, "fn", obj)  # triton JITFunction / InterpretedFunction keep the python fn in .fn
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    path = Path(inspect.getsourcefile(fn) or "?")
    parts = path.parts
    rel = "/".join(parts[parts.index("src"):]) if "src" in parts else path.name
    head = f"`{rel}`, lines {start}–{start + len(lines) - 1}" + (f" — {note}" if note else "")
    code = "```python\n" + textwrap.dedent("".join(lines)).rstrip() + "\n```\n"
    if fold if fold is not None else (not kernel and len(lines) > HELPER_FOLD_LINES):
        return _Markdown(f"::::{{admonition}} {head} ({len(lines)} lines)\n:class: dropdown\n\n{code}::::\n")
    return _Markdown(head + "\n\n" + code)


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


def verdict(comparison, a: str, b: str, *, digits: int = 3) -> _Markdown:
    """A comparison helper's sentence as page prose (Markdown that wraps, interval included), not stdout."""
    text = comparison.sentence(a, b, digits=digits)
    return _Markdown(text[0].upper() + text[1:] + ("" if text.endswith(".") else "."))


def verdicts(items: Iterable[tuple], *, digits: int = 3, none: str = "No pair was timed against another in this run.") -> _Markdown:
    """Several comparisons as one Markdown list, each item a `verdict` sentence (interval included):
    `items` are (comparison, a, b) triples. What a page shows instead of printing sentences to stdout."""
    lines = [f"- {verdict(c, a, b, digits=digits).text}" for c, a, b in items]
    return _Markdown("\n".join(lines) + "\n" if lines else none)


def differences(title: str, reasons: Iterable[str], *, none: str = "No differences.") -> _Markdown:
    """Why `compare()` refuses a pair (`comparability`), or the allowed differences it lists
    (`Comparison.context`), as Markdown: `title`, then one item per reason with its label as prose and
    its values as inline code, so a shape dict reads as data rather than as garbled prose."""
    items = []
    for reason in reasons:
        label, sep, values = str(reason).partition(": ")
        values = values.replace("`", "'")
        items.append(f"- {label}: `{values}`" if sep and values else f"- {label}")
    return _Markdown(f"{title}\n\n" + ("\n".join(items) + "\n" if items else none))


def table(rows: Iterable[dict] | Iterable[RunRecord], columns: list[str] | None = None):
    """A DataFrame of rows (or of records' measurements). Displayed on a page through
    `format_table` (registered for every DataFrame when this module is imported in a notebook)."""
    import pandas as pd

    rows = list(rows)
    if rows and isinstance(rows[0], RunRecord):
        from .charts import records_rows

        rows = records_rows(rows)
    df = pd.DataFrame(rows)
    return df[columns] if columns else df


# --- the one table formatter ----------------------------------------------------------------------

NOT_APPLICABLE = "—"
# column-name suffix -> unit shown in the header
_UNITS = {"s": "s", "ms": "ms", "us": "µs", "ns": "ns", "mib": "MiB", "mb": "MB", "gib": "GiB", "gb": "GB",
          "kb": "KB", "bytes": "bytes", "gbps": "GB/s", "tflops": "TFLOP/s", "pct": "%"}
_TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _split_unit(name: str) -> tuple[str, str | None]:
    m = re.fullmatch(r"(.+?)_(s|ms|us|ns|mib|mb|gib|gb|kb|bytes|gbps|tflops|pct)", str(name))
    return (m.group(1), m.group(2)) if m else (str(name), None)


def format_cell(v: Any, digits: int = 3) -> str:
    """One table cell as text: integers as integers, floats to `digits` significant figures,
    "—" for not applicable (None, NaN), structured values spelled out (never a repr)."""
    from .measure import significant

    if v is None:
        return NOT_APPLICABLE
    if isinstance(v, bool):
        return "yes" if v else "no"
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
        v = v.item()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return NOT_APPLICABLE if math.isnan(v) else ("∞" if v > 0 else "−∞")
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return significant(v, digits)
    if isinstance(v, dict):
        return ", ".join(f"{k} {format_cell(x, digits)}" for k, x in v.items()) or NOT_APPLICABLE
    if isinstance(v, (list, tuple, set)):
        return ", ".join(format_cell(x, digits) for x in v) or NOT_APPLICABLE
    s = str(v)
    return NOT_APPLICABLE if s in ("", "nan", "None", "NaN") else s


def tidy_frame(df):
    """The DataFrame a reader sees: a meaningful index becomes columns (a 0..N one is dropped),
    multi-level headers are joined, units move into headers, and a table that mixes seconds with
    milliseconds shows all its times in milliseconds."""
    import pandas as pd

    df = df.copy()
    if isinstance(df.columns, pd.MultiIndex):
        df.columns = [" · ".join(str(x) for x in c if str(x) != "") for c in df.columns]
    if not isinstance(df.index, pd.RangeIndex) or df.index.name is not None:
        df = df.reset_index()
    names = [str(c) for c in df.columns]
    units = {c: _split_unit(c)[1] for c in names}
    time_units = {u for c, u in units.items() if u in _TIME_SCALE} | ({"ms"} if "ms" in names else set())
    target = "ms" if len(time_units) > 1 else None
    out = {}
    for col, name in zip(df.columns, names):
        base, unit = _split_unit(name)
        values = df[col]
        if target and unit in _TIME_SCALE and unit != target:
            values = values.map(lambda x: x * _TIME_SCALE[unit] / _TIME_SCALE[target] if isinstance(x, (int, float))
                                and not isinstance(x, bool) else x)
            unit = target
        header = f"{base.replace('_', ' ')} ({_UNITS[unit]})" if unit else name
        while header in out:
            header += " "
        out[header] = values
    return pd.DataFrame(out)


def format_table(df, *, digits: int = 3) -> str:
    """HTML for a DataFrame: no index column, units in headers, significant figures, integers as
    integers, "—" for not applicable, no truncation; wide tables scroll inside their own box."""
    df = tidy_frame(df)
    head = "".join(f"<th>{_html.escape(str(c))}</th>" for c in df.columns)
    numeric = [df[c].map(lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)).all() for c in df.columns]
    body = []
    for row in df.itertuples(index=False):
        cells = "".join(("<td class='num'>" if num else "<td>") + _html.escape(format_cell(v, digits)) + "</td>"
                        for v, num in zip(row, numeric))
        body.append(f"<tr>{cells}</tr>")
    return (f'<div class="ib-table"><table class="dataframe ib"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


class _Html:
    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self):
        return self.text


def folded_table(summary: str, df, *, digits: int = 3) -> _Html:
    """A table behind a toggle (HTML `<details>`), for rows a page's prose already sums up: the
    summary line says what is inside."""
    return _Html(f"<details><summary>{_html.escape(summary)} ({len(df)} rows)</summary>"
                 f"{format_table(df, digits=digits)}</details>")


def _install_display() -> None:
    """Inside IPython: every DataFrame a page shows goes through `format_table`; library warnings
    stay off the page."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    import pandas as pd

    ip.display_formatter.formatters["text/html"].for_type(pd.DataFrame, format_table)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # explicit default: silences Triton's notice


_install_display()


def run_summary(ctx) -> str:
    """One line: device, preset, seed, and the knobs that differ from the preset."""
    preset_values = {name: ctx.module.PRESETS.get(ctx.preset, {}).get(name, p.default)
                     for name, p in ctx.module.PARAMETERS.items()}
    changed = [f"`{k}={format_cell(v)}`" for k, v in ctx.params.items() if preset_values.get(k) != v]
    knobs = "; knobs changed from the preset: " + ", ".join(changed) if changed else "; every knob as the preset sets it"
    return f"**This run:** {ctx.hardware_label}, preset `{ctx.preset}`, seed {ctx.seed}{knobs}."


def hardware_notice(ctx) -> _Markdown:
    """The run line and the admonition every chapter shows above its numbers: which device, which
    preset, and, on CPU, what the numbers can and cannot mean."""
    if ctx.device.type == "cuda":
        body = "Triton kernels are compiled and timed with CUDA events."
    else:
        try:
            load = f" The load average was {os.getloadavg()[0]:.1f} when this page executed: CPU times swing with it."
        except (OSError, AttributeError):
            load = ""
        body = ("There is no GPU here: Triton kernels ran in the Triton interpreter, which checks "
                "correctness only and is never timed. Times on this page are of PyTorch paths on this CPU, "
                "labelled as such; GPU numbers come from committed reference runs, each with its record." + load)
    return _Markdown(f"{run_summary(ctx)}\n\n:::{{admonition}} Hardware\n:class: note\n{body}\n:::\n")


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
