"""Kimi K3's latent MoE tail, with the top-k finalize in one of three places (vLLM #53152).

K3 runs its routed experts in a latent space (L = 3584, half the hidden size H = 7168). Under tensor
parallelism each of the N ranks holds a 1/N slice of every expert's intermediate dimension, so each
rank's down projection (GEMM2) yields a TP-partial latent row per (token, slot). The tail then
needs, per token: the k slot rows weighted and summed (the *finalize*), the N ranks' partials summed
(AllReduce), an RMSNorm over L, the up projection L -> H and the shared expert's output added.

    separate  (vLLM before #53152): GEMM2 writes unweighted rows in expert-sorted (permuted) order;
              a finalize kernel gathers each token's k rows through the permutation map, multiplies by
              the router weights, sums them in fp32 (slot order) and writes [T, L] BF16; the tail's
              collective kernel reads it back. 4 launches.
    atomic    (TensorRT-LLM's fused-finalize epilogue): a zero-filled fp32 [T, L], GEMM2 with the
              router weight in its epilogue adding each row into its token's row atomically, a cast
              to BF16. 5 launches, and the k adds land in whatever order the CTAs finish.
    deferred  (#53152, `do_finalize=False`): GEMM2's rows, the router weights and the permutation
              map go straight to the collective kernel, which gathers, weights and sums the rows as
              it loads them — the same arithmetic in the same order as `separate`, so the same bits —
              one launch and the [T, L] write + read fewer. 3 launches.

After the finalize the three paths share the collective (`collective_kernel`: every rank's BF16
partial summed in fp32 in rank order, rounded once, RMSNorm in fp32, rounded) and the up projection
(`up_proj_kernel`: x [T, L] @ W_up[H, L]^T + shared [T, H], fp32 accumulate, rounded once).

The AllReduce is a stand-in: one process holds all N ranks' GEMM2 outputs ([N, P, L]) and the
collective reads them all, where a real rank finalizes its own rows and receives N - 1 partials
from its peers (the push path is `comm`'s business). The byte counts say both: what this
process's launches move, and what one rank of the real protocol moves (`tail_costs`).

All Triton kernels launch with `enable_fp_fusion=False`, so `w * y + acc` rounds twice, as the
PyTorch reference does. Tensors: rows BF16, router weights fp32, perm int32 (slot -> permuted row,
-1 for a slot this rank does not hold), norm weight / W_up / shared BF16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import bf16_cast_needs_emulation, dot_needs_fp32, triton_backend_for
from . import fused_moe as FM, routing

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne as _round
except Exception:  # pragma: no cover - triton missing: only the references work
    triton = None

VARIANTS = ("separate", "atomic", "deferred")
GEMM2_KERNELS = ("expert-major", "decode")   # tl.dot `moe_gemm_kernel`, or the decode loop's `moe_decode_tail_kernel`
LAUNCHES = {"separate": ("GEMM2 (rows, permuted)", "finalize", "collective", "up-projection"),
            "atomic": ("zero-fill fp32 [T, L]", "GEMM2 (weight + atomic add)", "cast to BF16", "collective",
                       "up-projection"),
            "deferred": ("GEMM2 (rows, permuted)", "collective (+ finalize on load)", "up-projection")}

if triton is not None:
    @triton.jit
    def _finalize_row(rows_ptr, perm_ptr, w_ptr, t, cols, mask, L, K: tl.constexpr):
        """fp32 Σ_j w[t, j] · rows[perm[t, j]] over j = 0..K-1 in order (a slot with perm -1 adds nothing)."""
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for j in range(K):   # a loop, not unrolled: K = 16 unrolled loads of a 3584-wide row spill
            p = tl.load(perm_ptr + t * K + j)
            w = tl.where(p >= 0, tl.load(w_ptr + t * K + j), 0.0)     # a slot this rank does not hold adds 0
            y = tl.load(rows_ptr + tl.maximum(p, 0).to(tl.int64) * L + cols, mask=mask, other=0.0).to(tl.float32)
            acc = acc + w * y
        return acc

    @triton.jit
    def finalize_kernel(rows_ptr, perm_ptr, w_ptr, out_ptr, T, L, rows_rank_stride,
                        K: tl.constexpr, BLOCK_L: tl.constexpr, EMU: tl.constexpr):
        """out[r, t] = BF16(Σ_j w · rows[r, perm[r, t, j]]): one program per (rank, token, L block)."""
        r = tl.program_id(0)
        t = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
        mask = cols < L
        acc = _finalize_row(rows_ptr + r.to(tl.int64) * rows_rank_stride, perm_ptr + r * T * K, w_ptr + r * T * K,
                            t, cols, mask, L, K)
        tl.store(out_ptr + (r * T + t).to(tl.int64) * L + cols, _round(acc, tl.bfloat16, EMU), mask=mask)

    @triton.jit
    def collective_kernel(src_ptr, perm_ptr, w_ptr, nw_ptr, out_ptr, T, L, src_rank_stride, l_f, eps,
                          N: tl.constexpr, K: tl.constexpr, DEFERRED: tl.constexpr, BLOCK_L: tl.constexpr,
                          EMU: tl.constexpr):
        """One token's whole latent row: per rank its BF16 partial — loaded ([N, T, L] partials) or,
        DEFERRED, finalized here from the rank's rows ([N, P, L]) — summed in fp32 in rank order and
        rounded once (the AllReduce), then RMSNorm in fp32 and rounded."""
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK_L)
        mask = cols < L
        total = tl.zeros([BLOCK_L], dtype=tl.float32)
        for r in range(N):
            if DEFERRED:
                part = _finalize_row(src_ptr + r * src_rank_stride, perm_ptr + r * T * K, w_ptr + r * T * K,
                                     t, cols, mask, L, K)
                part = _round(part, tl.bfloat16, EMU).to(tl.float32)     # what the rank would push
            else:
                part = tl.load(src_ptr + r * src_rank_stride + t.to(tl.int64) * L + cols, mask=mask,
                               other=0.0).to(tl.float32)
            total = total + part
        x = _round(total, tl.bfloat16, EMU).to(tl.float32)               # the AllReduce's result
        var = tl.div_rn(tl.sum(tl.where(mask, x * x, 0.0), axis=0), l_f)
        scale = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * L + cols, _round((x * scale) * nw, tl.bfloat16, EMU), mask=mask)

    @triton.jit
    def up_proj_kernel(x_ptr, w_ptr, sh_ptr, out_ptr, T, H, L,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_FP32: tl.constexpr, EMU: tl.constexpr):
        """out [T, H] = BF16(x [T, L] @ W_up[H, L]^T + shared [T, H]), fp32 accumulation."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * L + offs_k[None, :],
                        mask=(offs_m[:, None] < T) & (offs_k[None, :] < L), other=0.0)
            b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * L + offs_k[:, None],
                        mask=(offs_n[None, :] < H) & (offs_k[:, None] < L), other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
        mask = (offs_m[:, None] < T) & (offs_n[None, :] < H)
        offs = offs_m[:, None].to(tl.int64) * H + offs_n[None, :]
        sh = tl.load(sh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _round(acc + sh, tl.bfloat16, EMU), mask=mask)


