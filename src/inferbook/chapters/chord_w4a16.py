"""Chapter `chord-w4a16`: W4A16 MoE kernels, their three layouts, and the M each expert sees.

Records (one list per run):
- `routing`: a batch routed at Kimi-K2's MoE shapes (hidden 7168, 384 experts, top-8) with a
  synthetic router: tokens per expert (the histogram), hence the M each expert's GEMM runs at,
  overall and per EP8 rank. Router only: no expert weights of that size are built on CPU.
- `kernel-checks`: fused MoE for each layout and the dense GEMM against the fp32 reference,
  the compressed-tensors round trip, and the wrong-layout refusal.
- `roofline-model`: bytes and flops per call of one Kimi-K2 expert GEMM at each M, BF16 vs
  W4A16 weights; the memory-bound ceiling on the speedup (16 / 4.5 ≈ 3.56x, less with activations).
- `layouts`: the three packing specs as bytes (how many words differ pairwise), the load
  profiles and the packing each picks, and each spec's buffer read by another spec's kernel
  (the wrong numbers the LayoutError prevents).
- timings: on CPU the PyTorch paths only (BF16 weights vs dequantize-then-matmul), labelled; on
  CUDA the Triton W4A16 GEMM per M against the measured copy bandwidth (weights rotated through
  more than L2), the decode sweep over tokens-per-expert M at Kimi-K2 EP8 local shapes (48
  experts) for each layout's fused MoE, the prefill per layout (CUDA graphs, no host syncs), and
  the MMA instruction in each compiled kernel's PTX.
- `seed-*`: the seed's Chord numbers as quoted records (source "quoted: ..."), never measured here.
"""
from __future__ import annotations

import math
import statistics

import torch

from ..errors import UserError
from ..measure import benchmark, ceilings, roofline
from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..moe import fused_moe as FM, routing as R, w4a16 as W
from ..moe.routing import on_gpu
from ..moe.timing import gpu_time

KIMI_K2 = dict(hidden=7168, moe_inter=2048, experts=384, top_k=8, ep=8)
SEED_SOURCE = "quoted: seed §三 (Novita Chord engineering report, 2026-09-15)"

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('routing', 'tokens_per_expert_median', "Median tokens an expert receives at the preset's decode batch")

PARAMETERS = {
    "route_tokens": Param(int, help="tokens routed at Kimi-K2 shapes for the histogram"),
    "skew": Param(float, help="expert popularity skew of the synthetic router (0: none)"),
    "hidden": Param(int, help="hidden size of the MoE used for kernel checks"),
    "inter": Param(int, help="expert FFN size of the MoE used for kernel checks"),
    "experts": Param(int, help="experts in the kernel-check MoE"),
    "top_k": Param(int, help="experts per token in the kernel-check MoE"),
    "tokens": Param(int, help="tokens in the kernel-check batch"),
    "gemm_n": Param(int, help="N of the timed dense GEMM (Kimi-K2 expert gate+up: 4096)"),
    "gemm_k": Param(int, help="K of the timed dense GEMM (Kimi-K2 hidden: 7168)"),
    "m_sweep": Param(str, help="comma-separated M values of the timed GEMM (decode sizes)"),
    "prefill_tokens": Param(int, help="tokens of the timed grouped prefill (CUDA only)"),
    "prefill_experts": Param(int, help="experts of the timed grouped prefill (CUDA only)"),
    "decode_experts": Param(int, help="local experts of the decode sweep (Kimi-K2 EP8: 384 / 8 = 48)"),
    "decode_hidden": Param(int, help="hidden size of the decode sweep (Kimi-K2: 7168)"),
    "decode_inter": Param(int, help="expert FFN size of the decode sweep (Kimi-K2: 2048)"),
    "decode_m": Param(str, help="comma-separated tokens-per-expert M of the decode sweep"),
    "reps": Param(int, help="minimum timed repetitions"),
}

PRESETS = {
    "smoke": dict(route_tokens=256, skew=0.0, hidden=64, inter=32, experts=8, top_k=2, tokens=13,
                  gemm_n=256, gemm_k=512, m_sweep="1,16", prefill_tokens=0, prefill_experts=8, reps=3,
                  decode_experts=4, decode_hidden=64, decode_inter=32, decode_m="1,3"),
    "cpu": dict(route_tokens=4096, skew=0.25, hidden=128, inter=64, experts=16, top_k=4, tokens=50,
                gemm_n=4096, gemm_k=7168, m_sweep="1,4,16,64", prefill_tokens=0, prefill_experts=8, reps=5,
                decode_experts=8, decode_hidden=128, decode_inter=64, decode_m="1,4,16"),
    "gpu": dict(route_tokens=65536, skew=0.25, hidden=7168, inter=2048, experts=16, top_k=8, tokens=64,
                gemm_n=4096, gemm_k=7168, m_sweep="1,2,4,8,16,32,64,128", prefill_tokens=4096,
                prefill_experts=32, reps=20, decode_experts=48, decode_hidden=7168, decode_inter=2048,
                decode_m="1,2,4,8,16,32,64"),
}


def parse_ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{name} must be comma-separated positive ints, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{name} must be comma-separated positive ints, got {text!r}")
    return vals


def check_moe_shape(hidden: int, inter: int, experts: int, top_k: int) -> None:
    """Group size 32 along the packed dims and 1 <= top_k <= experts (UserError otherwise)."""
    if hidden % 32 or inter % 32:
        raise UserError(f"hidden and inter must be multiples of the group size 32, got {hidden} and {inter}")
    if not 1 <= top_k <= experts:
        raise UserError(f"top_k must be in [1, experts={experts}], got {top_k}")


def check_params(P: dict) -> None:
    """Sweeps parse and shapes fit the kernels, before any work (`setup` calls this)."""
    parse_ints(P["m_sweep"], "m_sweep")
    parse_ints(P["decode_m"], "decode_m")
    check_moe_shape(P["hidden"], P["inter"], P["experts"], P["top_k"])
    if P["gemm_k"] % 32:
        raise UserError(f"gemm_k must be a multiple of 32, got {P['gemm_k']}")
    if P["decode_hidden"] % 32 or P["decode_inter"] % 32:
        raise UserError(f"decode_hidden and decode_inter must be multiples of the group size 32, got "
                        f"{P['decode_hidden']} and {P['decode_inter']}")


# ---------------------------------------------------------------------------
# Routing at Kimi-K2 shapes

def kimi_router(ctx, skew: float, *, hidden: int = KIMI_K2["hidden"], experts: int = KIMI_K2["experts"]):
    """A synthetic router: random gate weights (std 1/sqrt(H)) and a popularity bias that makes
    expert r's logit lower by skew * log(1 + r) (skew 0: every expert equally likely a priori)."""
    g = torch.Generator().manual_seed(ctx.seed + 11)
    gate = torch.randn(experts, hidden, generator=g) / math.sqrt(hidden)
    perm = torch.randperm(experts, generator=g)
    popularity = -skew * torch.log1p(perm.float())
    return gate, popularity


