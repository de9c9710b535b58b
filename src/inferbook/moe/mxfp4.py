"""MXFP4 expert weights for the MoE decode tail: OCP MX e2m1 elements, one E8M0 scale per 32 along K.

Quantization is `inferbook.numerics.mx.quantize(w, "e2m1", axis=-1, block=32,
scale_rounding="floor")` (OCP MX v1.0's floor rule); this module only *packs* the MX object it
returns into the layout the kernel reads, and unpacks it back. Nothing here re-implements the
quantizer, and the reference dequantization is `numerics.mx.dequantize` of the unpacked object.

Packing spec (``mxfp4 indexed``), one per weight ``W [E, N, K]`` (``[N, K]`` for one matrix):

- ``qweight`` uint8 ``[E, N, K/2]``: two e2m1 codes per byte along K, element 2i in the low
  nibble, 2i+1 in the high nibble (the order of OCP's packed FP4 and of PyTorch's
  ``float4_e2m1fn_x2``). A code is sign (bit 3), exponent (bits 2..1, bias 1), mantissa (bit 0).
- ``scales`` uint8 ``[E, N, K/32]``: E8M0 biased exponents, scale = 2**(byte - 127); 0xFF is NaN.

Storage: 4 bits per weight plus 8 bits per 32 weights = 4.25 bits per weight (W4A16's BF16 group
scales make it 4.5). Every MXFP4 value is an e2m1 number (two significant bits) times a power of
two, so it is exact in fp32 and in BF16: the in-kernel decode (`mxfp4_tile`) has no rounding to
match, and the tests check it bit for bit against `numerics.mx.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import mx as MX

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

BLOCK = 32
ELEMENT = "e2m1"
SCALE_ROUNDING = "floor"
BITS_PER_WEIGHT = 4 + 8 / BLOCK  # 4.25
LAYOUT = "mxfp4 indexed"
LAYOUT_CODE = 4  # kernel-side code (w4a16's codes 0..3 are INT4 layouts and plain BF16)
LABEL = "mxfp4 (e2m1, e8m0 per 32, floor)"


@dataclass(frozen=True)
class PackedMXFP4:
    """MXFP4 weights packed for the decode tail kernel. `shape` is the logical (E, N, K) or (N, K)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple
    layout: str = LAYOUT

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel()

    def to(self, device) -> "PackedMXFP4":
        return PackedMXFP4(self.qweight.to(device), self.scales.to(device), self.shape, self.layout)


