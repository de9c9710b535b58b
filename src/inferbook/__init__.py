"""inferbook: one week of inference-infrastructure news, built, checked and measured.

Importing the package turns the Triton interpreter on where there is no CUDA device;
this must happen before any kernel module is imported (see `inferbook.device`).
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import device as _device

_device.configure_triton_interpreter()

from .context import Context, setup  # noqa: E402
from .errors import IncomparableRecords, UserError  # noqa: E402
from .record import RunRecord, compare  # noqa: E402

__all__ = ["Context", "IncomparableRecords", "RunRecord", "UserError", "compare", "setup", "__version__"]
