"""FlashAttention in Triton: forward and backward, fixed-length or packed varlen, paged KV,
GQA/MQA with PackGQA, head dims up to 256 (padded and predicated), attention sinks.

Shapes (H = query heads, Hk = key/value heads, H % Hk == 0, D = head dim <= 256):

- batched:  q [B, Sq, H, D], k and v [B, Sk, Hk, D]  ->  out [B, Sq, H, D], lse [B, H, Sq]
- varlen:   q [total_q, H, D], k and v [total_k, Hk, D], cu_seqlens_q/k int32 [B+1]
            ->  out [total_q, H, D], lse [H, total_q]
- paged:    k_cache and v_cache [num_pages, page_size, Hk, D] (FlashInfer's NHD layout) with a
            CSR page table: kv_indptr int32 [B+1], kv_indices int32 [kv_indptr[-1]],
            kv_last_page_len int32 [B]; q batched or varlen as above. Forward only.

dtypes: q, k, v float16 or bfloat16 (the same); out in that dtype; lse float32 (natural log);
sinks float32 [H]. Causal masks are aligned bottom-right (FlashAttention's convention): query i
of a sequence sees key j when j <= i + Sk - Sq, so with Sq > Sk the first Sq - Sk queries see
no key at all.

The empty-sequence contract (the seed's "空 Q/K 的零梯度"):
- a query that sees no key (Sk = 0, or causal with Sq > Sk) gets out = 0 and lse = -inf
  (with sinks: out = 0, lse = its sink logit); its dQ is 0;
- an empty Q returns empty out/lse without error, and in backward every key that no query
  attends gets dK = dV = 0 — exactly 0, never NaN.

Softmax bookkeeping is in base 2 (`exp2`, with the scale folded into `qk_scale = scale*log2 e`);
lse is stored in natural log. Backward: the row sums `delta = rowsum(dO * O)` and the sink
gradient are computed with PyTorch (O(rows) reductions); the two O(Sq*Sk) passes — dK/dV and
dQ — are Triton kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import device as _device

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing: only the references work
    triton = None
    tl = None

HEAD_DIMS = (64, 96, 128, 192, 256)   # the head dims the matrix covers; any 1..256 runs
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _seq_bounds(b, seqlen_q, seqlen_k, CU_Q, CU_K, KV_INDPTR, KV_LAST, page_size,
                    VARLEN_Q: tl.constexpr, KV_MODE: tl.constexpr):
        """Where sequence b starts and how long it is, for Q and for K (KV_MODE 0 fixed,
        1 varlen, 2 paged). Paged: Sk = (pages - 1) * page_size + last_page_len."""
        if VARLEN_Q:
            q_start = tl.load(CU_Q + b)
            sq = tl.load(CU_Q + b + 1) - q_start
        else:
            q_start = b * 0
            sq = seqlen_q + b * 0
        page_start = b * 0
        if KV_MODE == 1:
            k_start = tl.load(CU_K + b)
            sk = tl.load(CU_K + b + 1) - k_start
        elif KV_MODE == 2:
            k_start = b * 0
            page_start = tl.load(KV_INDPTR + b)
            n_pages = tl.load(KV_INDPTR + b + 1) - page_start
            last = tl.load(KV_LAST + b)
            sk = tl.where(n_pages > 0, (n_pages - 1) * page_size + last, 0)
        else:
            k_start = b * 0
            sk = seqlen_k + b * 0
        return q_start, sq, k_start, sk, page_start

    @triton.jit
    def _kv_rows(offs_n, n_ok, b, k_start, page_start, KV_INDICES, page_size, KV_MODE: tl.constexpr):
        """(outer, inner) row indices of keys offs_n: (batch, position) or (physical page, slot).
        The page lookup is the only difference between contiguous and paged KV."""
        if KV_MODE == 2:
            page = offs_n // page_size
            outer = tl.load(KV_INDICES + page_start + page, mask=n_ok, other=0).to(tl.int64)
            inner = (offs_n % page_size).to(tl.int64)
        else:
            outer = (b + offs_n * 0).to(tl.int64)
            inner = (k_start + offs_n).to(tl.int64)
        return outer, inner

    @triton.jit
    def _fwd_tiles(acc, l_i, m_i, q, K, V, lo, hi, offs_m, offs_d, d_ok, sq, sk, b, k_start, page_start, KV_INDICES,
                   page_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                   head_k, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, KV_MODE: tl.constexpr,
                   DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr):
        """The online softmax over key tiles [lo, hi). MASKED=False is the bulk of a long row — tiles
        wholly inside the sequence and below the causal diagonal — with no mask on loads or scores;
        MASKED=True takes the ragged tail and the diagonal."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            kb, ks = _kv_rows(offs_n, n_ok, b, k_start, page_start, KV_INDICES, page_size, KV_MODE)
            k_ptr = K + (kb * stride_kb + ks * stride_ks + head_k * stride_kh)[None, :] + offs_d[:, None] * stride_kd
            v_ptr = V + (kb * stride_vb + ks * stride_vs + head_k * stride_vh)[:, None] + offs_d[None, :] * stride_vd
            if MASKED:
                kt = tl.load(k_ptr, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            elif EVEN_D:  # head dim == tile width: plain, vectorisable loads
                kt = tl.load(k_ptr)
            else:
                kt = tl.load(k_ptr, mask=d_ok[:, None], other=0.0)
            if DOT_FP32:  # interpreter only: its bf16 tl.dot is wrong
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt) * qk_scale
            if MASKED:
                valid = n_ok[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + (sk - sq))
                s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen only masked keys keeps m = -inf; subtracting 0 instead of
            # -inf keeps exp2 at 0 rather than exp2(-inf - -inf) = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptr, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            elif EVEN_D:
                v = tl.load(v_ptr)
            else:
                v = tl.load(v_ptr, mask=d_ok[None, :], other=0.0)
            p_lo = p.to(V.dtype.element_ty)  # P is rounded to the input dtype, as on tensor cores
            if DOT_FP32:
                v = v.to(tl.float32)
                p_lo = p_lo.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_lo, v)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd_kernel(
        Q, K, V, O, LSE, SINKS, CU_Q, CU_K, KV_INDPTR, KV_INDICES, KV_LAST,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_ob, stride_os, stride_oh,
        stride_lh,
        seqlen_q, seqlen_k, head_dim, group, qk_scale, page_size,
        CAUSAL: tl.constexpr, VARLEN_Q: tl.constexpr, KV_MODE: tl.constexpr, PACK_GQA: tl.constexpr,
        HAS_SINKS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    ):
        # grid: (row blocks, batch, heads). With PACK_GQA the heads axis runs over KV heads and
        # the M rows of a tile are (query position, query head of the group) pairs, so one K/V
        # tile is loaded once for all `group` query heads that share it.
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        q_start, sq, k_start, sk, page_start = _seq_bounds(
            b, seqlen_q, seqlen_k, CU_Q, CU_K, KV_INDPTR, KV_LAST, page_size, VARLEN_Q, KV_MODE)
        offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if PACK_GQA:
            rows = sq * group
            offs_m = offs_r // group
            head_q = h * group + offs_r % group
            head_k = h
        else:
            rows = sq
            offs_m = offs_r
            head_q = h + offs_r * 0
            head_k = h // group
        if pid_m * BLOCK_M >= rows:  # this sequence is shorter than the longest one
            return
        r_ok = offs_r < rows
        # head dims that are not powers of two (96, 192) are padded to BLOCK_D: the padded
        # lanes are predicated off on every load and store (PackGQA's padded-head predication)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim

        q_row = (b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs
                 + head_q.to(tl.int64) * stride_qh)
        q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd,
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:  # interpreter only: its bf16 tl.dot is wrong
            q = q.to(tl.float32)

        if HAS_SINKS:  # the sink is one more logit in the denominator, with no value vector
            m_i = tl.load(SINKS + head_q, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        hi = sk
        # tiles below `hi_full` are entirely valid for every row of this tile: no mask at all
        hi_full = (sk // BLOCK_N) * BLOCK_N
        if CAUSAL:  # keys past the last row's diagonal are never loaded
            first_r = pid_m * BLOCK_M
            last_r = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, rows - 1)
            if PACK_GQA:
                first_r = first_r // group
                last_r = last_r // group
            hi = tl.minimum(sk, tl.maximum(last_r + 1 + sk - sq, 0))
            hi_full = tl.minimum(hi_full, (tl.maximum(first_r + 1 + sk - sq, 0) // BLOCK_N) * BLOCK_N)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, K, V, 0, hi_full, offs_m, offs_d, d_ok, sq, sk, b, k_start, page_start, KV_INDICES,
            page_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            head_k, qk_scale, False, CAUSAL, KV_MODE, DOT_FP32, BLOCK_N, EVEN_D)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, K, V, hi_full, hi, offs_m, offs_d, d_ok, sq, sk, b, k_start, page_start, KV_INDICES,
            page_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            head_k, qk_scale, True, CAUSAL, KV_MODE, DOT_FP32, BLOCK_N, EVEN_D)

        # no key and no sink: l = 0 -> out 0, lse -inf (the empty-K contract)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        o_row = (b.to(tl.int64) * stride_ob + (q_start + offs_m).to(tl.int64) * stride_os
                 + head_q.to(tl.int64) * stride_oh)
        tl.store(O + o_row[:, None] + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])
        if VARLEN_Q:
            l_row = q_start + offs_m
        else:
            l_row = b * seqlen_q + offs_m
        tl.store(LSE + head_q.to(tl.int64) * stride_lh + l_row, lse, mask=r_ok)

    @triton.jit
    def _attn_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_dob, stride_dos, stride_doh, stride_dod,
        stride_gb, stride_gs, stride_gh,
        stride_lh,
        seqlen_q, seqlen_k, head_dim, group, qk_scale, sm_scale,
        CAUSAL: tl.constexpr, VARLEN: tl.constexpr, KV_MODE: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # grid: (key blocks, batch, KV heads). One program owns a K/V tile and sums dK, dV over
        # every query block of every query head in its group: no atomics, GQA reduced in registers.
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
        hk = tl.program_id(2)
        q_start, sq, k_start, sk, page_start = _seq_bounds(
            b, seqlen_q, seqlen_k, CU_Q, CU_K, CU_Q, CU_Q, 1, VARLEN, KV_MODE)
        if pid_n * BLOCK_N >= sk:
            return
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < sk
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        nd_ok = n_ok[:, None] & d_ok[None, :]
        k_row = b.to(tl.int64) * stride_kb + (k_start + offs_n).to(tl.int64) * stride_ks + hk * stride_kh
        v_row = b.to(tl.int64) * stride_vb + (k_start + offs_n).to(tl.int64) * stride_vs + hk * stride_vh
        k = tl.load(K + k_row[:, None] + offs_d[None, :] * stride_kd, mask=nd_ok, other=0.0)
        v = tl.load(V + v_row[:, None] + offs_d[None, :] * stride_vd, mask=nd_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

        lo = 0
        if CAUSAL:  # queries above this tile's diagonal never see its keys
            lo = tl.maximum(pid_n * BLOCK_N - (sk - sq), 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        # a key no query attends (empty Q) runs no iteration: dK = dV = 0 exactly
        for g in range(0, group):
            hq = hk * group + g
            for start_m in range(lo, sq, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                m_ok = offs_m < sq
                md_ok = m_ok[:, None] & d_ok[None, :]
                q_row = (b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs
                         + hq * stride_qh)
                do_row = (b.to(tl.int64) * stride_dob + (q_start + offs_m).to(tl.int64) * stride_dos
                          + hq * stride_doh)
                q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd, mask=md_ok, other=0.0)
                do = tl.load(DO + do_row[:, None] + offs_d[None, :] * stride_dod, mask=md_ok, other=0.0)
                if VARLEN:
                    l_row = q_start + offs_m
                else:
                    l_row = b * seqlen_q + offs_m
                lse = tl.load(LSE + hq.to(tl.int64) * stride_lh + l_row, mask=m_ok, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + hq.to(tl.int64) * stride_lh + l_row, mask=m_ok, other=0.0)
                # lse = -inf marks a query with no key; all its scores are masked, so any
                # finite stand-in gives p = 0 (and no NaN)
                lse = tl.where(lse == float("-inf"), 0.0, lse)
                if DOT_FP32:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                s = tl.dot(q, tl.trans(k)) * qk_scale
                valid = m_ok[:, None] & n_ok[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + (sk - sq))
                s = tl.where(valid, s, float("-inf"))
                p = tl.exp2(s - lse[:, None])
                p_lo = p.to(Q.dtype.element_ty)
                if DOT_FP32:
                    p_lo = p_lo.to(tl.float32)
                dv += tl.dot(tl.trans(p_lo), do)
                dp = tl.dot(do, tl.trans(v))
                ds = p * (dp - delta[:, None])
                ds_lo = ds.to(Q.dtype.element_ty)
                if DOT_FP32:
                    ds_lo = ds_lo.to(tl.float32)
                dk += tl.dot(tl.trans(ds_lo), q)
        dk = dk * sm_scale
        g_row = b.to(tl.int64) * stride_gb + (k_start + offs_n).to(tl.int64) * stride_gs + hk * stride_gh
        tl.store(DK + g_row[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=nd_ok)
        tl.store(DV + g_row[:, None] + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=nd_ok)

    @triton.jit
    def _attn_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_dob, stride_dos, stride_doh, stride_dod,
        stride_gb, stride_gs, stride_gh,
        stride_lh,
        seqlen_q, seqlen_k, head_dim, group, qk_scale, sm_scale,
        CAUSAL: tl.constexpr, VARLEN: tl.constexpr, KV_MODE: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # grid: (query blocks, batch, query heads); recomputes P from lse, as the forward left it
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        hq = tl.program_id(2)
        hk = hq // group
        q_start, sq, k_start, sk, page_start = _seq_bounds(
            b, seqlen_q, seqlen_k, CU_Q, CU_K, CU_Q, CU_Q, 1, VARLEN, KV_MODE)
        if pid_m * BLOCK_M >= sq:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < sq
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        md_ok = m_ok[:, None] & d_ok[None, :]
        q_row = b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs + hq * stride_qh
        do_row = b.to(tl.int64) * stride_dob + (q_start + offs_m).to(tl.int64) * stride_dos + hq * stride_doh
        q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd, mask=md_ok, other=0.0)
        do = tl.load(DO + do_row[:, None] + offs_d[None, :] * stride_dod, mask=md_ok, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        if VARLEN:
            l_row = q_start + offs_m
        else:
            l_row = b * seqlen_q + offs_m
        lse = tl.load(LSE + hq.to(tl.int64) * stride_lh + l_row, mask=m_ok, other=0.0) * 1.4426950408889634
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(DELTA + hq.to(tl.int64) * stride_lh + l_row, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = sk
        if CAUSAL:
            last_m = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, sq - 1)
            hi = tl.minimum(sk, tl.maximum(last_m + 1 + sk - sq, 0))
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            nd_ok = n_ok[:, None] & d_ok[None, :]
            k_row = b.to(tl.int64) * stride_kb + (k_start + offs_n).to(tl.int64) * stride_ks + hk * stride_kh
            v_row = b.to(tl.int64) * stride_vb + (k_start + offs_n).to(tl.int64) * stride_vs + hk * stride_vh
            k = tl.load(K + k_row[:, None] + offs_d[None, :] * stride_kd, mask=nd_ok, other=0.0)
            v = tl.load(V + v_row[:, None] + offs_d[None, :] * stride_vd, mask=nd_ok, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            valid = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + (sk - sq))
            s = tl.where(valid, s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            ds_lo = ds.to(Q.dtype.element_ty)
            if DOT_FP32:
                ds_lo = ds_lo.to(tl.float32)
            dq += tl.dot(ds_lo, k)
        dq = dq * sm_scale
        g_row = b.to(tl.int64) * stride_gb + (q_start + offs_m).to(tl.int64) * stride_gs + hq * stride_gh
        tl.store(DQ + g_row[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=md_ok)


# ---------------------------------------------------------------------------
# Launch configuration

def block_config(device: torch.device, head_dim: int, kind: str) -> dict:
    """Tile sizes and warps per kernel. Fixed, not autotuned (autotuning would add minutes of
    compilation per head dim and mask combination to every run of the matrix).

    GPU: 128x64 forward tiles up to D=128; D=192/256 pad to 256 and halve the tiles to keep the
    fp32 accumulators in registers. Interpreter: 64x64 — each interpreted op costs far more than
    its arithmetic, so fewer, larger tiles run fastest (measured: 32x32 is ~4x slower on the smoke
    matrix); the 113x203 shape still spans several tiles with ragged tails.
    """
    block_d = max(16, triton.next_power_of_2(head_dim)) if triton is not None else head_dim
    if device.type != "cuda":
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=1)
    if kind == "fwd":
        if block_d <= 64:
            return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=3)
        if block_d <= 128:
            return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=2)
    if kind == "dkdv":
        if block_d <= 128:
            return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=2)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=1)
    if block_d <= 128:  # dq
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=16, BLOCK_D=block_d, num_warps=8, num_stages=1)


