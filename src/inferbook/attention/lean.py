"""A Lean-Attention-like (stream-K) decode kernel: the KV tiles of the *whole batch* are laid end to
end and divided evenly over a fixed grid of programs, so where a request's keys are cut depends on
every other request in the batch — its position, the others' lengths, the batch size.

    out = lean_decode_attention(q, k_cache, v_cache, seqlens, ctas=None)

Shapes as `decode.decode_attention`: q [B, H, D]; k_cache, v_cache [B, S, Hk, D]; seqlens int [B].

The plan follows Lean Attention as AITER's Triton implementation (`aiter/ops/triton/lean_atten.py`,
after onnxruntime's) does it for decode: the work units are (kv head, request) pairs in kv-head-major
order, each of ceil(seqlen / BLOCK_N) tiles; the total is split over `ctas` programs (one per SM),
the first `total - (per - 1) * ctas` programs taking `per = ceil(total / ctas)` tiles and the rest
`per - 1`. A program walks its tile range, cutting at unit boundaries, and writes one partial
(unnormalized accumulator, running max, running sum) per piece. A unit's pieces are merged in
program order — the host program's piece first, then the later programs' — as AITER's host block
does. Differences from AITER: the merge is a second launch instead of an in-kernel wait on locks, and
the plan's pieces are listed on the host; the cuts and the merge order are the same, and they are
what decides the bits.

`plan_lean` is that plan; `lean_decode_attention` runs it (Triton; the PyTorch emulation
`lean_decode_reference` computes the same pieces and merge with torch ops, for the CPU path and as a
check of the plan).
"""
from __future__ import annotations

import math

import torch

from .. import device as _device
from ..errors import UserError
from . import decode

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne as _round
except Exception:  # pragma: no cover - no triton
    triton = None
    tl = None

BLOCK_N = decode.BLOCK_N
LOG2E = decode.LOG2E


