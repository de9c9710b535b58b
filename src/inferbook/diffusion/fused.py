"""Fused operations of the H3 video VAE: references, Triton kernels and the dispatch between them.

The seed (ComfyUI #16187, read against `comfy/ldm/minimax/vae.py` and comfy-kitchen) moves the
normalization, SiLU and padding in front of each causal 3D convolution into one kernel
(`group_norm_silu_pad3d`: per-frame GroupNorm, SiLU, reflect padding in space and zero frames in front,
NDHWC out), adds the residual in the convolution's epilogue, and gives the ViT decoder's Attention and
FeedForward a linear-layer interface that takes RMSNorm, SwiGLU and a scaled residual as parameters
(`linear_input_act`). This module builds each of those ways:

- eager: plain PyTorch, one kernel per operation (`*_eager`), also the correctness reference;
- Triton: `_frame_stats_kernel` (per-frame GroupNorm statistics) and `_norm_silu_pad_kernel` (norm + SiLU
  + padding written once into the NDHWC buffer the convolution reads; an interior launch with 16-byte
  vectors and a border launch for the reflected columns), `_fused_linear_kernel` (RMSNorm prologue,
  SwiGLU / bias / scaled-residual epilogue) and `_conv3d_implicit_gemm_kernel` (the fp16-accumulation
  conv behind `--fast fp16_accumulation`, bias and residual in its epilogue);
- torch.compile of the eager model is chosen one level up, in `vae.py`.

`Ops(backend=...)` is the dispatch: it picks the Triton kernel when it can run (`triton_backend_for`),
else the eager op, and notes every choice with its reason and the shapes it saw in a `BackendLog`,
which a RunRecord stores. Two gates from the seed are explicit arguments, never defaults:
`fp16_accumulation=True` enables the FP16-accumulation convolution, and INT8 attention exists only in
a model returned by `vae.quantize_decoder_int8()`.

Tensor layout: video activations are [B, C, T, H, W] with channels-last (NDHWC) memory; linear inputs
are [..., K].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import bf16_cast_needs_emulation, dot_needs_fp32, triton_backend_for
from ..errors import UserError
from ..triton_utils import cast_rtne

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("eager", "fused")
NORMS = ("rms", "group")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise UserError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Which backend ran, why, and on what shapes.

@dataclass
class BackendLog:
    """Per operation: the backend(s) actually used, the reason, the distinct local shapes, call count."""

    ops: dict = field(default_factory=dict)

    def note(self, op: str, backend: str, reason: str, shapes: dict, dtype) -> None:
        e = self.ops.setdefault(op, {"backend": backend, "reason": reason, "shapes": [], "calls": 0,
                                     "dtype": str(dtype).replace("torch.", "")})
        if backend not in e["backend"].split(" + "):
            e["backend"] += " + " + backend  # mixed backends within one run are visible, never hidden
            e["reason"] += f"; {backend}: {reason}"
        shp = {k: list(v) for k, v in shapes.items()}
        if shp not in e["shapes"] and len(e["shapes"]) < 12:
            e["shapes"].append(shp)
        e["calls"] += 1

    def backend(self, op: str) -> str:
        return self.ops[op]["backend"]

    def to_record(self, rec) -> None:
        for op, e in self.ops.items():
            rec.set_backend(op, e["backend"], reason=e["reason"], shapes={"seen": e["shapes"], "calls": e["calls"]},
                            dtype=e["dtype"])


def triton_usable(x: torch.Tensor) -> tuple[bool, str]:
    """Can the fused Triton kernels take `x`? (ok, how-or-why-not)."""
    ok, why = triton_backend_for(x.device)
    if not ok:
        return False, why
    if x.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {str(x.dtype).replace('torch.', '')} is not supported by the fused kernels " \
                      f"(float32, bfloat16, float16)"
    if x.numel() == 0:
        return False, "empty tensor"
    return True, why


# ---------------------------------------------------------------------------------------------------
# Eager references. Written the way ComfyUI writes them (comfy/ldm/minimax/vae.py and comfy-kitchen's
# eager `group_norm_silu_pad3d`): one PyTorch op per step.

def _pad5(pad) -> tuple[int, int, int, int, int]:
    """(left, right, top, bottom, front): comfy-kitchen's order. Reflect in space, zeros in front."""
    if len(pad) != 5 or any((not isinstance(p, int)) or isinstance(p, bool) or p < 0 for p in pad):
        raise UserError(f"pad must be 5 non-negative ints (left, right, top, bottom, front), got {pad!r}")
    return tuple(pad)


