"""Ahead-of-time compilation of the launches a chapter's `gpu` preset makes, for real NVIDIA targets.

A launch is described, not run: `Launch(name, kernel, args, kwargs, source)` carries the positional
arguments as the launcher passes them (tensors may be `ptr(dtype)` stand-ins: only dtype and
alignment matter to the compiler; Python ints as the launcher passes them, since Triton specialises
on ints equal to 1 and divisible by 16) and the keyword arguments (constexprs, `num_warps`,
`num_stages`). Each launcher builds its `Launch` from the same config function it launches with, so
the check sees what a GPU would run.

(This module is filled in by the compile-check work: `compile_launch`, `inspect_chapter`, the
report table. The `Launch` type and `ptr` are the stable interface kernel modules use.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Launch:
    name: str          # one line of the table, e.g. "gate_up decode M16 N4096 K7168 cfg 16x64x128"
    kernel: Any        # the @triton.jit function
    args: list         # positional arguments as the launcher passes them
    kwargs: dict = field(default_factory=dict)  # constexprs + num_warps / num_stages
    source: str = ""   # where the launch happens, e.g. "moe/fused_moe.py:moe_gemm"


def ptr(dtype: torch.dtype) -> torch.Tensor:
    """A one-element CPU tensor standing for a device pointer of `dtype`, 16-byte aligned as CUDA
    allocations are (the compiler reads only its dtype and alignment)."""
    return torch.empty(64, dtype=dtype)[:1]