# ---------------------------------------------------------------------------
# Inputs and the reference

@dataclass
class TailInputs:
    """One layer's latent tail at decode. act [N, T*k, I/N] BF16 (every rank's routed activations,
    slot order), w2 [N] of [E, L, I/N] (BF16, W4A16 indexed or MXFP4; each rank's slice),
    topk_weights [T, k] fp32, topk_ids [T, k] int32, norm_weight [L], w_up [H, L], shared [T, H] BF16."""
    act: torch.Tensor
    w2: list
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    norm_weight: torch.Tensor
    w_up: torch.Tensor
    shared: torch.Tensor
    eps: float = 1e-6

    @property
    def shape(self) -> dict:
        N, TK, _ = self.act.shape
        T, k = self.topk_ids.shape
        return {"ranks": N, "tokens": T, "top_k": k, "latent": self.norm_weight.numel(), "hidden": self.w_up.shape[0],
                "experts": FM._tail_weights(self.w2[0])[4], "inter_per_rank": self.act.shape[2]}


def make_inputs(ranks: int, tokens: int, latent: int, hidden: int, experts: int, top_k: int, inter: int, *,
                fmt: str = "bf16", device="cpu", seed: int = 0, gemm2: str = "expert-major") -> TailInputs:
    """Random inputs: W2 per rank N(0, 1/I) (I = the full intermediate size), router softmax top-k
    renormalized, W_up N(0, 1/L), shared N(0, 1). gemm2 "decode" (W4A16, MXFP4): W2 repacked for the decode
    loop once here, at load time (`GEMM2_KERNELS`)."""
    from . import mxfp4 as MXF, w4a16 as W

    if inter % ranks or (inter // ranks) % 32:
        raise ValueError(f"inter={inter} must split into {ranks} slices of a multiple of 32")
    g = torch.Generator(device="cpu").manual_seed(seed)
    ip = inter // ranks
    quant = {"bf16": lambda w: w.bfloat16(), "w4a16": lambda w: W.quantize(w, layout="indexed"),
             "mxfp4": MXF.quantize}[fmt]
    if gemm2 not in GEMM2_KERNELS or (gemm2 == "decode" and fmt not in FM.DECODE_FORMATS):
        raise ValueError(f"gemm2 must be one of {GEMM2_KERNELS} ('decode' for w4a16 or mxfp4), got {gemm2!r} for {fmt}")
    w2 = [quant((torch.randn(experts, latent, ip, generator=g) / inter ** 0.5).to(device)) for _ in range(ranks)]
    if gemm2 == "decode":
        w2 = [FM.pack_for_decode(w) for w in w2]
    act = torch.randn(ranks, tokens * top_k, ip, generator=g).bfloat16().to(device)
    tw, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k)
    return TailInputs(act=act, w2=w2, topk_weights=(tw / tw.sum(-1, keepdim=True)).to(device),
                      topk_ids=ids.to(torch.int32).to(device),
                      norm_weight=(1 + 0.1 * torch.randn(latent, generator=g)).bfloat16().to(device),
                      w_up=(torch.randn(hidden, latent, generator=g) / latent ** 0.5).bfloat16().to(device),
                      shared=torch.randn(tokens, hidden, generator=g).bfloat16().to(device))


