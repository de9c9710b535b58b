"""Gated DeltaNet: the recurrence, its chunked (WY) form, and a NaN/accuracy harness for backends.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; state S [B, H, K, V].
Per step t (one head):

    S   <- exp(g_t) * S                       # gate (g_t <= 0: decay)
    u_t  = beta_t * (v_t - S^T k_t)           # delta rule: what S predicts for k_t is replaced
    S   <- S + k_t u_t^T
    o_t  = scale * S^T q_t                    # scale defaults to K ** -0.5

`recurrent` runs that loop. `chunked` computes the same thing chunk by chunk: with
G the in-chunk cumulative sum of g, the in-chunk updates solve one unit lower-triangular
system (I + diag(beta) A) U = diag(beta) (V - diag(exp G) K S0), A[t, j] = exp(G_t - G_j) k_t.k_j
for j < t, and the state is carried between chunks. Gate differences exp(G_t - G_j) are masked
*before* the exp (j > t would overflow: exp of a large positive number, then inf * 0 = NaN).
A length that is not a multiple of the chunk is padded with zeros (k = v = q = beta = g = 0),
which leaves the state unchanged.

Both return (o in v's dtype, final state in the compute dtype: fp32, or fp64 for fp64 inputs).
Backward is autograd's. `chunked(working_dtype=bf16)` rounds what a production chunked kernel stores
(the harness's BF16 baseline); `fla_precision` follows fla's chunk kernels op by op at their precision;
`chunked_triton` is the chunked forward on `tl.dot` (+ backward: `gdn_chunk_bwd.chunked_triton_autograd`).
`check_backend(fn)` is the harness the seed's known issue asks for (Transformer Engine 2.19: GDN backward
may return NaN at head_dim=32 until a cuDNN frontend release ships the fix).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch


def _check(q, k, v, g, beta, initial_state, chunk_size=None):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"g and beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Normalize the last axis in fp32 (fp64 for fp64 input) and store in x's dtype, as fla's
    `l2norm_fwd` does for `use_qk_l2norm_in_kernel=True` (the normalized q, k are rounded to x's dtype)."""
    xf = x.to(_compute_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _varlen(fn, q, k, v, g, beta, scale, initial_state, cu_seqlens, **kw):
    """Packed variable-length sequences (THD, as fla and FlashAttention take them): B == 1, sequence i
    is tokens cu_seqlens[i]:cu_seqlens[i+1]; initial_state [N, H, K, V]; returns (o [1, T, H, V], the
    N final states [N, H, K, V]). Each sequence runs alone: no state crosses a boundary."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"varlen inputs are packed [1, T, H, K]; got q of shape {tuple(q.shape)}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != q.shape[1] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[1]}, got {cu}")
    N = len(cu) - 1
    if initial_state is not None and initial_state.shape[0] != N:
        raise ValueError(f"initial_state must hold one state per sequence ({N}), got {tuple(initial_state.shape)}")
    outs, states = [], []
    for i in range(N):
        a, b = cu[i], cu[i + 1]
        h0 = initial_state[i:i + 1] if initial_state is not None else None
        o, S = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale, initial_state=h0, **kw)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


def recurrent(q, k, v, g, beta, scale=None, initial_state=None, compute_dtype=None, *, cu_seqlens=None,
              use_qk_l2norm: bool = False):
    """Step-by-step Gated DeltaNet. Returns (o [B, T, H, V] in v.dtype, S [B, H, K, V]).

    `compute_dtype` (default fp32, fp64 for fp64 inputs) is the dtype of the state and of every
    operation. `cu_seqlens` takes packed variable-length sequences (see `_varlen`);
    `use_qk_l2norm` normalizes q and k first (`l2norm`), as fla's `use_qk_l2norm_in_kernel`.
    """
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        return _varlen(recurrent, q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype=compute_dtype)
    _check(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype or _compute_dtype(v)
    out_dtype = v.dtype
    scale = K ** -0.5 if scale is None else scale
    S = (torch.zeros(B, H, K, V, dtype=cd, device=q.device) if initial_state is None
         else initial_state.to(cd))
    q, k, v, g, beta = (t.to(cd) for t in (q, k, v, g, beta))
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]                                                   # [B, H, K]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
    o = torch.stack(outs, dim=1) if outs else torch.zeros(B, 0, H, V, dtype=cd, device=q.device)
    return o.to(out_dtype), S


def rounded_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """x rounded to `dtype` and back (a stored intermediate, or a `tl.dot` operand, in the working
    precision); autograd's cast rounds the gradient flowing back through it to `dtype` as well, so
    the backward of a function built from it keeps its intermediates in `dtype` too. No-op for None."""
    return x if dtype is None else x.to(dtype).to(x.dtype)


def chunked(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None, *, _exp_before_mask=False,
            cu_seqlens=None, use_qk_l2norm: bool = False, working_dtype=None):
    """Chunked (WY-form) Gated DeltaNet, same results as `recurrent` up to rounding.

    `working_dtype` (e.g. bf16) is the precision of a production chunked kernel: every stored per-chunk
    intermediate (the state read for the chunk, W, U, the masked q.k matrix P, the gated keys) and
    every matmul operand is rounded to it, while the sums accumulate in fp32 and the running state
    stays fp32 (`rounded_to`; gradients are rounded the same way on their way back). None: all fp32.
    `_exp_before_mask=True` reproduces a classic bug for the harness to catch: exponentiate the gate
    differences, then zero the masked ones. The forward stays finite (the mask selects 0), but the
    backward of exp multiplies a zero gradient by exp(+large) = inf: NaN. `cu_seqlens` and
    `use_qk_l2norm` as in `recurrent`.
    """
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        return _varlen(chunked, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=chunk_size,
                       _exp_before_mask=_exp_before_mask, working_dtype=working_dtype)
    _check(q, k, v, g, beta, initial_state, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = _compute_dtype(v)
    wd = working_dtype if working_dtype is not None and working_dtype != cd else None
    lo = lambda x: rounded_to(x, wd)  # noqa: E731
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    NT = -(-T // C)
    S = (torch.zeros(B, H, K, V, dtype=cd, device=q.device) if initial_state is None
         else initial_state.to(cd))
    if T == 0:
        return torch.zeros(B, 0, H, V, dtype=v.dtype, device=q.device), S
    pad = NT * C - T

    def heads_first(x, last):  # [B, T, H, (D)] -> [B, H, NT, C, (D)], zero padded
        x = x.to(cd)
        if last:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            return x.permute(0, 2, 1, 3).reshape(B, H, NT, C, x.shape[-1])
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.permute(0, 2, 1).reshape(B, H, NT, C)

    qc, kc, vc = heads_first(q, True), heads_first(k, True), heads_first(v, True)
    gc, bc = heads_first(g, False), heads_first(beta, False)
    G = gc.cumsum(-1)                                                   # [B, H, NT, C]
    idx = torch.arange(C, device=q.device)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    diff = G[..., :, None] - G[..., None, :]                            # G_t - G_j
    neg_inf = torch.full_like(diff, -math.inf)
    if _exp_before_mask:  # the bug, kept for the harness's demonstration
        decay_strict = torch.where(strict, diff.exp(), torch.zeros_like(diff))
        decay_incl = torch.where(incl, diff.exp(), torch.zeros_like(diff))
    else:
        decay_strict = torch.where(strict, diff, neg_inf).exp()         # masked before exp
        decay_incl = torch.where(incl, diff, neg_inf).exp()
    A = decay_strict * (kc @ kc.transpose(-1, -2))                     # [.., C, C]
    L = torch.eye(C, dtype=cd, device=q.device) + bc[..., :, None] * A
    rhs = torch.cat([lo(bc[..., None] * vc), lo((bc * G.exp())[..., None] * kc)], dim=-1)
    sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    U0, W = lo(sol[..., :V]), lo(sol[..., V:])                          # U = U0 - W S0
    P = lo(decay_incl * (qc @ kc.transpose(-1, -2)))                    # [.., C, C]
    qg = lo(qc * G.exp()[..., None])
    k_to_end = lo(kc * (G[..., -1:] - G).exp()[..., None])              # exp(G_C - G_j) <= 1
    g_end = G[..., -1].exp()                                            # [B, H, NT]
    outs = []
    for n in range(NT):
        h = lo(S)                                                       # the chunk's stored state
        U = lo(U0[:, :, n] - W[:, :, n] @ h)
        outs.append((qg[:, :, n] @ h + P[:, :, n] @ U) * scale)
        S = g_end[:, :, n, None, None] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, H, NT * C, V)[:, :, :T].permute(0, 2, 1, 3)
    return o.to(v.dtype), S


# ---------------------------------------------------------------------------
# A Triton kernel for the forward recurrence (inference): one program per (batch*head, block of V
# columns). Columns of S are independent under the delta rule (each column's prediction and update
# use only that column), so V splits across programs and the K x BV state block lives in registers
# for all T steps: S is read from and written to memory once, not once per token.

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def gdn_recurrent_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, h0_ptr, o_ptr, hT_ptr, T, H, K, V, scale,
                                 BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
        ok = tl.arange(0, BK)
        ov = i_v * BV + tl.arange(0, BV)
        mk = ok < K
        mv = ov < V
        m_s = mk[:, None] & mv[None, :]
        s_off = i_bh.to(tl.int64) * K * V + ok[:, None] * V + ov[None, :]
        if HAS_H0:
            S = tl.load(h0_ptr + s_off, mask=m_s, other=0.0).to(tl.float32)
        else:
            S = tl.zeros((BK, BV), dtype=tl.float32)
        for t in range(T):
            row = (i_b.to(tl.int64) * T + t) * H + i_h          # (b, t, h) in [B, T, H, *] layouts
            kt = tl.load(k_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
            qt = tl.load(q_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
            vt = tl.load(v_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
            gt = tl.load(g_ptr + row).to(tl.float32)
            bt = tl.load(b_ptr + row).to(tl.float32)
            S = S * tl.exp(gt)
            u = bt * (vt - tl.sum(S * kt[:, None], axis=0))         # beta (v - S^T k)
            S = S + kt[:, None] * u[None, :]
            ot = tl.sum(S * qt[:, None], axis=0) * scale
            tl.store(o_ptr + row * V + ov, ot, mask=mv)
        tl.store(hT_ptr + s_off, S, mask=m_s)


def recurrent_blocks(K: int, V: int, device: torch.device) -> tuple[int, int]:
    """(BK, BV) of the recurrent kernel: on a GPU the fp32 state block [BK, BV] stays <= 4K values
    (registers); the interpreter runs one program at a time with numpy, so one block of all V
    columns is cheapest there."""
    BK = triton.next_power_of_2(K)
    if device.type == "cuda":
        return BK, min(triton.next_power_of_2(V), max(16, 4096 // BK))
    return BK, triton.next_power_of_2(V)


def _recurrent_launch(q, k, v, g, beta, h0, o, hT, scale: float, has_h0: bool, *, device: torch.device):
    """The launch (`compiled.Launch`) of `recurrent_triton` for contiguous q, k [B, T, H, K], v [B, T, H, V],
    g, beta [B, T, H], fp32 h0/hT [B, H, K, V] and fp32 o [B, T, H, V] (tensors or `meta` stand-ins)."""
    from ..compiled import Launch

    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = recurrent_blocks(K, V, device)
    return Launch(f"gdn recurrent fwd K{K} V{V} BV{BV} {str(q.dtype)[6:]}", gdn_recurrent_fwd_kernel,
                  [q, k, v, g, beta, h0, o, hT, T, H, K, V, scale], dict(BK=BK, BV=BV, HAS_H0=has_h0),
                  "numerics/gdn.py:recurrent_triton", (triton.cdiv(V, BV), B * H))


def recurrent_launches(batch: int, seqlen: int, heads: int, k_dim: int, v_dim: int, dtype=torch.bfloat16,
                       has_h0: bool = False) -> list:
    """The launch `recurrent_triton` makes for these shapes on a GPU, without running it."""
    from ..compiled import meta

    qk = (batch, seqlen, heads, k_dim)
    f32 = torch.float32
    st = meta((batch, heads, k_dim, v_dim), f32)
    return [_recurrent_launch(meta(qk, dtype), meta(qk, dtype), meta((batch, seqlen, heads, v_dim), dtype),
                              meta((batch, seqlen, heads), dtype), meta((batch, seqlen, heads), dtype), st,
                              meta((batch, seqlen, heads, v_dim), f32), st, k_dim ** -0.5, has_h0,
                              device=torch.device("cuda"))]


def recurrent_triton(q, k, v, g, beta, scale=None, initial_state=None, *, cu_seqlens=None, use_qk_l2norm=False):
    """Forward-only Gated DeltaNet in one Triton kernel (no autograd). Returns (o in v.dtype, S fp32).

    Computes in fp32 like `recurrent`; the kernel writes fp32 and torch rounds to v's dtype (the
    Triton 3.9 interpreter truncates fp32 -> bf16 instead of rounding to nearest even).
    `cu_seqlens` runs one launch per packed sequence and `use_qk_l2norm` normalizes before the
    kernel (both in PyTorch, not in the kernel).
    """
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        return _varlen(recurrent_triton, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    _check(q, k, v, g, beta, initial_state)
    if triton is None:
        raise RuntimeError("triton is not installed")
    if any(t.requires_grad for t in (q, k, v, g, beta)) and torch.is_grad_enabled():
        raise ValueError("recurrent_triton is forward-only: call it under torch.no_grad() or use `chunked`")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > 256 or V > 4096:
        raise ValueError(f"recurrent_triton supports head dims K <= 256 (got K={K}) and V <= 4096 (got V={V})")
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    hT = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    h0 = initial_state.float().contiguous() if initial_state is not None else hT
    if T > 0 or initial_state is not None:
        launch = _recurrent_launch(q, k, v, g, beta, h0, o, hT, scale, initial_state is not None, device=q.device)
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    else:
        hT.zero_()
    return o.to(v.dtype), hT


FLA_CHUNK = "fla chunk_gated_delta_rule"
FLA_RECURRENT = "fla fused_recurrent_gated_delta_rule (forward)"


def fla_backends(device) -> tuple[dict, str]:
    """flash-linear-attention's kernels (package `fla-core`) as harness backends, where they run:
    ({name: fn}, why not). They are Triton kernels written for GPUs and take BF16/FP16 only (the
    chunk path asserts it); the harness skips their float32 cases as "not run", not as failures."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        return {}, f"fla-core is not installed here ({type(e).__name__}: {str(e)[:80]})"
    if torch.device(device).type != "cuda":
        return {}, "fla-core's Triton kernels need a GPU; they are not run in the Triton interpreter"

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
        cu = cu_seqlens.to(q.device) if cu_seqlens is not None else None
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu)

    def fused(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
        cu = cu_seqlens.to(q.device) if cu_seqlens is not None else None
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                                cu_seqlens=cu)

    chunk.dtypes = fused.dtypes = {torch.bfloat16, torch.float16}
    return {FLA_CHUNK: chunk, FLA_RECURRENT: fused}, "fla-core kernels run on this GPU"


