"""Errors a user can cause. The CLI prints these as one line, never a traceback."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input from the person running the book: names the value and what is allowed."""


class MissingRequirement(UserError):
    """A chapter needs an optional package (e.g. PyAV) that this environment lacks."""


class IncomparableRecords(UserError):
    """`compare()` refused: the records differ in something that makes a ratio meaningless."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("records are not comparable: " + "; ".join(self.reasons))


class InterpreterTimingError(RuntimeError):
    """Someone tried to time a Triton kernel while the Triton interpreter is on."""


def choices(values) -> str:
    """Render allowed values for an error message: 'a', 'b' or 'c'."""
    values = [repr(v) for v in values]
    if len(values) <= 1:
        return "".join(values)
    return ", ".join(values[:-1]) + " or " + values[-1]


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` safe to print on a terminal: control characters (newline, ESC of an ANSI sequence, ...)
    shown as escapes, so a name read from a file cannot move the cursor or forge a line."""
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c.isprintable() or (keep_newlines and c == "\n"):
            out.append(c)
        else:
            out.append(repr(c)[1:-1] if c not in "'\"" else c)
    return "".join(out)