def route_kimi(ctx, tokens: int, skew: float, chunk: int = 4096):
    """Route `tokens` random hidden states (BF16) through the synthetic Kimi-K2 router; returns
    (topk_weights, topk_ids) on CPU. Sigmoid scores, top-8, renormalized, as Kimi-K2 does; the
    popularity bias is added to the logits, so a popular expert scores higher for every token."""
    gate, popularity = kimi_router(ctx, skew)
    g = torch.Generator().manual_seed(ctx.seed + 12)
    ws, ids = [], []
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        h = torch.randn(n, KIMI_K2["hidden"], generator=g).bfloat16()
        scores = (h.float() @ gate.T + popularity).sigmoid()
        i = scores.topk(KIMI_K2["top_k"], dim=-1).indices
        w = scores.gather(1, i)
        ws.append(w / w.sum(-1, keepdim=True))
        ids.append(i.to(torch.int32))
    return torch.cat(ws), torch.cat(ids)


def routing_stats(counts: torch.Tensor, ep: int) -> dict:
    """Summary of rows per expert (the GEMM's M) and rows per EP rank (experts split evenly)."""
    c = counts.tolist()
    per_rank = counts.reshape(ep, -1).sum(1).tolist()
    return {"min": min(c), "median": statistics.median(c), "max": max(c), "mean": sum(c) / len(c),
            "empty": sum(1 for v in c if v == 0), "per_rank": per_rank}


def routing_record(ctx, route_tokens: int, skew: float) -> RunRecord:
    tw, ids = route_kimi(ctx, route_tokens, skew)
    counts = R.tokens_per_expert(ids, KIMI_K2["experts"])
    st = routing_stats(counts, KIMI_K2["ep"])
    rec = ctx.new_record("routing", variant="synthetic router", workload={
        "model": "Kimi-K2 MoE shapes (router only): hidden 7168, 384 experts, top-8, sigmoid scores",
        "model_revision": f"random gate weights, seed {ctx.seed}, popularity skew {skew}",
        "quantization": "none (router in fp32)", "batch": route_tokens}, topology={"ep": KIMI_K2["ep"]})
    rec.set_backend("router", "torch fp32 sigmoid top-k", reason="routing only; no experts run",
                    shapes={"hidden": [route_tokens, KIMI_K2["hidden"]], "gate": [KIMI_K2["experts"], KIMI_K2["hidden"]]})
    rec.add("tokens_per_expert_min", st["min"], "rows", phase="routing")
    rec.add("tokens_per_expert_median", st["median"], "rows", phase="routing")
    rec.add("tokens_per_expert_max", st["max"], "rows", phase="routing")
    rec.add("tokens_per_expert_mean", st["mean"], "rows", phase="routing")
    rec.add("experts_without_tokens", st["empty"], "experts", phase="routing")
    rec.add("rows_per_ep_rank_max", max(st["per_rank"]), "rows", phase="routing", per_rank=st["per_rank"])
    rec.add("rows_per_ep_rank_min", min(st["per_rank"]), "rows", phase="routing")
    rec.add("histogram", route_tokens, "tokens", phase="routing", counts=counts.tolist())
    # The M a decode step sees: a batch of 1..256 concurrent tokens, each expert gets a handful.
    for batch in (1, 8, 64, 256):
        if batch <= route_tokens:
            cb = R.tokens_per_expert(ids[:batch], KIMI_K2["experts"])
            rec.add(f"decode_batch{batch}_max_m", int(cb.max()), "rows", phase="routing", batch=batch,
                    active_experts=int((cb > 0).sum()))
    return rec


def decode_m_table(rec: RunRecord) -> list[dict]:
    rows = []
    for m in rec.measurements:
        if m["name"].startswith("decode_batch"):
            rows.append({"decode batch (tokens)": m["batch"], "experts with ≥1 token": m["active_experts"],
                         "largest M any expert GEMM sees": int(m["value"])})
    return rows


# ---------------------------------------------------------------------------
# Correctness

def make_moe(ctx, hidden, inter, experts, top_k, tokens, layout="indexed"):
    g, dev = ctx.generator(21), ctx.device
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, inter, generator=g, device=dev) / math.sqrt(inter)
    x = torch.randn(tokens, hidden, generator=g, device=dev).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device=dev)
    if experts > top_k:
        logits[:, 0] = -1e4  # expert 0 receives no tokens: the kernels must skip it
    tw, ids = logits.softmax(-1).topk(top_k)
    tw = tw / tw.sum(-1, keepdim=True)
    return (W.quantize(w13, layout=layout), W.quantize(w2, layout=layout), x, tw, ids.to(torch.int32))


def check_layouts(ctx, hidden, inter, experts, top_k, tokens) -> list[dict]:
    """Each layout's fused MoE against the fp32 reference; rows for a table."""
    rows = []
    for layout in W.LAYOUTS:
        w13, w2, x, tw, ids = make_moe(ctx, hidden, inter, experts, top_k, tokens, layout)
        out = FM.fused_moe(x, w13, w2, tw, ids)
        err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                           FM.fused_moe_torch(x, w13, w2, tw, ids))
        rows.append({"layout": layout, "max |out - fp32 ref|": err, "tolerance (2x PyTorch BF16 error)": tol,
                     "passed": ok, "packing": W.PACKING_SPECS[layout].qweight})
    return rows


def check_dense(ctx, hidden, inter) -> list[dict]:
    g = torch.Generator().manual_seed(ctx.seed + 22)
    w = torch.randn(2 * inter + 3, hidden, generator=g)  # odd N
    x = torch.randn(37, hidden, generator=g).bfloat16().to(ctx.device)
    rows = []
    for layout in W.LAYOUTS:
        q = W.quantize(w.to(ctx.device), layout=layout)
        err, tol, ok = FM.within_tolerance(W.linear(x, q), W.linear_reference(x, q), W.linear_torch(x, q))
        rows.append({"layout": layout, "max |out - fp32 ref|": err, "tolerance": tol, "passed": ok})
    return rows


def check_decode(ctx, hidden, inter, experts, top_k, tokens) -> list[dict]:
    """The decode kernels (Marlin-style repack, `pack_decode`) against the fp32 reference: the dense
    GEMM at M = 1 and 16 on an odd N, and the MoE layer (four experts) with at most 16 rows per expert."""
    g = torch.Generator().manual_seed(ctx.seed + 26)
    w = torch.randn(2 * inter + 3, hidden, generator=g).to(ctx.device)
    q = W.quantize(w)
    d = W.pack_decode(q)
    rows = []
    for m in (1, 16):
        x = torch.randn(m, hidden, generator=g).bfloat16().to(ctx.device)
        err, tol, ok = FM.within_tolerance(W.decode_linear(x, d), W.decode_reference(x, d), W.linear_torch(x, q))
        rows.append({"kernel": f"decode_linear M={m}", "error": err, "tolerance": tol, "passed": ok})
    e = min(experts, 4)                                            # a few experts: the interpreter is slow
    w13, w2, x, tw, ids = make_moe(ctx, hidden, inter, e, min(top_k, e - 1), min(tokens, 8))
    if int(R.tokens_per_expert(ids, e).max()) <= FM.DECODE_MAX_ROWS:
        out = FM.fused_moe_decode(x, W.pack_decode(w13), W.pack_decode(w2), tw, ids)
        err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                           FM.fused_moe_torch(x, w13, w2, tw, ids))
        rows.append({"kernel": f"fused_moe_decode T={x.shape[0]}", "error": err, "tolerance": tol, "passed": ok})
    return rows


