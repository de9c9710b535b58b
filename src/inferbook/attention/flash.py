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
from ..words import count

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing: only the references work
    triton = None
    tl = None

HEAD_DIMS = (64, 96, 128, 192, 256)   # the head dims the matrix covers; any 1..256 runs
MAX_HEAD_DIM = 576     # forward: q/k head dims up to MLA's 576 (512 latent + 64 rope)
MAX_HEAD_DIM_V = 512   # forward: value head dim up to MLA's 512
MAX_HEAD_DIM_BWD = 256
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
    def _keep(offs_m, offs_n, n_ok, sq, sk, wl, wr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
        """Which (query, key) pairs of a tile are attended: keys inside the sequence, and with
        CAUSAL / WINDOW, key j of query i (bottom-right aligned: i' = i + sk - sq) when
        i' - wl <= j <= i' + wr (a negative wl or wr: unbounded on that side)."""
        keep = n_ok[None, :] & (offs_m[:, None] >= 0)
        shift = offs_m[:, None] + (sk - sq)
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= shift)
        if WINDOW:
            keep = keep & ((wr < 0) | (offs_n[None, :] <= shift + wr)) & ((wl < 0) | (offs_n[None, :] >= shift - wl))
        return keep

    @triton.jit
    def _logits(q, q2, kt, kt2, qk_scale, softcap_log2e, HAS_TAIL: tl.constexpr, SOFTCAP: tl.constexpr):
        """Base-2 logits of a tile: q k^T (the head dim in two dots when it is split, e.g. MLA's
        512 + 64), scaled; with SOFTCAP, softcap * tanh(s / softcap) (qk_scale is then
        scale / softcap and softcap_log2e = softcap * log2 e). Also returns tanh (1 without a cap)
        for the backward."""
        s = tl.dot(q, kt)
        if HAS_TAIL:
            s = tl.dot(q2, kt2, s)
        s = s * qk_scale
        t = s * 0.0 + 1.0
        if SOFTCAP:
            t = 1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)     # tanh, finite for every finite s
            s = t * softcap_log2e
        return s, t

    @triton.jit
    def _fwd_tiles(acc, l_i, m_i, q, q2, K, V, lo, hi, offs_m, offs_d, d_ok, offs_d2, d2_ok, offs_dv, dv_ok, sq, sk,
                   b, k_start, page_start, KV_INDICES, page_size, stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd, head_k, qk_scale, softcap_log2e, wl, wr,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                   KV_MODE: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                   EVEN_DV: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_D: tl.constexpr):
        """The online softmax over key tiles [lo, hi). MASKED=False is the bulk of a long row — tiles
        wholly inside the sequence and inside every row's causal / window band — with no mask on
        loads or scores; MASKED=True takes the ragged ends and the band's edges."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            kb, ks = _kv_rows(offs_n, n_ok, b, k_start, page_start, KV_INDICES, page_size, KV_MODE)
            k_base = K + (kb * stride_kb + ks * stride_ks + head_k * stride_kh)[None, :]
            k_ptr = k_base + offs_d[:, None] * stride_kd
            v_ptr = V + (kb * stride_vb + ks * stride_vs + head_k * stride_vh)[:, None] + offs_dv[None, :] * stride_vd
            if MASKED:
                kt = tl.load(k_ptr, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            elif EVEN_D:  # head dim == tile width: plain, vectorisable loads
                kt = tl.load(k_ptr)
            else:
                kt = tl.load(k_ptr, mask=d_ok[:, None], other=0.0)
            kt2 = kt
            if HAS_TAIL:  # the head dim's remainder (MLA: the 64 rope dims after 512)
                kt2 = tl.load(k_base + (BLOCK_D + offs_d2)[:, None] * stride_kd,
                              mask=n_ok[None, :] & d2_ok[:, None], other=0.0)
            if DOT_FP32:  # interpreter only: its bf16 tl.dot is wrong
                kt = kt.to(tl.float32)
                kt2 = kt2.to(tl.float32)
            s, t = _logits(q, q2, kt, kt2, qk_scale, softcap_log2e, HAS_TAIL, SOFTCAP)
            if MASKED:
                s = tl.where(_keep(offs_m, offs_n, n_ok, sq, sk, wl, wr, CAUSAL, WINDOW), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen only masked keys keeps m = -inf; subtracting 0 instead of
            # -inf keeps exp2 at 0 rather than exp2(-inf - -inf) = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptr, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
            elif EVEN_DV:
                v = tl.load(v_ptr)
            else:
                v = tl.load(v_ptr, mask=dv_ok[None, :], other=0.0)
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
        seqlen_q, seqlen_k, head_dim, head_dim_v, group, qk_scale, softcap_log2e, window_left, window_right,
        page_size,
        CAUSAL: tl.constexpr, VARLEN_Q: tl.constexpr, KV_MODE: tl.constexpr, PACK_GQA: tl.constexpr,
        HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TAIL: tl.constexpr,
        BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
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
        # lanes are predicated off on every load and store (PackGQA's padded-head predication);
        # above 256 the head dim is split into BLOCK_D + a BLOCK_D2 tail (MLA's 576 = 512 + 64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        offs_d2 = tl.arange(0, BLOCK_D2)
        d2_ok = (BLOCK_D + offs_d2) < head_dim
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v

        q_row = (b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs
                 + head_q.to(tl.int64) * stride_qh)
        q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd,
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        q2 = q
        if HAS_TAIL:
            q2 = tl.load(Q + q_row[:, None] + (BLOCK_D + offs_d2)[None, :] * stride_qd,
                         mask=r_ok[:, None] & d2_ok[None, :], other=0.0)
        if DOT_FP32:  # interpreter only: its bf16 tl.dot is wrong
            q = q.to(tl.float32)
            q2 = q2.to(tl.float32)

        if HAS_SINKS:  # the sink is one more logit in the denominator, with no value vector
            m_i = tl.load(SINKS + head_q, mask=r_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # The key range this row tile can see, [lo, hi), and inside it the tiles that every row sees
        # whole, [lo_full, hi_full): those run with no mask; tiles outside [lo, hi) are never loaded
        # (a sliding window visits only the tiles its band touches).
        first_r = pid_m * BLOCK_M
        last_r = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, rows - 1)
        if PACK_GQA:
            first_r = first_r // group
            last_r = last_r // group
        first_s = first_r + sk - sq              # bottom-right aligned positions of the first / last row
        last_s = last_r + sk - sq
        wr = window_right
        if CAUSAL:  # causal is the window (window_left, 0), as in FlashAttention
            wr = window_right * 0
        lo = first_s * 0
        lo_full = lo
        hi = sk
        hi_full = (sk // BLOCK_N) * BLOCK_N
        if CAUSAL or WINDOW:
            bounded = wr >= 0
            hi = tl.where(bounded, tl.minimum(sk, tl.maximum(last_s + wr + 1, 0)), hi)
            hi_full = tl.where(bounded, tl.minimum(hi_full, (tl.maximum(first_s + wr + 1, 0) // BLOCK_N) * BLOCK_N),
                               hi_full)
            if WINDOW:
                left = window_left >= 0
                lo = tl.where(left, (tl.maximum(first_s - window_left, 0) // BLOCK_N) * BLOCK_N, lo)
                lo_full = tl.where(left, tl.cdiv(tl.maximum(last_s - window_left, 0), BLOCK_N) * BLOCK_N, lo_full)
        lo = tl.minimum(lo, hi)
        mid_lo = tl.maximum(lo, tl.minimum(lo_full, hi))
        mid_hi = tl.maximum(mid_lo, tl.minimum(hi_full, hi))
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, q2, K, V, lo, mid_lo, offs_m, offs_d, d_ok, offs_d2, d2_ok, offs_dv, dv_ok, sq, sk,
            b, k_start, page_start, KV_INDICES, page_size, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, head_k, qk_scale, softcap_log2e, window_left, wr,
            True, CAUSAL, WINDOW, SOFTCAP, KV_MODE, DOT_FP32, BLOCK_N, EVEN_D, EVEN_DV, HAS_TAIL, BLOCK_D)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, q2, K, V, mid_lo, mid_hi, offs_m, offs_d, d_ok, offs_d2, d2_ok, offs_dv, dv_ok, sq, sk,
            b, k_start, page_start, KV_INDICES, page_size, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, head_k, qk_scale, softcap_log2e, window_left, wr,
            False, CAUSAL, WINDOW, SOFTCAP, KV_MODE, DOT_FP32, BLOCK_N, EVEN_D, EVEN_DV, HAS_TAIL, BLOCK_D)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, q2, K, V, mid_hi, hi, offs_m, offs_d, d_ok, offs_d2, d2_ok, offs_dv, dv_ok, sq, sk,
            b, k_start, page_start, KV_INDICES, page_size, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, head_k, qk_scale, softcap_log2e, window_left, wr,
            True, CAUSAL, WINDOW, SOFTCAP, KV_MODE, DOT_FP32, BLOCK_N, EVEN_D, EVEN_DV, HAS_TAIL, BLOCK_D)

        # no key and no sink: l = 0 -> out 0, lse -inf (the empty-K contract)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        o_row = (b.to(tl.int64) * stride_ob + (q_start + offs_m).to(tl.int64) * stride_os
                 + head_q.to(tl.int64) * stride_oh)
        tl.store(O + o_row[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty),
                 mask=r_ok[:, None] & dv_ok[None, :])
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
        stride_gvb, stride_gvs, stride_gvh,
        stride_lh,
        seqlen_q, seqlen_k, head_dim, head_dim_v, group, qk_scale, softcap_log2e, sm_scale, window_left,
        window_right,
        CAUSAL: tl.constexpr, VARLEN: tl.constexpr, KV_MODE: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v
        nd_ok = n_ok[:, None] & d_ok[None, :]
        ndv_ok = n_ok[:, None] & dv_ok[None, :]
        k_row = b.to(tl.int64) * stride_kb + (k_start + offs_n).to(tl.int64) * stride_ks + hk * stride_kh
        v_row = b.to(tl.int64) * stride_vb + (k_start + offs_n).to(tl.int64) * stride_vs + hk * stride_vh
        k = tl.load(K + k_row[:, None] + offs_d[None, :] * stride_kd, mask=nd_ok, other=0.0)
        v = tl.load(V + v_row[:, None] + offs_dv[None, :] * stride_vd, mask=ndv_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

        # the queries whose band reaches this key tile: i' - wl <= j <= i' + wr (i' = i + sk - sq)
        wr = window_right
        if CAUSAL:
            wr = window_right * 0
        lo = pid_n * 0
        hi = sq
        if CAUSAL or WINDOW:  # queries above this tile's diagonal (or band) never see its keys
            lo = tl.where(wr >= 0, tl.maximum(pid_n * BLOCK_N - wr - (sk - sq), 0), lo)
            lo = (lo // BLOCK_M) * BLOCK_M
            if WINDOW:
                hi = tl.where(window_left >= 0,
                              tl.minimum(sq, tl.maximum(pid_n * BLOCK_N + BLOCK_N + window_left - (sk - sq), 0)), hi)
        # a key no query attends (empty Q) runs no iteration: dK = dV = 0 exactly
        for g in range(0, group):
            hq = hk * group + g
            for start_m in range(lo, hi, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                m_ok = offs_m < sq
                md_ok = m_ok[:, None] & d_ok[None, :]
                mdv_ok = m_ok[:, None] & dv_ok[None, :]
                q_row = (b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs
                         + hq * stride_qh)
                do_row = (b.to(tl.int64) * stride_dob + (q_start + offs_m).to(tl.int64) * stride_dos
                          + hq * stride_doh)
                q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd, mask=md_ok, other=0.0)
                do = tl.load(DO + do_row[:, None] + offs_dv[None, :] * stride_dod, mask=mdv_ok, other=0.0)
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
                s, t = _logits(q, q, tl.trans(k), k, qk_scale, softcap_log2e, False, SOFTCAP)
                valid = m_ok[:, None] & _keep(offs_m, offs_n, n_ok, sq, sk, window_left, wr, CAUSAL, WINDOW)
                s = tl.where(valid, s, float("-inf"))
                p = tl.exp2(s - lse[:, None])
                p_lo = p.to(Q.dtype.element_ty)
                if DOT_FP32:
                    p_lo = p_lo.to(tl.float32)
                dv += tl.dot(tl.trans(p_lo), do)
                dp = tl.dot(do, tl.trans(v))
                ds = p * (dp - delta[:, None])
                if SOFTCAP:  # d(softcap tanh(x / softcap)) / dx = 1 - tanh^2
                    ds = ds * (1.0 - t * t)
                ds_lo = ds.to(Q.dtype.element_ty)
                if DOT_FP32:
                    ds_lo = ds_lo.to(tl.float32)
                dk += tl.dot(tl.trans(ds_lo), q)
        dk = dk * sm_scale
        g_row = b.to(tl.int64) * stride_gb + (k_start + offs_n).to(tl.int64) * stride_gs + hk * stride_gh
        tl.store(DK + g_row[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=nd_ok)
        gv_row = b.to(tl.int64) * stride_gvb + (k_start + offs_n).to(tl.int64) * stride_gvs + hk * stride_gvh
        tl.store(DV + gv_row[:, None] + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=ndv_ok)

    @triton.jit
    def _attn_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
        stride_qb, stride_qs, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_dob, stride_dos, stride_doh, stride_dod,
        stride_gb, stride_gs, stride_gh,
        stride_lh,
        seqlen_q, seqlen_k, head_dim, head_dim_v, group, qk_scale, softcap_log2e, sm_scale, window_left,
        window_right,
        CAUSAL: tl.constexpr, VARLEN: tl.constexpr, KV_MODE: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
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
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v
        md_ok = m_ok[:, None] & d_ok[None, :]
        q_row = b.to(tl.int64) * stride_qb + (q_start + offs_m).to(tl.int64) * stride_qs + hq * stride_qh
        do_row = b.to(tl.int64) * stride_dob + (q_start + offs_m).to(tl.int64) * stride_dos + hq * stride_doh
        q = tl.load(Q + q_row[:, None] + offs_d[None, :] * stride_qd, mask=md_ok, other=0.0)
        do = tl.load(DO + do_row[:, None] + offs_dv[None, :] * stride_dod, mask=m_ok[:, None] & dv_ok[None, :],
                     other=0.0)
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
        # the keys this query tile's band reaches (tiles outside it are never loaded)
        wr = window_right
        if CAUSAL:
            wr = window_right * 0
        lo = pid_m * 0
        hi = sk
        if CAUSAL or WINDOW:
            last_m = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, sq - 1)
            hi = tl.where(wr >= 0, tl.minimum(sk, tl.maximum(last_m + wr + 1 + sk - sq, 0)), hi)
            if WINDOW:
                lo = tl.where(window_left >= 0,
                              (tl.maximum(pid_m * BLOCK_M + sk - sq - window_left, 0) // BLOCK_N) * BLOCK_N, lo)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < sk
            nd_ok = n_ok[:, None] & d_ok[None, :]
            k_row = b.to(tl.int64) * stride_kb + (k_start + offs_n).to(tl.int64) * stride_ks + hk * stride_kh
            v_row = b.to(tl.int64) * stride_vb + (k_start + offs_n).to(tl.int64) * stride_vs + hk * stride_vh
            k = tl.load(K + k_row[:, None] + offs_d[None, :] * stride_kd, mask=nd_ok, other=0.0)
            v = tl.load(V + v_row[:, None] + offs_dv[None, :] * stride_vd, mask=n_ok[:, None] & dv_ok[None, :],
                        other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s, t = _logits(q, q, tl.trans(k), k, qk_scale, softcap_log2e, False, SOFTCAP)
            valid = m_ok[:, None] & _keep(offs_m, offs_n, n_ok, sq, sk, window_left, wr, CAUSAL, WINDOW)
            s = tl.where(valid, s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            ds_lo = ds.to(Q.dtype.element_ty)
            if DOT_FP32:
                ds_lo = ds_lo.to(tl.float32)
            dq += tl.dot(ds_lo, k)
        dq = dq * sm_scale
        g_row = b.to(tl.int64) * stride_gb + (q_start + offs_m).to(tl.int64) * stride_gs + hq * stride_gh
        tl.store(DQ + g_row[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=md_ok)


# ---------------------------------------------------------------------------
# Launch configuration

def head_tiles(head_dim: int, head_dim_v: int | None = None) -> dict:
    """How the head dims map onto tiles: up to 256 the q/k head dim is padded to a power of two
    (BLOCK_D, padded lanes predicated off); above 256 it is split into a power-of-two BLOCK_D and a
    tail BLOCK_D2 (MLA's 576 = 512 + 64: two dots instead of a 1024-wide tile). BLOCK_DV pads the
    value head dim (dv != d, up to 512)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_dim <= 256:
        bd, tail = max(16, triton.next_power_of_2(head_dim)), 0
    else:
        bd = 1 << (head_dim.bit_length() - 1)
        tail = max(16, triton.next_power_of_2(head_dim - bd)) if head_dim > bd else 0
    return dict(BLOCK_D=bd, HAS_TAIL=tail > 0, BLOCK_D2=tail or 16, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                EVEN_D=bd <= head_dim, EVEN_DV=triton.next_power_of_2(dv) == dv and dv >= 16)


def block_config(device: torch.device, head_dim: int, kind: str, head_dim_v: int | None = None, *,
                 paged: bool = False, pack: bool = False, window: bool = False, softcap: bool = False,
                 causal: bool = False) -> dict:
    """`_block_config`'s tiles for `kind` ('fwd', 'dq', 'dkdv'), through `device.swept` under the name
    'attention.<kind>' (what `python -m inferbook.compiled.sweep` varies)."""
    return _device.swept(f"attention.{kind}", _block_config(device, head_dim, kind, head_dim_v, paged=paged,
                                                              pack=pack, window=window, softcap=softcap,
                                                              causal=causal))


def _block_config(device: torch.device, head_dim: int, kind: str, head_dim_v: int | None = None, *,
                  paged: bool = False, pack: bool = False, window: bool = False, softcap: bool = False,
                  causal: bool = False) -> dict:
    """Tile sizes and warps per kernel. Fixed, not autotuned (autotuning would add minutes of
    compilation per head dim and mask combination to every run of the matrix).

    GPU: 128x64 forward tiles up to D=128; D=192/256 pad to 256 and halve the tiles to keep the
    fp32 accumulators in registers; MLA-sized heads (d or dv > 256) 32x32 with 8 warps (q [32, 576] and
    the [32, 512] accumulator in registers: no spill on sm_90).
    Backward at d <= 128: dK/dV 64x64 on one warpgroup on sm_90 (wgmma), dQ 64x32 on 4 warps on NVIDIA. At d 192/256:
    dK/dV 32x64 (on sm_90 mostly mma.sync: 32 rows are half a warpgroup's wgmma, and every 64-row tile spilled),
    dQ 32x16 on 4 warps with two stages on NVIDIA (64x16 on sm_90). The flags (paged KV, PackGQA, a window,
    softcap, causal) add index and mask arithmetic
    that pushed some NVIDIA tiles past 255 registers; those cases take smaller tiles on NVIDIA (below,
    with the predicted times that chose them). CDNA takes 4-wave tiles for dK/dV and the MLA forward (8 waves
    sit two a SIMD at 256 VGPRs and spilled there). Interpreter: 64x64 — each interpreted op costs far more than
    its arithmetic, so fewer, larger tiles run fastest (measured: 32x32 is ~4x slower on the smoke
    matrix); the 113x203 shape still spans several tiles with ragged tails.
    """
    block_d = max(16, triton.next_power_of_2(head_dim)) if triton is not None else head_dim
    if not _device.wants_gpu_config(device):
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=1)
    if kind == "fwd":
        widest = max(head_dim, head_dim_v or head_dim)
        if widest > 256:   # MLA-sized heads (576/512): short tiles keep q and the accumulator in registers
            cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=1)
            # CDNA: 8 waves sit two a SIMD at 256 VGPRs, and every MLA forward of the matrix spilled there
            # (104-488 B); 4 waves of 32 rows x 16 keys hold 239-251 with none, predicted faster in all
            # (the twelve: 508 -> 230 us on MI300X, 385 -> 193 us on MI355X; of 32x32, 16x32, 16x16, 64x32 at 4
            # waves and 16x32 at 2, the others spill or are predicted slower)
            amd = {**cfg, "BLOCK_N": 16, "num_warps": 4}
            if not (pack and window):
                return dict(_device.pick_config({"nvidia": cfg, "hip": amd}, device))
            # PackGQA with a window: 32x32 at 8 warps spilled 8-32 B on sm_90/sm_100 (255 registers); 16x16
            # at 4 warps holds 190-228 with no spill on sm_80/90/100 and is predicted faster on every such
            # launch of the matrix (predicted, waves-bound: sm_90 d576 paged-1 window-left softcap 13.4 -> 10.1 us,
            # causal empty-q 10.0 -> 5.9 us). Not for every MLA launch: the 1023x1024 contiguous one is
            # predicted slower at 16x16 (sm_90 107 -> 136 us). AMD takes its own, as above.
            return dict(_device.pick_config({"nvidia": {**cfg, "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4},
                                             "hip": amd}, device))
        block_d = max(16, triton.next_power_of_2(widest))
        # CDNA, d <= 128: 128x64 on 4 waves, one stage (at most 294 registers, no spill; the 8-wave tiles
        # spilled 12-116 B on five flagged launches a target): every such forward of the matrix predicted
        # faster or as fast, the twenty-nine 4.4 -> 2.2 ms on MI300X, 3.2 -> 1.6 ms on MI355X; throughput d128
        # full 2.1 -> 1.1 ms and 1.4 -> 0.7 ms, best of the 24 of (128x128 within 1 %)
        #   inferbook sweep attention-test-matrix gfx942 attention.fwd --kernel _attn_fwd_kernel \
        #     --launch "throughput d128 full" --set BLOCK_M=64,128 --set BLOCK_N=32,64,128 --set num_warps=4,8 \
        #     --set num_stages=1,2 --jobs 2
        amd_fwd = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=1)
        if block_d <= 64:
            cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=3)
            if not (paged or pack or window or softcap):
                return dict(_device.pick_config({"nvidia": cfg, "hip": amd_fwd}, device))
            # 128x64 at 4 warps sits at 252-255 registers at d64; paged KV, PackGQA or a window (softcap's
            # tanh adds more) spilled 16-128 B on NVIDIA. 64-key tiles -> 32 halve the score tile: no spill on sm_80/90/100 and every
            # such launch of the matrix predicted no slower (predicted: sm_80 d64 paged-128 MQA+pack
            # window-left 10.4 -> 7.8 us, sm_90 6.9 -> 5.4, sm_100 10.8 -> 7.8). Not without those
            # features: the plain d64 sinks launch is predicted slower at 32 keys (sm_90 3.9 -> 5.4 us,
            # latency-bound), and it does not spill. AMD takes its own (above).
            return dict(_device.pick_config({"nvidia": {**cfg, "BLOCK_N": 32}, "hip": amd_fwd}, device))
        if block_d <= 128:
            cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=3)
            configs = {"nvidia": cfg, "hip": amd_fwd}
            if pack and triton.next_power_of_2(head_dim_v or head_dim) == 128:
                # sm_80, PackGQA with a 128-wide accumulator: 128x64 spilled 88-136 B (255 registers);
                # 64-row tiles hold 168-192 with no spill and are predicted faster on every such launch of the
                # matrix (predicted: d128 paged-16 GQA+pack 113x203 sinks 21.8 -> 6.9 us). sm_90/sm_100 do
                # not spill there; dv 48 (a 64-wide accumulator) does not spill and is predicted slower at
                # 64 rows (6.5 -> 7.8 us)
                configs["sm_80"] = {**cfg, "BLOCK_M": 64}
            return dict(_device.pick_config(configs, device))
        # sm_100: ptxas (Triton's --regAllocOptLevel=2) held these to 128 registers and spilled 32 B at
        # d192/dv96 with softcap; `maxnreg` lifts the cap (no spill on any d 192/256 forward there)
        # CDNA: the same tile on 4 waves, one stage (at most 297 registers; 8 waves spilled 12-24 B on gfx942):
        # the twelve d 192/256 forwards of the matrix 251 -> 115 us on MI300X, 190 -> 86 us on MI355X, none slower
        cfg = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=2)
        return dict(_device.pick_config({"nvidia": cfg, "sm_100": {**cfg, "maxnreg": 255},
                                         "hip": {**cfg, "num_warps": 4, "num_stages": 1}}, device))
    if kind == "dkdv":
        if block_d <= 128:
            cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=2)
            configs = {"nvidia": cfg}
            if block_d <= 64:
                # sm_80 at d64: 64 keys per program spilled 20-44 B (255 registers); 32 hold 116-149, no spill,
                # every d64 dK/dV launch of the matrix predicted faster (predicted: causal GQA sinks
                # window-left 6.0 -> 4.8 us). sm_90 keeps 64 (wgmma's M = 64 for dK/dV), sm_100 does not spill
                configs["sm_80"] = {**cfg, "BLOCK_N": 32}
            elif causal and not softcap:
                # sm_100, d 65-128 causal: ptxas held 8 warps to 128 registers and spilled 16 B (throughput
                # d128 causal); 4 warps hold 166-206, no spill, predicted no slower on every such launch of the
                # matrix (predicted: throughput d128 causal B2 S8192 H16 1323 -> 986 us, waves-bound). Not
                # non-causal (the d128 MQA sinks launch is predicted 7.8 -> 8.4 us at 4 warps) nor with
                # softcap (maxnreg below; 7.8 -> 8.4 us at d128 window-band)
                configs["sm_100"] = {**cfg, "num_warps": 4}
            if not softcap:
                # sm_90: 32 query rows on 8 warps are too few for wgmma (64 rows a warpgroup): 32 of the loop's 36
                # MMAs were mma.sync. 64 rows on 4 warps (one warpgroup), one stage, 170-254 registers, no spill:
                # predicted faster on all 16 d <= 128 dK/dV launches of the matrix, 7.6 -> 3.6 ms in all, throughput
                # d128 full 4.9 -> 2.3 ms and causal 2.4 -> 1.2 ms (waves-bound). With softcap's tanh three of them
                # spilled 80-188 B at 255 registers, so softcap keeps 32x64 on 8 warps. Not sm_80 (predicted no faster
                # in all: A100 is compute-bound there) nor sm_100 (spilled 8-276 B on 10 of the 16). Rerun with
                #   inferbook sweep attention-test-matrix sm_90 attention.dkdv --kernel _attn_bwd_dkdv_kernel \
                #     --launch "· d64" --launch "· d96" --launch "· d128" --launch "throughput d128" \
                #     --set BLOCK_M=32,64 --set num_warps=4,8 --set num_stages=1 --jobs 2
                configs["sm_90"] = {**cfg, "BLOCK_M": 64, "num_warps": 4, "num_stages": 1}
            # CDNA (gfx942/gfx950): 8 waves of 32x64 sit two a SIMD, 256 VGPRs each, and spilled 8-652 B on
            # 12 of the matrix's 14 d <= 128 dK/dV launches on each. 4 waves of 128x64, one a SIMD with the unified
            # file's 512, spill none without a causal mask or softcap (400-485 registers; with them 511-512 and
            # 16-88 B spilled), so those take 32 keys (250-330, no spill). Predicted: throughput d128 full 12.2 ->
            # 2.0 ms on MI300X (the best of the 24 the command below sweeps; at 8 waves 128x64 spills 484 B),
            # 7.4 -> 1.1 ms on MI355X; causal 7.5 -> 1.3, 4.7 -> 0.9 ms. aotriton tunes its own dK/dV over
            # 32x64 and 64x16 at 1-2 waves; ours at 32x64 spills at 1 wave and is predicted 3x slower at 2.
            #   inferbook sweep attention-test-matrix gfx942 attention.dkdv --kernel _attn_bwd_dkdv_kernel \
            #     --launch "throughput d128 full" --set BLOCK_M=32,64,128 --set BLOCK_N=32,64 --set num_warps=4,8 \
            #     --set num_stages=1,2 --jobs 2
            configs["hip"] = {**cfg, "BLOCK_M": 128, "BLOCK_N": 32 if (causal or softcap) else 64, "num_warps": 4,
                              "num_stages": 1}
            return dict(_device.pick_config(configs, device))
        # d 192/256: 32x64 on 8 warps, no spill on sm_80/90/100; one stage so the K, V, dK, dV tiles fit shared
        # memory. On sm_90 the dK and dV MMAs are 4 wgmma and 48-64 mma.sync (32 rows are half a warpgroup's M
        # of 64); 64 rows spilled 960-4396 B on the matrix's four launches, 16 rows are predicted slower
        # (`inferbook sweep attention-test-matrix sm_90 attention.dkdv --kernel _attn_bwd_dkdv_kernel --launch
        # "· d192" --launch "· d256" --set BLOCK_M=16,32,64 --set num_warps=4,8`).
        # CDNA: at 8 waves (256 VGPRs each) every such launch of the matrix spilled 556-1128 B; 4 waves of 64
        # rows x 32 keys hold 312-502 with none, predicted faster on each (the four: 158 -> 29 us on MI300X,
        # 90 -> 16 us on MI355X; of 32x64, 32x32, 64x64, 16x64, 16x32 and 128x32 at 4 waves, the others spill
        # or are predicted slower)
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=1)
        return dict(_device.pick_config({"nvidia": cfg, "hip": {**cfg, "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}},
                                        device))
    if block_d <= 128:  # dq
        # CDNA: 128 rows x 64 keys on 4 waves, one stage (311-386 registers, no spill): every d <= 128 dQ
        # launch of the matrix predicted faster than at 64x32 on 8 waves, the fourteen 7.6 -> 2.3 ms on MI300X
        # and 5.6 -> 1.5 ms on MI355X (throughput d128 full 4.5 -> 1.3 ms on MI300X, tied best of the 16 of
        #   inferbook sweep attention-test-matrix gfx942 attention.dq --kernel _attn_bwd_dq_kernel \
        #     --launch "throughput d128 full" --set BLOCK_M=64,128 --set BLOCK_N=32,64 --set num_warps=4,8 \
        #     --set num_stages=1,2 --jobs 2
        # with 128x32)
        # NVIDIA: 64x32 on 4 warps, one stage (8 warps and two stages before: a 64-row tile is one warpgroup's
        # wgmma on sm_90, and the second warpgroup only split it): over the 16 d <= 128 dQ launches of the matrix,
        # predicted faster on 12 / 10 / 15 and slower on none, no spill, 5.2 -> 2.7 ms on H200, 3.2 -> 1.9 ms on
        # B200, 8.5 -> 8.2 ms on A100 (throughput d128 full 3.2 -> 1.7 ms on H200). Rerun with
        #   inferbook sweep attention-test-matrix sm_90 attention.dq --kernel _attn_bwd_dq_kernel \
        #     --launch "· d64" --launch "· d96" --launch "· d128" --launch "throughput d128" \
        #     --set num_warps=4,8 --set num_stages=1,2 --jobs 2             (likewise sm_100, sm_80)
        cfg = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=4, num_stages=1)
        return dict(_device.pick_config({"nvidia": cfg, "hip": {**cfg, "BLOCK_M": 128, "BLOCK_N": 64}}, device))
    # d 192/256 dQ, 32x16: two stages on NVIDIA (K and V stream through shared memory by cp.async
    # instead of being held in registers: one stage spilled 8 B at d 192 on sm_90 and sm_100, at 128
    # registers; two use 105-140, no spill on sm_80/90/100). AMD keeps the one stage it was checked with.
    # NVIDIA on 4 warps (8 split a 32-row tile thinner than an MMA needs): over the matrix's four d 192/256 dQ
    # launches predicted 27.7 -> 22.9 us on A100 and 18.0 -> 16.2 us on B200, none slower, no spill; sm_90
    # takes 64 rows (32 on 4 warps spilled 8 B there; 64x16 none), 18.1 -> 15.0 us, faster on all four.
    #   inferbook sweep attention-test-matrix sm_90 attention.dq --kernel _attn_bwd_dq_kernel \
    #     --launch "· d192" --launch "· d256" --set BLOCK_M=32,64 --set num_warps=4,8     (likewise sm_80, sm_100)
    # CDNA: 2 waves (128 lanes, as NVIDIA's 4 warps), one stage: 26.7 -> 13.6 us on MI300X and 22.2 -> 12.0 us
    # on MI355X over the four, each faster, no spill (of 1, 2, 4 and 8 waves at 32 rows; `--set num_warps=1,2,4,8`)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_D=block_d, num_warps=4, num_stages=2)
    return dict(_device.pick_config({"nvidia": cfg, "sm_90": {**cfg, "BLOCK_M": 64},
                                     "hip": {**cfg, "num_warps": 2, "num_stages": 1}}, device))


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
    if k.shape[:-1] != v.shape[:-1]:
        _fail(f"k and v must have the same shape but for the head dim, got {list(k.shape)} and {list(v.shape)}")
    D, H, Hk, DV = q.shape[-1], q.shape[-2], k.shape[-2], v.shape[-1]
    if not 1 <= D <= MAX_HEAD_DIM:
        _fail(f"head dim {D} is not supported; allowed: 1..{MAX_HEAD_DIM} (the matrix covers {HEAD_DIMS})")
    if not 1 <= DV <= MAX_HEAD_DIM_V:
        _fail(f"value head dim {DV} is not supported; allowed: 1..{MAX_HEAD_DIM_V}")
    if k.shape[-1] != D:
        _fail(f"k has head dim {k.shape[-1]} but q has {D}")
    if Hk < 1 or H % Hk:
        _fail(f"q has {H} heads, k/v {Hk}: the query heads must be a multiple of the KV heads (GQA/MQA)")
    if not varlen and not paged and q.shape[0] != k.shape[0]:
        _fail(f"q has batch {q.shape[0]} but k has {k.shape[0]}")


def _check_window_softcap(window_size, softcap) -> tuple[tuple[int, int], float]:
    """FlashAttention's `window_size=(left, right)` (-1: unbounded) and `softcap` (0: none)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        _fail(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        _fail(f"softcap must be a finite number >= 0 (0: no cap), got {softcap!r}")
    return (int(window_size[0]), int(window_size[1])), float(softcap)


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
    window: tuple = (-1, -1)   # (left, right) keys a query sees around its diagonal; -1: unbounded
    softcap: float = 0.0       # > 0: logits s -> softcap * tanh(s / softcap)


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
    Hk, DV = k.shape[-2], v.shape[-1]
    group = H // Hk
    pack = meta.pack_gqa and group > 1
    cfg = block_config(device, D, "fwd", DV, paged=kv_mode == 2, pack=pack, window=tuple(meta.window) != (-1, -1),
                       softcap=meta.softcap > 0)
    tiles = head_tiles(D, DV)
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
            meta.seqlen_q, meta.seqlen_k, D, DV, group, *_logit_scales(meta), int(meta.window[0]),
            int(meta.window[1]), page_size]
    kwargs = dict(CAUSAL=meta.causal, VARLEN_Q=meta.varlen, KV_MODE=kv_mode, PACK_GQA=pack,
                  HAS_SINKS=sinks is not None, WINDOW=tuple(meta.window) != (-1, -1), SOFTCAP=meta.softcap > 0,
                  DOT_FP32=_device.dot_needs_fp32(device), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], **tiles,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))
    return Launch("fwd", _attn_fwd_kernel, args, kwargs, "attention/flash.py:_forward", grid)


def _logit_scales(meta: _Meta) -> tuple[float, float]:
    """(qk_scale, softcap_log2e) the kernels take: scale * log2 e without a cap (base-2 logits);
    with a cap, scale / softcap (the tanh argument) and softcap * log2 e."""
    if meta.softcap > 0:
        return meta.scale / meta.softcap, meta.softcap * LOG2E
    return meta.scale * LOG2E, 0.0


def _forward(q, k, v, sinks, meta: _Meta, *, kv_mode: int = 0, page_table=None, page_size: int = 1):
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
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
    DV = v.shape[-1]
    scales, window = _logit_scales(meta), (int(meta.window[0]), int(meta.window[1]))
    flags = dict(CAUSAL=meta.causal, VARLEN=meta.varlen, KV_MODE=1 if meta.varlen else 0,
                 WINDOW=tuple(meta.window) != (-1, -1), SOFTCAP=meta.softcap > 0, DOT_FP32=dot_fp32)
    block_dv = head_tiles(D, DV)["BLOCK_DV"]
    # softcap on sm_100: ptxas held dK/dV to 128 registers (48 B spilled at d96/dv48) and dQ to 64 (8 B at
    # d96); `maxnreg` lifts the cap, no prediction worse. Not without softcap: there the cap is what
    # keeps the throughput backward resident (lifting it at 8 warps: d128 causal dK/dV predicted 1.27 -> 2.18 ms;
    # that launch now runs 4 warps there, `block_config`)
    regs = _device.pick_config({"nvidia": {}, "sm_100": {"maxnreg": 255}}, device) if meta.softcap > 0 else {}
    launches = []
    cfg = block_config(device, max(D, DV), "dkdv", causal=meta.causal, softcap=meta.softcap > 0)
    cfg["BLOCK_D"] = head_tiles(D)["BLOCK_D"]
    gk = _strides4(dk, meta.varlen)
    grid = (triton.cdiv(meta.max_seqlen_k, cfg["BLOCK_N"]), meta.batch, Hk)
    if grid[0] > 0:
        launches.append(Launch("bwd dkdv", _attn_bwd_dkdv_kernel, [
            _nonempty(q), k, v, _nonempty(dout), _nonempty(lse), _nonempty(delta), dk, dv, cu_q, cu_k,
            *common, gk[0], gk[1], gk[2], *_strides4(dv, meta.varlen)[:3], lse.stride(0),
            meta.seqlen_q, meta.seqlen_k, D, DV, group, *scales, meta.scale, *window],
            dict(**flags, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=block_dv,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **regs), "attention/flash.py:_backward", grid))
    cfg = block_config(device, max(D, DV), "dq")
    cfg["BLOCK_D"] = head_tiles(D)["BLOCK_D"]
    gq = _strides4(dq, meta.varlen)
    grid = (triton.cdiv(meta.max_seqlen_q, cfg["BLOCK_M"]), meta.batch, H)
    if grid[0] > 0:
        launches.append(Launch("bwd dq", _attn_bwd_dq_kernel, [
            q, k, v, dout, lse, delta, dq, cu_q, cu_k,
            *common, gq[0], gq[1], gq[2], lse.stride(0),
            meta.seqlen_q, meta.seqlen_k, D, DV, group, *scales, meta.scale, *window],
            dict(**flags, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=block_dv,
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **regs), "attention/flash.py:_backward", grid))
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
                       name: str = "", window_size=(-1, -1), softcap: float = 0.0) -> list:
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
    meta.window, meta.softcap = _check_window_softcap(window_size, softcap)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
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
        launches += _backward_launches(torch.empty(out.shape, dtype=q.dtype, device=q.device), q, k, v, lse, delta,
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
              pack_gqa, v=None) -> _Meta:
    if not isinstance(causal, bool):
        _fail(f"causal must be True or False, got {causal!r}")
    if not isinstance(pack_gqa, bool):
        _fail(f"pack_gqa must be True or False, got {pack_gqa!r}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_qkv(q, k, k if v is None else v, varlen=varlen, paged=False)
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
              pack_gqa: bool = True, backend: str = "auto", window_size=(-1, -1), softcap: float = 0.0):
    """FlashAttention forward (and, through autograd, backward) with the Triton kernels.

    q [B, Sq, H, D] with k, v [B, Sk, Hk, D]; or packed varlen q [total_q, H, D], k, v
    [total_k, Hk, D] with int32 `cu_seqlens_q`/`cu_seqlens_k` [B+1]. float16 or bfloat16.
    `sinks`: optional float32 [H] sink logits (learnable: they get a gradient), as gpt-oss / FA3.
    `window_size=(left, right)`: query i (bottom-right aligned) sees keys [i - left, i + right], -1
    unbounded (FlashAttention's semantics; causal is (left, 0)); key tiles outside every row's band
    are never loaded. `softcap` > 0: logits s -> softcap * tanh(s / softcap) before the softmax.
    v may have its own head dim (dv != d); the forward takes d <= 576 and dv <= 512 (MLA), the
    backward d, dv <= 256.
    `pack_gqa`: fold the query heads of a KV head into the tile's M rows (forward).
    `backend`: 'auto' (Triton where it can run, else the PyTorch reference), 'triton', 'torch'.
    Returns out (same layout and dtype as q), and lse (float32; [B, H, Sq] or [H, total_q])
    when `return_lse`. Non-contiguous inputs are read through their strides, not copied.
    """
    if backend not in ("auto", "triton", "torch"):
        _fail(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    meta = _meta_for(q, k, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     pack_gqa=pack_gqa, v=v)
    _check_qkv(q, k, v, varlen=meta.varlen, paged=False)
    _check_scale_sinks(softmax_scale, sinks, q.shape[-2], q.device)
    meta.window, meta.softcap = _check_window_softcap(window_size, softcap)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)) \
            and max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM_BWD:
        _fail(f"the backward takes head dims up to {MAX_HEAD_DIM_BWD} (got d={q.shape[-1]}, dv={v.shape[-1]}); "
              "MLA-sized heads are forward only: call under torch.no_grad()")
    chosen = backend
    if backend == "auto":
        chosen = select_backend(q.device)[0]
    elif backend == "triton":
        ok, why = _device.triton_backend_for(q.device)
        if not ok:
            _fail(f"backend='triton' cannot run here: {why}")
    if chosen == "torch":
        out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=meta.scale,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks,
                                       window_size=meta.window, softcap=meta.softcap)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    out, lse = _FlashAttention.apply(q, k, v, sinks.contiguous() if sinks is not None else None, meta)
    lse = _lse_view(lse, meta)
    return (out, lse) if return_lse else out


def paged_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal: bool = False,
                    softmax_scale: float | None = None, cu_seqlens_q=None, max_seqlen_q: int | None = None,
                    return_lse: bool = False, *, sinks=None, pack_gqa: bool = True, window_size=(-1, -1),
                    softcap: float = 0.0):
    """Forward attention over a paged KV cache with a FlashInfer-style CSR page table.

    k_cache, v_cache [num_pages, page_size, Hk, D] (NHD). Sequence b owns the pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] in order, the last one filled to
    kv_last_page_len[b] slots (1..page_size; 0 allowed only for a sequence with no page).
    q [B, Sq, H, D], or varlen [total_q, H, D] with `cu_seqlens_q`. Forward only: inputs that
    require grad with grad mode on are refused (serving paths do not differentiate).
    `window_size`, `softcap`, `sinks` and dv != d as in `attention`.
    """
    if not isinstance(causal, bool):
        _fail(f"causal must be True or False, got {causal!r}")
    if not isinstance(pack_gqa, bool):
        _fail(f"pack_gqa must be True or False, got {pack_gqa!r}")
    varlen = cu_seqlens_q is not None
    _check_qkv(q, k_cache, v_cache, varlen=varlen, paged=True)
    _check_scale_sinks(softmax_scale, sinks, q.shape[-2], q.device)
    window, cap = _check_window_softcap(window_size, softcap)
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
                  f"(0 for one with none); sequence {b} has {count(n, 'page')}")
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
                                       cu_seqlens_k=cu_k, sinks=sinks, window_size=window, softcap=cap)
        out = out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])
        return (out, lse if varlen else lse.view(-1, B, q.shape[1]).transpose(0, 1)) if return_lse else out
    meta.window, meta.softcap = window, cap
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
    vc = torch.full((total_pages, page_size, Hk, v.shape[-1]), fill, dtype=v.dtype, device=v.device)
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
    v = torch.cat(vs) if vs else v_cache.new_zeros((0, Hk, v_cache.shape[3]))
    return k, v, torch.tensor(cu, dtype=torch.int32, device=k_cache.device)


# ---------------------------------------------------------------------------
# PyTorch references

def _reference_one(q, k, v, causal: bool, scale: float, sinks, upcast: bool, window=(-1, -1), softcap: float = 0.0):
    """One sequence: q [Sq, H, D], k [Sk, Hk, D], v [Sk, Hk, DV] -> out [Sq, H, DV], lse [H, Sq] (float32).
    `window` (left, right) and `softcap` as `attention` takes them.

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
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    wl, wr = window
    if causal:
        wr = 0
    if wl >= 0 or wr >= 0:
        i = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
        j = torch.arange(Sk, device=q.device)[None, :]
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
        if wr >= 0:
            keep &= j <= i + wr
        if wl >= 0:
            keep &= j >= i - wl
        scores = scores.masked_fill(~keep, float("-inf"))
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
                        cu_seqlens_q=None, cu_seqlens_k=None, sinks=None, upcast: bool = True,
                        window_size=(-1, -1), softcap: float = 0.0):
    """PyTorch attention with the same layouts and contract as `attention` (differentiable).

    Returns (out, lse): out float32 when upcast else in q's dtype; lse float32 [B, H, Sq] or
    [H, total_q]. Loops over sequences: a reference, not a fast path.
    """
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(len(cq) - 1):
            o, l = _reference_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal, scale, sinks,
                                  upcast, window_size, softcap)
            outs.append(o)
            lses.append(l)
        H = q.shape[1]
        out = torch.cat(outs) if outs else q.new_zeros((0, H, v.shape[-1]), dtype=torch.float32 if upcast else q.dtype)
        lse = torch.cat(lses, dim=1) if lses else torch.zeros(H, 0, device=q.device)
        return out, lse
    outs, lses = zip(*[_reference_one(q[b], k[b], v[b], causal, scale, sinks, upcast, window_size, softcap)
                       for b in range(q.shape[0])]) if q.shape[0] else ((), ())
    if not outs:
        return (q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32 if upcast else q.dtype),
                torch.zeros(0, q.shape[2], q.shape[1], device=q.device))
    return torch.stack(outs), torch.stack(lses)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool,
                    direction: str = "fwd") -> float:
    """FLOPs as FlashAttention's benchmarks count them: forward 4*B*H*Sq*Sk*D (two matmuls),
    halved when causal; backward 2.5x the forward (five matmuls, of which two recompute)."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * (2.5 if direction == "bwd" else 1.0)