def fla_precision(q, k, v, g, beta, scale=None, initial_state=None, *, chunk_size=64, cu_seqlens=None,
                  use_qk_l2norm: bool = False):
    """fla's `chunk_gated_delta_rule` forward, emulated in PyTorch operation by operation at fla's
    precision (fla-core 0.6: `chunk_fwd.py`, `wy_fast.py`, `common/chunk_delta_h.py`, `common/chunk_o.py`),
    so the harness can be shown to accept a real kernel's rounding on a CPU. Inputs in their dtype
    (bf16 in fla); G = cumsum(g) in fp32; A = (I + beta k k^T exp(G_i - G_j))^-1 solved in fp32 and
    **stored in the input dtype**; u = A (beta v), w = A (beta exp(G) k) from input-dtype operands,
    stored in the input dtype; per chunk the state h is **stored in the input dtype** and read back for
    v_new = u - w h (stored in the input dtype) and for o; the running state accumulates in fp32
    (h <- exp(G_C) h + k^T round(v_new exp(G_C - G))); o = scale (exp(G) q h + round(P) v_new), P the
    masked q k^T exp(G_i - G_j). fla works in log2 units (exp2 of g / ln 2): the same numbers up to fp32
    rounding. Differentiable (autograd rounds the gradients at the same casts); returns (o in v's dtype,
    final state fp32), as fla does."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        return _varlen(fla_precision, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=chunk_size)
    _check(q, k, v, g, beta, initial_state, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    low = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else None
    lo = lambda x: rounded_to(x, low)  # noqa: E731
    f32 = torch.float64 if v.dtype == torch.float64 else torch.float32
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    NT = -(-T // C)
    S = torch.zeros(B, H, K, V, dtype=f32, device=q.device) if initial_state is None else initial_state.to(f32)
    if T == 0:
        return torch.zeros(B, 0, H, V, dtype=v.dtype, device=q.device), S
    pad = NT * C - T

    def heads_first(x):   # [B, T, H, (D)] -> [B, H, NT, C, (D)] in fp32, zero padded
        x = x.to(f32)
        if x.dim() == 4:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            return x.permute(0, 2, 1, 3).reshape(B, H, NT, C, x.shape[-1])
        return torch.nn.functional.pad(x, (0, 0, 0, pad)).permute(0, 2, 1).reshape(B, H, NT, C)

    qc, kc, vc, gc, bc = (heads_first(t) for t in (q, k, v, g, beta))
    G = gc.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    diff = G[..., :, None] - G[..., None, :]
    neg_inf = torch.full_like(diff, -math.inf)
    A = bc[..., :, None] * torch.where(idx[:, None] > idx[None, :], diff, neg_inf).exp() * (kc @ kc.transpose(-1, -2))
    eye = torch.eye(C, dtype=f32, device=q.device)
    Ai = lo(torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True))
    u = lo(Ai @ lo(vc * bc[..., None]))
    w = lo(Ai @ lo(kc * (bc * G.exp())[..., None]))
    P = lo(torch.where(idx[:, None] >= idx[None, :], diff, neg_inf).exp() * (qc @ kc.transpose(-1, -2)))
    outs = []
    for n in range(NT):
        h = lo(S)
        v_new = u[:, :, n] - w[:, :, n] @ h
        G_n, G_last = G[:, :, n], G[:, :, n, -1:]
        outs.append(((qc[:, :, n] @ h) * G_n.exp()[..., None] + P[:, :, n] @ lo(v_new)) * scale)
        S = S * G_last.exp()[..., None] + kc[:, :, n].transpose(-1, -2) @ lo(v_new * (G_last - G_n).exp()[..., None])
    o = torch.stack(outs, dim=2).reshape(B, H, NT * C, V)[:, :, :T].permute(0, 2, 1, 3)
    return o.to(v.dtype), S


def gdn_flops(B: int, T: int, H: int, K: int, V: int) -> int:
    """Multiply-adds x2 of the recurrence: decay, S^T k, rank-1 update, S^T q (per step, per head)."""
    return 2 * B * T * H * K * V * 4


# ---------------------------------------------------------------------------
# Fault injection: a backend whose backward returns NaN at one head dim (like the known TE issue).

class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


def inject_backward_nan(fn: Callable, head_dim: int = 32) -> Callable:
    """Wrap a backend so dq is NaN whenever K == head_dim; forward is untouched.
    The harness must flag it: that is how we know the harness can fail."""
    def wrapped(q, k, v, g, beta, scale=None, initial_state=None, **kw):
        if q.shape[-1] == head_dim:
            q = _NaNGrad.apply(q)
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, **kw)

    wrapped.__name__ = f"{getattr(fn, '__name__', 'backend')}+nan@K={head_dim}"
    return wrapped


# ---------------------------------------------------------------------------
# The harness

GATES = ("random", "zero", "very_negative")
GRADS = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(B, T, H, K, V, gate: str, *, seed: int = 0, device="cpu", initial_state: bool = True,
                n_states: int | None = None, normalize_k: bool = True):
    """fp64 inputs: k L2-normalised (the delta rule's stable regime) unless `normalize_k=False` (for
    cases whose backend normalizes q and k itself: then q, k are raw, scaled x3), beta in (0, 1),
    g by `gate`: 'random' (log-sigmoid of N(0,1)+2, mild decay), 'zero' (exactly 0: no decay)
    or 'very_negative' (-1e3: exp underflows to 0, the state resets every step). The initial
    state is [n_states or B, H, K, V] (one per packed sequence for varlen)."""
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {GATES}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    if normalize_k:
        k = k / k.norm(dim=-1, keepdim=True)
    else:
        q, k = 3 * q, 3 * k
    beta = torch.sigmoid(r(B, T, H))
    if gate == "random":
        g = torch.nn.functional.logsigmoid(r(B, T, H) + 2.0)
    elif gate == "zero":
        g = torch.zeros(B, T, H, dtype=torch.float64)
    else:
        g = torch.full((B, T, H), -1e3, dtype=torch.float64)
    h0 = r(n_states or B, H, K, V) * 0.1 if initial_state else None
    out = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)
    return {n: (t.to(device) if t is not None else None) for n, t in out.items()}


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp64 (NaN when a is not finite)."""
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return math.nan
    den = ref.norm().item()
    num = (a - ref).norm().item()
    return num / den if den > 0 else num


