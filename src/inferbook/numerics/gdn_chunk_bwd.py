"""Gated DeltaNet's chunked backward on `tl.dot`, structured as flash-linear-attention's
`chunk_gated_delta_rule_bwd` (fla `gated_delta_rule/chunk.py`, read at fla-org/flash-linear-attention
bc3b101), and `chunked_triton_autograd`: the chunked forward of `gdn_chunk` + this backward as one
`torch.autograd.Function`, a backend the harness (`gdn.check_backend`) judges with backward=True.

Four kernels, in fla's order, chunk size BT = 64, rows [TT, H, *] as the forward's (varlen by the same
(sequence, chunk) tables):

1. `gdn_chunk_dv_local_kernel` (fla `common/chunk_o.py: chunk_bwd_kernel_dv_local`), one program per
   (chunk, head): dv_local = A^T do, A^T[i, j] = scale k_i.q_j exp(G_j - G_i) for i <= j, the in-chunk
   path of o to v_new; A^T rounded to the input dtype, dv_local stored in it.
2. `gdn_chunk_dhu_bwd_kernel` (fla `common/chunk_delta_h.py: chunk_gated_delta_rule_bwd_kernel_dhu`),
   one program per (block of V, sequence, head), *backwards* over chunks: the state gradient dh [K, BV]
   stays fp32 in registers, starting from dS (the final state's gradient); per chunk it is stored (input
   dtype) as the gradient of the state leaving the chunk, dv2 = exp(G_last - G) k dh + dv_local
   (stored), and dh <- exp(G_last) dh + scale q^T (exp(G) do) - w^T dv2; after the first chunk it is the
   initial state's gradient dh0 (fp32).
3. `gdn_chunk_dqkwg_kernel` (fla `chunk_o.py: chunk_bwd_kernel_dqkwg`), one program per (block of K,
   chunk, head): over V blocks ds = do v_new^T, dq = do h^T, dk = v_new dh^T, dw = -dv2 h^T and the
   G_last gradient sum(h * dh); then the gates, ds masked (i >= j *before* the exp) and rounded, dq += ds k,
   dk += ds^T q, and dg (the gradient of the cumulative gate G; + G_last's at the chunk's last row), one
   fp32 dg per K block (summed later, as fla's `dg.sum(0)`).
4. `gdn_chunk_wy_bwd_kernel` (fla `gated_delta_rule/wy_fast.py: prepare_wy_repr_bwd_kernel`), one
   program per (chunk, head): through w = A (beta exp(G) k) and u = A (beta v): dk2, dv, dbeta and dA,
   then through A = (I + L)^-1: dL = -A^T dA A^T (strictly lower), L_ij = beta_i k_i.k_j exp(G_i - G_j),
   into dk, dbeta and dG. It also does what fla runs after it: dg.sum(0) over K blocks, dg += dg2 and
   the in-chunk *reverse* cumsum of dg (fla's `chunk_local_cumsum(reverse=True)`, a separate kernel),
   turning the gradient of G into that of g.

Precision as fla's: every dot takes input-dtype operands and accumulates fp32; the stored intermediates
(dv_local, dh per chunk, dv2, dw, dq, dk, dk2, dv, dbeta) are in the input dtype, dh's running value, dh0
and dg in fp32; the dot operands built in fp32 (ds, dA, beta exp(G) k, beta v, dv2 for the dh update) are
rounded to the input dtype first.

Where ours differs from fla:
- the forward's intermediates (g_cum, A, w, u, h, v_new) are kept from the forward, not recomputed in the
  backward (fla recomputes w, u by `recompute_w_u_fwd` and h, v_new by `chunk_gated_delta_rule_fwd_h` to
  save memory; the values are the same);
- the dh update takes q^T (exp(G) do), exp(G) do rounded to the input dtype (fla forms exp(G) q in fp32
  and its dot then takes fp32 operands, TF32 on NVIDIA; an fp32 [64, 256] q spills at K 256);
- gate differences are masked before the exp everywhere (fla masks after in dv_local and the dA step; the
  values kept are the same, the discarded ones are never inf);
- dg's in-chunk part is rows minus columns of ds * (q k^T) (one more [BT, BT] dot); fla takes q.dq - k.dk,
  whose diagonal cancels only up to rounding: with g = -1e3, where the true dg is 0, our kernel written
  that way failed the harness's fp32 case at T = 45 on that noise (2.9e-6 against the 2e-6 floor);
- dg's sum over K blocks, the dg2 add and the reverse cumsum are folded into kernel 4; dk from kernels 3
  and 4 are added in fp32 and rounded once (fla adds two bf16 tensors);
- natural-log units (exp, not exp2); tiles and warps fixed per head dim (`bwd_blocks`; fla autotunes);
- in-kernel L2 normalisation of q, k (`use_qk_l2norm`) is done by `gdn.l2norm` in PyTorch before the
  kernels, so autograd differentiates it (fla has `l2norm_bwd`); no grouped value heads (HV > H).
"""
from __future__ import annotations