def loop_rows() -> list[dict]:
    """The committed sm_90 main-loop counts of the W4A16 launches at M <= 16 (`moe.loop_cost`, read from
    the SASS), one row per launch, for the page."""
    from ..moe import loop_cost as LC

    return [{"launch": r["launch"], "warp-instr / 64 weights / thread": r["instructions_per_64_weights_per_thread"],
             "warp-instr / DRAM byte": r["warp_instructions_per_byte"],
             "issue bound / copy ceiling": r["issue_bound_vs_copy_ceiling"], "regs": r["regs"],
             "warps / SM": r["warps_per_sm"], "bytes in flight / needed": round(r["bytes_in_flight_per_sm"] /
                                                                              r["bytes_in_flight_needed"], 2)}
            for r in LC.load_saved()]


def check_round_trip(ctx, hidden, inter) -> bool:
    from safetensors.torch import load, save

    g = torch.Generator().manual_seed(ctx.seed + 23)
    w13 = W.quantize(torch.randn(2, 2 * inter, hidden, generator=g), layout="grouped_contiguous")
    w2 = W.quantize(torch.randn(2, hidden, inter, generator=g), layout="grouped_masked")
    blob = save(W.export_moe_compressed_tensors(w13, w2, "model.layers.0.mlp"))
    a13, a2 = W.import_moe_compressed_tensors(load(blob), "model.layers.0.mlp", 2, "indexed")
    return all(torch.equal(u, v) for x, y in ((a13, w13), (a2, w2)) for u, v in zip(W.unpack(x), W.unpack(y)))


def layout_bytes_table(ctx, n: int = 64, k: int = 128) -> list[dict]:
    """The same quantized values packed three ways: dtype, shape, and the share of 32-bit words
    that differ from the indexed (checkpoint) buffer, position by position."""
    g = torch.Generator().manual_seed(ctx.seed + 24)
    q = W.quantize(torch.randn(n, k, generator=g), layout="indexed")
    base = q.qweight.flatten()
    rows = []
    for layout in W.LAYOUTS:
        p = W.to_layout(q, layout)
        flat = p.qweight.flatten()
        same = flat.numel() == base.numel()
        rows.append({"layout": layout, "packed": W.PACKING_SPECS[layout].qweight, "shape": tuple(p.qweight.shape),
                     "words differing from indexed": float((flat != base).float().mean()) if same else None})
    return rows


def wrong_layout_numbers(ctx, n: int = 64, k: int = 128, m: int = 4) -> list[dict]:
    """Each spec's buffer fed to another spec's kernel (bypassing the tag with `reinterpret`):
    the dense W4A16 GEMM's error against the fp32 reference of the *true* weights."""
    g = torch.Generator().manual_seed(ctx.seed + 25)
    w = torch.randn(n, k, generator=g).to(ctx.device)
    x = torch.randn(m, k, generator=g).bfloat16().to(ctx.device)
    rows = []
    for src in W.LAYOUTS:
        q = W.quantize(w, layout=src)
        ref, tq = W.linear_reference(x, q), W.linear_torch(x, q)
        for dst in W.LAYOUTS:
            err, tol, ok = FM.within_tolerance(W.linear(x, W.reinterpret(q, dst)), ref, tq)
            rows.append({"buffer packed as": src, "read by the kernel of": dst, "max |error|": err,
                         "tolerance": tol, "correct": ok})
    return rows


def check_wrong_layout(ctx, hidden, inter, experts, top_k, tokens) -> str:
    w13, w2, x, tw, ids = make_moe(ctx, hidden, inter, experts, top_k, tokens, "grouped_masked")
    try:
        FM.fused_moe(x, w13, w2, tw, ids, layout="grouped_contiguous")
    except W.LayoutError as e:
        return str(e)
    raise AssertionError("a grouped_masked buffer was accepted by the grouped_contiguous kernel")


def layouts_record(ctx) -> RunRecord:
    rec = ctx.new_record("layouts", variant="packing specs", workload={
        "model": "one [64, 128] weight", "quantization": "w4a16 g32"})
    for row in layout_bytes_table(ctx):
        if row["words differing from indexed"] is not None:
            rec.add(f"differs_from_indexed[{row['layout']}]", row["words differing from indexed"], "fraction of words",
                    phase="analysis", layout=row["layout"], shape=list(row["shape"]))
    for name, spec in W.LOAD_PROFILES.items():
        rec.add(f"profile[{name}]", 1, "profile", phase="load", layout=spec["layout"], kernel=spec["kernel"],
                when=spec["when"])
    for row in wrong_layout_numbers(ctx):
        rec.add(f"read[{row['buffer packed as']}->{row['read by the kernel of']}]", row["max |error|"], "abs error",
                phase="analysis", src=row["buffer packed as"], dst=row["read by the kernel of"],
                tolerance=row["tolerance"], correct=row["correct"])
        same = row["buffer packed as"] == row["read by the kernel of"]
        rec.add_check(f"{row['buffer packed as']} read as {row['read by the kernel of']}: "
                      f"{'correct' if same else 'wrong numbers'}", row["correct"] == same,
                      error=row["max |error|"], tolerance=row["tolerance"])
    return rec


def wrong_layout_rows(rec: RunRecord) -> list[dict]:
    return [{"buffer packed as": m["src"], "read by the kernel of": m["dst"], "max |error|": m["value"],
             "tolerance": m["tolerance"], "correct numbers": m["correct"]}
            for m in rec.measurements if m["name"].startswith("read[")]


# ---------------------------------------------------------------------------
# The decode sweep: every local expert sees exactly M rows