FEATURES = {"varlen": "cu_seqlens", "l2norm": "use_qk_l2norm"}


def supports(fn: Callable, feature: str) -> bool:
    """Does backend `fn` take the keyword a case needs ('varlen': cu_seqlens, 'l2norm': use_qk_l2norm)?
    A `supports` attribute (a set of feature names) wins; else the signature decides (**kw: yes)."""
    import inspect

    declared = getattr(fn, "supports", None)
    if declared is not None:
        return feature in declared
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return FEATURES[feature] in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def harness_cases(head_dims, lengths, gates, extra=()) -> list[dict]:
    """The sweep's cases: every (head dim, length, gate) — a head dim is K (then V = K) or a pair
    (K, V) — plus `extra` cases, dicts with K, V, lengths (one length, or several packed as varlen
    when `varlen`), gate and l2norm."""
    cases = []
    for hd in head_dims:
        K, V = (hd, hd) if isinstance(hd, int) else (int(hd[0]), int(hd[1]))
        for T in lengths:
            for gate in gates:
                cases.append({"K": K, "V": V, "lengths": [int(T)], "varlen": False, "gate": gate, "l2norm": False})
    for c in extra:
        cases.append({"varlen": False, "l2norm": False, "gate": "random", **c, "V": c.get("V", c["K"])})
    return cases