import torch

from .. import device as _device
from . import gdn_chunk
from .gdn_chunk import CHUNK, _TL_DTYPE

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne
    from .gdn_chunk import _chunk_rows, _ld, _operand, _state_block, _state_chunk
except Exception:  # pragma: no cover
    triton = None
    tl = None


if triton is not None:
    @triton.jit
    def gdn_chunk_dv_local_kernel(q, k, g_cum, do, dv, cu_seqlens, chunk_indices, scale, H, K, V,
                                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                                  EMULATE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        rows, m_t, last_row, o_t, T, i_t = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
        o_i = tl.arange(0, BT)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = _ld(k + rows[:, None] * K + o_k[None, :], m, DOT_FP32)
            b_q = _ld(q + rows[:, None] * K + o_k[None, :], m, DOT_FP32)
            b_A = tl.dot(b_k, tl.trans(b_q), b_A, input_precision=PRECISION)      # [i, j] = k_i . q_j
        b_G = tl.load(g_cum + rows, mask=m_t, other=0.0)
        upper = (o_i[:, None] <= o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_A = b_A * scale * tl.exp(tl.where(upper, b_G[None, :] - b_G[:, None], float("-inf")))
        b_Ab = _operand(b_A, DT, EMULATE, DOT_FP32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = m_t[:, None] & (o_v < V)[None, :]
            b_do = _ld(do + rows[:, None] * V + o_v[None, :], m_v, DOT_FP32)
            b_dv = tl.dot(b_Ab, b_do, input_precision=PRECISION)
            tl.store(dv + rows[:, None] * V + o_v[None, :], cast_rtne(b_dv, DT, EMULATE), mask=m_v)

    @triton.jit
    def gdn_chunk_dhu_bwd_kernel(q, k, w, g_cum, do, dv, dv2, dh, dht, dh0, cu_seqlens, chunk_offsets, scale,
                                 H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                 HAS_H0: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
        i_h, bos, T, boh, NT, o_k, m_k, o_v, m_v, m_s, s_off = _state_block(cu_seqlens, chunk_offsets, H, K, V,
                                                                            BT, BK, BV)
        b_dh = tl.load(dht + s_off, mask=m_s, other=0.0).to(tl.float32)
        for i_r in range(NT):
            i_t = NT - 1 - i_r
            # d(state leaving the chunk) stored (input dtype) before its update
            rows, m_t, b_G_last, b_G = _state_chunk(dh, g_cum, b_dh, i_t, i_h, bos, T, boh, H, K, V, o_k, o_v, m_s,
                                                    BT, DT, EMULATE)
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_k = _ld(k + rows[:, None] * K + o_k[None, :], m_tk, DOT_FP32)
            b_dv = tl.dot(b_k, _operand(b_dh, DT, EMULATE, DOT_FP32), input_precision=PRECISION)
            b_dv = b_dv * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None]
            b_dv += tl.load(dv + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            tl.store(dv2 + rows[:, None] * V + o_v[None, :], cast_rtne(b_dv, DT, EMULATE), mask=m_tv)
            # (exp(G) q)^T do as q^T (exp(G) do): the gate scales the [BT, BV] tile, not the [BT, K] one (an
            # fp32 copy of q at K 256 spills on sm_90)
            b_q = _ld(q + rows[:, None] * K + o_k[None, :], m_tk, DOT_FP32)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_dog = _operand(b_do * tl.where(m_t, tl.exp(b_G), 0.0)[:, None], DT, EMULATE, DOT_FP32)
            b_w = _ld(w + rows[:, None] * K + o_k[None, :], m_tk, DOT_FP32)
            b_dh = (b_dh * tl.exp(b_G_last)
                    + tl.dot(tl.trans(b_q), b_dog, input_precision=PRECISION) * scale
                    - tl.dot(tl.trans(b_w), _operand(b_dv, DT, EMULATE, DOT_FP32), input_precision=PRECISION))
        if HAS_H0:
            tl.store(dh0 + s_off, b_dh, mask=m_s)

    @triton.jit
    def gdn_chunk_dqkwg_kernel(q, k, v_new, g_cum, h, do, dh, dv2, dq, dk, dw, dg, cu_seqlens, chunk_indices,
                               scale, TT, H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               DT: tl.constexpr, EMULATE: tl.constexpr, DOT_FP32: tl.constexpr,
                               PRECISION: tl.constexpr):
        i_k = tl.program_id(0)
        i_c = tl.program_id(1)
        i_h = tl.program_id(2)
        rows, m_t, last_row, o_t, T, i_t = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
        o_i = tl.arange(0, BT)
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        s_base = (i_c.to(tl.int64) * H + i_h) * K * V             # chunks numbered as in chunk_indices
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        b_dg_last = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_s = m_k[:, None] & m_v[None, :]
            b_vn = _ld(v_new + rows[:, None] * V + o_v[None, :], m_tv, DOT_FP32)
            b_do = _ld(do + rows[:, None] * V + o_v[None, :], m_tv, DOT_FP32)
            b_dv = _ld(dv2 + rows[:, None] * V + o_v[None, :], m_tv, DOT_FP32)
            b_h = _ld(h + s_base + o_k[:, None] * V + o_v[None, :], m_s, DOT_FP32)     # [BK, BV]
            b_dh = _ld(dh + s_base + o_k[:, None] * V + o_v[None, :], m_s, DOT_FP32)
            b_dg_last += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
            b_ds = tl.dot(b_do, tl.trans(b_vn), b_ds, input_precision=PRECISION)
            b_dq = tl.dot(b_do, tl.trans(b_h), b_dq, input_precision=PRECISION)
            b_dk = tl.dot(b_vn, tl.trans(b_dh), b_dk, input_precision=PRECISION)
            b_dw = tl.dot(b_dv, tl.trans(b_h), b_dw, input_precision=PRECISION)
        tl.store(dw + rows[:, None] * K + o_k[None, :], cast_rtne(-b_dw, DT, EMULATE), mask=m_tk)
        b_q = _ld(q + rows[:, None] * K + o_k[None, :], m_tk, DOT_FP32)
        b_k = _ld(k + rows[:, None] * K + o_k[None, :], m_tk, DOT_FP32)
        b_G = tl.load(g_cum + rows, mask=m_t, other=0.0)
        b_G_last = tl.load(g_cum + last_row)
        dg_last = tl.sum(b_dg_last, 0) * tl.exp(b_G_last)
        b_dq = b_dq * tl.exp(b_G)[:, None] * scale
        b_dk = b_dk * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None]
        dg_last += tl.sum(tl.sum(b_dk * b_k.to(tl.float32), 1), 0)
        incl = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_ds = b_ds * tl.exp(tl.where(incl, b_G[:, None] - b_G[None, :], float("-inf"))) * scale
        # dG_i of the in-chunk term P_ij = q_i.k_j exp(G_i - G_j) is sum_j dP_ij P_ij - sum_j dP_ji P_ji, by
        # rows minus columns of one matrix, so the diagonal (exp(0): no dependence on G) cancels exactly.
        # fla takes q.dq - k.dk after adding ds k and ds^T q, where the diagonal cancels only up to
        # rounding: with g = -1e3 (true dg = 0) that leaves fp32 noise above the harness's floor.
        b_dsP = b_ds * tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        b_dg = (tl.sum(b_dq * b_q.to(tl.float32), 1) - tl.sum(b_dk * b_k.to(tl.float32), 1)
                + tl.sum(b_dsP, 1) - tl.sum(b_dsP, 0))
        b_dg = tl.where(rows == last_row, b_dg + dg_last, b_dg)
        b_dsb = _operand(b_ds, DT, EMULATE, DOT_FP32)
        b_dq = tl.dot(b_dsb, b_k, b_dq, input_precision=PRECISION)
        b_dk = tl.dot(tl.trans(b_dsb), b_q, b_dk, input_precision=PRECISION)
        tl.store(dq + rows[:, None] * K + o_k[None, :], cast_rtne(b_dq, DT, EMULATE), mask=m_tk)
        tl.store(dk + rows[:, None] * K + o_k[None, :], cast_rtne(b_dk, DT, EMULATE), mask=m_tk)
        tl.store(dg + i_k.to(tl.int64) * TT * H + rows, b_dg, mask=m_t)

    @triton.jit
    def gdn_chunk_wy_bwd_kernel(k, v, beta, g_cum, A, dw, du, dk_qk, dg_qk, dk, dv, db, dg, cu_seqlens,
                                chunk_indices, TT, H, K, V, NK, BT: tl.constexpr, BK: tl.constexpr,
                                BV: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                                DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        rows, m_t, last_row, o_t, T, i_t = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
        o_i = tl.arange(0, BT)
        b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        b_G = tl.load(g_cum + rows, mask=m_t, other=0.0)
        b_eG = tl.where(m_t, tl.exp(b_G), 0.0)
        b_A = _ld(A + rows[:, None] * BT + o_i[None, :], m_t[:, None], DOT_FP32)    # A[i, j], lower
        b_At = tl.trans(b_A)
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
        b_db = tl.zeros([BT], dtype=tl.float32)
        b_dg = tl.zeros([BT], dtype=tl.float32)
        # w = A (beta exp(G) k): d(beta exp(G) k) = A^T dw, dA += dw (beta exp(G) k)^T
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
            b_kbg = b_k * (b_b * b_eG)[:, None]
            b_dw = _ld(dw + rows[:, None] * K + o_k[None, :], m, DOT_FP32)
            b_dA = tl.dot(b_dw, tl.trans(_operand(b_kbg, DT, EMULATE, DOT_FP32)), b_dA, input_precision=PRECISION)
            b_dkbg = tl.dot(b_At, b_dw, input_precision=PRECISION)
            b_db += tl.sum(b_dkbg * b_k * b_eG[:, None], 1)
            b_dg += tl.sum(b_dkbg * b_kbg, 1)
            b_dk = b_dkbg * (b_b * b_eG)[:, None] + tl.load(dk_qk + rows[:, None] * K + o_k[None, :], mask=m,
                                                            other=0.0).to(tl.float32)
            tl.store(dk + rows[:, None] * K + o_k[None, :], b_dk, mask=m)    # fp32 scratch, finished below
        # u = A (beta v)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m = m_t[:, None] & (o_v < V)[None, :]
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)
            b_du = _ld(du + rows[:, None] * V + o_v[None, :], m, DOT_FP32)
            b_dA = tl.dot(b_du, tl.trans(_operand(b_v * b_b[:, None], DT, EMULATE, DOT_FP32)), b_dA,
                          input_precision=PRECISION)
            b_dvb = tl.dot(b_At, b_du, input_precision=PRECISION)
            b_db += tl.sum(b_dvb * b_v, 1)
            tl.store(dv + rows[:, None] * V + o_v[None, :], cast_rtne(b_dvb * b_b[:, None], DT, EMULATE), mask=m)
        # A = (I + L)^-1: dL = -A^T dA A^T on the strictly lower part; L_ij = beta_i k_i.k_j exp(G_i - G_j)
        strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_dA = tl.where(strict, b_dA, 0.0)
        b_dA = tl.dot(_operand(b_dA, DT, EMULATE, DOT_FP32), b_At, input_precision=PRECISION)
        b_dA = tl.dot(b_At, _operand(b_dA, DT, EMULATE, DOT_FP32), input_precision=PRECISION)
        b_dL = -b_dA * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))  # d(beta_i k_i.k_j)
        b_dLb = _operand(b_dL, DT, EMULATE, DOT_FP32)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = _ld(k + rows[:, None] * K + o_k[None, :], m, DOT_FP32)
            b_kb = _operand(b_k.to(tl.float32) * b_b[:, None], DT, EMULATE, DOT_FP32)
            b_kk = tl.dot(b_k, tl.trans(b_k), b_kk, input_precision=PRECISION)
            b_dkb = tl.dot(b_dLb, b_k, input_precision=PRECISION)                  # sum_j dL_ij k_j
            b_db += tl.sum(b_dkb * b_k.to(tl.float32), 1)
            b_dk = (b_dkb * b_b[:, None] + tl.dot(tl.trans(b_dLb), b_kb, input_precision=PRECISION)
                    + tl.load(dk + rows[:, None] * K + o_k[None, :], mask=m, other=0.0))
            tl.store(dk + rows[:, None] * K + o_k[None, :], b_dk, mask=m)
        tl.store(db + rows, cast_rtne(b_db, DT, EMULATE), mask=m_t)
        # dG_i += sum_j dL_ij L_ij - sum_j dL_ji L_ji; then dG from kernel 3 (summed over its K blocks), and
        # the in-chunk reverse cumsum: dg_t = sum_{s >= t} dG_s
        b_dLL = b_dL * b_kk * b_b[:, None]
        b_dg += tl.sum(b_dLL, 1) - tl.sum(b_dLL, 0)
        for i_k in range(NK):
            b_dg += tl.load(dg_qk + i_k * TT * H + rows, mask=m_t, other=0.0)
        b_dg = tl.where(m_t, b_dg, 0.0)
        b_dg = tl.sum(b_dg, 0) - tl.cumsum(b_dg, 0) + b_dg
        tl.store(dg + rows, b_dg, mask=m_t)


def bwd_blocks(K: int, V: int, device: torch.device) -> dict:
    """Tiles and warps of the four backward kernels. On a GPU: BK = BV = 64 in dv_local, dqkwg and wy
    (fla's tiling on Ada-class shared memory; fla takes 128 on Hopper); the dhu kernel holds all of K and
    a BV block of the fp32 dh, as the forward's state kernel (`gdn_chunk.chunk_blocks`; BV 16 at K 256);
    8 warps for dqkwg's four [64, 64] fp32 accumulators and for wy's [64, 64] A, A^T, dA and k k^T (4 warps
    spill on sm_90 from K 64); sm_80 changes wy's and dhu's (`_sm80_bwd`). The interpreter runs one program at a time: there one block covers all of
    K and V."""
    c = gdn_chunk.chunk_blocks(K, V, device)
    full_k = max(16, triton.next_power_of_2(K))
    full_v = max(16, triton.next_power_of_2(V))
    gpu = _device.wants_gpu_config(device)
    bk = min(full_k, 64) if gpu else full_k
    bv = min(full_v, 64) if gpu else full_v
    # dhu at K 256: BV 16 (the forward's 32 spills on sm_90: dhu holds k, q and w tiles of [64, 256])
    bv_dhu = min(c["BV_STATE"], 16) if gpu and c["BK_STATE"] > 128 else c["BV_STATE"]
    out = dict(BK=bk, BV=bv, BK_STATE=c["BK_STATE"], BV_STATE=bv_dhu, warps_state=c["warps_state"],
               stages_state=c["stages_state"], warps_dqkwg=8, warps_wy=8, warps=4, gpu_precision=c["gpu_precision"],
               BK_wy=bk, BV_wy=bv, stages_wy=None)
    if gpu:
        out.update(_device.pick_config(_BWD_TARGET_CONFIGS, device)(out))
        out = _device.swept("gdn.bwd", out)
    return out


def _sm80_bwd(c: dict) -> dict:
    """sm_80 (mma.sync keeps the accumulators in registers, 255 at most a thread at 8 warps): wy's [64, 64]
    A, A^T, dA, dL and k k^T leave no room for a [64, 64] k tile, so BK = BV = 16 and no pipelining (at 64
    and 3 stages it spilled 1.6 KB; the issue bound predicted lower too); dhu at K 64 and K 128 takes BV 32
    (BV 64 spilled 86 and 96 B; at K 128 twice the programs, 128 on A100's 108 SMs where 64 left 44 idle),
    at K 256 one stage (its [256, 16] dh and three [64, 256] tiles spilled 88 B at 2; the launch is
    memory-bound either way, predicted alike). dqkwg and dv_local take BV 32: dqkwg's V loop then holds
    half the h, dh, do and v tiles (380 B of spill -> 72 B, shared memory 80 -> 40 KB, predicted as fast
    or faster at every shape); the 72 B left are its three [64, 64] fp32 accumulators beside dA, and only
    BK 32 removes them, which the model predicts 1.2-1.4x slower (twice the programs, each re-reading the
    chunk's v, do and dA tiles: issue- or waves-bound). Tried at K 64 and kept out: BV 16 leaves the same
    72 B; 2 or 1 stages spill 96 and 224 B; 16 warps 3.8 KB; finishing and storing dq before the [64, 64]
    q k^T product 152 B (ptxas schedules the longer-lived tiles worse)."""
    d = dict(BK_wy=min(c["BK_wy"], 16), BV_wy=min(c["BV_wy"], 16), stages_wy=1, BV=min(c["BV"], 32))
    if c["BK_STATE"] in (64, 128):
        d["BV_STATE"] = min(c["BV_STATE"], 32)
    elif c["BK_STATE"] > 128:
        d["stages_state"] = 1
    return d


def _sm100_bwd(c: dict) -> dict:
    """sm_100: dqkwg on 4 warps. Its loop is issue-bound on B200 (1.11x H200's issue rate against 1.67x
    its bandwidth); at 8 warps each of its four [64, 64] fp32 accumulators is split over twice the warps
    and every warp repeats the loads' address arithmetic and the reductions for dg. 4 warps hold them in 248
    registers without a spill; predicted 16.4 us against 18.9 at the timed shape (B4 T1024 H8 K 128), 2.15
    against 2.41 at K 64 (`compiled.peers`' backward rows and `inferbook inspect gdn-backward-check
    --target sm_100`). On sm_90 the same launch is memory-bound at either count, and 8 stays."""
    return {"warps_dqkwg": 4}


def _cdna_bwd(c: dict) -> dict:
    """CDNA (gfx942, gfx950): dqkwg, wy and dhu on 4 waves. At 8 every wave repeats the address arithmetic and
    the reductions of tiles split over twice the waves, and wy spilled 8-16 B of scratch at K 64 and 128 on
    gfx942. Predicted over the gpu preset's 18 launches of each kernel (`inferbook sweep gdn-backward-check
    gfx942 gdn.bwd --kernel gdn_chunk_wy_bwd_kernel --set BK_wy=16,32,64 --set warps_wy=4,8`, and
    warps_dqkwg / warps_state likewise; faster on every launch, no scratch): wy 447 -> 256 us on MI300X, 288
    -> 152 on MI355X; dqkwg 322 -> 182 and 244 -> 132; dhu 218 -> 179 and 141 -> 123 (slower on none). BK_wy
    64 stays (32: 268 and 151 us). dv_local keeps 4 (2: 79.1 us against 79.2, slower on 12 of 18). dhu's 4
    (`warps_state`) comes from the forward's `gdn_chunk.chunk_blocks`, whose state kernel takes 4 on CDNA too."""
    return {"warps_wy": 4, "warps_dqkwg": 4}


# per-target changes to `bwd_blocks`' GPU config (`device.pick_config`: 'nvidia' is every other target)
_BWD_TARGET_CONFIGS = {"nvidia": lambda c: {}, "sm_80": _sm80_bwd, "sm_100": _sm100_bwd, "hip": _cdna_bwd}


def _bwd_launches(q, k, v, beta, g_cum, A, w, h, v_new, do, dht, h0, cu, idx, offs, dv_local, dv2, dh, dh0,
                  dq, dk_qk, dw, dg_qk, dk, dv, db, dg, *, n_seqs: int, n_chunks: int, scale: float,
                  has_h0: bool, device: torch.device, chunk: int = CHUNK) -> list:
    """The four `compiled.Launch`es of the backward (tensors or `meta` stand-ins), rows [TT, H, *]."""
    from ..compiled import Launch

    TT, H, K = q.shape
    V = v.shape[-1]
    c = bwd_blocks(K, V, device)
    nk = triton.cdiv(K, c["BK"])
    flags = dict(DT=getattr(tl, _TL_DTYPE[q.dtype]), EMULATE=_device.bf16_cast_needs_emulation(device),
                 DOT_FP32=_device.dot_needs_fp32(device),
                 PRECISION="ieee" if q.dtype == torch.float32 or _device.dot_needs_fp32(device) else c["gpu_precision"])
    dt = str(q.dtype)[6:]
    src = "numerics/gdn_chunk_bwd.py:chunked_triton_autograd"
    return [
        Launch(f"gdn chunk bwd dv_local K{K} V{V} {dt}", gdn_chunk_dv_local_kernel,
               [q, k, g_cum, do, dv_local, cu, idx, scale, H, K, V],
               dict(BT=chunk, BK=c["BK"], BV=c["BV"], num_warps=c["warps"], **flags), src, (n_chunks, H)),
        Launch(f"gdn chunk bwd dhu K{K} V{V} BV{c['BV_STATE']} {dt}", gdn_chunk_dhu_bwd_kernel,
               [q, k, w, g_cum, do, dv_local, dv2, dh, dht, dh0, cu, offs, scale, H, K, V],
               dict(BT=chunk, BK=c["BK_STATE"], BV=c["BV_STATE"], HAS_H0=has_h0, num_warps=c["warps_state"],
                    num_stages=c["stages_state"], **flags), src, (triton.cdiv(V, c["BV_STATE"]), n_seqs * H)),
        Launch(f"gdn chunk bwd dqkwg K{K} V{V} {dt}", gdn_chunk_dqkwg_kernel,
               [q, k, v_new, g_cum, h, do, dh, dv2, dq, dk_qk, dw, dg_qk, cu, idx, scale, TT, H, K, V],
               dict(BT=chunk, BK=c["BK"], BV=c["BV"], num_warps=c["warps_dqkwg"], **flags), src, (nk, n_chunks, H)),
        Launch(f"gdn chunk bwd wy K{K} V{V} {dt}", gdn_chunk_wy_bwd_kernel,
               [k, v, beta, g_cum, A, dw, dv2, dk_qk, dg_qk, dk, dv, db, dg, cu, idx, TT, H, K, V, nk],
               dict(BT=chunk, BK=c["BK_wy"], BV=c["BV_wy"], num_warps=c["warps_wy"], **flags,
                    **({} if c["stages_wy"] is None else dict(num_stages=c["stages_wy"]))), src, (n_chunks, H)),
    ]


def chunked_bwd_launches(batch: int, seqlen: int, heads: int, k_dim: int, v_dim: int, dtype=torch.bfloat16,
                         has_h0: bool = True) -> list:
    """The launches of the backward for a [batch, seqlen] problem on a GPU, without running it."""
    from ..compiled import meta

    TT = batch * seqlen
    n_chunks = batch * -(-seqlen // CHUNK)
    dev = torch.device("cuda")
    nk = triton.cdiv(k_dim, bwd_blocks(k_dim, v_dim, dev)["BK"])
    f32, i32 = torch.float32, torch.int32
    tk, tv, th = (TT, heads, k_dim), (TT, heads, v_dim), (TT, heads)
    st, hh = (batch, heads, k_dim, v_dim), (n_chunks, heads, k_dim, v_dim)
    m = meta
    return _bwd_launches(m(tk, dtype), m(tk, dtype), m(tv, dtype), m(th, dtype), m(th, f32),
                         m((TT, heads, CHUNK), dtype), m(tk, dtype), m(hh, dtype), m(tv, dtype), m(tv, dtype),
                         m(st, f32), m(st, f32), m((batch + 1,), i32), m((2 * n_chunks,), i32), m((batch + 1,), i32),
                         m(tv, dtype), m(tv, dtype), m(hh, dtype), m(st, f32), m(tk, dtype), m(tk, dtype),
                         m(tk, dtype), m((nk, TT, heads), f32), m(tk, f32), m(tv, dtype), m(th, dtype), m(th, f32),
                         n_seqs=batch, n_chunks=n_chunks, scale=k_dim ** -0.5, has_h0=has_h0, device=dev)


class _ChunkedGDN(torch.autograd.Function):
    """o, S = chunked forward (`gdn_chunk.chunked_fwd`); backward by the four kernels above. Inputs
    q, k, v [B, T, H, *], g, beta [B, T, H] in one dtype; h0 [N, H, K, V] or None."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, cu_seqlens):
        o, ht, saved = gdn_chunk.chunked_fwd(q, k, v, g, beta, scale, h0, cu_seqlens=cu_seqlens)
        B, T, H, K = q.shape
        flat = lambda t, *tail: t.reshape(B * T, H, *tail).contiguous()  # noqa: E731
        ctx.save_for_backward(flat(q, K), flat(k, K), flat(v, v.shape[-1]), flat(beta.to(q.dtype)))
        ctx.saved = saved
        ctx.shape = (B, T, H, K, v.shape[-1])
        ctx.has_h0 = h0 is not None
        ctx.g_dtype = g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dS):
        qf, kf, vf, bf = ctx.saved_tensors
        s = ctx.saved
        B, T, H, K, V = ctx.shape
        TT, N, dev, dt = B * T, s["N"], qf.device, qf.dtype
        dS = (dS if dS is not None else torch.zeros(N, H, K, V, device=dev)).float().contiguous()
        dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=dev)
        if not s["n_chunks"]:   # every sequence empty: S = h0
            z = lambda *sh: torch.zeros(*sh, dtype=dt, device=dev)  # noqa: E731
            return (z(B, T, H, K), z(B, T, H, K), z(B, T, H, V), z(B, T, H).to(ctx.g_dtype), z(B, T, H),
                    dS.clone() if ctx.has_h0 else None, None, None)
        dof = do.reshape(TT, H, V).to(dt).contiguous()
        nk = triton.cdiv(K, bwd_blocks(K, V, dev)["BK"])
        e = lambda *sh, dtype=dt: torch.empty(*sh, dtype=dtype, device=dev)  # noqa: E731
        out = dict(dv_local=e(TT, H, V), dv2=e(TT, H, V), dh=e(s["n_chunks"], H, K, V), dh0=dh0,
                   dq=e(TT, H, K), dk_qk=e(TT, H, K), dw=e(TT, H, K), dg_qk=e(nk, TT, H, dtype=torch.float32),
                   dk=e(TT, H, K, dtype=torch.float32), dv=e(TT, H, V), db=e(TT, H), dg=e(TT, H, dtype=torch.float32))
        for la in _bwd_launches(qf, kf, vf, bf, s["g_cum"], s["A"], s["w"], s["h"], s["v_new"], dof, dS, dh0,
                                s["cu"], s["idx"], s["offs"], *out.values(), n_seqs=N, n_chunks=s["n_chunks"],
                                scale=s["scale"], has_h0=ctx.has_h0, device=dev):
            la.kernel[la.grid](*la.args, **la.kwargs)
        r = lambda t, *tail: t.reshape(B, T, H, *tail)  # noqa: E731
        return (r(out["dq"], K), r(out["dk"].to(dt), K), r(out["dv"], V), r(out["dg"]).to(ctx.g_dtype),
                r(out["db"]), dh0 if ctx.has_h0 else None, None, None)


def chunked_triton_autograd(q, k, v, g, beta, scale=None, initial_state=None, *, cu_seqlens=None,
                            use_qk_l2norm: bool = False):
    """Chunked Gated DeltaNet on `tl.dot`, forward and backward (`gdn_chunk.chunked_triton`'s forward, the
    backward of this module): same arguments and results as `chunked_triton`, differentiable in q, k, v,
    g, beta and initial_state. g and beta are taken in q's dtype (as the forward does; autograd casts the
    gradients back); `use_qk_l2norm` normalizes q, k with `gdn.l2norm` before the kernels (autograd
    differentiates it)."""
    from . import gdn

    if use_qk_l2norm:
        q, k = gdn.l2norm(q), gdn.l2norm(k)
    if q.device.type == "cuda" and q.dtype == torch.float32:
        raise ValueError("chunked_triton_autograd takes bf16/fp16 on a GPU; fp32 runs only in the interpreter")
    gdn._check(q, k, v, g, beta, None)
    return _ChunkedGDN.apply(q, k, v, g.to(q.dtype), beta.to(q.dtype), initial_state,
                             None if scale is None else float(scale), cu_seqlens)


chunked_triton_autograd.supports = {"varlen", "l2norm"}