def even_routing(experts: int, top_k: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in which each of `experts` experts receives `m` rows (exactly m when k divides E*m, as at
    Kimi-K2 EP8's 48 experts and top-8; else m or m + 1): T = ceil(E*m/k) tokens, token t's slots are
    experts (t*k + j) mod E (distinct while k <= E). Weights random, summing to 1."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    T = -(-experts * m // top_k)
    slots = torch.arange(T * top_k, device=device).reshape(T, top_k)
    ids = (slots % experts).to(torch.int32)
    w = torch.rand(T, top_k, generator=torch.Generator().manual_seed(m)).to(device) + 0.5
    return w / w.sum(-1, keepdim=True), ids


def decode_traffic(T: int, k: int, E: int, H: int, I: int) -> dict:
    """Bytes a fused-MoE decode step moves at HBM level: every one of the E experts' W4A16 weights
    once, the BF16 activations in and out, and the [T*k, I] and [T*k, H] BF16 intermediates
    written and read once each. Flops: 2 * rows * (2I*H + H*I)."""
    w = E * (W.weight_bytes(2 * I, H, "w4a16") + W.weight_bytes(H, I, "w4a16"))
    act = 2 * T * H * 2 + 2 * (T * k * I * 2) + 2 * (T * k * H * 2)
    return {"weight_bytes": w, "bytes": w + act, "flops": 2 * T * k * 3 * I * H}


def make_experts(ctx, experts: int, hidden: int, inter: int, layout: str, chunk: int = 8):
    """Random expert weights quantized `chunk` experts at a time (bounded fp32 temporaries)."""
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 41)
    w13s, w2s = [], []
    for e0 in range(0, experts, chunk):
        n = min(chunk, experts - e0)
        w13s.append(W.quantize(torch.randn(n, 2 * inter, hidden, generator=g, device=ctx.device) / math.sqrt(hidden),
                               layout=layout))
        w2s.append(W.quantize(torch.randn(n, hidden, inter, generator=g, device=ctx.device) / math.sqrt(inter),
                              layout=layout))
    return W.cat_experts(*w13s), W.cat_experts(*w2s)


def check_decode_sweep(ctx, experts, hidden, inter, top_k, ms) -> list[dict]:
    """The decode sweep's routing and kernels at this preset's small shapes: each expert gets M
    rows, and the indexed and masked fused MoE match the fp32 reference."""
    rows = []
    k = min(top_k, experts)
    base13, base2 = make_experts(ctx, experts, hidden, inter, "indexed")
    for m in ms:
        tw, ids = even_routing(experts, k, m, ctx.device)
        counts = R.tokens_per_expert(ids, experts)
        x = torch.randn(ids.shape[0], hidden, generator=ctx.generator(m)).bfloat16()
        ref = FM.fused_moe_reference(x, base13, base2, tw, ids)
        tq = FM.fused_moe_torch(x, base13, base2, tw, ids)
        for layout in ("indexed", "grouped_masked"):
            w13, w2 = W.to_layout(base13, layout), W.to_layout(base2, layout)
            out = FM.fused_moe(x, w13, w2, tw, ids, max_m=int(counts.max()) if layout == "grouped_masked" else None)
            err, tol, ok = FM.within_tolerance(out, ref, tq)
            rows.append({"M": m, "layout": layout, "rows per expert": (int(counts.min()), int(counts.max())),
                         "error": err, "tolerance": tol, "passed": ok and int(counts.min()) == int(counts.max()) >= m})
    return rows


# ---------------------------------------------------------------------------
# Rooflines

def gemm_traffic(m: int, n: int, k: int, fmt: str) -> dict:
    """Bytes and flops of one `[M, K] x [N, K]^T` GEMM with weights in `fmt` (BF16 activations)."""
    w = W.weight_bytes(n, k, fmt)
    act = 2 * m * k + 2 * m * n
    return {"weight_bytes": w, "activation_bytes": act, "bytes": w + act, "flops": 2 * m * n * k}


def roofline_model_record(ctx, ms: list[int]) -> RunRecord:
    n, k = 2 * KIMI_K2["moe_inter"], KIMI_K2["hidden"]
    rec = ctx.new_record("roofline-model", variant="analysis", workload={
        "model": "one Kimi-K2 expert gate+up GEMM [4096, 7168]", "quantization": "w4a16 g32 vs bf16"})
    rec.add("bits_per_weight_w4a16", W.BITS_PER_WEIGHT, "bits", phase="analysis")
    rec.add("weight_only_bound", 16 / W.BITS_PER_WEIGHT, "x", phase="analysis")
    for m in sorted(set(ms) | {1, 16, 256, 4096}):
        b, q = gemm_traffic(m, n, k, "bf16"), gemm_traffic(m, n, k, "w4a16")
        rec.add(f"bound_m{m}", b["bytes"] / q["bytes"], "x", phase="analysis", m=m,
                intensity_bf16=b["flops"] / b["bytes"], intensity_w4a16=q["flops"] / q["bytes"])
    return rec


def roofline_rows(rec: RunRecord) -> list[dict]:
    return [{"M": m["m"], "best speedup if memory-bound (bytes ratio)": m["value"],
             "flop/byte BF16": m["intensity_bf16"], "flop/byte W4A16": m["intensity_w4a16"]}
            for m in rec.measurements if m["name"].startswith("bound_m")]


# ---------------------------------------------------------------------------
# Timings

def _dense_weights(ctx, n, k):
    g = torch.Generator().manual_seed(ctx.seed + 31)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(ctx.device)
    return w.bfloat16(), W.quantize(w, layout="indexed")


def cpu_timings(ctx, gemm_n, gemm_k, ms, reps) -> list[RunRecord]:
    """PyTorch paths on this CPU: BF16 weights resident vs W4A16 dequantized at every call."""
    wb, q = _dense_weights(ctx, gemm_n, gemm_k)
    out = []
    for variant, quant in (("bf16 weights", "none (bf16)"), ("w4a16 dequantize + matmul", "w4a16 g32")):
        rec = ctx.new_record(f"cpu-{'bf16' if quant.startswith('none') else 'w4a16'}", variant=variant, workload={
            "model": f"dense GEMM [{gemm_n}, {gemm_k}]", "quantization": quant, "dtype": "bfloat16"})
        rec.set_backend("gemm", "torch bf16 matmul" if quant.startswith("none") else "torch dequantize + bf16 matmul",
                        reason="CPU: PyTorch paths only (Triton runs in the interpreter here)",
                        shapes={"w": [gemm_n, gemm_k]}, dtype="bfloat16")
        for m in ms:
            x = torch.randn(m, gemm_k, generator=ctx.generator(m)).bfloat16()
            fn = (lambda: x @ wb.T) if quant.startswith("none") else (lambda: W.linear_torch(x, q))
            with R.cpu_threads(1):
                t = benchmark(fn, ctx.device, label=f"{variant} M={m}", warmup=1, min_reps=reps, min_time_s=0.2)
            rec.add_timing(f"gemm_m{m}", t, phase="steady", m=m, device_label="CPU (PyTorch)", threads=1)
        out.append(rec)
    return out


def mma_instructions(ptx: str) -> dict:
    """Matrix instructions in a kernel's PTX: Blackwell tcgen05.mma, Hopper wgmma and the warp-level
    mma.sync (the parser `inferbook.compiled` uses for its compile tables)."""
    from ..compiled import mma_family

    m = mma_family(ptx)
    return {"wgmma": m["counts"].get("wgmma", 0), "mma_sync": m["counts"].get("mma.sync", 0),
            "tcgen05": m["counts"].get("tcgen05", 0), "mma_sync_shapes": [x for x in m["shapes"] if x.startswith("m16")]}


def sass_instructions(cubin: bytes) -> dict | None:
    """HMMA (warp-level mma.sync) and HGMMA (Hopper wgmma) counts in the kernel's SASS, via
    `cuobjdump -sass`; None where the CUDA binutils are not installed."""
    import os
    import re
    import shutil
    import subprocess
    import tempfile

    tool = shutil.which("cuobjdump")
    if tool is None or not cubin:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return {"HMMA": len(re.findall(r"\bHMMA\.", sass)), "HGMMA": len(re.findall(r"\bHGMMA\.", sass)),
            "hmma_shapes": sorted(set(re.findall(r"\bHMMA\.(\w+)", sass)))}


def _rotation(device, nbytes: int) -> int:
    """How many copies of an `nbytes` buffer to cycle through so each call misses L2 (2x its size)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    return max(2, math.ceil(2 * l2 / max(nbytes, 1)))


def gpu_decode_sweep(ctx, experts, hidden, inter, top_k, ms, reps, ceil, why) -> list[RunRecord]:
    """Fused MoE per layout with every local expert at exactly M rows, timed over CUDA graphs
    (check=False: no host syncs; the routing bookkeeping of each layout is inside the step)."""
    recs = []
    top_k = min(top_k, experts)
    for layout in ("indexed", "grouped_masked", "grouped_contiguous"):
        # the same weights (same generator seed) quantized straight into each layout, a chunk of experts
        # at a time: one layout's buffers live at a time (the Kimi-K2 EP8 set is ~1.2 GB in W4A16)
        w13, w2 = make_experts(ctx, experts, hidden, inter, layout)
        rec = ctx.new_record(f"gpu-decode-{layout}", variant=f"triton fused MoE {layout}", workload={
            "model": f"Kimi-K2 EP8 local MoE: {experts} experts, H{hidden}, I{inter}, top-{top_k}",
            "quantization": "w4a16 g32", "dtype": "bfloat16"}, topology={"ep": KIMI_K2["ep"], "rank": 0})
        for m in ms:
            tw, ids = even_routing(experts, top_k, m, ctx.device)
            T = ids.shape[0]
            x = torch.randn(T, hidden, device=ctx.device).bfloat16()
            kw = dict(max_m=m) if layout == "grouped_masked" else {}
            cfg = FM.moe_config(T * top_k / experts, False)
            rec.set_backend(f"fused_moe_m{m}", f"triton {layout}", reason=why,
                            shapes={"x": [T, hidden], "rows_per_expert": m, "block": cfg})
            t, how = gpu_time(lambda: FM.fused_moe(x, w13, w2, tw, ids, check=False, **kw), ctx.device,
                              label=f"{layout} M={m}", reps=reps, inner=5)
            tr = decode_traffic(T, top_k, experts, hidden, inter)
            r = roofline(bytes_moved=tr["bytes"], flops=tr["flops"], seconds=t.median_s, ceil=ceil)
            rec.add_timing(f"decode_m{m}", t, phase="decode", m=m, how=how, tokens=T)
            rec.add(f"frac_copy_m{m}", r["frac_copy"], "fraction of measured copy GB/s", phase="decode", m=m,
                    achieved_gbps=r["achieved_gbps"], bytes=tr["bytes"], target=0.7 if m <= 16 else None)
        rec.add("copy_ceiling", ceil.copy_gbps, "GB/s", phase="ceiling")
        recs.append(rec)
        if layout == "grouped_masked":   # the same experts repacked for the decode kernel (M <= 16)
            d13, d2 = W.pack_decode(w13), W.pack_decode(w2)
            del w13, w2
            rec = ctx.new_record("gpu-decode-decode-packed", variant="triton fused MoE decode kernel", workload={
                "model": f"Kimi-K2 EP8 local MoE: {experts} experts, H{hidden}, I{inter}, top-{top_k}",
                "quantization": "w4a16 g32 (decode repack)", "dtype": "bfloat16"}, topology={"ep": KIMI_K2["ep"], "rank": 0})
            for m in [m for m in ms if m <= FM.DECODE_MAX_ROWS]:
                tw, ids = even_routing(experts, top_k, m, ctx.device)
                T = ids.shape[0]
                x = torch.randn(T, hidden, device=ctx.device).bfloat16()
                rec.set_backend(f"fused_moe_m{m}", "triton decode kernel (masked rows)", reason=why,
                                shapes={"x": [T, hidden], "rows_per_expert": m, "block": FM.moe_decode_config(False, True)})
                t, how = gpu_time(lambda: FM.fused_moe_decode(x, d13, d2, tw, ids, max_m=m, check=False), ctx.device,
                                  label=f"decode-packed M={m}", reps=reps, inner=5)
                tr = decode_traffic(T, top_k, experts, hidden, inter)
                r = roofline(bytes_moved=tr["bytes"], flops=tr["flops"], seconds=t.median_s, ceil=ceil)
                rec.add_timing(f"decode_m{m}", t, phase="decode", m=m, how=how, tokens=T)
                rec.add(f"frac_copy_m{m}", r["frac_copy"], "fraction of measured copy GB/s", phase="decode", m=m,
                        achieved_gbps=r["achieved_gbps"], bytes=tr["bytes"], target=0.8)
            rec.add("copy_ceiling", ceil.copy_gbps, "GB/s", phase="ceiling")
            recs.append(rec)
            del d13, d2
    return recs


def gpu_prefill(ctx, hidden, inter, experts, top_k, tokens, reps, ceil, why) -> list[RunRecord]:
    """The prefill step per layout, over CUDA graphs with check=False: no host syncs inside (the
    contiguous layout is sized for the worst case; the masked one gets its max_m outside)."""
    recs = []
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 42)
    ids = torch.argsort(torch.rand(tokens, experts, device=ctx.device, generator=g), dim=1)[:, :top_k].to(torch.int32)
    tw = torch.full((tokens, top_k), 1.0 / top_k, device=ctx.device)
    x = torch.randn(tokens, hidden, device=ctx.device, generator=g).bfloat16()
    busiest = int(R.tokens_per_expert(ids, experts).max())  # outside the timed step
    flops = 2 * tokens * top_k * 3 * inter * hidden
    for layout in W.LAYOUTS:
        w13, w2 = make_experts(ctx, experts, hidden, inter, layout)
        kw = dict(max_m=busiest) if layout == "grouped_masked" else {}
        rec = ctx.new_record(f"gpu-prefill-{layout}", variant=f"triton fused MoE {layout}", workload={
            "model": f"MoE E{experts} H{hidden} I{inter} top-{top_k}", "quantization": "w4a16 g32",
            "batch": tokens, "dtype": "bfloat16"}, topology={"ep": 1})
        rec.set_backend("fused_moe", f"triton {layout}", reason=why,
                        shapes={"x": [tokens, hidden], "rows_per_expert": tokens * top_k / experts,
                                "block": FM.moe_config(tokens * top_k / experts, False)})
        t, how = gpu_time(lambda: FM.fused_moe(x, w13, w2, tw, ids, check=False, **kw), ctx.device,
                          label=f"prefill {layout}", reps=max(3, reps // 4), inner=2)
        rec.add_timing("fused_moe", t, phase="prefill", how=how + "; check=False, no host syncs in the step")
        rec.add("tflops", flops / t.median_s / 1e12, "TFLOP/s", phase="prefill")
        rec.add("frac_matmul", flops / t.median_s / 1e12 / ceil.matmul_tflops, "fraction of measured bf16 matmul",
                phase="prefill", target=0.5)
        recs.append(rec)
    return recs


def gpu_timings(ctx, gemm_n, gemm_k, ms, reps, prefill_tokens, prefill_experts, hidden, inter, top_k,
                decode_experts, decode_hidden, decode_inter, decode_m) -> list[RunRecord]:
    ceil = ceilings(ctx.device)
    wb, q = _dense_weights(ctx, gemm_n, gemm_k)
    # One weight is ~16 MB, less than L2: cycle through copies so every call reads HBM.
    n_rot = _rotation(ctx.device, q.nbytes)
    qs = [q] + [W.PackedW4(q.qweight.clone(), q.scales.clone(), q.shape, q.group_size, q.layout)
                for _ in range(n_rot - 1)]
    wbs = [wb] + [wb.clone() for _ in range(n_rot - 1)]
    recs = []
    tri = ctx.new_record("gpu-w4a16-triton", variant="triton w4a16", workload={
        "model": f"dense GEMM [{gemm_n}, {gemm_k}]", "quantization": "w4a16 g32", "dtype": "bfloat16"})
    ref = ctx.new_record("gpu-bf16-torch", variant="torch bf16", workload={
        "model": f"dense GEMM [{gemm_n}, {gemm_k}]", "quantization": "none (bf16)", "dtype": "bfloat16"})
    ok, why = FM.backend(ctx.device)
    for m in ms:
        x = torch.randn(m, gemm_k, device=ctx.device).bfloat16()
        _, kernel = W.linear(x, q, return_kernel=True)
        cfg = W.linear_config(m, False)
        tri.set_backend(f"gemm_m{m}", "triton w4a16 (indexed spec)", reason=why, shapes={"x": [m, gemm_k], "block": cfg})
        if kernel is not None and hasattr(kernel, "asm") and "ptx" in kernel.asm:
            ins = mma_instructions(kernel.asm["ptx"])
            tri.add(f"ptx_mma_sync_m{m}", ins["mma_sync"], "instructions", phase="compile", m=m,
                    shapes=ins["mma_sync_shapes"])
            tri.add(f"ptx_wgmma_m{m}", ins["wgmma"], "instructions", phase="compile", m=m)
            tri.add(f"ptx_tcgen05_m{m}", ins["tcgen05"], "instructions", phase="compile", m=m)
            sass = sass_instructions(kernel.asm.get("cubin", b""))
            if sass is not None:
                tri.add(f"sass_hmma_m{m}", sass["HMMA"], "instructions", phase="compile", m=m, shapes=sass["hmma_shapes"])
                tri.add(f"sass_hgmma_m{m}", sass["HGMMA"], "instructions", phase="compile", m=m)
        turn = iter(range(1 << 30))
        t, how = gpu_time(lambda: W.linear(x, qs[next(turn) % n_rot]), ctx.device, label=f"w4a16 M={m}", reps=reps,
                          inner=n_rot)
        how += f"; weights rotated over {n_rot} copies (> L2)"
        r = roofline(bytes_moved=gemm_traffic(m, gemm_n, gemm_k, "w4a16")["bytes"],
                     flops=2 * m * gemm_n * gemm_k, seconds=t.median_s, ceil=ceil)
        tri.add_timing(f"gemm_m{m}", t, m=m, how=how)
        tri.add(f"frac_copy_m{m}", r["frac_copy"], "fraction of measured copy GB/s", m=m,
                achieved_gbps=r["achieved_gbps"], intensity=r["intensity_flop_per_byte"], target=0.7 if m <= 16 else None)
        turn_b = iter(range(1 << 30))
        tb, how_b = gpu_time(lambda: x @ wbs[next(turn_b) % n_rot].T, ctx.device, label=f"bf16 M={m}", reps=reps,
                             uses_triton=False, inner=n_rot)
        how_b += f"; weights rotated over {n_rot} copies (> L2)"
        rb = roofline(bytes_moved=gemm_traffic(m, gemm_n, gemm_k, "bf16")["bytes"],
                      flops=2 * m * gemm_n * gemm_k, seconds=tb.median_s, ceil=ceil)
        ref.add_timing(f"gemm_m{m}", tb, m=m, how=how_b)
        ref.add(f"frac_copy_m{m}", rb["frac_copy"], "fraction of measured copy GB/s", m=m,
                achieved_gbps=rb["achieved_gbps"], intensity=rb["intensity_flop_per_byte"])
    ref.set_backend("gemm", "torch bf16 matmul (cuBLAS)", shapes={"w": [gemm_n, gemm_k]})
    dec = ctx.new_record("gpu-w4a16-decode", variant="triton w4a16 decode kernel", workload={
        "model": f"dense GEMM [{gemm_n}, {gemm_k}]", "quantization": "w4a16 g32 (decode repack)", "dtype": "bfloat16"})
    ds = [W.pack_decode(qq) for qq in qs]
    for m in [m for m in ms if m <= W.DECODE_MAX_M]:
        x = torch.randn(m, gemm_k, device=ctx.device).bfloat16()
        dec.set_backend(f"gemm_m{m}", "triton w4a16 decode (split-K, ordered reduction)", reason=why,
                        shapes={"x": [m, gemm_k], "block": W.decode_config(m, gemm_n, gemm_k)})
        turn_d = iter(range(1 << 30))
        t, how = gpu_time(lambda: W.decode_linear(x, ds[next(turn_d) % n_rot]), ctx.device, label=f"decode M={m}",
                          reps=reps, inner=n_rot)
        r = roofline(bytes_moved=gemm_traffic(m, gemm_n, gemm_k, "w4a16")["bytes"], flops=2 * m * gemm_n * gemm_k,
                     seconds=t.median_s, ceil=ceil)
        dec.add_timing(f"gemm_m{m}", t, m=m, how=how + f"; weights rotated over {n_rot} copies (> L2)")
        dec.add(f"frac_copy_m{m}", r["frac_copy"], "fraction of measured copy GB/s", m=m,
                achieved_gbps=r["achieved_gbps"], target=0.8)
    recs.append(dec)
    recs.append(beside_gemlite(ctx, qs, ds, [m for m in ms if m <= W.DECODE_MAX_M], gemm_n, gemm_k))
    for rec in (tri, ref):
        rec.add("copy_ceiling", ceil.copy_gbps, "GB/s", phase="ceiling")
        rec.add("matmul_ceiling", ceil.matmul_tflops, "TFLOP/s", phase="ceiling")
    recs += [tri, ref]
    recs += gpu_decode_sweep(ctx, decode_experts, decode_hidden, decode_inter, KIMI_K2["top_k"], decode_m, reps,
                             ceil, why)
    if prefill_tokens:
        recs += gpu_prefill(ctx, hidden, inter, prefill_experts, top_k, prefill_tokens, reps, ceil, why)
    return recs


def beside_gemlite(ctx, qs, ds, ms, gemm_n: int, gemm_k: int) -> RunRecord:
    """Our decode kernel and gemlite's W4A16 (the peer the compiler section predicts beside ours,
    `inferbook.compiled.peers`) on the same weights (both rotated over the same copies, > L2), timed in
    the same run, warmed and interleaved (`peers.time_beside`), ours / gemlite from `compare_timings`;
    where gemlite does not import, the record says why and holds no timing."""
    from ..compiled import peers
    from ..measure import compare_timings

    rec = ctx.new_record("gpu-w4a16-beside-gemlite", variant="ours decode kernel vs gemlite", workload={
        "model": f"dense GEMM [{gemm_n}, {gemm_k}]", "quantization": "w4a16 g32", "dtype": "bfloat16"})
    first, why = peers.gemlite_layer(qs[0], W.GROUP_SIZE)
    rec.notes = f"gemlite peer: {why}"
    if first is None:
        return rec
    rec.set_backend("peer", "gemlite GemLiteLinearTriton (Triton W4A16), timed beside ours", reason="interleaved, same run")
    layers = [first] + [peers.gemlite_layer(qq, W.GROUP_SIZE)[0] for qq in qs[1:]]
    n = len(layers)
    for m in ms:
        x = torch.randn(m, gemm_k, device=ctx.device).bfloat16()
        turn = {"ours": iter(range(1 << 30)), "gemlite": iter(range(1 << 30))}
        sides = {"ours": lambda: W.decode_linear(x, ds[next(turn["ours"]) % n]),
                 "gemlite": lambda: layers[next(turn["gemlite"]) % n](x)}
        times = peers.time_beside(sides, ctx.device, rounds=4, min_reps=5, max_reps=50, min_time_s=0.05)
        for side, t in times.items():
            rec.add_timing(f"{side}_m{m}", t, m=m, interleaved=True, how=f"weights rotated over {n} copies (> L2)")
        c = compare_timings(times["ours"], times["gemlite"])
        rec.add(f"ours_over_gemlite_m{m}", c.ratio, "x", m=m, lo=c.lo, hi=c.hi, confidence=c.confidence)
    return rec


# ---------------------------------------------------------------------------
# The seed's numbers, quoted

def seed_records(ctx) -> list[RunRecord]:
    """The seed's Chord results (per-layer MoE shapes, not service speedups), as quoted records."""
    out = []
    for name, gpu, phase, lo, hi, baseline in (
            ("seed-h200-prefill", "NVIDIA H200", "prefill", 1.11, 1.20, "Humming"),
            ("seed-h200-decode", "NVIDIA H200", "decode", 1.16, 1.24, "Humming"),
            ("seed-b300-decode", "NVIDIA B300", "decode", 1.81, 2.15, "Humming default config, not tuned for this case")):
        rec = RunRecord(chapter=ctx.chapter.slug, name=name, variant=f"Chord vs {baseline}",
                        hardware={"device_type": "cuda", "gpu_name": f"{gpu} (quoted)"}, device="(quoted)",
                        workload={"model": "Kimi K2.x MoE layer shapes", "quantization": "w4a16 g32 (bf16 scales)"},
                        topology={"ep": 8}, source=SEED_SOURCE,
                        notes="per-layer MoE shapes listed in the report; not a whole-service speedup")
        rec.add("speedup_low", lo, f"x vs {baseline}", phase=phase)
        rec.add("speedup_high", hi, f"x vs {baseline}", phase=phase)
        out.append(rec)
    return out