def case_label(c: dict) -> str:
    shape = f"K={c['K']}" + (f" V={c['V']}" if c["V"] != c["K"] else "")
    lens = f"varlen {c['lengths']}" if c["varlen"] else f"T={c['lengths'][0]}"
    return f"{shape} {lens} {c['gate']}" + (" l2norm in kernel" if c["l2norm"] else "") + \
        (f" ({c['tag']})" if c.get("tag") else "")


def _run(fn, inputs: dict, dtype, do: torch.Tensor, dS: torch.Tensor, backward: bool = True, **kw):
    if not backward:
        with torch.no_grad():
            args = {n: (t.to(dtype) if t is not None else None) for n, t in inputs.items()}
            o, S = fn(args["q"], args["k"], args["v"], args["g"], args["beta"], initial_state=args["h0"], **kw)
        return {"o": o.detach(), "S": S.detach()}
    leaves = {n: (t.to(dtype).detach().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
              initial_state=leaves["h0"], **kw)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    names = [n for n in GRADS if leaves.get(n) is not None]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    out = {"o": o.detach(), "S": S.detach()}
    for n, gr in zip(names, grads):
        out["d" + n] = gr.detach() if gr is not None else torch.zeros_like(leaves[n])
    return out


@dataclass
class HarnessReport:
    backend: str
    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)   # cases the backend does not take: not run

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r["passed"] for r in self.rows)

    def failures(self) -> list[dict]:
        return [r for r in self.rows if not r["passed"]]


