"""Chapter `minimax-m3-moe`: shared-expert fusion, and backends chosen by per-rank shapes.

Records:
- `tp1` … `tp8`: the attention backend `select_backends` picks for a MiniMax-M3-like config
  (4 KV heads, assumed) and the local shapes that decided it, in `backends` and `topology`.
- `shared-check`: the shared expert as one more always-selected slot equals the separate path
  with the same rounding points, bit for bit; both within tolerance of fp32; the
  `routed_scaling_factor` scales the routed sum before the shared add (checked against the
  definition, and against the wrong order, which must fail).
- `ep<N>`: where the shared expert lives under expert parallelism N (a copy on every rank, in
  each rank's widened physical table), the per-rank local shapes, and a simulated EP run whose
  per-rank partial outputs sum to the one-rank result.
- `decode-check`: the same two paths as a decode step runs them (T = 16 tokens, the decode kernels on
  experts repacked once by `pack_decode`): fused slot == separate with the same rounding points, bit
  for bit; both, and the separate path with the shared MLP on the dense decode kernel, within
  tolerance of fp32.
- `shared-<variant>-c<C>-<tiles>`: separate vs fused shared expert at concurrency C (one decode
  step of C tokens). On CUDA, at C <= 16 (`FM.decode_step`) both paths on the decode kernels
  (tiles "decode"; experts repacked once, outside the timed call), else with every MoE launch of both
  paths at the same tiles, for each of the two configurations the paths would pick on their own; the
  fused step includes building the k+1-slot routing table. On CPU the PyTorch paths (labelled CPU,
  tiles "torch").
- `seed-*`: the seed's MI355X numbers as quoted records, with their units and topology kept, so
  that `compare()` accepts MXFP8 before/after and refuses the MXFP4 and P/D figures.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..measure import benchmark, compare_timings
from ..presets import Param
from ..record import RunRecord
from ..moe import backends as B, fused_moe as FM, w4a16 as W
from .chord_w4a16 import parse_ints
from ..moe.routing import cpu_threads, on_gpu
from ..moe.timing import gpu_time

SEED_SOURCE = "quoted: seed §四 (vLLM blog on MiniMax M3 / AMD MI355X, 2026-09-10)"
SEED_PR_SOURCE = "quoted: seed §四 (the shared-expert fusion PR, as cited by the vLLM blog)"

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('shared-fused-c1', 'gain_vs_separate', 'Gain of the fused shared expert over the separate path at concurrency 1')

PARAMETERS = {
    "hidden": Param(int, help="hidden size of the MoE used for the shared-expert runs"),
    "inter": Param(int, help="expert FFN size (routed and shared expert alike)"),
    "experts": Param(int, help="routed experts"),
    "top_k": Param(int, help="routed experts per token"),
    "concurrency": Param(str, help="comma-separated concurrencies (tokens per decode step)"),
    "tps": Param(str, help="comma-separated tensor-parallel sizes for backend selection"),
    "eps": Param(str, help="comma-separated expert-parallel sizes for the shared-expert placement"),
    "routed_scaling_factor": Param(float, help="scale of the routed sum before the shared add (assumed)"),
    "reps": Param(int, help="minimum timed repetitions"),
}

PRESETS = {
    "smoke": dict(hidden=64, inter=32, experts=8, top_k=2, concurrency="1,8", tps="1,2,4,8", reps=3, eps="1,2",
                  routed_scaling_factor=2.5),
    # cpu: hidden 128 (from 256) halves the Triton-interpreted checks (shared check, simulated EP ranks) that bind
    # this chapter on a CPU; w13 and w2 still take two BLOCK_K steps each, so the bitwise check still sums K in
    # blocks
    "cpu": dict(hidden=128, inter=128, experts=16, top_k=4, concurrency="1,8,32,128", tps="1,2,4,8", reps=15,
                eps="1,2,4", routed_scaling_factor=2.5),
    "gpu": dict(hidden=6144, inter=1536, experts=64, top_k=8, concurrency="1,8,32,128", tps="1,2,4,8", reps=30,
                eps="1,2,4,8", routed_scaling_factor=2.5),
}


def check_params(P: dict) -> None:
    """Concurrencies and TP sizes parse, shapes fit the kernels, before any work (`setup` calls this)."""
    from .chord_w4a16 import check_moe_shape

    parse_ints(P["concurrency"], "concurrency")
    for tp in parse_ints(P["tps"], "tps"):
        try:
            B.local_shapes(B.MINIMAX_M3_LIKE, tp)
        except ValueError as e:
            raise UserError(str(e)) from None
    check_moe_shape(P["hidden"], P["inter"], P["experts"], P["top_k"])
    for ep in parse_ints(P["eps"], "eps"):   # expert-parallel sizes: positive ints the model's experts split into
        try:
            B.local_shapes(B.MINIMAX_M3_LIKE, 1, ep)
        except ValueError as e:
            raise UserError(str(e)) from None
    rsf = P["routed_scaling_factor"]
    if not (rsf > 0 and math.isfinite(rsf)):
        raise UserError(f"parameter 'routed_scaling_factor' must be a finite number > 0, got {rsf}")
    if P["reps"] < 2:
        raise UserError(f"parameter 'reps' must be >= 2 (the comparison needs a spread), got {P['reps']}")


# ---------------------------------------------------------------------------
# Backend selection per TP

def backend_records(ctx, tps: list[int]) -> list[RunRecord]:
    cfg = B.MINIMAX_M3_LIKE
    out = []
    for tp in tps:
        s = B.select_backends(cfg, tp)
        loc = s["local"]
        rec = ctx.new_record(f"tp{tp}", variant="backend selection", workload={
            "model": cfg.name, "model_revision": cfg.note, "quantization": "(not run: selection only)"},
            topology={"tp": tp, "ep": 1})
        rec.set_backend("attention", s["attention"], reason=s["reason"],
                        shapes={"q": [loc["q_heads"], loc["head_dim"]], "kv": [loc["kv_heads"], loc["head_dim"]],
                                "kv_replicas": loc["kv_replicas"]})
        rec.set_backend("moe", "grouped GEMM, experts replicated (EP1), FFN split by TP",
                        shapes={"w13": [cfg.num_experts, 2 * loc["moe_inter"], cfg.hidden],
                                "w2": [cfg.num_experts, cfg.hidden, loc["moe_inter"]]})
        rec.add("kv_heads_per_rank", loc["kv_heads"], "heads", phase="config")
        rec.add("q_heads_per_rank", loc["q_heads"], "heads", phase="config")
        rec.add("moe_inter_per_rank", loc["moe_inter"], "columns", phase="config")
        rec.notes = "; ".join(s["refused"])
        out.append(rec)
    return out


# ---------------------------------------------------------------------------
# Shared expert: separate path vs one more routed slot

def make_layer(ctx, hidden, inter, experts, top_k, T, layout="indexed"):
    g = ctx.generator(500 + T)
    dev = ctx.device
    w13 = W.quantize(torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / math.sqrt(hidden), layout=layout)
    w2 = W.quantize(torch.randn(experts, hidden, inter, generator=g, device=dev) / math.sqrt(inter), layout=layout)
    s13 = W.quantize(torch.randn(1, 2 * inter, hidden, generator=g, device=dev) / math.sqrt(hidden), layout=layout)
    s2 = W.quantize(torch.randn(1, hidden, inter, generator=g, device=dev) / math.sqrt(inter), layout=layout)
    x = torch.randn(T, hidden, generator=g, device=dev).bfloat16()
    tw, ids = torch.randn(T, experts, generator=g, device=dev).softmax(-1).topk(top_k)
    return w13, w2, s13, s2, x, tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)


def shared_check(ctx, hidden, inter, experts, top_k, rsf, T=19) -> RunRecord:
    rec = ctx.new_record("shared-check", variant="correctness", workload={
        "model": f"MoE E{experts}+1 shared, H{hidden} I{inter} top-{top_k}", "quantization": "w4a16 g32",
        "batch": T, "dtype": "bfloat16"})
    name, why = FM.backend(ctx.device)
    rec.set_backend("fused_moe", name, reason=why, shapes={"x": [T, hidden]})
    for layout in ("indexed", "grouped_masked"):
        w13, w2, s13, s2, x, tw, ids = make_layer(ctx, hidden, inter, experts, top_k, T, layout)
        a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, rsf)
        # One tile config for both calls: `moe_config` follows rows per expert, which the shared slot changes,
        # and another BLOCK_K sums K in another order on a GPU. With the same tiles the two paths run the
        # same kernel over the same rows in the same order, so bit equality is what the GPU guarantees too.
        tiles = FM.moe_config(T * top_k / experts, interpreted=ctx.interpreted)
        fused = FM.shared_fused(x, a13, a2, aw, aid, block=tiles)
        same = FM.shared_separate(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf, block=tiles)
        old = FM.shared_separate(x, w13, w2, tw, ids, s13, s2, round_each=True, routed_scaling_factor=rsf)
        rec.add_check(f"[{layout}] fused slot == separate, same rounding points (bitwise)", torch.equal(fused, same),
                      error=float((fused.float() - same.float()).abs().max()), tolerance=0.0)
        # The reference from the definition (rsf * routed + shared, each on its own), not from the slot table.
        ref = FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf)
        pt = FM.fused_moe_torch(x, a13, a2, aw, aid)
        # The each-branch-rounded path makes two more BF16 roundings than PyTorch's single-pass layer,
        # so it gets 3x PyTorch's own error instead of 2x.
        for label, out, factor in (("fused slot", fused, 2.0), ("separate, each branch rounded", old, 3.0)):
            err, tol, ok = FM.within_tolerance(out, ref, pt, factor=factor)
            rec.add_check(f"[{layout}] {label} vs fp32 rsf*routed + shared ({factor:.0f}x PyTorch's error)", ok,
                          error=err, tolerance=tol)
        if rsf != 1.0:  # the wrong order, (routed + shared) * rsf, scales the shared expert too: must be caught
            wrong = FM.shared_fused(x, a13, a2, aw * torch.tensor([1.0] * top_k + [rsf], device=aw.device), aid)
            err, tol, ok = FM.within_tolerance(wrong, ref, pt)
            rec.add_check(f"[{layout}] the wrong order (shared scaled by rsf) fails the check", not ok,
                          error=err, tolerance=tol)
        rec.add(f"bf16_ulps_differing_{layout}", int((fused != old).sum()), "elements", phase="check",
                of=fused.numel())
    rec.add("routed_scaling_factor", rsf, "x", phase="config")
    return rec


def decode_check(ctx, hidden, inter, experts, top_k, rsf, T=FM.DECODE_MAX_ROWS) -> RunRecord:
    """Both paths as a decode step runs them (`FM.decode_step`: T <= 16 tokens, the shared expert's
    full m16 tile at the default T): the fused slot on `fused_moe_decode` over decode-packed experts,
    bit for bit equal to the separate path with the same rounding points (routed experts and the shared
    one as two `fused_moe_decode` calls, fp32 branches), both within tolerance of the fp32 definition, as
    is the separate path the timings run (the shared MLP on the dense decode kernel, `decode_linear`)."""
    rec = ctx.new_record("decode-check", variant="correctness (decode kernels)", workload={
        "model": f"MoE E{experts}+1 shared, H{hidden} I{inter} top-{top_k}", "quantization": "w4a16 g32 (decode repack)",
        "batch": T, "dtype": "bfloat16"})
    name, why = FM.backend(ctx.device)
    rec.set_backend("fused_moe", f"{name} decode kernel (decode-packed experts)", reason=why,
                    shapes={"x": [T, hidden], "block": FM.moe_decode_config(False, True)})
    w13, w2, s13, s2, x, tw, ids = make_layer(ctx, hidden, inter, experts, top_k, T)
    dec = FM.SharedDecodeWeights(w13, w2, s13, s2)      # load time: pack_decode once
    fused = FM.shared_fused_decode_step(x, dec, tw, ids, routed_scaling_factor=rsf)
    same = FM.shared_separate_decode(x, dec, tw, ids, routed_scaling_factor=rsf)
    # exact on a GPU too: both paths run the same decode kernel, same config and K order, on the same
    # packed weights (no split at these expert counts, `test_decode_check_paths_share_one_config`; a split would
    # reduce in split order anyway, no atomics in the sum), and the combine sums the
    # same fp32 rows in slot order, shared slot last, as the separate path adds it; only the tile row differs
    rec.add_check(f"[decode T{T}] fused slot == separate, same rounding points (bitwise)", torch.equal(fused, same),
                  error=float((fused.float() - same.float()).abs().max()), tolerance=0.0)
    ref = FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf)
    a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, rsf)
    pt = FM.fused_moe_torch(x, a13, a2, aw, aid)
    # the dense decode kernel rounds the shared MLP's gate/up to BF16 and each branch before the add:
    # 3x PyTorch's error, as for the each-branch-rounded separate path
    sep = FM.routed_plus_shared_mlp_decode(x, dec, tw, ids, routed_scaling_factor=rsf)
    for label, out, factor in (("fused slot", fused, 2.0), ("separate, shared MLP on the dense decode kernel", sep, 3.0)):
        err, tol, ok = FM.within_tolerance(out, ref, pt, factor=factor)
        rec.add_check(f"[decode T{T}] {label} vs fp32 rsf*routed + shared ({factor:.0f}x PyTorch's error)", ok,
                      error=err, tolerance=tol)
    rec.add("rows_shared_expert", T, "rows", phase="check", max_rows=FM.DECODE_MAX_ROWS)
    return rec


def experts_slice(q: W.PackedW4, start: int, stop: int) -> W.PackedW4:
    """Experts start..stop-1 of an [E, N, K] buffer (a view, same layout)."""
    return W.PackedW4(q.qweight[start:stop], q.scales[start:stop], (stop - start, *q.shape[1:]), q.group_size, q.layout)


def ep_simulated(x, w13, w2, s13, s2, tw, ids, ep: int, rsf: float):
    """Expert parallelism simulated in one process: tokens belong to ranks round-robin (t mod ep, as
    data-parallel attention hands them over); every rank holds its E/ep routed experts plus a copy of
    the shared expert and computes the slots routed to it; the ranks' fp32 partial outputs are summed
    (the combine). At a decode step (`FM.decode_step`) a rank runs `fused_moe_decode` over its experts,
    decode-packed, with vLLM's `expert_map` (the other ranks' experts -1, their slots skipped: no local
    expert sees more than T rows); else `fused_moe` with the other ranks' slots at weight 0 on local
    expert 0. Returns (out BF16 [T, H], per-rank rows {rank: rows its experts computed})."""
    E = w13.shape[0]
    local = E // ep
    T = x.shape[0]
    token_rank = torch.arange(T, device=x.device) % ep
    weights, logical = FM.shared_slot_routing(tw, ids, E, rsf)
    phys = FM.ep_physical_ids(logical, E, ep, token_rank)
    total = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    rows = {}
    decode = FM.decode_step(T)
    for r in range(ep):
        base = r * (local + 1)
        mine = (phys >= base) & (phys < base + local + 1)
        l13 = W.cat_experts(experts_slice(w13, r * local, (r + 1) * local), s13)
        l2 = W.cat_experts(experts_slice(w2, r * local, (r + 1) * local), s2)
        if decode:
            emap = FM.ep_expert_map(r, local + 1, ep, device=x.device)
            total += FM.fused_moe_decode(x, W.pack_decode(l13), W.pack_decode(l2), weights, phys, max_m=max(T, 1),
                                         out_dtype=torch.float32, expert_map=emap)
        else:
            lid = torch.where(mine, phys - base, torch.zeros_like(phys))
            lw = torch.where(mine, weights, torch.zeros_like(weights))  # other ranks' slots: weight 0 here
            total += FM.fused_moe(x, l13, l2, lw, lid.to(torch.int32), out_dtype=torch.float32)
        rows[r] = int(mine.sum())
    return total.to(torch.bfloat16), rows


EP_TOKENS = 12   # tokens of the simulated EP step: a decode step (`FM.decode_step`), so the ranks run the decode kernel


def ep_records(ctx, hidden, inter, experts, top_k, eps: list[int], rsf: float, T: int = EP_TOKENS) -> list[RunRecord]:
    cfg = B.MINIMAX_M3_LIKE
    out = []
    w13, w2, s13, s2, x, tw, ids = make_layer(ctx, hidden, inter, experts, top_k, T)
    ref = FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf)
    a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, rsf)
    pt = FM.fused_moe_torch(x, a13, a2, aw, aid)
    for ep in eps:
        place = FM.ep_shared_placement(cfg.num_experts, ep)
        loc = B.local_shapes(cfg, 1, ep)
        rec = ctx.new_record(f"ep{ep}", variant="shared-expert placement", workload={
            "model": cfg.name, "model_revision": cfg.note, "quantization": "w4a16 g32 (simulated layer)"},
            topology={"tp": 1, "ep": ep})
        for row in place:
            rec.set_backend(f"moe_rank{row['rank']}", "grouped GEMM over the rank's physical experts (routed + shared copy)",
                            reason=f"routed experts {row['routed experts']}, shared copy at {row['shared copy']}",
                            shapes={"physical_experts": row["physical slots"],
                                    "w13": [row["physical slots"], 2 * loc["moe_inter"], cfg.hidden],
                                    "w2": [row["physical slots"], cfg.hidden, loc["moe_inter"]]})
        rec.add("shared_copies", ep, "copies", phase="config", placement=place)
        rec.add("physical_experts_per_rank", place[0]["physical slots"], "experts", phase="config")
        rec.add("shared_weight_bytes_total", ep * (W.weight_bytes(2 * cfg.moe_inter, cfg.hidden, "w4a16")
                                                   + W.weight_bytes(cfg.hidden, cfg.moe_inter, "w4a16")),
                "bytes", phase="config")
        if experts % ep == 0:  # the simulated layer (this preset's small experts) split over ep ranks
            got, rows = ep_simulated(x, w13, w2, s13, s2, tw, ids, ep, rsf)
            err, tol, ok = FM.within_tolerance(got, ref, pt)
            rec.add_check(f"EP{ep} simulated: ranks' partial sums vs fp32 rsf*routed + shared", ok, error=err,
                          tolerance=tol)
            rec.add("rows_per_rank", max(rows.values()), "rows", phase="check", per_rank=rows)
        out.append(rec)
    return out


def _torch_separate(x, W13, W2, Ws13, Ws2, tw, ids, rsf):
    """PyTorch: routed experts (weights times rsf), then the shared expert as its own MLP, then the add."""
    routed = FM.fused_moe_torch(x, W13, W2, tw.float() * rsf, ids)
    I = Ws13.shape[1] // 2
    h = x @ Ws13[0].T
    shared = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ Ws2[0].T
    return routed + shared


def tile_configs(C: int, experts: int, top_k: int) -> list[dict]:
    """The GPU tiles each path would pick on its own at concurrency C (the routed MoE from C*k/E rows
    per expert, the fused one from C*(k+1)/(E+1)); both paths are timed at each of them."""
    out = []
    for rows in (C * top_k / experts, C * (top_k + 1) / (experts + 1)):
        cfg = FM.moe_config(rows, False)
        if cfg not in out:
            out.append(cfg)
    return out


def tiles_tag(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"


DECODE_TAG = "decode"   # the tiles tag of a decode step (`FM.decode_step`): the decode kernels' own tiles


def step_tag(C: int, experts: int, top_k: int) -> str:
    """The tiles tag of the fused path's record at concurrency C: the decode kernels' at a decode step,
    else the tiles the fused path picks on its own (C*(k+1)/(E+1) rows per expert)."""
    return DECODE_TAG if FM.decode_step(C) else tiles_tag(FM.moe_config(C * (top_k + 1) / (experts + 1), False))


def shared_timings(ctx, hidden, inter, experts, top_k, concurrency, reps, rsf) -> list[RunRecord]:
    out = []
    name, why = FM.backend(ctx.device)
    cuda = on_gpu(ctx)
    for C in concurrency:
        w13, w2, s13, s2, x, tw, ids = make_layer(ctx, hidden, inter, experts, top_k, C)
        a13, a2 = FM.shared_slot_weights(w13, w2, s13, s2)  # load time, outside the step
        variants = []
        if cuda and FM.decode_step(C):   # decode: both paths on the decode kernels, experts repacked once here
            dec = FM.SharedDecodeWeights(w13, w2, s13, s2)
            variants.append((DECODE_TAG, {
                "separate": lambda: FM.routed_plus_shared_mlp_decode(x, dec, tw, ids, routed_scaling_factor=rsf,
                                                                     check=False),
                "fused": lambda: FM.shared_fused_decode_step(x, dec, tw, ids, routed_scaling_factor=rsf, check=False)}))
            backend = {"separate": f"{name}: routed MoE on the decode kernel (decode-packed experts) + shared gate/up "
                                    "and down on the dense decode kernel (split-K), SiLU-and-mul, add",
                       "fused": f"{name}: k+1-slot routing table, then one grouped MoE on the decode kernel "
                                "(decode-packed experts)"}
        elif cuda:
            for cfg in tile_configs(C, experts, top_k):
                tag = tiles_tag(cfg)
                variants.append((tag, {
                    # the separate path's shared MLP runs the dense kernel's own tuned tiles at this M
                    "separate": lambda cfg=cfg: FM.routed_plus_shared_mlp(x, w13, w2, tw, ids, s13, s2,
                                                                          routed_scaling_factor=rsf, check=False,
                                                                          block=cfg,
                                                                          shared_block=W.linear_config(C, False)),
                    "fused": lambda cfg=cfg: FM.shared_fused_step(x, a13, a2, tw, ids, routed_scaling_factor=rsf,
                                                                  check=False, block=cfg)}))
            backend = {"separate": f"{name}: routed MoE + shared gate/up GEMM, SiLU-and-mul, down GEMM (the dense "
                                    "kernel's tuned tiles), add",
                       "fused": f"{name}: k+1-slot routing table, then one grouped MoE"}
        else:  # PyTorch on CPU, BF16 weights resident (no dequantization inside the timed call)
            W13, W2, Ws13, Ws2 = (W.dequantize(q) for q in (w13, w2, s13, s2))
            A13, A2 = torch.cat([W13, Ws13]), torch.cat([W2, Ws2])

            def fused_torch():
                aw, aid = FM.shared_slot_routing(tw, ids, experts, rsf)
                return FM.fused_moe_torch(x, A13, A2, aw, aid)

            variants.append(("torch", {"separate": lambda: _torch_separate(x, W13, W2, Ws13, Ws2, tw, ids, rsf),
                                       "fused": fused_torch}))
            backend = {"separate": "torch: routed experts + shared MLP + add",
                       "fused": "torch: k+1-slot routing table, one expert loop"}
        for tag, fns in variants:
            times = {}
            for variant, fn in fns.items():
                rec = ctx.new_record(f"shared-{variant}-c{C}-{tag}", variant=variant, workload={
                    "model": f"MoE E{experts}+1 shared, H{hidden} I{inter} top-{top_k}", "quantization": "w4a16 g32",
                    "batch": C, "dtype": "bfloat16"}, topology={"tp": 1, "ep": 1})
                rec.set_backend("moe_layer", "one MoE layer with a shared expert",
                                reason=why if cuda else "CPU: PyTorch paths only",
                                shapes={"x": [C, hidden], "tiles": tag})
                rec.notes = backend[variant]
                how = "perf_counter, one intra-op thread"
                if cuda:
                    t, how = gpu_time(fn, ctx.device, label=f"{variant} C={C} {tag}", reps=reps)
                else:
                    with cpu_threads(1):
                        t = benchmark(fn, ctx.device, label=f"{variant} C={C}", warmup=1, min_reps=reps,
                                      min_time_s=0.3)
                rec.add_timing("layer", t, phase="decode", device_label=ctx.hardware_label if cuda else "CPU (PyTorch)",
                               how=how, tiles=tag)
                rec.add("tokens_per_s", C / t.median_s, "tok/s (one layer)", phase="decode")
                times[variant] = t
                out.append(rec)
            # gain = separate / fused - 1, with the comparison's interval; a verdict only when it separates
            c = compare_timings(times["separate"], times["fused"])
            out[-1].add("gain_vs_separate", 100 * (c.ratio - 1), "% throughput", phase="decode", concurrency=C,
                        tiles=tag, lo=100 * (c.lo - 1), hi=100 * (c.hi - 1), verdict=c.verdict,
                        sentence=c.sentence("the separate path", "the fused slot"))
    return out


# ---------------------------------------------------------------------------
# The seed's numbers

def seed_records(ctx) -> list[RunRecord]:
    hw = {"device_type": "cuda", "gpu_name": "AMD MI355X (quoted)"}
    wl = {"model": "MiniMax M3", "input_len": 8192, "output_len": 1024, "batch": "concurrency 32"}

    def rec(name, variant, quant, topology, source=SEED_SOURCE, notes="", **extra_wl):
        return RunRecord(chapter=ctx.chapter.slug, name=name, variant=variant, hardware=hw, device="(quoted)",
                         workload={**wl, "quantization": quant, **extra_wl}, topology=topology, source=source,
                         notes=notes)

    before = rec("seed-mxfp8-before", "before (cumulative optimizations)", "mxfp8", {"tp": 4, "ep": 1})
    before.add("throughput", 109.1, "output tok/s/GPU", phase="steady")
    before.add("tpot_mean", 69.1, "ms", phase="decode")
    after = rec("seed-mxfp8-after", "after (cumulative optimizations)", "mxfp8", {"tp": 4, "ep": 1})
    after.add("throughput", 342.4, "output tok/s/GPU", phase="steady")
    after.add("tpot_mean", 22.1, "ms", phase="decode")
    mxfp4 = rec("seed-mxfp4-later", "later MXFP4 runs", "mxfp4", {"tp": 2, "ep": 1},
                notes="the blog lists higher MXFP4 figures, which the seed does not quote; the topology moved "
                      "from TP4 to TP2 along the way")
    pd = rec("seed-pd", "prefill/decode disaggregated", "not stated in the seed", {"pd": "disaggregated"},
             notes="6370.5 is TOTAL tokens/s/GPU, not output tokens/s/GPU")
    pd.add("throughput", 6370.5, "total tok/s/GPU", phase="steady")
    fusion = RunRecord(chapter=ctx.chapter.slug, name="seed-shared-fusion", variant="shared expert fused",
                       hardware={"device_type": "cuda", "gpu_name": "not stated (PR cited in the MI355X write-up)"},
                       device="(quoted)", workload={"model": "MiniMax M3"}, source=SEED_PR_SOURCE,
                       notes="single-PR gains, relative to the same build without the fusion")
    fusion.add("gain_c1", 30.2, "% throughput", phase="decode", concurrency=1)
    fusion.add("gain_c128", 5.6, "% throughput", phase="decode", concurrency=128)
    return [before, after, mxfp4, pd, fusion]


def measure(ctx, *, hidden, inter, experts, top_k, concurrency, tps, reps, eps, routed_scaling_factor) -> list[RunRecord]:
    cs = parse_ints(concurrency, "concurrency")
    tp_list = parse_ints(tps, "tps")
    ep_list = parse_ints(eps, "eps")
    if hidden % 32 or inter % 32:
        raise UserError(f"hidden and inter must be multiples of the group size 32, got {hidden} and {inter}")
    if not 1 <= top_k <= experts:
        raise UserError(f"top_k must be in [1, experts={experts}], got {top_k}")
    if not (routed_scaling_factor > 0 and math.isfinite(routed_scaling_factor)):
        raise UserError(f"routed_scaling_factor must be a finite positive number, got {routed_scaling_factor}")
    if reps < 2:
        raise UserError(f"reps must be at least 2 (the comparison needs a spread), got {reps}")
    try:
        for tp in tp_list:
            B.local_shapes(B.MINIMAX_M3_LIKE, tp)  # a bad TP fails here, before any work
        for ep in ep_list:
            B.local_shapes(B.MINIMAX_M3_LIKE, 1, ep)
    except ValueError as e:
        raise UserError(str(e)) from None
    records = backend_records(ctx, tp_list)
    records.append(shared_check(ctx, hidden, inter, experts, top_k, routed_scaling_factor))
    records.append(decode_check(ctx, hidden, inter, experts, top_k, routed_scaling_factor))
    records += ep_records(ctx, hidden, inter, experts, top_k, ep_list, routed_scaling_factor)
    records += shared_timings(ctx, hidden, inter, experts, top_k, cs, reps, routed_scaling_factor)
    records += seed_records(ctx)
    return records


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): at a decode
    concurrency (`FM.decode_step`: C <= 16) the fused path (routed experts plus the shared expert as
    slot k+1) and the separate path (routed MoE plus the shared expert's two GEMMs) on the decode
    kernels (`fused_moe_decode`, `decode_linear`); at every larger C and each of its tile configs
    (`tile_configs`) both paths on the tiled kernels (the shared MLP at the dense kernel's own tiles);
    the decode check (T=16), the shared check (T=19, tiled) and the simulated EP ranks (T=12, fp32
    partials, on the decode kernel with the other ranks' slots skipped); one per distinct kernel."""
    from .. import compiled

    p = params
    E, k, H, I = p["experts"], p["top_k"], p["hidden"], p["inter"]
    launches = []
    for C in parse_ints(p["concurrency"], "concurrency"):
        if FM.decode_step(C):                  # both paths on the decode kernels (max_m = C)
            launches += FM.fused_moe_decode_launches(C, k + 1, E + 1, H, I, max_m=C, name=f"fused-slot C{C} decode")
            launches += FM.fused_moe_decode_launches(C, k, E, H, I, max_m=C, name=f"routed C{C} decode")
            launches += W.decode_launches(C, 2 * I, H, name=f"shared_mlp gate/up C{C} decode kernel")
            launches += W.decode_launches(C, H, I, name=f"shared_mlp down C{C} decode kernel")
            continue
        for cfg in tile_configs(C, E, k):
            tag = f"C{C} {tiles_tag(cfg)}"
            launches += FM.fused_moe_launches(C, k + 1, E + 1, H, I, "indexed", block=cfg, name=f"fused-slot {tag}")
            launches += FM.fused_moe_launches(C, k, E, H, I, "indexed", block=cfg, name=f"routed {tag}")
        dense = W.linear_config(C, False)      # the separate path's shared MLP: the dense kernel's own tiles
        launches += W.linear_launches(C, 2 * I, H, "indexed", block=dense, name=f"shared_mlp gate/up C{C} dense cfg")
        launches += W.linear_launches(C, H, I, "indexed", block=dense, name=f"shared_mlp down C{C} dense cfg")
    Td = FM.DECODE_MAX_ROWS                                                   # decode_check
    launches += FM.fused_moe_decode_launches(Td, k + 1, E + 1, H, I, max_m=Td, name=f"decode check fused-slot T{Td}")
    for dt in (torch.float32, torch.bfloat16):                                # its separate paths' combines
        launches += FM.fused_moe_decode_launches(Td, k, E, H, I, max_m=Td, name=f"decode check routed T{Td}")[:2]
        launches += FM.combine_launches(Td, k, H, torch.bfloat16, dt, name=f"decode check routed T{Td}")
        launches += FM.fused_moe_decode_launches(Td, 1, 1, H, I, max_m=Td, name=f"decode check: shared as its own MoE T{Td}")[:2]
        launches += FM.combine_launches(Td, 1, H, torch.bfloat16, dt, name=f"decode check: shared as its own MoE T{Td}")
    launches += W.decode_launches(Td, 2 * I, H, name=f"decode check shared_mlp gate/up T{Td} decode kernel")
    launches += W.decode_launches(Td, H, I, name=f"decode check shared_mlp down T{Td} decode kernel")
    T = 19                                                                    # shared_check
    launches += FM.fused_moe_launches(T, k + 1, E + 1, H, I, "indexed", name=f"shared check fused-slot T{T}")
    for dt in (torch.float32, torch.bfloat16):                                # shared_separate, round_each False/True
        d = str(dt)[6:]
        launches += FM.fused_moe_launches(T, k, E, H, I, "indexed", out_dtype=dt, name=f"shared check routed T{T} -> {d}")
        launches += FM.fused_moe_launches(T, 1, 1, H, I, "indexed", out_dtype=dt,
                                          name=f"shared check: shared as its own MoE -> {d}")
    for ep in parse_ints(p["eps"], "eps"):                                    # ep_records' simulated ranks
        if E % ep == 0:                                                       # T 12: a decode step, expert_map
            launches += FM.fused_moe_decode_launches(EP_TOKENS, k + 1, E // ep + 1, H, I, max_m=EP_TOKENS,
                                                     out_dtype=torch.float32, name=f"EP{ep} rank")
    # the decode kernels keep a row per grid: the shared MLP's down, each EP rank and each batch size are one
    # specialisation but another grid, and the cost model's waves and residency are the grid's
    return compiled.dedupe(launches, keep_grids=DECODE_KERNELS)


