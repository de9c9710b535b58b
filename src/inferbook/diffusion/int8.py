"""The H3 decoder's INT8 path as ComfyUI runs it: W8A8 linears with the norm / SwiGLU / addcmul fused around
them, and one batched INT8 attention.

ComfyUI's ViT3D decoder (`comfy/ldm/minimax/vae.py`) routes all four linears of a block through
`comfy.ops.linear_input_act`: `to_qkv` and `w1` with an RMSNorm input activation, `w2` with a SwiGLU input
activation, `to_out` and `w2` with the scaled residual (`addcmul`) in the epilogue. When the weights are INT8
`QuantizedTensor`s these run comfy-kitchen's INT8 kernels, and the attention runs `ck.int8_attention` (INT8
Q·Kᵀ, P·V in the activation dtype: SageAttention's "qk int8, pv fp16" form).

Ours, per linear (x [M, K] -> y [M, N]):

    act(x)  = x | RMSNorm(x) * g | silu(gate) * up        (fp32, one pass per row)
    xq, xs  = per-token symmetric INT8 of act(x)           (`_act_quant_kernel`: the activation is never stored
                                                             in float)
    y       = (xq @ wqᵀ) [int32] * xs * ws + bias            (`_int8_gemm_kernel`: INT8 tensor-core dot, int32
                                                             accumulator, scales and bias in the epilogue)
    y       = residual + residual_scale * y                   (same epilogue: ComfyUI's addcmul)

and for attention (q, k, v [B, S, H, D]): Q and K quantized per token (`_act_quant_kernel`), then
`_int8_attention_kernel`: one program per (query block, batch x head), Q·Kᵀ as an INT8 dot with int32
accumulation, scaled by the two per-token scales, an online softmax in fp32, P·V in the activation dtype with
fp32 accumulation. No (batch, head) loop in Python and no S x S tensor.

`*_eager` are the references: the same quantization in PyTorch, the GEMM by `torch._int_mm` (cuBLAS's INT8
GEMM on CUDA, oneDNN's on a CPU); the attention reference materializes the scores (exact fp32 products of the
int8 values), which is what the kernel avoids. Every function returns (result, how): `how` names what ran, and
is INT8_GEMM / TRITON_INT8 only when that kernel itself returned.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import dot_needs_fp32

INT8_GEMM = "torch._int_mm"                 # int_mm's label when the INT8 GEMM itself returned
TRITON_INT8_GEMM = "triton int8 GEMM"
TRITON_INT8_ATTENTION = "triton int8 attention"
INT8_KERNELS = (INT8_GEMM, TRITON_INT8_GEMM, TRITON_INT8_ATTENTION)
ACTS = {"none": 0, "rms_norm": 1, "swiglu": 2}
# Launches of our INT8 Triton kernels in this process, by kernel: the backend's own report of what ran (on a
# CPU the interpreter's launches leave no profiler rows; on CUDA the profiler's kernel names say the same).
LAUNCHES = {"_act_quant_kernel": 0, "_int8_gemm_kernel": 0, "_int8_attention_kernel": 0}


# ---------------------------------------------------------------------------------------------------
# References (PyTorch).

def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: w ~= q * scale, q int8 [..., N, K], scale fp32 [..., N, 1]."""
    scale = w.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(w.float() / scale), -127, 127).to(torch.int8), scale


def input_act_eager(x: torch.Tensor, act: str, norm_weight=None, eps: float = 1e-6) -> torch.Tensor:
    """ComfyUI's `linear_input_act` activations in fp32: none, RMSNorm(x) * g, or silu(gate) * up (x = [gate | up])."""
    xf = x.float()
    if act == "rms_norm":
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    if act == "swiglu":
        gate, up = xf.chunk(2, dim=-1)
        return F.silu(gate) * up
    return xf


