"""Gated DeltaNet's chunked forward on `tl.dot`, structured as flash-linear-attention's `chunk_gated_delta_rule`.

Three kernels, as fla's `chunk.py` calls them (fla-core 0.6: `gated_delta_rule/chunk_fwd.py` + `wy_fast.py`,
`common/chunk_delta_h.py`, `common/chunk_o.py`), chunk size BT = 64:

1. `gdn_chunk_wy_fwd_kernel`, one program per (chunk, head): G = chunk-local cumsum of g (fp32); the WY
   representation A = (I + beta k k^T exp(G_i - G_j), strictly lower)^-1 solved in fp32 by forward
   substitution and stored in the input dtype; w = A (beta exp(G) k) and u = A (beta v), both `tl.dot`,
   stored in the input dtype.
2. `gdn_chunk_state_fwd_kernel`, one program per (block of V, sequence, head), sequential over chunks:
   the running state h [K, BV] stays in fp32 registers; per chunk it is stored (input dtype) for the output
   kernel, v_new = u - w h (`tl.dot`, stored), and h <- exp(G_last) h + k^T (v_new exp(G_last - G)) (`tl.dot`).
3. `gdn_chunk_o_fwd_kernel`, one program per (block of V, chunk, head): o = scale (exp(G) q h + P v_new),
   P = q k^T exp(G_i - G_j) masked to i >= j *before* the exp — two `tl.dot`s into fp32, one more for P v_new.

Every dot takes input-dtype operands and accumulates in fp32 (bf16/fp16 on a GPU; fp32 inputs only in the
interpreter, with `input_precision="ieee"`), the precision `gdn.fla_precision` emulates and the harness's BF16 baseline allows. Varlen (packed THD
with `cu_seqlens`) is handled inside the kernels by a (sequence, chunk) table, as fla's `chunk_indices`; a
padded batch runs as B packed sequences. `use_qk_l2norm` normalizes q and k inside the kernels (fp32, rounded
to the input dtype, as fla's `l2norm_fwd` stores them). Where fla differs: it solves A by 16x16 diagonal blocks
merged with dots (we substitute row by row over the whole chunk), works in log2 units (exp2), autotunes
BV / warps / stages and keeps HV > H (grouped value heads). The backward is `gdn_chunk_bwd` (this forward +
fla's four backward kernels, as a `torch.autograd.Function`).
"""
from __future__ import annotations

import torch

from .. import device as _device

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne
except Exception:  # pragma: no cover
    triton = None
    tl = None

L2NORM_EPS = 1e-6   # fla's l2norm: x / sqrt(sum(x^2) + eps)
CHUNK = 64          # fla's chunk size