def roofline_work(params: dict) -> list[dict]:
    """One fused decode layer per concurrency C as {name, bytes, flops}: the W4A16 weights of the
    experts C tokens are expected to touch (uniform routing: E·(1-(1-k/E)^C), plus the shared
    expert), activations in and out; flops 2·C·(k+1)·3·H·I."""
    E, k, H, I = params["experts"], params["top_k"], params["hidden"], params["inter"]
    per_expert = W.weight_bytes(2 * I, H, "w4a16") + W.weight_bytes(H, I, "w4a16")
    out = []
    for C in parse_ints(params["concurrency"], "concurrency"):
        active = E * (1 - (1 - k / E) ** C) + 1
        nbytes = active * per_expert + 2 * C * H * 2 + C * (k + 1) * (2 * I + I) * 2 * 2
        out.append({"name": f"fused layer C={C}", "bytes": nbytes, "flops": 2 * C * (k + 1) * 3 * H * I,
                    # the measured counterpart: the fused path on the decode kernels, or at the tiles it picks
                    "record": f"shared-fused-c{C}-{step_tag(C, E, k)}",
                    "metric": "layer"})
    return out


DECODE_KERNELS = ("moe_decode_kernel", *W.DENSE_DECODE_KERNELS)


# the decode check's bitwise construction: the shared expert as a one-expert MoE on the fused slot's kernel and
# config, 24 (gate/up) or 48 (down) CTAs and no split-K (a grid under half the CUs keeps the fused slot's config).
# The separate path a server runs puts the shared MLP on the split-K decode kernel instead (its own rows)
CHECK_ONLY = "shared as its own MoE"