def latent_tail_reference(x: TailInputs, round_to: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """fp32 throughout, one rounding at the end (`round_to`; None: the fp32 value unrounded, the gold
    a tolerance check measures errors against): the exact arithmetic every path approximates."""
    total = sum(FM.moe_tail_reference(x.act[r], x.w2[r], x.topk_weights, x.topk_ids) for r in range(x.act.shape[0]))
    xn = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + x.eps) * x.norm_weight.float()
    out = xn @ x.w_up.float().T + x.shared.float()
    return out if round_to is None else out.to(round_to)


def latent_tail_torch(x: TailInputs) -> torch.Tensor:
    """PyTorch with the separate path's rounding points: rows BF16, finalize in fp32 -> BF16 per rank,
    ranks summed in fp32 -> BF16, RMSNorm -> BF16, up-projection + shared -> BF16."""
    N = x.act.shape[0]
    T, k = x.topk_ids.shape
    parts = []
    for r in range(N):
        rows = FM._tail_rows(x.act[r], x.w2[r], torch.ones_like(x.topk_weights), x.topk_ids).bfloat16().float()
        acc = torch.zeros(T, rows.shape[1])
        for j in range(k):
            acc = acc + x.topk_weights[:, j:j + 1].float() * rows.view(T, k, -1)[:, j]
        parts.append(acc.bfloat16().float())
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    xr = total.bfloat16().float()
    xn = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + x.eps) * x.norm_weight.float()).bfloat16()
    return (xn.float() @ x.w_up.float().T + x.shared.float()).bfloat16()