def conv_pad(kernel: tuple[int, int, int], T: int, spatial_pad=None) -> tuple[int, int, int, int, int]:
    """The padding ComfyUI's CausalConv3d applies for a kernel (kt, kh, kw) and padding (kt//2, kh//2, kw//2):
    reflect (kw//2, kw//2, kh//2, kh//2) in space (or `spatial_pad`), and 2*(kt//2) = kt-1 zero frames in
    front, except for a single frame (T == 1), where the conv drops its zero taps instead ('causal_zero')."""
    kt, kh, kw = kernel
    sp = tuple(spatial_pad) if spatial_pad is not None else (kw // 2, kw // 2, kh // 2, kh // 2)
    return (*sp, 0 if T == 1 else 2 * (kt // 2))


def rms_norm_channels_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the channel dim of [B, C, ...] (per pixel); statistics in fp32, result in x.dtype."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)
    y = y * weight.float().view(shape)
    if bias is not None:
        y = y + bias.float().view(shape)
    return y.to(x.dtype)


def frame_group_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                           groups: int) -> torch.Tensor:
    """ComfyUI's TemporalIsolatedGroupNorm: GroupNorm whose statistics are one frame's (C/G, H, W), time
    folded into the batch. x [B, C, T, H, W] -> same shape and dtype."""
    b, c, t, h, w = x.shape
    y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    y = F.group_norm(y, groups, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)
    return y.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


@dataclass
class Norm:
    """A channel norm: `kind` 'group' (per-frame GroupNorm, as H3's encoder) or 'rms' (per pixel, over C)."""

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float = 1e-6
    groups: int = 32

    def __post_init__(self):
        _check_choice("norm", self.kind, NORMS)
        C = self.weight.numel()
        if self.kind == "group" and C % self.groups:
            raise UserError(f"GroupNorm({self.groups}) needs channels divisible by {self.groups}, got {C}")

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return rms_norm_channels_eager(x, self.weight, self.bias, self.eps)
        return frame_group_norm_eager(x, self.weight, self.bias, self.eps, self.groups)


def norm_silu_pad_eager(x: torch.Tensor, norm: Norm | None, pad, silu: bool = True) -> torch.Tensor:
    """norm -> SiLU -> reflect padding in space, zero frames in front (comfy-kitchen's eager op).

    x [B, C, T, H, W]; pad (left, right, top, bottom, front); norm None skips the norm (and the SiLU
    unless `silu`). Returns [B, C, T+front, H+top+bottom, W+left+right] in x.dtype, channels-last (NDHWC)."""
    left, right, top, bottom, front = _pad5(pad)
    y = norm.eager(x) if norm is not None else x
    if silu:
        y = F.silu(y)
    if left or right or top or bottom:
        y = F.pad(y, (left, right, top, bottom, 0, 0), mode="reflect")
    if front:
        y = F.pad(y, (0, 0, 0, 0, front, 0))
    return y.contiguous(memory_format=torch.channels_last_3d)


def conv3d_eager(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride=1,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """Valid 3D convolution of an already padded input, residual added after it (ComfyUI: `out += residual`).
    A channels-last input gets a channels-last weight, so cuDNN keeps the output NDHWC."""
    if xp.is_contiguous(memory_format=torch.channels_last_3d) and xp.shape[1] > 1:
        weight = weight.contiguous(memory_format=torch.channels_last_3d)
    out = F.conv3d(xp, weight, bias, stride)
    if residual is not None:
        out += residual
    return out


def fused_linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                       residual: torch.Tensor | None = None, residual_scale: torch.Tensor | None = None) -> torch.Tensor:
    """ComfyUI's `linear_input_act`: y = [RMSNorm(x) * g] @ W^T (+ bias) [-> SwiGLU], then
    residual + residual_scale * y (an addcmul; scale 1 when not given).

    x [..., K]; weight [N, K] ([2N, K] with swiglu: rows :N are the gate, N: the up projection);
    residual [..., N]; residual_scale [N]. Returns [..., N] in x.dtype."""
    h = x
    if norm_weight is not None:
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype)
    y = F.linear(h, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = torch.addcmul(residual, y, residual_scale) if residual_scale is not None else y + residual
    return y


# ---------------------------------------------------------------------------------------------------
# Triton: per-frame GroupNorm statistics, then norm + SiLU + padding in one pass, NDHWC in and out.
#
# Layout: x is channels-last [B, T, H, W, C] in memory (strides (sxb, 1, sxt, sxh, sxw) in NCDHW order),
# so one pixel's channels are contiguous and a tile [BLOCK_P pixels, BLOCK_C channels] is BLOCK_P runs of
# BLOCK_C contiguous elements: 16-byte vectors whenever C is a multiple of 8 (bf16) / 4 (fp32). The interior
# launch writes columns LEFT .. LEFT+W-1 of every output row (reflected rows read their source row,
# front frames write zeros); a second, tiny launch writes the LEFT + RIGHT reflected border columns.

NORM_NONE, NORM_RMS, NORM_GROUP = 0, 1, 2


@triton.jit
def _frame_stats_kernel(x_ptr, part_ptr, C, HW, CHUNK, SPLIT, sxb, sxt, T,
                        VEC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_C: tl.constexpr):
    # Program (frame f = b*T + t, split s, channel block cb) reduces pixels [s*CHUNK, (s+1)*CHUNK) of one
    # frame for BLOCK_C channels: each tile's exact mean and M2, merged into the running ones (Chan et al.),
    # so there is no E[x^2] - E[x]^2 cancellation. Writes per channel (count, mean, M2) to
    # part[f, s, 0:3, c]; the host merges splits and a group's channels in float64 (tiny).
    f = tl.program_id(0)
    s = tl.program_id(1)
    cb = tl.program_id(2)
    b = f // T
    t = f % T
    cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    base = b.to(tl.int64) * sxb + t.to(tl.int64) * sxt
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, HW)
    cnt = tl.zeros([BLOCK_C], dtype=tl.float32)
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        pm = p < end
        pix = base + p.to(tl.int64) * C
        if VEC > 1:
            pix = tl.multiple_of(pix, VEC)
        if EVEN_C:
            m = tl.broadcast_to(pm[:, None], (BLOCK_P, BLOCK_C))
        else:
            m = pm[:, None] & (cs < C)[None, :]
        v = tl.load(x_ptr + pix[:, None] + cs[None, :], mask=m, other=0.0).to(tl.float32)
        n_t = tl.sum(pm.to(tl.float32), axis=0)
        t_mean = tl.sum(v, axis=0) / n_t
        d = tl.where(m, v - t_mean[None, :], 0.0)
        t_m2 = tl.sum(d * d, axis=0)
        tot = cnt + n_t
        delta = t_mean - mean
        mean += delta * (n_t / tot)
        m2 += t_m2 + delta * delta * (cnt * n_t / tot)
        cnt = tot
    cm = cs < C
    out = part_ptr + (f.to(tl.int64) * SPLIT + s) * 3 * C + cs
    tl.store(out, cnt, mask=cm)
    tl.store(out + C, mean, mask=cm)
    tl.store(out + 2 * C, m2, mask=cm)


@triton.jit
def _norm_silu_pad_kernel(
    x_ptr, out_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
    C, T, H, W, To, Ho, Wo, LEFT, TOP, FRONT, NCOLS,
    sxb, sxt, sxh, sxw, eps,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr, BORDER: tl.constexpr,
    VEC: tl.constexpr, EVEN_C: tl.constexpr, EMULATE_BF16: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One program = one output row (b, t_out, h_out) x BLOCK_P output pixels x all channels (looped in
    # BLOCK_C chunks). The output is the conv's padded NDHWC input; every element is written exactly once
    # by the two launches together (interior, BORDER), so no torch.empty-then-F.pad pass is needed.
    row = tl.program_id(0)
    ho = row % Ho
    t_o = (row // Ho) % To
    b = row // (Ho * To)
    ti = t_o - FRONT                         # causal: front frames are zeros
    hi = ho - TOP
    hi = tl.where(hi < 0, -hi, hi)           # reflect (no edge repeat), as F.pad(mode="reflect")
    hi = tl.where(hi >= H, 2 * (H - 1) - hi, hi)
    tic = tl.maximum(ti, 0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    if BORDER:
        pm = p < NCOLS
        wo = tl.where(p < LEFT, p, W + p)    # p >= LEFT: right border column LEFT + W + (p - LEFT)
        wi = wo - LEFT
        wi = tl.where(wi < 0, -wi, wi)
        wi = tl.where(wi >= W, 2 * (W - 1) - wi, wi)
    else:
        pm = p < W
        wi = p
        wo = p + LEFT
    # row validity as a vector (the interpreter mis-types `vector & scalar` masks)
    live = (ti + tl.zeros([BLOCK_P], dtype=tl.int32)) >= 0
    lm = pm & live
    x_pix = b.to(tl.int64) * sxb + tic.to(tl.int64) * sxt + hi.to(tl.int64) * sxh + wi.to(tl.int64) * sxw
    o_pix = (row.to(tl.int64) * Wo + wo) * C
    if VEC > 1:
        x_pix = tl.multiple_of(x_pix, VEC)
        o_pix = tl.multiple_of(o_pix, VEC)
    bt = b * T + tic
    if NORM == 1:
        # RMS: pass 1 over channel chunks, sum of squares per pixel
        ss = tl.zeros([BLOCK_P], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            if EVEN_C:
                m = tl.broadcast_to(lm[:, None], (BLOCK_P, BLOCK_C))
            else:
                m = lm[:, None] & (cs < C)[None, :]
            v = tl.load(x_ptr + x_pix[:, None] + cs[None, :], mask=m, other=0.0).to(tl.float32)
            ss += tl.sum(v * v, axis=1)
        rstd_pix = tl.math.rsqrt(ss / C + eps)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        cm = cs < C
        if EVEN_C:
            m = tl.broadcast_to(lm[:, None], (BLOCK_P, BLOCK_C))
            ms = tl.broadcast_to(pm[:, None], (BLOCK_P, BLOCK_C))
        else:
            m = lm[:, None] & cm[None, :]
            ms = pm[:, None] & cm[None, :]
        v = tl.load(x_ptr + x_pix[:, None] + cs[None, :], mask=m, other=0.0).to(tl.float32)
        if NORM == 1:
            z = v * rstd_pix[:, None]
        elif NORM == 2:
            # statistics expanded per channel [B*T, C] on the host: contiguous, so vector loads too
            mu = tl.load(mean_ptr + bt * C + cs, mask=cm, other=0.0)
            rs = tl.load(rstd_ptr + bt * C + cs, mask=cm, other=0.0)
            z = (v - mu[None, :]) * rs[None, :]
        else:
            z = v
        if NORM != 0:
            gw = tl.load(w_ptr + cs, mask=cm, other=0.0).to(tl.float32)
            z = z * gw[None, :]
            if HAS_BIAS:
                gb = tl.load(b_ptr + cs, mask=cm, other=0.0).to(tl.float32)
                z = z + gb[None, :]
        if APPLY_SILU:
            z = z / (1.0 + tl.exp(-z))  # one rounding fewer than z * sigmoid(z)
        z = tl.where(m, z, 0.0)
        tl.store(out_ptr + o_pix[:, None] + cs[None, :], cast_rtne(z, out_ptr.dtype.element_ty, EMULATE_BF16),
                 mask=ms)


def _pow2_factor(n: int) -> int:
    return n & -n if n > 0 else 1


def norm_pad_config(C: int, W: int, itemsize: int) -> dict:
    """Block constexprs of the norm + pad kernels, the same on a GPU and in the interpreter.

    BLOCK_C: the largest power of two dividing C, at most 64 (so no channel lane is masked: EVEN_C), or
    next_pow2(C) masked when C has no factor 8; BLOCK_P pixels make a 2048-element tile; VEC the elements
    of a 16-byte vector that C's alignment allows (the compiler's `multiple_of` hint)."""
    f = _pow2_factor(C)
    if f >= 8 or f >= C:
        block_c, even = min(64, f), True
    else:
        block_c, even = min(64, triton.next_power_of_2(C)), False
    vec = min(16 // itemsize, f)
    block_p = max(1, min(triton.next_power_of_2(max(W, 1)), 2048 // block_c))
    return dict(BLOCK_C=block_c, EVEN_C=even, VEC=vec, BLOCK_P=block_p)


def stats_config(B: int, T: int, C: int, HW: int, itemsize: int, target_programs: int = 1024) -> dict:
    """Grid and blocks of the per-frame statistics pass: tiles of 64 pixels x BLOCK_C channels, and enough
    pixel splits that B*T*splits*channel-blocks programs fill a GPU, each still looping over >= 8 tiles."""
    cfg = norm_pad_config(C, 1, itemsize)
    block_c, block_p = cfg["BLOCK_C"], 64
    n_cb = triton.cdiv(C, block_c)
    split = max(1, min(triton.cdiv(target_programs, B * T * n_cb), triton.cdiv(HW, 8 * block_p)))
    chunk = triton.cdiv(triton.cdiv(HW, split), block_p) * block_p
    split = triton.cdiv(HW, chunk)
    return dict(BLOCK_P=block_p, BLOCK_C=block_c, EVEN_C=cfg["EVEN_C"], VEC=cfg["VEC"], SPLIT=split, CHUNK=chunk,
                grid=(B * T, split, n_cb))


def frame_group_stats_triton(x: torch.Tensor, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame GroupNorm statistics of channels-last x [B, C, T, H, W]: (mean, rstd) float32 [B*T, G]."""
    B, C, T, H, W = x.shape
    cfg = stats_config(B, T, C, H * W, x.element_size())
    part = torch.empty(B * T, cfg["SPLIT"], 3, C, device=x.device, dtype=torch.float32)
    _frame_stats_kernel[cfg["grid"]](x, part, C, H * W, cfg["CHUNK"], cfg["SPLIT"], x.stride(0), x.stride(2), T,
                                     VEC=cfg["VEC"], BLOCK_P=cfg["BLOCK_P"], BLOCK_C=cfg["BLOCK_C"],
                                     EVEN_C=cfg["EVEN_C"], num_warps=4)
    p = part.double()
    cnt, mu, m2 = p[:, :, 0], p[:, :, 1], p[:, :, 2]                    # [F, S, C]
    n_c = cnt.sum(1)                                                   # [F, C]
    mean_c = (cnt * mu).sum(1) / n_c
    m2_c = m2.sum(1) + (cnt * (mu - mean_c[:, None]) ** 2).sum(1)
    cpg = C // groups
    mean_c, m2_c, n_c = (t.view(B * T, groups, cpg) for t in (mean_c, m2_c, n_c))
    mean_g = mean_c.mean(-1)
    m2_g = m2_c.sum(-1) + (n_c * (mean_c - mean_g[..., None]) ** 2).sum(-1)
    var = m2_g / n_c.sum(-1)
    return mean_g.float().contiguous(), torch.rsqrt(var + eps).float().contiguous()


def norm_silu_pad_triton(x: torch.Tensor, norm: Norm | None, pad, silu: bool = True) -> torch.Tensor:
    """Fused (per-frame GroupNorm | RMSNorm | none) -> SiLU -> reflect/causal padding, NDHWC out.

    x [B, C, T, H, W] (any layout: a non-channels-last input is made channels-last first, as comfy-kitchen
    transposes it); pad (left, right, top, bottom, front). Same result as `norm_silu_pad_eager`."""
    left, right, top, bottom, front = _pad5(pad)
    B, C, T, H, W = x.shape
    if max(left, right) >= W or max(top, bottom) >= H:
        raise UserError(f"reflect padding {pad} needs it smaller than the frame {H}x{W}")
    if not x.is_contiguous(memory_format=torch.channels_last_3d):
        x = x.contiguous(memory_format=torch.channels_last_3d)
    To, Ho, Wo = T + front, H + top + bottom, W + left + right
    out = torch.empty(B, C, To, Ho, Wo, device=x.device, dtype=x.dtype, memory_format=torch.channels_last_3d)
    kind = NORM_NONE if norm is None else (NORM_RMS if norm.kind == "rms" else NORM_GROUP)
    mean = rstd = out
    eps = 0.0
    if kind == NORM_GROUP:
        mean, rstd = frame_group_stats_triton(x, norm.groups, norm.eps)
        cpg = C // norm.groups
        mean, rstd = (t.repeat_interleave(cpg, dim=1).contiguous() for t in (mean, rstd))  # [B*T, C]
    if norm is not None:
        eps = norm.eps
    w = norm.weight if norm is not None else out
    b = norm.bias if (norm is not None and norm.bias is not None) else w
    sxb, _, sxt, sxh, sxw = x.stride()
    emulate = bf16_cast_needs_emulation(x.device)
    common = dict(NORM=kind, HAS_BIAS=norm is not None and norm.bias is not None, APPLY_SILU=silu,
                  EMULATE_BF16=emulate, num_warps=4)
    args = (x, out, w, b, mean, rstd, C, T, H, W, To, Ho, Wo, left, top, front, left + right,
            sxb, sxt, sxh, sxw, eps)
    cfg = norm_pad_config(C, W, x.element_size())
    _norm_silu_pad_kernel[(B * To * Ho, triton.cdiv(W, cfg["BLOCK_P"]))](*args, BORDER=False, **cfg, **common)
    if left + right:
        bcfg = {**cfg, "BLOCK_P": triton.next_power_of_2(left + right)}
        # a few columns per row: one warp, so each thread still holds a run of channels
        _norm_silu_pad_kernel[(B * To * Ho, 1)](*args, BORDER=True, **bcfg, **{**common, "num_warps": 1})
    return out


# ---------------------------------------------------------------------------------------------------
# Triton: the fused linear interface (RMSNorm prologue, SwiGLU / bias / residual epilogue).

@triton.jit
def _fused_linear_kernel(x_ptr, w_ptr, bias_ptr, g_ptr, r_ptr, rs_ptr, out_ptr, M, N, K,
                         sxm, sxk, swn, swk, srm, srn, som, son, eps,
                         HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                         HAS_RES: tl.constexpr, HAS_RSCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                         IEEE: tl.constexpr, EMULATE_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    nm = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + rk[None, :] * sxk, mask=mm[:, None] & km[None, :], other=0.0)
        if HAS_NORM:
            # RMSNorm(x) @ W = rstd[m] * ((x * g) @ W): the row statistic rides along the K loop and is
            # applied once in the epilogue, so the normalized activations are never written out.
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
            g = tl.load(g_ptr + rk, mask=km, other=0.0).to(tl.float32)
            a = (af * g[None, :]).to(x_ptr.dtype.element_ty)
        wt = tl.load(w_ptr + rn[None, :] * swn + rk[:, None] * swk, mask=km[:, None] & nm[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's bf16 tl.dot pitfall: upcast there only
            a = a.to(tl.float32)
            wt = wt.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, wt, acc)
        if SWIGLU:
            wu = tl.load(w_ptr + (rn + N)[None, :] * swn + rk[:, None] * swk, mask=km[:, None] & nm[None, :], other=0.0)
            if DOT_FP32:
                wu = wu.to(tl.float32)
            if IEEE:
                acc_up = tl.dot(a, wu, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, wu, acc_up)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        # round gate and up like the eager F.linear output would be before silu(gate) * up
        gate = cast_rtne(acc, out_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        up = cast_rtne(acc_up, out_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        # residual + scale * y (ComfyUI's addcmul): y rounded like the eager F.linear output first
        acc = cast_rtne(acc, out_ptr.dtype.element_ty, EMULATE_BF16).to(tl.float32)
        if HAS_RSCALE:
            acc = acc * tl.load(rs_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(r_ptr + rm.to(tl.int64)[:, None] * srm + rn[None, :] * srn, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :] * son,
             cast_rtne(acc, out_ptr.dtype.element_ty, EMULATE_BF16), mask=omask)


# Tiles of `_fused_linear_kernel` per shape class (issue: one fixed 64 x 64 x 32 tile left a 2048-wide H3 linear
# at 64 x 64 outputs per CTA, re-reading each weight tile M / 64 times):
# - few tokens (M <= 64): a 32-row tile and more column blocks, so the grid still covers the SMs;
# - large outputs (M x N >= 2048 x 2048): 128 x 128 (64 for SwiGLU, which holds two accumulators), 8 warps;
# - otherwise 128 x 64, 4 warps. BLOCK_K 32 keeps the fp32 accumulators and two bf16 operand tiles in registers
#   and shared memory at 3 stages on sm_80 .. sm_100.
LINEAR_GPU_CONFIGS = {"small_m": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
                      "wide": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
                      "wide_swiglu": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3),
                      "default": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)}
LINEAR_GPU_CONFIG = LINEAR_GPU_CONFIGS["default"]
LINEAR_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4)


def linear_shape_class(M: int, N: int, swiglu: bool = False) -> str:
    if M <= 64:
        return "small_m"
    if M * N >= 2048 * 2048:
        return "wide_swiglu" if swiglu else "wide"
    return "default"


def linear_config(device, M: int = 4096, N: int = 4096, swiglu: bool = False, gpu_config: bool = False) -> dict:
    """Blocks of `_fused_linear_kernel` for an M x N output: the GPU's for this shape class, or smaller ones in
    the interpreter (its numpy temporaries) unless `gpu_config` asks for the GPU's exact constexprs there too
    (the test matrix does)."""
    if torch.device(device).type == "cuda" or gpu_config:
        return dict(LINEAR_GPU_CONFIGS[linear_shape_class(M, N, swiglu)])
    return dict(LINEAR_INTERPRETER_CONFIG)


def fused_linear_triton(x, weight, bias=None, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None,
                        residual_scale=None, gpu_config: bool = False):
    """Triton version of `fused_linear_eager` (same arguments, same shapes)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    r2 = residual.reshape(-1, N) if residual is not None else out
    cfg = linear_config(x.device, M, N, swiglu, gpu_config)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fused_linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        r2, residual_scale if residual_scale is not None else weight, out, M, N, K,
        *x2.stride(), *weight.stride(), *r2.stride(), *out.stride(), eps,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_RES=residual is not None,
        HAS_RSCALE=residual is not None and residual_scale is not None,
        DOT_FP32=dot_needs_fp32(x.device), IEEE=x.dtype == torch.float32,
        EMULATE_BF16=bf16_cast_needs_emulation(x.device), **cfg)
    return out.reshape(*x.shape[:-1], N)


# ---------------------------------------------------------------------------------------------------
# Per-head RMSNorm + split-half RoPE on q and k (ComfyUI's `rms_rope_split_half`).

def rms_rope_eager(q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, eps: float):
    """Per-head RMSNorm (not affine) then split-half RoPE on the first 2 * pairs dims.

    q, k [B, S, H, D]; angles [S, pairs] (fp32). Returns new q, k in their dtype."""
    pairs = angles.shape[-1]
    c, s = torch.cos(angles)[None, :, None, :], torch.sin(angles)[None, :, None, :]

    def one(t):
        tf = t.float()
        tf = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)
        a, b, rest = tf[..., :pairs], tf[..., pairs:2 * pairs], tf[..., 2 * pairs:]
        return torch.cat([a * c - b * s, a * s + b * c, rest], dim=-1).to(t.dtype)

    return one(q), one(k)


@triton.jit
def _rms_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, ang_ptr, S, H, D, PAIRS, sqb, sqs, sqh, skb, sks, skh, eps,
                     EMULATE_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (b*S*H + s*H + h, which): one head of one token of q (which=0) or k (which=1). The partner of
    # dim i < PAIRS is i + PAIRS and vice versa; dims >= 2 PAIRS are only normalized.
    pid = tl.program_id(0)
    which = tl.program_id(1)
    h = pid % H
    s = (pid // H) % S
    b = pid // (H * S)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if which == 0:
        src = q_ptr + b.to(tl.int64) * sqb + s.to(tl.int64) * sqs + h * sqh
        dst = qo_ptr + pid.to(tl.int64) * D
    else:
        src = k_ptr + b.to(tl.int64) * skb + s.to(tl.int64) * sks + h * skh
        dst = ko_ptr + pid.to(tl.int64) * D
    x = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    lo = d < PAIRS
    rot = d < 2 * PAIRS
    partner = tl.where(lo, d + PAIRS, d - PAIRS)
    xp = tl.load(src + partner, mask=dm & rot, other=0.0).to(tl.float32)
    j = tl.where(lo, d, d - PAIRS)
    a = tl.load(ang_ptr + s.to(tl.int64) * PAIRS + j, mask=dm & rot, other=0.0)
    c = tl.cos(a)
    sn = tl.sin(a)
    y = tl.where(rot, tl.where(lo, x * c - xp * sn, xp * sn + x * c), x) * rstd
    tl.store(dst + d, cast_rtne(y, qo_ptr.dtype.element_ty, EMULATE_BF16), mask=dm)


def rms_rope_triton(q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, eps: float):
    """Triton version of `rms_rope_eager`: one pass over q and k (strided views of the qkv output are fine
    as long as the head dim is contiguous). Returns contiguous q, k [B, S, H, D]."""
    B, S, H, D = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    qo, ko = torch.empty(B, S, H, D, device=q.device, dtype=q.dtype), torch.empty(B, S, H, D, device=k.device, dtype=k.dtype)
    ang = angles.float().contiguous()
    _rms_rope_kernel[(B * S * H, 2)](q, k, qo, ko, ang, S, H, D, ang.shape[-1], q.stride(0), q.stride(1), q.stride(2),
                                     k.stride(0), k.stride(1), k.stride(2), eps,
                                     EMULATE_BF16=bf16_cast_needs_emulation(q.device),
                                     BLOCK_D=triton.next_power_of_2(D), num_warps=1)
    return qo, ko


# ---------------------------------------------------------------------------------------------------
# The FP16-accumulation convolution, behind its gate: a Triton implicit-GEMM conv (NDHWC in and out, no
# im2col buffer), products accumulated in fp16 by the tensor cores (`out_dtype=tl.float16`), bias and
# residual in the epilogue, as comfy-kitchen's `fp16_conv3d`. Without the gate ComfyUI runs cuDNN's conv.

@triton.jit
def _conv3d_implicit_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, r_ptr, out_ptr,
    M, Ci, Co, To, Ho, Wo, sxb, sxt, sxh, sxw, ST, SH, SW, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACC_FP16: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GEMM view: rows m = output pixels (b, t, h, w), columns n = output channels, reduction over
    # (tap, ci). x is the padded NDHWC input; w is [KT*KH*KW*Ci, Co] (tap-major, Co contiguous);
    # out and the residual are NDHWC, i.e. [M, Co] row-major.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    nm = rn < Co
    wo = rm % Wo
    ho = (rm // Wo) % Ho
    to = (rm // (Wo * Ho)) % To
    b = rm // (Wo * Ho * To)
    pix0 = b.to(tl.int64) * sxb + (to * ST).to(tl.int64) * sxt + (ho * SH).to(tl.int64) * sxh + (wo * SW).to(tl.int64) * sxw
    if ACC_FP16:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float16)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tap in range(0, KT * KH * KW):
        dt = tap // (KH * KW)
        dh = (tap // KW) % KH
        dw = tap % KW
        pix = pix0 + dt * sxt + dh * sxh + dw * sxw
        for c0 in range(0, Ci, BLOCK_K):
            ck = c0 + tl.arange(0, BLOCK_K)
            km = ck < Ci
            a = tl.load(x_ptr + pix[:, None] + ck[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            wt = tl.load(w_ptr + (tap * Ci + ck).to(tl.int64)[:, None] * Co + rn[None, :],
                         mask=km[:, None] & nm[None, :], other=0.0)
            if DOT_FP32:  # interpreter: numpy's fp16 matmul is not the tensor core's; emulate below
                part = tl.dot(a.to(tl.float32), wt.to(tl.float32))
                if ACC_FP16:
                    acc = (acc.to(tl.float32) + part.to(tl.float16).to(tl.float32)).to(tl.float16)
                else:
                    acc += part
            elif ACC_FP16:
                acc = tl.dot(a, wt, acc, out_dtype=tl.float16)
            else:
                acc = tl.dot(a, wt, acc)
    y = acc.to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    omask = mm[:, None] & nm[None, :]
    off = rm.to(tl.int64)[:, None] * Co + rn[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + off, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=omask)


CONV_GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
# CDNA: the NVIDIA tile's K step of 32 gives an MFMA loop short on work per load; 128x128x64 on 4 waves, one
# stage (gfx942's 64 KB of LDS), no spill. Predicted over the timed encoder's 15 fp16 convs: the NVIDIA tile
# (128x64x32, 3 stages) 15.1 ms on MI300X and 12.7 ms on MI355X, this one 7.0 and 5.9 ms, the best total of the
# 24 swept on MI355X; on MI300X 256x128x64 is 6.7 ms in all but slower on 5 of the 15, so not taken (the model
# counts no stalls). Rerun with (gfx950 likewise)
#   inferbook sweep h3-vae-fusion gfx942 conv3d --kernel _conv3d_implicit_gemm_kernel --launch "timed encoder" \
#     --set BLOCK_M=64,128,256 --set BLOCK_N=64,128 --set BLOCK_K=32,64 --set num_stages=1,3 --jobs 2
CONV_CDNA_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=1)


def conv_config(Ci: int, Co: int, device=None) -> dict:
    """Blocks of the implicit-GEMM conv for `device` (`device.pick_config`; the same in the interpreter: the
    matrix runs the GPU's tiles)."""
    from .. import device as _device

    cfg = dict(_device.swept("conv3d", _device.pick_config({"nvidia": CONV_GPU_CONFIG, "hip": CONV_CDNA_CONFIG},
                                                           device or "cpu")))
    cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], triton.next_power_of_2(Ci)))
    cfg["BLOCK_N"] = max(16, min(cfg["BLOCK_N"], triton.next_power_of_2(Co)))
    return cfg


def conv3d_triton(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride=1,
                  residual: torch.Tensor | None = None, *, fp16_accumulation: bool = True) -> torch.Tensor:
    """Valid 3D conv of a padded input as an implicit GEMM; fp16 inputs, fp16 (gate) or fp32 accumulation.

    xp [B, Ci, Tp, Hp, Wp] (made NDHWC), weight [Co, Ci, kt, kh, kw], residual [B, Co, To, Ho, Wo].
    Returns NDHWC [B, Co, To, Ho, Wo] in xp.dtype."""
    st = (stride,) * 3 if isinstance(stride, int) else tuple(stride)
    B, Ci, Tp, Hp, Wp = xp.shape
    Co, _, kt, kh, kw = weight.shape
    To, Ho, Wo = (Tp - kt) // st[0] + 1, (Hp - kh) // st[1] + 1, (Wp - kw) // st[2] + 1
    xp = xp.contiguous(memory_format=torch.channels_last_3d)
    w2 = weight.permute(2, 3, 4, 1, 0).reshape(kt * kh * kw * Ci, Co).to(xp.dtype).contiguous()
    out = torch.empty(B, Co, To, Ho, Wo, device=xp.device, dtype=xp.dtype, memory_format=torch.channels_last_3d)
    r = residual.contiguous(memory_format=torch.channels_last_3d) if residual is not None else out
    M = B * To * Ho * Wo
    cfg = conv_config(Ci, Co, xp.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(Co, cfg["BLOCK_N"]))
    sxb, _, sxt, sxh, sxw = xp.stride()
    _conv3d_implicit_gemm_kernel[grid](
        xp, w2, bias if bias is not None else w2, r, out, M, Ci, Co, To, Ho, Wo, sxb, sxt, sxh, sxw, *st,
        KT=kt, KH=kh, KW=kw, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        ACC_FP16=fp16_accumulation, DOT_FP32=dot_needs_fp32(xp.device), **cfg)
    return out


def fp16_conv_usable(xp: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Where the gated kernel runs: float16 activations on a Triton-capable device, C_in a multiple of 8 (as
    comfy-kitchen's gate: conv_in / conv_out with 3 channels fall back)."""
    ok, why = triton_backend_for(xp.device)
    if not ok:
        return False, f"fp16 conv kernel unavailable: {why}"
    if xp.dtype != torch.float16:
        return False, (f"fp16_accumulation=True but activations are {str(xp.dtype).replace('torch.', '')}: "
                       "the fp16 path would change their precision, so the default conv runs")
    if xp.shape[1] % 8 or weight.shape[0] % 8:
        return False, f"channels {xp.shape[1]}->{weight.shape[0]} are not multiples of 8: the default conv runs"
    return True, why


# ---------------------------------------------------------------------------------------------------
# Dispatch.

def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class Ops:
    """The VAE's operations with a backend: 'eager' (PyTorch) or 'fused' (Triton where it can run).

    Every call notes (op, backend, reason, shapes) in `self.log`. `fp16_accumulation` is the seed's
    `--fast fp16_accumulation`: off by default, honoured only for float16 activations (either backend)."""

    def __init__(self, backend: str = "eager", *, fp16_accumulation: bool = False, log: BackendLog | None = None):
        _check_choice("backend", backend, BACKENDS)
        if not isinstance(fp16_accumulation, bool):
            raise UserError(f"fp16_accumulation must be True or False, got {fp16_accumulation!r}")
        self.backend = backend
        self.fp16_accumulation = fp16_accumulation
        self.log = log if log is not None else BackendLog()

    def _use_triton(self, x: torch.Tensor) -> tuple[bool, str]:
        if self.backend == "eager":
            return False, "eager requested"
        ok, why = triton_usable(x)
        return (True, why) if ok else (False, f"fallback to eager: {why}")

    def norm_silu_pad(self, x, norm: Norm | None, pad, silu: bool = True):
        op = f"norm_silu_pad[{norm.kind if norm is not None else 'pad'}]"
        ok, why = self._use_triton(x)
        self.log.note(op, "triton fused" if ok else "eager", why, {"x": _shape(x)}, x.dtype)
        return norm_silu_pad_triton(x, norm, pad, silu) if ok else norm_silu_pad_eager(x, norm, pad, silu)

    def linear(self, x, weight, bias=None, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None,
               residual_scale=None, name="linear"):
        ok, why = self._use_triton(x)
        if ok and weight.dtype != x.dtype:
            ok, why = False, f"fallback to eager: weight dtype {weight.dtype} differs from activations {x.dtype}"
        parts = [p for p, on in (("rmsnorm", norm_weight is not None), ("swiglu", swiglu),
                                 ("residual", residual is not None)) if on]
        self.log.note(f"{name}[{'+'.join(parts) or 'plain'}]", "triton fused linear" if ok else "eager", why,
                      {"x": _shape(x), "w": _shape(weight)}, x.dtype)
        fn = fused_linear_triton if ok else fused_linear_eager
        return fn(x, weight, bias, norm_weight=norm_weight, eps=eps, swiglu=swiglu, residual=residual,
                  residual_scale=residual_scale)

    def rms_rope(self, q, k, angles, eps):
        ok, why = self._use_triton(q)
        self.log.note("rms_rope", "triton fused" if ok else "eager", why, {"q": _shape(q)}, q.dtype)
        return rms_rope_triton(q, k, angles, eps) if ok else rms_rope_eager(q, k, angles, eps)

    def conv3d(self, xp, weight, bias=None, stride=1, residual=None):
        """Valid conv of an already padded input, residual added in its epilogue. The default path is
        F.conv3d (cuDNN on a GPU) then `out += residual`; the gate runs the fp16-accumulation kernel."""
        shapes = {"x": _shape(xp), "w": _shape(weight)}
        if self.fp16_accumulation:
            ok, why = fp16_conv_usable(xp, weight)
            if ok:
                self.log.note("conv3d", "triton fp16-accumulation conv", "enabled by fp16_accumulation=True; " + why,
                              shapes, xp.dtype)
                return conv3d_triton(xp, weight, bias, stride, residual, fp16_accumulation=True)
        else:
            why = "default (fp16_accumulation not enabled)"
        lib = "cuDNN" if xp.is_cuda else "CPU"
        self.log.note("conv3d", f"F.conv3d ({lib})", why, shapes, xp.dtype)
        return conv3d_eager(xp, weight, bias, stride, residual)


# ---------------------------------------------------------------------------------------------------
# Tolerance: the FlashAttention rule.

FA_FACTOR = 2.0      # our error may be twice PyTorch's own error in the same precision ...
FA_FLOOR = 0.1       # ... plus a tenth of that error (not a fraction of max |ref|) ...
FP32_ULPS = 4        # ... plus FlashAttention's `fwd_atol`: fp32 round-off at the reference's magnitude


def fa_rule_check(out: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor, *, factor: float = FA_FACTOR,
                  floor: float = FA_FLOOR) -> dict:
    """FlashAttention's rule, on the max error and on the RMS error:

        |out - ref64| <= factor * |eager - ref64| + floor * |eager - ref64| + 4 * 2^-24 * |ref64|

    `eager` is PyTorch in the same precision as `out`. The last term is FlashAttention's test floor
    (`2 * (ref + 0.3 - 0.3 - ref)`, fp32 round-off at the reference's scale, max or RMS): it lets an fp32
    kernel round a few more times than a correctly rounded eager op, and is ~65000x smaller than a bf16
    ulp, so it does not loosen a bf16 cell (the old floor 2 * eps_bf16 * max|ref| made the tolerance
    about 5x the eager error). The RMS criterion catches a systematic shift (a wrong eps) that the max
    error can hide under rounding. NaN or inf never passes."""
    o, e, r = out.detach().double().cpu(), eager.detach().double().cpu(), ref64.detach().double().cpu()
    if o.shape != r.shape:
        return {"error": float("inf"), "eager_error": 0.0, "tolerance": 0.0, "rms_error": float("inf"),
                "rms_eager_error": 0.0, "rms_tolerance": 0.0, "passed": False, "why": f"shape {tuple(o.shape)}"}
    u = FP32_ULPS * 2.0 ** -24
    err, err_e = float((o - r).abs().max()), float((e - r).abs().max())
    rms, rms_e = float((o - r).pow(2).mean().sqrt()), float((e - r).pow(2).mean().sqrt())
    tol = (factor + floor) * err_e + u * float(r.abs().max())
    rtol = (factor + floor) * rms_e + u * float(r.pow(2).mean().sqrt())
    finite = bool(torch.isfinite(o).all())
    return {"error": err, "eager_error": err_e, "tolerance": tol, "rms_error": rms, "rms_eager_error": rms_e,
            "rms_tolerance": rtol, "passed": finite and err <= tol and rms <= rtol}


# ---------------------------------------------------------------------------------------------------
# Bytes-moved models.

def eager_bytes_moved(fn, *args, **kwargs) -> tuple[int, list[tuple[str, int]]]:
    """Bytes each ATen op of `fn(*args)` reads and writes, summed: every tensor input read once, every
    output written once (views and other aliasing ops move nothing). Returns (total, [(op, bytes)]).

    This is the eager path's traffic *model*: an op whose input already sits in cache moves less DRAM
    traffic than counted, a broadcast input is counted at its own size."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    per_op: list[tuple[str, int]] = []

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            in_ptrs = {t.untyped_storage().data_ptr() for t in ins}
            aliasing = outs and all(o.untyped_storage().data_ptr() in in_ptrs for o in outs)
            if aliasing and not func._schema.is_mutable:
                return out  # a view: no data moves
            n = sum(t.numel() * t.element_size() for t in ins) + (0 if aliasing else sum(
                t.numel() * t.element_size() for t in outs))
            per_op.append((str(func.__name__), int(n)))
            return out

    with _Count():
        fn(*args, **kwargs)
    return sum(n for _, n in per_op), per_op


def fused_bytes_moved(shape, itemsize: int, pad, *, norm: str | None) -> int:
    """DRAM traffic of the fused path, by construction of its kernels (x [B, C, T, H, W], NDHWC):

    - group: the statistics pass reads x once, then the apply pass reads x and writes the padded buffer;
    - rms: one pass reads x (its second loop over the channels re-reads a tile it has just read: counted
      once, assumed to hit in L1/L2) and writes the padded buffer; none: the same.
    Front zero frames are written, never read. Per-channel weights and statistics are not counted."""
    B, C, T, H, W = shape
    left, right, top, bottom, front = _pad5(pad)
    n = B * C * T * H * W
    n_pad = B * C * (T + front) * (H + top + bottom) * (W + left + right)
    reads = 2 * n if norm == "group" else n
    return itemsize * (reads + n_pad)