def int_mm(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, str]:
    """int8 [M, K] @ int8 [K, N] -> int32 [M, N] with `torch._int_mm` (cuBLAS INT8 GEMM on CUDA, oneDNN on a
    CPU). CUDA wants M > 16 and K, N multiples of 8: the operands are zero-padded to that (exact), and the
    result sliced. If `_int_mm` is still refused, the exact fallback is a float matmul of the integers
    (fp32 while K * 127^2 < 2^24, else fp64), and the returned label says so."""
    M, K = a.shape
    N = b.shape[1]
    if a.is_cuda:
        pm, pk, pn = max(0, 17 - M), (-K) % 8, (-N) % 8
        if pm or pk:
            a = F.pad(a, (0, pk, 0, pm))
        if pk or pn:
            b = F.pad(b, (0, pn, 0, pk))
    try:
        return torch._int_mm(a.contiguous(), b)[:M, :N], INT8_GEMM
    except RuntimeError as e:  # a build without the INT8 GEMM for this layout
        acc = torch.float32 if K * 127 * 127 < 2 ** 24 else torch.float64
        out = (a.to(acc) @ b.to(acc))[:M, :N].round().to(torch.int32)
        return out, f"exact {str(acc)[6:]} matmul of the int8 values (_int_mm refused: {str(e).splitlines()[0][:60]})"


def int8_linear_eager(x, wq, ws, bias=None, *, act="none", norm_weight=None, eps=1e-6, residual=None,
                      residual_scale=None) -> tuple[torch.Tensor, str]:
    """W8A8 linear: act(x) quantized per token, weight per row (wq int8 [N, K], ws fp32 [N]), one INT8 GEMM,
    scales and bias on the int32 sums, then residual + residual_scale * y. x [..., K or 2K] -> [..., N]."""
    a = input_act_eager(x, act, norm_weight, eps)
    K = a.shape[-1]
    xq, xs = quantize_rows(a.reshape(-1, K))
    acc, how = int_mm(xq, wq.t())
    y = acc.float() * xs * ws.view(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
    if residual is not None:
        y = torch.addcmul(residual, y, residual_scale) if residual_scale is not None else residual + y
    return y, how


def int8_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The reference of `int8_attention_triton`: q, k, v [B, S, H, D]; Q and K quantized per token, the scores
    exact products of the int8 values (fp32 holds them exactly while D * 127^2 < 2^24) times both scales,
    softmax in fp32, P V in the activation dtype. Materializes [B, H, S, S]: a reference, not a kernel."""
    D = q.shape[-1]
    qi, qs = quantize_rows(q)
    ki, ks = quantize_rows(k)
    s = torch.einsum("bqhd,bkhd->bhqk", qi.float(), ki.float())
    s = s * qs.squeeze(-1).permute(0, 2, 1)[..., None] * ks.squeeze(-1).permute(0, 2, 1)[:, :, None, :] / math.sqrt(D)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    o = torch.einsum("bhqk,bkhd->bqhd", p.float(), v.float()).to(v.dtype)
    return o, "int8 QK^T reference (exact fp32 products of the int8 values, S x S scores)"


# ---------------------------------------------------------------------------------------------------
# Triton kernels.

@triton.jit
def _act_block(xr, g_ptr, rk, km, K, rstd, ACT: tl.constexpr):
    """act(x) in fp32 at columns rk (mask km) of one row xr: ACT 0 x, 1 x * rstd * g (RMSNorm), 2 silu(gate) * up
    (gate at rk, up at K + rk)."""
    a = tl.load(xr + rk, mask=km, other=0.0).to(tl.float32)
    if ACT == 1:
        a = a * rstd * tl.load(g_ptr + rk, mask=km, other=0.0).to(tl.float32)
    if ACT == 2:
        up = tl.load(xr + K + rk, mask=km, other=0.0).to(tl.float32)
        a = a * tl.sigmoid(a) * up
    return a


@triton.jit
def _act_quant_kernel(x_ptr, g_ptr, q_ptr, s_ptr, K, sxm, sqm, eps,
                      ACT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row: act(x) in fp32 (ACT 0 none, 1 RMSNorm * g, 2 silu(gate) * up over [gate | up]), its absmax,
    then the int8 row and its scale. K is the activation's width (half of x's for SwiGLU)."""
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * sxm
    ss = 0.0
    if ACT == 1:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(xr + rk, mask=rk < K, other=0.0).to(tl.float32)
            ss += tl.sum(a * a, axis=0)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    amax = 0.0
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = _act_block(xr, g_ptr, rk, km, K, rstd, ACT)
        amax = tl.maximum(amax, tl.max(tl.abs(a), axis=0))
    scale = tl.maximum(amax, 1e-12) / 127.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = _act_block(xr, g_ptr, rk, km, K, rstd, ACT)
        v = a / scale
        r = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))   # round half away from zero
        tl.store(q_ptr + row * sqm + rk, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=km)