def select_backend(device: torch.device) -> tuple[str, str]:
    """('triton', how) when a Triton kernel can run on this device's tensors, else ('torch', why)."""
    ok, reason = _device.triton_backend_for(device)
    return ("triton", reason) if ok else ("torch", f"PyTorch reference: {reason}")


# ---------------------------------------------------------------------------
# Input checks: a clear ValueError before any work

def _fail(msg: str):
    raise ValueError(msg)


def _check_cu(name: str, cu, total: int, device) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        _fail(f"{name} must be a 1-D int32 tensor of batch+1 offsets, got "
              f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__}"
              f"{list(cu.shape) if isinstance(cu, torch.Tensor) else ''}")
    if cu.device != device:
        _fail(f"{name} is on {cu.device}, q is on {device}; put them on the same device")
    vals = cu.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != total:
        _fail(f"{name} must start at 0, never decrease and end at the packed length {total}; got {vals[:8]}"
              f"{'...' if len(vals) > 8 else ''} (last {vals[-1]})")
    return vals


def _check_qkv(q, k, v, *, varlen: bool, paged: bool):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            _fail(f"{name} has dtype {t.dtype}; allowed: torch.float16 or torch.bfloat16")
        if t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            _fail(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype")
    want_q = 3 if varlen else 4
    if q.dim() != want_q:
        _fail(f"q must be {'[total_q, H, D] (varlen)' if varlen else '[B, Sq, H, D]'}, got shape {list(q.shape)}")
    if paged:
        if k.dim() != 4:
            _fail(f"k_cache must be [num_pages, page_size, Hk, D] (NHD), got shape {list(k.shape)}")
    elif k.dim() != want_q:
        _fail(f"k must be {'[total_k, Hk, D] (varlen)' if varlen else '[B, Sk, Hk, D]'}, got shape {list(k.shape)}")
    if k.shape != v.shape:
        _fail(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    D, H, Hk = q.shape[-1], q.shape[-2], k.shape[-2]
    if not 1 <= D <= MAX_HEAD_DIM:
        _fail(f"head dim {D} is not supported; allowed: 1..{MAX_HEAD_DIM} (the matrix covers {HEAD_DIMS})")
    if k.shape[-1] != D:
        _fail(f"k has head dim {k.shape[-1]} but q has {D}")
    if Hk < 1 or H % Hk:
        _fail(f"q has {H} heads, k/v {Hk}: the query heads must be a multiple of the KV heads (GQA/MQA)")
    if not varlen and not paged and q.shape[0] != k.shape[0]:
        _fail(f"q has batch {q.shape[0]} but k has {k.shape[0]}")


def _check_scale_sinks(softmax_scale, sinks, H, device):
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not math.isfinite(softmax_scale) or softmax_scale <= 0:
            _fail(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or sinks.dtype != torch.float32:
            _fail(f"sinks must be a float32 tensor of shape [{H}] (one logit per query head), got "
                  f"{sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__} "
                  f"{list(sinks.shape) if isinstance(sinks, torch.Tensor) else ''}")
        if sinks.device != device:
            _fail(f"sinks is on {sinks.device} but q is on {device}")


# ---------------------------------------------------------------------------
# Launchers

@dataclass
class _Meta:
    causal: bool
    scale: float
    varlen: bool
    batch: int
    seqlen_q: int        # fixed layout only (0 for varlen)
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    pack_gqa: bool
    rows: int            # total query rows (B*Sq or total_q)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """A 0-element tensor may have a null data pointer, which a GPU launch rejects; the kernels
    never read it (every length is 0), so a one-element stand-in is passed instead."""
    return t if t.numel() else t.new_zeros(1)


def _strides4(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; varlen tensors have no batch axis (stride 0)."""
    return (0, *t.stride()) if varlen else tuple(t.stride())


def _forward_launch(q, k, v, sinks, meta: _Meta, out, lse, *, kv_mode: int, page_table, page_size: int,
                    device: torch.device):
    """The forward kernel's launch (a `compiled.Launch`) for these tensors, or None when nothing is
    launched. `device` picks the config (`block_config`); the tensors may be `meta` tensors."""
    from ..compiled import Launch

    H, D = q.shape[-2], q.shape[-1]
    Hk = k.shape[-2]
    group = H // Hk
    cfg = block_config(device, D, "fwd")
    pack = meta.pack_gqa and group > 1
    rows_per_seq = meta.max_seqlen_q * (group if pack else 1)
    grid = (triton.cdiv(rows_per_seq, cfg["BLOCK_M"]), meta.batch, Hk if pack else H)
    if rows_per_seq == 0 or meta.batch == 0 or meta.rows == 0:
        return None
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    indptr, indices, last = page_table if page_table is not None else (dummy, dummy, dummy)
    sq_ = _strides4(q, meta.varlen)
    if kv_mode == 2:
        sk_, sv_ = tuple(k.stride()), tuple(v.stride())
    else:
        sk_, sv_ = _strides4(k, meta.varlen), _strides4(v, meta.varlen)
    so = _strides4(out, meta.varlen)
    args = [q, _nonempty(k), _nonempty(v), out, lse, sinks if sinks is not None else lse,
            meta.cu_q if meta.cu_q is not None else dummy, meta.cu_k if meta.cu_k is not None else dummy,
            indptr, _nonempty(indices), last,
            *sq_, *sk_, *sv_, so[0], so[1], so[2], lse.stride(0),
            meta.seqlen_q, meta.seqlen_k, D, group, meta.scale * LOG2E, page_size]
    kwargs = dict(CAUSAL=meta.causal, VARLEN_Q=meta.varlen, KV_MODE=kv_mode, PACK_GQA=pack,
                  HAS_SINKS=sinks is not None, DOT_FP32=_device.dot_needs_fp32(device),
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], EVEN_D=cfg["BLOCK_D"] == D,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return Launch("fwd", _attn_fwd_kernel, args, kwargs, "attention/flash.py:_forward", grid)


def _forward(q, k, v, sinks, meta: _Meta, *, kv_mode: int = 0, page_table=None, page_size: int = 1):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[-2], meta.rows), dtype=torch.float32, device=q.device)
    launch = _forward_launch(q, k, v, sinks, meta, out, lse, kv_mode=kv_mode, page_table=page_table,
                             page_size=page_size, device=q.device)
    if launch is not None:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return out, lse


def _backward_launches(dout, q, k, v, lse, delta, dq, dk, dv, meta: _Meta, *, device: torch.device) -> list:
    """The dK/dV and dQ kernels' launches (`compiled.Launch`) for these tensors (may be `meta`)."""
    from ..compiled import Launch

    H, D = q.shape[-2], q.shape[-1]
    Hk = k.shape[-2]
    group = H // Hk
    if meta.rows == 0 or k.numel() == 0 or meta.batch == 0:
        return []
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = meta.cu_q if meta.cu_q is not None else dummy
    cu_k = meta.cu_k if meta.cu_k is not None else dummy
    common = (*_strides4(q, meta.varlen), *_strides4(k, meta.varlen), *_strides4(v, meta.varlen),
              *_strides4(dout, meta.varlen))
    dot_fp32 = _device.dot_needs_fp32(device)
    launches = []
    cfg = block_config(device, D, "dkdv")
    gk = _strides4(dk, meta.varlen)
    grid = (triton.cdiv(meta.max_seqlen_k, cfg["BLOCK_N"]), meta.batch, Hk)
    if grid[0] > 0:
        launches.append(Launch("bwd dkdv", _attn_bwd_dkdv_kernel, [
            _nonempty(q), k, v, _nonempty(dout), _nonempty(lse), _nonempty(delta), dk, dv, cu_q, cu_k,
            *common, gk[0], gk[1], gk[2], lse.stride(0),
            meta.seqlen_q, meta.seqlen_k, D, group, meta.scale * LOG2E, meta.scale],
            dict(CAUSAL=meta.causal, VARLEN=meta.varlen, KV_MODE=1 if meta.varlen else 0, DOT_FP32=dot_fp32,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), "attention/flash.py:_backward", grid))
    cfg = block_config(device, D, "dq")
    gq = _strides4(dq, meta.varlen)
    grid = (triton.cdiv(meta.max_seqlen_q, cfg["BLOCK_M"]), meta.batch, H)
    if grid[0] > 0:
        launches.append(Launch("bwd dq", _attn_bwd_dq_kernel, [
            q, k, v, dout, lse, delta, dq, cu_q, cu_k,
            *common, gq[0], gq[1], gq[2], lse.stride(0),
            meta.seqlen_q, meta.seqlen_k, D, group, meta.scale * LOG2E, meta.scale],
            dict(CAUSAL=meta.causal, VARLEN=meta.varlen, KV_MODE=1 if meta.varlen else 0, DOT_FP32=dot_fp32,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), "attention/flash.py:_backward", grid))
    return launches


def _backward(dout, q, k, v, out, lse, sinks, meta: _Meta):
    H = q.shape[-2]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: one O(rows * D) reduction, left to PyTorch
    delta = (dout.float() * out.float()).sum(-1).reshape(meta.rows, H).t().contiguous()
    dsinks = None
    if sinks is not None:
        # the sink logit has no value vector: dL/dsink_h = -sum_i exp(sink_h - lse_i) * delta_i
        dsinks = -(torch.exp(sinks[:, None] - lse) * delta).sum(1)
    for launch in _backward_launches(dout, q, k, v, lse, delta, dq, dk, dv, meta, device=q.device):
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return dq, dk, dv, dsinks


def attention_launches(q, k, v, *, causal: bool = False, seqlens_q: list[int] | None = None,
                       seqlens_k: list[int] | None = None, sinks: bool = False, pack_gqa: bool = True,
                       backward: bool = False, paged: bool = False, device: torch.device | None = None,
                       name: str = "") -> list:
    """The launches `attention` / `paged_attention` (and, with `backward`, autograd's backward) make
    for q, k, v of these shapes, strides and dtype, without running them (`compiled.Launch` list).

    q, k, v: tensors or `compiled.meta(...)` stand-ins in the layouts `attention` takes; with
    `paged`, k and v are the caches [num_pages, page_size, Hk, D]. `seqlens_q`/`seqlens_k`: the
    varlen sequence lengths (varlen when given; `seqlens_k` also gives the paged lengths).
    `device`: whose config (default: a CUDA device's)."""
    dev = device or torch.device("cuda")
    H = q.shape[-2]
    varlen = seqlens_q is not None
    i32 = dict(dtype=torch.int32, device=q.device)
    if varlen:
        B = len(seqlens_q)
        rows = q.shape[0]
        cu_q = torch.empty(B + 1, **i32)
        cu_k = torch.empty(B + 1, **i32) if not paged else None
        lk = max(seqlens_k, default=0) if seqlens_k is not None else 0
        meta = _Meta(causal, 1.0 / math.sqrt(q.shape[-1]), True, B, 0, 0, max(seqlens_q, default=0), lk,
                     cu_q, cu_k, pack_gqa, rows)
    else:
        B, Sq = q.shape[0], q.shape[1]
        Sk = 0 if paged else k.shape[1]
        lk = max(seqlens_k, default=0) if paged and seqlens_k is not None else Sk
        meta = _Meta(causal, 1.0 / math.sqrt(q.shape[-1]), False, B, Sq, Sk, Sq, lk, None, None, pack_gqa, B * Sq)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((H, meta.rows), dtype=torch.float32, device=q.device)
    sk_t = torch.empty(H, dtype=torch.float32, device=q.device) if sinks else None
    page_table = None
    page_size = 1
    if paged:
        page_size = k.shape[1]
        page_table = (torch.empty(B + 1, **i32), torch.empty(max(k.shape[0], 1), **i32), torch.empty(max(B, 1), **i32))
    launches = []
    fwd = _forward_launch(q, k, v, sk_t, meta, out, lse, kv_mode=2 if paged else (1 if varlen else 0),
                          page_table=page_table, page_size=page_size, device=dev)
    if fwd is not None:
        launches.append(fwd)
    if backward and not paged:
        delta = torch.empty((H, meta.rows), dtype=torch.float32, device=q.device)
        launches += _backward_launches(torch.empty(q.shape, dtype=q.dtype, device=q.device), q, k, v, lse, delta,
                                       torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                       torch.empty(k.shape, dtype=k.dtype, device=k.device),
                                       torch.empty(v.shape, dtype=v.dtype, device=v.device), meta, device=dev)
    for la in launches:
        la.name = f"{name} {la.name}".strip() if name else la.name
    return launches


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, meta):
        out, lse = _forward(q, k, v, sinks, meta, kv_mode=1 if meta.varlen else 0)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.meta = meta
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, sinks, ctx.meta)
        return dq, dk, dv, dsinks, None