if triton is not None:
    @triton.jit
    def _operand(x, DT: tl.constexpr, EMULATE: tl.constexpr, DOT_FP32: tl.constexpr):
        """fp32 x rounded to the input dtype DT (a dot operand or a stored intermediate); under the
        interpreter the rounded value goes back to fp32 (its bf16 tl.dot is wrong)."""
        y = cast_rtne(x, DT, EMULATE)
        if DOT_FP32:
            y = y.to(tl.float32)
        return y

    @triton.jit
    def _ld(ptr, mask, DOT_FP32: tl.constexpr):
        """A stored input-dtype tile as a dot operand (fp32 under the interpreter: its bf16 dot is wrong)."""
        x = tl.load(ptr, mask=mask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _row_rnorm(ptr, rows, m_t, K, BT: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
        """1 / sqrt(sum over all of K of x^2 + eps) per row of q or k (fla's l2norm), or 1."""
        if USE_L2NORM:
            ss = tl.zeros([BT], dtype=tl.float32)
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                x = tl.load(ptr + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                            other=0.0).to(tl.float32)
                ss += tl.sum(x * x, 1)
            return tl.rsqrt(ss + 1e-6)
        else:
            return tl.full([BT], 1.0, tl.float32)

    @triton.jit
    def _load_rows(ptr, rows, m_t, K, o_d, m_d, rnorm, USE_L2NORM: tl.constexpr, DT: tl.constexpr,
                   EMULATE: tl.constexpr, DOT_FP32: tl.constexpr):
        """A [BT, BD] tile of q or k (rows: (token, head) rows; columns o_d of K), scaled by `rnorm`
        and rounded to the input dtype when normalizing (as fla's l2norm stores it), as the input
        dtype (fp32 under the interpreter)."""
        x = tl.load(ptr + rows[:, None] * K + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
        if USE_L2NORM:
            return _operand(x.to(tl.float32) * rnorm[:, None], DT, EMULATE, DOT_FP32)
        if DOT_FP32:
            return x.to(tl.float32)
        return x

    @triton.jit
    def _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT: tl.constexpr):
        """Chunk i_c of the (sequence, chunk) table for head i_h: its (token, head) rows of [TT, H, *],
        their mask, the row of its last valid token, its token offsets, the sequence's length T and the
        chunk's number i_t in the sequence."""
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = (bos + o_t) * H + i_h
        last_row = (bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        return rows, m_t, last_row, o_t, T, i_t

    @triton.jit
    def _state_block(cu_seqlens, chunk_offsets, H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """The program of a sequential-over-chunks state kernel (forward state, backward dh): grid (block
        of V, sequence * head); the state block [BK, BV] (all of K, columns o_v), its mask and offsets
        in [N, H, K, V], the sequence's first row bos, length T, first chunk boh and chunk count NT."""
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1)
        i_n = i_nh // H
        i_h = i_nh % H
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        NT = tl.cdiv(T, BT)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_s = m_k[:, None] & m_v[None, :]
        s_off = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        return i_h, bos, T, boh, NT, o_k, m_k, o_v, m_v, m_s, s_off

    @triton.jit
    def _state_chunk(h, g_cum, b_h, i_t, i_h, bos, T, boh, H, K, V, o_k, o_v, m_s, BT: tl.constexpr,
                     DT: tl.constexpr, EMULATE: tl.constexpr):
        """Chunk i_t of a state kernel: stores the running fp32 state b_h as the chunk's (input dtype,
        at [chunk, H, K, V]); returns the chunk's rows, their mask, G at its last valid row and G per row."""
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = (bos + o_t) * H + i_h
        p_h = h + ((boh + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, cast_rtne(b_h, DT, EMULATE), mask=m_s)
        last = tl.minimum(i_t * BT + BT, T) - 1
        b_G_last = tl.load(g_cum + (bos + last) * H + i_h)
        b_G = tl.load(g_cum + rows, mask=m_t, other=0.0)
        return rows, m_t, b_G_last, b_G

    @triton.jit
    def gdn_chunk_wy_fwd_kernel(k, v, g, beta, g_cum, A, w, u, cu_seqlens, chunk_indices, H, K, V,
                                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                                DT: tl.constexpr, EMULATE: tl.constexpr, DOT_FP32: tl.constexpr,
                                PRECISION: tl.constexpr):
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        rows, m_t, last_row, o_t, T, i_t = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
        o_i = tl.arange(0, BT)
        b_g = tl.load(g + rows, mask=m_t, other=0.0).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)                                       # chunk-local, fp32
        tl.store(g_cum + rows, b_G, mask=m_t)
        b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)
        # beta_i k_i.k_j exp(G_i - G_j) for j < i: the gate difference masked before the exp (j > i is
        # exp of a positive number that overflows with strong gates)
        rn_k = _row_rnorm(k, rows, m_t, K, BT, BK, USE_L2NORM)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            b_k = _load_rows(k, rows, m_t, K, o_k, o_k < K, rn_k, USE_L2NORM, DT, EMULATE, DOT_FP32)
            b_kk = tl.dot(b_k, tl.trans(b_k), b_kk, input_precision=PRECISION)
        strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_L = b_b[:, None] * b_kk * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))
        # (I + L)^-1 by forward substitution, row by row: X_i = e_i - sum_j L_ij X_j, over the chunk's
        # valid rows only (a partial last chunk stops early, as fla's solve_tril does)
        b_Ai = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(tl.minimum(BT, T - i_t * BT)):
            l_i = tl.sum(tl.where(o_i[:, None] == i, b_L, 0.0), 0)        # row i of L, over j
            x_i = tl.where(o_i == i, 1.0, 0.0) - tl.sum(l_i[:, None] * b_Ai, 0)
            b_Ai = tl.where(o_i[:, None] == i, x_i[None, :], b_Ai)
        b_Ai = tl.where(m_t[:, None] & m_t[None, :], b_Ai, 0.0)
        tl.store(A + rows[:, None] * BT + o_i[None, :], cast_rtne(b_Ai, DT, EMULATE), mask=m_t[:, None])
        b_Ab = _operand(b_Ai, DT, EMULATE, DOT_FP32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = m_t[:, None] & (o_v < V)[None, :]
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_v, other=0.0).to(tl.float32)
            b_u = tl.dot(b_Ab, _operand(b_v * b_b[:, None], DT, EMULATE, DOT_FP32), input_precision=PRECISION)
            tl.store(u + rows[:, None] * V + o_v[None, :], cast_rtne(b_u, DT, EMULATE), mask=m_v)
        b_kscale = b_b * tl.exp(b_G)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = m_t[:, None] & (o_k < K)[None, :]
            b_k = _load_rows(k, rows, m_t, K, o_k, o_k < K, rn_k, USE_L2NORM, DT, EMULATE, DOT_FP32).to(tl.float32)
            b_w = tl.dot(b_Ab, _operand(b_k * b_kscale[:, None], DT, EMULATE, DOT_FP32), input_precision=PRECISION)
            tl.store(w + rows[:, None] * K + o_k[None, :], cast_rtne(b_w, DT, EMULATE), mask=m_k)

    @triton.jit
    def gdn_chunk_state_fwd_kernel(k, w, u, g_cum, h, v_new, h0, ht, cu_seqlens, chunk_offsets, H, K, V,
                                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                                   USE_L2NORM: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
        i_h, bos, T, boh, NT, o_k, m_k, o_v, m_v, m_s, s_off = _state_block(cu_seqlens, chunk_offsets, H, K, V,
                                                                            BT, BK, BV)
        if HAS_H0:
            b_h = tl.load(h0 + s_off, mask=m_s, other=0.0).to(tl.float32)
        else:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)
        for i_t in range(NT):
            # the chunk's state stored (input dtype) before its update
            rows, m_t, b_G_last, b_G = _state_chunk(h, g_cum, b_h, i_t, i_h, bos, T, boh, H, K, V, o_k, o_v, m_s,
                                                    BT, DT, EMULATE)
            b_w = _ld(w + rows[:, None] * K + o_k[None, :], m_t[:, None] & m_k[None, :], DOT_FP32)
            m_tv = m_t[:, None] & m_v[None, :]
            b_v = tl.load(u + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_v = b_v - tl.dot(b_w, _operand(b_h, DT, EMULATE, DOT_FP32), input_precision=PRECISION)
            tl.store(v_new + rows[:, None] * V + o_v[None, :], cast_rtne(b_v, DT, EMULATE), mask=m_tv)
            b_vg = _operand(b_v * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None], DT, EMULATE, DOT_FP32)
            b_k = _load_rows(k, rows, m_t, K, o_k, m_k, _row_rnorm(k, rows, m_t, K, BT, BK, USE_L2NORM), USE_L2NORM,
                             DT, EMULATE, DOT_FP32)
            b_h = b_h * tl.exp(b_G_last) + tl.dot(tl.trans(b_k), b_vg, input_precision=PRECISION)
        tl.store(ht + s_off, b_h, mask=m_s)

    @triton.jit
    def gdn_chunk_o_fwd_kernel(q, k, v_new, h, g_cum, o, cu_seqlens, chunk_indices, scale, H, K, V,
                               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                               DT: tl.constexpr, EMULATE: tl.constexpr, DOT_FP32: tl.constexpr,
                               PRECISION: tl.constexpr):
        i_v = tl.program_id(0)
        i_c = tl.program_id(1)
        i_h = tl.program_id(2)
        rows, m_t, last_row, o_t, T, i_t = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
        o_i = tl.arange(0, BT)
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_o = tl.zeros([BT, BV], dtype=tl.float32)
        b_P = tl.zeros([BT, BT], dtype=tl.float32)
        h_base = h + (i_c.to(tl.int64) * H + i_h) * K * V             # chunks are numbered as in chunk_indices
        rn_q = _row_rnorm(q, rows, m_t, K, BT, BK, USE_L2NORM)
        rn_k = _row_rnorm(k, rows, m_t, K, BT, BK, USE_L2NORM)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q = _load_rows(q, rows, m_t, K, o_k, m_k, rn_q, USE_L2NORM, DT, EMULATE, DOT_FP32)
            b_k = _load_rows(k, rows, m_t, K, o_k, m_k, rn_k, USE_L2NORM, DT, EMULATE, DOT_FP32)
            b_h = _ld(h_base + o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :], DOT_FP32)
            b_o = tl.dot(b_q, b_h, b_o, input_precision=PRECISION)
            b_P = tl.dot(b_q, tl.trans(b_k), b_P, input_precision=PRECISION)
        b_G = tl.load(g_cum + rows, mask=m_t, other=0.0)
        incl = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_P = b_P * tl.exp(tl.where(incl, b_G[:, None] - b_G[None, :], float("-inf")))   # masked before exp
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = _ld(v_new + rows[:, None] * V + o_v[None, :], m_tv, DOT_FP32)
        b_o = (b_o * tl.exp(b_G)[:, None]
               + tl.dot(_operand(b_P, DT, EMULATE, DOT_FP32), b_v, input_precision=PRECISION)) * scale
        tl.store(o + rows[:, None] * V + o_v[None, :], cast_rtne(b_o, DT, EMULATE), mask=m_tv)