# ---------------------------------------------------------------------------
# Launch builders (the launcher launches what they return)

def _cfg(L: int, device) -> dict:
    return dict(BLOCK_L=triton.next_power_of_2(L), EMU=bf16_cast_needs_emulation(device),
                num_warps=4 if L <= 1024 else 8 if L <= 2048 else 16, enable_fp_fusion=False)


def up_proj_config(interpreted: bool) -> dict:
    return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64) if not interpreted else dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)


def _finalize_launch(rows, perm, w, out, T, L, K, device):
    from ..compiled import Launch

    N = out.shape[0]
    BL = 1024 if L > 1024 else triton.next_power_of_2(L)
    return Launch(f"latent finalize N{N} T{T} k{K} L{L}", finalize_kernel,
                  [rows, perm, w, out, T, L, rows.stride(0)],
                  dict(K=K, BLOCK_L=BL, EMU=bf16_cast_needs_emulation(device), num_warps=4, enable_fp_fusion=False),
                  "moe/latent_tail.py:run_tail", (N, T, triton.cdiv(L, BL)))


def _collective_launch(src, perm, w, nw, out, T, L, K, eps, *, deferred: bool, device):
    from ..compiled import Launch

    N = src.shape[0]
    return Launch(f"latent collective {'deferred ' if deferred else ''}N{N} T{T} k{K} L{L}", collective_kernel,
                  [src, perm, w, nw, out, T, L, src.stride(0), float(L), float(eps)],
                  dict(N=N, K=K, DEFERRED=deferred, **_cfg(L, device)), "moe/latent_tail.py:run_tail", (T,))


def _up_proj_launch(xn, w_up, shared, out, T, H, L, device, cfg):
    from ..compiled import Launch

    return Launch(f"latent up-proj T{T} L{L} H{H} cfg {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}",
                  up_proj_kernel, [xn, w_up, shared, out, T, H, L],
                  dict(DOT_FP32=dot_needs_fp32(device), EMU=bf16_cast_needs_emulation(device), **cfg),
                  "moe/latent_tail.py:run_tail", (triton.cdiv(T, cfg["BLOCK_M"]), triton.cdiv(H, cfg["BLOCK_N"])))


def _gemm2_launch(a, w2, c, al, dest, w_flat, T, k, L, I, device, cfg, *, atomic: bool):
    qw, sc, code, group, E, _, _ = FM._tail_weights(w2)
    if FM.is_decode_packed(w2):   # the decode loop (`moe_decode_tail_kernel`), its row blocks: rows at sorted positions
        grid = (triton.cdiv(L, cfg["BLOCK_N"]), al[1].numel())
        return FM._decode_tail_launch(a, qw, sc, c, al[0], al[1], w_flat, T, k, L, I, qw[0].numel(), sc[0].numel(), grid,
                                      out_div=k if atomic else 1, atomic=atomic, group=group, cfg=cfg, device=device,
                                      **FM.decode_format(w2),
                                      row_weight=atomic, out_sorted=not atomic,
                                      name=f"latent GEMM2 decode {'atomic' if atomic else 'rows'} T{T} k{k} L{L} I{I}",
                                      source="moe/latent_tail.py:run_tail")
    dummy = _meta((1,), torch.int32) if c.device.type == "meta" else torch.empty(1, dtype=torch.int32, device=c.device)
    grid = (al[1].numel(), triton.cdiv(L, cfg["BLOCK_N"]))
    return FM._gemm_launch(f"latent GEMM2 {'atomic' if atomic else 'rows'} T{T} k{k} L{L} I{I}", a, qw, sc, c, al[0], al[1], dummy,
                           dummy if atomic else dest, w_flat, T * k, L, I, 0, qw[0].numel(), sc[0].numel(), grid,
                           ROWS=0, A_DIV=1, SCATTER=not atomic, GATED=False, MUL_ROW_WEIGHT=atomic,
                           common=dict(LAYOUT=code, GROUP=group, DOT_FP32=dot_needs_fp32(device), **cfg),
                           OUT_DIV=k if atomic else 1, ATOMIC=atomic, source="moe/latent_tail.py:run_tail")