# The baseline of a BF16/FP16 case: the chunked form at the working precision of a production kernel
# (fla's chunk size, every per-chunk intermediate and matmul operand rounded to the input dtype, fp32
# sums and fp32 running state; `chunked(working_dtype=...)`).
BASELINE_CHUNK = 64
# o and S against that baseline: 1.25x, not FlashAttention's 2x. FlashAttention's baseline rounds once
# at the end; ours already carries every rounding a correct chunked kernel makes, so the allowance left
# is between two roundings of the same algorithm (fla's, emulated by `fla_precision`: 0.83-1.06x of the
# baseline over 47 cases, K 32-256, T 17-513, three gate regimes). 2x would pass 0.4 % noise on o.
WORKING_OUT_FACTOR = 1.25
# Floors added to the same-precision tolerance, by the dtype of the tensor judged: fp32 chunked and
# recurrent round differently (a triangular solve against a running sum), so 2x "the recurrence's
# own fp32 error" could be below what fp32 resolves over a sum of T terms. Small next to the
# baseline's error in each dtype (a BF16 output's rounding alone is ~2e-3 relative RMS).
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-4, torch.float16: 5e-5, torch.float64: 1e-10}


def bf16_state_recurrent(q, k, v, g, beta, scale=None, initial_state=None, **kw):
    """A backend that keeps its running state (and every operation) in BF16, rounded at every step:
    the harness must reject it in BF16 cases (its o or S error is 1.3-5x the working-precision
    baseline's, whose running state is fp32)."""
    o, S = recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, compute_dtype=torch.bfloat16, **kw)
    return o, S.float()


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scaled_gradient(fn: Callable, name: str = "g", rel: float = 0.05) -> Callable:
    """Wrap a backend so the gradient of input `name` (q, k, v, g or beta) is (1 + rel) times what
    `fn`'s backward gives: finite, plausible, off by `rel` (a 5 % dg error by default); forward untouched."""
    if name not in NAMES_IN:
        raise ValueError(f"name must be one of {NAMES_IN}, got {name!r}")

    def wrapped(q, k, v, g, beta, scale=None, initial_state=None, **kw):
        args = dict(q=q, k=k, v=v, g=g, beta=beta)
        if args[name].requires_grad:
            args[name] = _ScaleGrad.apply(args[name], 1.0 + rel)
        return fn(*args.values(), scale=scale, initial_state=initial_state, **kw)

    wrapped.__name__ = f"{getattr(fn, '__name__', 'backend')}+{rel:g} error on d{name}"
    return wrapped


