"""Triton helpers that kernels of more than one topic need. Imports triton: import this module
only from kernel modules (after `inferbook` has set up the interpreter)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, dt: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 -> `dt`, rounding to nearest even.

    The Triton interpreter (3.9) truncates fp32 -> bf16 instead of rounding (its
    `fp_downcast_rounding="rtne"` is wrong too). With EMULATE_BF16 — pass
    `device.bf16_cast_needs_emulation(device)` — the rounding is done on the bits as PyTorch
    does, NaN becoming the canonical 0x7FC0. Compiled kernels use the hardware conversion.
    """
    if EMULATE_BF16 and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).to(tl.uint16)
        rounded = tl.where(x != x, tl.full(rounded.shape, 0x7FC0, tl.uint16), rounded)
        return rounded.to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dt)
