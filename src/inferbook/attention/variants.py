"""Attention variants the main kernel (`flash`) does not take: a sliding window, logit softcapping and
a value head dim different from the query/key head dim (dv != d, MLA-like). A compact Triton
FlashAttention, forward and backward, fixed layout, MHA/GQA, for the acceptance matrix's cases
that FlashAttention's own tests cover (`window_size`, `softcap`, `d != dv`).

Shapes: q [B, Sq, H, D], k [B, Sk, Hk, D], v [B, Sk, Hk, DV] (H % Hk == 0, D, DV <= 256) ->
out [B, Sq, H, DV] in q's dtype, lse [B, H, Sq] float32 (natural log). fp16 or bf16.

Semantics (FlashAttention's): masks are aligned bottom-right; query i sees key j when
  j <= i + Sk - Sq + window[1] and j >= i + Sk - Sq - window[0]   (window[k] = -1: unbounded),
causal is window (-1, 0). Softcap (> 0) replaces each scaled logit s by softcap * tanh(s / softcap)
before the softmax. A query that sees no key gets out = 0, lse = -inf, and no gradient.

Simpler than `flash` on purpose: every key tile goes through the masked path (no mask-free bulk
loop, no PackGQA, no paged or varlen layouts); it is a checked reference kernel, not a fast one.
"""
from __future__ import annotations

import math

import torch

from .. import device as _device
from ..errors import UserError

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne as _round
except Exception:  # pragma: no cover - no triton
    triton = None
    tl = None

LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16)


def reference(q, k, v, *, window=(-1, -1), softcap: float = 0.0, causal: bool = False, scale=None,
              upcast: bool = True):
    """PyTorch definition (differentiable): (out, lse). upcast=True: all float32; False: matmuls in
    the input dtype, softmax in float32, P rounded to the input dtype (PyTorch's own error in that
    precision, FlashAttention's yardstick)."""
    dtype = q.dtype
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wl, wr = (window[0], 0) if causal else window
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    kk = k.repeat_interleave(H // Hk, dim=2)
    vv = v.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
    j = torch.arange(Sk, device=q.device)[None, :]
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if wr >= 0:
        keep &= j <= i + wr
    if wl >= 0:
        keep &= j >= i - wl
    s = s.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1) if Sk else torch.ones(Sq, dtype=torch.bool, device=q.device)
    lse = torch.logsumexp(s.masked_fill(empty[:, None], 0.0), dim=-1) if Sk else torch.zeros(B, H, Sq, device=q.device)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(vv.dtype), vv)
    lse = lse.masked_fill(empty, float("-inf")).detach()
    return (out if upcast else out.to(dtype)), lse