def gemm2_config(w2, T: int, k: int, E: int, L: int, interpreted: bool, device=None) -> dict:
    """GEMM2's tiles for T tokens of top-k over E experts into L columns: the tl.dot kernel's `moe_config`,
    or for decode-packed weights the decode tail's (`decode_tail_config`: 16-row blocks, 8 where B200 swaps
    W4A16's operands; its grid (L / BLOCK_N) x the row blocks of `routing.padded_rows`)."""
    if FM.is_decode_packed(w2):
        return FM.decode_tail_config(interpreted, device, **FM.decode_format(w2),
                                     programs=FM._decode_tail_programs(T * k, E, L))
    return dict(FM.moe_config(T * k / E, interpreted))


def _meta(shape, dtype):
    from ..compiled import meta

    return meta(shape, dtype)


# ---------------------------------------------------------------------------
# Running a variant

def run_tail(x: TailInputs, variant: str, *, block=None) -> tuple[torch.Tensor, list[str], dict]:
    """The tail by `variant` (VARIANTS) -> (out [T, H] BF16, the launch names in order, intermediate
    buffers {name: bytes} it allocated). Off a Triton device: the PyTorch path (`latent_tail_torch`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dev = x.act.device
    ok, _ = triton_backend_for(dev)
    if not ok:
        return latent_tail_torch(x), ["torch"], {}
    N, TK, I = x.act.shape
    T, k = x.topk_ids.shape
    L, H = x.norm_weight.numel(), x.w_up.shape[0]
    E = FM._tail_weights(x.w2[0])[4]
    interp = dev.type != "cuda"
    cfg = gemm2_config(x.w2[0], T, k, E, L, interp and block != "gpu", dev) if block in (None, "gpu") else dict(block)
    ids = x.topk_ids.to(torch.int32).contiguous()
    w = x.topk_weights.float().contiguous()
    al = routing.align_indexed(ids, E, cfg["BLOCK_M"], check=False)
    P = al.sorted_ids.numel()
    # expanded (slot) -> permuted (sorted position) map: where GEMM2 writes each slot's row
    dest = torch.full((T * k,), -1, dtype=torch.int32, device=dev)
    valid = al.sorted_ids < T * k
    dest[al.sorted_ids[valid].long()] = torch.arange(P, device=dev, dtype=torch.int32)[valid]
    perm = dest.view(T, k)
    names, buffers = [], {}
    xn = torch.empty((T, L), dtype=torch.bfloat16, device=dev)
    out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    upc = up_proj_config(interp) if block != "gpu" else up_proj_config(False)

    def launch(la):
        FM._run(la)
        names.append(la.name)

    if variant == "atomic":
        acc = torch.zeros((N, T, L), dtype=torch.float32, device=dev)
        names.append("zero-fill fp32 [T, L]")
        for r in range(N):
            launch(_gemm2_launch(x.act[r].contiguous(), x.w2[r], acc[r], (al.sorted_ids, al.block_expert), None,
                                 w.flatten(), T, k, L, I, dev, cfg, atomic=True))
        partials = acc.to(torch.bfloat16)
        names.append("cast fp32 -> BF16")
        buffers = {"accumulator": acc[0].numel() * 4, "partial": partials[0].numel() * 2}
        launch(_collective_launch(partials, perm, w, x.norm_weight, xn, T, L, k, x.eps, deferred=False, device=dev))
    else:
        rows = torch.empty((N, P, L), dtype=torch.bfloat16, device=dev)   # padding rows are never read
        for r in range(N):
            launch(_gemm2_launch(x.act[r].contiguous(), x.w2[r], rows[r], (al.sorted_ids, al.block_expert), dest,
                                 w.flatten(), T, k, L, I, dev, cfg, atomic=False))
        buffers = {"rows": T * k * L * 2}
        perms = perm.expand(N, T, k).contiguous()
        ws = w.expand(N, T, k).contiguous()
        if variant == "separate":
            partials = torch.empty((N, T, L), dtype=torch.bfloat16, device=dev)
            launch(_finalize_launch(rows, perms, ws, partials, T, L, k, dev))
            buffers["partial"] = partials[0].numel() * 2
            launch(_collective_launch(partials, perms, ws, x.norm_weight, xn, T, L, k, x.eps, deferred=False,
                                      device=dev))
        else:
            launch(_collective_launch(rows, perms, ws, x.norm_weight, xn, T, L, k, x.eps, deferred=True, device=dev))
    launch(_up_proj_launch(xn, x.w_up, x.shared, out, T, H, L, dev, upc))
    return out, names, buffers


def tail_launches(tokens: int, top_k: int, experts: int, latent: int, hidden: int, inter_per_rank: int, ranks: int,
                  fmt: str, variant: str, name: str = "", gemm2: str = "expert-major") -> list:
    """The Triton launches of `variant` on a GPU, built without running (`compiled.Launch`); the torch
    zero-fill and cast of the atomic variant are not Triton launches and are not listed. gemm2 "decode":
    GEMM2 on the decode loop, its weights in the decode packing."""
    from ..compiled import meta

    T, k, E, L, H, I, N = tokens, top_k, experts, latent, hidden, inter_per_rank, ranks
    dev = torch.device("cuda")
    if gemm2 == "decode":
        w2 = FM.decode_packed_meta(E, L, I, fmt)
    elif fmt == "bf16":
        w2 = meta((E, L, I), torch.bfloat16)
    else:
        from . import mxfp4 as MXF, w4a16 as W
        if fmt == "mxfp4":
            w2 = MXF.PackedMXFP4(meta((E, L, I // 2), torch.uint8), meta((E, L, I // MXF.BLOCK), torch.uint8),
                                 (E, L, I))
        else:
            w2 = W.PackedW4(meta((E, L, I // 8), torch.int32), meta((E, L, I // 32), torch.bfloat16), (E, L, I), 32,
                            "indexed")
    cfg = gemm2_config(w2, T, k, E, L, False, dev)
    BM = cfg["BLOCK_M"]
    P = routing.padded_rows(T * k, E, BM)
    a = meta((T * k, I), torch.bfloat16)
    al = (meta((P,), torch.int32), meta((P // BM,), torch.int32))
    w_flat, perm, ws = meta((T * k,), torch.float32), meta((N, T, k), torch.int32), meta((N, T, k), torch.float32)
    nw = meta((L,), torch.bfloat16)
    xn, out = meta((T, L), torch.bfloat16), meta((T, H), torch.bfloat16)
    las = []
    expert_bytes = weight_bytes(L, I, fmt, gemm2)
    if variant == "atomic":
        las.append(_gemm2_launch(a, w2, meta((T, L), torch.float32), al, None, w_flat, T, k, L, I, dev, cfg, atomic=True))
        las.append(_collective_launch(meta((N, T, L), torch.bfloat16), perm, ws, nw, xn, T, L, k, 1e-6, deferred=False,
                                      device=dev))
    else:
        rows = meta((N, P, L), torch.bfloat16)
        las.append(_gemm2_launch(a, w2, meta((P, L), torch.bfloat16), al, meta((T * k,), torch.int32), w_flat, T, k, L,
                                 I, dev, cfg, atomic=False))
        if variant == "separate":
            partials = meta((N, T, L), torch.bfloat16)
            las.append(_finalize_launch(rows, perm, ws, partials, T, L, k, dev))
            las.append(_collective_launch(partials, perm, ws, nw, xn, T, L, k, 1e-6, deferred=False, device=dev))
        else:
            las.append(_collective_launch(rows, perm, ws, nw, xn, T, L, k, 1e-6, deferred=True, device=dev))
    # GEMM2 reads the weights of the experts its row blocks can reach, not the whole [E, L, I] table
    # (the rows variant writes its T*k rows at their sorted positions of the [P, L] buffer: T*k rows moved)
    written = las[0].args[3] if variant == "atomic" else meta((T * k, L), torch.bfloat16)
    las[0].dram_bytes = FM.tail_dram_bytes(T, k, E, L, I, expert_bytes, BM, written, atomic=variant == "atomic")
    las.append(_up_proj_launch(xn, meta((H, L), torch.bfloat16), meta((T, H), torch.bfloat16), out, T, H, L, dev,
                               up_proj_config(False)))
    for la in las:
        la.name = f"{name} {variant}: {la.name} {fmt}".strip()
    return las


# ---------------------------------------------------------------------------
# What each launch moves, counted launch by launch

def weight_bytes(n: int, k: int, fmt: str, gemm2: str = "expert-major") -> int:
    """Bytes of one expert's [n, k] GEMM2 weights as that kernel reads them (the decode loop: K padded to 256)."""
    from . import mxfp4 as MXF, w4a16 as W

    if gemm2 == "decode":
        return FM.decode_weight_bytes(n, k, fmt)
    return MXF.weight_bytes(n, k) if fmt == "mxfp4" else W.weight_bytes(n, k, fmt)


