"""W4A16: symmetric INT4 weights in groups of 32 along K with BF16 scales, BF16 activations.

A weight `W [N, K]` (or `[E, N, K]` for E experts) becomes integers `q` in [-8, 7] and one
BF16 scale per 32 consecutive K values: `W ≈ q * scale`. Storage is 4 bits per weight plus
16 bits per 32 weights = 4.5 bits per weight, so the best a memory-bound W4A16 GEMM can do
against BF16 weights is 16 / 4.5 ≈ 3.56x, not 4x.

Three packing specs, one per MoE kernel family (as Chord has), and they are different bytes; a
packed buffer carries its layout, and every kernel entry point checks it, because each kernel
hard-codes the address arithmetic of its own spec (a buffer of another spec is read as wrong
numbers, silently: `reinterpret` shows it):

- ``indexed``            int32 ``[E, N, K/8]``: eight consecutive K values per word, value i in
                         bits 4i..4i+3, stored with a +8 offset; scales ``[E, N, K/g]``. This is
                         the compressed-tensors ``pack-quantized`` layout of public Kimi-K2 INT4
                         checkpoints, so import is a copy; a load profile (`LOAD_PROFILES`) decides
                         at model load whether to keep it or repack for a grouped kernel.
- ``grouped_contiguous`` int32 ``[E, Kp/8, N]``, words in *fragment order* (Kp: K rounded up to
                         a multiple of 32): scales ``[E, K/g, N]``.
                         Prefill (large M, wide N tiles): a ``[BLOCK_K/8, BLOCK_N]`` word tile is
                         BLOCK_N consecutive words per row, read in wide coalesced rows.
- ``grouped_masked``     int32 ``[E, ceil(N/16), Kp/8, 16]``, words in fragment order, in panels
                         of 16 output rows: scales ``[E, N, K/g]``. Decode (small M, narrow N
                         blocks streaming all of K): each 16-row panel is one contiguous run of
                         K/2 x 16 bytes, so a CTA's whole weight stream is a few long runs.

*Fragment order* (both grouped specs, Marlin's pre-shuffle): within each run of 32 K values, word j
(j = 0..3) holds the K offsets {2j, 2j+1} + {0, 8, 16, 24} — the values one thread of an
``mma.sync m16n8k16`` B fragment holds over two k16 steps — with Marlin's interleave, field
f = 4b + a holding offset 8a + 2j + b, so fields f and f + 4 are the consecutive pair (k, k+1)
that fills one BF16x2 register. One 32-bit word feeds one fragment's dequantize. Triton chooses
its own register layouts, so our kernel undoes the order with a register permute after the unpack
(the compiler may route that through shared memory); the bytes are Marlin's arrangement, the
instruction sequence is not Marlin's `lop3` one. The grouped specs store K rounded up to whole
32-runs (the pad holds the value 0).

Every kernel reads each packed 32-bit word once and splits its eight values in registers
(`w4_tile`, `unpack_words`), and each BF16 scale once per group of 32: the tile it stages in
shared memory is the packed bytes, not one word per weight.

Conversions between specs are explicit (`to_layout`). The reference for every kernel is
`dequantize` to fp32 and a matmul in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:  # the package still imports (reference paths only) where triton is missing
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

from ..device import dot_needs_fp32, kernel_target, pick_config, target_vendor, triton_backend_for

LAYOUTS = ("indexed", "grouped_contiguous", "grouped_masked")
# Kernel-side codes; 3 is plain BF16 weights [E, N, K] (the baseline the kernels share code with).
LAYOUT_CODE = {"indexed": 0, "grouped_contiguous": 1, "grouped_masked": 2, "bf16": 3}
GROUP_SIZE = 32
QMIN, QMAX = -8, 7
OFFSET = 8  # stored nibble = q + 8 (compressed-tensors' offset encoding)
BITS_PER_WEIGHT = 4 + 16 / GROUP_SIZE  # 4.5


PANEL = 16      # grouped_masked: output rows per contiguous panel
FRAG_K = 32     # grouped specs: the K run one fragment-order block of four words covers


def _fragment_order() -> torch.Tensor:
    """int64 [32]: position p of a 32-value run (word p // 8, field p % 8) holds K offset
    8a + 2j + b, with j = p // 8 and field f = p % 8 = 4b + a (see the module docstring)."""
    p = torch.arange(FRAG_K)
    j, f = p // 8, p % 8
    b, a = f // 4, f % 4
    return 8 * a + 2 * j + b


FRAGMENT_ORDER = _fragment_order()
FRAGMENT_INVERSE = torch.argsort(FRAGMENT_ORDER)


class LayoutError(ValueError):
    """A packed buffer was given to a kernel built for another packing spec."""


@dataclass(frozen=True)
class PackingSpec:
    layout: str
    qweight: str   # shape and dtype of the packed integers
    scales: str    # shape of the BF16 scales
    kernel: str    # which kernel family reads it


PACKING_SPECS = {
    "indexed": PackingSpec("indexed", "int32 [E, N, K/8] (8 nibbles along K, +8 offset)", "bf16 [E, N, K/g]",
                           "indexed fused MoE (tokens sorted and padded per expert, gathered by index)"),
    "grouped_contiguous": PackingSpec("grouped_contiguous", "int32 [E, Kp/8, N] (fragment-order words, N contiguous; Kp = K rounded up to 32)",
                                      "bf16 [E, K/g, N]", "grouped GEMM over contiguous per-expert segments (prefill)"),
    "grouped_masked": PackingSpec("grouped_masked", "int32 [E, N/16, Kp/8, 16] (fragment-order words, 16-row panels)",
                                  "bf16 [E, N, K/g]", "grouped GEMM over [E, max_m, K] with per-expert counts (decode)"),
}


class _Packed:
    """What every packed INT4 weight answers from its logical `shape` ((N, K) or (E, N, K)) and `qweight`."""

    @property
    def n(self) -> int:
        return self.shape[-2]

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.qweight.device


@dataclass(frozen=True)
class PackedW4(_Packed):
    """INT4 weights packed for one kernel family. `shape` is the logical (E, N, K) or (N, K)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple
    group_size: int
    layout: str

    @property
    def experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def to(self, device) -> "PackedW4":
        return PackedW4(self.qweight.to(device), self.scales.to(device), self.shape, self.group_size, self.layout)

    def require(self, layout: str, what: str) -> None:
        """Raise `LayoutError` unless this buffer is packed in `layout`."""
        if self.layout != layout:
            raise LayoutError(
                f"{what} reads weights packed as {layout!r} ({PACKING_SPECS[layout].qweight}), but this buffer is "
                f"packed as {self.layout!r} ({PACKING_SPECS[self.layout].qweight}); the same buffer cannot be "
                f"swapped between kernels: convert it once with to_layout(q, {layout!r})")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown W4A16 layout {layout!r}; choose one of {', '.join(map(repr, LAYOUTS))}")


def _as3d(shape: tuple) -> tuple[int, int, int]:
    return (1, *shape) if len(shape) == 2 else tuple(shape)


# ---------------------------------------------------------------------------
# Quantize / pack / unpack / dequantize (PyTorch; these define the formats)

def quantize_values(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group along the last axis. Returns (q int8 [..., K], scales bf16 [..., K/g]).

    scale = max|w| / 7 rounded to BF16, then q = round(w / scale) clamped to [-8, 7]; the rounding
    uses the *stored* BF16 scale, so |w - q * scale| <= scale / 2 holds for every element.
    """
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"weights must be a torch.Tensor, got {type(w).__name__}")
    if w.ndim not in (2, 3):
        raise ValueError(f"weights must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"weights must be floating point, got {w.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    K = w.shape[-1]
    if K == 0 or K % group_size:
        raise ValueError(f"K = {K} (the last axis) must be a positive multiple of group_size = {group_size}")
    if w.numel() and not torch.isfinite(w).all():
        raise ValueError("weights contain NaN or Inf; INT4 quantization needs finite values")
    g = w.float().reshape(*w.shape[:-1], K // group_size, group_size)
    scale = (g.abs().amax(-1) / QMAX).to(torch.bfloat16)
    sf = scale.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round(g / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(g))
    q = q.clamp(QMIN, QMAX).to(torch.int8).reshape(w.shape)
    return q, scale


def _pack_nibbles_int32(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., K] in [-8, 7] -> int32 [..., K/8]; value i of each word in bits 4i..4i+3, +8 offset."""
    u = (q.to(torch.int64) + OFFSET).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    word = (u << shifts).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as two's-complement int32
    return word.to(torch.int32)


def _unpack_nibbles_int32(word: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, device=word.device, dtype=torch.int32)
    u = (word.unsqueeze(-1) >> shifts) & 0xF
    return (u - OFFSET).to(torch.int8).reshape(*word.shape[:-1], word.shape[-1] * 8)


def padded_k(K: int, layout: str) -> int:
    """K as the spec stores it: the grouped specs round K up to whole 32-runs (the pad holds value 0,
    so a kernel may read it: it contributes nothing); indexed stores K as it is."""
    return K if layout == "indexed" else -(-K // FRAG_K) * FRAG_K


def _to_fragment_order(q3: torch.Tensor) -> torch.Tensor:
    """int8 [E, N, K] -> [E, N, Kp] (K padded with zeros to whole 32-runs), each run in fragment order."""
    E, N, K = q3.shape
    Kp = padded_k(K, "grouped")
    if Kp != K:
        q3 = torch.cat([q3, torch.zeros((E, N, Kp - K), dtype=q3.dtype, device=q3.device)], -1)
    return q3.reshape(E, N, Kp // FRAG_K, FRAG_K)[..., FRAGMENT_ORDER.to(q3.device)].reshape(E, N, Kp)


def _from_fragment_order(v3: torch.Tensor, K: int) -> torch.Tensor:
    E, N, Kp = v3.shape
    return v3.reshape(E, N, Kp // FRAG_K, FRAG_K)[..., FRAGMENT_INVERSE.to(v3.device)].reshape(E, N, Kp)[..., :K]


def _pack(q3: torch.Tensor, s3: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q3 int8 [E, N, K], s3 bf16 [E, N, K/g] -> (qweight, scales) in `layout`'s spec, contiguous."""
    if layout == "indexed":
        return _pack_nibbles_int32(q3).contiguous(), s3.contiguous()
    E, N, K = q3.shape
    words = _pack_nibbles_int32(_to_fragment_order(q3))            # [E, N, Kp/8], fragment order
    KW = words.shape[-1]
    if layout == "grouped_contiguous":
        return words.transpose(1, 2).contiguous(), s3.transpose(1, 2).contiguous()
    n_pad = -N % PANEL                                             # pad rows: value 0 (never read)
    if n_pad:
        words = torch.cat([words, torch.full((E, n_pad, KW), -2004318072, dtype=torch.int32,  # 0x88888888
                                             device=words.device)], 1)
    panels = words.reshape(E, (N + n_pad) // PANEL, PANEL, KW).transpose(2, 3)
    return panels.contiguous(), s3.contiguous()


def unpack(q: PackedW4) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [E, N, K], bf16 scales [E, N, K/g]) of any layout, in the logical shape (E=1 for 2D)."""
    E, N, K = _as3d(q.shape)
    if q.layout == "indexed":
        return _unpack_nibbles_int32(q.qweight.reshape(E, N, K // 8)), q.scales.reshape(E, N, -1)
    KW = padded_k(K, q.layout) // 8
    if q.layout == "grouped_contiguous":
        words = q.qweight.reshape(E, KW, N).transpose(1, 2)
        return _from_fragment_order(_unpack_nibbles_int32(words), K), q.scales.reshape(E, -1, N).transpose(1, 2)
    panels = q.qweight.reshape(E, -1, KW, PANEL)
    words = panels.transpose(2, 3).reshape(E, -1, KW)[:, :N]
    return _from_fragment_order(_unpack_nibbles_int32(words), K), q.scales.reshape(E, N, -1)


def reinterpret(q: PackedW4, layout: str) -> PackedW4:
    """The same bytes tagged as another layout: what happens when one spec's buffer is fed to
    another spec's kernel. For the demonstration only (the kernels then read wrong numbers);
    needs buffers of equal size (N a multiple of 16 for grouped_masked, K of 32 for the grouped specs)."""
    _check_layout(layout)
    E, N, K = _as3d(q.shape)
    KW = padded_k(K, layout) // 8
    want = {"indexed": (E, N, K // 8), "grouped_contiguous": (E, KW, N),
            "grouped_masked": (E, -(-N // PANEL), KW, PANEL)}[layout]
    swant = (E, K // q.group_size, N) if layout == "grouped_contiguous" else (E, N, K // q.group_size)
    if q.qweight.numel() != torch.Size([abs(d) for d in want]).numel():
        raise ValueError(f"cannot reinterpret a {q.layout!r} buffer of {q.qweight.numel()} words as {layout!r} "
                         f"{want}: sizes differ")
    qw, sc = q.qweight.reshape(want), q.scales.reshape(swant)
    if len(q.shape) == 2:
        qw, sc = qw[0], sc[0]
    return PackedW4(qw, sc, q.shape, q.group_size, layout)


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE, layout: str = "indexed") -> PackedW4:
    """Quantize `w [N, K]` or `[E, N, K]` (any float dtype) to INT4 and pack it for `layout`."""
    _check_layout(layout)
    q, s = quantize_values(w, group_size)
    shape = tuple(w.shape)
    E, N, K = _as3d(shape)
    qw, sc = _pack(q.reshape(E, N, K), s.reshape(E, N, K // group_size), layout)
    if len(shape) == 2:
        qw, sc = qw[0], sc[0]
    return PackedW4(qw, sc, shape, group_size, layout)


# A load profile decides, at model load, which packing the experts get (the seed: the indexed
# profile picks its packing when the model loads). The checkpoint is always compressed-tensors
# (indexed); a profile for a grouped kernel repacks once, offline, never per call.
LOAD_PROFILES = {
    "indexed": dict(layout="indexed", kernel="indexed fused MoE", when="any M; checkpoint bytes as they are"),
    "sm90-grouped-decode": dict(layout="grouped_masked", kernel="masked grouped GEMM",
                                when="decode: a few rows per expert, fixed [E, max_m] shapes (CUDA graphs)"),
    "sm90-grouped-prefill": dict(layout="grouped_contiguous", kernel="contiguous grouped GEMM",
                                 when="prefill: long per-expert segments"),
}


def packing_for_profile(profile: str) -> str:
    """The layout a load profile packs the experts in (`LOAD_PROFILES`)."""
    if profile not in LOAD_PROFILES:
        raise ValueError(f"unknown load profile {profile!r}; choose one of {', '.join(map(repr, LOAD_PROFILES))}")
    return LOAD_PROFILES[profile]["layout"]


def to_layout(q: PackedW4, layout: str) -> PackedW4:
    """Repack an INT4 buffer for another kernel family (explicit, copies; values unchanged)."""
    _check_layout(layout)
    if q.layout == layout:
        return q
    vals, s = unpack(q)
    qw, sc = _pack(vals, s, layout)
    if len(q.shape) == 2:
        qw, sc = qw[0], sc[0]
    return PackedW4(qw, sc, q.shape, q.group_size, layout)


def dequantize(q: PackedW4, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Weights back in the logical shape: q * scale, computed in fp32 (exact), returned in `dtype`."""
    vals, s = unpack(q)
    E, N, K = vals.shape
    w = vals.float().reshape(E, N, K // q.group_size, q.group_size) * s.float().unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


def expert(q: PackedW4, e: int) -> PackedW4:
    """Expert `e` of an [E, N, K] buffer as a 2-D [N, K] buffer (a view, same layout)."""
    if len(q.shape) != 3 or not 0 <= e < q.shape[0]:
        raise ValueError(f"expert {e!r} out of range for weights of shape {q.shape}")
    return PackedW4(q.qweight[e], q.scales[e], tuple(q.shape[1:]), q.group_size, q.layout)


def cat_experts(*qs: PackedW4) -> PackedW4:
    """Stack expert weights packed in the same layout: [E1, N, K] + [E2, N, K] -> [E1+E2, N, K]."""
    first = qs[0]
    for q in qs:
        if len(q.shape) != 3 or q.shape[1:] != first.shape[1:] or q.group_size != first.group_size:
            raise ValueError(f"cannot stack expert weights of shapes {[x.shape for x in qs]}")
        q.require(first.layout, "cat_experts")
    return PackedW4(torch.cat([q.qweight for q in qs]), torch.cat([q.scales for q in qs]),
                    (sum(q.shape[0] for q in qs), *first.shape[1:]), first.group_size, first.layout)


# ---------------------------------------------------------------------------
# compressed-tensors "pack-quantized" INT4 (the format of public Kimi-K2 INT4 checkpoints)

def compressed_tensors_config(group_size: int = GROUP_SIZE) -> dict:
    """The `quantization_config` entry such a checkpoint carries (weights only; activations BF16)."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group_size}}}}


def export_compressed_tensors(q: PackedW4, prefix: str) -> dict[str, torch.Tensor]:
    """One linear's tensors: `{prefix}.weight_packed` int32 [N, K/8], `{prefix}.weight_scale` bf16
    [N, K/g], `{prefix}.weight_shape` int64 [2]. `q` must be 2-D (one expert projection)."""
    if len(q.shape) != 2:
        raise ValueError(f"export one [N, K] projection at a time, got shape {q.shape}")
    idx = to_layout(q, "indexed")
    return {f"{prefix}.weight_packed": idx.qweight.contiguous().cpu(),
            f"{prefix}.weight_scale": idx.scales.contiguous().cpu(),
            f"{prefix}.weight_shape": torch.tensor(q.shape, dtype=torch.int64)}


def import_compressed_tensors(tensors: dict[str, torch.Tensor], prefix: str, layout: str = "indexed") -> PackedW4:
    """Read one projection written in the compressed-tensors pack-quantized INT4 format."""
    _check_layout(layout)
    try:
        packed, scale, shape = (tensors[f"{prefix}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape"))
    except KeyError as e:
        raise ValueError(f"no compressed-tensors INT4 projection at {prefix!r} (missing {e.args[0]!r})") from None
    N, K = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (N, K // 8) or K % 8:
        raise ValueError(f"{prefix}.weight_packed must be int32 [{N}, {K // 8}] for weight_shape [{N}, {K}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if scale.ndim != 2 or scale.shape[0] != N or scale.shape[1] == 0 or K % scale.shape[1]:
        raise ValueError(f"{prefix}.weight_scale must be [{N}, K/group] with K = {K}, got {tuple(scale.shape)}")
    group = K // scale.shape[1]
    q = PackedW4(packed.contiguous(), scale.to(torch.bfloat16).contiguous(), (N, K), group, "indexed")
    return to_layout(q, layout)


def export_moe_compressed_tensors(w13: PackedW4, w2: PackedW4, prefix: str) -> dict[str, torch.Tensor]:
    """Experts as a Kimi-K2 checkpoint names them: `{prefix}.experts.{e}.{gate,up,down}_proj.*`."""
    E, two_i, H = w13.shape
    I = two_i // 2
    g13, s13 = unpack(w13)
    g2, s2 = unpack(w2)
    gs = w13.group_size
    out = {}
    for e in range(E):
        for name, vals, sc in (("gate_proj", g13[e, :I], s13[e, :I]), ("up_proj", g13[e, I:], s13[e, I:]),
                               ("down_proj", g2[e], s2[e])):
            qw, s = _pack(vals[None], sc[None], "indexed")
            out.update(export_compressed_tensors(PackedW4(qw[0], s[0], tuple(vals.shape), gs, "indexed"),
                                                 f"{prefix}.experts.{e}.{name}"))
    return out


def import_moe_compressed_tensors(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int,
                                  layout: str = "indexed") -> tuple[PackedW4, PackedW4]:
    """(w13 [E, 2I, H], w2 [E, H, I]) from per-expert gate/up/down projections, packed for `layout`."""
    def one(e, name):
        return import_compressed_tensors(tensors, f"{prefix}.experts.{e}.{name}", "indexed")

    w13 = [cat_rows(one(e, "gate_proj"), one(e, "up_proj")) for e in range(num_experts)]
    w2 = [one(e, "down_proj") for e in range(num_experts)]
    stack = lambda qs: PackedW4(torch.stack([q.qweight for q in qs]), torch.stack([q.scales for q in qs]),
                                (len(qs), *qs[0].shape), qs[0].group_size, "indexed")
    return to_layout(stack(w13), layout), to_layout(stack(w2), layout)


def load_moe_experts(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int,
                     profile: str = "indexed") -> tuple[PackedW4, PackedW4]:
    """Model load: read a compressed-tensors INT4 checkpoint's experts and pack them, once, in the
    layout the load `profile` chooses (`LOAD_PROFILES`); the kernels then take only that layout."""
    return import_moe_compressed_tensors(tensors, prefix, num_experts, packing_for_profile(profile))


def cat_rows(a: PackedW4, b: PackedW4) -> PackedW4:
    """[N1, K] and [N2, K] indexed-packed -> [N1 + N2, K] (gate and up into w13)."""
    a.require("indexed", "cat_rows")
    b.require("indexed", "cat_rows")
    return PackedW4(torch.cat([a.qweight, b.qweight]), torch.cat([a.scales, b.scales]),
                    (a.shape[0] + b.shape[0], a.shape[1]), a.group_size, "indexed")


# ---------------------------------------------------------------------------
# Triton: one tile loader for every spec, and the dense W4A16 GEMM

if triton is not None:

    @triton.jit
    def round_bf16(x, EMULATE: tl.constexpr):
        """fp32 -> BF16, round to nearest even. The Triton interpreter (3.9) truncates instead (and its
        `fp_downcast_rounding="rtne"` is wrong too), so under the interpreter we round the bits
        ourselves; the result is then exactly representable and the cast exact. Finite inputs."""
        if EMULATE:
            bits = x.to(tl.uint32, bitcast=True).to(tl.int64)  # int64: no overflow checks, no wrap
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.uint32).to(tl.float32, bitcast=True)
        return x.to(tl.bfloat16)

    @triton.jit
    def unpack_words(word):
        """int32 [R, C] -> int32 [R, 8C]: the eight 4-bit fields of each word, field i (bits 4i..4i+3)
        at column 8c + i, values 0..15 (the stored nibble, offset not yet removed).

        The word is read from memory once; its fields are split in registers by shift and mask, as
        Marlin's dequantize does. `tl.join` adds a register-minor axis, so each thread keeps all
        eight fields of the words it loaded and the final reshape moves no data: the tree joins
        fields (0,4), (2,6), (1,5), (3,7), then pairs, so the flat index of field i is i."""
        v0 = word & 0xF
        v1 = (word >> 4) & 0xF
        v2 = (word >> 8) & 0xF
        v3 = (word >> 12) & 0xF
        v4 = (word >> 16) & 0xF
        v5 = (word >> 20) & 0xF
        v6 = (word >> 24) & 0xF
        v7 = (word >> 28) & 0xF  # >> is arithmetic on int32: the mask drops the sign bits
        lo = tl.join(tl.join(v0, v4), tl.join(v2, v6))   # [R, C, 2, 2]: (a, b) -> field 4a + 2b
        hi = tl.join(tl.join(v1, v5), tl.join(v3, v7))   # the same, + 1
        both = tl.join(lo, hi)                           # [R, C, 2, 2, 2]: (a, b, c) -> 4a + 2b + c
        return tl.reshape(both, (word.shape[0], word.shape[1] * 8))

    @triton.jit
    def w4_tile(qw_ptr, s_ptr, k0, offs_n, N, K, LAYOUT: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
        """Weight tile W[offs_n, k0 : k0 + BLOCK_K] dequantized to BF16, returned transposed as
        [BLOCK_K, BLOCK_N]. Out-of-range elements come back as 0.

        `qw_ptr`/`s_ptr` point at one expert's [N, K] matrix. The address arithmetic is the packing spec:
        each LAYOUT code reads only its own arrangement. Each packed 32-bit word is loaded once (a
        [BLOCK_N, BLOCK_K/8] int32 tile, an eighth of the elements) and split into its eight values in
        registers (`unpack_words`); each scale is loaded once per group ([BLOCK_N, BLOCK_K/GROUP]) and
        broadcast over its GROUP values. K is a multiple of GROUP (hence of 8)."""
        WORDS: tl.constexpr = BLOCK_K // 8
        offs_kw = k0 // 8 + tl.arange(0, WORDS)
        nn = offs_n[:, None]
        kw = offs_kw[None, :]
        if EMULATE:  # the interpreter checks every int32 add/mul for overflow (slow); int64 is skipped
            nn = nn.to(tl.int64)
            kw = kw.to(tl.int64)
        if LAYOUT == 3:  # plain BF16 [N, K] (baseline): no packing
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kk = offs_k[None, :]
            if EMULATE:
                kk = kk.to(tl.int64)
            w = tl.load(qw_ptr + nn * K + kk, mask=(nn < N) & (kk < K), other=0.0).to(tl.bfloat16)
        else:
            if LAYOUT == 0:
                KW = K // 8
            else:  # the grouped specs store K rounded up to whole 32-runs; the pad holds value 0
                KW = (K + 31) // 32 * 4
            wmask = (nn < N) & (kw < KW)
            if LAYOUT == 1:  # grouped_contiguous: int32 [Kp/8, N] (words of one column n contiguous along N)
                word = tl.load(qw_ptr + kw * N + nn, mask=wmask, other=0)
            elif LAYOUT == 0:  # indexed: int32 [N, K/8] (compressed-tensors)
                word = tl.load(qw_ptr + nn * KW + kw, mask=wmask, other=0)
            else:  # grouped_masked: int32 [N/16, Kp/8, 16] (16-row panels, each one contiguous run)
                word = tl.load(qw_ptr + ((nn // 16) * KW + kw) * 16 + nn % 16, mask=wmask, other=0)
            u = unpack_words(word)  # [BLOCK_N, BLOCK_K] in the spec's field order
            if LAYOUT != 0:
                # fragment order -> K order: column 32r + 8j + 4b + a holds K offset 32r + 8a + 2j + b
                u = tl.reshape(u, (offs_n.shape[0], BLOCK_K // 32, 4, 2, 4))   # (n, r, j, b, a)
                u = tl.reshape(tl.permute(u, (0, 1, 4, 2, 3)), (offs_n.shape[0], BLOCK_K))
            # nibble u -> fp32 (u - 8) without an int-to-float convert (I2F issues at a quarter of the
            # ALU rate): u | 0x4B000000 is the fp32 2**23 + u, and subtracting 2**23 + 8 is exact.
            # One OR and one FADD per value, at full rate (the trick Marlin plays with fp16 magic numbers).
            magic = (u | 0x4B000000).to(tl.float32, bitcast=True)
            q = magic - 8388616.0  # [BLOCK_N, BLOCK_K] in [-8, 7]; padding words give -8 (scale 0)
            if BLOCK_K % GROUP == 0:  # whole groups in the tile: one scale per (row, group)
                GROUPS: tl.constexpr = BLOCK_K // GROUP
                offs_g = k0 // GROUP + tl.arange(0, GROUPS)
                gg = offs_g[None, :]
                smask = (nn < N) & (gg < K // GROUP)
                if LAYOUT == 1:
                    s = tl.load(s_ptr + gg * N + nn, mask=smask, other=0.0)
                else:
                    s = tl.load(s_ptr + nn * (K // GROUP) + gg, mask=smask, other=0.0)
                w = tl.reshape(q, (offs_n.shape[0], GROUPS, GROUP)) * s.to(tl.float32)[:, :, None]
                w = tl.reshape(w, (offs_n.shape[0], BLOCK_K))
            else:  # the tile lies inside one group (GROUP a multiple of BLOCK_K): one scale per row
                g = k0 // GROUP
                if LAYOUT == 1:
                    s = tl.load(s_ptr + g * N + nn, mask=nn < N, other=0.0)
                else:
                    s = tl.load(s_ptr + nn * (K // GROUP) + g, mask=nn < N, other=0.0)
                w = q * s.to(tl.float32)
            # q * scale is exact in fp32 (4-bit times 8-bit significands); one rounding to BF16,
            # the same one `dequantize(q, torch.bfloat16)` makes. Masked-out scales are 0, so the
            # padding comes back as (-8) * 0 = 0.
            w = round_bf16(w, EMULATE)
        return tl.trans(w)

    @triton.jit
    def _w4a16_linear_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_om, stride_on,
                             LAYOUT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            b = w4_tile(qw_ptr, s_ptr, k0, offs_n, N, K, LAYOUT, GROUP, BLOCK_K, DOT_FP32)
            # DOT_FP32 (interpreter only): its bf16 tl.dot is wrong, and its fp32 -> bf16 casts truncate;
            # both are worked around under this one flag (device.dot_needs_fp32).
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, round_bf16(acc, DOT_FP32),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def linear_config(M: int, interpreted: bool) -> dict:
    """Block sizes for the dense kernel. Small M (decode) -> narrow N blocks so enough programs
    stream the weights; the interpreter wants few, large programs (it is numpy underneath)."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    if M <= 16:  # BLOCK_K 256: each CTA keeps 3 x 32 x 128 B of weights in flight (the bandwidth needs bytes in flight)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def check_block_k(block_k: int, group_size: int, layout: str = "indexed") -> None:
    """The tile loader reads whole 32-bit words and whole scale groups: BLOCK_K must be a multiple
    of 8 and either hold whole groups (BLOCK_K % group == 0) or lie inside one (group % BLOCK_K == 0);
    the grouped specs' fragment order needs whole 32-runs (BLOCK_K % 32 == 0)."""
    if block_k % 8 or (block_k % group_size and group_size % block_k):
        raise ValueError(f"BLOCK_K = {block_k} must be a multiple of 8 that divides, or is a multiple of, "
                         f"the group size {group_size}")
    if layout != "indexed" and block_k % FRAG_K:
        raise ValueError(f"BLOCK_K = {block_k} must be a multiple of {FRAG_K} for the {layout!r} spec")


def _check_activations(x: torch.Tensor, K: int, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: activations must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{what}: activations must be bfloat16 (W4A16), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"{what}: activations' last axis must be K = {K}, got shape {tuple(x.shape)}")


def linear_reference(x: torch.Tensor, q: PackedW4) -> torch.Tensor:
    """fp32 reference: dequantize, then x @ W.T in fp32. Returns fp32 [..., N]."""
    return x.float() @ dequantize(q, torch.float32).T


def linear_torch(x: torch.Tensor, q: PackedW4) -> torch.Tensor:
    """What PyTorch does in the same precision: BF16 dequantized weights, BF16 matmul."""
    return x @ dequantize(q, torch.bfloat16).T


def linear(x: torch.Tensor, q: PackedW4, *, layout: str | None = None, block: dict | str | None = None,
           return_kernel: bool = False):
    """Dense W4A16 GEMM: `x [..., K]` BF16 times INT4 `q [N, K]` (any layout) -> BF16 `[..., N]`.

    Runs the Triton kernel (compiled on CUDA, interpreted on CPU); falls back to `linear_torch` where
    Triton cannot run. `block`: None = `linear_config` for this device; "gpu" = the exact block
    constexprs (and warps, stages) a GPU would run, also in the interpreter (the test matrix checks
    the GPU's tiles on CPU this way); or a dict. `return_kernel=True` also returns the compiled kernel (for PTX inspection).
    """
    if not isinstance(q, PackedW4) or len(q.shape) != 2:
        raise ValueError(f"linear needs a 2-D PackedW4 weight [N, K], got {getattr(q, 'shape', type(q).__name__)}")
    if layout is not None:  # the caller's kernel family: refuse another spec's buffer
        _check_layout(layout)
        q.require(layout, f"the {layout!r} dense W4A16 kernel")
    N, K = q.shape
    _check_activations(x, K, "linear")
    if x.device != q.device:
        raise ValueError(f"linear: activations on {x.device} but weights on {q.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    ok, _ = triton_backend_for(x.device)
    if M == 0 or N == 0:
        return (out.reshape(*lead, N), None) if return_kernel else out.reshape(*lead, N)
    if not ok:
        out = linear_torch(x2, q)
        return (out.reshape(*lead, N), None) if return_kernel else out.reshape(*lead, N)
    cfg = dict(linear_config(M, False) if block == "gpu" else (block or linear_config(M, x.device.type != "cuda")))
    check_block_k(cfg["BLOCK_K"], q.group_size, q.layout)
    launch = _linear_launch(x2, q.qweight, q.scales, out, q.layout, q.group_size, cfg, device=x.device)
    kernel = launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    out = out.reshape(*lead, N)
    return (out, kernel) if return_kernel else out


def weight_bytes(n: int, k: int, fmt: str, group_size: int = GROUP_SIZE) -> int:
    """Bytes one [N, K] weight occupies: bf16 = 2 per weight; w4a16 = 0.5 per weight + 2 per group."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "w4a16":
        return n * k // 2 + 2 * n * (k // group_size)
    raise ValueError(f"unknown weight format {fmt!r}; choose 'bf16' or 'w4a16'")


# ---------------------------------------------------------------------------
# Launch builder (inferbook.compiled): what `linear` launches on a GPU, without running it

def _linear_launch(x2, qweight, scales, out, layout: str, group_size: int, cfg: dict, *, device: torch.device):
    """The launch (`compiled.Launch`) `linear` makes: x2 bf16 [M, K], the packed weight and scales of
    `layout`, out bf16 [M, N], tiles `cfg` (tensors or `meta` stand-ins; `device` sets DOT_FP32)."""
    from ..compiled import Launch

    M, K = x2.shape
    N = out.shape[1]
    return Launch(f"w4a16 linear {layout} M{M} N{N} K{K} cfg {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}",
                  _w4a16_linear_kernel,
                  [x2, qweight, scales, out, M, N, K, x2.stride(0), x2.stride(1), out.stride(0), out.stride(1)],
                  dict(LAYOUT=LAYOUT_CODE[layout], GROUP=group_size, DOT_FP32=dot_needs_fp32(device), **cfg),
                  "moe/w4a16.py:linear", (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"])))


def linear_launches(m: int, n: int, k: int, layout: str = "indexed", *, group_size: int = GROUP_SIZE,
                    block: dict | None = None, name: str = "") -> list:
    """The launch `linear(x [m, k] bf16, q [n, k] packed for `layout`)` makes on a GPU, from the
    same `linear_config` and arguments (`compiled.Launch` list; tensors are `meta` stand-ins)."""
    from ..compiled import meta

    cfg = dict(block or linear_config(m, False))
    check_block_k(cfg["BLOCK_K"], group_size, layout)
    # full-shape stand-ins: the cost model counts each tensor argument's bytes (the weights are most of them)
    if layout == "bf16":
        qw, sc = meta((n, k), torch.bfloat16), meta((1,), torch.bfloat16)
    else:
        kp = padded_k(k, layout)
        words = {"indexed": (n, k // 8), "grouped_contiguous": (kp // 8, n),
                 "grouped_masked": (-(-n // PANEL), kp // 8, PANEL)}[layout]
        qw = meta(words, torch.int32)
        sc = meta((k // group_size, n) if layout == "grouped_contiguous" else (n, k // group_size), torch.bfloat16)
    launch = _linear_launch(meta((m, k), torch.bfloat16), qw, sc,
                            meta((m, n), torch.bfloat16), layout, group_size, cfg, device=torch.device("cuda"))
    if name:
        launch.name = name
    return [launch]


# ---------------------------------------------------------------------------
# Decode (M <= 16): Marlin's cost structure in Triton
#
# The weights are repacked once, offline (`pack_decode`, as vLLM's `gptq_marlin_repack` does for
# Marlin), so that the B operand of each `tl.dot` is an *elementwise* function of the loaded words:
# K is cut into runs of 256; in a run, word j (0..31) of column n holds, in nibble i (0..7), the
# weight at K offset 32 i + j. Nibble i of a [32, BLOCK_N] word tile is then the [32, BLOCK_N]
# B tile of K offsets 32 i .. 32 i + 31 -- one whole group of 32, so its scale is one number per
# column and is applied to the dot's fp32 result (no per-weight scale multiply). Because the chain
# load -> shift -> inline asm -> dot is elementwise, Triton's HoistLayoutConversion puts the words
# (4 bits a weight) into the MMA operand layout straight from the cp.async stage in shared memory:
# no shared-memory round trip of the dequantized tile, no register permute.
#
# The dequantize: nibble -> bf16 (128 + u) with the magic-number trick (0x4300 is bf16 128.0; OR-ing
# a 4-bit u into the low mantissa bits gives 128 + u exactly): per pair of weights one `prmt` (byte
# i//2 of two words into the two halves of one register), one shift for odd nibbles, one
# `lop3` (mask and OR the magic in one instruction). The bias 136 = 128 + 8 is removed by a second
# MMA against a constant tile of -136 in the same fp32 accumulator (cheaper than a bf16x2 subtract
# per pair). `prmt` makes the asm correct for whichever two elements Triton hands it (`pack=2`
# leaves the pairing unspecified); Marlin, which owns its registers, needs neither.
# Split-K over runs fills the SMs at M = 1; the partial sums go to an fp32 [SPLIT, M, N] buffer
# summed in a fixed order (deterministic), or are added atomically into a zeroed fp32 [M, N].

RUN = 256          # K values per run of the decode packing
RUN_WORDS = RUN // 8


@dataclass(frozen=True)
class DecodeW4(_Packed):
    """INT4 weights repacked for the decode kernels: qweight int32 [Kp/8, N] (Kp = K rounded up to
    256; runs of 256 K values, word j of a run holding K offset 32 i + j in nibble i, +8 offset, pad
    value 0), scales bf16 [Kp/256, ceil(N/2), 256/g, 2] (run, column pair, group of the run, column of
    the pair; pad 0): a column pair's groups of one run are adjacent, so a kernel reads a run's scales
    in one wide load; [E, ...] in front for E experts. `shape` is the logical (N, K) or (E, N, K)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    shape: tuple
    group_size: int

    @property
    def k_padded(self) -> int:
        return self.qweight.shape[-2] * 8

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel() * 2


def pack_decode(q: PackedW4) -> DecodeW4:
    """Repack an INT4 weight [N, K] or [E, N, K] (any layout) for the decode kernels (offline, once, as
    Marlin's repack is). The group size must be 32, 64, 128 or 256 (whole nibble tiles, whole groups a run)."""
    if not isinstance(q, PackedW4) or len(q.shape) not in (2, 3):
        raise ValueError(f"pack_decode needs a PackedW4 [N, K] or [E, N, K], got {getattr(q, 'shape', type(q).__name__)}")
    if q.group_size % 32 or RUN % q.group_size:
        raise ValueError(f"the decode kernel needs a group size of 32, 64, 128 or 256 (a multiple of 32 that "
                         f"divides {RUN}), got {q.group_size}")
    vals, s = unpack(q)                                            # [E, N, K] int8, [E, N, K/g]
    E, N, K = vals.shape
    Kp = -(-K // RUN) * RUN
    if Kp != K:  # pad value 0 (stored 8) and scale 0: the padding contributes nothing
        vals = torch.cat([vals, torch.zeros((E, N, Kp - K), dtype=vals.dtype, device=vals.device)], -1)
    groups_p = -(-Kp // q.group_size)
    if groups_p != s.shape[-1]:
        s = torch.cat([s, torch.zeros((E, N, groups_p - s.shape[-1]), dtype=s.dtype, device=s.device)], -1)
    # [E, N, runs, nibble i, word j] -> word j's nibble i holds K offset 32 i + j
    u = (vals.to(torch.int64) + OFFSET).reshape(E, N, Kp // RUN, 8, RUN_WORDS)
    shifts = (torch.arange(8, device=u.device, dtype=torch.int64) * 4).reshape(1, 1, 1, 8, 1)
    word = (u << shifts).sum(3)                                    # [E, N, runs, 32]
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    qweight = word.reshape(E, N, Kp // 8).transpose(1, 2).contiguous()   # [E, Kp/8, N]
    P, GR = -(-N // 2), RUN // q.group_size
    if 2 * P != N:   # odd N: a zero column completes the last pair
        s = torch.cat([s, torch.zeros((E, 1, groups_p), dtype=s.dtype, device=s.device)], 1)
    # [E, column pair, column of the pair, run, group of the run] -> [E, run, pair, group, column]
    scales = s.reshape(E, P, 2, Kp // RUN, GR).permute(0, 3, 1, 4, 2).contiguous()
    if len(q.shape) == 2:
        qweight, scales = qweight[0], scales[0]
    return DecodeW4(qweight, scales, tuple(q.shape), q.group_size)


def decode_packed_shapes(n: int, k: int, group_size: int = GROUP_SIZE) -> tuple[tuple, tuple]:
    """The shapes `pack_decode` gives one [N, K] weight: int32 words [Kp/8, N] and bf16 scales
    [Kp/256, ceil(N/2), 256/g, 2] (Kp = K rounded up to a run of 256), for the launch builders' meta tensors."""
    kp = -(-k // RUN) * RUN
    return (kp // 8, n), (kp // RUN, -(-n // 2), RUN // group_size, 2)


def decode_weight_bytes(n: int, k: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes of one [N, K] weight in `pack_decode`'s layout (K padded to 256): what a decode kernel reads."""
    words, scales = decode_packed_shapes(n, k, group_size)
    return math.prod(words) * 4 + math.prod(scales) * 2


def unpack_decode(d: DecodeW4) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, bf16 scales) in the logical shape ([N, K] and [N, K/g], or with E in front):
    the inverse of `pack_decode`."""
    E, N, K = _as3d(d.shape)
    Kp = d.k_padded
    word = d.qweight.reshape(E, Kp // 8, N).transpose(1, 2).reshape(E, N, Kp // RUN, 1, RUN_WORDS)
    word = word.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(8, device=word.device, dtype=torch.int64) * 4).reshape(1, 1, 1, 8, 1)
    vals = (((word >> shifts) & 0xF) - OFFSET).reshape(E, N, Kp)[..., :K].to(torch.int8)
    sc = d.scales.reshape(E, *d.scales.shape[-4:])                 # [E, runs, pairs, groups a run, 2]
    s = sc.permute(0, 2, 4, 1, 3).reshape(E, 2 * sc.shape[2], -1)[:, :N, :K // d.group_size].contiguous()
    return vals.reshape(*d.shape), s.reshape(*d.shape[:-1], K // d.group_size)


def dequantize_decode(d: DecodeW4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights of a decode-packed buffer in the logical shape (q * scale in fp32, then `dtype`)."""
    vals, s = unpack_decode(d)
    w = vals.float().reshape(*vals.shape[:-1], -1, d.group_size) * s.float().unsqueeze(-1)
    return w.reshape(vals.shape).to(dtype)


def nibble_asm_model(w0: int, w1: int, i: int) -> int:
    """What the decode kernel's inline asm computes for nibble `i` of two words, in Python (the
    interpreter cannot run PTX; tests check the asm's bit logic through this model): prmt selects
    byte i//2 of w0 into byte 0 and of w1 into byte 2, odd i shifts right by 4, lop3 keeps bits
    0x000F000F and ORs 0x43004300. Returns the 32-bit register: two bf16 values 128 + u."""
    b = i // 2
    sel = NIBBLE_PRMT[b]
    src = [(w0 >> (8 * k)) & 0xFF for k in range(4)] + [(w1 >> (8 * k)) & 0xFF for k in range(4)]
    t = sum(src[(sel >> (4 * d)) & 0x7] << (8 * d) for d in range(4))   # prmt, default mode
    if i % 2:
        t >>= 4
    lut = 0xEA                                                     # (a & b) | c
    a, bb, c = t, 0x000F000F, 0x43004300
    return sum((((lut >> ((((a >> k) & 1) << 2) | (((bb >> k) & 1) << 1) | ((c >> k) & 1))) & 1) << k)
               for k in range(32))


NIBBLE_PRMT = (0x4400, 0x5511, 0x6622, 0x7733)   # prmt selectors: byte b of each word into bytes 0 and 2
# v_perm_b32 selectors (`nibble_bf16`'s AMDGCN path): byte b of the first word into byte 0, of the second
# into byte 2, zero (0x0C) into bytes 1 and 3
NIBBLE_PERM = (0x0C040C00, 0x0C050C01, 0x0C060C02, 0x0C070C03)


def _v_perm_b32(w0: int, w1: int, sel: int) -> int:
    """`v_perm_b32 d, w1, w0, sel` as the CDNA3 ISA guide defines it: result byte k from the 64-bit {w1:w0}
    (selector byte 0-7: that byte, w0's bytes first; 0x0C: zero; no other selector is used here)."""
    src = [(w0 >> (8 * k)) & 0xFF for k in range(4)] + [(w1 >> (8 * k)) & 0xFF for k in range(4)]

    def byte(s: int) -> int:
        if s < 8:
            return src[s]
        if s == 0x0C:
            return 0x00
        raise ValueError(f"selector byte {s:#x} is not one this kernel uses")

    return sum(byte((sel >> (8 * k)) & 0xFF) << (8 * k) for k in range(4))


def nibble_perm_model(w0: int, w1: int, i: int) -> int:
    """The AMDGCN path of `nibble_bf16` for nibble `i` of two words, in Python: `v_perm_b32 d, w1, w0,
    NIBBLE_PERM[i // 2]` (`_v_perm_b32`), odd i `v_lshrrev_b32 d, 4, d`, then `v_and_or_b32 d, d, 0x000F000F,
    0x43004300` ((d & mask) | magic). Returns the 32-bit register: two bf16 values 128 + u."""
    t = _v_perm_b32(w0, w1, NIBBLE_PERM[i // 2])
    if i % 2:
        t >>= 4
    return (t & 0x000F000F) | 0x43004300


def nibble_byte_perm_model(w0: int, w1: int, b: int) -> tuple[int, int]:
    """`_nibble_byte_amd` (the CDNA loop's dequantize) for byte `b` of two words, in Python, instruction by
    instruction: $0 = v_perm_b32(w1, w0, NIBBLE_PERM[b]); $1 = v_lshrrev_b32(4, $0); $0 = v_and_or_b32($0,
    mask, magic); $1 = v_and_or_b32($1, mask, magic). Returns ($0, $1): nibbles 2b and 2b + 1 as bf16 128 + u."""
    r0 = _v_perm_b32(w0, w1, NIBBLE_PERM[b])
    r1 = r0 >> 4
    r0 = (r0 & 0x000F000F) | 0x43004300
    r1 = (r1 & 0x000F000F) | 0x43004300
    return r0, r1


if triton is not None:

    @triton.jit
    def _nibble_pairs(words, SEL: tl.constexpr, ODD: tl.constexpr):
        """bf16 128 + u for one nibble of each word, two words per asm (see `nibble_asm_model`)."""
        if ODD:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; prmt.b32 t, $1, $2, " + SEL + "; shr.u32 t, t, 4; "
                "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }",
                "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; prmt.b32 t, $1, $2, " + SEL + "; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }",
                "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _nibble_pairs_amd(words, SEL: tl.constexpr, ODD: tl.constexpr):
        """The AMDGCN form of `_nibble_pairs`: v_perm_b32 puts byte SEL of two words in the low byte of
        each bf16 half (PTX's prmt), v_and_or_b32 masks the nibble and ORs 0x4300 (PTX's lop3). GFX9's
        VOP3 encoding takes no literal, so the selector, mask and magic come in as registers (loop
        invariant: loaded once)."""
        sel = tl.full(words.shape, SEL, tl.int32)
        mask = tl.full(words.shape, 0x000F000F, tl.int32)
        magic = tl.full(words.shape, 0x43004300, tl.int32)
        if ODD:
            return tl.inline_asm_elementwise(
                "v_perm_b32 $0, $2, $1, $3\n v_lshrrev_b32 $0, 4, $0\n v_and_or_b32 $0, $0, $5, $7",
                "=&v,v,v,v,v,v,v,v,v", [words, sel, mask, magic], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "v_perm_b32 $0, $2, $1, $3\n v_and_or_b32 $0, $0, $5, $7",
                "=&v,v,v,v,v,v,v,v,v", [words, sel, mask, magic], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _nibble_byte_amd(words, SEL: tl.constexpr):
        """Both nibbles of byte SEL picks, for two words per asm: one v_perm_b32 (as `_nibble_pairs_amd`), then
        the even nibble by v_and_or_b32 and the odd one by v_lshrrev_b32 + v_and_or_b32 of the same permuted
        register: 4 instructions for 4 weights, where two `_nibble_pairs_amd` calls take 5
        (`nibble_byte_perm_model`). Returns (128 + even nibble, 128 + odd nibble), bf16."""
        sel = tl.full(words.shape, SEL, tl.int32)
        mask = tl.full(words.shape, 0x000F000F, tl.int32)
        magic = tl.full(words.shape, 0x43004300, tl.int32)
        return tl.inline_asm_elementwise(
            "v_perm_b32 $0, $3, $2, $4\n v_lshrrev_b32 $1, 4, $0\n v_and_or_b32 $0, $0, $6, $8\n "
            "v_and_or_b32 $1, $1, $6, $8",
            "=&v,=&v,v,v,v,v,v,v,v,v", [words, sel, mask, magic], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
            pack=2)

    @triton.jit
    def nibble_byte_bf16(words, B: tl.constexpr, ASM: tl.constexpr):
        """[32, BN] int32 words -> ([32, BN] bf16 128 + nibble 2B, [32, BN] bf16 128 + nibble 2B + 1), exact: byte
        B of each word. ASM 2: one AMDGCN asm for both (`_nibble_byte_amd`); otherwise `nibble_bf16` twice."""
        if ASM == 2:
            return _nibble_byte_amd(words, 0x0C040C00 + 0x00010001 * B)   # NIBBLE_PERM[B]
        else:
            return nibble_bf16(words, 2 * B, ASM), nibble_bf16(words, 2 * B + 1, ASM)

    @triton.jit
    def nibble_bf16(words, I: tl.constexpr, ASM: tl.constexpr):
        """[32, BN] int32 words -> [32, BN] bf16 128 + u (u = nibble I, 0..15), exact. ASM 1: the PTX
        path (NVIDIA); 2: the AMDGCN path (gfx9 CDNA); 0: plain tl ops (the interpreter, any backend)."""
        if ASM == 1:
            if I == 0:
                return _nibble_pairs(words, "0x4400", False)
            elif I == 1:
                return _nibble_pairs(words, "0x4400", True)
            elif I == 2:
                return _nibble_pairs(words, "0x5511", False)
            elif I == 3:
                return _nibble_pairs(words, "0x5511", True)
            elif I == 4:
                return _nibble_pairs(words, "0x6622", False)
            elif I == 5:
                return _nibble_pairs(words, "0x6622", True)
            elif I == 6:
                return _nibble_pairs(words, "0x7733", False)
            else:
                return _nibble_pairs(words, "0x7733", True)
        elif ASM == 2:   # v_perm_b32 selector bytes: 0-3 the first word's bytes, 4-7 the second's, 0x0c zero
            return _nibble_pairs_amd(words, 0x0C040C00 + 0x00010001 * (I // 2), I % 2 == 1)   # NIBBLE_PERM[I // 2]
        else:   # bf16 bits 0x4300 | u are 128 + u exactly: shift, mask, or, truncate; no convert
            return (((words >> (4 * I)) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def widen_pairs(pairs):
        """fp32 [2 P] scales from P int32 words of two bf16 scales each (columns 2p, 2p + 1; the low half
        is the even column), widened in registers (a shift and a mask: bf16 is fp32's upper half)."""
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (2 * pairs.shape[0],))

    @triton.jit
    def run_scales(s_ptr, r, pair0, pairs_per_row, P: tl.constexpr):
        """The eight group scales of run r for column pairs pair0 .. pair0 + P - 1, as eight [P] int32
        words (two bf16 columns each), from `pack_decode`'s [runs, N/2, 8, 2] scale layout: one
        column pair's eight groups are 32 contiguous bytes, so the whole run's scales are one
        [P, 8] load (wide loads; Triton moves it into the accumulator's column layout through shared
        memory, once per run), split into groups in registers."""
        sq = tl.load(s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                     + (r * pairs_per_row + pair0 + tl.arange(0, P))[:, None] * 8 + tl.arange(0, 8)[None, :])
        even, odd = tl.split(tl.reshape(sq, (P, 4, 2)))              # groups 0 2 4 6 | 1 3 5 7
        g04, g26 = tl.split(tl.reshape(even, (P, 2, 2)))
        g15, g37 = tl.split(tl.reshape(odd, (P, 2, 2)))
        g0, g4 = tl.split(g04)
        g2, g6 = tl.split(g26)
        g1, g5 = tl.split(g15)
        g3, g7 = tl.split(g37)
        return g0, g1, g2, g3, g4, g5, g6, g7

    @triton.jit
    def group_activations(x_ptr, stride_xm, offs_m, m_ok, K, k, EVEN_K: tl.constexpr):
        """x[offs_m, k : k + 32] bf16 [BLOCK_M, 32], rows beyond M (and K) zero."""
        offs_j = tl.arange(0, 32)
        if EVEN_K:  # K a multiple of 256: only the rows beyond M are masked
            return tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_j)[None, :], mask=m_ok[:, None], other=0.0)
        else:
            return tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_j)[None, :],
                           mask=m_ok[:, None] & ((k + offs_j)[None, :] < K), other=0.0)

    @triton.jit
    def _fma_amd(x, y, z):
        """x * y + z rounded once (v_fma_f32), one element an asm. What `acc + part * s[None, :]` contracts to on
        CDNA, written out because LLVM pairs those FMAs into v_pk_fma_f32 and, the column scale being the same for
        a lane's four accumulator rows, copies it into register pairs first: at 128 columns a wave (the decode
        tail's one-wave tile, `decode_tail_config`) 288 v_mov_b32 of gfx950's 1944 instructions at K3's shapes, and
        one scalar FMA a value needs no copy (1823). At 64 columns a wave the paired form copies little and takes
        fewer instructions (chord's and MiniMax-M3's decode launches: 2-6 % more with this), so they keep it."""
        return tl.inline_asm_elementwise("v_fma_f32 $0, $1, $2, $3", "=v,v,v,v", [x, y, z], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def group_dot(acc, a, b, s, neg, DOT_FP32: tl.constexpr, FMA_AMD: tl.constexpr = False):
        """acc [BLOCK_M, BLOCK_N] fp32 + (a @ (b - 136)) * s[None, :] for one nibble tile b [32, BLOCK_N] bf16
        (128 + u) and its column scales s [BLOCK_N] fp32: two MMAs into one fp32 sum (128 + u, then the
        constant -136 tile `neg`); the scale by one FMA a value (FMA_AMD: `_fma_amd`'s, the CDNA loop's)."""
        if DOT_FP32:  # the interpreter: its bf16 dot is wrong (device.dot_needs_fp32)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), tl.dot(a.to(tl.float32), neg))
        else:
            part = tl.dot(a, b, tl.dot(a, neg))                    # Σ a (128 + u) - 136 Σ a = Σ a (u - 8)
        if FMA_AMD:
            return _fma_amd(part, tl.broadcast_to(s[None, :], part.shape), acc)
        else:
            return acc + part * s[None, :]

    @triton.jit
    def column_scale(s_ptr, r, i, pairs_per_row, offs_n, n_ok, GROUP: tl.constexpr, EVEN_N: tl.constexpr):
        """fp32 [BLOCK_N] scales of nibble tile i of run r, one 4-byte load a column (its pair's word of that
        group in `pack_decode`'s [runs, pairs, 256 / GROUP, 2] layout: both columns' bf16) and one shift
        and mask to widen its own half (the CDNA loop: no [P, 8] tile to move into the accumulator's layout)."""
        GR: tl.constexpr = 256 // GROUP
        word = (r * pairs_per_row + offs_n // 2) * GR + (32 * i) // GROUP
        s32 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if EVEN_N:
            w = tl.load(s32 + word)
        else:
            w = tl.load(s32 + word, mask=n_ok, other=0)
        return ((w << ((1 - offs_n % 2) * 16)) & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def decode_run(acc, x_ptr, stride_xm, offs_m, m_ok, qw_ptr, s_ptr, row_stride, n0, offs_n, n_ok, K, r, neg,
                   GROUP: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr, CDNA_LOOP: tl.constexpr = False, FMA_AMD: tl.constexpr = False):
        """acc [BLOCK_M, BLOCK_N] fp32 += x[offs_m, run r] @ W[offs_n, run r].T for one run of 256 K values:
        one [32, BLOCK_N] word tile (row stride `row_stride` words), eight nibble tiles of one group each
        (or GROUP/32 tiles a group), each through two MMAs (128 + u, then the constant -136) and its
        column scale. Scales: `pack_decode`'s [runs, ceil(row_stride / 2), 256 / GROUP, 2] layout.
        CDNA_LOOP (the AMD configs, `DECODE_TARGETS`): the nibbles a byte at a time (`nibble_byte_bf16`: one
        v_perm_b32 serves two tiles) and each column's scale word loaded where it is used (`column_scale`);
        the NVIDIA loop loads the run's scales in one [P, 8] load and widens them a pair at a time. FMA_AMD (the CDNA
        loop only): the scales by `_fma_amd`, for a tile where LLVM's paired FMAs copy them (`group_dot`)."""
        offs_j = tl.arange(0, 32)
        if EVEN_N:  # N a multiple of BLOCK_N: no column mask in the loop
            words = tl.load(qw_ptr + (r * 32 + offs_j)[:, None] * row_stride + offs_n[None, :])
        else:
            words = tl.load(qw_ptr + (r * 32 + offs_j)[:, None] * row_stride + offs_n[None, :], mask=n_ok[None, :],
                            other=0)
        GR: tl.constexpr = 256 // GROUP                             # groups a run
        pairs_per_row = (row_stride + 1) // 2
        if CDNA_LOOP:
            for bi in tl.static_range(4):
                k = r * 256 + 64 * bi
                b_even, b_odd = nibble_byte_bf16(words, bi, ASM)    # 128 + u of tiles 2 bi, 2 bi + 1, exact in bf16
                acc = group_dot(acc, group_activations(x_ptr, stride_xm, offs_m, m_ok, K, k, EVEN_K), b_even,
                                column_scale(s_ptr, r, 2 * bi, pairs_per_row, offs_n, n_ok, GROUP, EVEN_N), neg, DOT_FP32,
                                FMA_AMD)
                acc = group_dot(acc, group_activations(x_ptr, stride_xm, offs_m, m_ok, K, k + 32, EVEN_K), b_odd,
                                column_scale(s_ptr, r, 2 * bi + 1, pairs_per_row, offs_n, n_ok, GROUP, EVEN_N), neg, DOT_FP32,
                                FMA_AMD)
        else:
            PAIRS: tl.constexpr = EVEN_N and GROUP == 32
            if PAIRS:  # the run's 8 groups x BLOCK_N columns in one load
                g0, g1, g2, g3, g4, g5, g6, g7 = run_scales(s_ptr, r, n0 // 2, pairs_per_row, offs_n.shape[0] // 2)
            for i in tl.static_range(8):
                a = group_activations(x_ptr, stride_xm, offs_m, m_ok, K, r * 256 + 32 * i, EVEN_K)
                b = nibble_bf16(words, i, ASM)                         # 128 + u, exact in bf16
                if PAIRS:
                    if i == 0:
                        s = widen_pairs(g0)
                    elif i == 1:
                        s = widen_pairs(g1)
                    elif i == 2:
                        s = widen_pairs(g2)
                    elif i == 3:
                        s = widen_pairs(g3)
                    elif i == 4:
                        s = widen_pairs(g4)
                    elif i == 5:
                        s = widen_pairs(g5)
                    elif i == 6:
                        s = widen_pairs(g6)
                    else:
                        s = widen_pairs(g7)
                else:
                    s_off = ((r * pairs_per_row + offs_n // 2) * GR + (32 * i) // GROUP) * 2 + offs_n % 2
                    if EVEN_N:
                        s = tl.load(s_ptr + s_off).to(tl.float32)
                    else:
                        s = tl.load(s_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
                acc = group_dot(acc, a, b, s, neg, DOT_FP32)
        return acc

    @triton.jit
    def decode_neg(BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """The constant B tile of -136 (bf16, or fp32 in the interpreter)."""
        if DOT_FP32:
            return tl.full((32, BLOCK_N), -136.0, tl.float32)
        else:
            return tl.full((32, BLOCK_N), -136.0, tl.bfloat16)

    @triton.jit
    def decode_program(M, N, K, SPLITS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's column block and split of both decode kernels (grid (column blocks, SPLITS)):
        (pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, r0, r1); split pid_k takes runs [r0, r1) of the K / 256."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        runs = (K + 255) // 256
        return (pid_n, pid_k, offs_m, offs_n, offs_m < M, offs_n < N, (pid_k * runs) // SPLITS,
                ((pid_k + 1) * runs) // SPLITS)

    @triton.jit
    def w4a16_decode_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, stride_xm, SPLITS,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            ASM: tl.constexpr, DOT_FP32: tl.constexpr, ATOMIC: tl.constexpr,
                            EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False, CDNA_LOOP: tl.constexpr = False):
        """out[pid_k, m, n] (fp32) = Σ over this split's runs of x[m, k] W[n, k]; ATOMIC adds into out[m, n].
        x bf16 [M, K]; qw int32 [Kp/8, N] and s bf16 [Kp/GROUP, N] from `pack_decode`. Split pid_k of
        SPLITS takes runs [pid_k runs / SPLITS, (pid_k + 1) runs / SPLITS): whole runs, the counts
        differing by at most one, so the split count can fit the SM count where the runs do not divide."""
        pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, r0, r1 = decode_program(M, N, K, SPLITS, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        neg = decode_neg(BLOCK_N, DOT_FP32)
        for r in range(r0, r1):
            acc = decode_run(acc, x_ptr, stride_xm, offs_m, m_ok, qw_ptr, s_ptr, N, pid_n * BLOCK_N, offs_n, n_ok, K, r, neg,
                             GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP)
        mask = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


    @triton.jit
    def decode_run_swapped(acc, x_ptr, stride_xm, offs_m, m_ok, qw_ptr, s_ptr, row_stride, offs_n, n_ok, K, r, neg, s_col,
                           GROUP: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_N: tl.constexpr,
                           EVEN_K: tl.constexpr):
        """Swap-AB: acc [BLOCK_N, BLOCK_M] fp32 += W[offs_n, run r] @ x[offs_m, run r].T for one run. The
        weights are the MMA's A operand (m16 rows of output columns), the activations its n8 B operand, so
        at M <= 8 no MMA row is padding and a warp's activation loads and -136 MMA serve all its columns.
        The [BLOCK_N, 32] word tile is read as rows n (the same `pack_decode` bytes as `decode_run`), each
        nibble tile straight into the A operand; a column's scale per group is one 2-byte load at
        s_col [BLOCK_N] (int32: its offset in `pack_decode`'s scale layout within a run and group, computed
        once a CTA, so the loop adds one scalar a group)."""
        offs_j = tl.arange(0, 32)
        if EVEN_N:
            words = tl.load(qw_ptr + (r * 32 + offs_j)[None, :] * row_stride + offs_n[:, None])
        else:
            words = tl.load(qw_ptr + (r * 32 + offs_j)[None, :] * row_stride + offs_n[:, None], mask=n_ok[:, None],
                            other=0)
        GR: tl.constexpr = 256 // GROUP
        pairs_per_row = (row_stride + 1) // 2
        for i in tl.static_range(8):
            k = r * 256 + 32 * i
            if EVEN_K:
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_j)[:, None], mask=m_ok[None, :], other=0.0)
            else:
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_j)[:, None],
                             mask=m_ok[None, :] & ((k + offs_j)[:, None] < K), other=0.0)
            b = nibble_bf16(words, i, ASM)                         # [BLOCK_N, 32] 128 + u, exact in bf16
            s_run = s_ptr + (r * pairs_per_row * GR + (32 * i) // GROUP) * 2
            if EVEN_N:
                s = tl.load(s_run + s_col).to(tl.float32)
            else:
                s = tl.load(s_run + s_col, mask=n_ok, other=0.0).to(tl.float32)
            if DOT_FP32:  # the interpreter: its bf16 dot is wrong (device.dot_needs_fp32)
                part = tl.dot(b.to(tl.float32), xt.to(tl.float32), tl.dot(neg, xt.to(tl.float32)))
            else:
                part = tl.dot(b, xt, tl.dot(neg, xt))              # Σ (128 + u) x - 136 Σ x = Σ (u - 8) x
            acc += part * s[:, None]
        return acc

    @triton.jit
    def swapped_operands(offs_n, GROUP: tl.constexpr, DOT_FP32: tl.constexpr):
        """`decode_run_swapped`'s loop-invariant operands for the columns offs_n [BLOCK_N]: the constant A tile of
        -136 [BLOCK_N, 32] (bf16, or fp32 in the interpreter) and s_col, int32 [BLOCK_N], each column's scale
        offset within its pair's groups of a run (computed once a CTA)."""
        neg = tl.full((offs_n.shape[0], 32), -136.0, tl.float32 if DOT_FP32 else tl.bfloat16)
        return neg, (offs_n // 2) * (2 * (256 // GROUP)) + offs_n % 2

    @triton.jit
    def w4a16_decode_swapped_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, stride_xm, SPLITS,
                                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    ASM: tl.constexpr, DOT_FP32: tl.constexpr, ATOMIC: tl.constexpr,
                                    EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False):
        """`w4a16_decode_kernel` with the operands swapped (`decode_run_swapped`): the same arguments, split
        and outputs; the accumulator is [BLOCK_N, BLOCK_M] (BLOCK_M 8 at M <= 8), stored through transposed
        pointers into the same fp32 [SPLIT, M, N] (or, ATOMIC, [M, N]) buffer."""
        pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, r0, r1 = decode_program(M, N, K, SPLITS, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        neg, s_col = swapped_operands(offs_n, GROUP, DOT_FP32)
        for r in range(r0, r1):
            acc = decode_run_swapped(acc, x_ptr, stride_xm, offs_m, m_ok, qw_ptr, s_ptr, N, offs_n, n_ok, K, r, neg, s_col,
                                     GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K)
        mask = n_ok[:, None] & m_ok[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)


DECODE_MAX_M = 16
SWAP_MAX_M = 8     # the swap-AB kernel's BLOCK_M: the activations are the MMA's n8 operand
DENSE_DECODE_KERNELS = ("w4a16_decode_kernel", "w4a16_decode_swapped_kernel")   # decode_linear's kernels, by name
H200_SMS = 132


def decode_asm(device) -> int:
    """Which dequantize the decode kernels take (their ASM constexpr): 1, inline PTX (`prmt`/`lop3`) on an
    NVIDIA GPU or when building for an sm target; 2, inline AMDGCN (`v_perm_b32`/`v_and_or_b32`) on a ROCm
    GPU or `building_for('gfx942')`/`'gfx950'`; 0, plain tl ops, in the interpreter."""
    if dot_needs_fp32(device):
        return 0
    return 2 if target_vendor(kernel_target(device)) == "hip" else 1



# Per target (`device.pick_config`): the SMs the split-K fills, the column block and its warps, the
# CTAs per SM the split aims at, whether the split must divide the runs evenly, and the pipeline depth.
# B200 (sm_100, 148 SMs) reads HBM 1.67x faster than H200 but issues only 1.11x more instructions, so
# its grid must fill 148 SMs without a long tail. At N 4096, K 7168 with 128-column CTAs no split does:
# 7 equal splits (224 CTAs) leave the busiest SM 2 CTAs of 4 runs where the average has 1.5; 9 splits
# of 3 or 4 runs (288 CTAs) put a 4-run and a 3-run CTA on the busiest SM (7 runs where the average
# has 6.05) and 1.3x the CTAs' prologues, which the cost model (each CTA's own trips) predicts under
# 80 % of the copy ceiling at M = 2. 64-column CTAs of 2 warps (the same 32 columns a warp, 5 resident
# a SM) halve the grain: 6 splits of 4 or 5 runs (384 CTAs, at most 3 a SM) keep the prologues few and
# the busiest SM near the average (`inferbook inspect chord-w4a16 --target sm_100`).
# 3 stages, not 2: 2 save a few loop instructions but wait one DRAM latency a run instead of half of one.
# Short CTAs (sm_100's `short_runs`): where that split leaves a CTA fewer than 4 runs, its pipeline's fill
# (one DRAM latency) is paid over too few runs and the CTAs' prologues pile up. MiniMax-M3's shared MLP
# (gate/up N 3072, K 6144: 24 runs, 48 column blocks) takes 8 splits of 3 runs there: 384 CTAs, the
# busiest SM 3 where the average has 2.59, predicted 78 % (M 1) and 76 % (M 8) of the copy ceiling,
# waves-bound, issue/memory 1.11 and 1.13. Such a shape takes instead the most equal splits that put
# more than one and at most two CTAs on each SM (two 2-warp CTAs fill the 4 schedulers) and a 4-stage
# pipeline (3 runs in flight, so a CTA of 4 runs waits 2.3 latencies, not 3): 6 splits of 4 runs (288
# CTAs), predicted 89 % / 91 % / 97 % at M 1 / 8 / 16, issue/memory 1.09 / 1.07 / 1.00 (`inferbook
# inspect minimax-m3-moe --target sm_100`; its down, N 6144 K 1536, 3 splits of 2 runs: predicted 56 %
# at M 1, latency-bound, which is the model's floor for any kernel of its 5.3 MB on B200: they take less
# than two DRAM latencies, `compiled.latency_floor_fraction`; no config of the sweep below takes its issue time under
# memory / 0.9 at M 1 without losing time: 2 splits of 3 runs are predicted alike, 1.20 µs, at issue/memory 1.14,
# 1.11, 1.03 at M 1, 8, 16, and 2 splits at 3 stages reach 1.11 at M 1 but 1.50 µs; `python -m
# inferbook.moe.decode_sweep sm_100 6144 1536 --m 1,8 --block-n 32,64,128 --warps 1,2,4 --stages 2,3,4
# --splits 1,2,3,6` lists them all). 4 stages cost about 70 prologue instructions
# a warp, so a shape whose CTAs already run 4 or more runs keeps 3 (chord-w4a16's N 4096, K 7168 at 4
# stages: predicted 81 % at M 1, not 82 %). These plain-kernel rules now run on B200 at M 9..16 only:
# Swap-AB (sm_100's `swap_ab`, M <= 8): the weights become the MMA's A operand and the activations its B
# operand, as vLLM's CUTLASS dispatch does for M <= 16 on sm_100 (`scaled_mm_sm100_fp8_dispatch.cuh`:
# `sm100_fp8_config_M16_swap_ab`, a 128 x 32 tile, the epilogue transposed). The weights fill the MMA's m16
# rows and the tokens its n8 columns (BLOCK_M 8, `w4a16_decode_swapped_kernel`), so no MMA row is padding
# and the FFMAs that apply the scales halve; one warp holds 64 columns, so its activation loads and its -136
# MMA serve 64 columns, not 32. One-warp CTAs (255 registers), split so about 4 sit on each SM, one a
# scheduler. Predicted on B200 (datasheet ceiling) against the plain kernel above, at M 1 / 8:
# chord's N 4096, K 7168, 9 splits: 2.08 / 2.23 µs, memory-bound (plain: 2.53 / 2.60, waves);
# MiniMax-M3's gate/up, N 3072, K 6144, 12 splits: 1.35 / 1.49 µs, memory-bound (plain: 1.50 / 1.55, waves);
# its down, N 6144, K 1536, 6 splits of one run: 1.20 µs, latency-bound as before (its floor), issue/memory
# 1.07 / 0.93 (plain: 1.24 / 1.17). No spills: a column's scale offset within its pair's groups is
# computed once, outside the loop (computed per run, it cost 8 B of spill at M > 1). `decode_sweep
# ... --swap 0,1` sweeps both kernels. At M 16 the plain kernel's m16 rows are all used, and it stays.
# On H200 (and the other NVIDIA targets) short CTAs take 64-column CTAs of 2 warps instead, split unevenly to
# about 2.9 CTAs per SM on a 4-stage pipeline: 128-column CTAs of 4 warps hold 194 registers a thread, so
# only 2 fit an SM, and a split to 2 CTAs an SM of 1 to 3 runs leaves the busiest SM a third CTA's chain.
# MiniMax-M3's shared MLP on sm_90 (`inferbook inspect minimax-m3-moe --target sm_90`): gate/up, 8 equal
# splits of 3 runs at 128 columns, predicted 89 % of the copy ceiling at M 1 (waves) -> 8 splits of 3 runs
# at 64 columns, 100 % (memory); down, 6 splits of 1 run, 47 % at M 1 and 57 % at M 8 (waves) -> 4 splits of
# 1 or 2 runs, 94 % (latency) and 100 %; 4 or 5 resident CTAs a SM where the 128-column CTA had 2. (With 1 or
# 2 runs a CTA, 3 and 4 stages are predicted alike; the gate/up's 3 runs wait 2 latencies at 4, 2.5 at 3.)
_WIDE_CTAS = dict(sms=H200_SMS, block_n=128, num_warps=4, ctas_per_sm=2.0, even_split=True, num_stages=3)
_CDNA = dict(sms=304, block_n=128, num_warps=2, ctas_per_sm=2.0, even_split=True, num_stages=1, cdna_loop=True)
DECODE_TARGETS = {
    "nvidia": dict(_WIDE_CTAS, short_runs=dict(below=4, block_n=64, num_warps=2, ctas_per_sm=2.9, num_stages=4)),
    "sm_100": dict(sms=148, block_n=64, num_warps=2, ctas_per_sm=2.6, even_split=False, num_stages=3,
                   short_runs=dict(below=4, num_stages=4, equal_split=True),
                   swap_ab=dict(max_m=SWAP_MAX_M, block_m=SWAP_MAX_M, block_n=64, num_warps=1, num_stages=3,
                                ctas_per_sm=4.0)),
    # CDNA: the CDNA loop (`decode_run`'s CDNA_LOOP: a v_perm_b32 per byte serves two nibble tiles, scales a word
    # a column), no pipelining (num_stages 1: the AMD stream pipeliner stages the word tile through LDS, about 40 %
    # more instructions a run, and enough resident waves hide the latency instead), and splits of about 2 runs
    # (a CTA's chain is then 3 DRAM latencies). The cost model (`python -m inferbook.moe.decode_sweep gfx942 4096
    # 7168 --m 1,16 --block-n 64,128 --warps 1,2,4 --stages 1,2,3 --splits 7,14,28`) at chord's N 4096, K 7168,
    # M 1, datasheet ceiling: MI300X (304 CUs), 128 columns of 2 waves, 14 splits: 3.36 us, waves-bound, issue/
    # memory 0.78 (its loads, though, one after another: see below; the NVIDIA tiles at 3 stages and 7 splits: 7.58 us, issue-bound, 2.41); MI355X (256 CUs at 2.4 GHz,
    # 8 TB/s: 1.5x MI300X's bandwidth, 0.96x its issue rate), 64 columns of one wave (2 waves: issue/memory 1.05), 14 splits: 2.40 us,
    # latency-bound, 0.99. MiniMax-M3's gate/up (N 3072, K 6144): MI355X 24 splits of one run, 1.68 us (12:
    # 2.40); MI300X 24 splits, 2.06 us, memory-bound. Its down (N 6144, K 1536, 6 runs) is held by the latency
    # floor (one run a CTA: 2 latencies, 1.60 us, against 1.03 / 0.68 us of memory).
    # MI300X takes MI355X's one-wave CTAs of 64 columns too: at two waves the waves share each group's
    # activation tile through LDS, a barrier a tile, so a trip waited 9 loads one after another
    # (`compiled.machine.load_rounds`, not charged by the model); at one, one. Predicted alike at chord's N 4096,
    # K 7168 (3.36 -> 3.38 us at M 1, issue-bound at 1.07 of memory; M 16 3.85, memory-bound) and MiniMax-M3's
    # gate/up (2.06 us at C 1). Where 1-wave CTAs are fewer than 2 a CU (`few_ctas`: MiniMax-M3's down, 96 x 6),
    # they are narrowed to 32 columns: 1.60 us at the floor, as its 2-wave 64-column CTAs were (64 columns of
    # one wave: 1.94, waves; `python -m inferbook.moe.decode_sweep gfx942 6144 1536 --m 1,8 --block-n 32,64
    # --warps 1,2 --stages 1 --splits 3,6`).
    "hip": _CDNA,
    "gfx942": dict(_CDNA, sms=304, block_n=64, num_warps=1, ctas_per_sm=4.5, few_ctas=dict(block_n=32, below=2.0)),
    "gfx950": dict(_CDNA, sms=256, block_n=64, num_warps=1, ctas_per_sm=4.5),
}


def decode_config(m: int, n: int, k: int, *, sms: int | None = None, interpreted: bool = False, device=None) -> dict:
    """Tiles and split-K of the decode kernel. BLOCK_N 128 (4 warps, one m16 x 32 MMA strip per
    warp; on sm_100 BLOCK_N 64 of 2 warps, `DECODE_TARGETS`); split K over runs so the grid holds about
    2 CTAs (8 warps) per SM -- what the kernel's registers let an SM hold at once -- each split >= 1 run. Fewer, longer splits amortise each CTA's
    prologue (the pipeline's fill) and epilogue over more runs: at N 4096, K 7168 a split of 7 (224 CTAs,
    4 runs each) is predicted faster than one of 10 that gives every SM two CTAs (3 runs each), which
    spends more of its issue slots outside the main loop. Where the target allows uneven splits
    (`DECODE_TARGETS`) the split count is the one nearest the target's CTAs per SM and splits differ by one run;
    where that leaves a CTA too few runs (`short_runs`), on sm_100 the most equal splits of 1 to 2 CTAs an
    SM and a deeper pipeline, on the other NVIDIA targets 64-column CTAs of 2 warps, about 2.9 an SM. On
    sm_100 at M <= 8 the swap-AB kernel instead (`SWAP_AB`, BLOCK_M 8: `swap_ab`), one-warp CTAs of 64
    columns, about 4 an SM, splits differing by one run. On CDNA (gfx942, gfx950) the CDNA loop (`CDNA_LOOP`),
    one stage, the card's one-wave tiles, and narrower CTAs where the grid has few CTAs for the CUs (`few_ctas`).
    `device`: whose target picks the entry (`device.pick_config`; default a CUDA device, i.e. the
    `building_for` target or the GPU's). The interpreter: one wide program per split (its cost is per program)."""
    if m > DECODE_MAX_M:
        raise ValueError(f"the decode kernel takes M <= {DECODE_MAX_M} rows, got {m}")
    runs = max(1, -(-k // RUN))
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=min(2, runs))
    t = pick_config(DECODE_TARGETS, torch.device("cuda") if device is None else device)
    sms = sms or t["sms"]

    def splits_for(bn: int, ctas_per_sm: float) -> int:    # splits of whole runs giving about ctas_per_sm an SM
        return max(1, min(runs, round(ctas_per_sm * sms / -(-n // bn))))

    swap = t.get("swap_ab")
    if swap and m <= swap["max_m"]:                               # the weights as the MMA's A operand
        bn = swap["block_n"]
        return dict(BLOCK_M=swap["block_m"], BLOCK_N=bn, SPLIT_K=splits_for(bn, swap["ctas_per_sm"]),
                    num_warps=swap["num_warps"], num_stages=swap["num_stages"], SWAP_AB=True)

    bn = t["block_n"]
    n_blocks = -(-n // bn)
    split = splits_for(bn, t["ctas_per_sm"])
    stages = t["num_stages"]
    if t["even_split"]:
        per = -(-runs // split)
        split = -(-runs // per)                                    # whole equal splits, no empty one
    warps = t["num_warps"]
    short = t.get("short_runs")
    if short and runs < short["below"] * split:                  # CTAs of fewer runs than `below`
        if short.get("equal_split"):                               # 1 to 2 CTAs an SM, equal runs, deeper pipeline
            equal = [s for s in range(1, runs + 1) if runs % s == 0 and sms < n_blocks * s <= 2 * sms]
            if equal:
                split, stages = max(equal), short["num_stages"]
        else:                                                      # narrower CTAs, more of them resident, uneven split
            bn, warps, stages = short["block_n"], short["num_warps"], short["num_stages"]
            split = splits_for(bn, short["ctas_per_sm"])
    few = t.get("few_ctas")
    if few and n_blocks * split < few.get("below", 1.0) * sms:    # few CTAs for the SMs (CUs): narrower ones
        bn = few["block_n"]
        split = splits_for(bn, t["ctas_per_sm"])
    cfg = dict(BLOCK_M=16, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return dict(cfg, CDNA_LOOP=True) if t.get("cdna_loop") else cfg


def _decode_launch(x2, qweight, scales, out, n: int, k: int, group_size: int, cfg: dict, *, device, atomic: bool):
    from ..compiled import Launch

    M = x2.shape[0]
    if M > cfg["BLOCK_M"]:
        raise ValueError(f"decode config BLOCK_M {cfg['BLOCK_M']} holds fewer than the {M} rows")
    swap = bool(cfg.get("SWAP_AB"))
    kw = {key: v for key, v in cfg.items() if key not in ("SPLIT_K", "SWAP_AB")}
    emu = dot_needs_fp32(device)
    return Launch(f"w4a16 decode M{M} N{n} K{k} cfg {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x256 split{cfg['SPLIT_K']}"
                  f"{' swap-AB' if swap else ''}{' atomic' if atomic else ''}",
                  w4a16_decode_swapped_kernel if swap else w4a16_decode_kernel,
                  [x2, qweight, scales, out, M, n, k, x2.stride(0), cfg["SPLIT_K"]],
                  dict(GROUP=group_size, ASM=decode_asm(device), DOT_FP32=emu, ATOMIC=atomic, EVEN_N=n % cfg["BLOCK_N"] == 0,
                       EVEN_K=k % RUN == 0, **kw),
                  "moe/w4a16.py:decode_linear", (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"]))


def decode_linear(x: torch.Tensor, d: DecodeW4, *, deterministic: bool = True, block: dict | str | None = None,
                  return_kernel: bool = False):
    """W4A16 GEMM for decode: `x [..., K]` BF16 (at most 16 rows) times a `pack_decode` weight -> BF16
    `[..., N]`. deterministic=True: the split-K partials go to fp32 [SPLIT, M, N] and are summed in
    split order; False: atomically added into a zeroed fp32 [M, N] (order varies run to run).
    `block`: None = `decode_config` for this device, "gpu" = the GPU's tiles (also in the interpreter)."""
    if not isinstance(d, DecodeW4) or len(d.shape) != 2:
        raise ValueError(f"decode_linear needs a 2-D DecodeW4 from pack_decode(), got {getattr(d, 'shape', type(d).__name__)}")
    N, K = d.shape
    _check_activations(x, K, "decode_linear")
    if x.device != d.device:
        raise ValueError(f"decode_linear: activations on {x.device} but weights on {d.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M > DECODE_MAX_M:
        raise ValueError(f"decode_linear takes at most {DECODE_MAX_M} rows, got {M}; use linear() for larger M")
    ok, _ = triton_backend_for(x.device)
    if M == 0 or N == 0 or not ok:
        out = (x2 @ dequantize_decode(d, torch.bfloat16).T) if M and N else torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
        return (out.reshape(*lead, N), None) if return_kernel else out.reshape(*lead, N)
    interp = x.device.type != "cuda"
    cfg = dict(decode_config(M, N, K, device=x.device) if block == "gpu" else (block or decode_config(M, N, K, interpreted=interp, device=x.device)))
    if deterministic:
        part = torch.empty((cfg["SPLIT_K"], M, N), dtype=torch.float32, device=x.device)
    else:
        part = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    la = _decode_launch(x2, d.qweight, d.scales, part, N, K, d.group_size, cfg, device=x.device, atomic=not deterministic)
    kernel = la.kernel[la.grid](*la.args, **la.kwargs)
    out = (part.sum(0) if deterministic else part).to(torch.bfloat16)
    return (out.reshape(*lead, N), kernel) if return_kernel else out.reshape(*lead, N)


def decode_reference(x: torch.Tensor, d: DecodeW4) -> torch.Tensor:
    """fp32 reference for `decode_linear`: dequantize, x @ W.T in fp32. Returns fp32 [..., N]."""
    return x.float() @ dequantize_decode(d, torch.float32).T


def decode_launches(m: int, n: int, k: int, *, group_size: int = GROUP_SIZE, deterministic: bool = True,
                    name: str = "", cfg: dict | None = None) -> list:
    """The launch `decode_linear(x [m, k], pack_decode(q [n, k]), block=cfg)` makes on a GPU
    (`compiled.Launch`); `cfg` None: `decode_config`'s pick."""
    from ..compiled import meta

    cfg = cfg or decode_config(m, n, k)
    out = meta((cfg["SPLIT_K"], m, n) if deterministic else (m, n), torch.float32)
    words, scales = decode_packed_shapes(n, k, group_size)         # pack_decode's shapes: the real bytes
    la = _decode_launch(meta((m, k), torch.bfloat16), meta(words, torch.int32), meta(scales, torch.bfloat16), out, n, k,
                        group_size, cfg, device=torch.device("cuda"), atomic=not deterministic)
    if name:
        la.name = name
    return [la]