if triton is not None:
    @triton.jit
    def _scores(q, kt, offs_m, offs_n, sq, sk, scale, softcap, WL, WR, SOFTCAP: tl.constexpr):
        """Scaled (optionally capped) natural logits of a tile, masked to -inf; and tanh for the
        softcap backward (1 where no cap)."""
        s = tl.dot(q, kt) * scale
        t = s * 0.0 + 1.0
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for every finite x
            t = 1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)
            s = softcap * t
        shift = offs_m[:, None] + (sk - sq)
        valid = (offs_m[:, None] < sq) & (offs_n[None, :] < sk)
        valid = valid & ((WR < 0) | (offs_n[None, :] <= shift + WR)) & ((WL < 0) | (offs_n[None, :] >= shift - WL))
        return tl.where(valid, s, float("-inf")), t, valid

    @triton.jit
    def _var_fwd_kernel(Q, K, V, O, LSE, sq, sk, H, group, D, DV, scale, softcap, WL, WR,
                        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                        SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, EMU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr):
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        hk = h // group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok = offs_m < sq
        q = tl.load(Q + b * sqb + offs_m[:, None] * sqs + h * sqh + offs_d[None, :],
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for start_n in range(0, sk, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            kt = tl.load(K + b * skb + offs_n[None, :] * sks + hk * skh + offs_d[:, None],
                         mask=n_ok[None, :] & (offs_d[:, None] < D), other=0.0)
            v = tl.load(V + b * svb + offs_n[:, None] * svs + hk * svh + offs_dv[None, :],
                        mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if DOT_FP32:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            s, t, valid = _scores(q, kt, offs_m, offs_n, sq, sk, scale, softcap, WL, WR, SOFTCAP)
            s = s * 1.4426950408889634
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p_lo = _round(p, V.dtype.element_ty, EMU)
            if DOT_FP32:
                p_lo = p_lo.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_lo, v)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(O + b * sob + offs_m[:, None] * sos + h * soh + offs_dv[None, :], _round(out, O.dtype.element_ty, EMU),
                 mask=m_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + (b * H + h) * sq + offs_m, lse, mask=m_ok)

    @triton.jit
    def _var_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV_, sq, sk, H, group, D, DV, scale, softcap, WL, WR,
                        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                        SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, EMU: tl.constexpr, FOR_DQ: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr):
        """FOR_DQ=False: one program per (key block, batch, kv head), dK and dV over every query
        block of the group's heads. FOR_DQ=True: one program per (query block, batch, head), dQ.
        P is recomputed from lse; with softcap, dS carries the cap's derivative 1 - tanh^2."""
        pid = tl.program_id(0)
        b = tl.program_id(1)
        hh = tl.program_id(2)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        if FOR_DQ:
            h = hh
            hk = h // group
            offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < sq
            q = tl.load(Q + b * sqb + offs_m[:, None] * sqs + h * sqh + offs_d[None, :],
                        mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(DO + b * sob + offs_m[:, None] * sos + h * soh + offs_dv[None, :],
                         mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + (b * H + h) * sq + offs_m, mask=m_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
            delta = tl.load(DELTA + (b * H + h) * sq + offs_m, mask=m_ok, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for start_n in range(0, sk, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                n_ok = offs_n < sk
                kt = tl.load(K + b * skb + offs_n[None, :] * sks + hk * skh + offs_d[:, None],
                             mask=n_ok[None, :] & (offs_d[:, None] < D), other=0.0)
                vt = tl.load(V + b * svb + offs_n[None, :] * svs + hk * svh + offs_dv[:, None],
                             mask=n_ok[None, :] & (offs_dv[:, None] < DV), other=0.0)
                if DOT_FP32:
                    kt = kt.to(tl.float32)
                    vt = vt.to(tl.float32)
                s, t, valid = _scores(q, kt, offs_m, offs_n, sq, sk, scale, softcap, WL, WR, SOFTCAP)
                p = tl.where(valid, tl.exp2(s * 1.4426950408889634 - lse[:, None]), 0.0)
                dp = tl.dot(do, vt)
                ds = p * (dp - delta[:, None])
                if SOFTCAP:
                    ds = ds * (1.0 - t * t)
                ds_lo = _round(ds, Q.dtype.element_ty, EMU)
                if DOT_FP32:
                    ds_lo = ds_lo.to(tl.float32)
                dq += tl.dot(ds_lo, tl.trans(kt))
            dq = dq * scale
            tl.store(DQ + b * sqb + offs_m[:, None] * sqs + h * sqh + offs_d[None, :],
                     _round(dq, DQ.dtype.element_ty, EMU), mask=m_ok[:, None] & (offs_d[None, :] < D))
        else:
            hk = hh
            offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            kt = tl.load(K + b * skb + offs_n[None, :] * sks + hk * skh + offs_d[:, None],
                         mask=n_ok[None, :] & (offs_d[:, None] < D), other=0.0)
            vt = tl.load(V + b * svb + offs_n[None, :] * svs + hk * svh + offs_dv[:, None],
                         mask=n_ok[None, :] & (offs_dv[:, None] < DV), other=0.0)
            if DOT_FP32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            dk = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
            dv = tl.zeros([BLOCK_DV, BLOCK_N], tl.float32)
            for g in range(0, group):
                h = hk * group + g
                for start_m in range(0, sq, BLOCK_M):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    m_ok = offs_m < sq
                    q = tl.load(Q + b * sqb + offs_m[:, None] * sqs + h * sqh + offs_d[None, :],
                                mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
                    do = tl.load(DO + b * sob + offs_m[:, None] * sos + h * soh + offs_dv[None, :],
                                 mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
                    if DOT_FP32:
                        q = q.to(tl.float32)
                        do = do.to(tl.float32)
                    lse = tl.load(LSE + (b * H + h) * sq + offs_m, mask=m_ok, other=0.0)
                    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
                    delta = tl.load(DELTA + (b * H + h) * sq + offs_m, mask=m_ok, other=0.0)
                    s, t, valid = _scores(q, kt, offs_m, offs_n, sq, sk, scale, softcap, WL, WR, SOFTCAP)
                    p = tl.where(valid, tl.exp2(s * 1.4426950408889634 - lse[:, None]), 0.0)
                    p_lo = _round(p, Q.dtype.element_ty, EMU)
                    if DOT_FP32:
                        p_lo = p_lo.to(tl.float32)
                    dv += tl.dot(tl.trans(do), p_lo)                 # [DV, N]
                    dp = tl.dot(do, vt)
                    ds = p * (dp - delta[:, None])
                    if SOFTCAP:
                        ds = ds * (1.0 - t * t)
                    ds_lo = _round(ds, Q.dtype.element_ty, EMU)
                    if DOT_FP32:
                        ds_lo = ds_lo.to(tl.float32)
                    dk += tl.dot(tl.trans(q), ds_lo)                 # [D, N]
            dk = dk * scale
            tl.store(DK + b * skb + offs_n[None, :] * sks + hk * skh + offs_d[:, None],
                     _round(dk, DK.dtype.element_ty, EMU), mask=n_ok[None, :] & (offs_d[:, None] < D))
            tl.store(DV_ + b * svb + offs_n[None, :] * svs + hk * svh + offs_dv[:, None],
                     _round(dv, DV_.dtype.element_ty, EMU), mask=n_ok[None, :] & (offs_dv[:, None] < DV))


def _blocks(device: torch.device, D: int, DV: int, kind: str = "fwd") -> dict:
    """Tiles: 64 x 64 for the forward (32 x 32 above head dim 128); the backward's dK/dV program holds
    two [head dim x BLOCK_N] fp32 accumulators, so it takes 32 x 32 above head dim 64 (at 64 x 64 and
    d128, ptxas spilled ~0.5 KB per thread on sm_90). The same tiles in the interpreter: the tests
    run the GPU tiles."""
    big = max(D, DV) > (64 if kind == "bwd" else 128)
    return {"BLOCK_M": 32 if big else 64, "BLOCK_N": 32 if big else 64,
            "BLOCK_D": max(16, triton.next_power_of_2(D)), "BLOCK_DV": max(16, triton.next_power_of_2(DV))}


def _check(q, k, v, window, softcap):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise UserError(f"{name} must be a 4-D tensor [B, S, heads, dim]")
    B, Sq, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
        raise UserError(f"k must be [B, Sk, Hk, {D}] and v [B, Sk, Hk, DV], got {tuple(k.shape)} and {tuple(v.shape)}")
    if H % k.shape[2]:
        raise UserError(f"query heads {H} must be a multiple of kv heads {k.shape[2]}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UserError("q, k and v must share a float16 or bfloat16 dtype")
    if not (1 <= D <= 256 and 1 <= v.shape[3] <= 256):
        raise UserError(f"head dims must be in 1..256, got d={D}, dv={v.shape[3]}")
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        raise UserError(f"window must be two ints >= -1 (-1: unbounded), got {window!r}")
    if not (isinstance(softcap, (int, float)) and softcap >= 0 and math.isfinite(softcap)):
        raise UserError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")


def _fwd_launch(q, k, v, out, lse, window, softcap: float, scale: float, *, device: torch.device):
    """The forward launch (`compiled.Launch`) for contiguous q [B, Sq, H, D], k [B, Sk, Hk, D],
    v [B, Sk, Hk, DV], out [B, Sq, H, DV], fp32 lse [B, H, Sq] (tensors or `meta` stand-ins), or None
    when nothing is launched. `device` picks the tiles and the emulation flags."""
    from ..compiled import Launch

    B, Sq, H, D = q.shape
    Sk, Hk, DV = k.shape[1], k.shape[2], v.shape[3]
    if not (B and Sq and H):
        return None
    cfg = _blocks(device, D, DV)
    return Launch("variants fwd", _var_fwd_kernel, [
        q, k, v, out, lse, Sq, Sk, H, H // Hk, D, DV, scale, float(softcap or 1.0), window[0], window[1],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2)],
        dict(SOFTCAP=softcap > 0, DOT_FP32=_device.dot_needs_fp32(device),
             EMU=_device.bf16_cast_needs_emulation(device), **cfg),
        "attention/variants.py:_VariantAttention.forward", (triton.cdiv(Sq, cfg["BLOCK_M"]), B, H))


def _bwd_launches(q, k, v, dout, lse, delta, dq, dk, dv, window, softcap: float, scale: float, *,
                  device: torch.device) -> list:
    """The dK/dV and dQ launches (`compiled.Launch`) of the backward for contiguous tensors (or `meta`
    stand-ins): dout [B, Sq, H, DV], fp32 lse and delta [B, H, Sq], dq/dk/dv shaped as q/k/v."""
    from ..compiled import Launch

    B, Sq, H, D = q.shape
    Sk, Hk, DV = k.shape[1], k.shape[2], v.shape[3]
    if not (B and Sq and Sk):
        return []
    args = [q, k, v, dout, lse, delta, dq, dk, dv, Sq, Sk, H, H // Hk, D, DV, scale, float(softcap or 1.0),
            window[0], window[1], q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2)]
    bwd = dict(SOFTCAP=softcap > 0, DOT_FP32=_device.dot_needs_fp32(device),
               EMU=_device.bf16_cast_needs_emulation(device), **_blocks(device, D, DV, "bwd"))
    src = "attention/variants.py:_VariantAttention.backward"
    # 8 warps for the dK/dV program above head dim 64: no spills on sm_80/90 up to d192 (d256: ~76 B
    # on sm_90), against 0.2-0.6 KB at 4 warps
    return [Launch("variants bwd dkdv", _var_bwd_kernel, list(args),
                   dict(bwd, FOR_DQ=False, num_warps=8 if max(D, DV) > 64 else 4), src,
                   (triton.cdiv(Sk, bwd["BLOCK_N"]), B, Hk)),
            Launch("variants bwd dq", _var_bwd_kernel, list(args), dict(bwd, FOR_DQ=True), src,
                   (triton.cdiv(Sq, bwd["BLOCK_M"]), B, H))]


class _VariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, softcap, scale):
        B, Sq, H, D = q.shape
        DV = v.shape[3]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(B, Sq, H, DV, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
        launch = _fwd_launch(q, k, v, out, lse, window, softcap, scale, device=q.device)
        if launch is not None:
            launch.kernel[launch.grid](*launch.args, **launch.kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (window, softcap, scale)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        window, softcap, scale = ctx.args
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()      # [B, H, Sq]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for launch in _bwd_launches(q, k, v, dout, lse, delta, dq, dk, dv, window, softcap, scale, device=q.device):
            launch.kernel[launch.grid](*launch.args, **launch.kwargs)
        return dq, dk, dv, None, None, None


def attention(q, k, v, *, window=(-1, -1), softcap: float = 0.0, causal: bool = False, scale=None):
    """Triton attention with a sliding window, softcap and dv != d (module docstring): (out, lse)."""
    window = tuple(int(w) if isinstance(w, int) else w for w in window)
    _check(q, k, v, window, softcap)
    ok, why = _device.triton_backend_for(q.device)
    if not ok:
        raise UserError(f"variants.attention needs Triton on {q.device}: {why}")
    if causal:
        window = (window[0], 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _VariantAttention.apply(q, k, v, window, float(softcap), scale)


def variant_launches(batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int, head_dim: int,
                     head_dim_v: int, *, dtype=torch.bfloat16, window=(-1, -1), softcap: float = 0.0,
                     causal: bool = False, backward: bool = True, name: str = "") -> list:
    """The launches `attention(...)` (and its backward) makes on a GPU for these shapes and options,
    without running them (`compiled.Launch` list on `meta` stand-ins)."""
    from ..compiled import meta

    window = (window[0], 0) if causal else tuple(window)
    scale = 1.0 / math.sqrt(head_dim)
    dev = torch.device("cuda")
    q = meta((batch, seqlen_q, heads, head_dim), dtype)
    k = meta((batch, seqlen_k, kv_heads, head_dim), dtype)
    v = meta((batch, seqlen_k, kv_heads, head_dim_v), dtype)
    out = meta((batch, seqlen_q, heads, head_dim_v), dtype)
    lse = meta((batch, heads, seqlen_q), torch.float32)
    fwd = _fwd_launch(q, k, v, out, lse, window, float(softcap), scale, device=dev)
    launches = [fwd] if fwd is not None else []
    if backward:
        launches += _bwd_launches(q, k, v, meta(out.shape, dtype), lse, meta(lse.shape, torch.float32),
                                  meta(q.shape, dtype), meta(k.shape, dtype), meta(v.shape, dtype), window,
                                  float(softcap), scale, device=dev)
    tag = (f"B{batch} {seqlen_q}x{seqlen_k} H{heads}/{kv_heads} d{head_dim} dv{head_dim_v} {str(dtype)[6:]}"
           f" window{window}{f' softcap{softcap:g}' if softcap else ''}")
    for la in launches:
        la.name = f"{name} {la.name} {tag}".strip()
    return launches
