"""OCP microscaling (MX v1.0): MXFP8 (E4M3, E5M2) and MXFP4 (E2M1) with E8M0 block scales.

A block of `block` consecutive elements (along `axis`), or a 2-D tile of `block=(r, c)`
elements, shares one scale 2**s stored as an E8M0 byte (biased exponent s + 127; 0xFF is
NaN). Each element is stored as the element format's bit pattern (one uint8 per element,
FP4 codes unpacked: 0..15).

Scale exponent, from the block's largest magnitude `amax = m * 2**E` (1 <= m < 2):

- `"floor"` (OCP MX v1.0, section 6.3): s = floor(log2(amax)) - emax = E - emax, where emax
  is the exponent of the element format's largest normal. The block's largest element then
  lands in [2**emax, 2**(emax+1)), above the format's max normal when m > its mantissa:
  those elements saturate (e.g. E4M3: 460 -> 448).
- `"up"`: the smallest s with amax <= max_normal * 2**s, i.e. s = E - emax, plus one when m
  exceeds the max normal's mantissa (1.75 for E4M3/E5M2, 1.5 for E2M1). Nothing saturates;
  one binade of resolution is given up for those blocks. This is the round-up policy of
  Transformer Engine's MXFP8 path (`float_to_e8m0(amax * max_norm_rcp)`, rounding the exponent
  up) and of torchao's RCEIL mode, computed here in integers; the tests check that the two forms
  agree for every fp32 amax in [max_normal/2, 4 max_normal), hence for every normal amax.

Both rules clamp s to E8M0's range [-127, 127]; an all-zero block gets s = -127 (byte 0).
A block holding NaN or +-Inf gets the NaN scale 0xFF, so the whole block dequantizes to NaN
(as torchao's FLOOR implementation does); its elements are stored as the format's NaN code
(0x7F) for FP8 and 0 for FP4, which has no NaN encoding.

Elements: x * 2**-s (exact: a power-of-two scaling) rounded to nearest, ties to even, and
saturated to +-max_normal; subnormals of the element format are kept; the sign of zero is
kept. Inputs may be float32, bfloat16 or float16; they are widened to float32 (exactly).

`quantize_reference` (PyTorch) and `quantize_triton` (one Triton kernel for row-wise,
column-wise and 2-D blocks) implement the same arithmetic and agree bit for bit; the tests
also check both against an independent float64 + `torch.float8` implementation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

try:  # Triton is optional: without it the PyTorch reference runs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton
    triton = None
    tl = None


# ---------------------------------------------------------------------------
# Element formats

@dataclass(frozen=True)
class ElementFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    emax: int          # exponent of the largest normal
    max_mant: int      # mantissa field of the largest normal, in fp32's 23-bit units
    nan_code: int      # code stored for elements of a NaN-scale block
    has_inf: bool
    has_nan: bool

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal."""
        return 1 - self.bias

    @property
    def sign_shift(self) -> int:
        return self.ebits + self.mbits

    @property
    def n_codes(self) -> int:
        return 1 << (self.ebits + self.mbits + 1)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)


FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 4, 3, 7, 448.0, 8, 0x600000, 0x7F, has_inf=False, has_nan=True),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, 57344.0, 15, 0x600000, 0x7F, has_inf=True, has_nan=True),
    "e2m1": ElementFormat("e2m1", 2, 1, 1, 6.0, 2, 0x400000, 0x0, has_inf=False, has_nan=False),
}
SCALE_ROUNDING = ("floor", "up")
BACKENDS = ("auto", "torch", "triton")
E8M0_NAN = 255


def decode_table(fmt: str) -> torch.Tensor:
    """fp32 value of every code of `fmt` (256 for FP8, 16 for FP4), from the bit layout."""
    f = FORMATS[fmt]
    vals = []
    for code in range(f.n_codes):
        sign = -1.0 if code >> f.sign_shift else 1.0
        mag = code & ((1 << f.sign_shift) - 1)
        e, m = mag >> f.mbits, mag & ((1 << f.mbits) - 1)
        if f.name == "e4m3" and e == 15 and m == 7:
            v = math.nan
        elif f.name == "e5m2" and e == 31:
            v = math.inf if m == 0 else math.nan
        elif e == 0:
            v = m * 2.0 ** (f.emin - f.mbits)
        else:
            v = (1 + m / (1 << f.mbits)) * 2.0 ** (e - f.bias)
        vals.append(sign * v)
    return torch.tensor(vals, dtype=torch.float32)


# ---------------------------------------------------------------------------
# The quantized tensor

@dataclass
class MXTensor:
    """Elements (uint8 codes, the input's shape), E8M0 scales (uint8 biased exponents).

    1-D blocks along `axis`: `scales.shape` is the input shape with `shape[axis]` replaced by
    ceil(n / block). 2-D tiles (`block=(r, c)`, 2-D input): `scales.shape == (ceil(M/r), ceil(N/c))`
    and `axis` is None. A partial trailing block shares one scale over its valid elements.
    """

    elements: torch.Tensor
    scales: torch.Tensor
    fmt: str
    axis: int | None
    block: int | tuple[int, int]
    scale_rounding: str
    dtype: torch.dtype = torch.float32  # the high-precision input's dtype
    backend: str = field(default="torch")

    @property
    def shape(self) -> torch.Size:
        return self.elements.shape

    def nbytes(self) -> int:
        """Storage as a kernel would hold it: FP4 packs two codes per byte."""
        per = 0.5 if self.fmt == "e2m1" else 1.0
        return int(math.ceil(self.elements.numel() * per)) + self.scales.numel()


