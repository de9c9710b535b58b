"""The MoE layer with W4A16 (or BF16) experts: gate/up GEMM + SiLU-and-mul, down GEMM, top-k combine.

    out[t] = Σ_j  w[t, j] · W2[e] ( SiLU(W1g[e] x[t]) ⊙ W1u[e] x[t] ),   e = topk_ids[t, j]

`w13 [E, 2I, H]` holds gate rows (first I) and up rows (next I); `w2 [E, H, I]`.

One Triton GEMM kernel serves the three layouts; what differs is how a row block finds its
rows (ROWS: gathered by slot id, a contiguous segment, or a masked slab of `[E, max_m, K]`)
and which packing spec its weight tiles are read in (LAYOUT). The gate/up launch fuses
SiLU-and-mul into its epilogue; the down launch applies the router weight in its epilogue
and writes one row per (token, slot) into `[T*k, H]`; a combine launch sums each token's k
rows in a fixed order (slot 0 first) in fp32.

`moe_tail` is the decode tail of the `kimi-topk-tail-fusion` chapter: the down projection
with the combine either as that separate pass or folded into the down kernel's epilogue; its
expert weights may be BF16, W4A16 (indexed) or MXFP4 (`moe.mxfp4`, decoded in registers).
`shared_*` are the two ways of running a shared expert (MiniMax M3 chapter).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..device import dot_needs_fp32, pick_config, triton_backend_for
from . import mxfp4 as MXF, routing
from . import mxfp4_decode as MXD
from .mxfp4 import PackedMXFP4
from .mxfp4_decode import DecodeMXFP4
from .w4a16 import (DECODE_MAX_M, DECODE_TARGETS, SWAP_MAX_M, LAYOUT_CODE, LAYOUTS, DecodeW4, PackedW4, cat_experts, check_block_k,
                    decode_asm, decode_linear, decode_packed_shapes, dequantize, dequantize_decode, expert, linear,
                    pack_decode, triton)
from .w4a16 import decode_weight_bytes as w4_decode_weight_bytes

if triton is not None:
    import triton.language as tl

    from .mxfp4 import mxfp4_tile
    from .mxfp4_decode import decode_run_fp4
    from .w4a16 import decode_neg, decode_run, decode_run_swapped, round_bf16, swapped_operands, w4_tile

    @triton.jit
    def moe_gemm_kernel(a_ptr, qw_ptr, s_ptr, c_ptr, rows_ptr, block_expert_ptr, counts_ptr, dest_ptr, roww_ptr,
                        n_rows, N, K, max_m, q_expert_stride, s_expert_stride,
                        stride_am, stride_ak, stride_cm, stride_cn,
                        ROWS: tl.constexpr, A_DIV: tl.constexpr, SCATTER: tl.constexpr, GATED: tl.constexpr,
                        MUL_ROW_WEIGHT: tl.constexpr, OUT_BF16: tl.constexpr, LAYOUT: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr, OUT_DIV: tl.constexpr = 1, ATOMIC: tl.constexpr = False):
        """C[rows, n] = A[rows] @ W[e].T for one expert's row block. GATED: N output columns from
        2N weight rows, out = SiLU(gate) * up. ROWS 0 = indexed, 1 = contiguous, 2 = masked.
        LAYOUT 0-2 = W4A16 specs, 3 = BF16 [N, K], 4 = MXFP4 (decoded in registers).

        Epilogue: the router weight of the row's slot (MUL_ROW_WEIGHT), then the row is written at
        slot // OUT_DIV; ATOMIC adds it into an fp32 C instead (OUT_DIV = k: the top-k combine as a
        scatter-add into the token's row, as TensorRT-LLM's fused-finalize epilogue does)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_end = K
        if ROWS == 0:    # indexed: slot ids sorted by expert; sentinel n_rows marks padding
            e = tl.load(block_expert_ptr + pid_m)
            k_end = tl.where(e >= 0, K, 0)  # a block past the last expert's run (-1) loads nothing
            e = tl.maximum(e, 0)
            slot = tl.load(rows_ptr + offs)
            valid = slot < n_rows
            a_row = slot // A_DIV          # gate/up: token = slot // k; down: the slot's own row
            c_row = slot
        elif ROWS == 1:  # contiguous: this block lies inside one expert's segment
            e = tl.load(block_expert_ptr + pid_m)
            k_end = tl.where(e >= 0, K, 0)  # a block past the last segment (-1, worst-case sizing) loads nothing
            e = tl.maximum(e, 0)
            valid = offs < n_rows
            a_row = offs
            c_row = offs
        else:            # masked: expert = grid axis 2, rows beyond its count are padding
            e = tl.program_id(2)
            count = tl.load(counts_ptr + e)
            valid = offs < count
            a_row = e * max_m + offs
            c_row = a_row
            k_end = tl.where(pid_m * BLOCK_M < count, K, 0)  # an empty block loads no weights
        if SCATTER:  # write each row at its (token, slot) position
            c_row = tl.load(dest_ptr + c_row, mask=valid, other=-1)
            valid = valid & (c_row >= 0)
        qw = qw_ptr + e.to(tl.int64) * q_expert_stride
        sc = s_ptr + e.to(tl.int64) * s_expert_stride
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATED:  # weight rows: gate [0, N), up [N, 2N)
            NW = 2 * N
        else:
            NW = N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak,
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
            if LAYOUT == 4:  # MXFP4: e2m1 x E8M0 is exact in BF16
                b = mxfp4_tile(qw, sc, k0, offs_n, NW, K, BLOCK_K, DOT_FP32).to(tl.bfloat16)
            else:
                b = w4_tile(qw, sc, k0, offs_n, NW, K, LAYOUT, GROUP, BLOCK_K, DOT_FP32)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
            if GATED:
                if LAYOUT == 4:
                    b_up = mxfp4_tile(qw, sc, k0, offs_n + N, NW, K, BLOCK_K, DOT_FP32).to(tl.bfloat16)
                else:
                    b_up = w4_tile(qw, sc, k0, offs_n + N, NW, K, LAYOUT, GROUP, BLOCK_K, DOT_FP32)
                if DOT_FP32:
                    acc_up = tl.dot(a.to(tl.float32), b_up.to(tl.float32), acc_up)
                else:
                    acc_up = tl.dot(a, b_up, acc_up)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if MUL_ROW_WEIGHT:  # router weight in the epilogue, indexed by the row's slot id
            w = tl.load(roww_ptr + c_row, mask=valid, other=0.0)
            acc = acc * w[:, None]
        mask = valid[:, None] & (offs_n[None, :] < N)
        out_row = c_row // OUT_DIV
        ptrs = c_ptr + out_row[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        if ATOMIC:  # fp32 C, zeroed by the caller; the k adds of a token land in any order
            tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        elif OUT_BF16:
            tl.store(ptrs, round_bf16(acc, DOT_FP32), mask=mask)
        else:
            tl.store(ptrs, acc, mask=mask)

    @triton.jit
    def combine_kernel(y_ptr, out_ptr, T, H, TOPK, OUT_BF16: tl.constexpr, EMULATE: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = Σ_j y[t*k + j] in fp32, j = 0, 1, ..., k-1 (a fixed order)."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_t[:, None] < T) & (offs_h[None, :] < H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for j in range(TOPK):
            rows = offs_t.to(tl.int64) * TOPK + j
            acc += tl.load(y_ptr + rows[:, None] * H + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        ptrs = out_ptr + offs_t[:, None].to(tl.int64) * H + offs_h[None, :]
        if OUT_BF16:
            tl.store(ptrs, round_bf16(acc, EMULATE), mask=mask)
        else:
            tl.store(ptrs, acc, mask=mask)

    @triton.jit
    def down_tail_kernel(act_ptr, qw_ptr, s_ptr, ids_ptr, w_ptr, out_ptr, N, K, TOPK, q_expert_stride,
                         s_expert_stride, FUSED: tl.constexpr, OUT_BF16: tl.constexpr, LAYOUT: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EMULATE: tl.constexpr):
        """Decode tail, token-major: for token t and a block of output columns, each of its k
        slots is a GEMV against its expert's down weights. FUSED: the k weighted rows are
        summed in registers (slot order) and one [N] row is stored; else each weighted row is
        stored into [T*k, N] for a separate combine pass. LAYOUT 0 = W4A16 indexed, 3 = BF16,
        4 = MXFP4 (e2m1 + E8M0 per 32, decoded in registers by `mxfp4_tile`)."""
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(TOPK):
            slot = t.to(tl.int64) * TOPK + j
            e = tl.load(ids_ptr + slot).to(tl.int64)
            wt = tl.load(w_ptr + slot)
            part = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(act_ptr + slot * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                if LAYOUT == 4:
                    b = mxfp4_tile(qw_ptr + e * q_expert_stride, s_ptr + e * s_expert_stride, k0, offs_n,
                                   N, K, BLOCK_K, EMULATE)
                else:
                    b = w4_tile(qw_ptr + e * q_expert_stride, s_ptr + e * s_expert_stride, k0, offs_n, N, K,
                                LAYOUT, GROUP, BLOCK_K, EMULATE).to(tl.float32)
                part += tl.sum(a[:, None] * b, axis=0)
            if FUSED:
                acc += wt * part
            else:
                y = wt * part
                if OUT_BF16:
                    tl.store(out_ptr + slot * N + offs_n, round_bf16(y, EMULATE), mask=offs_n < N)
                else:
                    tl.store(out_ptr + slot * N + offs_n, y, mask=offs_n < N)
        if FUSED:
            tl.store(out_ptr + t.to(tl.int64) * N + offs_n, round_bf16(acc, EMULATE), mask=offs_n < N)


    @triton.jit
    def moe_decode_kernel(a_ptr, qw_ptr, s_ptr, c_ptr, counts_ptr, dest_ptr, roww_ptr, N, K, max_m,
                          q_expert_stride, s_expert_stride, stride_am, stride_cm,
                          GATED: tl.constexpr, SCATTER: tl.constexpr, MUL_ROW_WEIGHT: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                          DOT_FP32: tl.constexpr, OUT_BF16: tl.constexpr = True, EVEN_N: tl.constexpr = False,
                          EVEN_K: tl.constexpr = False, CDNA_LOOP: tl.constexpr = False, SPLITS: tl.constexpr = 1,
                          part_ptr=None, lock_ptr=None):
        """Decode MoE GEMM over the masked layout (`routing.to_masked`), weights from `pack_decode`:
        program (column block, expert e) computes C[rows of e] = A[rows of e] @ W[e].T for its at most
        BLOCK_M (>= max_m) rows, with `decode_run`'s Marlin-style main loop. GATED: gate rows [0, N),
        up rows [N, 2N), out = SiLU(gate) * up. SCATTER: row r is written at dest[r] (its slot),
        times the slot's router weight (MUL_ROW_WEIGHT). An expert without rows loads nothing.
        SPLITS > 1 (grid (column blocks, E, SPLITS)): split pid_k takes runs [pid_k runs / SPLITS,
        (pid_k + 1) runs / SPLITS) of K / 256, stores its fp32 partials (gate, then up) at
        part [SPLITS, E * max_m, NW] and counts itself in lock int32 [E, column blocks] (zero between
        launches); the split that arrives last sums the SPLITS partials in split order (the same bits
        whichever arrives last), runs the epilogue and sets the count back to zero."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        count = tl.load(counts_ptr + e)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < count
        rows = e * max_m + offs_m
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if GATED:
            NW = 2 * N
        else:
            NW = N
        qw = qw_ptr + e.to(tl.int64) * q_expert_stride
        sc = s_ptr + e.to(tl.int64) * s_expert_stride
        a_rows = a_ptr + (e * max_m).to(tl.int64) * stride_am
        neg = decode_neg(BLOCK_N, DOT_FP32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the loop's bound is a function of K alone (the cost model reads its trips from the IR); an expert
        # without rows skips it as a whole
        if SPLITS == 1:
            if count > 0:
                for r in range(0, (K + 255) // 256):
                    acc = decode_run(acc, a_rows, stride_am, offs_m, m_ok, qw, sc, NW, pid_n * BLOCK_N, offs_n, n_ok, K, r,
                                     neg, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP)
                    if GATED:
                        acc_up = decode_run(acc_up, a_rows, stride_am, offs_m, m_ok, qw, sc, NW, pid_n * BLOCK_N + N, offs_n + N,
                                            n_ok, K, r, neg, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP)
            moe_decode_epilogue(acc, acc_up, c_ptr, dest_ptr, roww_ptr, rows, offs_n, m_ok, n_ok, stride_cm,
                                GATED, SCATTER, MUL_ROW_WEIGHT, DOT_FP32, OUT_BF16)
        elif count > 0:   # an expert without rows: no split loads, stores or counts anything
            pid_k = tl.program_id(2)
            runs = (K + 255) // 256
            for r in range((pid_k * runs) // SPLITS, ((pid_k + 1) * runs) // SPLITS):
                acc = decode_run(acc, a_rows, stride_am, offs_m, m_ok, qw, sc, NW, pid_n * BLOCK_N, offs_n, n_ok, K, r,
                                 neg, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP)
                if GATED:
                    acc_up = decode_run(acc_up, a_rows, stride_am, offs_m, m_ok, qw, sc, NW, pid_n * BLOCK_N + N, offs_n + N,
                                        n_ok, K, r, neg, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP)
            part_rows = tl.num_programs(1) * max_m
            mask = m_ok[:, None] & n_ok[None, :]
            p = part_ptr + (pid_k * part_rows + rows)[:, None].to(tl.int64) * NW + offs_n[None, :]
            tl.store(p, acc, mask=mask)
            if GATED:
                tl.store(p + N, acc_up, mask=mask)
            # every thread's partial is written before the count says so (the CUDA samples' "last block"
            # reduction: __syncthreads, then one release atomic); acq_rel makes the other splits' partials
            # visible to the one that arrives last
            stores_done(ASM)
            tl.debug_barrier()
            lock = lock_ptr + e * tl.num_programs(0) + pid_n
            if tl.atomic_add(lock, 1, sem="acq_rel") == SPLITS - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    q = part_ptr + (s * part_rows + rows)[:, None].to(tl.int64) * NW + offs_n[None, :]
                    acc += tl.load(q, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(q + N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(lock, 0, sem="relaxed")            # ready for the next launch
                moe_decode_epilogue(acc, acc_up, c_ptr, dest_ptr, roww_ptr, rows, offs_n, m_ok, n_ok, stride_cm,
                                    GATED, SCATTER, MUL_ROW_WEIGHT, DOT_FP32, OUT_BF16)

    @triton.jit
    def stores_done(ASM: tl.constexpr):
        """Before a CTA barrier that publishes this thread's global stores. NVIDIA: nothing (bar.sync orders a
        CTA's memory operations, and the release atomic after it is cumulative). AMDGCN (ASM 2): each wave
        waits for its stores to be acknowledged (s_waitcnt vmcnt(0)); Triton's barrier is a bare s_barrier,
        and the release atomic's own wait covers only the wave that issues it."""
        if ASM == 2:
            tl.inline_asm_elementwise("s_waitcnt vmcnt(0)", "=v,0", [tl.full((1,), 0, tl.int32)], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def moe_decode_epilogue(acc, acc_up, c_ptr, dest_ptr, roww_ptr, rows, offs_n, m_ok, n_ok, stride_cm,
                            GATED: tl.constexpr, SCATTER: tl.constexpr, MUL_ROW_WEIGHT: tl.constexpr,
                            DOT_FP32: tl.constexpr, OUT_BF16: tl.constexpr):
        """`moe_decode_kernel`'s epilogue on its fp32 [BLOCK_M, BLOCK_N] sums: SiLU(gate) * up (GATED),
        the scatter to the slot's row and its router weight, the store."""
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        c_row = rows
        valid = m_ok
        if SCATTER:
            c_row = tl.load(dest_ptr + rows, mask=m_ok, other=-1)
            valid = m_ok & (c_row >= 0)
        if MUL_ROW_WEIGHT:
            acc = acc * tl.load(roww_ptr + c_row, mask=valid, other=0.0)[:, None]
        ptrs = c_ptr + c_row[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        if OUT_BF16:
            tl.store(ptrs, round_bf16(acc, DOT_FP32), mask=valid[:, None] & n_ok[None, :])
        else:
            tl.store(ptrs, acc, mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def moe_decode_tail_kernel(a_ptr, qw_ptr, s_ptr, c_ptr, rows_ptr, block_expert_ptr, roww_ptr, n_rows, N, K,
                               q_expert_stride, s_expert_stride, stride_am, stride_cm, OUT_DIV: tl.constexpr,
                               ATOMIC: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr,
                               EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                               CDNA_LOOP: tl.constexpr = False, OUT_BF16: tl.constexpr = True,
                               FP4: tl.constexpr = False, FOLD: tl.constexpr = False,
                               ROW_WEIGHT: tl.constexpr = True, OUT_SORTED: tl.constexpr = False,
                               FMA_AMD: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
        """The decode tail's down projection on `decode_run`'s Marlin-style loop (FP4: `decode_run_fp4`'s, over
        `mxfp4_decode.pack_decode`'s words and E8M0 bytes, FOLD its scale-folding form), over the indexed layout
        (`routing.align_indexed` at BLOCK_M, 16 or swapped 8): program (column block, row block b) gathers the at most
        BLOCK_M slots of block b (all of one expert; the sentinel n_rows pads) and computes their rows of
        act @ W2[e].T from `pack_decode`'s words, then the epilogue: each row times its slot's router
        weight (ROW_WEIGHT), written at slot // OUT_DIV, or (OUT_SORTED, the latent tail's permuted rows) at
        the slot's position in the sorted order, pid_b * BLOCK_M + j. ATOMIC (the fused finalize, OUT_DIV = k):
        added into an fp32 [T, N] accumulator zeroed by the caller, so the k rows of a token meet there (in CTA
        order); else rows [T*k, N] (or [P, N], OUT_SORTED) in BF16 (OUT_BF16) or fp32 for a separate combine. A block past the last expert's run
        (-1) loads and writes nothing; the loop's bound is K's alone (the cost model reads its trips). OUT_DIV is a
        constexpr, as vLLM's `top_k: tl.constexpr` is: passed at run time, `slot // k` compiled to a full signed
        division a row (40 of the 992 instructions a warp on sm_100 at K3's tail); known, k 16 is a shift.
        SWAP_AB (W4A16 only, the NVIDIA configs, `decode_tail_config`): `w4a16.decode_run_swapped`'s loop, the
        weights the MMA's A operand and the block's BLOCK_M (8) slots its n8 B operand, the sums [BLOCK_N, BLOCK_M]
        stored through transposed pointers (`_tail_store`'s TRANSPOSED), the same rows in the same buffers."""
        pid_n = tl.program_id(0)
        pid_b = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_b)
        if e >= 0:
            slot = tl.load(rows_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
            m_ok = slot < n_rows
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            qw = qw_ptr + e.to(tl.int64) * q_expert_stride
            sc = s_ptr + e.to(tl.int64) * s_expert_stride
            if SWAP_AB:   # the weights as the MMA's A operand: sums [BLOCK_N, BLOCK_M]
                tl.static_assert(not FP4, "SWAP_AB runs the W4A16 loop only")
                neg_t, s_col = swapped_operands(offs_n, GROUP, DOT_FP32)
                acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for r in range(0, (K + 255) // 256):
                    acc_t = decode_run_swapped(acc_t, a_ptr, stride_am, slot, m_ok, qw, sc, N, offs_n, n_ok, K, r, neg_t,
                                               s_col, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K)
                _tail_store(acc_t, c_ptr, roww_ptr, slot, m_ok, offs_n, n_ok, pid_b, stride_cm, OUT_DIV, ATOMIC, BLOCK_M,
                            DOT_FP32, EVEN_N, OUT_BF16, ROW_WEIGHT, OUT_SORTED, True)
            else:
                neg = decode_neg(BLOCK_N, DOT_FP32)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r in range(0, (K + 255) // 256):   # the slot ids are the activation rows (gathered)
                    if FP4:
                        acc = decode_run_fp4(acc, a_ptr, stride_am, slot, m_ok, qw, sc, N, offs_n, n_ok, K, r, ASM,
                                             DOT_FP32, EVEN_N, EVEN_K, FOLD)
                    else:
                        acc = decode_run(acc, a_ptr, stride_am, slot, m_ok, qw, sc, N, pid_n * BLOCK_N, offs_n, n_ok, K,
                                         r, neg, GROUP, ASM, DOT_FP32, EVEN_N, EVEN_K, CDNA_LOOP, FMA_AMD)
                _tail_store(acc, c_ptr, roww_ptr, slot, m_ok, offs_n, n_ok, pid_b, stride_cm, OUT_DIV, ATOMIC, BLOCK_M,
                            DOT_FP32, EVEN_N, OUT_BF16, ROW_WEIGHT, OUT_SORTED, False)

    @triton.jit
    def _tail_store(acc, c_ptr, roww_ptr, slot, m_ok, offs_n, n_ok, pid_b, stride_cm, OUT_DIV: tl.constexpr,
                    ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_N: tl.constexpr,
                    OUT_BF16: tl.constexpr, ROW_WEIGHT: tl.constexpr, OUT_SORTED: tl.constexpr,
                    TRANSPOSED: tl.constexpr):
        """`moe_decode_tail_kernel`'s epilogue on its fp32 sums acc [BLOCK_M, BLOCK_N] (TRANSPOSED: [BLOCK_N,
        BLOCK_M], the swap-AB loop's): each slot's row times its router weight (ROW_WEIGHT), written at slot //
        OUT_DIV (OUT_SORTED: at pid_b * BLOCK_M + j), atomically added (ATOMIC) or stored in BF16 / fp32. The
        transposed form writes the same elements through transposed pointers (no transpose of the sums)."""
        if OUT_SORTED:
            out_row = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
        else:
            out_row = slot // OUT_DIV
        if TRANSPOSED:
            if ROW_WEIGHT:
                acc = acc * tl.load(roww_ptr + slot, mask=m_ok, other=0.0)[None, :]
            ptrs = c_ptr + out_row[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
            if ATOMIC and EVEN_N:   # every column in range: the rows' mask alone
                mask = tl.broadcast_to(m_ok[None, :], acc.shape)
            else:
                mask = n_ok[:, None] & m_ok[None, :]
        else:
            if ROW_WEIGHT:
                acc = acc * tl.load(roww_ptr + slot, mask=m_ok, other=0.0)[:, None]
            ptrs = c_ptr + out_row[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
            if ATOMIC and EVEN_N:   # every column in range: the rows' mask alone (gfx950: one s_and_b64 less an atomic;
                mask = tl.broadcast_to(m_ok[:, None], acc.shape)   # on the stores sm_100's ptxas then spilled)
            else:
                mask = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        elif OUT_BF16:
            tl.store(ptrs, round_bf16(acc, DOT_FP32), mask=mask)
        else:
            tl.store(ptrs, acc, mask=mask)


# ---------------------------------------------------------------------------
# References

def _weights(w, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, PackedW4):
        return dequantize(w, dtype)
    if isinstance(w, PackedMXFP4):
        return MXF.dequantize(w, dtype)
    return w.to(dtype)


def _moe_in(x, w13, w2, topk_weights, topk_ids, dtype) -> torch.Tensor:
    """Σₖ wₖ · W2ₑ(SiLU(W1gₑ x) ⊙ W1uₑ x) with weights, activations and matmuls in `dtype`
    and the combine in fp32. Returns fp32 [T, H]."""
    W13, W2 = _weights(w13, dtype), _weights(w2, dtype)
    I = W13.shape[1] // 2
    T, k = topk_ids.shape
    out = torch.zeros((T, W2.shape[1]), dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten().long()
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().flatten()
        t = slots // k
        h = x[t].to(dtype) @ W13[e].T
        y = (F.silu(h[:, :I]) * h[:, I:]) @ W2[e].T
        out.index_add_(0, t, topk_weights.flatten()[slots].float()[:, None] * y.float())
    return out


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """fp32 reference: dequantize, every product and sum in fp32. Returns fp32 [T, H]."""
    return _moe_in(x, w13, w2, topk_weights, topk_ids, torch.float32)


def fused_moe_torch(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """What PyTorch does in BF16 (the same precision): BF16 weights and matmuls, BF16 activation,
    fp32 combine. The FlashAttention-style tolerance is measured against this path's own error."""
    return _moe_in(x, w13, w2, topk_weights, topk_ids, torch.bfloat16).to(torch.bfloat16)


def within_tolerance(out: torch.Tensor, ref: torch.Tensor, out_torch: torch.Tensor, factor: float = 2.0):
    """FlashAttention's rule: our max error against the fp32 reference must be at most `factor` times
    PyTorch's own max error in the same precision (plus fp32 round-off of the reference). NaN fails.

    Returns (error, tolerance, passed)."""
    if out.numel() == 0:
        return 0.0, 0.0, out.shape == ref.shape
    err = float((out.float() - ref).abs().max())
    base = float((out_torch.float() - ref).abs().max())
    tol = factor * base + 1e-6 * float(ref.abs().max())
    ok = (err == err) and err <= tol and bool(torch.isfinite(out.float()).all())
    return err, tol, ok


# ---------------------------------------------------------------------------
# The layer

def moe_config(rows_per_expert: float, interpreted: bool) -> dict:
    """Block sizes: BLOCK_M follows the rows an expert sees (the M the seed says to record)."""
    if interpreted:  # few, large programs: the interpreter's cost is per program and per op
        return dict(BLOCK_M=16 if rows_per_expert <= 16 else 64, BLOCK_N=64, BLOCK_K=64)
    if rows_per_expert <= 16:
        # 32 columns, not 64: the gate/up launch's two [16, 64] accumulators and their dequantized tiles spilled
        # 20 B on sm_100 at 64, and at 32 the issue per weight falls (predicted, `inferbook inspect`: chord's decode
        # M1 gate_up 68 -> 77 % of the copy ceiling on H200, 50 -> 60 % on B200, 89 -> 100 % on A100; MiniMax-M3's
        # C32 gate_up 65 -> 80 % on H200; gfx942 42 -> 49 %), twice the CTAs filling the SMs' last round
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    # gate/up keeps two accumulators: BLOCK_N 64 keeps them at 64 fp32 registers per thread
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)


def _validate(x, w13, w2, topk_weights, topk_ids, layout, check=True):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown MoE layout {layout!r}; choose one of {', '.join(map(repr, LAYOUTS))}")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, PackedW4) or len(w.shape) != 3:
            raise ValueError(f"{name} must be a 3-D PackedW4 [E, N, K] from quantize(), got {type(w).__name__}")
        w.require(layout, f"the {layout!r} fused MoE kernel ({name})")
    E, two_i, H = w13.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {w13.shape} and {w2.shape}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != H:
        raise ValueError(f"x must be [T, {H}], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 (W4A16), got {x.dtype}")
    if check:
        routing._check_topk(topk_ids, E)
    elif not isinstance(topk_ids, torch.Tensor) or topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be a [T, k] tensor, got {getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    if topk_ids.shape[0] != x.shape[0] or not isinstance(topk_weights, torch.Tensor) \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={x.shape[0]}, k]; got "
                         f"{tuple(topk_ids.shape)} and {tuple(getattr(topk_weights, 'shape', ()))}")
    if not topk_weights.is_floating_point() or (check and topk_weights.numel() and not torch.isfinite(topk_weights).all()):
        raise ValueError("topk_weights must be finite floating-point values")
    for t, name in ((w13.qweight, "w13"), (w2.qweight, "w2"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def backend(device: torch.device) -> tuple[str, str]:
    """(backend name, reason) the layer will use on `device`."""
    ok, why = triton_backend_for(device)
    return ("triton", why) if ok else ("torch (dequantize + bf16 matmul)", f"Triton cannot run: {why}")


def fused_moe(x, w13: PackedW4, w2: PackedW4, topk_weights, topk_ids, layout: str | None = None, *,
              block: dict | None = None, max_m: int | None = None, inter_dtype=torch.bfloat16,
              out_dtype=torch.bfloat16, check: bool = True) -> torch.Tensor:
    """MoE layer for `x [T, H]` BF16 with INT4 experts packed for `layout` (default: w13's).

    topk_weights fp32 [T, k], topk_ids int [T, k]. Returns `[T, H]` in `out_dtype` (BF16; fp32 to
    keep the combine's sum unrounded, as the shared-expert check does). `inter_dtype` is the dtype
    of the `[T*k, H]` weighted rows between the down GEMM and the combine. `check=False` skips the
    checks that read values back to the host (expert-id range, finite weights): the indexed path
    then makes no device-to-host sync and can be captured in a CUDA graph (every layout; the masked
    one when `max_m` is given). `block`: None =
    `moe_config` for this device, "gpu" = the GPU's exact block constexprs even when interpreted
    (for the test matrix), or a dict of BLOCK_M/N/K (+ num_warps, num_stages).
    """
    layout = layout or getattr(w13, "layout", None)
    _validate(x, w13, w2, topk_weights, topk_ids, layout, check)
    if out_dtype not in (torch.bfloat16, torch.float32) or inter_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype and inter_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}, {inter_dtype}")
    E, two_i, H = w13.shape
    I = two_i // 2
    T, k = topk_ids.shape
    if T == 0:
        return torch.empty((0, H), dtype=out_dtype, device=x.device)
    ok, _ = triton_backend_for(x.device)
    if not ok:
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids).to(out_dtype)
    interp = x.device.type != "cuda"
    gpu_cfg = block == "gpu"  # the GPU's exact tiles, also in the interpreter
    cfg = dict(moe_config(T * k / E, False) if gpu_cfg else (block or moe_config(T * k / E, interp)))
    check_block_k(cfg["BLOCK_K"], w13.group_size, layout)
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    emu = dot_needs_fp32(x.device)
    weights_flat = topk_weights.float().contiguous().flatten()
    common = dict(LAYOUT=LAYOUT_CODE[layout], GROUP=w13.group_size, DOT_FP32=emu, **cfg)
    dummy = torch.empty(1, dtype=torch.int32, device=x.device)
    y = torch.empty((T * k, H), dtype=inter_dtype, device=x.device)

    def gemm(a, w, c, rows, block_expert, counts, dest, n_rows, N, K, grid, *, ROWS, A_DIV, SCATTER, GATED,
             MUL_ROW_WEIGHT, m_max=0):
        _run(_gemm_launch("", a, w.qweight, w.scales, c, rows, block_expert, counts, dest, weights_flat, n_rows, N, K,
                          m_max, w.qweight[0].numel(), w.scales[0].numel(), grid, ROWS=ROWS, A_DIV=A_DIV,
                          SCATTER=SCATTER, GATED=GATED, MUL_ROW_WEIGHT=MUL_ROW_WEIGHT, common=common,
                          source="moe/fused_moe.py:fused_moe"))

    if layout == "indexed":
        al = routing.align_indexed(topk_ids, E, BM, check=False)  # ids already checked (or check=False)
        nb = al.block_expert.numel()
        act = torch.empty((T * k, I), dtype=torch.bfloat16, device=x.device)
        gemm(x, w13, act, al.sorted_ids, al.block_expert, dummy, dummy, T * k, I, H, (nb, triton.cdiv(I, BN)),
             ROWS=0, A_DIV=k, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False)
        gemm(act, w2, y, al.sorted_ids, al.block_expert, dummy, dummy, T * k, H, I, (nb, triton.cdiv(H, BN)),
             ROWS=0, A_DIV=1, SCATTER=False, GATED=False, MUL_ROW_WEIGHT=True)
    elif layout == "grouped_contiguous":
        pc = routing.permute_contiguous(x, topk_ids, E, BM, check=False)  # ids checked above (or check=False)
        P, nb = pc.x.shape[0], pc.block_expert.numel()
        act = torch.empty((P, I), dtype=torch.bfloat16, device=x.device)
        gemm(pc.x, w13, act, dummy, pc.block_expert, dummy, dummy, P, I, H, (nb, triton.cdiv(I, BN)),
             ROWS=1, A_DIV=1, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False)
        gemm(act, w2, y, dummy, pc.block_expert, dummy, pc.dest, P, H, I, (nb, triton.cdiv(H, BN)),
             ROWS=1, A_DIV=1, SCATTER=True, GATED=False, MUL_ROW_WEIGHT=True)
    else:
        m = routing.to_masked(x, topk_ids, E, max_m, check=check)
        xm = m.x.reshape(E * m.max_m, H)
        act = torch.empty((E * m.max_m, I), dtype=torch.bfloat16, device=x.device)
        mb = triton.cdiv(m.max_m, BM)
        gemm(xm, w13, act, dummy, dummy, m.counts, dummy, E * m.max_m, I, H, (mb, triton.cdiv(I, BN), E),
             ROWS=2, A_DIV=1, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False, m_max=m.max_m)
        gemm(act, w2, y, dummy, dummy, m.counts, m.dest, E * m.max_m, H, I, (mb, triton.cdiv(H, BN), E),
             ROWS=2, A_DIV=1, SCATTER=True, GATED=False, MUL_ROW_WEIGHT=True, m_max=m.max_m)
    return combine(y, k, out_dtype, block="gpu" if gpu_cfg else None)


DECODE_MAX_ROWS = 16   # rows per expert the decode path takes (one m16 MMA tile)


def _last_round_full(ctas: int, sms: int) -> float:
    """How full the busiest SMs' last round is: (CTAs per SM on average) / (CTAs on the busiest SM)."""
    return ctas / sms / -(-ctas // sms)


def moe_decode_config(interpreted: bool, gated: bool = False, *, n: int | None = None, experts: int | None = None,
                      k: int | None = None, device=None) -> dict:
    """Tiles of `moe_decode_kernel`: BLOCK_N 128, 4 warps; the gated launch (two word tiles, two accumulators)
    BLOCK_N 64. The interpreter: BLOCK_N 64.
    Given the gated launch's `n` (its intermediate size) and `experts`, on NVIDIA targets a grid of at least one
    CTA an SM whose last round is far from full takes 32-column CTAs of 2 warps instead (twice the CTAs, the
    rounds fuller): an EP8 rank of MiniMax-M3 (9 local experts, 24 blocks of 64 columns: 216 CTAs on B200's
    148 SMs, the busiest SM 2 where the average has 1.46) is predicted at 75 % of the copy ceiling (waves)
    with 64 columns and 100 % (memory) with 32 (`inferbook inspect minimax-m3-moe --target sm_100`). On NVIDIA
    the column block is the only grain (no split-K: NVIDIA's machine code is the unsplit kernel's). The choice
    is made from host-side shapes only (no sync); the K order of every output is the same at either width.
    CDNA targets take `MOE_DECODE_CDNA`'s tiles and the decode kernels' CDNA loop, one stage, and, given also
    the gated launch's `k` (its hidden size), split-K (SPLITS) for a grid of few experts (`MOE_DECODE_CDNA`)."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=64)
    dev = torch.device("cuda") if device is None else device
    cdna = pick_config(MOE_DECODE_CDNA, dev)
    if cdna:                                                       # the CDNA loop, its own tiles and rule
        bn, warps = cdna["gated" if gated else "down"]
        cfg = dict(BLOCK_M=16, BLOCK_N=bn, num_warps=warps, num_stages=1, CDNA_LOOP=True)
        if gated and n and experts and k:
            cus = pick_config(DECODE_TARGETS, dev)["sms"]
            ctas, runs, splits = -(-n // bn) * experts, -(-k // 256), 1
            if ctas >= cus // 2:                                   # a grid too small for that stays as it is
                while ctas * warps * splits < cdna["waves_per_cu"] * cus and 2 * splits <= runs:
                    splits *= 2                                    # too few waves for the CUs' SIMDs: split K
            if splits > 1:
                cfg["SPLITS"] = splits
        return cfg
    cfg = dict(BLOCK_M=16, BLOCK_N=64 if gated else 128, num_warps=4, num_stages=3)
    if gated and n and experts:
        sms = pick_config(DECODE_TARGETS, dev)["sms"]
        wide, narrow = -(-n // 64) * experts, -(-n // 32) * experts
        if wide >= sms and _last_round_full(narrow, sms) > _last_round_full(wide, sms) + 0.1:
            cfg.update(BLOCK_N=32, num_warps=2)
    return cfg


# CDNA (`moe_decode_config`): (BLOCK_N, waves) of the gated and the down launch, the decode kernels' CDNA loop
# (`w4a16.decode_run`), no pipelining (num_stages 1: Triton's AMD stream pipeliner stages the words through LDS,
# which costs more instructions than it hides latency here; enough waves resident hide it instead). From
# `inferbook inspect chord-w4a16 --target gfx942` / `gfx950` sweeps at EP8 (48 experts, H 7168, I 2048, M 1):
# MI300X gate/up 64 columns of 2 waves, down 128 of 2, both predicted memory-bound (issue/memory 0.85, 0.74);
# MI355X gate/up 64 of 1 wave (2 waves: 1.17, issue-bound), down 128 of 2 (0.80, 0.95). The NVIDIA tiles above
# with 3 stages were predicted at 71-73 % (MI300X) and 46-58 % (MI355X) of the copy ceiling, issue-bound.
# Each 2-wave tile is now two 1-wave tiles of half its columns (MI300X gate/up 32 of 1, down 64 of 1; MI355X
# down 64 of 1): the same waves over the same columns, predicted alike (chord's EP8 rank unchanged; MiniMax-M3's
# launches 1410 -> 1412 us in all on MI300X, 958 -> 952 on MI355X), but no wave waits for another's share of an
# activation tile through LDS: a 2-wave tile's trip waited 9 to 11 loads one after another, a 1-wave one's one
# (`compiled.machine.load_rounds`, which the cost model does not charge).
# A gate/up grid of few experts (an EP rank) with fewer than `waves_per_cu` waves a CU splits K in 2, then 4
# (whole runs, equal where the runs divide: 24 at H 6144, 28 at H 7168), keeping its tiles: narrower tiles
# issue more a byte, and an unsplit CTA's runs are one latency each in a row. MiniMax-M3's ranks (I 1536,
# H 6144, `inspect minimax-m3-moe`): MI300X EP8 (9 experts) 4 splits, predicted 74 -> 100 % of the copy of
# the bytes moved (partials included; 32 columns unsplit before, issue/memory 0.96 -> 0.86), EP4 (17) 2
# splits, 94 -> 100 %; MI355X EP8 4 splits, 61 -> 100 % (16 columns before, latency-bound), EP4 2 splits,
# 75 -> 100 %. Three splits (8 runs a CTA) are predicted worse than four on both (78-84 %, waves), so the
# count doubles. A grid under half the CUs stays as it is (so the decode check's one-expert MoE keeps the
# fused slot's config: `test_decode_check_paths_share_one_config`). Every figure predicted, not measured:
# `python -m inferbook.moe.decode_sweep gfx950 1536 6144 --moe 9 --m 12 --block-n 32,64 --warps 1,2 --stages 1
# --splits 1,2,3,4` (and gfx942, --moe 17) prints each alternative's bounds.
MOE_DECODE_CDNA = {"nvidia": None, "hip": dict(gated=(32, 1), down=(64, 1), waves_per_cu=4),
                   "gfx950": dict(gated=(64, 1), down=(64, 1), waves_per_cu=2)}


def _decode_gemm_launch(name, a, qw, qs, c, counts, dest, roww, N, K, max_m, q_es, s_es, *, gated: bool, scatter: bool,
                        group: int, cfg: dict, device, source: str = "moe/fused_moe.py:fused_moe_decode",
                        part=None, lock=None):
    """One `moe_decode_kernel` launch (`compiled.Launch`): a [E * max_m, K] bf16 rows, decode-packed
    weights qw / scales qs (q_es, s_es elements per expert), c out rows; grid (column blocks, E), and
    (.., SPLITS) with `decode_split_buffers`' part and lock where cfg has SPLITS > 1."""
    from ..compiled import Launch

    E = counts.shape[0]
    emu = dot_needs_fp32(device)
    kw = dict(GATED=gated, SCATTER=scatter, MUL_ROW_WEIGHT=scatter, GROUP=group, ASM=decode_asm(device), DOT_FP32=emu,
              OUT_BF16=c.dtype == torch.bfloat16, EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_K=K % 256 == 0, **cfg)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), E)
    if cfg.get("SPLITS", 1) > 1:
        if part is None or lock is None:
            raise ValueError("a split-K decode launch needs its partials and lock buffers (decode_split_buffers)")
        kw.update(part_ptr=part, lock_ptr=lock)
        grid += (cfg["SPLITS"],)
    return Launch(name, moe_decode_kernel, [a, qw, qs, c, counts, dest, roww, N, K, max_m, q_es, s_es, a.stride(0),
                                            c.stride(0)], kw, source, grid)


# the arrival counts' workspace, one a (device, stream), grown when a launch needs more: zeroed once, and every
# split-K launch leaves its counts zero again (the last arrival resets its own), as vLLM's Marlin MoE keeps one
# zeroed workspace of locks (`marlin_make_workspace_new`) a layer instead of a zero fill a call. Launches on one
# stream run one after another, so they never share a count at once
_LOCK_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _lock_workspace(device, numel: int) -> torch.Tensor:
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device.type, device.index, stream)
    ws = _LOCK_WORKSPACE.get(key)
    if ws is None or ws.numel() < numel:
        ws = _LOCK_WORKSPACE[key] = torch.zeros(max(numel, 2 * ws.numel() if ws is not None else 0),
                                                dtype=torch.int32, device=device)
    return ws[:numel]


def decode_split_buffers(E: int, max_m: int, N: int, cfg: dict, *, gated: bool, device, meta: bool = False):
    """A split-K `moe_decode_kernel` launch's buffers: fp32 partials [SPLITS, E * max_m, 2N if gated else N]
    (fresh, from the caching allocator) and the int32 arrival counts [E, column blocks], a view of the
    stream's zeroed lock workspace (the kernel leaves them zero). (None, None) at one split."""
    if cfg.get("SPLITS", 1) == 1:
        return None, None
    shapes = ((cfg["SPLITS"], E * max_m, 2 * N if gated else N), (E, triton.cdiv(N, cfg["BLOCK_N"])))
    if meta:
        from ..compiled import meta as _meta

        return _meta(shapes[0], torch.float32), _meta(shapes[1], torch.int32)
    return (torch.empty(shapes[0], dtype=torch.float32, device=device),
            _lock_workspace(device, shapes[1][0] * shapes[1][1]).view(shapes[1]))


def fused_moe_decode(x, d13: DecodeW4, d2: DecodeW4, topk_weights, topk_ids, *, max_m: int | None = None,
                     inter_dtype=torch.bfloat16, out_dtype=torch.bfloat16, check: bool = True,
                     block: dict | str | None = None, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer at decode (at most 16 rows per expert) with experts repacked by `pack_decode`:
    rows in the masked layout, gate/up with SiLU-and-mul in its epilogue and down with the router
    weight and the scatter to [T*k, H] in its, both on the Marlin-style decode loop; then `combine`.
    x bf16 [T, H]; d13 [E, 2I, H], d2 [E, H, I]; returns [T, H] in `out_dtype`.
    `expert_map` (int [E_all], as vLLM's under expert parallelism): topk_ids are ids in [0, E_all) and
    expert_map[id] the local expert in [0, E) or -1 for one held elsewhere; such a slot is skipped
    (no row, its weighted row zero), so a local expert sees at most T rows whatever the others get."""
    for name, d in (("d13", d13), ("d2", d2)):
        if not isinstance(d, DecodeW4) or len(d.shape) != 3:
            raise ValueError(f"{name} must be a 3-D DecodeW4 from pack_decode(), got {type(d).__name__}")
    E, two_i, H = d13.shape
    I = two_i // 2
    if two_i % 2 or d2.shape != (E, H, I):
        raise ValueError(f"d13 must be [E, 2I, H] and d2 [E, H, I]; got {d13.shape} and {d2.shape}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != H or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 [T, {H}], got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}")
    T, k = topk_ids.shape
    if T == 0:
        return torch.empty((0, H), dtype=out_dtype, device=x.device)
    skip = expert_map is not None
    if skip:
        if not isinstance(expert_map, torch.Tensor) or expert_map.ndim != 1 or expert_map.device != x.device:
            raise ValueError(f"expert_map must be a 1-D int tensor on {x.device}, got {getattr(expert_map, 'shape', expert_map)!r}")
        if check:
            routing._check_topk(topk_ids, expert_map.numel())
            if expert_map.numel() and (int(expert_map.min()) < -1 or int(expert_map.max()) >= E):
                raise ValueError(f"expert_map's values must lie in [-1, {E}), got [{int(expert_map.min())}, {int(expert_map.max())}]")
        topk_ids = expert_map.long()[topk_ids.long()].to(torch.int32)
    m = routing.to_masked(x, topk_ids, E, max_m, check=check, skip_negative=skip)
    if m.max_m > DECODE_MAX_ROWS:
        raise ValueError(f"fused_moe_decode takes at most {DECODE_MAX_ROWS} rows per expert, got max_m = {m.max_m}; "
                         f"use fused_moe for larger batches")
    ok, _ = triton_backend_for(x.device)
    if not ok:
        W13, W2 = dequantize_decode(d13, torch.bfloat16), dequantize_decode(d2, torch.bfloat16)
        flat = topk_ids.flatten().long()
        out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
        for e in torch.unique(flat).tolist():
            if e < 0:            # expert_map's -1: held elsewhere
                continue
            slots = (flat == e).nonzero().flatten()
            h = x[slots // k] @ W13[e].T
            y = (F.silu(h[:, :I]) * h[:, I:]) @ W2[e].T
            out.index_add_(0, slots // k, topk_weights.flatten()[slots].float()[:, None] * y.float())
        return out.to(out_dtype)
    interp = x.device.type != "cuda"
    gpu = block == "gpu"
    xm = m.x.reshape(E * m.max_m, H)
    act = torch.empty((E * m.max_m, I), dtype=torch.bfloat16, device=x.device)
    # a skipped slot's row is written by no program: zero, so that the combine adds nothing for it
    y = (torch.zeros if skip else torch.empty)((T * k, H), dtype=inter_dtype, device=x.device)
    roww = topk_weights.float().contiguous().flatten()
    for (a, d, c, N, K, gated) in ((xm, d13, act, I, H, True), (act, d2, y, H, I, False)):
        shape = dict(n=N, experts=E, k=K, device=x.device) if gated else {}
        cfg = dict(moe_decode_config(False, gated, **shape) if gpu else (block or moe_decode_config(interp, gated, **shape)))
        part, lock = decode_split_buffers(E, m.max_m, N, cfg, gated=gated, device=x.device)
        _run(_decode_gemm_launch("", a, d.qweight, d.scales, c, m.counts, m.dest, roww, N, K, m.max_m,
                                 d.qweight[0].numel(), d.scales[0].numel(), gated=gated, scatter=not gated,
                                 group=d.group_size, cfg=cfg, device=x.device, part=part, lock=lock))
    return combine(y, k, out_dtype, block="gpu" if gpu else None)


def fused_moe_decode_launches(tokens: int, top_k: int, experts: int, hidden: int, inter: int, *, max_m: int,
                              group_size: int = 32, inter_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                              name: str = "", gated_cfg: dict | None = None) -> list:
    """`fused_moe_decode`'s gate/up and down launches plus its combine on a GPU (meta tensors);
    `gated_cfg` (a sweep's): the gate/up launch's config instead of `moe_decode_config`'s."""
    from ..compiled import meta

    T, k, E, H, I = tokens, top_k, experts, hidden, inter
    i32, bf16, f32 = torch.int32, torch.bfloat16, torch.float32
    dev = torch.device("cuda")
    counts, dest, roww = meta((E,), i32), meta((E * max_m,), i32), meta((T * k,), f32)
    act = meta((E * max_m, I), bf16)
    out = []
    for stage, a, c, N, K, gated in (("gate_up", meta((E * max_m, H), bf16), act, I, H, True),
                                     ("down", act, meta((T * k, H), inter_dtype), H, I, False)):
        q_es, s_es = (math.prod(sh) for sh in decode_packed_shapes(2 * N if gated else N, K, group_size))
        cfg = (gated and gated_cfg) or moe_decode_config(False, gated, **(dict(n=N, experts=E, k=K) if gated else {}))
        part, lock = decode_split_buffers(E, max_m, N, cfg, gated=gated, device=dev, meta=True)
        split = f" split{cfg['SPLITS']}" if part is not None else ""
        out.append(_decode_gemm_launch(f"{name} {stage} decode-packed T{T} k{k} E{E} H{H} I{I} M{max_m} cfg 16x{cfg['BLOCK_N']}x256"
                                       f"{split}".strip(), a, meta((E, q_es), i32), meta((E, s_es), bf16), c, counts, dest,
                                       roww, N, K, max_m, q_es, s_es, gated=gated, scatter=not gated, group=group_size,
                                       cfg=cfg, device=dev, part=part, lock=lock))
    out += combine_launches(T, k, H, inter_dtype, out_dtype, name=name)
    return out


def combine_config(interpreted: bool) -> dict:
    """Combine tiles: the interpreter wants few, large programs; a GPU many small ones."""
    return dict(BLOCK_T=64, BLOCK_H=128) if interpreted else dict(BLOCK_T=8, BLOCK_H=128)


def combine(y: torch.Tensor, k: int, out_dtype=torch.bfloat16, *, block=None) -> torch.Tensor:
    """[T*k, H] weighted rows -> [T, H]: each token's k rows summed in fp32, slot order.
    `block="gpu"`: the GPU's tiles even when interpreted."""
    TK, H = y.shape
    T = TK // k
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    ok, _ = triton_backend_for(y.device)
    if not ok:
        acc = torch.zeros((T, H), dtype=torch.float32, device=y.device)
        for j in range(k):
            acc += y.reshape(T, k, H)[:, j].float()
        return acc.to(out_dtype)
    cfg = combine_config(block != "gpu" and y.device.type != "cuda")
    _run(_combine_launch(y.contiguous(), out, k, cfg, device=y.device))
    return out


def _run(launch) -> None:
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)


def _gemm_launch(name, a, qw, qs, c, rows, block_expert, counts, dest, roww, n_rows, N, K, m_max, q_es, s_es, grid, *,
                 ROWS, A_DIV, SCATTER, GATED, MUL_ROW_WEIGHT, common: dict, OUT_DIV=None, ATOMIC=None,
                 source: str):
    """One `moe_gemm_kernel` launch (`compiled.Launch`): a [n_rows, K] activations, the packed expert
    weights qw / scales qs (q_es, s_es elements per expert), c [.., N] out, the routing tables
    (rows, block_expert, counts, dest: int32), roww fp32 router weights per slot; `common` = LAYOUT,
    GROUP, DOT_FP32 and the tiles. OUT_DIV / ATOMIC are passed only when given (the tail's epilogue)."""
    from ..compiled import Launch

    kw = dict(ROWS=ROWS, A_DIV=A_DIV, SCATTER=SCATTER, GATED=GATED, MUL_ROW_WEIGHT=MUL_ROW_WEIGHT,
              OUT_BF16=c.dtype == torch.bfloat16, **common)
    if OUT_DIV is not None:
        kw.update(OUT_DIV=OUT_DIV, ATOMIC=ATOMIC)
    return Launch(name, moe_gemm_kernel,
                  [a, qw, qs, c, rows, block_expert, counts, dest, roww, n_rows, N, K, m_max, q_es, s_es,
                   a.stride(0), a.stride(1), c.stride(0), c.stride(1)], kw, source, grid)


def _combine_launch(y, out, k: int, cfg: dict, *, device: torch.device):
    """`combine`'s launch (`compiled.Launch`): y [T*k, H] (bf16 or fp32) -> out [T, H]."""
    from ..compiled import Launch

    T, H = out.shape
    BT, BH = cfg["BLOCK_T"], cfg["BLOCK_H"]
    return Launch(f"combine y:{str(y.dtype)[6:]} -> {str(out.dtype)[6:]} T{T} k{k} H{H}", combine_kernel,
                  [y, out, T, H, k], dict(OUT_BF16=out.dtype == torch.bfloat16, EMULATE=dot_needs_fp32(device),
                                          BLOCK_T=BT, BLOCK_H=BH),
                  "moe/fused_moe.py:combine", (triton.cdiv(T, BT), triton.cdiv(H, BH)))


# ---------------------------------------------------------------------------
# The decode tail: combine as a separate pass, or folded into the down projection's epilogue

def _tail_weights(w2):
    """(qweight, scales, LAYOUT code, group, E, H, I) for an indexed PackedW4, a PackedMXFP4 or a
    BF16 [E, H, I] tensor."""
    if isinstance(w2, PackedMXFP4):
        if len(w2.shape) != 3:
            raise ValueError(f"w2 must be [E, H, I], got {w2.shape}")
        E, H, I = w2.shape
        return w2.qweight, w2.scales, MXF.LAYOUT_CODE, MXF.BLOCK, E, H, I
    if isinstance(w2, PackedW4):
        if len(w2.shape) != 3:
            raise ValueError(f"w2 must be [E, H, I], got {w2.shape}")
        w2.require("indexed", "the decode tail kernel")
        E, H, I = w2.shape
        return w2.qweight, w2.scales, LAYOUT_CODE["indexed"], w2.group_size, E, H, I
    if isinstance(w2, (DecodeW4, DecodeMXFP4)):
        if len(w2.shape) != 3:
            raise ValueError(f"w2 must be [E, H, I], got {w2.shape}")
        E, H, I = w2.shape
        return w2.qweight, w2.scales, None, w2.group_size, E, H, I
    if isinstance(w2, torch.Tensor) and w2.ndim == 3 and w2.dtype == torch.bfloat16:
        E, H, I = w2.shape
        w = w2.contiguous()
        return w, w, LAYOUT_CODE["bf16"], 32, E, H, I
    raise ValueError(f"w2 must be an indexed PackedW4, a PackedMXFP4, a decode-packed DecodeW4 or DecodeMXFP4 (kernel='decode') "
                     f"or a BF16 [E, H, I] tensor, got {type(w2).__name__}")


def token_major_config(interpreted: bool) -> dict:
    """Tiles of the token-major GEMV tail (`kernel="token-major"`)."""
    return dict(BLOCK_N=128, BLOCK_K=128) if interpreted else dict(BLOCK_N=64, BLOCK_K=128, num_warps=4)


TAIL_KERNELS = ("expert-major", "token-major", "decode")
DECODE_FORMATS = ("w4a16", "mxfp4")   # the decode tail's expert formats (`w4a16.pack_decode`, `mxfp4_decode.pack_decode`)


def pack_for_decode(w):
    """Expert weights repacked once, at load time, for the decode kernels: an indexed `PackedW4` by
    `w4a16.pack_decode`, a `PackedMXFP4` by `mxfp4_decode.pack_decode`."""
    return MXD.pack_decode(w) if isinstance(w, PackedMXFP4) else pack_decode(w)


def is_decode_packed(w) -> bool:
    """Whether `w` is in a decode kernel's packing (`pack_for_decode`)."""
    return isinstance(w, (DecodeW4, DecodeMXFP4))


def decode_format(w) -> dict:
    """The decode tail's format keywords for decode-packed weights `w`, as `decode_tail_config` and
    `_decode_tail_launch` take them: fp4 (MXFP4) and fold (`DecodeMXFP4.fold`; False for W4A16)."""
    return dict(fp4=isinstance(w, DecodeMXFP4), fold=getattr(w, "fold", False))


def decode_packed_meta(E: int, N: int, K: int, fmt: str):
    """Meta stand-ins of E experts' [N, K] weights in `fmt`'s decode packing (a `DecodeW4` or a folded
    `DecodeMXFP4` of meta tensors), for the launch builders."""
    from ..compiled import meta

    decode_weight_bytes(N, K, fmt)   # the format check
    if fmt == "mxfp4":
        qs, ss = MXD.decode_packed_shapes(N, K)
        return DecodeMXFP4(meta((E, *qs), torch.int32), meta((E, *ss), torch.uint8), (E, N, K))
    qs, ss = decode_packed_shapes(N, K)
    return DecodeW4(meta((E, *qs), torch.int32), meta((E, *ss), torch.bfloat16), (E, N, K), 32)


def decode_weight_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one [n, k] weight in the decode packing of `fmt` (DECODE_FORMATS; K padded to 256): what a
    decode kernel reads."""
    if fmt not in DECODE_FORMATS:
        raise ValueError(f"the decode kernels read {' or '.join(DECODE_FORMATS)} weights, got {fmt!r}")
    return MXD.decode_weight_bytes(n, k) if fmt == "mxfp4" else w4_decode_weight_bytes(n, k)
DECODE_TAIL_BLOCK_M = 16   # the decode tail's row blocks: one m16 MMA tile of one expert's slots
DECODE_TAIL_SWAP_BLOCK_M = SWAP_MAX_M   # swap-AB's (B200's W4A16 tail): the slots are the MMA's n8 operand
# MXFP4's stages on NVIDIA (`decode_tail_config`): 2 (its tiles' loads issued before the loop), 1 on sm_100
DECODE_TAIL_FP4_STAGES = {"nvidia": 2, "sm_100": 1}
# the W4A16 decode tail's NVIDIA tiles (`decode_tail_config` says why): sm_100 swaps the operands
DECODE_TAIL_NVIDIA = {"nvidia": dict(BLOCK_M=DECODE_TAIL_BLOCK_M, BLOCK_N=64, num_warps=2, num_stages=2),
                      "sm_100": dict(BLOCK_M=DECODE_TAIL_SWAP_BLOCK_M, BLOCK_N=64, num_warps=1, num_stages=1,
                                     SWAP_AB=True)}


def decode_tail_config(interpreted: bool, device=None, *, programs: int | None = None, fp4: bool = False,
                       fold: bool = True) -> dict:
    """Tiles of the decode tail (`moe_decode_tail_kernel`), given its grid's `programs` where known. Its K is
    one expert's FFN slice (Kimi K3: 256 a rank), so a CTA runs one or two runs of 256: there is nothing for
    a pipeline to overlap across runs. A second stage still matters where it makes the pipeliner issue every
    group's activation tile before the loop (NVIDIA's unswapped tiles, below); elsewhere one stage frees the
    registers the stages held.
    NVIDIA (`DECODE_TAIL_NVIDIA`): 64 columns on 2 warps, 2 stages. At one stage each trip waits 10 loads one
    after another (`machine.load_rounds`: the 8 groups' activation tiles staged one by one through one shared
    buffer, each load issued after the barrier that waits on the last one's store), which the cost model
    records but does not charge; at 2 stages the pipeliner issues them all as cp.async before the loop and a
    trip waits one (its scales). Predicted at K3's tail (k 16, 896 experts, H 3584, I 256), T 8: H200 14.1 us
    at 2 stages, issue-bound at 0.98 of the copy ceiling's 13.8 us (1 stage: 13.9, 0.99; the fused_moe
    decode-down tile, 128 columns on 4 warps, 3 stages: 16.8 us, waves); A100 32.6 us either way, memory-bound.
    Over the chapter's four T on H200: 180 us at 2 stages, 177 at 1, 190 at 3 (`inferbook sweep
    kimi-topk-tail-fusion sm_90 moe.decode_tail --kernel moe_decode_tail_kernel --launch "decode w4a16 fused"
    --set num_stages=1,2,3`); A100 414 at each. 1 stage was the least of the 18 configs swept that spill
    nothing (--set BLOCK_N=32,64,128 --set num_warps=1,2,4 --set num_stages=1,3); 2 is kept for the nine
    loads a trip no longer waits in turn, at 2 % more predicted time. At T 1 (8 MB) every config without a
    spill is 2.4 us there: two rounds of one-run CTAs.
    sm_100 swaps the operands (SWAP_AB, `w4a16.decode_run_swapped`'s loop; B200 brings 1.5x H200's bytes a cycle
    to an SM, so the 2-warp tile was issue-bound at 0.72 of memory's 8.3 us and latency-bound, 5 CTAs an SM at
    190 registers, 12.0 us at T 8): 8-slot row blocks, one warp of 64 columns (255 registers, 8 CTAs an SM; 24 B
    of spill: ptxas keeps three of the epilogue's slot ids in local memory across the loop, one store and one
    load each a warp). Predicted on B200: T 8 8.3 us, memory-bound, issue/memory 1.01 (latency 7.3); over the
    four T 110 us, was 149 (`inferbook sweep kimi-topk-tail-fusion sm_100 moe.decode_tail ... --set
    BLOCK_N=32,64,128 --set num_warps=1,2,4`: the least of the nine; 128 columns on 2 warps 111, spilling 32 B).
    Its trip waits 9 loads in turn (the activation tiles, as above); 2 or 3 stages leave 4 (each group's scales,
    loaded and moved into the accumulator's layout one group at a time) and cost 7 % / 13 % (118, 124 us; 2
    stages spill 144 B), so it keeps one.
    Swapped on sm_90 it is predicted 184 us over the four T, not 178: T 128's worst case of 8-slot blocks reads
    7 % more weights (`routing.max_blocks`) and H200's 2-warp tile already meets issue 21's bar; A100 alike.
    CDNA: the CDNA loop, one stage, one-wave CTAs: 128 columns for a grid of at least 2048 programs (at
    CDNA's 128-column tile, `_decode_tail_programs`), else 64; at 128 columns W4A16's scales by scalar FMAs (`FMA_AMD`, `w4a16._fma_amd`: LLVM's paired
    FMAs copied each column scale into register pairs, 288 moves a wave on gfx950). Over the four T: MI300X
    213 -> 179 us (T 8: 16.7 -> 14.1, memory 12.5; since OUT_DIV is a constexpr 12.8, and with FMA_AMD
    memory-bound at 12.5), MI355X 199 -> 160 us (T 8 since: 11.3, then 10.6, and with EVEN_N's row mask on
    the atomics 10.4, against memory's 8.3), issue-bound;
    128 columns on 1 wave was the best of the 9 swept at gfx942 and gfx950 (--set BLOCK_N=32,64,128 --set
    num_warps=1,2,4). At T 1 (448 programs) 128 columns on one wave leave the CUs half empty (MI300X 2.8 -> 4.8
    us), so small grids took 2 waves of 128; they now take the same waves as one-wave CTAs of 64 columns, so no
    wave waits for another's share of an activation tile through LDS (a trip waited 9 loads in turn, now one,
    `compiled.machine.load_rounds`): T 1 predicted MI300X 2.42 -> 2.40 us, MI355X 1.88 -> 1.84. The interpreter:
    BLOCK_N 64.
    fp4 (MXFP4 weights) with fold False (`DecodeMXFP4.fold` False, the exact-scale loop): W4A16's tile (on one warp
    its per-group fp32 scales spill 1.8 KB on sm_90, on two none) without FMA_AMD (compiled at K3's tail, T 8, one
    wave: gfx942 7412 -> 7492 instructions a wave with it, gfx950 4502 -> 4581). fp4 and fold (the folded
    loop): on NVIDIA 64 columns on one warp, no spill
    (`inferbook sweep kimi-topk-tail-fusion sm_90 moe.decode_tail_fp4 --kernel moe_decode_tail_kernel --launch "decode mxfp4
    fused" --set BLOCK_N=32,64,128 --set num_warps=1,2,4`: 198 us over the gpu preset's five launches, within
    1 % of the best of the nine, 128 columns on 2 warps; 2 warps at 64 columns: 222). H200 T 8: 13.1 us at one stage,
    memory-bound (13.2 at two, issue at 0.99 of memory); the least summed time of the nine at T 1-8 on sm_80 and sm_100
    (B200 11.6 us at T 8, issue-bound at 0.68). On NVIDIA both fp4 loops take 2 stages (`DECODE_TAIL_FP4_STAGES`):
    at one a trip waited 9 loads in turn (17 the exact loop's), at two none (8), predicted alike on A100 and H200
    (H200's 5358 us over the chapter's MXFP4 decode launches, 5359 at 2); B200, issue-bound, keeps one (2 stages:
    178 us over the gpu preset's six folded launches, 172 at 1). CDNA: the rule above (gfx942 T 8 19.0 us at 128 columns on
    1 wave, issue-bound at 0.62: the AMDGCN form multiplies in fp32)."""
    from .. import device as _device

    if interpreted:
        return dict(BLOCK_M=DECODE_TAIL_BLOCK_M, BLOCK_N=64)
    dev = torch.device("cuda") if device is None else device
    if pick_config(MOE_DECODE_CDNA, dev) is None:
        if fp4:
            cfg = dict(BLOCK_M=DECODE_TAIL_BLOCK_M, BLOCK_N=64, num_warps=1 if fold else 2,
                       num_stages=pick_config(DECODE_TAIL_FP4_STAGES, dev))
        else:
            cfg = dict(pick_config(DECODE_TAIL_NVIDIA, dev))
    else:   # one-wave CTAs: 128 columns for a big grid, else 64 (the waves of 2-wave 128-column CTAs, no LDS)
        big = programs is not None and programs >= DECODE_TAIL_ONE_WAVE_PROGRAMS
        cfg = dict(BLOCK_M=DECODE_TAIL_BLOCK_M, BLOCK_N=128 if big else 64, num_warps=1, num_stages=1, CDNA_LOOP=True)
        if big and not fp4:   # W4A16 at 128 columns a wave: the scales by scalar FMAs (`w4a16._fma_amd`)
            cfg["FMA_AMD"] = True
    return dict(_device.swept("moe.decode_tail_fp4" if fp4 and fold else "moe.decode_tail", cfg))


DECODE_TAIL_ONE_WAVE_PROGRAMS = 2048   # CDNA: from this grid on, 128 columns a one-wave program (`decode_tail_config`)


def decode_tail_block_m(fmt: str, device=None) -> int:
    """The decode tail's row block (`decode_tail_config`'s BLOCK_M) for `fmt` ('w4a16' or 'mxfp4') on `device`
    (None: a CUDA device, i.e. the `building_for` target; a CPU device: the interpreter's): 8 where B200 swaps
    W4A16's operands, else 16."""
    dev = torch.device("cuda") if device is None else device
    return decode_tail_config(dev.type != "cuda", dev, fp4=fmt == "mxfp4")["BLOCK_M"]


def moe_tail(act: torch.Tensor, w2, topk_weights, topk_ids, *, fused: bool, inter_dtype=torch.bfloat16,
             block=None, check: bool = True, kernel: str = "expert-major"):
    """Down projection of routed activations `act [T*k, I]` (slot order) plus the top-k combine.

    kernel="expert-major" (default; tensor cores): the slots are sorted by expert (`align_indexed`)
    and each row block of one expert goes through `moe_gemm_kernel`'s `tl.dot`, the router weight in
    its epilogue. fused=False: the epilogue writes one `[T*k, H]` row per slot (`inter_dtype`) and
    `combine` (vLLM's `moe_sum`) adds each token's k rows in slot order. fused=True: the epilogue
    adds the weighted row into the token's row of a zeroed fp32 `[T, H]` accumulator (atomic
    scatter-add, TensorRT-LLM's fused finalize), then one cast to BF16; the `[T*k, H]` rows never
    exist, and the k adds of a token land in whatever order the CTAs finish (not bitwise
    reproducible on a GPU).
    kernel="token-major": the older GEMV kernel, one program per token (no tensor cores), the k
    rows summed in registers in slot order when fused.
    kernel="decode" (w2 a `DecodeW4` from `w4a16.pack_decode` or a `DecodeMXFP4` from `mxfp4_decode.pack_decode`,
    repacked once at load time): `moe_decode_tail_kernel`, the same indexed layout at `decode_tail_config`'s BLOCK_M on the decode
    kernels' Marlin-style loop (dequantized nibbles or e2m1 codes straight into the MMA operand), the same
    two epilogues.

    Returns (out [T, H] BF16, launches, buffers): `buffers` maps each intermediate tensor the call
    allocated to its bytes, {"rows": [T*k, H] rows, "accumulator": fp32 [T, H]} (0 where absent).
    """
    qw, sc, code, group, E, H, I = _tail_weights(w2)
    if kernel not in TAIL_KERNELS:
        raise ValueError(f"kernel must be one of {TAIL_KERNELS}, got {kernel!r}")
    if (kernel == "decode") != is_decode_packed(w2):
        raise ValueError("kernel='decode' takes w2 decode-packed (w4a16.pack_decode of an indexed PackedW4, or "
                         f"mxfp4_decode.pack_decode of a PackedMXFP4), and only it does; got kernel={kernel!r} with "
                         f"{type(w2).__name__}")
    if not isinstance(act, torch.Tensor) or act.dtype != torch.bfloat16 or act.ndim != 2 or act.shape[1] != I:
        raise ValueError(f"act must be BF16 [T*k, {I}], got {getattr(act, 'dtype', None)} {tuple(getattr(act, 'shape', ()))}")
    if check:  # reads the ids back to the host; check=False for CUDA-graph capture
        routing._check_topk(topk_ids, E)
    T, k = topk_ids.shape
    if act.shape[0] != T * k or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"act must have T*k = {T * k} rows and topk_weights shape {tuple(topk_ids.shape)}")
    if inter_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"inter_dtype must be torch.bfloat16 or torch.float32, got {inter_dtype}")
    ok, _ = triton_backend_for(act.device)
    none = {"rows": 0, "accumulator": 0}
    if not ok or T == 0:
        return moe_tail_torch(act, w2, topk_weights, topk_ids, fused=fused, inter_dtype=inter_dtype), (1 if fused else 2), none
    gpu_cfg = block == "gpu"
    interp = act.device.type != "cuda"
    emu = dot_needs_fp32(act.device)
    ids = topk_ids.to(torch.int32).contiguous()
    w = topk_weights.float().contiguous()
    a = act.contiguous()
    q_es, s_es = qw[0].numel(), sc[0].numel()
    if kernel == "token-major":
        cfg = dict(token_major_config(False) if gpu_cfg else (block or token_major_config(interp)))
        check_block_k(cfg["BLOCK_K"], group, "indexed")
        grid = (T, triton.cdiv(H, cfg["BLOCK_N"]))
        extra = {"enable_fp_fusion": False}  # no FMA contraction: the fused and separate paths round alike
        if fused:
            out = torch.empty((T, H), dtype=torch.bfloat16, device=act.device)
            _run(_down_tail_launch(a, qw, sc, ids, w, out, H, I, k, q_es, s_es, fused=True, code=code, group=group,
                                   emu=emu, cfg={**cfg, **extra}, grid=grid))
            return out, 1, none
        y = torch.empty((T * k, H), dtype=inter_dtype, device=act.device)
        _run(_down_tail_launch(a, qw, sc, ids, w, y, H, I, k, q_es, s_es, fused=False, code=code, group=group,
                               emu=emu, cfg={**cfg, **extra}, grid=grid))
        return combine(y, k, block="gpu" if gpu_cfg else None), 2, {"rows": y.numel() * y.element_size(), "accumulator": 0}
    if kernel == "decode":
        cfg = dict(block if block and not gpu_cfg else
                   decode_tail_config(interp and not gpu_cfg, act.device, programs=_decode_tail_programs(T * k, E, H),
                                      **decode_format(w2)))
        al = routing.align_indexed(ids, E, cfg["BLOCK_M"], check=False)
        grid = (triton.cdiv(H, cfg["BLOCK_N"]), al.block_expert.numel())

        def decode(c, *, out_div, atomic):
            _run(_decode_tail_launch(a, qw, sc, c, al.sorted_ids, al.block_expert, w.flatten(), T, k, H, I, q_es, s_es,
                                     grid, out_div=out_div, atomic=atomic, group=group, cfg=cfg, device=act.device,
                                     **decode_format(w2)))

        return _expert_major_finish(decode, T, k, H, fused, inter_dtype, act.device, gpu_cfg)
    cfg = dict(moe_config(T * k / E, False) if gpu_cfg else (block or moe_config(T * k / E, interp)))
    check_block_k(cfg["BLOCK_K"], group, "indexed")  # MXFP4: group 32, whole blocks per tile
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    al = routing.align_indexed(ids, E, BM, check=False)
    dummy = torch.empty(1, dtype=torch.int32, device=act.device)
    grid = (al.block_expert.numel(), triton.cdiv(H, BN))

    def launch(c, *, out_div, atomic):
        _run(_tail_gemm_launch(a, qw, sc, c, al.sorted_ids, al.block_expert, dummy, w.flatten(), T, k, H, I, q_es,
                               s_es, grid, out_div=out_div, atomic=atomic, code=code, group=group, emu=emu, cfg=cfg))

    return _expert_major_finish(launch, T, k, H, fused, inter_dtype, act.device, gpu_cfg)


def _expert_major_finish(launch, T: int, k: int, H: int, fused: bool, inter_dtype, device, gpu_cfg: bool):
    """The two expert-major tails' (tl.dot and decode) outputs from `launch(c, out_div=, atomic=)`: fused, a
    zeroed fp32 [T, H] accumulator the launch adds into, then the cast (3 launches); separate, [T*k, H] rows
    in `inter_dtype`, then `combine` (2). Returns `moe_tail`'s (out, launches, buffers)."""
    if fused:
        acc = torch.zeros((T, H), dtype=torch.float32, device=device)
        launch(acc, out_div=k, atomic=True)
        return acc.to(torch.bfloat16), 3, {"rows": 0, "accumulator": acc.numel() * acc.element_size()}
    y = torch.empty((T * k, H), dtype=inter_dtype, device=device)
    launch(y, out_div=1, atomic=False)
    return combine(y, k, block="gpu" if gpu_cfg else None), 2, {"rows": y.numel() * y.element_size(), "accumulator": 0}


def _down_tail_launch(a, qw, sc, ids, w, c, H, I, k, q_es, s_es, *, fused: bool, code: int, group: int, emu: bool,
                      cfg: dict, grid):
    """The token-major tail's `down_tail_kernel` launch (`compiled.Launch`): a [T*k, I] bf16, w2 words
    and scales, ids int32 / w fp32 [T, k], c = out [T, H] bf16 (fused) or rows [T*k, H]."""
    from .. import device as _device
    from ..compiled import Launch

    # NVIDIA: ptxas (Triton's --regAllocOptLevel=2) held this kernel to 128 registers and spilled 8 B
    # (MXFP4, fused, sm_100); `maxnreg` lifts the cap. AMD has no such option (Triton refuses it there)
    regs = _device.pick_config({"nvidia": {"maxnreg": 255}, "hip": {}}, a.device)
    return Launch("down_tail token-major", down_tail_kernel, [a, qw, sc, ids, w, c, H, I, k, q_es, s_es],
                  dict(FUSED=fused, OUT_BF16=c.dtype == torch.bfloat16, LAYOUT=code, GROUP=group, EMULATE=emu, **cfg,
                       **regs),
                  "moe/fused_moe.py:moe_tail", grid)


def _tail_gemm_launch(a, qw, sc, c, sorted_ids, block_expert, dummy, roww, T, k, H, I, q_es, s_es, grid, *,
                      out_div: int, atomic: bool, code: int, group: int, emu: bool, cfg: dict):
    """The expert-major tail's `moe_gemm_kernel` launch: the down GEMM with the router weight in the
    epilogue, rows written at slot // out_div (atomic: added into an fp32 [T, H] accumulator)."""
    return _gemm_launch("down_tail expert-major", a, qw, sc, c, sorted_ids, block_expert, dummy, dummy, roww, T * k, H,
                        I, 0, q_es, s_es, grid, ROWS=0, A_DIV=1, SCATTER=False, GATED=False, MUL_ROW_WEIGHT=True,
                        common=dict(LAYOUT=code, GROUP=group, DOT_FP32=emu, **cfg), OUT_DIV=out_div, ATOMIC=atomic,
                        source="moe/fused_moe.py:moe_tail")


def _decode_tail_programs(slots: int, E: int, H: int) -> int:
    """The decode tail's grid size at CDNA's tile, 128 columns and 16-row blocks (the tile `decode_tail_config`'s
    rule is about), for `slots` routed slots over E experts into H columns: from the shapes, as
    `routing.align_indexed`'s worst-case buffer is."""
    return triton.cdiv(H, 128) * (routing.padded_rows(slots, E, DECODE_TAIL_BLOCK_M) // DECODE_TAIL_BLOCK_M)


def _decode_tail_launch(a, qw, sc, c, sorted_ids, block_expert, roww, T, k, H, I, q_es, s_es, grid, *, out_div: int,
                        atomic: bool, group: int, cfg: dict, device, dram_bytes=None, fp4: bool = False,
                        fold: bool = False, row_weight: bool = True, out_sorted: bool = False,
                        name: str = "down_tail decode", source: str = "moe/fused_moe.py:moe_tail"):
    """The decode tail's `moe_decode_tail_kernel` launch (`compiled.Launch`): a [T*k, I] bf16 routed rows,
    `pack_decode`'s words qw / scales sc (q_es, s_es elements an expert), c = fp32 [T, H] (atomic) or rows
    [T*k, H]; grid (column blocks, row blocks of `align_indexed` at cfg's BLOCK_M)."""
    from ..compiled import Launch

    kw = dict(ATOMIC=atomic, GROUP=group, ASM=decode_asm(device), DOT_FP32=dot_needs_fp32(device),
              EVEN_N=H % cfg["BLOCK_N"] == 0, EVEN_K=I % 256 == 0, OUT_BF16=c.dtype == torch.bfloat16, **cfg,
              **(dict(FP4=True, FOLD=fold) if fp4 else {}),
              **({} if row_weight else {"ROW_WEIGHT": False}), **({"OUT_SORTED": True} if out_sorted else {}))
    return Launch(name, moe_decode_tail_kernel,
                  [a, qw, sc, c, sorted_ids, block_expert, roww, T * k, H, I, q_es, s_es, a.stride(0), c.stride(0)],
                  dict(OUT_DIV=out_div, **kw), source, grid, dram_bytes=dram_bytes)


def reorder_bound(out_a: torch.Tensor, out_b: torch.Tensor, act, w2, topk_weights, topk_ids):
    """Whether two BF16 tails that add the same k fp32 terms per element, in different orders, each
    rounded once to BF16, differ by no more than that allows: per element
    2 (k - 1) 2**-24 Σ|terms| (two fp32 sums of k terms) plus one BF16 ulp of the larger magnitude.
    Returns (ok, max |a - b| / bound). NaN fails."""
    k = topk_ids.shape[1]
    scale = moe_tail_reference(act, w2, topk_weights, topk_ids, absolute=True)
    order = 2 * max(k - 1, 1) * 2.0 ** -24 * scale * 1.01
    mag = torch.maximum(out_a.float().abs(), out_b.float().abs()) + order
    ulp = torch.where(mag > 0, torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-38))) - 7), torch.zeros_like(mag))
    bound = order + ulp
    diff = (out_a.float() - out_b.float()).abs()
    worst = float((diff / bound.clamp_min(1e-38)).max()) if diff.numel() else 0.0
    ok = bool(torch.isfinite(out_a.float()).all() and torch.isfinite(out_b.float()).all()) and bool((diff <= bound).all())
    return ok, worst


def _expert_weight(w2, e: int, dtype) -> torch.Tensor:
    """Expert e's [H, I] weights, dequantized (one expert at a time: bounded memory)."""
    if isinstance(w2, PackedW4):
        return dequantize(expert(w2, e), dtype)
    if isinstance(w2, PackedMXFP4):
        return MXF.dequantize(PackedMXFP4(w2.qweight[e], w2.scales[e], tuple(w2.shape[1:])), dtype)
    if isinstance(w2, DecodeW4):
        return dequantize_decode(_decode_expert(w2, e), dtype)
    if isinstance(w2, DecodeMXFP4):
        return MXD.dequantize_decode(DecodeMXFP4(w2.qweight[e], w2.scales[e], tuple(w2.shape[1:])), dtype)
    return w2[e].to(dtype)


def _tail_rows(act, w2, topk_weights, topk_ids, *, absolute: bool = False) -> torch.Tensor:
    """fp32 [T*k, H]: w[t, j] · W2[e] act[t*k + j], one expert at a time (the memory is the
    output plus one expert's weights, never a [T*k, H, I] gather). `absolute`: |w| |W2| |act|."""
    T, k = topk_ids.shape
    flat = topk_ids.flatten().long()
    wts = topk_weights.float().flatten()
    a = act.float()
    if absolute:
        wts, a = wts.abs(), a.abs()
    y = torch.zeros((T * k, _tail_weights(w2)[5]), dtype=torch.float32, device=act.device)
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().flatten()
        We = _expert_weight(w2, e, torch.float32)
        if absolute:
            We = We.abs()
        y[slots] = (a[slots] @ We.T) * wts[slots, None]
    return y


def moe_tail_torch(act, w2, topk_weights, topk_ids, *, fused: bool = False, inter_dtype=torch.bfloat16):
    """PyTorch tail: per-expert GEMMs into `[T*k, H]` (in `inter_dtype`), then the sum over k.
    PyTorch has no epilogue to fold the combine into; `fused` only keeps the rows in fp32."""
    T, k = topk_ids.shape
    y = _tail_rows(act, w2, topk_weights, topk_ids)
    if not fused:
        y = y.to(inter_dtype).float()
    return y.reshape(T, k, -1).sum(1).to(torch.bfloat16)


def moe_tail_reference(act, w2, topk_weights, topk_ids, *, absolute: bool = False) -> torch.Tensor:
    """fp32: Σ_j w[t, j] · W2[e] act[t*k + j]. `absolute=True`: Σ_j |w| |W2| |act| (the scale of the
    terms, for bounding how much summation order can change an fp32 sum)."""
    T, k = topk_ids.shape
    return _tail_rows(act, w2, topk_weights, topk_ids, absolute=absolute).reshape(T, k, -1).sum(1)


# ---------------------------------------------------------------------------
# Shared expert: a separate path, or one more always-selected slot
#
# Ordering (SGLang's `moe_fused_gate`, DeepGEMM #409's MegaMoE): out = rsf * Σ_j w_j y_j + shared(x),
# `routed_scaling_factor` (rsf) scales the routed sum *before* the shared expert's output is added;
# the shared expert is never scaled. In the fused form the rsf is folded into the routed slots'
# weights and the shared slot gets weight 1 (SGLang gives it sum(w) / rsf and scales the whole
# output by rsf after renormalizing, which is the same product).

def _check_rsf(routed_scaling_factor) -> float:
    rsf = float(routed_scaling_factor)
    if not (rsf > 0 and rsf < float("inf")):
        raise ValueError(f"routed_scaling_factor must be a finite positive number, got {routed_scaling_factor!r}")
    return rsf


def shared_separate(x, w13, w2, topk_weights, topk_ids, shared_w13: PackedW4, shared_w2: PackedW4, *,
                    round_each: bool = False, layout: str | None = None, routed_scaling_factor: float = 1.0,
                    block=None) -> torch.Tensor:
    """Routed experts (weights scaled by `routed_scaling_factor`) and the shared expert as two MoE
    calls, added. `round_each=True` rounds each branch to BF16 before the add (the usual separate
    path); False keeps both in fp32 and rounds once."""
    rsf = _check_rsf(routed_scaling_factor)
    T = x.shape[0]
    dt = torch.bfloat16 if round_each else torch.float32
    routed = fused_moe(x, w13, w2, topk_weights.float() * rsf, topk_ids, layout, out_dtype=dt, block=block)
    ones = torch.ones((T, 1), dtype=torch.float32, device=x.device)
    zeros = torch.zeros((T, 1), dtype=torch.int32, device=x.device)
    shared = fused_moe(x, shared_w13, shared_w2, ones, zeros, layout, out_dtype=dt, block=block)
    return (routed.float() + shared.float()).to(torch.bfloat16) if not round_each else routed + shared


def shared_mlp(x, shared_w13: PackedW4, shared_w2: PackedW4, *, block=None) -> torch.Tensor:
    """The shared expert as its own dense MLP: gate/up GEMM, SiLU-and-mul, down GEMM (BF16 out)."""
    g13, g2 = expert(shared_w13, 0), expert(shared_w2, 0)
    h = linear(x, g13, block=block)
    I = h.shape[-1] // 2
    return linear(F.silu(h[:, :I]) * h[:, I:], g2, block=block)


def routed_plus_shared_mlp(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2, *,
                           routed_scaling_factor: float = 1.0, check: bool = True, block=None,
                           shared_block=None) -> torch.Tensor:
    """The path before the fusion: routed MoE (its weights times `routed_scaling_factor`), the shared
    expert's own GEMMs and activation, the add. `block` sets the MoE's tiles; `shared_block` the shared
    MLP's dense GEMMs (None: the same `block`; a real separate path runs the dense kernel's own tuned
    tiles, `w4a16.linear_config`)."""
    rsf = _check_rsf(routed_scaling_factor)
    routed = fused_moe(x, w13, w2, topk_weights.float() * rsf, topk_ids, check=check, block=block)
    return routed + shared_mlp(x, shared_w13, shared_w2, block=block if shared_block is None else shared_block)


def shared_slot_weights(w13, w2, shared_w13, shared_w2):
    """Expert tables with the shared expert appended as expert E (done once, at load time)."""
    return cat_experts(w13, shared_w13), cat_experts(w2, shared_w2)


def shared_slot_routing(topk_weights, topk_ids, num_routed: int, routed_scaling_factor: float = 1.0):
    """The per-step routing table for k+1 slots: the routed slots' weights times
    `routed_scaling_factor`, then slot k = the shared expert (id `num_routed`) with weight 1.
    Returns (weights fp32 [T, k+1], ids int32 [T, k+1]). Device ops only (no host sync)."""
    rsf = _check_rsf(routed_scaling_factor)
    T = topk_ids.shape[0]
    dev = topk_ids.device
    ids = torch.cat([topk_ids.to(torch.int32), torch.full((T, 1), num_routed, dtype=torch.int32, device=dev)], 1)
    weights = torch.cat([topk_weights.float() * rsf, torch.ones((T, 1), dtype=torch.float32, device=dev)], 1)
    return weights, ids


def with_shared_slot(w13, w2, shared_w13, shared_w2, topk_weights, topk_ids, routed_scaling_factor: float = 1.0):
    """Expert tables with the shared expert appended as expert E, and routing with one more slot
    (id E, weight 1; routed weights times `routed_scaling_factor`) per token: the shared expert
    becomes part of the routed grouped GEMM."""
    a13, a2 = shared_slot_weights(w13, w2, shared_w13, shared_w2)
    weights, ids = shared_slot_routing(topk_weights, topk_ids, w13.shape[0], routed_scaling_factor)
    return a13, a2, weights, ids


def shared_fused(x, w13_all, w2_all, weights_all, ids_all, layout: str | None = None, *,
                 check: bool = True, block=None) -> torch.Tensor:
    """The routed grouped GEMM with the shared expert as slot k (see `with_shared_slot`)."""
    return fused_moe(x, w13_all, w2_all, weights_all, ids_all, layout, check=check, block=block)


def shared_fused_step(x, w13_all, w2_all, topk_weights, topk_ids, *, routed_scaling_factor: float = 1.0,
                      check: bool = True, block=None) -> torch.Tensor:
    """One decode step of the fused form as a server runs it: build the k+1-slot routing table
    from this step's router output, then one grouped MoE (the table build is part of the step)."""
    weights, ids = shared_slot_routing(topk_weights, topk_ids, w13_all.shape[0] - 1, routed_scaling_factor)
    return fused_moe(x, w13_all, w2_all, weights, ids, check=check, block=block)


def decode_step(tokens: int) -> bool:
    """Whether a step of `tokens` tokens runs on the decode kernels (`fused_moe_decode`, `decode_linear`):
    chord-w4a16's rule, at most DECODE_MAX_ROWS rows per expert and DECODE_MAX_M rows per dense GEMM,
    from the bound that holds before routing (a token picks an expert at most once, so no expert -- the
    shared one included -- sees more than `tokens` rows): no routing read back, the same rule for both paths."""
    return tokens <= min(DECODE_MAX_ROWS, DECODE_MAX_M)


class SharedDecodeWeights:
    """A shared-expert layer's experts repacked once (load time) for the decode kernels (`pack_decode`):
    the k+1 table `all13 [E+1, 2I, H]`, `all2 [E+1, H, I]` (routed experts, then the shared one as expert
    E: the fused slot), and views of it, no copy: the routed experts alone (`routed13`, `routed2`: the
    separate path's MoE), the shared expert as a one-expert table (`shared_moe13`, `shared_moe2`) and as
    two dense weights `shared13 [2I, H]`, `shared2 [H, I]` (the separate path's MLP)."""

    def __init__(self, w13: PackedW4, w2: PackedW4, shared_w13: PackedW4, shared_w2: PackedW4):
        self.all13, self.all2 = (pack_decode(a) for a in shared_slot_weights(w13, w2, shared_w13, shared_w2))
        E = w13.shape[0]
        self.routed13, self.routed2 = _decode_experts(self.all13, 0, E), _decode_experts(self.all2, 0, E)
        self.shared_moe13, self.shared_moe2 = _decode_experts(self.all13, E, E + 1), _decode_experts(self.all2, E, E + 1)
        self.shared13, self.shared2 = _decode_expert(self.all13, E), _decode_expert(self.all2, E)

    @property
    def num_routed(self) -> int:
        return self.routed13.shape[0]


def _decode_experts(d: DecodeW4, start: int, stop: int) -> DecodeW4:
    """Experts start..stop-1 of a 3-D decode-packed table (views)."""
    return DecodeW4(d.qweight[start:stop], d.scales[start:stop], (stop - start, *d.shape[1:]), d.group_size)


def _decode_expert(d: DecodeW4, e: int) -> DecodeW4:
    """Expert e of a 3-D decode-packed table as a 2-D [N, K] weight for `decode_linear` (views)."""
    return DecodeW4(d.qweight[e], d.scales[e], tuple(d.shape[1:]), d.group_size)


def shared_mlp_decode(x, shared13: DecodeW4, shared2: DecodeW4) -> torch.Tensor:
    """`shared_mlp` on the dense decode kernel (x [T <= 16, H] BF16): gate/up, SiLU-and-mul, down."""
    h = decode_linear(x, shared13)
    I = h.shape[-1] // 2
    return decode_linear(F.silu(h[:, :I]) * h[:, I:], shared2)


def routed_plus_shared_mlp_decode(x, dec: SharedDecodeWeights, topk_weights, topk_ids, *,
                                  routed_scaling_factor: float = 1.0, check: bool = True) -> torch.Tensor:
    """`routed_plus_shared_mlp` at decode (`decode_step`): the routed MoE on `fused_moe_decode` (max_m = T,
    the bound known without reading the routing back), the shared expert's MLP on `decode_linear`, the add."""
    rsf = _check_rsf(routed_scaling_factor)
    T = x.shape[0]
    routed = fused_moe_decode(x, dec.routed13, dec.routed2, topk_weights.float() * rsf, topk_ids, max_m=max(T, 1),
                              check=check)
    return routed + shared_mlp_decode(x, dec.shared13, dec.shared2)


def shared_separate_decode(x, dec: SharedDecodeWeights, topk_weights, topk_ids, *, round_each: bool = False,
                           routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """`shared_separate` on the decode kernel: the routed experts and the shared one as two
    `fused_moe_decode` calls, added (round_each=False: both in fp32, rounded once)."""
    rsf = _check_rsf(routed_scaling_factor)
    T = x.shape[0]
    dt = torch.bfloat16 if round_each else torch.float32
    routed = fused_moe_decode(x, dec.routed13, dec.routed2, topk_weights.float() * rsf, topk_ids, max_m=max(T, 1),
                              out_dtype=dt)
    ones = torch.ones((T, 1), dtype=torch.float32, device=x.device)
    zeros = torch.zeros((T, 1), dtype=torch.int32, device=x.device)
    shared = fused_moe_decode(x, dec.shared_moe13, dec.shared_moe2, ones, zeros, max_m=max(T, 1), out_dtype=dt)
    return (routed.float() + shared.float()).to(torch.bfloat16) if not round_each else routed + shared


def shared_fused_decode_step(x, dec: SharedDecodeWeights, topk_weights, topk_ids, *,
                             routed_scaling_factor: float = 1.0, check: bool = True) -> torch.Tensor:
    """`shared_fused_step` at decode (`decode_step`): the k+1-slot routing table, then one
    `fused_moe_decode` over the decode-packed k+1 table (max_m = T: the shared expert's exact count)."""
    weights, ids = shared_slot_routing(topk_weights, topk_ids, dec.num_routed, routed_scaling_factor)
    return fused_moe_decode(x, dec.all13, dec.all2, weights, ids, max_m=max(x.shape[0], 1), check=check)


def shared_reference(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2, *,
                     routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """fp32, from the definition: rsf * routed MoE + shared MLP, each computed on its own."""
    rsf = _check_rsf(routed_scaling_factor)
    T = x.shape[0]
    routed = fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
    one = torch.ones((T, 1), dtype=torch.float32, device=x.device)
    shared = fused_moe_reference(x, shared_w13, shared_w2, one, torch.zeros((T, 1), dtype=torch.int32, device=x.device))
    return rsf * routed + shared


def ep_shared_placement(num_routed: int, ep: int, num_shared: int = 1) -> list[dict]:
    """Where each expert lives under expert parallelism `ep` with the shared expert(s) fused as
    slots (SGLang's DeepEP shared-expert fusion, #20089; ROCm ATOM's all-to-all fusion): every
    rank's physical table is its E/ep routed experts followed by its own copy of the shared
    expert(s), so a token's shared slot is served on the token's own rank (no dispatch) and the
    shared weights are replicated ep times. One row per rank."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep <= 0 or num_routed % ep:
        raise ValueError(f"ep = {ep!r} must be a positive divisor of the {num_routed} routed experts")
    local = num_routed // ep
    return [{"rank": r, "routed experts": f"{r * local}..{(r + 1) * local - 1}", "physical slots": local + num_shared,
             "shared copy": f"physical id {r * (local + num_shared) + local}", "shared copies in total": ep}
            for r in range(ep)]


def ep_physical_ids(ids_all: torch.Tensor, num_routed: int, ep: int, token_rank: torch.Tensor,
                    num_shared: int = 1) -> torch.Tensor:
    """Logical k+1-slot ids -> physical ids in the widened per-rank layout of `ep_shared_placement`:
    routed id e -> e + (e // (E/ep)) * num_shared; the shared slot -> the copy on the token's rank
    (`token_rank` int [T]). As SGLang's `_fused_remap_deepep_kernel` maps them."""
    local = num_routed // ep
    ids = ids_all.long()
    routed = ids < num_routed
    phys_routed = ids + (ids // local) * num_shared
    phys_shared = token_rank.long()[:, None] * (local + num_shared) + local + (ids - num_routed)
    return torch.where(routed, phys_routed, phys_shared).to(torch.int32)


def ep_expert_map(rank: int, local: int, ep: int, device=None) -> torch.Tensor:
    """vLLM's `expert_map` for one rank of `ep` that each hold `local` experts in the widened physical
    layout (`ep_physical_ids`): int32 [ep * local], physical id p -> p - rank * local on this rank, -1 on
    the others (`fused_moe_decode(expert_map=...)` skips those slots)."""
    p = torch.arange(ep * local, device=device)
    base = rank * local
    return torch.where((p >= base) & (p < base + local), p - base, torch.full_like(p, -1)).to(torch.int32)

# ---------------------------------------------------------------------------
# Launch builders (inferbook.compiled): what `fused_moe`, `combine` and `moe_tail` launch on a
# GPU for given shapes, from the same config functions and argument lists, without running them

def _packed_elements(layout: str, N: int, K: int, group_size: int) -> tuple[int, int]:
    """(int32 words, scales) one expert's [N, K] weight holds in `layout` (w4a16's packing specs)."""
    from .w4a16 import PANEL, padded_k

    Kp = padded_k(K, layout)
    words = {"indexed": N * K // 8, "grouped_contiguous": Kp // 8 * N,
             "grouped_masked": -(-N // PANEL) * PANEL * Kp // 8}[layout]
    return words, N * K // group_size


def fused_moe_launches(tokens: int, top_k: int, experts: int, hidden: int, inter: int, layout: str = "indexed", *,
                       max_m: int | None = None, inter_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                       group_size: int = 32, block: dict | None = None, name: str = "") -> list:
    """`fused_moe`'s gate/up and down launches plus its combine for x [tokens, hidden] routed to
    `top_k` of `experts` experts (w13 [E, 2*inter, hidden], w2 [E, hidden, inter] packed for
    `layout`). `max_m` (masked layout): rows per expert (default: twice the mean, rounded up)."""
    from ..compiled import meta

    T, k, E, H, I = tokens, top_k, experts, hidden, inter
    cfg = dict(block or moe_config(T * k / E, False))
    check_block_k(cfg["BLOCK_K"], group_size, layout)
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dev = torch.device("cuda")
    common = dict(LAYOUT=LAYOUT_CODE[layout], GROUP=group_size, DOT_FP32=dot_needs_fp32(dev), **cfg)
    i32, bf16, f32 = torch.int32, torch.bfloat16, torch.float32
    dummy = meta((1,), i32)
    tag = f"{layout} T{T} k{k} E{E} H{H} I{I} cfg {BM}x{BN}x{cfg['BLOCK_K']} w{cfg.get('num_warps', 4)} s{cfg.get('num_stages', 3)}"
    out = []

    def gemm(stage, a, c, rows, block_expert, counts, dest, n_rows, N, K, grid, *, ROWS, A_DIV, SCATTER, GATED,
             MUL_ROW_WEIGHT, m_max=0):
        q_es, s_es = _packed_elements(layout, 2 * N if GATED else N, K, group_size)
        out.append(_gemm_launch(f"{name} {stage} {tag}".strip(), a, meta((E, q_es), i32), meta((E, s_es), bf16), c,
                                rows, block_expert, counts, dest, meta((T * k,), f32), n_rows, N, K, m_max, q_es, s_es,
                                grid, ROWS=ROWS, A_DIV=A_DIV, SCATTER=SCATTER, GATED=GATED,
                                MUL_ROW_WEIGHT=MUL_ROW_WEIGHT, common=common, source="moe/fused_moe.py:fused_moe"))

    y = meta((T * k, H), inter_dtype)
    P = routing.padded_rows(T * k, E, BM)                        # routing's worst-case buffer (indexed, contiguous)
    nb = P // BM
    if layout == "indexed":
        ids, be = meta((P,), i32), meta((nb,), i32)
        act = meta((T * k, I), bf16)
        gemm("gate_up", meta((T, H), bf16), act, ids, be, dummy, dummy, T * k, I, H, (nb, triton.cdiv(I, BN)),
             ROWS=0, A_DIV=k, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False)
        gemm("down", act, y, ids, be, dummy, dummy, T * k, H, I, (nb, triton.cdiv(H, BN)),
             ROWS=0, A_DIV=1, SCATTER=False, GATED=False, MUL_ROW_WEIGHT=True)
    elif layout == "grouped_contiguous":
        be, dest = meta((nb,), i32), meta((P,), i32)
        act = meta((P, I), bf16)
        gemm("gate_up", meta((P, H), bf16), act, dummy, be, dummy, dummy, P, I, H, (nb, triton.cdiv(I, BN)),
             ROWS=1, A_DIV=1, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False)
        gemm("down", act, y, dummy, be, dummy, dest, P, H, I, (nb, triton.cdiv(H, BN)),
             ROWS=1, A_DIV=1, SCATTER=True, GATED=False, MUL_ROW_WEIGHT=True)
    else:
        mm = max_m or max(1, 2 * -(-T * k // E))
        counts, dest = meta((E,), i32), meta((E * mm,), i32)
        act = meta((E * mm, I), bf16)
        mb = triton.cdiv(mm, BM)
        gemm("gate_up", meta((E * mm, H), bf16), act, dummy, dummy, counts, dummy, E * mm, I, H,
             (mb, triton.cdiv(I, BN), E), ROWS=2, A_DIV=1, SCATTER=False, GATED=True, MUL_ROW_WEIGHT=False, m_max=mm)
        gemm("down", act, y, dummy, dummy, counts, dest, E * mm, H, I, (mb, triton.cdiv(H, BN), E),
             ROWS=2, A_DIV=1, SCATTER=True, GATED=False, MUL_ROW_WEIGHT=True, m_max=mm)
    out += combine_launches(T, k, H, inter_dtype, out_dtype, name=name)
    return out


def combine_launches(tokens: int, top_k: int, hidden: int, y_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                     name: str = "") -> list:
    """`combine`'s launch for y [tokens*top_k, hidden] -> [tokens, hidden] on a GPU."""
    from ..compiled import meta

    la = _combine_launch(meta((tokens * top_k, hidden), y_dtype), meta((tokens, hidden), out_dtype), top_k,
                         combine_config(False), device=torch.device("cuda"))
    la.name = f"{name} {la.name}".strip()
    return [la]


def moe_tail_launches(tokens: int, top_k: int, experts: int, hidden: int, inter: int, fmt: str, *, fused: bool,
                      inter_dtype=torch.bfloat16, kernel: str = "expert-major", name: str = "",
                      fold: bool = True) -> list:
    """`moe_tail`'s launches on a GPU for act [tokens*top_k, inter] and w2 [E, hidden, inter] in
    `fmt` ('bf16', 'w4a16' (indexed) or 'mxfp4'), for `kernel` ('expert-major': `moe_gemm_kernel`
    with the router weight in its epilogue, atomically added into an fp32 [T, H] accumulator when
    fused; 'token-major': `down_tail_kernel`; 'decode', w4a16 or mxfp4: `moe_decode_tail_kernel` on
    `w4a16.pack_decode`'s or `mxfp4_decode.pack_decode`'s layout), plus `combine` when not fused. Each GEMM launch states its DRAM bytes
    (`tail_dram_bytes`): the weights of the experts it can reach, not the whole [E, H, I] table. `fold` (decode,
    mxfp4): False builds MXFP4's exact-scale path (`DecodeMXFP4.fold` False: a scale byte outside FOLD_SCALES)."""
    from ..compiled import meta

    if kernel not in TAIL_KERNELS:
        raise ValueError(f"kernel must be one of {TAIL_KERNELS}, got {kernel!r}")
    if kernel == "decode" and fmt not in DECODE_FORMATS:
        raise ValueError(f"the decode tail kernel takes {' or '.join(DECODE_FORMATS)} experts, got fmt {fmt!r}")
    T, k, E, H, I = tokens, top_k, experts, hidden, inter
    if kernel == "decode":
        fp4, fold = fmt == "mxfp4", fold and fmt == "mxfp4"
        qw, sc, code, group, *_ = _tail_weights(decode_packed_meta(E, H, I, fmt))
        q_es, s_es = qw[0].numel(), sc[0].numel()
    elif fmt == "bf16":
        qw = sc = meta((E, H, I), torch.bfloat16)
        code, group, q_es, s_es = LAYOUT_CODE["bf16"], 32, H * I, H * I
    elif fmt == "w4a16":
        qw, sc = meta((E, H, I // 8), torch.int32), meta((E, H, I // 32), torch.bfloat16)
        code, group, q_es, s_es = LAYOUT_CODE["indexed"], 32, H * I // 8, H * I // 32
    elif fmt == "mxfp4":
        qw, sc = meta((E, H, I // 2), torch.uint8), meta((E, H, I // MXF.BLOCK), torch.uint8)
        code, group, q_es, s_es = MXF.LAYOUT_CODE, MXF.BLOCK, H * I // 2, H * I // MXF.BLOCK
    else:
        raise ValueError(f"fmt must be 'bf16', 'w4a16' or 'mxfp4', got {fmt!r}")
    expert_bytes = q_es * qw.element_size() + (s_es * sc.element_size() if sc is not qw else 0)
    dev = torch.device("cuda")
    emu = dot_needs_fp32(dev)
    a, ids, w = meta((T * k, I), torch.bfloat16), meta((T, k), torch.int32), meta((T, k), torch.float32)
    c = meta((T, H), torch.float32) if fused else meta((T * k, H), inter_dtype)
    tag = f"{fmt} {'fused' if fused else 'separate y:' + str(inter_dtype)[6:]} T{T} k{k} H{H} I{I}"
    if kernel == "token-major":
        cfg = dict(token_major_config(False), enable_fp_fusion=False)
        c = meta((T, H), torch.bfloat16) if fused else c
        la = _down_tail_launch(a, qw, sc, ids, w, c, H, I, k, q_es, s_es, fused=fused, code=code, group=group, emu=emu,
                               cfg=cfg, grid=(T, triton.cdiv(H, cfg["BLOCK_N"])))
        la.dram_bytes = tail_dram_bytes(T, k, E, H, I, expert_bytes, None, c, atomic=False)
    elif kernel == "decode":
        cfg = decode_tail_config(False, programs=_decode_tail_programs(T * k, E, H), fp4=fp4, fold=fold)
        BM = cfg["BLOCK_M"]
        P = routing.padded_rows(T * k, E, BM)
        la = _decode_tail_launch(a, qw, sc, c, meta((P,), torch.int32), meta((P // BM,), torch.int32),
                                 meta((T * k,), torch.float32), T, k, H, I, q_es, s_es,
                                 (triton.cdiv(H, cfg["BLOCK_N"]), P // BM), out_div=k if fused else 1, atomic=fused,
                                 group=group, cfg=cfg, device=dev, fp4=fp4, fold=fold,
                                 dram_bytes=tail_dram_bytes(T, k, E, H, I, expert_bytes, BM, c, atomic=fused))
        tag += f" cfg {BM}x{cfg['BLOCK_N']}x256{' swap-AB' if cfg.get('SWAP_AB') else ''}"
    else:
        cfg = dict(moe_config(T * k / E, False))
        BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
        P = routing.padded_rows(T * k, E, BM)                     # routing.align_indexed's worst-case buffer
        la = _tail_gemm_launch(a, qw, sc, c, meta((P,), torch.int32), meta((P // BM,), torch.int32),
                               meta((1,), torch.int32), meta((T * k,), torch.float32), T, k, H, I, q_es, s_es,
                               (P // BM, triton.cdiv(H, BN)), out_div=k if fused else 1, atomic=fused, code=code,
                               group=group, emu=emu, cfg=cfg)
        la.dram_bytes = tail_dram_bytes(T, k, E, H, I, expert_bytes, BM, c, atomic=fused)
        tag += f" cfg {BM}x{BN}x{cfg['BLOCK_K']}"
    la.name = f"{name} {la.name} {tag}".strip()
    out = [la]
    if not fused:
        out += combine_launches(T, k, H, inter_dtype, torch.bfloat16, name=name)
    return out


def tail_dram_bytes(T: int, k: int, E: int, H: int, I: int, expert_bytes: int, block_m: int | None, out, *,
                    atomic: bool) -> int:
    """DRAM bytes of one tail GEMM launch, from shapes alone (the routing unseen, so its worst case):
    weights, one expert's `expert_bytes` per row block that can hold slots (`routing.max_blocks`; the
    token-major kernel (block_m None) reads its slot's expert for every slot, T*k), the activations
    [T*k, I] BF16, the router ids and weights (8 B a slot), the sorted ids and block experts (4 B each,
    `padded_rows`), and the output `out`: rows written once, or (atomic) an fp32 [T, H] accumulator read
    and written back once by its atomics (L2 absorbs the k adds of a token)."""
    if block_m is None:
        weights, routing_bytes = T * k * expert_bytes, T * k * 8
    else:
        P = routing.padded_rows(T * k, E, block_m)
        weights = routing.max_blocks(T * k, E, block_m) * expert_bytes
        routing_bytes = T * k * 8 + P * 4 + P // block_m * 4
    out_bytes = out.numel() * out.element_size() * (2 if atomic else 1)
    return weights + T * k * I * 2 + routing_bytes + out_bytes