NAMES_IN = ("q", "k", "v", "g", "beta")


def noisy_output(fn: Callable, rel: float = 0.01, seed: int = 0) -> Callable:
    """Wrap a backend so o carries `rel` relative Gaussian noise (finite, plausible, wrong): the
    harness must reject it."""
    def wrapped(q, k, v, g, beta, scale=None, initial_state=None, **kw):
        o, S = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, **kw)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device)
        return o + (rel * o.float() * noise).to(o.dtype), S

    wrapped.__name__ = f"{getattr(fn, '__name__', 'backend')}+{rel:g} noise on o"
    return wrapped


def check_backend(fn: Callable, *, name: str | None = None, forward_only: bool = False, **kw) -> HarnessReport:
    """Sweep one GDN backend `fn(q, k, v, g, beta, scale=None, initial_state=None) -> (o, S)`;
    see `check_backends` for the sweep and the pass rule."""
    name = name or getattr(fn, "__name__", "backend")
    return check_backends({name: fn}, forward_only=(name,) if forward_only else (), **kw)[name]


def baseline(dtype) -> Callable:
    """The same-precision baseline of a case in `dtype`: for BF16/FP16 the chunked form at a production
    kernel's working precision (`BASELINE_CHUNK`, intermediates and matmul operands in `dtype`, fp32
    sums and running state; its gradients by autograd, rounded at the same casts); for fp32/fp64 the
    recurrence in that precision."""
    if dtype in (torch.bfloat16, torch.float16):
        def working_precision(q, k, v, g, beta, scale=None, initial_state=None, **kw):
            return chunked(q, k, v, g, beta, chunk_size=BASELINE_CHUNK, scale=scale, initial_state=initial_state,
                           working_dtype=dtype, **kw)
        return working_precision
    return recurrent