_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def chunk_blocks(K: int, V: int, device: torch.device) -> dict:
    """Tiles and warps per kernel. BK: the K tile of the wy and output kernels (64, as fla; the whole
    of K, at least 16, when smaller); the state kernel holds all of K (BK_STATE = next power of two)
    and a BV-column block of the fp32 state in registers: BV 64 up to K 128, 32 at K 256 (fla's
    autotuner picks 32 or 64), so the state is <= 8K values per program (sm_90/sm_100: 16 up to K 64 and
    32 at K 128, for more programs; also on CDNA; below); at K 256 the state kernel runs
    8 warps and 2 stages (4 warps spill on sm_90; 3 stages exceed sm_80's shared memory), at K 128 8 warps
    (4 spill on sm_80 and sm_100). The
    interpreter runs one program at a time: there the whole of V is one block.

    AMD (CDNA, `device.pick_config`'s 'hip' entry), same tiles: from K 128 the state kernel runs one
    stage (the software pipeline's extra copies of the w, u and k tiles sit in LDS: with NVIDIA's 3
    stages at K 128 and 2 at K 256 they outgrow gfx942's 64 KB, and at K 256 the kernel spills VGPRs on
    gfx942 and gfx950), and every dot takes `input_precision="ieee"` (`PRECISION`): for bf16/fp16
    operands the precision changes nothing, and gfx950's backend rejects the "tf32" NVIDIA passes.
    The compile tables record, beside each AMD row, what the NVIDIA config made on that target."""
    bk = max(16, min(64, triton.next_power_of_2(K)))
    bk_state = max(16, triton.next_power_of_2(K))
    bv_full = max(16, triton.next_power_of_2(V))
    if _device.wants_gpu_config(device):
        bv_state = min(bv_full, 64 if bk_state <= 128 else 32)
        bv_o = min(bv_full, 64)
    else:
        bv_state = bv_o = bv_full
    big = bk_state > 128
    out = dict(BK=bk, BK_STATE=bk_state, BV_WY=min(bv_full, 64), BV_STATE=bv_state, BV_O=bv_o,
               warps_wy=4, warps_state=8 if bk_state >= 128 else 4, stages_state=2 if big else 3, warps_o=4,
               gpu_precision="tf32")
    if _device.wants_gpu_config(device):
        # sm_90/sm_100 and CDNA: the state kernel walks the chunks one after another, so a launch with few programs
        # (V / BV x sequences x heads: 8 at the long single sequence) is bound by that chain's latency; BV 16
        # up to K 64 and 32 at K 128 give it 2-4x the programs, each a shorter chain. The backward's dhu
        # kernel takes the same BV (`gdn_chunk_bwd.bwd_blocks`). Predicted over the chapter's 19 state
        # launches 347 -> 158 us on H200 (the long K 64 sequence 197 -> 50 us) and 348 -> 143 us on B200; its
        # 18 dhu launches 169 -> 125 and 158 -> 99 us; MI300X 605 -> 218 and 515 -> 218 us, MI355X 314 -> 132 and
        # 311 -> 141 us; none slower, no spill. Not at K 256 (BV 16 is predicted slower there) nor on sm_80
        # (there it spilled 16-72 B and made five launches slower).
        #   inferbook sweep gdn-backward-check sm_90 gdn.chunk --kernel gdn_chunk_state_fwd_kernel \
        #     --set BV_STATE=16,32,64 --jobs 2     (gdn.bwd --kernel gdn_chunk_dhu_bwd_kernel likewise)
        fast = dict(out, BV_STATE=min(bv_full, 16 if bk_state <= 64 else 32) if bk_state <= 128 else bv_state)
        # CDNA: the state kernel on 4 waves at every K (8 at K >= 128 repeat address arithmetic and reductions
        # of tiles split over twice the waves): its 19 launches 218 -> 172 us on MI300X, 132 -> 118 on MI355X,
        # slower on none, no scratch (`... gfx942 gdn.chunk --kernel gdn_chunk_state_fwd_kernel --set warps_state=4,8`)
        amd = dict(fast, stages_state=1 if bk_state >= 128 else out["stages_state"], gpu_precision="ieee", warps_state=4)
        out = _device.swept("gdn.chunk", _device.pick_config({"nvidia": out, "sm_90": fast, "sm_100": fast,
                                                              "hip": amd}, device))
    return out