def decode_bound_rows(target: str = "sm_90") -> list[dict]:
    """The cost model's verdict (`compiled.predict_launches`, from the committed compile table; predicted,
    not measured) on this chapter's decode-kernel launches (the decode steps, C <= 16, the EP ranks and the
    decode check), one row each: issue time over memory time at the copy ceiling, the binding bound, the
    predicted share of that ceiling, and a note where a row is not held to issue 21's bar (80 %, issue time
    <= memory time / 0.9): the decode check's one-expert MoE, and a launch too small for any kernel to reach
    80 % on that card (`compiled.latency_floor_fraction`: its bytes take less than two DRAM latencies)."""
    from .. import compiled

    out = []
    for p in compiled.predict_launches("minimax-m3-moe", target, compiled.TARGET_CARD[target]):
        if p["kernel"] not in DECODE_KERNELS:
            continue
        floor = compiled.latency_floor_fraction(p)
        note = ("the check's one-expert MoE (no split-K)" if CHECK_ONLY in p["launch"] else
                f"small: no kernel of these bytes over {100 * floor:.0f} %" if floor < 0.8 else "")
        out.append({"launch": p["launch"], **compiled.bar_columns(p), "copy floor %": round(100 * floor), "note": note})
    return out


def decode_bar_sentence(rows_by_target: dict[str, list[dict]]) -> str:
    """The page's sentence on issue 21's bar from `decode_bound_rows` per target: the held rows' worst issue
    over memory time and least share of the copy ceiling, then the noted rows by name."""
    from .. import compiled

    said = []
    for t, rows in rows_by_target.items():
        held, noted = [r for r in rows if not r["note"]], [r for r in rows if r["note"]]
        said.append((f"on {compiled.TARGET_CARD[t]} ({t}) their issue time is at most "
                     f"{max(r['issue / memory time'] for r in held):.2f} of their memory time and they are predicted "
                     f"at no less than {min(r['% of copy ceiling'] for r in held):.0f} % of the {held[0]['ceiling']} "
                     f"copy ceiling" if held else f"{t}: no decode-kernel rows in the compile table")
                    + (" — rows not held to that bar: " + ", ".join(
                        f"{r['launch'].split(' decode-packed')[0]} at {r['% of copy ceiling']} % ({r['bound']}-bound; "
                        f"{r['note']})" for r in noted) if noted else ""))
    return "; ".join(said)
