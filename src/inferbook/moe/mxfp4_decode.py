"""MXFP4 weights repacked for the decode loop: e2m1 codes straight into the MMA operand in 2 to 4 bit
instructions a pair of weights and one BF16 FMA that applies the group's E8M0 scale too.

`moe.mxfp4` packs OCP MX e2m1 codes two to a byte and decodes them with a chain of compares and selects
(`mxfp4_tile`): some thirty instructions a weight, which is why its tails are instruction-bound. This
module is the MXFP4 counterpart of `w4a16.pack_decode`: an offline repack (once, at load time, as
Marlin's is) into the decode kernels' runs of 256 K values, and the in-loop decode.

The decode is Marlin's (vLLM `csrc/quantization/marlin/dequant.h`, `dequant<nv_bfloat162, kFE2M1f>`):
put an e2m1 code's sign in BF16's sign bit and its three magnitude bits (exponent e1 e0, mantissa m) in
BF16 bits 8..6 (the low two exponent bits and the top mantissa bit). Those BF16 bits read as the e2m1
value times 2**-126 exactly, the codes 0 and 0.5 included (BF16 subnormals, whose spacing is e2m1's
with the same factor); one BF16 multiply by 2**126 (Marlin's `__hmul2` by its bias register) makes
every value the exact, normal e2m1 number, so the tensor cores never see a subnormal operand. Marlin
then multiplies its B fragment by the group's scale (a second `__hmul2` a pair); ours folds the E8M0
scale into the one FMA (multiplier 2**(b - 1), `pair_scale`), so the MMA accumulates straight into the
fp32 sum, for scale bytes in FOLD_SCALES; a tensor with a byte outside takes the exact path, which scales
each group's fp32 dot as `w4a16.decode_run` applies its BF16 group scales (`DecodeMXFP4.fold` says which).

Where ours differs from Marlin: Marlin's pairs are nibbles i and i + 4 of one word (its repack
interleaves them), so `(q & 0x80008000) | ((q & 0x70007000) >> 6)` decodes a pair from one register.
Triton hands an inline asm two elements of its own choosing (`pack=2`, here two adjacent K rows: two
words), so a pair is first assembled with one `prmt` (two bytes of each word into the two halves), and
the codes are laid out in the word so that after that `prmt`, five of a word's eight codes need one
shift and one AND, one needs the AND alone, and two need a shift, an AND and an AND-OR (`CODE_BITS`,
found by an exhaustive search over byte pairs and shifts: no layout serves all eight with one shift).
That is 3.1 integer instructions a pair on average, plus the FMA; W4A16's loop takes 2.5 and a second MMA.

Layout (``mxfp4 decode``), for one weight ``W [N, K]`` (``[E, ...]`` in front for experts), K padded to
Kp (a multiple of 256; pad codes 0, pad scales 127 = 1.0):

- ``qweight`` int32 ``[Kp/8, N]``: runs of 256 K values; word j of run r of column n holds the codes of
  K offsets 256 r + 32 i + j for i = 0..7, code i's sign / e1 / e0 / m at word bits ``CODE_BITS[i]``.
- ``scales`` uint8 ``[Kp/256, N, 8]``: the E8M0 byte of group 8 r + i of column n at [r, n, i].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import mxfp4 as MXF
from .mxfp4 import PackedMXFP4

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

RUN = 256
RUN_WORDS = RUN // 8
LAYOUT = "mxfp4 decode"
PAD_SCALE = 127          # E8M0 1.0: the zero pad codes times a finite scale
# The E8M0 bytes whose scale the decode folds into its BF16 FMA (`decode_run_fp4`'s FOLD): 2**(b - 1) must be
# a finite BF16 (b <= 128) and every nonzero weight 0.5 x 2**(b - 127) a normal one (b >= 2), so the MMA
# sees no subnormal. Real weights sit far inside (|w| < 12 and > 2**-125); a tensor with a byte outside
# takes the exact path, which applies 2**(b - 127) to the fp32 dot (2**-127 at b 0, NaN at 255).
FOLD_SCALES = (2, 128)
TWO_126 = 2.0 ** 126
BF16X2_TWO_126 = 0x7E807E80   # 2**126 in both halves (exponent 253)

# Each code's decode: (low byte l, high byte h) of the 16-bit chunk `prmt` assembles from a word (h above
# l), then either one left shift `k` of the chunk and the mask 0x81C0 per half ("fast"), or, "two-shift",
# the sign shifted by `a` and the magnitude left in place, joined by an AND-OR.
# The search (the module docstring) minimised the instructions a word; each entry is (l, h, kind, shift).
CODE_DECODE = (
    (1, 0, "fast", 0),
    (0, 1, "fast", 5),
    (0, 1, "fast", 2),
    (2, 1, "two-shift", 6),
    (2, 1, "fast", 4),
    (3, 1, "fast", 3),
    (3, 2, "two-shift", 2),
    (3, 2, "fast", 6),
)


def _chunk_bit(p: int, l: int, h: int) -> int:
    """Word bit of bit p (0..15) of the chunk made of byte h (bits 8-15) over byte l (bits 0-7)."""
    return 8 * h + (p - 8) if p >= 8 else 8 * l + p


def _code_bits() -> tuple[tuple[int, int, int, int], ...]:
    """Word bit positions of each code's (sign, e1, e0, m), from `CODE_DECODE`: after the shift(s) the
    sign lands on the half's bit 15 and the magnitude on bits 8, 7, 6."""
    out = []
    for l, h, kind, s in CODE_DECODE:
        sign_shift, mag_shift = (s, s) if kind == "fast" else (s, 0)
        out.append((_chunk_bit(15 - sign_shift, l, h),) + tuple(_chunk_bit(t - mag_shift, l, h) for t in (8, 7, 6)))
    return tuple(out)