def chunk_tables(lengths: list[int], chunk: int = CHUNK) -> tuple[list[int], list[int]]:
    """fla's `prepare_chunk_indices` / `prepare_chunk_offsets`: the (sequence, chunk) pair of every
    chunk in order, flattened, and each sequence's first chunk."""
    indices, offsets = [], [0]
    for n, L in enumerate(lengths):
        nt = -(-L // chunk)
        indices += [x for i in range(nt) for x in (n, i)]
        offsets.append(offsets[-1] + nt)
    return indices, offsets


def _launches(q, k, v, g, beta, h0, cu, idx, offs, g_cum, A, w, u, h, v_new, ht, o, *, n_seqs: int,
              n_chunks: int, scale: float, has_h0: bool, l2norm: bool, device: torch.device,
              chunk: int = CHUNK) -> list:
    """The three `compiled.Launch`es of `chunked_triton` (tensors or `meta` stand-ins): q, k [TT, H, K],
    v [TT, H, V], g, beta [TT, H] in the input dtype, cu / idx / offs int32 tables."""
    from ..compiled import Launch

    TT, H, K = q.shape
    V = v.shape[-1]
    c = chunk_blocks(K, V, device)
    flags = dict(USE_L2NORM=l2norm, DT=getattr(tl, _TL_DTYPE[q.dtype]),
                 EMULATE=_device.bf16_cast_needs_emulation(device), DOT_FP32=_device.dot_needs_fp32(device),
                 PRECISION="ieee" if q.dtype == torch.float32 or _device.dot_needs_fp32(device) else c["gpu_precision"])
    dt = str(q.dtype)[6:]
    src = "numerics/gdn_chunk.py:chunked_triton"
    return [
        Launch(f"gdn chunk wy K{K} V{V} BT{chunk} {dt}", gdn_chunk_wy_fwd_kernel,
               [k, v, g, beta, g_cum, A, w, u, cu, idx, H, K, V],
               dict(BT=chunk, BK=c["BK"], BV=c["BV_WY"], num_warps=c["warps_wy"], **flags), src, (n_chunks, H)),
        Launch(f"gdn chunk state K{K} V{V} BV{c['BV_STATE']} {dt}", gdn_chunk_state_fwd_kernel,
               [k, w, u, g_cum, h, v_new, h0, ht, cu, offs, H, K, V],
               dict(BT=chunk, BK=c["BK_STATE"], BV=c["BV_STATE"], HAS_H0=has_h0, num_warps=c["warps_state"],
                    num_stages=c["stages_state"], **flags),
               src, (triton.cdiv(V, c["BV_STATE"]), n_seqs * H)),
        Launch(f"gdn chunk o K{K} V{V} BV{c['BV_O']} {dt}", gdn_chunk_o_fwd_kernel,
               [q, k, v_new, h, g_cum, o, cu, idx, scale, H, K, V],
               dict(BT=chunk, BK=c["BK"], BV=c["BV_O"], num_warps=c["warps_o"], **flags),
               src, (triton.cdiv(V, c["BV_O"]), n_chunks, H)),
    ]


def chunked_launches(batch: int, seqlen: int, heads: int, k_dim: int, v_dim: int, dtype=torch.bfloat16,
                     has_h0: bool = True, l2norm: bool = False) -> list:
    """The launches `chunked_triton` makes for a [batch, seqlen] problem on a GPU, without running it."""
    from ..compiled import meta

    TT = batch * seqlen
    n_chunks = batch * -(-seqlen // CHUNK)
    i32, f32 = torch.int32, torch.float32
    return _launches(meta((TT, heads, k_dim), dtype), meta((TT, heads, k_dim), dtype), meta((TT, heads, v_dim), dtype),
                     meta((TT, heads), dtype), meta((TT, heads), dtype), meta((batch, heads, k_dim, v_dim), f32),
                     meta((batch + 1,), i32), meta((2 * n_chunks,), i32), meta((batch + 1,), i32),
                     meta((TT, heads), f32), meta((TT, heads, CHUNK), dtype), meta((TT, heads, k_dim), dtype),
                     meta((TT, heads, v_dim), dtype), meta((n_chunks, heads, k_dim, v_dim), dtype),
                     meta((TT, heads, v_dim), dtype), meta((batch, heads, k_dim, v_dim), f32),
                     meta((TT, heads, v_dim), dtype), n_seqs=batch, n_chunks=n_chunks, scale=k_dim ** -0.5,
                     has_h0=has_h0, l2norm=l2norm, device=torch.device("cuda"))


def chunked_triton(q, k, v, g, beta, scale=None, initial_state=None, *, cu_seqlens=None,
                   use_qk_l2norm: bool = False):
    """Chunked Gated DeltaNet forward on `tl.dot` (no autograd). q, k [B, T, H, K], v [B, T, H, V],
    g, beta [B, T, H] in bf16 / fp16 / fp32 (K, V <= 256); initial_state [N, H, K, V] (N = B, or one per
    packed sequence with `cu_seqlens`, B = 1). Returns (o [B, T, H, V] in v's dtype, final state
    [N, H, K, V] fp32), as fla's `chunk_gated_delta_rule(output_final_state=True)`."""
    if any(t.requires_grad for t in (q, k, v, g, beta)) and torch.is_grad_enabled():
        raise ValueError("chunked_triton is forward-only: call it under torch.no_grad(), or use "
                         "`gdn_chunk_bwd.chunked_triton_autograd` (this forward + a chunked backward)")
    o, ht, _ = chunked_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return o, ht


def chunked_fwd(q, k, v, g, beta, scale=None, initial_state=None, *, cu_seqlens=None, use_qk_l2norm=False):
    """`chunked_triton`'s work, also for the backward (`gdn_chunk_bwd`): (o, final state, saved) where
    `saved` holds what the three kernels wrote (g_cum, A, w, u, h, v_new, flattened [TT, H, ...]) and the
    tables (cu, idx, offs as int32 tensors, lengths, N, scale)."""
    from . import gdn

    gdn._check(q, k, v, g, beta, None)
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if q.dtype not in _TL_DTYPE or len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"q, k, v must share one dtype of {list(_TL_DTYPE)}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cuda" and q.dtype == torch.float32:
        raise ValueError("chunked_triton takes bf16/fp16 on a GPU (fp32 would need FMA dots, which spill; "
                         "use gdn.chunked or gdn.recurrent_triton); fp32 runs only in the interpreter")
    if K > 256 or V > 256:
        raise ValueError(f"chunked_triton supports K, V <= 256, got K={K}, V={V}")
    if cu_seqlens is not None:
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T} with B == 1, got {cu} (B={B})")
    else:
        cu = [b * T for b in range(B + 1)]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    N = len(lengths)
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    TT = B * T
    idx, offs = chunk_tables(lengths)
    n_chunks = offs[-1]
    flat = lambda t, *tail: t.reshape(TT, H, *tail).contiguous()  # noqa: E731
    qf, kf, vf = flat(q, K), flat(k, K), flat(v, V)
    gf, bf = flat(g.to(q.dtype)), flat(beta.to(q.dtype))
    ht = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
    h0 = initial_state.float().contiguous() if initial_state is not None else ht
    o = torch.empty(TT, H, V, dtype=v.dtype, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    tables = dict(cu=torch.tensor(cu, **i32), idx=torch.tensor(idx, **i32), offs=torch.tensor(offs, **i32))
    bufs = {}
    if n_chunks:
        bufs = dict(g_cum=torch.empty(TT, H, dtype=torch.float32, device=dev),
                    A=torch.empty(TT, H, CHUNK, dtype=q.dtype, device=dev),
                    w=torch.empty(TT, H, K, dtype=q.dtype, device=dev), u=torch.empty(TT, H, V, dtype=q.dtype, device=dev),
                    h=torch.empty(n_chunks, H, K, V, dtype=q.dtype, device=dev),
                    v_new=torch.empty(TT, H, V, dtype=q.dtype, device=dev))
        for la in _launches(qf, kf, vf, gf, bf, h0, *tables.values(), *bufs.values(), ht, o, n_seqs=N, n_chunks=n_chunks,
                            scale=scale, has_h0=initial_state is not None, l2norm=use_qk_l2norm, device=dev):
            la.kernel[la.grid](*la.args, **la.kwargs)
    if initial_state is not None:   # sequences of length 0 keep their initial state
        empty = torch.tensor([L == 0 for L in lengths], device=dev)
        ht = torch.where(empty[:, None, None, None], initial_state.float(), ht)
    saved = dict(bufs, **tables, lengths=lengths, N=N, n_chunks=n_chunks, scale=scale)
    return o.reshape(B, T, H, V), ht, saved


chunked_triton.supports = {"varlen", "l2norm"}
