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