CODE_BITS = _code_bits()
assert sorted(b for code in CODE_BITS for b in code) == list(range(32)), "the codes must fill the word"
PRMT_SEL = tuple(l | h << 4 | (4 + l) << 8 | (4 + h) << 12 for l, h, _, _ in CODE_DECODE)       # PTX prmt
PERM_SEL = tuple(l | h << 8 | (4 + l) << 16 | (4 + h) << 24 for l, h, _, _ in CODE_DECODE)      # v_perm_b32


@dataclass(frozen=True)
class DecodeMXFP4:
    """MXFP4 weights in the decode loop's layout (the module docstring): qweight int32 [Kp/8, N], scales
    uint8 [Kp/256, N, 8], [E, ...] in front for E experts. `shape` is the logical (N, K) or (E, N, K)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple
    layout: str = LAYOUT
    group_size: int = MXF.BLOCK
    fold: bool = True   # every scale byte in FOLD_SCALES: the decode loop folds the scale into its FMA

    @property
    def k_padded(self) -> int:
        return self.qweight.shape[-2] * 8

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel()


def pack_decode(p: PackedMXFP4) -> DecodeMXFP4:
    """Repack MXFP4 weights [N, K] or [E, N, K] (`mxfp4.quantize`'s layout) for the decode loop, offline."""
    if not isinstance(p, PackedMXFP4) or len(p.shape) not in (2, 3):
        raise ValueError(f"pack_decode needs a PackedMXFP4 [N, K] or [E, N, K], got {getattr(p, 'shape', type(p).__name__)}")
    m = MXF.unpack(p)
    codes = m.elements.to(torch.int64).reshape(-1, *p.shape[-2:])          # [E, N, K] 0..15
    s = m.scales.to(torch.uint8).reshape(-1, p.shape[-2], p.shape[-1] // MXF.BLOCK)
    E, N, K = codes.shape
    Kp = -(-K // RUN) * RUN
    if Kp != K:
        codes = torch.cat([codes, codes.new_zeros((E, N, Kp - K))], -1)
        s = torch.cat([s, torch.full((E, N, (Kp - K) // MXF.BLOCK), PAD_SCALE, dtype=torch.uint8, device=s.device)], -1)
    u = codes.reshape(E, N, Kp // RUN, 8, RUN_WORDS)                        # [E, N, run, code i, word j]
    word = torch.zeros((E, N, Kp // RUN, RUN_WORDS), dtype=torch.int64, device=codes.device)
    for i, (ps, pe1, pe0, pm) in enumerate(CODE_BITS):
        c = u[:, :, :, i]
        word |= ((c >> 3) & 1) << ps | ((c >> 2) & 1) << pe1 | ((c >> 1) & 1) << pe0 | (c & 1) << pm
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    qweight = word.reshape(E, N, Kp // 8).transpose(1, 2).contiguous()       # [E, Kp/8, N]
    scales = s.reshape(E, N, Kp // RUN, 8).permute(0, 2, 1, 3).contiguous()  # [E, runs, N, 8]
    fold = bool(((s >= FOLD_SCALES[0]) & (s <= FOLD_SCALES[1])).all())
    if len(p.shape) == 2:
        qweight, scales = qweight[0], scales[0]
    return DecodeMXFP4(qweight, scales, tuple(p.shape), fold=fold)


def unpack_decode(d: DecodeMXFP4) -> PackedMXFP4:
    """The inverse of `pack_decode`: `mxfp4.pack`'s layout in the logical shape."""
    E, N, K = (1, *d.shape) if len(d.shape) == 2 else d.shape
    Kp = d.k_padded
    word = d.qweight.reshape(E, Kp // 8, N).transpose(1, 2).reshape(E, N, Kp // RUN, RUN_WORDS).to(torch.int64)
    word = word & 0xFFFFFFFF
    codes = torch.zeros((E, N, Kp // RUN, 8, RUN_WORDS), dtype=torch.int64, device=word.device)
    for i, (ps, pe1, pe0, pm) in enumerate(CODE_BITS):
        codes[:, :, :, i] = ((word >> ps) & 1) << 3 | ((word >> pe1) & 1) << 2 | ((word >> pe0) & 1) << 1 | ((word >> pm) & 1)
    codes = codes.reshape(E, N, Kp)[..., :K].to(torch.uint8)
    s = d.scales.reshape(E, Kp // RUN, N, 8).permute(0, 2, 1, 3).reshape(E, N, Kp // MXF.BLOCK)[..., :K // MXF.BLOCK]
    c = codes.reshape(E, N, K // 2, 2)
    q = (c[..., 0] | (c[..., 1] << 4)).contiguous()
    shape = tuple(d.shape)
    if len(shape) == 2:
        q, s = q[0], s[0]
    return PackedMXFP4(q, s.contiguous(), shape)


def dequantize_decode(d: DecodeMXFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights of a decode-packed buffer in the logical shape (`numerics.mx.dequantize`, exact)."""
    return MXF.dequantize(unpack_decode(d), dtype)


def decode_weight_bytes(n: int, k: int) -> int:
    """Bytes one [N, K] weight occupies in `pack_decode`'s layout (K padded to 256): what the loop reads."""
    kp = -(-k // RUN) * RUN
    return n * kp // 2 + n * kp // MXF.BLOCK


def decode_packed_shapes(n: int, k: int) -> tuple[tuple, tuple]:
    """The shapes `pack_decode` gives one [N, K] weight: int32 words [Kp/8, N], uint8 scales [Kp/256, N, 8]."""
    kp = -(-k // RUN) * RUN
    return (kp // 8, n), (kp // RUN, n, 8)


# ---------------------------------------------------------------------------
# Python models of the in-kernel decode (the interpreter cannot run PTX or AMDGCN; tests check the asm's
# bit logic through these)

def _prmt(w0: int, w1: int, sel: int) -> int:
    """PTX `prmt.b32 d, w0, w1, sel` (default mode, selector nibbles 0-7 only): byte k of d is byte
    sel[k] of the 64-bit {w1:w0}."""
    src = [(w0 >> (8 * k)) & 0xFF for k in range(4)] + [(w1 >> (8 * k)) & 0xFF for k in range(4)]
    return sum(src[(sel >> (4 * k)) & 0x7] << (8 * k) for k in range(4))


def _v_perm(w0: int, w1: int, sel: int) -> int:
    """AMDGCN `v_perm_b32 d, w1, w0, sel` for selector bytes 0-7: byte k of d is byte sel[k] of {w1:w0}."""
    src = [(w0 >> (8 * k)) & 0xFF for k in range(4)] + [(w1 >> (8 * k)) & 0xFF for k in range(4)]
    return sum(src[(sel >> (8 * k)) & 0xFF] << (8 * k) for k in range(4))


def code_bits_model(w0: int, w1: int, i: int, *, amd: bool = False) -> int:
    """The 32-bit register the decode asm builds for code `i` of two words before the multiply: two BF16
    halves, e2m1 value times 2**-126 each (the low half from w0). PTX: prmt, then `shl` + `and` (fast) or
    `shl` + `and` + `lop3` (two-shift); AMDGCN: v_perm_b32 then the same shifts and masks."""
    l, h, kind, s = CODE_DECODE[i]
    t = _v_perm(w0, w1, PERM_SEL[i]) if amd else _prmt(w0, w1, PRMT_SEL[i])
    if kind == "fast":
        return (t << s) & 0x81C081C0
    return ((t << s) & 0x80008000) | (t & 0x01C001C0)


def bf16_times_two_126(bits: int) -> int:
    """`fma.rn.bf16x2 d, x, 2**126, -0` on one half, in Python: the BF16 value times 2**126 (exact: the
    result is an e2m1 number, two significant bits), as BF16 bits."""
    v = torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double() * TWO_126
    return int(torch.tensor([v.item()], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def decode_asm_model(w0: int, w1: int, i: int, *, amd: bool = False) -> tuple[int, int]:
    """The two BF16 weights (bits) the decode gives for code `i` of words w0, w1: `code_bits_model`, then
    each half times 2**126 (`bf16_times_two_126`)."""
    r = code_bits_model(w0, w1, i, amd=amd)
    return bf16_times_two_126(r & 0xFFFF), bf16_times_two_126(r >> 16)


if triton is not None:

    from .w4a16 import group_activations

    @triton.jit
    def _fp4_pair_ptx(words, mult, SEL: tl.constexpr, KIND: tl.constexpr, SHIFT: tl.constexpr):
        """Two BF16 weights from one code of two words: `code_bits_model` (KIND 0: the mask alone; 1: one shift
        and the mask; 2: the two-shift form), then fma.rn.bf16x2 by `mult` (int32, a BF16 multiplier in both
        halves: 2**(b - 1) from `pair_scale`, the e2m1 value x 2**(b - 127), or 2**126, the bare value). BF16
        FMA takes the subnormal inputs exactly and the result is normal. The pair is two K rows of one column
        (Triton runs the asm in the MMA operand layout, `dot_op` opIdx 1 with kWidth 2:
        tests/test_mxfp4_decode.py reads it from the TTGIR), so $3 serves both halves."""
        if KIND == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, z; prmt.b32 t, $1, $2, " + SEL + "; and.b32 t, t, 0x81C081C0; "
                "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z; }",
                "=r,r,r,r,r", [words, mult], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif KIND == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, z; prmt.b32 t, $1, $2, " + SEL + "; shl.b32 t, t, " + SHIFT + "; "
                "and.b32 t, t, 0x81C081C0; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z; }",
                "=r,r,r,r,r", [words, mult], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, u, z; prmt.b32 t, $1, $2, " + SEL + "; shl.b32 u, t, " + SHIFT + "; "
                "and.b32 t, t, 0x01C001C0; lop3.b32 t, u, 0x80008000, t, 0xEA; "
                "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z; }",
                "=r,r,r,r,r", [words, mult], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def fp4_pair_ptx(words, mult, I: tl.constexpr):
        """[32, BN] int32 words -> [32, BN] bf16: code I times `mult` (`_fp4_pair_ptx`), code I's selector,
        kind and shift from `CODE_DECODE` (`PRMT_SEL`)."""
        if I == 0:
            return _fp4_pair_ptx(words, mult, "0x4501", 0, "0")
        elif I == 1:
            return _fp4_pair_ptx(words, mult, "0x5410", 1, "5")
        elif I == 2:
            return _fp4_pair_ptx(words, mult, "0x5410", 1, "2")
        elif I == 3:
            return _fp4_pair_ptx(words, mult, "0x5612", 2, "6")
        elif I == 4:
            return _fp4_pair_ptx(words, mult, "0x5612", 1, "4")
        elif I == 5:
            return _fp4_pair_ptx(words, mult, "0x5713", 1, "3")
        elif I == 6:
            return _fp4_pair_ptx(words, mult, "0x6723", 2, "2")
        else:
            return _fp4_pair_ptx(words, mult, "0x6723", 1, "6")

    @triton.jit
    def _fp4_bits_amd(words, SEL: tl.constexpr, KIND: tl.constexpr, SHIFT: tl.constexpr):
        """The AMDGCN form of `code_bits_model` (BF16 bits, value times 2**-126): v_perm_b32 assembles the
        pair (its VOP3 encoding takes the selector as a register), v_lshlrev_b32 and v_and_b32 (a VOP2
        literal) place it; the two-shift codes join sign and magnitude with v_and_or_b32, its mask a register."""
        sel = tl.full(words.shape, SEL, tl.int32)
        if KIND == 0:
            return tl.inline_asm_elementwise(
                "v_perm_b32 $0, $2, $1, $3\n v_and_b32 $0, 0x81C081C0, $0",
                "=&v,v,v,v,v", [words, sel], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif KIND == 1:
            return tl.inline_asm_elementwise(
                "v_perm_b32 $0, $2, $1, $3\n v_lshlrev_b32 $0, " + SHIFT + ", $0\n v_and_b32 $0, 0x81C081C0, $0",
                "=&v,v,v,v,v", [words, sel], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            sign = tl.full(words.shape, -2147450880, tl.int32)    # 0x80008000
            return tl.inline_asm_elementwise(
                "v_perm_b32 $0, $3, $2, $4\n v_lshlrev_b32 $1, " + SHIFT + ", $0\n v_and_b32 $0, 0x01C001C0, $0\n "
                "v_and_or_b32 $0, $1, $6, $0",
                "=&v,=&v,v,v,v,v,v,v", [words, sel, sign], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                pack=2)[0]

    @triton.jit
    def fp4_bits_amd(words, I: tl.constexpr):
        """[32, BN] int32 words -> [32, BN] bf16 bits of code I (value x 2**-126), by `_fp4_bits_amd`."""
        if I == 0:
            return _fp4_bits_amd(words, 0x04050001, 0, "0")
        elif I == 1:
            return _fp4_bits_amd(words, 0x05040100, 1, "5")
        elif I == 2:
            return _fp4_bits_amd(words, 0x05040100, 1, "2")
        elif I == 3:
            return _fp4_bits_amd(words, 0x05060102, 2, "6")
        elif I == 4:
            return _fp4_bits_amd(words, 0x05060102, 1, "4")
        elif I == 5:
            return _fp4_bits_amd(words, 0x05070103, 1, "3")
        elif I == 6:
            return _fp4_bits_amd(words, 0x06070203, 2, "2")
        else:
            return _fp4_bits_amd(words, 0x06070203, 1, "6")

    @triton.jit
    def _fp4_value_tl(words, PS: tl.constexpr, PE1: tl.constexpr, PE0: tl.constexpr, PM: tl.constexpr):
        """The plain-tl decode (the interpreter): fp32 bits sign << 31 | e1 << 24 | e0 << 23 | m << 22 from the
        code's word bits (the BF16 bits' fp32 image: value times 2**-126, an fp32 subnormal for e 0), times
        2**126 in fp32, exact. fp32, not BF16: the interpreter flushes BF16 subnormals when it widens them."""
        b = ((((words >> PS) & 1) << 31) | (((words >> PE1) & 1) << 24) | (((words >> PE0) & 1) << 23)
             | (((words >> PM) & 1) << 22))
        return b.to(tl.float32, bitcast=True) * TWO_126_F32

    @triton.jit
    def fp4_code_bf16(words, I: tl.constexpr, ASM: tl.constexpr):
        """[32, BN] int32 words -> [32, BN] bf16, the exact e2m1 values of code I (no scale). ASM 1: PTX
        (NVIDIA; the 2**126 multiply inside the asm, one fma.rn.bf16x2 a pair); 2: AMDGCN bits, then the
        multiply in fp32 (CDNA3 has no packed BF16 multiply); 0: plain tl ops in fp32 (`_fp4_value_tl`)."""
        if ASM == 1:
            return fp4_pair_ptx(words, tl.full(words.shape, BF16X2_TWO_126_C, tl.int32), I)
        else:
            if ASM == 2:
                b = fp4_bits_amd(words, I)
                b = b.to(tl.float32) * TWO_126_F32
            else:
                if I == 0:
                    b = _fp4_value_tl(words, 7, 0, 15, 14)
                elif I == 1:
                    b = _fp4_value_tl(words, 10, 3, 2, 1)
                elif I == 2:
                    b = _fp4_value_tl(words, 13, 6, 5, 4)
                elif I == 3:
                    b = _fp4_value_tl(words, 9, 8, 23, 22)
                elif I == 4:
                    b = _fp4_value_tl(words, 11, 20, 19, 18)
                elif I == 5:
                    b = _fp4_value_tl(words, 12, 29, 28, 27)
                elif I == 6:
                    b = _fp4_value_tl(words, 21, 16, 31, 30)
                else:
                    b = _fp4_value_tl(words, 17, 26, 25, 24)
            return b.to(tl.bfloat16)

    @triton.jit
    def fp4_scaled_bf16(words, I: tl.constexpr, ASM: tl.constexpr, sw):
        """[32, BN] int32 words and sw, int32 [BN]: the column's scale word of group I's four (byte I % 4 its
        E8M0 byte b, in FOLD_SCALES) -> [32, BN] bf16 weights e2m1 x 2**(b - 127), exact and normal. ASM 1:
        the scale folded into the PTX FMA (`fp4_pair_ptx`, `pair_scale`); otherwise `fp4_code_bf16`
        times the fp32 scale, then BF16 (exact)."""
        if ASM == 1:
            return fp4_pair_ptx(words, pair_scale(sw, I % 4)[None, :], I)
        elif ASM == 2:
            # the AMDGCN bits (value x 2**-126; fp32 subnormals are kept: Triton's AMD kernels run
            # "denormal-fp-math-f32"="ieee") times 2**(b - 1) in fp32 is the exact weight, a BF16 number:
            # the high half of its fp32 bits, no rounding sequence (gfx942 has no BF16 convert)
            b = (sw >> (8 * (I % 4))) & 255
            m = ((b + 126) << 23).to(tl.float32, bitcast=True)    # 2**(b - 1)
            p = fp4_bits_amd(words, I).to(tl.float32) * m[None, :]
            return (p.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            b = (sw >> (8 * (I % 4))) & 255
            s = (b << 23).to(tl.float32, bitcast=True)            # 2**(b - 127), normal for b in FOLD_SCALES
            return (fp4_code_bf16(words, I, ASM).to(tl.float32) * s[None, :]).to(tl.bfloat16)

    @triton.jit
    def pair_scale(sw, J: tl.constexpr):
        """int32 [BN]: BF16 2**(b - 1) (= 2**126 x the E8M0 scale 2**(b - 127)) in both halves, b = byte J of
        sw (in FOLD_SCALES, so the exponent field b + 126 stays in 128..254): `prmt` puts b in bytes 0 and 2
        (zero in 1 and 3), `mad` makes ((b + 126) << 7) x 0x10001 of it: two instructions a column."""
        if J == 0:
            return tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4040; mad.lo.u32 $0, t, 128, 0x3F003F00; }",
                                             "=r,r", [sw], dtype=tl.int32, is_pure=True, pack=1)
        elif J == 1:
            return tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4141; mad.lo.u32 $0, t, 128, 0x3F003F00; }",
                                             "=r,r", [sw], dtype=tl.int32, is_pure=True, pack=1)
        elif J == 2:
            return tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4242; mad.lo.u32 $0, t, 128, 0x3F003F00; }",
                                             "=r,r", [sw], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4343; mad.lo.u32 $0, t, 128, 0x3F003F00; }",
                                             "=r,r", [sw], dtype=tl.int32, is_pure=True, pack=1)

    TWO_126_F32: tl.constexpr = tl.constexpr(TWO_126)
    BF16X2_TWO_126_C: tl.constexpr = tl.constexpr(BF16X2_TWO_126)

    @triton.jit
    def e8m0_scale(s_ptr, r, i, offs_n, n_ok, N, EVEN_N: tl.constexpr):
        """fp32 [BLOCK_N] scales 2**(b - 127) of group i of run r (one byte a column from the [runs, N, 8]
        layout), exact as `numerics.mx.dequantize` has them: b 0 is the fp32 subnormal 2**-127, 255 NaN."""
        if EVEN_N:
            b = tl.load(s_ptr + (r * N + offs_n) * 8 + i).to(tl.int32)
        else:
            b = tl.load(s_ptr + (r * N + offs_n) * 8 + i, mask=n_ok, other=PAD_SCALE_C).to(tl.int32)
        bits = tl.where(b == 0, 0x400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    PAD_SCALE_C: tl.constexpr = tl.constexpr(PAD_SCALE)
    PAD_SCALE_WORD: tl.constexpr = tl.constexpr(PAD_SCALE * 0x01010101)   # four pad bytes

    @triton.jit
    def decode_run_fp4(acc, x_ptr, stride_xm, offs_m, m_ok, qw_ptr, s_ptr, row_stride, offs_n, n_ok, K, r,
                       ASM: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                       FOLD: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] fp32 += x[offs_m, run r] @ W[offs_n, run r].T for one run of 256 K values
        of `pack_decode`'s MXFP4 layout: one [32, BLOCK_N] word tile, eight code tiles of one group each,
        each decoded straight into the MMA operand. FOLD (every scale byte in FOLD_SCALES, `DecodeMXFP4.fold`):
        the group's scale rides in the decode's one BF16 FMA and the MMA accumulates into acc (Marlin scales
        its B fragment the same way); otherwise each group's fp32 dot times its exact E8M0 scale
        (`e8m0_scale`: 2**-127 and NaN as `numerics.mx.dequantize` has them). The counterpart of
        `w4a16.decode_run`, with no second MMA (e2m1 has no offset to remove)."""
        offs_j = tl.arange(0, 32)
        if EVEN_N:
            words = tl.load(qw_ptr + (r * 32 + offs_j)[:, None] * row_stride + offs_n[None, :])
        else:
            words = tl.load(qw_ptr + (r * 32 + offs_j)[:, None] * row_stride + offs_n[None, :], mask=n_ok[None, :],
                            other=0)
        if FOLD:  # the run's 8 scale bytes a column: one 8-byte load, moved to the operand layout once a run
            s32 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            offs_w = (r * row_stride + offs_n)[:, None] * 2 + tl.arange(0, 2)[None, :]
            if EVEN_N:
                sw = tl.load(s32 + offs_w)
            else:
                sw = tl.load(s32 + offs_w, mask=n_ok[:, None], other=PAD_SCALE_WORD)
            s_lo, s_hi = tl.split(sw)                                # groups 0-3 | 4-7, a byte each
        for i in tl.static_range(8):
            a = group_activations(x_ptr, stride_xm, offs_m, m_ok, K, r * 256 + 32 * i, EVEN_K)
            if FOLD:
                if i < 4:
                    b = fp4_scaled_bf16(words, i, ASM, s_lo)
                else:
                    b = fp4_scaled_bf16(words, i, ASM, s_hi)
                if DOT_FP32:  # the interpreter: its bf16 dot is wrong (device.dot_needs_fp32)
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                else:
                    acc = tl.dot(a, b, acc)
            else:
                b = fp4_code_bf16(words, i, ASM)
                if DOT_FP32:
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32))
                else:
                    part = tl.dot(a, b)
                acc += part * e8m0_scale(s_ptr, r, i, offs_n, n_ok, row_stride, EVEN_N)[None, :]
        return acc