def pack(m: MX.MXTensor) -> PackedMXFP4:
    """Pack an MX e2m1 object quantized along the last axis in blocks of 32 (K a multiple of 32)."""
    if not isinstance(m, MX.MXTensor):
        raise ValueError(f"pack expects an MXTensor from numerics.mx.quantize, got {type(m).__name__}")
    nd = m.elements.dim()
    if m.fmt != ELEMENT or m.block != BLOCK or m.axis != nd - 1 or nd not in (2, 3):
        raise ValueError(f"the tail kernel reads e2m1 with blocks of {BLOCK} along the last axis of a 2-D or 3-D "
                         f"weight; got fmt={m.fmt!r}, block={m.block!r}, axis={m.axis!r}, shape {tuple(m.shape)}")
    K = m.shape[-1]
    if K == 0 or K % BLOCK:
        raise ValueError(f"K = {K} (the last axis) must be a positive multiple of {BLOCK}")
    c = m.elements.reshape(*m.shape[:-1], K // 2, 2).to(torch.uint8)
    return PackedMXFP4((c[..., 0] | (c[..., 1] << 4)).contiguous(), m.scales.contiguous(), tuple(m.shape))


def unpack(p: PackedMXFP4) -> MX.MXTensor:
    """The MX object back (uint8 codes, E8M0 bytes), for `numerics.mx.dequantize`."""
    b = p.qweight
    codes = torch.stack([b & 0xF, b >> 4], -1).reshape(p.shape)
    return MX.MXTensor(codes, p.scales, ELEMENT, len(p.shape) - 1, BLOCK, SCALE_ROUNDING)


def quantize(w: torch.Tensor) -> PackedMXFP4:
    """`w [N, K]` or `[E, N, K]` -> MXFP4 (numerics.mx, OCP floor rule), packed for the tail kernel."""
    if not isinstance(w, torch.Tensor) or w.ndim not in (2, 3):
        raise ValueError(f"weights must be a [N, K] or [E, N, K] tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if w.shape[-1] == 0 or w.shape[-1] % BLOCK:
        raise ValueError(f"K = {w.shape[-1]} (the last axis) must be a positive multiple of {BLOCK}")
    return pack(MX.quantize(w, ELEMENT, axis=-1, block=BLOCK, scale_rounding=SCALE_ROUNDING))


def dequantize(p: PackedMXFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weights in the logical shape via `numerics.mx.dequantize` (fp32, exact), returned in `dtype`
    (BF16 is exact too: two significant bits times a power of two)."""
    return MX.dequantize(unpack(p)).to(dtype)


def weight_bytes(n: int, k: int) -> int:
    """Bytes one [N, K] MXFP4 weight occupies: 0.5 per weight + 1 E8M0 byte per 32."""
    return n * k // 2 + n * (k // BLOCK)


if triton is not None:

    from .w4a16 import unpack_words

    @triton.jit
    def mxfp4_tile(qw_ptr, s_ptr, k0, offs_n, N, K, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
        """Weight tile W[offs_n, k0 : k0 + BLOCK_K] of one expert's packed [N, K] MXFP4 matrix, decoded
        in registers to fp32 (exact) and returned transposed as [BLOCK_K, BLOCK_N]; 0 out of range.

        The uint8 [N, K/2] codes are read as int32 words, four bytes = eight codes along K in nibble
        order (code i of a word in bits 4i..4i+3, as W4A16's indexed words), each word once, split in
        registers by `unpack_words`; the E8M0 bytes once per block of 32 ([BLOCK_N, BLOCK_K/32]).
        BLOCK_K is a multiple of 32.

        e2m1 code -> value: with mag = code & 7, e = mag >> 1, m = mag & 1, twice the magnitude is
        m when e == 0 (0, 0.5) and (2 + m) << (e - 1) otherwise (1, 1.5, 2, 3, 4, 6); bit 3 is the
        sign. E8M0 byte b -> 2**(b - 127) built from its bits (b << 23); b == 0 is the fp32
        subnormal 2**-127, 0xFF is NaN, as numerics.mx.dequantize has them."""
        WORDS: tl.constexpr = BLOCK_K // 8
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_kw = k0 // 8 + tl.arange(0, WORDS)
        offs_g = k0 // 32 + tl.arange(0, GROUPS)
        nn = offs_n[:, None]
        kw = offs_kw[None, :]
        gg = offs_g[None, :]
        if EMULATE:  # the interpreter checks int32 index arithmetic for overflow (slow); int64 is not
            nn = nn.to(tl.int64)
            kw = kw.to(tl.int64)
            gg = gg.to(tl.int64)
        word = tl.load(qw_ptr.to(tl.pointer_type(tl.int32)) + nn * (K // 8) + kw, mask=(nn < N) & (kw < K // 8),
                       other=0)
        code = unpack_words(word)  # [BLOCK_N, BLOCK_K]
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        val = twice.to(tl.float32) * 0.5
        val = tl.where((code & 8) != 0, -val, val)
        b = tl.load(s_ptr + nn * (K // 32) + gg, mask=(nn < N) & (gg < K // 32), other=127).to(tl.int32)
        bits = tl.where(b == 0, 0x400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        scale = bits.to(tl.float32, bitcast=True)  # [BLOCK_N, BLOCK_K / 32]
        w = tl.reshape(val, (offs_n.shape[0], GROUPS, 32)) * scale[:, :, None]  # exact: 2 bits x a power of two
        return tl.trans(tl.reshape(w, (offs_n.shape[0], BLOCK_K)))