@triton.jit
def _int8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, r_ptr, rs_ptr, out_ptr, M, N, K,
                      sxm, swn, srm, som,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_RSCALE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out = (xq @ wqᵀ) * xs * ws + bias, then residual + rs * out; int8 operands, int32 accumulator."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)           # grouped order: GROUP_M row blocks share each weight column block
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + rk[None, :], mask=mm[:, None] & km[None, :], other=0)
        b = tl.load(w_ptr + rn.to(tl.int64)[None, :] * swn + rk[:, None], mask=km[:, None] & nm[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    y = acc.to(tl.float32) * tl.load(xs_ptr + rm, mask=mm, other=0.0)[:, None] \
        * tl.load(ws_ptr + rn, mask=nm, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)   # round like the eager output before the addcmul
        if HAS_RSCALE:
            y = y * tl.load(rs_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        y += tl.load(r_ptr + rm.to(tl.int64)[:, None] * srm + rn[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * som + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _int8_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, o_ptr, S, H, D, sm_scale,
                           sqb, sqs, sqh, svb, svs, svh, sob, sos, soh,
                           DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """One (query block, batch x head): Q·Kᵀ as an INT8 dot (int32), times both per-token scales, online softmax
    in fp32, P·V in v's dtype with an fp32 accumulator. q, k int8 [B, S, H, D] (k shares q's strides), scales
    fp32 [B, S, H] contiguous, v / o [B, S, H, D] with their strides."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mm, dm = rm < S, rd < D
    base_q = b.to(tl.int64) * sqb + h * sqh
    q = tl.load(q_ptr + base_q + rm.to(tl.int64)[:, None] * sqs + rd[None, :], mask=mm[:, None] & dm[None, :], other=0)
    qs = tl.load(qs_ptr + (b * S + rm) * H + h, mask=mm, other=0.0) * sm_scale
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    base_v = b.to(tl.int64) * svb + h * svh
    for n0 in range(0, S, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        nm = rn < S
        kt = tl.load(k_ptr + base_q + rn.to(tl.int64)[None, :] * sqs + rd[:, None], mask=dm[:, None] & nm[None, :],
                     other=0)
        ks = tl.load(ks_ptr + (b * S + rn) * H + h, mask=nm, other=0.0)
        s = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32) * qs[:, None] * ks[None, :]
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + base_v + rn.to(tl.int64)[:, None] * svs + rd[None, :], mask=nm[:, None] & dm[None, :],
                     other=0.0)
        pv = p.to(v_ptr.dtype.element_ty)
        if DOT_FP32:  # the interpreter's bf16 tl.dot pitfall: upcast there only
            pv = pv.to(tl.float32)
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, vt)
        m_i = m_new
    out = acc / l_i[:, None]
    base_o = b.to(tl.int64) * sob + h * soh
    tl.store(o_ptr + base_o + rm.to(tl.int64)[:, None] * sos + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mm[:, None] & dm[None, :])


# ---------------------------------------------------------------------------------------------------
# Launchers and their configs.

QUANT_BLOCK_K = 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per GEMM shape class, INT8 tensor-core tiles (K step 64 = one
# 16x8x32 IMMA pair per warp per k-step at minimum); the interpreter gets 32 x 32 x 32 (its numpy temporaries).
INT8_GEMM_CONFIGS = {"small_m": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
                     "wide": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
                     "default": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)}
INTERPRETER_GEMM = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4)
ATTENTION_GPU = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
ATTENTION_INTERPRETER = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)


def gemm_config(M: int, N: int, device, gpu_config: bool = False) -> dict:
    """The INT8 GEMM's tiles for an M x N output: few tokens take a short-M tile (more column blocks to fill
    the SMs), large outputs the 128 x 128 tile, the rest 128 x 64."""
    if torch.device(device).type != "cuda" and not gpu_config:
        return dict(INTERPRETER_GEMM)
    if M <= 64:
        return dict(INT8_GEMM_CONFIGS["small_m"])
    if M * N >= 2048 * 4096:
        return dict(INT8_GEMM_CONFIGS["wide"])
    return dict(INT8_GEMM_CONFIGS["default"])


def attention_config(device, gpu_config: bool = False) -> dict:
    return dict(ATTENTION_GPU if (torch.device(device).type == "cuda" or gpu_config) else ATTENTION_INTERPRETER)


def quantize_act_triton(x: torch.Tensor, act: str = "none", norm_weight=None, eps: float = 1e-6):
    """act(x) quantized per row by `_act_quant_kernel`: x [..., K] (or [..., 2K] for SwiGLU) ->
    (int8 [M, K], fp32 scales [M])."""
    X = x.reshape(-1, x.shape[-1])
    if X.stride(-1) != 1:
        X = X.contiguous()
    M = X.shape[0]
    K = X.shape[1] // 2 if act == "swiglu" else X.shape[1]
    q = torch.empty(M, K, device=x.device, dtype=torch.int8)
    s = torch.empty(M, device=x.device, dtype=torch.float32)
    if M:
        LAUNCHES["_act_quant_kernel"] += 1
        _act_quant_kernel[(M,)](X, norm_weight if norm_weight is not None else X, q, s, K, X.stride(0), q.stride(0),
                                eps, ACT=ACTS[act], BLOCK_K=min(QUANT_BLOCK_K, triton.next_power_of_2(K)), num_warps=4)
    return q, s


def int8_linear_triton(x, wq, ws, bias=None, *, act="none", norm_weight=None, eps=1e-6, residual=None,
                       residual_scale=None, gpu_config: bool = False) -> tuple[torch.Tensor, str]:
    """Triton version of `int8_linear_eager` (same arguments, same shapes): `_act_quant_kernel` then
    `_int8_gemm_kernel` with the scales, bias and addcmul in its epilogue."""
    xq, xs = quantize_act_triton(x, act, norm_weight, eps)
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    r2 = residual.reshape(-1, N) if residual is not None else out
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    cfg = gemm_config(M, N, x.device, gpu_config)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    LAUNCHES["_int8_gemm_kernel"] += 1
    _int8_gemm_kernel[grid](xq, xs, wq, ws, bias if bias is not None else ws, r2,
                            residual_scale if residual_scale is not None else ws, out, M, N, K,
                            xq.stride(0), wq.stride(0), r2.stride(0), out.stride(0),
                            HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                            HAS_RSCALE=residual is not None and residual_scale is not None, **cfg)
    return out.reshape(*x.shape[:-1], N), TRITON_INT8_GEMM


def int8_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gpu_config: bool = False,
                          sm_scale: float | None = None):
    """q, k, v [B, S, H, D] -> o [B, S, H, D] (contiguous), by `_act_quant_kernel` on Q and K and one launch of
    `_int8_attention_kernel` over every (query block, batch x head). `sm_scale` (default 1/sqrt(D)) exists for
    the test that breaks the kernel on purpose."""
    B, S, H, D = q.shape
    qi, qs = quantize_act_triton(q)
    ki, ks = quantize_act_triton(k)
    qi, ki = qi.view(B, S, H, D), ki.view(B, S, H, D)
    o = torch.empty(B, S, H, D, device=q.device, dtype=v.dtype)
    cfg = attention_config(q.device, gpu_config)
    grid = (triton.cdiv(S, cfg["BLOCK_M"]), B * H)
    LAUNCHES["_int8_attention_kernel"] += 1
    _int8_attention_kernel[grid](qi, qs, ki, ks, v, o, S, H, D, sm_scale or 1.0 / math.sqrt(D), *qi.stride()[:3],
                                 *v.stride()[:3], *o.stride()[:3], DOT_FP32=dot_needs_fp32(q.device),
                                 BLOCK_D=max(16, triton.next_power_of_2(D)), **cfg)
    return o, TRITON_INT8_ATTENTION