def _lse_view(lse: torch.Tensor, meta: _Meta) -> torch.Tensor:
    """Internal [H, rows] -> [B, H, Sq] (batched, a view) or [H, total_q] (varlen)."""
    if meta.varlen:
        return lse
    return lse.view(lse.shape[0], meta.batch, meta.seqlen_q).transpose(0, 1)


def _meta_for(q, k, *, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              pack_gqa) -> _Meta:
    if not isinstance(causal, bool):
        _fail(f"causal must be True or False, got {causal!r}")
    if not isinstance(pack_gqa, bool):
        _fail(f"pack_gqa must be True or False, got {pack_gqa!r}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_qkv(q, k, k, varlen=varlen, paged=False)
    _check_scale_sinks(softmax_scale, None, q.shape[-2], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            _fail("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        cq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        ck = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        if len(cq) != len(ck):
            _fail(f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}")
        lq = max(b - a for a, b in zip(cq, cq[1:]))
        lk = max(b - a for a, b in zip(ck, ck[1:]))
        for name, given, actual in (("max_seqlen_q", max_seqlen_q, lq), ("max_seqlen_k", max_seqlen_k, lk)):
            if given is not None and (not isinstance(given, int) or given < actual):
                _fail(f"{name}={given!r} is smaller than the longest sequence ({actual}) or not an int")
        return _Meta(causal, scale, True, len(cq) - 1, 0, 0, lq, lk, cu_seqlens_q.contiguous(),
                     cu_seqlens_k.contiguous(), pack_gqa, q.shape[0])
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    return _Meta(causal, scale, False, B, Sq, Sk, Sq, Sk, None, None, pack_gqa, B * Sq)


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, return_lse: bool = False, *, sinks=None,
              pack_gqa: bool = True, backend: str = "auto"):
    """FlashAttention forward (and, through autograd, backward) with the Triton kernels.

    q [B, Sq, H, D] with k, v [B, Sk, Hk, D]; or packed varlen q [total_q, H, D], k, v
    [total_k, Hk, D] with int32 `cu_seqlens_q`/`cu_seqlens_k` [B+1]. float16 or bfloat16.
    `sinks`: optional float32 [H] sink logits (learnable: they get a gradient).
    `pack_gqa`: fold the query heads of a KV head into the tile's M rows (forward).
    `backend`: 'auto' (Triton where it can run, else the PyTorch reference), 'triton', 'torch'.
    Returns out (same layout and dtype as q), and lse (float32; [B, H, Sq] or [H, total_q])
    when `return_lse`. Non-contiguous inputs are read through their strides, not copied.
    """
    if backend not in ("auto", "triton", "torch"):
        _fail(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    meta = _meta_for(q, k, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     pack_gqa=pack_gqa)
    _check_qkv(q, k, v, varlen=meta.varlen, paged=False)
    _check_scale_sinks(softmax_scale, sinks, q.shape[-2], q.device)
    chosen = backend
    if backend == "auto":
        chosen = select_backend(q.device)[0]
    elif backend == "triton":
        ok, why = _device.triton_backend_for(q.device)
        if not ok:
            _fail(f"backend='triton' cannot run here: {why}")
    if chosen == "torch":
        out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=meta.scale,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    out, lse = _FlashAttention.apply(q, k, v, sinks.contiguous() if sinks is not None else None, meta)
    lse = _lse_view(lse, meta)
    return (out, lse) if return_lse else out


def paged_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal: bool = False,
                    softmax_scale: float | None = None, cu_seqlens_q=None, max_seqlen_q: int | None = None,
                    return_lse: bool = False, *, sinks=None, pack_gqa: bool = True):
    """Forward attention over a paged KV cache with a FlashInfer-style CSR page table.

    k_cache, v_cache [num_pages, page_size, Hk, D] (NHD). Sequence b owns the pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] in order, the last one filled to
    kv_last_page_len[b] slots (1..page_size; 0 allowed only for a sequence with no page).
    q [B, Sq, H, D], or varlen [total_q, H, D] with `cu_seqlens_q`. Forward only: inputs that
    require grad with grad mode on are refused (serving paths do not differentiate).
    """
    if not isinstance(causal, bool):
        _fail(f"causal must be True or False, got {causal!r}")
    if not isinstance(pack_gqa, bool):
        _fail(f"pack_gqa must be True or False, got {pack_gqa!r}")
    varlen = cu_seqlens_q is not None
    _check_qkv(q, k_cache, v_cache, varlen=varlen, paged=True)
    _check_scale_sinks(softmax_scale, sinks, q.shape[-2], q.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, sinks)):
        _fail("paged_attention is forward-only (no backward through a page table); "
              "call it under torch.no_grad() or pass tensors that do not require grad")
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if page_size < 1:
        _fail(f"page_size must be >= 1, got {page_size}")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            _fail(f"{name} must be a 1-D int32 tensor, got "
                  f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != q.device:
            _fail(f"{name} is on {t.device} but q is on {q.device}")
    indptr = kv_indptr.tolist()
    B = len(indptr) - 1
    if B < 0 or indptr[0] != 0 or any(b < a for a, b in zip(indptr, indptr[1:])) or indptr[-1] != kv_indices.numel():
        _fail(f"kv_indptr must start at 0, never decrease and end at len(kv_indices)={kv_indices.numel()}; got {indptr[:8]}")
    if kv_last_page_len.numel() != B:
        _fail(f"kv_last_page_len has {kv_last_page_len.numel()} entries for {B} sequences")
    idx = kv_indices.tolist()
    if idx and (min(idx) < 0 or max(idx) >= num_pages):
        _fail(f"kv_indices must lie in [0, {num_pages}) (pages in the cache), got range [{min(idx)}, {max(idx)}]")
    lasts = kv_last_page_len.tolist()
    seqlens_k = []
    for b in range(B):
        n = indptr[b + 1] - indptr[b]
        lo = 1 if n else 0
        if not lo <= lasts[b] <= (page_size if n else 0):
            _fail(f"kv_last_page_len[{b}]={lasts[b]} must be in 1..{page_size} for a sequence with pages "
                  f"(0 for one with none); sequence {b} has {n} page(s)")
        seqlens_k.append((n - 1) * page_size + lasts[b] if n else 0)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if varlen:
        cq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        if len(cq) - 1 != B:
            _fail(f"cu_seqlens_q has {len(cq) - 1} sequences but the page table has {B}")
        lq = max(b - a for a, b in zip(cq, cq[1:]))
        if max_seqlen_q is not None and (not isinstance(max_seqlen_q, int) or max_seqlen_q < lq):
            _fail(f"max_seqlen_q={max_seqlen_q!r} is smaller than the longest sequence ({lq}) or not an int")
        meta = _Meta(causal, scale, True, B, 0, 0, lq, max(seqlens_k, default=0), cu_seqlens_q.contiguous(), None,
                     pack_gqa, q.shape[0])
    else:
        if q.shape[0] != B:
            _fail(f"q has batch {q.shape[0]} but the page table has {B} sequences")
        meta = _Meta(causal, scale, False, B, q.shape[1], 0, q.shape[1], max(seqlens_k, default=0), None, None,
                     pack_gqa, B * q.shape[1])
    ok, why = _device.triton_backend_for(q.device)
    if not ok:
        k, v, cu_k = gather_paged_kv(k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len)
        qv = q if varlen else q.reshape(-1, *q.shape[2:])
        cq = cu_seqlens_q if varlen else torch.arange(B + 1, device=q.device, dtype=torch.int32) * q.shape[1]
        out, lse = attention_reference(qv, k, v, causal=causal, softmax_scale=scale, cu_seqlens_q=cq,
                                       cu_seqlens_k=cu_k, sinks=sinks)
        out = out.to(q.dtype).reshape(q.shape)
        return (out, lse if varlen else lse.view(-1, B, q.shape[1]).transpose(0, 1)) if return_lse else out
    out, lse = _forward(q, k_cache, v_cache, sinks.contiguous() if sinks is not None else None, meta, kv_mode=2,
                        page_table=(kv_indptr.contiguous(), kv_indices.contiguous(), kv_last_page_len.contiguous()),
                        page_size=page_size)
    lse = _lse_view(lse, meta)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# Paged KV helpers (FlashInfer's CSR page table)

@dataclass
class PagedKV:
    k_cache: torch.Tensor        # [num_pages, page_size, Hk, D]
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor      # int32 [B+1]
    kv_indices: torch.Tensor     # int32 [nnz_pages]
    kv_last_page_len: torch.Tensor  # int32 [B]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]


def paged_from_contiguous(k, v, cu_seqlens_k, page_size: int, *, generator: torch.Generator | None = None,
                          spare_pages: int = 2, fill: float = float("nan")) -> PagedKV:
    """Copy packed K/V [total_k, Hk, D] into a page pool whose pages are scattered at random
    (so a wrong page lookup shows), unused slots and spare pages filled with `fill` (NaN: a
    kernel that reads past a sequence's last slot produces NaN and fails its check)."""
    if not isinstance(page_size, int) or page_size < 1:
        _fail(f"page_size must be a positive int, got {page_size!r}")
    lens = [b - a for a, b in zip(cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])]
    n_pages = [-(-n // page_size) for n in lens]
    total_pages = sum(n_pages) + spare_pages
    Hk, D = k.shape[-2], k.shape[-1]
    kc = torch.full((total_pages, page_size, Hk, D), fill, dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, fill)
    perm = torch.randperm(total_pages, generator=generator).tolist()
    indices, indptr, last = [], [0], []
    starts = cu_seqlens_k.tolist()
    for b, n in enumerate(lens):
        for p in range(n_pages[b]):
            phys = perm[len(indices)]
            lo, hi = starts[b] + p * page_size, min(starts[b] + (p + 1) * page_size, starts[b] + n)
            kc[phys, : hi - lo] = k[lo:hi]
            vc[phys, : hi - lo] = v[lo:hi]
            indices.append(phys)
        indptr.append(len(indices))
        last.append(n - (n_pages[b] - 1) * page_size if n else 0)
    i32 = dict(dtype=torch.int32, device=k.device)
    return PagedKV(kc, vc, torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32))


def gather_paged_kv(k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len):
    """The inverse: packed k, v [total_k, Hk, D] and cu_seqlens_k from a page table (torch)."""
    page_size = k_cache.shape[1]
    ks, vs, cu = [], [], [0]
    indptr, idx, last = kv_indptr.tolist(), kv_indices.tolist(), kv_last_page_len.tolist()
    for b in range(len(indptr) - 1):
        pages = idx[indptr[b]:indptr[b + 1]]
        n = (len(pages) - 1) * page_size + last[b] if pages else 0
        if pages:
            sel = torch.tensor(pages, device=k_cache.device, dtype=torch.long)
            ks.append(k_cache[sel].flatten(0, 1)[:n])
            vs.append(v_cache[sel].flatten(0, 1)[:n])
        cu.append(cu[-1] + n)
    Hk, D = k_cache.shape[2], k_cache.shape[3]
    k = torch.cat(ks) if ks else k_cache.new_zeros((0, Hk, D))
    v = torch.cat(vs) if vs else v_cache.new_zeros((0, Hk, D))
    return k, v, torch.tensor(cu, dtype=torch.int32, device=k_cache.device)


# ---------------------------------------------------------------------------
# PyTorch references

def _reference_one(q, k, v, causal: bool, scale: float, sinks, upcast: bool):
    """One sequence: q [Sq, H, D], k/v [Sk, Hk, D] -> out [Sq, H, D], lse [H, Sq] (float32).

    upcast=True: everything in float32 (the "truth"). upcast=False: the matmuls in the input
    dtype, softmax in float32, P rounded to the input dtype — PyTorch's own error in that
    precision, which sets the matrix's tolerance (FlashAttention's rule).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    Sq, H, _ = q.shape
    Sk, Hk, _ = k.shape
    k = k.repeat_interleave(H // Hk, dim=1)
    v = v.repeat_interleave(H // Hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q * scale, k).float()
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (Sk - Sq), float("-inf"))
    full = scores
    if sinks is not None:
        full = torch.cat([scores, sinks.float()[:, None, None].expand(H, Sq, 1)], dim=-1)
    # a row with no finite logit: lse = -inf, P = 0, and no NaN in the gradient either
    empty = ~torch.isfinite(full).any(-1) if full.shape[-1] else torch.ones(H, Sq, dtype=torch.bool, device=q.device)
    lse_f = torch.logsumexp(full.masked_fill(empty[..., None], 0.0), dim=-1)
    if full.shape[-1] == 0:
        lse_f = torch.zeros(H, Sq, device=q.device)
    p = torch.exp(scores - lse_f[..., None])
    out = torch.einsum("hqk,khd->qhd", p.to(v.dtype), v)
    lse = lse_f.masked_fill(empty, float("-inf")).detach()
    return out.to(dtype) if not upcast else out, lse


def attention_reference(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                        cu_seqlens_q=None, cu_seqlens_k=None, sinks=None, upcast: bool = True):
    """PyTorch attention with the same layouts and contract as `attention` (differentiable).

    Returns (out, lse): out float32 when upcast else in q's dtype; lse float32 [B, H, Sq] or
    [H, total_q]. Loops over sequences: a reference, not a fast path.
    """
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(len(cq) - 1):
            o, l = _reference_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal, scale, sinks, upcast)
            outs.append(o)
            lses.append(l)
        H = q.shape[1]
        out = torch.cat(outs) if outs else q.new_zeros((0, H, q.shape[-1]), dtype=torch.float32 if upcast else q.dtype)
        lse = torch.cat(lses, dim=1) if lses else torch.zeros(H, 0, device=q.device)
        return out, lse
    outs, lses = zip(*[_reference_one(q[b], k[b], v[b], causal, scale, sinks, upcast) for b in range(q.shape[0])]) \
        if q.shape[0] else ((), ())
    if not outs:
        return q.new_zeros(q.shape, dtype=torch.float32 if upcast else q.dtype), torch.zeros(0, q.shape[2], q.shape[1], device=q.device)
    return torch.stack(outs), torch.stack(lses)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool,
                    direction: str = "fwd") -> float:
    """FLOPs as FlashAttention's benchmarks count them: forward 4*B*H*Sq*Sk*D (two matmuls),
    halved when causal; backward 2.5x the forward (five matmuls, of which two recompute)."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * (2.5 if direction == "bwd" else 1.0)
