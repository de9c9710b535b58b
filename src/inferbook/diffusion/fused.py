"""Fused operations of the video-VAE decoder: references, Triton kernels and the dispatch between them.

The seed (ComfyUI #16187) moves the normalization, SiLU, padding and residual add around each 3D
convolution into fused kernels, and gives the attention / feed-forward parts a linear-layer interface
that takes RMSNorm, SwiGLU and a residual as parameters. This module builds each of those three ways:

- eager: plain PyTorch, one kernel per operation (`*_eager`), also the correctness reference;
- Triton: `_norm_silu_pad_kernel` (norm + SiLU + the conv's zero/causal padding, written once into the
  padded buffer the convolution reads; optionally the residual add before it), `_group_stats_kernel`
  (GroupNorm statistics, optionally fused with the residual add) and `_fused_linear_kernel`;
- torch.compile of the eager decoder is chosen one level up, in `vae.py`.

`Ops(backend=...)` is the dispatch: it picks the Triton kernel when it can run (`triton_backend_for`),
else the eager op, and notes every choice with its reason and the shapes it saw in a `BackendLog`,
which a RunRecord stores. Two gates from the seed are explicit arguments, never defaults:
`fp16_accumulation=True` enables the FP16-accumulation convolution, and INT8 attention exists only in
a decoder returned by `vae.quantize_decoder_int8()`.

Tensor layout everywhere: video activations are [B, C, T, H, W]; linear inputs are [..., K].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import dot_needs_fp32, triton_backend_for

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("eager", "fused")
NORMS = ("rms", "group")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


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
# Eager references. Written the way public video VAEs write them: one PyTorch op per step.

def rms_norm_channels_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the channel dim of [B, C, ...]; statistics in fp32, result in x.dtype."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)
    y = y * weight.float().view(shape)
    if bias is not None:
        y = y + bias.float().view(shape)
    return y.to(x.dtype)


def group_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                     groups: int) -> torch.Tensor:
    return F.group_norm(x, groups, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)


@dataclass
class Norm:
    """A channel norm: `kind` 'rms' (per pixel, over C) or 'group' (GroupNorm, over C/G x T x H x W)."""

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float = 1e-6
    groups: int = 32

    def __post_init__(self):
        _check_choice("norm", self.kind, NORMS)
        C = self.weight.numel()
        if self.kind == "group" and C % self.groups:
            raise ValueError(f"GroupNorm({self.groups}) needs channels divisible by {self.groups}, got {C}")

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return rms_norm_channels_eager(x, self.weight, self.bias, self.eps)
        return group_norm_eager(x, self.weight, self.bias, self.eps, self.groups)


def norm_silu_pad_eager(x: torch.Tensor, norm: Norm, pad: tuple[int, int, int], silu: bool = True) -> torch.Tensor:
    """norm -> SiLU -> zero padding (`pad` = (past frames, rows each side, columns each side)).

    Causal: time is padded with `pad[0]` frames *before* the first frame and none after."""
    y = norm.eager(x)
    if silu:
        y = F.silu(y)
    pt, ph, pw = pad
    return F.pad(y, (pw, pw, ph, ph, pt, 0))


def add_norm_silu_pad_eager(a: torch.Tensor, b: torch.Tensor, norm: Norm, pad, silu: bool = True):
    """y = a + b; returns (y, norm_silu_pad(y)). Three separate passes in eager."""
    y = a + b
    return y, norm_silu_pad_eager(y, norm, pad, silu)


def fused_linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """The seed's linear interface: y = [RMSNorm(x) * g] @ W^T (+ bias) [-> SwiGLU] (+ residual).

    x [..., K]; weight [N, K] ([2N, K] with swiglu: rows :N are the gate, N: the up projection);
    residual [..., N]. Returns [..., N] in x.dtype."""
    h = x
    if norm_weight is not None:
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype)
    y = F.linear(h, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual
    return y


# ---------------------------------------------------------------------------------------------------
# Triton: norm + SiLU + padding in one pass, optionally with the residual add in front.

@triton.jit
def _norm_silu_pad_kernel(
    x_ptr, r_ptr, y_ptr, out_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
    C, T, H, W, To, Ho, Wo, PT, PH, PW, plane_y, plane_o,
    sxb, sxc, sxt, sxh, sxw,
    srb, src, srt, srh, srw,
    eps,
    NORM_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # One program = one output row (b, t_out, h_out) x BLOCK_W output columns, all channels.
    # The output is the conv's *padded* input [B, C, To, Ho, Wo]: every element of it is written
    # exactly once here (zeros in the border), so no torch.zeros / F.pad pass is needed.
    row = tl.program_id(0)
    ho = row % Ho
    t_o = (row // Ho) % To
    b = row // (Ho * To)
    ti = t_o - PT                      # causal: only past frames are padding
    hi = ho - PH
    wo = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    wi = wo - PW
    # row validity broadcast to a vector first: the interpreter mis-types `vector & scalar` masks
    tiv = ti + tl.zeros([BLOCK_W], dtype=tl.int32)
    hiv = hi + tl.zeros([BLOCK_W], dtype=tl.int32)
    col_ok = (wi >= 0) & (wi < W) & (tiv >= 0) & (hiv >= 0) & (hiv < H)
    w_in = wo < Wo
    # int64 offsets: a 480p decode's last stage holds > 2**31 elements.
    b64 = b.to(tl.int64)
    x_base = b64 * sxb + ti.to(tl.int64) * sxt + hi.to(tl.int64) * sxh + wi.to(tl.int64) * sxw
    if HAS_RES:
        r_base = b64 * srb + ti.to(tl.int64) * srt + hi.to(tl.int64) * srh + wi.to(tl.int64) * srw
        # y = a + b is stored contiguous [B, C, T, H, W]
        y_base = b64 * C * plane_y + ti.to(tl.int64) * H * W + hi.to(tl.int64) * W + wi
    o_base = (b64 * C * To + t_o) * Ho * Wo + ho.to(tl.int64) * Wo + wo

    if NORM_RMS:
        # pass 1 over channel chunks: sum of squares per pixel (channels need not be a multiple of 32)
        ss = tl.zeros([BLOCK_W], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            m = (cs < C)[:, None] & col_ok[None, :]
            v = tl.load(x_ptr + x_base[None, :] + cs.to(tl.int64)[:, None] * sxc, mask=m, other=0.0)
            if HAS_RES:
                rv = tl.load(r_ptr + r_base[None, :] + cs.to(tl.int64)[:, None] * src, mask=m, other=0.0)
                v = (v.to(tl.float32) + rv.to(tl.float32)).to(y_ptr.dtype.element_ty)  # rounded like eager a + b
            v = v.to(tl.float32)
            ss += tl.sum(v * v, axis=0)
        rstd_pix = 1.0 / tl.sqrt(ss / C + eps)
    # pass 2: normalize, affine, SiLU, write the padded buffer (and y = a + b once)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        cm = cs < C
        m = cm[:, None] & col_ok[None, :]
        v = tl.load(x_ptr + x_base[None, :] + cs.to(tl.int64)[:, None] * sxc, mask=m, other=0.0)
        if HAS_RES:
            rv = tl.load(r_ptr + r_base[None, :] + cs.to(tl.int64)[:, None] * src, mask=m, other=0.0)
            v = (v.to(tl.float32) + rv.to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + y_base[None, :] + cs.to(tl.int64)[:, None] * plane_y, v, mask=m)
        v = v.to(tl.float32)
        if NORM_RMS:
            z = v * rstd_pix[None, :]
        else:
            mu = tl.load(mean_ptr + b * C + cs, mask=cm, other=0.0)
            rs = tl.load(rstd_ptr + b * C + cs, mask=cm, other=0.0)
            z = (v - mu[:, None]) * rs[:, None]
        gw = tl.load(w_ptr + cs, mask=cm, other=0.0).to(tl.float32)
        z = z * gw[:, None]
        if HAS_BIAS:
            gb = tl.load(b_ptr + cs, mask=cm, other=0.0).to(tl.float32)
            z = z + gb[:, None]
        if APPLY_SILU:
            z = z * tl.sigmoid(z)
        z = tl.where(m, z, 0.0)
        tl.store(out_ptr + o_base[None, :] + cs.to(tl.int64)[:, None] * plane_o,
                 z.to(out_ptr.dtype.element_ty), mask=cm[:, None] & w_in[None, :])


@triton.jit
def _group_stats_kernel(x_ptr, r_ptr, y_ptr, part_ptr, N_GROUP, CHUNK, SPLIT,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    # GroupNorm statistics of contiguous [B, C, T, H, W]: a group is one contiguous run of
    # N_GROUP = C/G*T*H*W elements. Program (bg, s) reduces elements [s*CHUNK, (s+1)*CHUNK) of group bg
    # with a per-lane Welford update (no E[x^2]-E[x]^2 cancellation) and writes (count, mean, M2).
    # With HAS_RES it also writes y = x + r, so the residual add costs no extra pass.
    bg = tl.program_id(0)
    s = tl.program_id(1)
    base = bg.to(tl.int64) * N_GROUP
    start = s * CHUNK
    cnt = tl.zeros([BLOCK], dtype=tl.float32)
    mean = tl.zeros([BLOCK], dtype=tl.float32)
    m2 = tl.zeros([BLOCK], dtype=tl.float32)
    for e0 in range(0, CHUNK, BLOCK):
        e = start + e0 + tl.arange(0, BLOCK)
        m = e < N_GROUP
        v = tl.load(x_ptr + base + e, mask=m, other=0.0)
        if HAS_RES:
            v = (v.to(tl.float32) + tl.load(r_ptr + base + e, mask=m, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + base + e, v, mask=m)
        v = v.to(tl.float32)
        mf = m.to(tl.float32)
        cnt += mf
        d = v - mean
        mean += tl.where(m, d / tl.maximum(cnt, 1.0), 0.0)
        m2 += tl.where(m, d * (v - mean), 0.0)
    tot = tl.sum(cnt, axis=0)
    mu = tl.sum(cnt * mean, axis=0) / tl.maximum(tot, 1.0)
    dm = mean - mu
    M2 = tl.sum(m2, axis=0) + tl.sum(cnt * dm * dm, axis=0)
    out = part_ptr + (bg * SPLIT + s) * 3
    tl.store(out, tot)
    tl.store(out + 1, mu)
    tl.store(out + 2, M2)


def _group_stats(x: torch.Tensor, r: torch.Tensor | None, groups: int, eps: float):
    """(y or x, mean[B, C], rstd[B, C]) with the Welford partials merged in float64 (tiny)."""
    x = x.contiguous()
    B, C = x.shape[:2]
    n_group = x.numel() // (B * groups)
    y = torch.empty_like(x) if r is not None else x
    BLOCK = 1024
    target = 512  # enough programs to fill a GPU; splitting costs only the tiny merge below
    split = max(1, min(triton.cdiv(n_group, BLOCK), target // (B * groups)))
    chunk = triton.cdiv(triton.cdiv(n_group, split), BLOCK) * BLOCK
    split = triton.cdiv(n_group, chunk)
    part = torch.empty(B * groups, split, 3, device=x.device, dtype=torch.float32)
    _group_stats_kernel[(B * groups, split)](x, r.contiguous() if r is not None else x, y, part, n_group, chunk,
                                             split, HAS_RES=r is not None, BLOCK=BLOCK)
    p = part.double()
    cnt, mu, m2 = p[..., 0], p[..., 1], p[..., 2]
    tot = cnt.sum(1)
    mean = (cnt * mu).sum(1) / tot
    var = (m2.sum(1) + (cnt * (mu - mean[:, None]) ** 2).sum(1)) / tot
    rstd = torch.rsqrt(var + eps)
    cpg = C // groups
    mean_c = mean.view(B, groups).repeat_interleave(cpg, dim=1).float().contiguous()
    rstd_c = rstd.view(B, groups).repeat_interleave(cpg, dim=1).float().contiguous()
    return y, mean_c, rstd_c


def _block_sizes(C: int, Wo: int) -> tuple[int, int]:
    block_w = min(128, triton.next_power_of_2(max(Wo, 1)))
    block_c = max(1, min(triton.next_power_of_2(C), 4096 // block_w, 32))
    return block_c, block_w


def norm_silu_pad_triton(x: torch.Tensor, norm: Norm, pad, silu: bool = True, residual: torch.Tensor | None = None):
    """Fused norm -> SiLU -> padding (with the residual add first when `residual` is given).

    Returns the padded [B, C, T+pt, H+2ph, W+2pw] buffer, or (y, padded) with a residual."""
    B, C, T, H, W = x.shape
    pt, ph, pw = pad
    To, Ho, Wo = T + pt, H + 2 * ph, W + 2 * pw
    out = torch.empty(B, C, To, Ho, Wo, device=x.device, dtype=x.dtype)
    mean = rstd = y = None
    src, r = x, residual
    if norm.kind == "group":
        # statistics pass (fused with the residual add); the apply pass then reads y
        y_or_x, mean, rstd = _group_stats(x, residual, norm.groups, norm.eps)
        if residual is not None:
            y = y_or_x
            src, r = y, None
    elif residual is not None:
        y = torch.empty(B, C, T, H, W, device=x.device, dtype=x.dtype)
    dummy = out
    BLOCK_C, BLOCK_W = _block_sizes(C, Wo)
    grid = (B * To * Ho, triton.cdiv(Wo, BLOCK_W))
    rr = r if r is not None else src
    _norm_silu_pad_kernel[grid](
        src, rr, y if (y is not None and r is not None) else dummy, out,
        norm.weight, norm.bias if norm.bias is not None else norm.weight,
        mean if mean is not None else dummy, rstd if rstd is not None else dummy,
        C, T, H, W, To, Ho, Wo, pt, ph, pw, T * H * W, To * Ho * Wo,
        *src.stride(), *rr.stride(), norm.eps,
        NORM_RMS=norm.kind == "rms", HAS_RES=r is not None, HAS_BIAS=norm.bias is not None, APPLY_SILU=silu,
        BLOCK_C=BLOCK_C, BLOCK_W=BLOCK_W, num_warps=4)
    return (y, out) if residual is not None else out


# ---------------------------------------------------------------------------------------------------
# Triton: the fused linear interface (RMSNorm prologue, SwiGLU / bias / residual epilogue).

@triton.jit
def _fused_linear_kernel(x_ptr, w_ptr, bias_ptr, g_ptr, r_ptr, out_ptr, M, N, K,
                         sxm, sxk, swn, swk, srm, srn, som, son, eps,
                         HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                         HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
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
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(r_ptr + rm.to(tl.int64)[:, None] * srm + rn[None, :] * srn, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty), mask=omask)


def fused_linear_triton(x, weight, bias=None, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None):
    """Triton version of `fused_linear_eager` (same arguments, same shapes)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    r2 = residual.reshape(-1, N) if residual is not None else out
    BM, BN, BK = 64, 64, 32
    if x.device.type != "cuda":
        BM, BN, BK = 32, 32, 32  # smaller tiles keep the interpreter's numpy temporaries small
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _fused_linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        r2, out, M, N, K, *x2.stride(), *weight.stride(), *r2.stride(), *out.stride(), eps,
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_RES=residual is not None,
        DOT_FP32=dot_needs_fp32(x.device), IEEE=x.dtype == torch.float32,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=4)
    return out.reshape(*x.shape[:-1], N)