def measure(ctx, *, route_tokens, skew, hidden, inter, experts, top_k, tokens, gemm_n, gemm_k, m_sweep,
            prefill_tokens, prefill_experts, reps, decode_experts, decode_hidden, decode_inter,
            decode_m) -> list[RunRecord]:
    ms = parse_ints(m_sweep, "m_sweep")
    dms = parse_ints(decode_m, "decode_m")
    if decode_hidden % 32 or decode_inter % 32 or decode_experts <= 0:
        raise UserError(f"decode_hidden and decode_inter must be multiples of 32 and decode_experts positive, got "
                         f"{decode_hidden}, {decode_inter}, {decode_experts}")
    if hidden % 32 or inter % 32:
        raise UserError(f"hidden and inter must be multiples of the group size 32, got {hidden} and {inter}")
    if gemm_k % 32:
        raise UserError(f"gemm_k must be a multiple of 32, got {gemm_k}")
    if not 1 <= top_k <= experts:
        raise UserError(f"top_k must be in [1, experts={experts}], got {top_k}")
    records = [routing_record(ctx, route_tokens, skew)]

    checks = ctx.new_record("kernel-checks", variant="correctness", workload={
        "model": f"MoE E{experts} H{hidden} I{inter} top-{top_k}", "quantization": "w4a16 g32",
        "batch": tokens, "dtype": "bfloat16"})
    name, why = FM.backend(ctx.device)
    checks.set_backend("fused_moe", name, reason=why, shapes={"x": [tokens, hidden], "w13": [experts, 2 * inter, hidden]})
    for row in check_layouts(ctx, hidden, inter, experts, top_k, tokens):
        checks.add_check(f"fused_moe[{row['layout']}] vs fp32", row["passed"], error=row["max |out - fp32 ref|"],
                         tolerance=row["tolerance (2x PyTorch BF16 error)"])
    for row in check_dense(ctx, hidden, inter):
        checks.add_check(f"linear[{row['layout']}] vs fp32", row["passed"], error=row["max |out - fp32 ref|"],
                         tolerance=row["tolerance"])
    for row in check_decode(ctx, hidden, inter, experts, top_k, tokens):
        checks.add_check(f"{row['kernel']} vs fp32", row["passed"], error=row["error"], tolerance=row["tolerance"])
    checks.add_check("compressed-tensors round trip", check_round_trip(ctx, hidden, inter), error=0.0, tolerance=0.0)
    checks.add_check("wrong layout refused", bool(check_wrong_layout(ctx, hidden, inter, experts, top_k, tokens)))
    if not on_gpu(ctx):  # the decode sweep's routing and kernels, at this preset's small shapes
        for row in check_decode_sweep(ctx, decode_experts, decode_hidden, decode_inter, top_k, dms):
            checks.add_check(f"decode sweep M={row['M']} {row['layout']} vs fp32", row["passed"], error=row["error"],
                             tolerance=row["tolerance"])
    records.append(checks)
    records.append(layouts_record(ctx))
    records.append(roofline_model_record(ctx, ms))
    if on_gpu(ctx):
        records += gpu_timings(ctx, gemm_n, gemm_k, ms, reps, prefill_tokens, prefill_experts, hidden, inter, top_k,
                               decode_experts, decode_hidden, decode_inter, dms)
    else:
        records += cpu_timings(ctx, gemm_n, gemm_k, ms, reps)
    records += seed_records(ctx)
    return records


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): the timed dense
    W4A16 GEMM at every M of the sweep, the dense check and the wrong-layout demonstration in every
    layout, the fused MoE check in every layout, the decode sweep at Kimi-K2 EP8 shapes (every layout,
    every M) and the prefill step in every layout; one per distinct compiled kernel."""
    from .. import compiled

    p = params
    launches = []
    for m in parse_ints(p["m_sweep"], "m_sweep"):
        launches += W.linear_launches(m, p["gemm_n"], p["gemm_k"], "indexed", name=f"decode sweep M{m} N{p['gemm_n']} "
                                      f"K{p['gemm_k']} cfg {'x'.join(str(v) for v in list(W.linear_config(m, False).values())[:3])}")
    launches += [la for la in decode_cost_launches(p)
                 if la.kernel in (W.w4a16_decode_kernel, W.w4a16_decode_swapped_kernel, FM.moe_decode_kernel)]
    for layout in W.LAYOUTS:                                   # check_dense: x [37, hidden], w [2*inter + 3, hidden]
        launches += W.linear_launches(37, 2 * p["inter"] + 3, p["hidden"], layout)
    for layout in W.LAYOUTS:                                   # wrong_layout_numbers: each spec's kernel, [4, 128] x [64, 128]
        launches += W.linear_launches(4, 64, 128, layout, name=f"wrong-layout demo: the {layout} kernel M4 N64 K128")
    for layout in W.LAYOUTS:                                   # check_layouts
        launches += FM.fused_moe_launches(p["tokens"], p["top_k"], p["experts"], p["hidden"], p["inter"], layout,
                                          name="check")
    E, H, I = p["decode_experts"], p["decode_hidden"], p["decode_inter"]
    k = min(p["top_k"], E)
    for layout in ("indexed", "grouped_masked", "grouped_contiguous"):          # gpu_decode_sweep
        for m in parse_ints(p["decode_m"], "decode_m"):
            launches += FM.fused_moe_launches(-(-E * m // k), k, E, H, I, layout, max_m=m, name=f"decode M{m}")
    if p["prefill_tokens"]:                                    # gpu_prefill
        for layout in W.LAYOUTS:
            launches += FM.fused_moe_launches(p["prefill_tokens"], p["top_k"], p["prefill_experts"], p["hidden"],
                                              p["inter"], layout, name="prefill")
    return compiled.dedupe(launches)


def decode_cost_launches(params: dict) -> list:
    """The W4A16 launches at M <= 16 whose main loop `moe.loop_cost` counts: the decode kernel at each
    M of the sweep (dense N x K), and the tiled kernel it replaces at M = 1 (the before)."""
    p = params
    n, k = p["gemm_n"], p["gemm_k"]
    out = []
    for m in parse_ints(p["m_sweep"], "m_sweep"):
        if m <= W.DECODE_MAX_M:
            out += W.decode_launches(m, n, k, name=f"decode kernel M{m} N{n} K{k}")
    out += W.linear_launches(1, n, k, "indexed", name=f"tiled kernel (before) M1 N{n} K{k} cfg "
                             f"{'x'.join(str(v) for v in list(W.linear_config(1, False).values())[:3])}")
    E, H, I = p["decode_experts"], p["decode_hidden"], p["decode_inter"]
    kk = min(p["top_k"], E)
    for m in parse_ints(p["decode_m"], "decode_m"):
        if m <= FM.DECODE_MAX_ROWS:
            out += [la for la in FM.fused_moe_decode_launches(-(-E * m // kk), kk, E, H, I, max_m=m, name=f"decode M{m}")
                    if la.kernel is FM.moe_decode_kernel]
    return out


def roofline_work(params: dict) -> list[dict]:
    """The gpu preset's timed GEMMs as {name, bytes, flops} (this chapter's `gemm_traffic`), with the
    record and measurement that hold their GPU time, for `compiled.chapter_section`."""
    out = []
    for m in parse_ints(params["m_sweep"], "m_sweep"):
        t = gemm_traffic(m, params["gemm_n"], params["gemm_k"], "w4a16")
        out.append({"name": f"W4A16 GEMM M={m} N={params['gemm_n']} K={params['gemm_k']}", "bytes": t["bytes"],
                    "flops": t["flops"], "record": "gpu-w4a16-triton", "metric": f"gemm_m{m}"})
    return out


def packing_map(layout: str, words=(0, 1, 16, 17), N: int = 32, K: int = 64) -> list[tuple[int, list[str]]]:
    """Which weights the 32-bit words at `words` (indices in memory order) of `layout`'s buffer hold,
    as (index, labels 'n{row} k{col}'), derived from the layout's own pack function (not drawn by
    hand): each position p = n*K + k is packed as three 4-bit digits in three packs, read back per nibble."""
    p = torch.arange(N * K).reshape(1, N, K)
    packs = []
    for shift in (0, 4, 8):   # three hex digits of the position, one pack each
        digit = ((p >> shift) & 0xF) - W.OFFSET
        qw, _ = W._pack(digit.to(torch.int8), torch.ones(1, N, K // W.GROUP_SIZE, dtype=torch.bfloat16), layout)
        packs.append(qw.reshape(-1)[list(words)].to(torch.int64) & 0xFFFFFFFF)
    out = []
    for i, w in enumerate(words):
        labels = []
        for j in range(8):
            pos = sum((((packs[d][i] >> (4 * j)) & 0xF) << (4 * d)) for d in range(3))
            labels.append(f"n{int(pos) // K} k{int(pos) % K}")
        out.append((w, labels))
    return out



_DECODE_ROLES = {"w4a16_decode_kernel": "decode kernel, dense (serving path)",
                 "w4a16_decode_swapped_kernel": "decode kernel, dense, swap-AB (serving path)",
                 "moe_decode_kernel": "decode kernel, fused MoE (serving path)",
                 "_w4a16_linear_kernel": "tiled dense, indexed (the prefill tiling at a decode M: comparison)",
                 "moe_gemm_kernel": "tiled fused MoE (the prefill tiling at a decode M: comparison)"}


def decode_bound_rows(target: str = "sm_90", card: str | None = None) -> list[dict]:
    """The cost model's verdict (`compiled.predict_launches`, read from the committed compile table) on
    every gpu-preset W4A16 launch at M <= 16 rows per GEMM (per expert for the MoE ones): the decode
    kernels this chapter serves decode with, and the tiled kernels of the three layouts kept as the
    chapter's comparison. One row per launch: warp-instructions per DRAM byte, issue time over
    memory time (at the copy ceiling), warps per SM, the binding bound and the predicted share of the
    copy ceiling."""
    import re

    from .. import compiled

    card = card or compiled.TARGET_CARD[target]
    out = []
    for p in compiled.predict_launches("chord-w4a16", target, card):
        role = _DECODE_ROLES.get(p["kernel"])
        m = re.search(r"\bM(\d+)\b", p["launch"])
        if role is None or m is None or int(m.group(1)) > W.DECODE_MAX_M:
            continue
        name = p["launch"]
        if not (name.startswith(("decode kernel", "decode M", "decode sweep")) or "decode-packed" in name):
            continue
        if p["kernel"] == "moe_gemm_kernel":
            role = role.replace("fused MoE", "fused MoE, " + next(l for l in W.LAYOUTS if f" {l} " in name))
        bar = compiled.bar_columns(p)
        out.append({"launch": name, "kernel": role, "warp-instr / DRAM byte": round(p["instr_per_byte"], 3),
                    "issue / memory time": bar.pop("issue / memory time"), "warps / SM": p["warps_per_sm"], **bar})
    return out