def _check_args(x, fmt, axis, block, scale_rounding, backend="torch"):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x dtype {x.dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    if fmt not in FORMATS:
        raise ValueError(f"unknown element format {fmt!r}; choose one of {sorted(FORMATS)}")
    if scale_rounding not in SCALE_ROUNDING:
        raise ValueError(f"unknown scale_rounding {scale_rounding!r}; choose 'floor' (OCP MX v1.0) or 'up'")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")

    def pow2(b):
        return isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= 128 and b & (b - 1) == 0

    if isinstance(block, (tuple, list)):
        if len(block) != 2 or not all(pow2(b) for b in block):
            raise ValueError(f"2-D block {block!r} must be two powers of two in [2, 128], e.g. (32, 32)")
        if x.dim() != 2:
            raise ValueError(f"2-D block scaling needs a 2-D tensor, got shape {tuple(x.shape)}")
        return None, (int(block[0]), int(block[1]))
    if not pow2(block):
        raise ValueError(f"block {block!r} must be a power of two in [2, 128] (OCP MX uses 32) or a 2-D tuple")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return axis % x.dim(), int(block)


def _as_2d(x: torch.Tensor, axis: int | None, block):
    """The 2-D problem a kernel solves: (x2d, SR, SC, restore) where restore(e2d) gives elements
    in x's shape and the scale shape is computed by the caller."""
    if axis is None:  # 2-D tiles
        return x, block[0], block[1], (lambda e: e)
    if x.dim() == 2 and axis == 0:  # column-wise: the kernel reads with strides, no copy
        return x, block, 1, (lambda e: e)
    moved = x.movedim(axis, -1)
    shape = moved.shape
    x2d = moved.reshape(-1, shape[-1])
    return x2d, 1, block, (lambda e: e.reshape(shape).movedim(-1, axis).contiguous())


def _scale_shape(x: torch.Tensor, axis, block) -> tuple[int, ...]:
    if axis is None:
        return (-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]))
    s = list(x.shape)
    s[axis] = -(-s[axis] // block)
    return tuple(s)


def _restore_scales(s2d: torch.Tensor, x: torch.Tensor, axis, block) -> torch.Tensor:
    if axis is None or (x.dim() == 2 and axis == 0):
        return s2d.contiguous()
    moved = list(x.movedim(axis, -1).shape)
    moved[-1] = s2d.shape[-1]
    return s2d.reshape(moved).movedim(-1, axis).contiguous()


# ---------------------------------------------------------------------------
# PyTorch reference

def _scale_exponent_torch(amax: torch.Tensor, f: ElementFormat, up: bool) -> torch.Tensor:
    """int32 s from a finite, non-negative fp32 amax (see the module docstring)."""
    bits = amax.view(torch.int32)
    s = ((bits >> 23) & 0xFF) - 127 - f.emax
    if up:
        s = s + ((bits & 0x7FFFFF) > f.max_mant).to(torch.int32)
    return s.clamp(-127, 127)


def _pow2_torch(p: torch.Tensor) -> torch.Tensor:
    """2**p as fp32 for int32 p in [-126, 127], built from its bits (exact)."""
    return ((p + 127) << 23).to(torch.int32).view(torch.float32)


def _encode_torch(y: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """Codes (int32) of fp32 values y: round to nearest even, saturate, keep subnormals and -0."""
    sign = (y.view(torch.int32) >> 31) & 1
    a = y.abs().clamp(max=f.max_normal)
    e = (((a.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=f.emin)
    v = a * _pow2_torch(f.mbits - e)                     # exact; < 2**(mbits+1)
    k = ((v + 8388608.0) - 8388608.0).to(torch.int32)    # RNE to an integer (fp32 add rounds to even)
    return (((e - f.emin) << f.mbits) + k) | (sign << f.sign_shift)


def _quantize_2d_torch(x2d: torch.Tensor, sr: int, sc: int, f: ElementFormat, up: bool):
    M, N = x2d.shape
    Mb, Nb = -(-M // sr), -(-N // sc)
    x = x2d.float()
    xp = torch.zeros(Mb * sr, Nb * sc, dtype=torch.float32, device=x.device)
    xp[:M, :N] = x
    blocks = xp.reshape(Mb, sr, Nb, sc)
    a = blocks.abs()
    bad = ~torch.isfinite(a)
    amax = torch.where(bad, torch.zeros_like(a), a).amax(dim=(1, 3))
    nbad = bad.any(dim=3).any(dim=1)
    s = _scale_exponent_torch(amax, f, up)
    scales = torch.where(nbad, torch.full_like(s, E8M0_NAN), s + 127).to(torch.uint8)
    y = blocks * _pow2_torch(-s)[:, None, :, None]
    codes = _encode_torch(y, f)
    codes = torch.where(nbad[:, None, :, None], torch.full_like(codes, f.nan_code), codes)
    codes = codes.reshape(Mb * sr, Nb * sc)[:M, :N].to(torch.uint8)
    return codes, scales


def quantize_reference(x: torch.Tensor, fmt: str = "e4m3", axis: int = -1, block=32,
                       scale_rounding: str = "floor") -> MXTensor:
    """PyTorch reference: `x` [any shape] -> MXTensor (see the module docstring)."""
    axis, block = _check_args(x, fmt, axis, block, scale_rounding)
    f = FORMATS[fmt]
    if x.numel() == 0:
        return MXTensor(torch.empty(x.shape, dtype=torch.uint8, device=x.device),
                        torch.empty(_scale_shape(x, axis, block), dtype=torch.uint8, device=x.device),
                        fmt, axis, block, scale_rounding, x.dtype, "torch")
    x2d, sr, sc, restore = _as_2d(x, axis, block)
    codes, scales = _quantize_2d_torch(x2d, sr, sc, f, scale_rounding == "up")
    return MXTensor(restore(codes), _restore_scales(scales, x, axis, block), fmt, axis, block, scale_rounding,
                    x.dtype, "torch")


# ---------------------------------------------------------------------------
# Triton kernel: one program quantizes an (NBR*SR) x (NBC*SC) tile holding NBR x NBC scale blocks.
# Row-wise blocks are (1, 32), column-wise (32, 1), 2-D weight tiles (32, 32) or (128, 128).

# A tile above MAX_TILE_ELEMENTS (a 2-D 128x128 or 128x64 weight block) is not held in registers at
# once: at 128 threads that is >= 64 fp32 values per thread per live tensor, and ptxas spilled
# 2.5 KB per thread on sm_90. Such a tile is one block tall (NBR == 1); the kernel reads it in
# slabs of MAX_TILE_ELEMENTS // TC rows, first for the block maxima (max is exact in any order),
# then again to encode (the second read of a 64 KB tile comes mostly from L2). Bits do not change.
MAX_TILE_ELEMENTS = 4096

if triton is not None:
    @triton.jit
    def _mx_load_key(x_ptr, rows, cols, M, N, sxm, sxn):
        """fp32 x of a [R, C] slab (0 outside the tensor: padding cannot raise a block's amax) and its
        magnitude key, the int32 bits of |x| (x's bits without the sign). Non-negative floats order as
        their bits do, so a block's largest key is its amax's bits, and NaN/Inf are exactly the keys from
        0x7F800000 up: one AND and an integer max an element find both (max() on floats need not
        propagate NaN, and an Inf must not become a scale)."""
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + cols[None, :].to(tl.int64) * sxn,
                    mask=mask, other=0.0).to(tl.float32)
        return x, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, mask

    @triton.jit
    def _mx_encode(x, inv, nbad, EMIN: tl.constexpr, MBITS: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                   MAX_NORMAL: tl.constexpr, NAN_CODE: tl.constexpr, HW: tl.constexpr = 0):
        """Element codes of fp32 x given its block's 2**-s (`inv`) and NaN/Inf flag, broadcast to x.
        HW (`hw_cast`): 1 / 2, the hardware's fp32 -> E4M3 / E5M2 conversion (sm_89+: `cvt.rn.satfinite`,
        two elements an instruction) of the value clamped to +-max_normal: round to nearest even, as the
        integer path below, which every other target and the interpreter take."""
        y = x * inv                                                  # exact: a power-of-two scaling
        if HW != 0:
            clamped = tl.minimum(tl.maximum(y, -MAX_NORMAL), MAX_NORMAL)
            c8 = clamped.to(tl.float8e4nv) if HW == 1 else clamped.to(tl.float8e5)
            return tl.where(nbad != 0, NAN_CODE, c8.to(tl.uint8, bitcast=True).to(tl.int32))
        sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
        av = tl.minimum(tl.abs(y), MAX_NORMAL)                       # saturate
        e = tl.maximum(((av.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        v = av * ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)   # units of the last mantissa bit
        k = ((v + 8388608.0) - 8388608.0).to(tl.int32)               # round half to even via fp32 add
        code = ((e - EMIN) << MBITS) + k                             # carry into the exponent is free
        code = code | (sign << SIGN_SHIFT)
        return tl.where(nbad != 0, NAN_CODE, code)

    @triton.jit
    def mx_quantize_kernel(x_ptr, e_ptr, s_ptr, M, N, MB, NB, sxm, sxn, sem, sen, ssm, ssn,
                           SR: tl.constexpr, SC: tl.constexpr, NBR: tl.constexpr, NBC: tl.constexpr,
                           EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                           SIGN_SHIFT: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_MANT: tl.constexpr,
                           NAN_CODE: tl.constexpr, ROUND_UP: tl.constexpr, HW: tl.constexpr = 0):
        TR: tl.constexpr = NBR * SR
        TC: tl.constexpr = NBC * SC
        # slab rows: the whole tile when it is small, else MAX_TILE_ELEMENTS // TC rows of a tile
        # that is one block tall (see MAX_TILE_ELEMENTS)
        SLAB: tl.constexpr = TR if TR * TC <= 4096 or NBR > 1 else 4096 // TC
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        cols = pid_c * TC + tl.arange(0, TC)
        if SLAB == TR:
            rows = pid_r * TR + tl.arange(0, TR)
            x, key, mask = _mx_load_key(x_ptr, rows, cols, M, N, sxm, sxn)
            kmax = tl.max(tl.max(tl.reshape(key, (NBR, SR, NBC, SC)), axis=3), axis=1)    # [NBR, NBC]
        else:
            kmax = tl.zeros((1, NBC), dtype=tl.int32)
            for r0 in range(0, TR, SLAB):
                rows = pid_r * TR + r0 + tl.arange(0, SLAB)
                x, key, mask = _mx_load_key(x_ptr, rows, cols, M, N, sxm, sxn)
                kmax = tl.maximum(kmax, tl.max(tl.max(tl.reshape(key, (1, SLAB, NBC, SC)), axis=3), axis=1))
        s, biased, nbad = _mx_scale(kmax, EMAX, MAX_MANT, ROUND_UP)
        srows = pid_r * NBR + tl.arange(0, NBR)
        scols = pid_c * NBC + tl.arange(0, NBC)
        smask = (srows[:, None] < MB) & (scols[None, :] < NB)
        tl.store(s_ptr + srows[:, None] * ssm + scols[None, :] * ssn, biased.to(tl.uint8), mask=smask)

        # Broadcast each block's 2**-s (a normal fp32, built from bits) back over its elements.
        inv = ((127 - s) << 23).to(tl.float32, bitcast=True)
        if SLAB == TR:
            inv_t = tl.reshape(tl.broadcast_to(tl.reshape(inv, (NBR, 1, NBC, 1)), (NBR, SR, NBC, SC)), (TR, TC))
            bad_t = tl.reshape(tl.broadcast_to(tl.reshape(nbad, (NBR, 1, NBC, 1)), (NBR, SR, NBC, SC)), (TR, TC))
            code = _mx_encode(x, inv_t, bad_t, EMIN, MBITS, SIGN_SHIFT, MAX_NORMAL, NAN_CODE, HW)
            tl.store(e_ptr + rows[:, None].to(tl.int64) * sem + cols[None, :].to(tl.int64) * sen,
                     code.to(tl.uint8), mask=mask)
        else:
            inv_t = tl.reshape(tl.broadcast_to(tl.reshape(inv, (1, 1, NBC, 1)), (1, SLAB, NBC, SC)), (SLAB, TC))
            bad_t = tl.reshape(tl.broadcast_to(tl.reshape(nbad, (1, 1, NBC, 1)), (1, SLAB, NBC, SC)), (SLAB, TC))
            for r0 in range(0, TR, SLAB):
                rows = pid_r * TR + r0 + tl.arange(0, SLAB)
                x, key, mask = _mx_load_key(x_ptr, rows, cols, M, N, sxm, sxn)
                code = _mx_encode(x, inv_t, bad_t, EMIN, MBITS, SIGN_SHIFT, MAX_NORMAL, NAN_CODE, HW)
                tl.store(e_ptr + rows[:, None].to(tl.int64) * sem + cols[None, :].to(tl.int64) * sen,
                         code.to(tl.uint8), mask=mask)


def _tile(sr: int, sc: int) -> tuple[int, int]:
    """Scale blocks per program (NBR, NBC): about 2-4K elements per tile, rows of >= 64 columns."""
    if sr == 1:
        return 16, max(1, 128 // sc)
    if sc == 1:        # column-wise 32 x 1: 128 columns (at 64, more of the work was the cross-thread reduction)
        return max(1, 32 // sr) if sr < 32 else 1, 128
    return max(1, 64 // sr), max(1, 64 // sc)


def quantize_triton(x: torch.Tensor, fmt: str = "e4m3", axis: int = -1, block=32,
                    scale_rounding: str = "floor") -> MXTensor:
    """The Triton kernel; bit-exact with `quantize_reference`. Needs `device.triton_backend_for` ok."""
    axis, block = _check_args(x, fmt, axis, block, scale_rounding)
    if triton is None:
        raise RuntimeError("triton is not installed; use quantize_reference or backend='torch'")
    elements = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return MXTensor(elements, torch.empty(_scale_shape(x, axis, block), dtype=torch.uint8, device=x.device),
                        fmt, axis, block, scale_rounding, x.dtype, "triton")
    x2d, sr, sc, restore = _as_2d(x, axis, block)
    M, N = x2d.shape
    MB, NB = -(-M // sr), -(-N // sc)
    e2d = torch.empty((M, N), dtype=torch.uint8, device=x.device)
    s2d = torch.empty((MB, NB), dtype=torch.uint8, device=x.device)
    launch = _quantize_launch(x2d, e2d, s2d, sr, sc, fmt, scale_rounding)
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return MXTensor(restore(e2d), _restore_scales(s2d, x, axis, block), fmt, axis, block, scale_rounding,
                    x.dtype, "triton")


# ---------------------------------------------------------------------------
# Row-wise and column-wise in one pass (what a training step's forward needs for x: the row-wise copy
# for y = x W^T now, the column-wise copy for wgrad later). Transformer Engine's MXFP8 cast kernel
# (`cast_mxfp8_2D_kernel`, sm_100) loads 32-row buffers of a 64x64 chunk into shared memory by TMA and
# writes both directions from there; here one program holds a BLOCK x TC register tile and writes
# both codes and both scale arrays. The high-precision tensor is read once instead of twice.

ROWCOL_TILE_COLS = 128  # BLOCK (32) rows x 128 columns = 4096 elements per program: no spills

if triton is not None:
    @triton.jit
    def _mx_scale(kmax, EMAX: tl.constexpr, MAX_MANT: tl.constexpr, ROUND_UP: tl.constexpr):
        """(s, biased E8M0 byte, NaN/Inf flag) of a block from its largest magnitude key (`_mx_load_key`):
        the amax's bits, or >= 0x7F800000 where the block holds a NaN or an Inf (module docstring)."""
        nbad = (kmax >= 0x7F800000).to(tl.int32)
        s = ((kmax >> 23) & 0xFF) - 127 - EMAX                       # floor(log2(amax)) - emax
        if ROUND_UP:
            s = s + ((kmax & 0x7FFFFF) > MAX_MANT).to(tl.int32)      # amax > max_normal * 2**s: one up
        s = tl.minimum(tl.maximum(s, -127), 127)
        return s, tl.where(nbad != 0, 255, s + 127), nbad

    @triton.jit
    def mx_quantize_rowcol_kernel(x_ptr, er_ptr, sr_ptr, ec_ptr, sc_ptr, M, N, NBN, MBM, sxm, sxn,
                                  BLOCK: tl.constexpr, TC: tl.constexpr,
                                  EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                                  SIGN_SHIFT: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_MANT: tl.constexpr,
                                  NAN_CODE: tl.constexpr, ROUND_UP: tl.constexpr, HW: tl.constexpr = 0):
        """One program: rows [BLOCK*pid_r, +BLOCK) x columns [TC*pid_c, +TC). Row-wise: 1 x BLOCK blocks
        (scales sr [M, NBN]); column-wise: BLOCK x 1 blocks (scales sc [MBM, N]); codes er, ec [M, N]."""
        NB: tl.constexpr = TC // BLOCK
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * BLOCK + tl.arange(0, BLOCK)
        cols = pid_c * TC + tl.arange(0, TC)
        x, key, mask = _mx_load_key(x_ptr, rows, cols, M, N, sxm, sxn)
        off = rows[:, None].to(tl.int64) * N + cols[None, :].to(tl.int64)
        # row-wise blocks: along the columns
        s_r, b_r, bad_r = _mx_scale(tl.max(tl.reshape(key, (BLOCK, NB, BLOCK)), axis=2), EMAX, MAX_MANT,
                                    ROUND_UP)                                        # [BLOCK rows, NB]
        sb = pid_c * NB + tl.arange(0, NB)
        tl.store(sr_ptr + rows[:, None] * NBN + sb[None, :], b_r.to(tl.uint8),
                 mask=(rows[:, None] < M) & (sb[None, :] < NBN))
        inv_r = ((127 - s_r) << 23).to(tl.float32, bitcast=True)
        inv_r = tl.reshape(tl.broadcast_to(tl.reshape(inv_r, (BLOCK, NB, 1)), (BLOCK, NB, BLOCK)), (BLOCK, TC))
        bad_rt = tl.reshape(tl.broadcast_to(tl.reshape(bad_r, (BLOCK, NB, 1)), (BLOCK, NB, BLOCK)), (BLOCK, TC))
        code_r = _mx_encode(x, inv_r, bad_rt, EMIN, MBITS, SIGN_SHIFT, MAX_NORMAL, NAN_CODE, HW)
        tl.store(er_ptr + off, code_r.to(tl.uint8), mask=mask)
        # column-wise blocks: the tile's BLOCK rows of each column are one block
        s_c, b_c, bad_c = _mx_scale(tl.max(key, axis=0), EMAX, MAX_MANT, ROUND_UP)  # [TC]
        tl.store(sc_ptr + pid_r * N + cols, b_c.to(tl.uint8), mask=cols < N)   # grid: pid_r < MBM
        inv_c = ((127 - s_c) << 23).to(tl.float32, bitcast=True)
        code_c = _mx_encode(x, tl.broadcast_to(inv_c[None, :], (BLOCK, TC)),
                            tl.broadcast_to(bad_c[None, :], (BLOCK, TC)), EMIN, MBITS, SIGN_SHIFT, MAX_NORMAL,
                            NAN_CODE, HW)
        tl.store(ec_ptr + off, code_c.to(tl.uint8), mask=mask)


def quantize_rowcol_reference(x: torch.Tensor, fmt: str = "e4m3", block: int = 32,
                              scale_rounding: str = "floor") -> tuple[MXTensor, MXTensor]:
    """Two passes of the reference: (row-wise 1 x block, column-wise block x 1) of a 2-D x."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"row+column quantization needs a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    return (quantize_reference(x, fmt, axis=-1, block=block, scale_rounding=scale_rounding),
            quantize_reference(x, fmt, axis=0, block=block, scale_rounding=scale_rounding))


def quantize_rowcol_triton(x: torch.Tensor, fmt: str = "e4m3", block: int = 32,
                           scale_rounding: str = "floor") -> tuple[MXTensor, MXTensor]:
    """One pass over x [M, N]: both MX copies, bit-exact with `quantize_rowcol_reference`."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"row+column quantization needs a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    _check_args(x, fmt, -1, block, scale_rounding)
    if block > ROWCOL_TILE_COLS:
        raise ValueError(f"one-pass row+column quantization supports block <= {ROWCOL_TILE_COLS}, got {block}")
    if triton is None:
        raise RuntimeError("triton is not installed; use quantize_rowcol_reference")
    M, N = x.shape
    NBN, MBM = -(-N // block), -(-M // block)
    dev = x.device
    er = torch.empty((M, N), dtype=torch.uint8, device=dev)
    ec = torch.empty((M, N), dtype=torch.uint8, device=dev)
    sr = torch.empty((M, NBN), dtype=torch.uint8, device=dev)
    sc = torch.empty((MBM, N), dtype=torch.uint8, device=dev)
    if x.numel():
        launch = _rowcol_launch(x, er, sr, ec, sc, fmt, block, scale_rounding)
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return (MXTensor(er, sr, fmt, 1, block, scale_rounding, x.dtype, "triton"),
            MXTensor(ec, sc, fmt, 0, block, scale_rounding, x.dtype, "triton"))


def rowcol_bytes(M: int, N: int, hp_bytes: int = 2, block: int = 32, passes: int = 1) -> int:
    """Bytes a row+column quantize moves: `passes` reads of the high-precision x, plus both copies'
    1-byte codes and E8M0 scales (MXFP8). One pass reads x once; two passes read it twice."""
    return passes * M * N * hp_bytes + 2 * M * N + M * (-(-N // block)) + (-(-M // block)) * N


def pick_backend(device: torch.device, backend: str = "auto") -> tuple[str, str]:
    """('torch' | 'triton', reason). auto: Triton on CUDA, the PyTorch reference elsewhere
    (the interpreter is for correctness checks, which call `quantize_triton` explicitly)."""
    from ..device import triton_backend_for

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    ok, why = triton_backend_for(device)
    if backend == "torch":
        return "torch", "asked for"
    if backend == "triton":
        if not ok:
            raise ValueError(f"backend 'triton' cannot run on {device}: {why}")
        return "triton", why
    if device.type == "cuda" and ok:
        return "triton", why
    return "torch", ("no CUDA device: PyTorch reference (Triton runs only in correctness checks)"
                     if device.type != "cuda" else f"Triton unavailable: {why}")


def quantize(x: torch.Tensor, fmt: str = "e4m3", axis: int = -1, block=32, scale_rounding: str = "floor",
             backend: str = "auto") -> MXTensor:
    """Quantize `x` to MX: see the module docstring. `backend`: 'auto', 'torch' or 'triton'."""
    _check_args(x, fmt, axis, block, scale_rounding, backend)
    chosen, _ = pick_backend(x.device, backend)
    fn = quantize_triton if chosen == "triton" else quantize_reference
    return fn(x, fmt, axis, block, scale_rounding)


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2**(b - 127); byte 0 is 2**-127 (an fp32 subnormal), 0xFF is NaN."""
    b = scales.to(torch.int32)
    vals = _pow2_torch((b - 127).clamp(-126, 127))
    vals = torch.where(b == 0, torch.full_like(vals, 2.0 ** -127), vals)
    return torch.where(b == E8M0_NAN, torch.full_like(vals, math.nan), vals)


_TABLES: dict = {}


def _table_on(fmt: str, device: torch.device) -> torch.Tensor:
    key = (fmt, str(device))
    if key not in _TABLES:
        _TABLES[key] = decode_table(fmt).to(device)
    return _TABLES[key]


def dequantize(mx: MXTensor) -> torch.Tensor:
    """fp32 values: decoded element * 2**(scale - 127); a 0xFF scale gives NaN for its block."""
    if not isinstance(mx, MXTensor):
        raise ValueError(f"dequantize expects an MXTensor, got {type(mx).__name__}")
    vals = torch.take(_table_on(mx.fmt, mx.elements.device), mx.elements.long())  # (indexing is ~1000x slower on CPU)
    scale = _scale_values(mx.scales)
    if mx.axis is None:
        r, c = mx.block
        full = scale.repeat_interleave(r, 0).repeat_interleave(c, 1)
    else:
        full = scale.repeat_interleave(mx.block, mx.axis)
    full = full[tuple(slice(0, n) for n in vals.shape)]
    return vals * full


def qdq(x: torch.Tensor, fmt: str = "e4m3", axis: int = -1, block=32, scale_rounding: str = "floor",
        backend: str = "auto") -> torch.Tensor:
    """Quantize then dequantize: what a low-precision GEMM sees of `x` (fp32)."""
    return dequantize(quantize(x, fmt, axis, block, scale_rounding, backend))


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (fp64): 10 log10(sum x^2 / sum (x - approx)^2)."""
    x, approx = x.double(), approx.double()
    noise = (x - approx).pow(2).sum().item()
    sig = x.pow(2).sum().item()
    if not math.isfinite(noise):
        return math.nan
    return math.inf if noise == 0 else 10 * math.log10(sig / noise)


# ---------------------------------------------------------------------------
# Recipes: a quantizer per tensor role and direction, in the spirit of TE's CustomRecipe.

@dataclass(frozen=True)
class Quantizer:
    """How one operand is rounded before a GEMM. fmt None: `hp` ('bf16' or 'fp32') rounding only."""

    fmt: str | None = "e4m3"
    block: int | tuple[int, int] = 32
    scale_rounding: str = "floor"
    hp: str = "bf16"

    def __post_init__(self):
        if self.fmt is not None and self.fmt not in FORMATS:
            raise ValueError(f"unknown element format {self.fmt!r}; choose one of {sorted(FORMATS)} or None")
        if self.hp not in ("bf16", "fp32"):
            raise ValueError(f"hp must be 'bf16' or 'fp32', got {self.hp!r}")
        if self.scale_rounding not in SCALE_ROUNDING:
            raise ValueError(f"unknown scale_rounding {self.scale_rounding!r}; choose 'floor' or 'up'")

    @property
    def is_2d(self) -> bool:
        return isinstance(self.block, tuple)

    @property
    def label(self) -> str:
        if self.fmt is None:
            return self.hp
        b = f"{self.block[0]}x{self.block[1]}" if self.is_2d else f"1x{self.block}"
        return f"MX{self.fmt.upper()} {b}" + (" up" if self.scale_rounding == "up" else "")

    def __call__(self, x: torch.Tensor, axis: int, backend: str = "auto") -> torch.Tensor:
        """x (2-D, high precision) as the GEMM sees it, fp32. `axis`: the GEMM's reduction axis."""
        if self.fmt is None:
            return x.to(torch.bfloat16).float() if self.hp == "bf16" else x.float()
        xb = x.to(torch.bfloat16) if self.hp == "bf16" else x.float()  # the tensor TE would quantize
        return qdq(xb, self.fmt, axis=axis, block=self.block, scale_rounding=self.scale_rounding,
                   backend=backend)


ROLES = ("input", "weight", "grad")
DIRECTIONS = ("row", "col")


@dataclass(frozen=True)
class Recipe:
    """A quantizer for each (role, direction). For y = x @ W.T with x [M, K], W [N, K], dy [M, N]:

    - forward  y  = x  @ W.T : x row-wise (blocks along K), W row-wise (along K)
    - dgrad    dx = dy @ W   : dy row-wise (along N),        W column-wise (along N)
    - wgrad    dW = dy.T @ x : dy column-wise (along M),     x column-wise (along M)
    """

    name: str
    quantizers: dict  # (role, direction) -> Quantizer
    description: str = ""

    def __post_init__(self):
        missing = [(r, d) for r in ROLES for d in DIRECTIONS if (r, d) not in self.quantizers]
        if missing:
            raise ValueError(f"recipe {self.name!r} has no quantizer for {missing}")

    def q(self, role: str, direction: str) -> Quantizer:
        return self.quantizers[(role, direction)]

    def shares_weight(self) -> bool:
        """True when one 2-D quantization of W serves both directions (W and W.T)."""
        r, c = self.q("weight", "row"), self.q("weight", "col")
        return r == c and r.is_2d


def make_recipe(name: str, *, input=None, weight=None, grad=None, description: str = "", **overrides) -> Recipe:
    """Build a recipe from one quantizer per role (both directions), then per-direction overrides
    such as `weight_col=Quantizer(...)`."""
    q = {}
    for role, qz in (("input", input), ("weight", weight), ("grad", grad)):
        for d in DIRECTIONS:
            q[(role, d)] = overrides.pop(f"{role}_{d}", None) or qz or Quantizer(None)
    if overrides:
        raise ValueError(f"unknown recipe overrides {sorted(overrides)}; use <role>_<row|col>")
    return Recipe(name, q, description)


def recipes() -> dict[str, Recipe]:
    """The recipes the chapter compares."""
    e4 = Quantizer("e4m3")
    e5 = Quantizer("e5m2")
    w2d = Quantizer("e4m3", block=(32, 32))
    out = [
        make_recipe("bf16", description="BF16 operands everywhere (the baseline)"),
        make_recipe("mxfp8", input=e4, weight=e4, grad=e4,
                    description="MXFP8 E4M3, 1x32 blocks, row- and column-wise quantized separately"),
        make_recipe("mxfp8-2d-weight", input=e4, weight=w2d, grad=e4,
                    description="as mxfp8, but W in 32x32 tiles: W and W.T share one quantization"),
        make_recipe("mxfp8-e5m2-grad", input=e4, weight=e4, grad=e5,
                    description="E4M3 forward, E5M2 for the output gradient (a different backward format)"),
        make_recipe("mxfp8-up", input=Quantizer("e4m3", scale_rounding="up"),
                    weight=Quantizer("e4m3", scale_rounding="up"), grad=Quantizer("e4m3", scale_rounding="up"),
                    description="as mxfp8, with round-up scales (no saturation)"),
        make_recipe("mxfp4-fwd", input=Quantizer("e2m1"), weight=Quantizer("e2m1"), grad=e4,
                    description="MXFP4 E2M1 for x and W (both directions), MXFP8 E4M3 for the output gradient"),
    ]
    return {r.name: r for r in out}


class _EmulatedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe, backend):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.backend = recipe, backend
        xq = recipe.q("input", "row")(x, axis=1, backend=backend)
        wq = recipe.q("weight", "row")(w, axis=1, backend=backend)
        return (xq @ wq.T).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        r, be = ctx.recipe, ctx.backend
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = r.q("grad", "row")(dy, axis=1, backend=be) @ r.q("weight", "col")(w, axis=0, backend=be)
        if ctx.needs_input_grad[1]:
            dw = r.q("grad", "col")(dy, axis=0, backend=be).T @ r.q("input", "col")(x, axis=0, backend=be)
        return (dx.to(x.dtype) if dx is not None else None, dw.to(w.dtype) if dw is not None else None, None, None)


def emulated_linear(x: torch.Tensor, w: torch.Tensor, recipe: Recipe, backend: str = "auto") -> torch.Tensor:
    """y = x @ w.T with every GEMM operand rounded as `recipe` says (quantize -> dequantize ->
    fp32 matmul). x: [M, K], w: [N, K] (fp32 master weights); returns [M, N] in x's dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"emulated_linear needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    return _EmulatedLinearFn.apply(x, w, recipe, backend)


def gemm_errors(recipe: Recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                backend: str = "auto") -> list[dict]:
    """SQNR (dB) of each operand per direction, and of each GEMM's output against fp64."""
    rows = []
    ops = {("input", "row"): (x, 1), ("input", "col"): (x, 0), ("weight", "row"): (w, 1),
           ("weight", "col"): (w, 0), ("grad", "row"): (dy, 1), ("grad", "col"): (dy, 0)}
    q = {}
    for (role, d), (t, axis) in ops.items():
        q[(role, d)] = recipe.q(role, d)(t, axis=axis, backend=backend)
        rows.append({"recipe": recipe.name, "kind": "operand", "tensor": f"{role} ({d}-wise)",
                     "quantizer": recipe.q(role, d).label, "sqnr_db": sqnr_db(t, q[(role, d)])})
    xd, wd, dyd = x.double(), w.double(), dy.double()
    gemms = {
        "forward y = x W^T": (q[("input", "row")] @ q[("weight", "row")].T, xd @ wd.T),
        "dgrad dx = dy W": (q[("grad", "row")] @ q[("weight", "col")], dyd @ wd),
        "wgrad dW = dy^T x": (q[("grad", "col")].T @ q[("input", "col")], dyd.T @ xd),
    }
    for name, (got, ref) in gemms.items():
        rows.append({"recipe": recipe.name, "kind": "gemm output", "tensor": name, "quantizer": "",
                     "sqnr_db": sqnr_db(ref, got)})
    return rows


# ---------------------------------------------------------------------------
# Cost model: quantize passes and transposes per training step, per GEMM.

def step_costs(recipe: Recipe, M: int, K: int, N: int, hp_bytes: int = 2) -> list[dict]:
    """Which quantized copies each GEMM of one linear layer's training step needs, and what they cost.

    Model (ours, stated so it can be argued with): a quantize pass reads the high-precision tensor
    (`hp_bytes` per element) and writes 1 byte per element plus one scale byte per block. Row-wise
    and column-wise 1-D copies are two passes over the high-precision tensor: a column-wise MX copy
    cannot be made from the row-wise one (other blocks, other scales), so the high-precision tensor
    must still be there. A 2-D weight is quantized once; W.T for dgrad is a transpose of 1-byte data
    (read 1 + write 1 byte per element). x's column-wise copy is made in the forward (x is at hand
    there) and kept until wgrad; dy's two copies are made in the backward.
    """
    sizes = {"input": M * K, "weight": N * K, "grad": M * N}
    gemm_of = {("input", "row"): "forward", ("weight", "row"): "forward", ("grad", "row"): "dgrad",
               ("weight", "col"): "dgrad", ("grad", "col"): "wgrad", ("input", "col"): "wgrad"}
    made_in = {("input", "row"): "forward", ("input", "col"): "forward", ("weight", "row"): "forward",
               ("weight", "col"): "forward", ("grad", "row"): "backward", ("grad", "col"): "backward"}
    rows = []
    for (role, d), gemm in gemm_of.items():
        qz = recipe.q(role, d)
        n = sizes[role]
        if qz.fmt is None:
            kind, read, write = "cast to bf16 (or none)", n * hp_bytes, 0
            if qz.hp == "bf16":
                kind, read, write = "none (bf16 operand)", 0, 0
        elif role == "weight" and d == "col" and recipe.shares_weight():
            kind, read, write = "transpose of the 2-D quantized W", n, n
        else:
            blocks = n // (qz.block[0] * qz.block[1] if qz.is_2d else qz.block)
            per = 0.5 if qz.fmt == "e2m1" else 1
            kind, read, write = "quantize pass over the hp tensor", n * hp_bytes, int(n * per) + blocks
        rows.append({"recipe": recipe.name, "gemm": gemm, "operand": f"{role} ({d}-wise)", "direction": d,
                     "quantizer": qz.label,
                     "work": kind, "made_in": made_in[(role, d)], "bytes": read + write,
                     "quantize_pass": kind.startswith("quantize"), "transpose": kind.startswith("transpose")})
    return rows


def direction_disagreement(x: torch.Tensor, fmt: str, scale_rounding: str = "floor") -> float:
    """Fraction of elements of 2-D `x` whose value differs between the row-wise and the
    column-wise quantization. With power-of-two scales an element's relative rounding does not
    depend on its scale unless it saturates or falls below the format's smallest normal; this
    counts how often the direction matters."""
    a = qdq(x, fmt, axis=1, scale_rounding=scale_rounding, backend="torch")
    b = qdq(x, fmt, axis=0, scale_rounding=scale_rounding, backend="torch")
    return float((a != b).float().mean())


# ---------------------------------------------------------------------------
# Launch builder (inferbook.compiled): what `quantize_triton` launches on a GPU, without running it

def hw_cast(fmt: str, device) -> int:
    """The encoders' HW constexpr: 1 (E4M3) / 2 (E5M2) where the target converts fp32 to that format in
    hardware with round-to-nearest-even (NVIDIA sm_89 and later: `cvt.rn.satfinite.e4m3x2.f32`, PTX ISA), else
    0, the integer encoding: sm_80 (no fp8 conversion), CDNA (gfx942's fp8 is the FNUZ variant; not taken on
    gfx950 either, unverified), E2M1, and the interpreter (`device.fp8_cast_needs_emulation`). Both give the same
    codes: the reference rounds to nearest even too (a test holds PyTorch's RNE cast to it)."""
    from .. import device as _device

    device = torch.device(device)
    # a meta tensor's launch is built to be compiled for a GPU (`compiled.meta`): the interpreter never runs it
    if fmt not in ("e4m3", "e5m2") or (device.type != "meta" and _device.fp8_cast_needs_emulation(device)):
        return 0
    t = _device.kernel_target(device)
    if t is None or _device.target_vendor(t) != "nvidia" or int(t[3:]) < 89:      # 'sm_90' -> 90
        return 0
    return 1 if fmt == "e4m3" else 2


def _quantize_launch(x2d, e2d, s2d, sr: int, sc: int, fmt: str, scale_rounding: str):
    """The launch (`compiled.Launch`) `quantize_triton` makes for x2d [M, N] (sr x sc blocks), codes
    e2d uint8 [M, N] and scales s2d uint8 [ceil(M/sr), ceil(N/sc)] (tensors or `meta` stand-ins)."""
    from ..compiled import Launch

    f = FORMATS[fmt]
    M, N = x2d.shape
    MB, NB = -(-M // sr), -(-N // sc)
    nbr, nbc = _tile(sr, sc)
    # NVIDIA: 2 warps, twice the elements a thread, so a block's reduction and the broadcast of its scale
    # cross fewer threads: at 8192^2 bf16 on H200 (predicted) row-wise 56 -> 42 us, column-wise 118 -> 46 us
    # (with the key max and 128 columns), 2-D 32x32 55 -> 42 us, memory-bound or within 8 % of it; 1 warp
    # holds more registers for no more. AMD: see `_cdna_waves`
    from .. import device as _device

    grid = (triton.cdiv(MB, nbr), triton.cdiv(NB, nbc))
    warps = _device.pick_config({"nvidia": 2, "hip": _cdna_waves(grid[0] * grid[1]) if x2d.element_size() == 2 else 4},
                                x2d.device)
    warps = _device.swept("mx.quantize", {"num_warps": warps})["num_warps"]
    return Launch(f"mx_quantize {fmt} {scale_rounding} {sr}x{sc} {str(x2d.dtype)[6:]} {M}x{N}", mx_quantize_kernel,
                  [x2d, e2d, s2d, M, N, MB, NB, x2d.stride(0), x2d.stride(1), e2d.stride(0), e2d.stride(1),
                   s2d.stride(0), s2d.stride(1)],
                  dict(SR=sr, SC=sc, NBR=nbr, NBC=nbc, EMAX=f.emax, EMIN=f.emin, MBITS=f.mbits,
                       SIGN_SHIFT=f.sign_shift, MAX_NORMAL=f.max_normal, MAX_MANT=f.max_mant, NAN_CODE=f.nan_code,
                       ROUND_UP=scale_rounding == "up", HW=hw_cast(fmt, x2d.device), num_warps=warps),
                  "numerics/mx.py:quantize_triton", grid)


# CDNA, 16-bit x: one wave of 64 lanes a program (as many lanes as NVIDIA's 2 warps) where the grid holds
# at least this many programs; 4 waves below it. Predicted at 8192^2 bf16 (`inferbook sweep te-mxfp8-recipes
# gfx942 mx.quantize --kernel mx_quantize_kernel --launch quantize-speed --set num_warps=1,2,4,8`, likewise
# gfx950 and mx.quantize_rowcol --launch "one pass"): the four quantize layouts 187 -> 153 us on MI300X (all
# memory-bound) and 212 -> 140 us on MI355X, none slower; row+column in one pass 95 -> 63 us and 125 -> 70 us.
# The small bit-exact check grids (153-1105 programs) are predicted slower at one wave (74 -> 161 us in all on
# MI300X, waves-bound: fewer lanes a program, too few programs to make it up), so they keep 4
CDNA_ONE_WAVE_MIN_PROGRAMS = 4096


def _cdna_waves(programs: int) -> int:
    return 1 if programs >= CDNA_ONE_WAVE_MIN_PROGRAMS else 4


def _rowcol_launch(x, er, sr, ec, sc, fmt: str, block: int, scale_rounding: str):
    """The launch (`compiled.Launch`) `quantize_rowcol_triton` makes for x [M, N], codes er/ec uint8
    [M, N], scales sr uint8 [M, ceil(N/block)] and sc uint8 [ceil(M/block), N] (or `meta` stand-ins)."""
    from ..compiled import Launch

    f = FORMATS[fmt]
    M, N = x.shape
    NBN, MBM = -(-N // block), -(-M // block)
    tc = ROWCOL_TILE_COLS
    # fp32 x on sm_80: 8 warps (4 held 32 fp32 values of x, |x| and the codes per thread and spilled
    # 136 B at 255 registers; 8: none, 117); fp32 elsewhere keeps 4. 16-bit x on NVIDIA: 2 warps (each
    # block's reductions cross fewer threads; predicted at 8192^2 bf16: H200 90 -> 77 us, B200 75 -> 64 us,
    # still issue-bound: two encodes an element). AMD: fp32 keeps 4 waves (not swept), 16-bit `_cdna_waves`
    from .. import device as _device

    warps = (_device.pick_config({"nvidia": 4, "sm_80": 8, "hip": 4}, x.device) if x.element_size() == 4 else
             _device.pick_config({"nvidia": 2, "hip": _cdna_waves(MBM * triton.cdiv(N, tc))}, x.device))
    warps = _device.swept("mx.quantize_rowcol", {"num_warps": warps})["num_warps"]
    return Launch(f"mx_quantize_rowcol {fmt} {scale_rounding} {block} {str(x.dtype)[6:]} {M}x{N} tile {block}x{tc}",
                  mx_quantize_rowcol_kernel, [x, er, sr, ec, sc, M, N, NBN, MBM, x.stride(0), x.stride(1)],
                  dict(BLOCK=block, TC=tc, EMAX=f.emax, EMIN=f.emin, MBITS=f.mbits, SIGN_SHIFT=f.sign_shift,
                       MAX_NORMAL=f.max_normal, MAX_MANT=f.max_mant, NAN_CODE=f.nan_code,
                       ROUND_UP=scale_rounding == "up", HW=hw_cast(fmt, x.device),
                       **({"num_warps": warps} if warps != 4 else {})),
                  "numerics/mx.py:quantize_rowcol_triton", (MBM, triton.cdiv(N, tc)))


def quantize_rowcol_launches(shape, dtype=torch.bfloat16, fmt: str = "e4m3", block: int = 32,
                             scale_rounding: str = "floor", name: str = "") -> list:
    """The launch `quantize_rowcol_triton(x of `shape`/`dtype`, fmt, block, scale_rounding)` makes on a
    GPU ([] for an empty x), without running it (`compiled.Launch` list; `meta` stand-ins)."""
    from ..compiled import meta

    M, N = (int(n) for n in shape)
    if not M * N:
        return []
    NBN, MBM = -(-N // block), -(-M // block)
    u8 = torch.uint8
    launch = _rowcol_launch(meta((M, N), dtype), meta((M, N), u8), meta((M, NBN), u8), meta((M, N), u8),
                            meta((MBM, N), u8), fmt, block, scale_rounding)
    if name:
        launch.name = name
    return [launch]


def quantize_launches(shape, dtype=torch.bfloat16, fmt: str = "e4m3", axis: int | None = -1, block=32,
                      scale_rounding: str = "floor", name: str = "") -> list:
    """The launch `quantize_triton(x of `shape`/`dtype`, fmt, axis, block, scale_rounding)` makes,
    from the same `_as_2d` / `_tile` and arguments (`compiled.Launch` list; `meta` stand-ins)."""
    from ..compiled import meta

    x = meta(shape, dtype)
    axis, block = _check_args(x, fmt, axis, block, scale_rounding)
    x2d, sr, sc, _ = _as_2d(x, axis, block)
    M, N = x2d.shape
    launch = _quantize_launch(x2d, meta((M, N), torch.uint8), meta((-(-M // sr), -(-N // sc)), torch.uint8), sr, sc,
                              fmt, scale_rounding)
    if name:
        launch.name = name
    return [launch]


# ---------------------------------------------------------------------------
# A block-scaled GEMM on the MX codes and scales: C = dequantize(x) @ dequantize(W).T
#
# `tl.dot_scaled` takes the E4M3/E5M2 codes (uint8) and the E8M0 scales (uint8, one per 32 along K)
# as `quantize` stores them. On sm_100 Triton lowers it to `tcgen05.mma ... kind::mxf8f6f4.block_scale`
# (the scales go to tensor memory, the tensor core applies them); on sm_90 and sm_80, which have no
# block-scaled MMA, it upcasts both operands to BF16 in registers (code * 2**(scale - 127), exact for
# E4M3/E5M2 unless the scale underflows BF16) and runs a BF16 MMA. sm_80 has no FP8 types: there
# (chosen at compile time, `cuda_capability_geq`) the kernel decodes the codes in integer ops and runs
# a BF16 `mma.sync`. The interpreter has no `dot_scaled`: EMULATE takes the same decode, fp32 `tl.dot`.

MX_GEMM_FORMATS = ("e4m3", "e5m2")

if triton is not None:
    from triton.language.target_info import cuda_capability_geq

    @triton.jit
    def _mx_decode_f32(codes, scales, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                       NAN_ALL_ONES: tl.constexpr, BLOCK_K: tl.constexpr):
        """[R, BLOCK_K] uint8 FP8 codes and [R, BLOCK_K/32] E8M0 bytes -> fp32 values, in integer ops (no
        fp8 types: sm_80 has none, and the interpreter checks the same code). NAN_ALL_ONES: E4M3's
        NaN is S.1111.111 only (no infinities); else (E5M2) exponent all ones is Inf / NaN."""
        c = codes.to(tl.int32)
        sign = (c >> 7) << 31
        e = (c >> MBITS) & ((1 << EBITS) - 1)
        m = c & ((1 << MBITS) - 1)
        normal = (sign | ((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * (2.0 ** (1 - BIAS - MBITS))
        sub = tl.where(sign != 0, -sub, sub)
        v = tl.where(e == 0, sub, normal)
        if NAN_ALL_ONES:
            v = tl.where((e == (1 << EBITS) - 1) & (m == (1 << MBITS) - 1), float("nan"), v)
        else:
            top = e == (1 << EBITS) - 1
            v = tl.where(top & (m != 0), float("nan"), tl.where(top, tl.where(sign != 0, -float("inf"), float("inf")), v))
        sc = scales.to(tl.int32)
        s = (sc << 23).to(tl.float32, bitcast=True)                          # 2**(e - 127) for e >= 1
        s = tl.where(sc == 0, 5.877471754111438e-39, s)                      # e = 0: 2**-127, an fp32 subnormal
        s = tl.where(sc == 255, float("nan"), s)
        v = tl.reshape(v, (v.shape[0], BLOCK_K // 32, 32)) * s[:, :, None]
        return tl.reshape(v, (v.shape[0], BLOCK_K))

    @triton.jit
    def mx_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                       FMT_A: tl.constexpr, FMT_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, EA: tl.constexpr = 4, MA: tl.constexpr = 3,
                       BA: tl.constexpr = 7, EB: tl.constexpr = 4, MB: tl.constexpr = 3, BB: tl.constexpr = 7,
                       DOT_FP32: tl.constexpr = True):
        """C[M, N] fp32 = Σ_k A[m, k] 2**(sa[m, k/32] - 127) · B[n, k] 2**(sb[n, k/32] - 127).
        A uint8 codes [M, K], sa uint8 [M, K/32]; B uint8 codes [N, K] (row-wise along K), sb [N, K/32].
        K a multiple of BLOCK_K (a multiple of 32)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // 32)
        m_ok = offs_m < M
        n_ok = offs_n < N
        KG = K // 32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0)
            sa = tl.load(as_ptr + offs_m[:, None] * KG + (k0 // 32 + offs_g)[None, :], mask=m_ok[:, None], other=0)
            sb = tl.load(bs_ptr + offs_n[:, None] * KG + (k0 // 32 + offs_g)[None, :], mask=n_ok[:, None], other=0)
            if EMULATE or not cuda_capability_geq(8, 9):   # the interpreter, or no FP8 types (sm_80)
                av = _mx_decode_f32(a, sa, EA, MA, BA, FMT_A == "e4m3", BLOCK_K)
                bv = tl.trans(_mx_decode_f32(b, sb, EB, MB, BB, FMT_B == "e4m3", BLOCK_K))
                if DOT_FP32:  # the interpreter (its bf16 dot is wrong): fp32, exact products
                    acc = tl.dot(av, bv, acc, input_precision="ieee")
                else:         # sm_80: the decoded values are exact in BF16 (8 exponent bits), BF16 MMA
                    acc = tl.dot(av.to(tl.bfloat16), bv.to(tl.bfloat16), acc)
            else:
                acc = tl.dot_scaled(a, sa, FMT_A, tl.trans(b), sb, FMT_B, acc)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def mx_gemm_config(interpreted: bool, device="cuda") -> dict:
    """Tiles: 128 x 128 x 128, 8 warps (no spills on sm_90 and sm_100; sm_90 128 x 256 x 64, below), 2 stages on a GPU (the tile tcgen05's block-scaled MMA wants; two
    stages keep sm_80's register-decode path inside its shared memory); one 32 x 32 x 64 program per
    tile in the interpreter. sm_80 (`device.pick_config`: the target `device` or `building_for`
    names) takes BLOCK_K 32: there both operands are decoded to fp32 in registers before the BF16
    MMA, and a 128-wide K step holds two [128, 128] decoded tiles per program — ptxas spilled 36 KB
    (BLOCK_K 64: 1.4 KB; 32: none, 217 registers). Same M x N tile, so the decode still amortizes
    over 128 rows and columns."""
    if interpreted:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64)
    from .. import device as _device

    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2)
    # sm_90 has no block-scaled MMA: Triton decodes the codes to bf16 in registers before the wgmma, so a
    # 256-wide N tile halves the A decodes an output; with a 64-wide K step it holds no spill. Predicted at
    # 4096^3 (waves-bound) 202 -> 156 us, the best of the 32 swept without a spill (`inferbook sweep
    # te-mxfp8-recipes sm_90 mx.gemm --kernel mx_gemm_kernel --launch timed --set BLOCK_M=64,128 --set
    # BLOCK_N=128,256 --set BLOCK_K=64,128 --set num_warps=4,8 --set num_stages=2,3`)
    return dict(_device.swept("mx.gemm", _device.pick_config({"nvidia": cfg, "sm_80": {**cfg, "BLOCK_K": 32},
                                                               "sm_90": {**cfg, "BLOCK_N": 256, "BLOCK_K": 64}}, device)))


def _check_gemm_operand(t, name: str, k: int | None = None) -> None:
    if not isinstance(t, MXTensor):
        raise ValueError(f"mx_gemm: {name} must be an MXTensor from quantize(), got {type(t).__name__}")
    if t.fmt not in MX_GEMM_FORMATS:
        raise ValueError(f"mx_gemm: {name} is {t.fmt}; the block-scaled GEMM takes {', '.join(MX_GEMM_FORMATS)}")
    if t.elements.ndim != 2 or t.axis not in (-1, 1) or t.block != 32:
        raise ValueError(f"mx_gemm: {name} must be 2-D with 32-element blocks along its last axis (K), got "
                         f"shape {tuple(t.elements.shape)}, axis {t.axis}, block {t.block}")
    if k is not None and t.elements.shape[1] != k:
        raise ValueError(f"mx_gemm: {name} has K = {t.elements.shape[1]}, expected {k}")


def mx_gemm_reference(a: MXTensor, b: MXTensor) -> torch.Tensor:
    """fp32 [M, N]: dequantize both, then a matmul in fp32 (float64 accumulation, rounded once)."""
    return (dequantize(a).double() @ dequantize(b).double().T).float()


def mx_gemm(a: MXTensor, b: MXTensor, *, block: dict | str | None = None) -> torch.Tensor:
    """Block-scaled GEMM C = dequantize(a) @ dequantize(b).T in fp32 from the MX codes and scales.
    a: [M, K] quantized along K; b: [N, K] quantized along K (a weight as a Linear stores it); both
    E4M3 or E5M2 with 32-element blocks, K a multiple of the tile's BLOCK_K (pad with zeros otherwise).
    `block="gpu"`: the GPU's tiles, also in the interpreter."""
    _check_gemm_operand(a, "a")
    M, K = a.elements.shape
    _check_gemm_operand(b, "b", K)
    N = b.elements.shape[0]
    ok = triton is not None and (a.elements.device.type == "cuda" or _interpreted())
    on_gpu = a.elements.device.type == "cuda"
    dev = a.elements.device
    cfg = dict(mx_gemm_config(False, dev) if block == "gpu" else (block or mx_gemm_config(not on_gpu, dev)))
    if K % cfg["BLOCK_K"]:
        raise ValueError(f"mx_gemm: K = {K} must be a multiple of BLOCK_K = {cfg['BLOCK_K']}")
    if not ok:
        return mx_gemm_reference(a, b)
    c = torch.empty((M, N), dtype=torch.float32, device=a.elements.device)
    la = _mx_gemm_launch(a.elements.contiguous(), a.scales.contiguous(), b.elements.contiguous(), b.scales.contiguous(),
                         c, a.fmt, b.fmt, cfg, emulate=not on_gpu, dot_fp32=not on_gpu)
    la.kernel[la.grid](*la.args, **la.kwargs)
    return c


def _interpreted() -> bool:
    """TRITON_INTERPRET as Triton reads it (`device.triton_interpreted`: 'true' is on, 'off' is off)."""
    from ..device import triton_interpreted

    return triton_interpreted()


def _mx_gemm_launch(a, sa, b, sb, c, fmt_a: str, fmt_b: str, cfg: dict, *, emulate: bool, dot_fp32: bool = False):
    from ..compiled import Launch

    M, K = a.shape
    N = b.shape[0]
    return Launch(f"mx_gemm {fmt_a} x {fmt_b} M{M} N{N} K{K} cfg {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}",
                  mx_gemm_kernel, [a, sa, b, sb, c, M, N, K, a.stride(0), b.stride(0), c.stride(0)],
                  dict(FMT_A=fmt_a, FMT_B=fmt_b, EMULATE=emulate, EA=FORMATS[fmt_a].ebits, MA=FORMATS[fmt_a].mbits,
                       BA=FORMATS[fmt_a].bias, EB=FORMATS[fmt_b].ebits, MB=FORMATS[fmt_b].mbits, BB=FORMATS[fmt_b].bias,
                       DOT_FP32=dot_fp32, **cfg), "numerics/mx.py:mx_gemm",
                  (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"])))


def mx_gemm_launches(m: int, n: int, k: int, fmt_a: str = "e4m3", fmt_b: str = "e4m3", name: str = "") -> list:
    """The launch `mx_gemm` makes on a GPU for a [m, k] x [n, k] MX product (`meta` stand-ins); the
    kernel picks its path from the target it is compiled for (dot_scaled from sm_89, decode on sm_80)."""
    from ..compiled import meta

    u8 = torch.uint8
    la = _mx_gemm_launch(meta((m, k), u8), meta((m, k // 32), u8), meta((n, k), u8), meta((n, k // 32), u8),
                         meta((m, n), torch.float32), fmt_a, fmt_b, mx_gemm_config(False), emulate=False)
    if name:
        la.name = name
    return [la]