def tail_costs(T: int, k: int, E: int, L: int, H: int, I: int, N: int, fmt: str, variant: str,
               counts: list[int], block_m: int, gemm2: str = "expert-major") -> list[dict]:
    """Per launch of one rank's tail: {launch, read, written} bytes, from the tensors that launch
    touches — GEMM2: its activations [T*k, I], its experts' [L, I] weights once per BLOCK_M row block
    (Σ_e ceil(c_e / BLOCK_M)), routing 8 B per slot and the sorted ids; finalize: k rows + 8 B per
    slot in, [T, L] out; collective: N BF16 partials (separate, atomic) or the rank's own k rows and
    N - 1 partials from its peers (deferred, the real push protocol), norm weight, [T, L] out; up
    projection: [T, L] + W_up [H, L] + shared [T, H] in, [T, H] out. The zero-fill writes and the cast
    reads the fp32 [T, L]; the cast writes BF16."""
    blocks = sum(-(-c // block_m) for c in counts if c)
    P = routing.padded_rows(T * k, E, block_m)
    g_in = T * k * I * 2 + blocks * weight_bytes(L, I, fmt, gemm2) + T * k * 8 + P * 4 + (P // block_m) * 4
    rows, part, acc32 = T * k * L * 2, T * L * 2, T * L * 4
    up = {"launch": "up-projection", "read": T * L * 2 + H * L * 2 + T * H * 2, "written": T * H * 2}
    coll_sep = {"launch": "collective", "read": N * part + L * 2, "written": T * L * 2}
    if variant == "separate":
        return [{"launch": "GEMM2 (rows, permuted)", "read": g_in, "written": rows},
                {"launch": "finalize", "read": rows + T * k * 8, "written": part}, coll_sep, up]
    if variant == "atomic":
        # the atomics read-modify-write the accumulator at least once per slot row
        return [{"launch": "zero-fill fp32 [T, L]", "read": 0, "written": acc32},
                {"launch": "GEMM2 (weight + atomic add)", "read": g_in + T * k * L * 4, "written": T * k * L * 4},
                {"launch": "cast to BF16", "read": acc32, "written": part}, coll_sep, up]
    return [{"launch": "GEMM2 (rows, permuted)", "read": g_in, "written": rows},
            {"launch": "collective (+ finalize on load)", "read": rows + T * k * 8 + (N - 1) * part + L * 2,
             "written": T * L * 2}, up]