# ---------------------------------------------------------------------------------------------------
# The FP16-accumulation convolution, behind its gate.

def conv3d_fp16_accumulation(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Valid 3D convolution of an already padded fp16 input, with fp16 partial sums.

    One matmul per kernel tap; the running sum over taps is kept in fp16 (and, on CUDA builds that
    have it, cuBLAS is allowed fp16 accumulation inside each matmul too). Faster on GPUs whose fp16
    accumulate rate is higher; less accurate, which is why the seed puts it behind a flag."""
    Co, Ci, kt, kh, kw = weight.shape
    B, C, Tp, Hp, Wp = xp.shape
    T, H, W = Tp - kt + 1, Hp - kh + 1, Wp - kw + 1
    mm = torch.backends.cuda.matmul
    had = getattr(mm, "allow_fp16_accumulation", None)
    if had is not None and xp.is_cuda:
        mm.allow_fp16_accumulation = True
    try:
        out = None
        for dt in range(kt):
            for dh in range(kh):
                for dw in range(kw):
                    xs = xp[:, :, dt:dt + T, dh:dh + H, dw:dw + W]
                    y = torch.einsum("bcthw,oc->bothw", xs, weight[:, :, dt, dh, dw])
                    out = y if out is None else out + y
    finally:
        if had is not None and xp.is_cuda:
            mm.allow_fp16_accumulation = had
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1, 1)
    return out


# ---------------------------------------------------------------------------------------------------
# Dispatch.

def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class Ops:
    """The decoder's operations with a backend: 'eager' (PyTorch) or 'fused' (Triton where it can run).

    Every call notes (op, backend, reason, shapes) in `self.log`. `fp16_accumulation` is the seed's
    `--fast fp16_accumulation`: off by default, and honoured only for float16 activations."""

    def __init__(self, backend: str = "eager", *, fp16_accumulation: bool = False, log: BackendLog | None = None):
        _check_choice("backend", backend, BACKENDS)
        if not isinstance(fp16_accumulation, bool):
            raise ValueError(f"fp16_accumulation must be True or False, got {fp16_accumulation!r}")
        self.backend = backend
        self.fp16_accumulation = fp16_accumulation
        self.log = log if log is not None else BackendLog()

    def _use_triton(self, x: torch.Tensor) -> tuple[bool, str]:
        if self.backend == "eager":
            return False, "eager requested"
        ok, why = triton_usable(x)
        return (True, why) if ok else (False, f"fallback to eager: {why}")

    def norm_silu_pad(self, x, norm: Norm, pad, silu: bool = True):
        op = f"norm_silu_pad[{norm.kind}]"
        ok, why = self._use_triton(x)
        self.log.note(op, "triton fused" if ok else "eager", why, {"x": _shape(x)}, x.dtype)
        return norm_silu_pad_triton(x, norm, pad, silu) if ok else norm_silu_pad_eager(x, norm, pad, silu)

    def add_norm_silu_pad(self, a, b, norm: Norm, pad, silu: bool = True):
        op = f"add_norm_silu_pad[{norm.kind}]"
        ok, why = self._use_triton(a)
        if ok and (b.shape != a.shape or b.dtype != a.dtype):
            ok, why = False, f"fallback to eager: residual {tuple(b.shape)}/{b.dtype} does not match {tuple(a.shape)}/{a.dtype}"
        self.log.note(op, "triton fused" if ok else "eager", why, {"x": _shape(a)}, a.dtype)
        if ok:
            return norm_silu_pad_triton(a, norm, pad, silu, residual=b)
        return add_norm_silu_pad_eager(a, b, norm, pad, silu)

    def linear(self, x, weight, bias=None, *, norm_weight=None, eps=1e-6, swiglu=False, residual=None, name="linear"):
        ok, why = self._use_triton(x)
        if ok and weight.dtype != x.dtype:
            ok, why = False, f"fallback to eager: weight dtype {weight.dtype} differs from activations {x.dtype}"
        parts = [p for p, on in (("rmsnorm", norm_weight is not None), ("swiglu", swiglu),
                                 ("residual", residual is not None)) if on]
        self.log.note(f"{name}[{'+'.join(parts) or 'plain'}]", "triton fused linear" if ok else "eager", why,
                      {"x": _shape(x), "w": _shape(weight)}, x.dtype)
        fn = fused_linear_triton if ok else fused_linear_eager
        return fn(x, weight, bias, norm_weight=norm_weight, eps=eps, swiglu=swiglu, residual=residual)

    def conv3d(self, xp, weight, bias=None):
        """Valid conv of an already padded input. The default path is F.conv3d (cuDNN on a GPU)."""
        if self.fp16_accumulation and xp.dtype == torch.float16:
            self.log.note("conv3d", "fp16-accumulation conv", "enabled by fp16_accumulation=True",
                          {"x": _shape(xp), "w": _shape(weight)}, xp.dtype)
            return conv3d_fp16_accumulation(xp, weight, bias)
        if self.fp16_accumulation:
            why = (f"fp16_accumulation=True but activations are {str(xp.dtype).replace('torch.', '')}: "
                   "the fp16 path would change their precision, so the default conv runs")
        else:
            why = "default (fp16_accumulation not enabled)"
        lib = "cuDNN" if xp.is_cuda else "CPU"
        self.log.note("conv3d", f"F.conv3d ({lib})", why, {"x": _shape(xp), "w": _shape(weight)}, xp.dtype)
        return F.conv3d(xp, weight, bias)


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


def fused_bytes_moved(shape, itemsize: int, pad, *, norm: str, residual: bool) -> int:
    """DRAM traffic of the fused path, by construction of its kernels (x [B, C, T, H, W]):

    - rms: read x (and the residual), write y = x + r (with a residual) and the padded buffer once; the
      kernel's second pass over the channels re-reads a tile it has just read (counted once: it is
      assumed to hit in L2);
    - group: a statistics pass reads x (and r, writing y), then the apply pass reads y, writes padded.
    Per-channel weights and statistics are negligible and not counted."""
    B, C, T, H, W = shape
    pt, ph, pw = pad
    n = B * C * T * H * W
    n_pad = B * C * (T + pt) * (H + 2 * ph) * (W + 2 * pw)
    if norm == "rms":
        return itemsize * ((2 * n if residual else n) + (n if residual else 0) + n_pad)
    stats = (2 * n + n) if residual else n
    return itemsize * (stats + n + n_pad)


# ---------------------------------------------------------------------------------------------------
# Launch builders (inferbook.compiled): what the fused ops launch on a GPU, without running them

def norm_silu_pad_launches(shape, dtype, kind: str, pad, *, groups: int = 32, residual: bool = False,
                           bias: bool = True, weight_dtype=torch.float32, silu: bool = True, name: str = "") -> list:
    """`norm_silu_pad_triton`'s launches for x [B, C, T, H, W] of `dtype` with a `kind` ('rms' |
    'group') norm whose weight/bias are `weight_dtype`: the group-statistics pass (group norm)
    and the apply pass, from the same `_block_sizes` and argument lists (`meta` stand-ins)."""
    from ..compiled import Launch, meta

    B, C, T, H, W = shape
    pt, ph, pw = pad
    To, Ho, Wo = T + pt, H + 2 * ph, W + 2 * pw
    x = meta(shape, dtype)
    out_t = meta((B, C, To, Ho, Wo), dtype)
    launches = []
    mean = rstd = y = None
    src, has_r = x, residual
    if kind == "group":
        launches += group_stats_launches(shape, dtype, groups, residual=residual, name=name)
        mean, rstd = meta((B, C), torch.float32), meta((B, C), torch.float32)
        if residual:
            y = meta(shape, dtype)
            src, has_r = y, False
    elif residual:
        y = meta(shape, dtype)
    rr = meta(shape, dtype) if has_r else src
    BLOCK_C, BLOCK_W = _block_sizes(C, Wo)
    w = meta((C,), weight_dtype)
    launches.append(Launch(
        f"{name} norm_silu_pad {kind}{'+res' if residual else ''} C{C} {T}x{H}x{W} w:{str(weight_dtype)[6:]}".strip(),
        _norm_silu_pad_kernel,
        [src, rr, y if (y is not None and has_r) else out_t, out_t, w, w,
         mean if mean is not None else out_t, rstd if rstd is not None else out_t,
         C, T, H, W, To, Ho, Wo, pt, ph, pw, T * H * W, To * Ho * Wo, *src.stride(), *rr.stride(), 1e-6],
        dict(NORM_RMS=kind == "rms", HAS_RES=has_r, HAS_BIAS=bias, APPLY_SILU=silu, BLOCK_C=BLOCK_C, BLOCK_W=BLOCK_W,
             num_warps=4),
        "diffusion/fused.py:norm_silu_pad_triton", (B * To * Ho, triton.cdiv(Wo, BLOCK_W))))
    return launches


def group_stats_launches(shape, dtype, groups: int, *, residual: bool = False, name: str = "") -> list:
    """`_group_stats`'s launch (the GroupNorm statistics pass, fused with the residual add)."""
    from ..compiled import Launch, meta

    B = shape[0]
    n = 1
    for s in shape:
        n *= s
    n_group = n // (B * groups)
    BLOCK, target = 1024, 512
    split = max(1, min(triton.cdiv(n_group, BLOCK), target // (B * groups)))
    chunk = triton.cdiv(triton.cdiv(n_group, split), BLOCK) * BLOCK
    split = triton.cdiv(n_group, chunk)
    x = meta(shape, dtype)
    return [Launch(f"{name} group_stats{' +res' if residual else ''} {'x'.join(map(str, shape))} grid {B * groups}x{split}".strip(),
                   _group_stats_kernel,
                   [x, meta(shape, dtype) if residual else x, meta(shape, dtype) if residual else x,
                    meta((B * groups, split, 3), torch.float32), n_group, chunk, split],
                   dict(HAS_RES=residual, BLOCK=BLOCK), "diffusion/fused.py:_group_stats", (B * groups, split))]


def fused_linear_launches(m: int, n: int, k: int, dtype=torch.bfloat16, *, norm: bool = False, swiglu: bool = False,
                          residual: bool = False, bias: bool = False, name: str = "") -> list:
    """`fused_linear_triton`'s launch for x [m, k] @ weight [n (2n with swiglu), k]^T on a GPU."""
    from ..compiled import Launch, meta

    x2 = meta((m, k), dtype)
    weight = meta((2 * n if swiglu else n, k), dtype)
    out = meta((m, n), dtype)
    r2 = meta((m, n), dtype) if residual else out
    BM, BN, BK = 64, 64, 32
    return [Launch(f"{name} fused_linear M{m} N{n} K{k}{' norm' if norm else ''}{' swiglu' if swiglu else ''}"
                   f"{' +res' if residual else ''}".strip(), _fused_linear_kernel,
                   [x2, weight, weight, weight, r2, out, m, n, k, *x2.stride(), *weight.stride(), *r2.stride(),
                    *out.stride(), 1e-6],
                   dict(HAS_NORM=norm, HAS_BIAS=bias, SWIGLU=swiglu, HAS_RES=residual, DOT_FP32=False,
                        IEEE=dtype == torch.float32, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=4),
                   "diffusion/fused.py:fused_linear_triton", (triton.cdiv(m, BM), triton.cdiv(n, BN)))]