def check_backends(fns: dict, *, head_dims=(32, 64, 128, 256), lengths=(17, 45), gates=GATES,
                   dtypes=(torch.bfloat16, torch.float32), batch: int = 1, heads: int = 2,
                   value_dim: int | None = None, device="cpu", seed: int = 0,
                   out_factor: float = 2.0, grad_factor: float = 3.0, working_out_factor: float = WORKING_OUT_FACTOR,
                   forward_only: tuple = (), extra_cases=()) -> dict[str, HarnessReport]:
    """Sweep GDN backends {name: fn} over (head_dim, length, gate, dtype); one report per backend.

    Each case: inputs made in fp64 and rounded to `dtype`; the reference is `recurrent` in fp64 on
    those same rounded inputs; the baseline (`baseline(dtype)`) runs on the inputs in `dtype`: for
    BF16/FP16 the chunked form with every per-chunk intermediate (state h, W, U, v_new, P) and every
    matmul operand rounded to `dtype` but fp32 sums and an fp32 running state — the precision fla's
    chunk kernels work at, so a backend with that precision passes; for fp32 the fp32 recurrence.
    A case passes when o, S and every gradient (q, k, v, g, beta, initial state) are finite and each
    relative RMS error against the reference is at most a factor times the baseline's, plus the floor
    of the judged tensor's dtype (`FLOOR`): o and S `working_out_factor` (BF16/FP16, see
    `WORKING_OUT_FACTOR`) or `out_factor` (fp32), gradients `grad_factor`. That still rejects 0.4 %
    noise on a working-precision o, a 5 % error on dg and a state kept in BF16 between steps
    (tests/test_numerics_gdn.py shows all three and the pass). NaN never passes; a backend that raises
    fails the case. Backends named in `forward_only` are run without autograd and judged on o and S
    only; their gradients are "not computed" (absent from the row), never NaN. `extra_cases` (see `harness_cases`) add K != V,
    packed variable-length (THD, `cu_seqlens`), long and in-kernel-L2-norm (`use_qk_l2norm`) cases;
    a backend that does not take a case's keyword is listed in its report's `skipped`, not run.
    """
    if not isinstance(fns, dict) or not fns or not all(callable(f) for f in fns.values()):
        raise ValueError("fns must be a non-empty dict {name: callable}")
    for hd in head_dims:
        dims = hd if isinstance(hd, (tuple, list)) else (hd,)
        if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise ValueError(f"head_dims must be positive ints or (K, V) pairs, got {hd!r}")
    for T in lengths:
        if not isinstance(T, int) or isinstance(T, bool) or T < 1:
            raise ValueError(f"lengths must be positive ints, got {T!r}")
    for dt in dtypes:
        if dt not in FLOOR:
            raise ValueError(f"dtype {dt} is not supported; use one of {list(FLOOR)}")
    for gate in gates:
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}; choose from {GATES}")
    reports = {n: HarnessReport(n) for n in fns}
    cases = harness_cases([(hd, value_dim) if value_dim and isinstance(hd, int) else hd for hd in head_dims],
                          lengths, gates, extra_cases)
    for i, c in enumerate(cases):
        K, V, gate = c["K"], c["V"], c["gate"]
        T = sum(c["lengths"])
        B = 1 if c["varlen"] else batch
        inputs = make_inputs(B, T, heads, K, V, gate, seed=seed + i, device=device,
                             n_states=len(c["lengths"]) if c["varlen"] else None, normalize_k=not c["l2norm"])
        gen = torch.Generator(device="cpu").manual_seed(seed + 10_000 + i)
        do = torch.randn(B, T, heads, V, generator=gen, dtype=torch.float64).to(device)
        dS = torch.randn(inputs["h0"].shape, generator=gen, dtype=torch.float64).to(device)
        kw = {}
        if c["varlen"]:
            kw["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(c["lengths"])), dtype=torch.long)
        if c["l2norm"]:
            kw["use_qk_l2norm"] = True
        needs = [f for f, on in (("varlen", c["varlen"]), ("l2norm", c["l2norm"])) if on]
        for dt in dtypes:
            rounded = {n: (t.to(dt).double() if t is not None else None) for n, t in inputs.items()}
            ref = _run(recurrent, rounded, torch.float64, do, dS, **kw)
            base = _run(baseline(dt), rounded, dt, do, dS, **kw)
            low = dt in (torch.bfloat16, torch.float16)
            for name, fn in fns.items():
                meta = {"backend": name, "head_dim": K, "value_dim": V, "T": T, "gate": gate,
                        "dtype": str(dt).replace("torch.", ""), "case": case_label(c), "varlen": c["varlen"],
                        "l2norm": c["l2norm"]}
                takes = getattr(fn, "dtypes", None)
                if takes is not None and dt not in takes:
                    reports[name].skipped.append({**meta, "reason": "not run: the backend takes "
                                                  + "/".join(str(d).replace("torch.", "") for d in takes) + " only"})
                    continue
                missing = [f for f in needs if not supports(fn, f)]
                if missing:
                    reports[name].skipped.append({**meta, "reason": "not run: the backend takes no " +
                                                  ", ".join(FEATURES[f] for f in missing)})
                    continue
                fwd_only = name in forward_only
                row = _judge(name, fn, rounded, dt, do, dS, {k_: ref[k_] for k_ in (("o", "S") if fwd_only else ref)},
                             base, K, T, gate, working_out_factor if low else out_factor, grad_factor,
                             backward=not fwd_only, **kw)
                reports[name].rows.append({**row, **meta})
    return reports


def _judge(name, fn, rounded, dt, do, dS, ref, base, K, T, gate, out_factor, grad_factor, backward=True,
           **kw) -> dict:
    row = {"backend": name, "head_dim": K, "T": T, "gate": gate, "dtype": str(dt).replace("torch.", "")}
    try:
        got = _run(fn, rounded, dt, do, dS, backward=backward, **kw)
    except Exception as e:  # a backend that raises fails its case; the sweep goes on
        row.update(passed=False, nonfinite="", reason=f"raised {type(e).__name__}: {str(e)[:120]}")
        return row
    nonfinite, reasons = [], []
    for key in ref:
        if key not in got:
            reasons.append(f"{key}: not returned")
            continue
        floor = FLOOR.get(got[key].dtype, FLOOR[dt])
        factor = out_factor if key in ("o", "S") else grad_factor
        base_err = rel_rms(base[key], ref[key])
        tol = factor * base_err + floor if math.isfinite(base_err) else floor
        row[f"tol_{key}"] = tol
        if not torch.isfinite(got[key]).all():
            nonfinite.append(key)
            row[f"err_{key}"] = None       # no error is computed for a non-finite tensor: it fails
            continue
        err = rel_rms(got[key], ref[key])
        row[f"err_{key}"] = err
        if not (err <= tol):  # NaN never passes
            reasons.append(f"{key}: {err:.2e} > {tol:.2e}")
    row["nonfinite"] = ",".join(nonfinite)
    row["passed"] = not nonfinite and not reasons
    row["reason"] = ("non-finite " + ",".join(nonfinite) + "; " if nonfinite else "") + "; ".join(reasons)
    return row