def plan_lean(seqlens: list[int], kv_heads: int, ctas: int, block_n: int = BLOCK_N) -> dict:
    """The stream-K split of a batch's KV tiles over `ctas` programs.

    Returns {'ctas', 'total_tiles', 'per', 'pieces': [(program, b, kvh, tile_lo, tile_hi)] in global
    order, 'prog_ptr' [ctas + 1] and 'unit_ptr' [Hk * B + 1] (CSR offsets into pieces; unit u =
    kvh * B + b)}. A request with seqlen 0 has no tiles and no pieces."""
    if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1:
        raise UserError(f"ctas must be a positive int, got {ctas!r}")
    B = len(seqlens)
    tiles = [math.ceil(int(n) / block_n) for n in seqlens]
    units = [(kvh, b, tiles[b]) for kvh in range(kv_heads) for b in range(B)]
    total = sum(t for _, _, t in units)
    ctas = max(1, min(ctas, total))
    per = -(-total // ctas) if total else 0
    high = total - (per - 1) * ctas if total else 0
    bounds = []
    for p in range(ctas):
        start = per * p if p < high else (per - 1) * (p - high) + high * per
        bounds.append((start, start + (per if p < high else per - 1)))
    pieces = []
    unit_ptr = [0]
    g0 = 0                                              # global index of the unit's first tile
    p = 0
    for kvh, b, n in units:
        t = 0
        while t < n:
            while bounds[p][1] <= g0 + t:               # programs that end before this tile
                p += 1
            hi = min(n, bounds[p][1] - g0)
            pieces.append((p, b, kvh, t, hi))
            t = hi
        g0 += n
        unit_ptr.append(len(pieces))
    prog_ptr = [0] * (ctas + 1)
    for piece in pieces:
        prog_ptr[piece[0] + 1] += 1
    for i in range(ctas):
        prog_ptr[i + 1] += prog_ptr[i]
    return {"ctas": ctas, "total_tiles": total, "per": per, "pieces": pieces, "prog_ptr": prog_ptr,
            "unit_ptr": unit_ptr}


def cuts_of(plan: dict, b: int, kvh: int = 0) -> list[int]:
    """Where request b's keys are cut (tile indices inside the request) under `plan`."""
    return [lo for (_, pb, ph, lo, _) in plan["pieces"] if pb == b and ph == kvh][1:]


if triton is not None:
    @triton.jit
    def _lean_kernel(Q, K, V, SEQLENS, PIECES, PROG_PTR, MID_ACC, MID_M, MID_L, qk_scale,
                     stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, EMU: tl.constexpr):
        """One program of the fixed grid: its pieces in order; per piece the keys of tiles
        [tile_lo, tile_hi) of one (request, kv head), all G query heads together. Writes the
        piece's unnormalized accumulator and its running max and sum (base 2)."""
        pid = tl.program_id(0)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        g_mask = g < G
        d_mask = d < D
        first = tl.load(PROG_PTR + pid)
        last = tl.load(PROG_PTR + pid + 1)
        for s in range(first, last):
            b = tl.load(PIECES + s * 5 + 1)
            kvh = tl.load(PIECES + s * 5 + 2)
            seqlen = tl.load(SEQLENS + b)
            start = tl.load(PIECES + s * 5 + 3) * BLOCK_N
            end = tl.minimum(tl.load(PIECES + s * 5 + 4) * BLOCK_N, seqlen)
            q = tl.load(Q + b * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for lo in range(start, end, BLOCK_N):
                keys = lo + n
                k_mask = keys < end
                kv_off = b * stride_kb + keys[:, None] * stride_ks + kvh * stride_kh + d[None, :]
                k = tl.load(K + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
                v = tl.load(V + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
                if DOT_FP32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                sc = tl.dot(q, tl.trans(k)) * qk_scale
                sc = tl.where(k_mask[None, :], sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                p_lo = _round(p, V.dtype.element_ty, EMU)
                if DOT_FP32:
                    p_lo = p_lo.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p_lo, v)
                m = m_new
            rows = s * G + g
            tl.store(MID_M + rows, m, mask=g_mask)
            tl.store(MID_L + rows, l, mask=g_mask)
            tl.store(MID_ACC + rows[:, None] * D + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _lean_merge_kernel(MID_ACC, MID_M, MID_L, UNIT_PTR, OUT, B, H,
                           G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, EMU: tl.constexpr):
        """One program per (request, query head): the unit's pieces merged in program order (the
        host piece first), as Lean Attention's host block reduces the later blocks' partials."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        gi = h % G
        u = kvh * B + b
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        one = tl.arange(0, 1)
        first = tl.load(UNIT_PTR + u)
        last = tl.load(UNIT_PTR + u + 1)
        m = tl.full([1], float("-inf"), tl.float32)
        l = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(first, last):
            row = s * G + gi
            m_s = tl.load(MID_M + row + one)
            l_s = tl.load(MID_L + row + one)
            a_s = tl.load(MID_ACC + row * D + d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, m_s)
            live = m_new > float("-inf")
            alpha = tl.where(live, tl.exp2(m - m_new), 1.0)
            beta = tl.where(live, tl.exp2(m_s - m_new), 0.0)
            acc = acc * alpha + a_s * beta
            l = l * alpha + l_s * beta
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)
        tl.store(OUT + (b * H + h) * D + d, _round(out, OUT.dtype.element_ty, EMU), mask=d_mask)


def prepare(seqlens: list[int], kv_heads: int, ctas: int, device) -> dict:
    """The plan and its device tensors, built once per batch composition (a serving engine builds it
    with the batch's metadata, before the step): a timed call then does no host work or sync."""
    plan = plan_lean([int(n) for n in seqlens], kv_heads, ctas)
    dev = torch.device(device)
    return {**plan, "t_pieces": torch.tensor(plan["pieces"] or [(0, 0, 0, 0, 0)], dtype=torch.int32, device=dev),
            "t_prog_ptr": torch.tensor(plan["prog_ptr"], dtype=torch.int32, device=dev),
            "t_unit_ptr": torch.tensor(plan["unit_ptr"], dtype=torch.int32, device=dev), "kv_heads": kv_heads}


def lean_decode_attention(q, k_cache, v_cache, seqlens, *, ctas: int | None = None, scale: float | None = None,
                          return_plan: bool = False, prepared: dict | None = None):
    """Stream-K decode attention (see the module docstring). `ctas`: programs of the fixed grid
    (default: the device's SM count, `decode.sm_count`). `prepared` (from `prepare` for these
    seqlens) skips the host-side plan and the read of `seqlens`."""
    B, H, Hk, D, S = decode.check_inputs(q, k_cache, v_cache, seqlens, values=prepared is None)
    ok, why = _device.triton_backend_for(q.device)
    if not ok:
        raise UserError(f"lean_decode_attention needs Triton on {q.device}: {why}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if prepared is None:
        prepared = prepare(seqlens.tolist(), Hk, ctas or decode.sm_count(q.device), q.device)
    elif prepared.get("kv_heads") != Hk or len(prepared["unit_ptr"]) != Hk * B + 1:
        raise UserError("prepared plan does not match this batch (kv heads or batch size differ)")
    plan = {k: v for k, v in prepared.items() if not k.startswith("t_")}
    out = torch.empty_like(q)
    if B == 0:
        return (out, plan) if return_plan else out
    dev = q.device
    n_pieces = len(plan["pieces"])
    G = H // Hk
    mid_acc = torch.empty(max(n_pieces, 1), G, D, dtype=torch.float32, device=dev)
    mid_m = torch.empty(max(n_pieces, 1), G, dtype=torch.float32, device=dev)
    mid_l = torch.empty(max(n_pieces, 1), G, dtype=torch.float32, device=dev)
    for launch in _lean_launches(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                 seqlens.to(dev, torch.int32).contiguous(), prepared["t_pieces"],
                                 prepared["t_prog_ptr"], prepared["t_unit_ptr"], mid_acc, mid_m, mid_l, out, plan,
                                 scale, device=dev):
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return (out, plan) if return_plan else out


def _lean_launches(q, k, v, lens, pieces, prog_ptr, unit_ptr, mid_acc, mid_m, mid_l, out, plan: dict,
                   scale: float, *, device: torch.device) -> list:
    """The stream-K and merge launches (`compiled.Launch`) of `lean_decode_attention` for contiguous
    q [B, H, D], k/v [B, S, Hk, D], int32 lens [B], the plan's int32 pieces / prog_ptr / unit_ptr,
    the fp32 partials mid_acc [P, G, D], mid_m / mid_l [P, G] and out [B, H, D] (tensors or `meta`
    stand-ins). No stream-K launch when the plan has no piece (every length 0)."""
    from ..compiled import Launch

    B, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    BLOCK_D = max(16, triton.next_power_of_2(D))   # tl.dot needs every dimension >= 16
    BLOCK_G = max(16, triton.next_power_of_2(G))
    emu = _device.bf16_cast_needs_emulation(device)
    src = "attention/lean.py:lean_decode_attention"
    # NVIDIA: ptxas (Triton's --regAllocOptLevel=2) held the stream-K kernel to 128 registers and
    # spilled 8 B at D 40 on sm_90; `maxnreg` lifts that cap (157 registers, no spill). AMD has no such
    # option (Triton refuses the keyword there)
    regs = _device.pick_config({"nvidia": {"maxnreg": 255}, "hip": {}}, device)
    launches = []
    if plan["pieces"]:
        launches.append(Launch("stream-K", _lean_kernel,
                               [q, k, v, lens, pieces, prog_ptr, mid_acc, mid_m, mid_l, scale * LOG2E,
                                q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2)],
                               dict(G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                                    DOT_FP32=_device.dot_needs_fp32(device), EMU=emu, num_warps=4, **regs),
                               src, (plan["ctas"],)))
    launches.append(Launch("merge", _lean_merge_kernel, [mid_acc, mid_m, mid_l, unit_ptr, out, B, H],
                           dict(G=G, D=D, BLOCK_D=BLOCK_D, EMU=emu, num_warps=1), src, (B, H)))
    return launches


def lean_launches(seqlens: list[int], heads: int, kv_heads: int, head_dim: int, max_seqlen: int, *, ctas: int,
                  dtype=torch.bfloat16, name: str = "") -> list:
    """The launches `lean_decode_attention` makes on a GPU for a batch with these `seqlens` (cache
    [len(seqlens), max_seqlen, kv_heads, head_dim]) over `ctas` programs, without running them."""
    from ..compiled import meta

    plan = plan_lean([int(n) for n in seqlens], kv_heads, ctas)
    B, G, P = len(seqlens), heads // kv_heads, max(len(plan["pieces"]), 1)
    q = meta((B, heads, head_dim), dtype)
    k = meta((B, max_seqlen, kv_heads, head_dim), dtype)
    i32, f32 = torch.int32, torch.float32
    launches = _lean_launches(q, k, meta(k.shape, dtype), meta((B,), i32), meta((P, 5), i32),
                              meta((plan["ctas"] + 1,), i32), meta((kv_heads * B + 1,), i32),
                              meta((P, G, head_dim), f32), meta((P, G), f32), meta((P, G), f32), meta(q.shape, dtype),
                              plan, 1.0 / math.sqrt(head_dim), device=torch.device("cuda"))
    tag = f"B{B} x{plan['ctas']} pieces{len(plan['pieces'])} H{heads}/{kv_heads} D{head_dim} S{max_seqlen}"
    for la in launches:
        la.name = f"{name} lean {la.name} {tag}".strip()
    return launches


def position_sweep(*, batch_sizes, positions=("first", "middle", "last"), heads: int, kv_heads: int, head_dim: int,
                   max_seqlen: int, target_len: int, dtype=torch.bfloat16, device="cpu", seed: int = 0,
                   split_size: int = decode.DEFAULT_SPLIT_SIZE, ctas: int = 8) -> list[dict]:
    """The same request (q, keys, values, length) placed first, in the middle or last of batches of
    each size, the other requests random. One row per (kernel, batch, position): the followed
    request's cuts, its output bit pattern and its error against the fp32 reference. Kernels: the
    stream-K kernel ('lean (stream-K)') and the fixed-split deterministic path ('fixed split')."""
    import hashlib

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    tq = torch.randn(heads, head_dim, generator=g).to(dtype)
    tk = torch.randn(max_seqlen, kv_heads, head_dim, generator=g).to(dtype)
    tv = torch.randn(max_seqlen, kv_heads, head_dim, generator=g).to(dtype)
    rows = []
    for B in batch_sizes:
        gb = torch.Generator().manual_seed(seed * 1000 + B)
        q = torch.randn(B, heads, head_dim, generator=gb).to(dtype)
        k = torch.randn(B, max_seqlen, kv_heads, head_dim, generator=gb).to(dtype)
        v = torch.randn(B, max_seqlen, kv_heads, head_dim, generator=gb).to(dtype)
        lens = torch.randint(1, max_seqlen + 1, (B,), generator=gb)
        for pos in positions if B > 1 else ("only",):
            i = {"first": 0, "middle": B // 2, "last": B - 1, "only": 0}[pos]
            if (pos == "middle" and B < 3):
                continue
            qq, kk, vv, ll = q.clone(), k.clone(), v.clone(), lens.clone()
            qq[i], kk[i], vv[i], ll[i] = tq, tk, tv, target_len
            qq, kk, vv, ll = qq.to(device), kk.to(device), vv.to(device), ll.to(device)
            ref = decode.decode_attention_reference(qq[i:i + 1], kk[i:i + 1], vv[i:i + 1], ll[i:i + 1]).float()
            lean_out, plan = lean_decode_attention(qq, kk, vv, ll, ctas=ctas, return_plan=True)
            fixed_out = decode.decode_attention(qq, kk, vv, ll, True, split_size=split_size)
            for kernel, out, cuts in (("lean (stream-K)", lean_out, cuts_of(plan, i)),
                                      ("fixed split", fixed_out,
                                       list(range(split_size // BLOCK_N, math.ceil(target_len / BLOCK_N),
                                                  split_size // BLOCK_N)))):
                t = out[i:i + 1]
                rows.append({"kernel": kernel, "batch": B, "position": pos, "cuts": cuts,
                             "bits": hashlib.sha256(decode.output_bits(t)).hexdigest()[:16],
                             "max_err": float((t.float() - ref).abs().max()), "nan": bool(t.isnan().any())})
    return rows
