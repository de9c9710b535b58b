"""Chapter `kimi-topk-tail-fusion`: the top-k combine folded into the down projection.

The MoE tail at decode: each token's k routed activations go through their experts' down
projections, and the k results are combined, Σ_j w[t, j] · y[t, j]. Both paths are expert-major
on tensor cores (`moe_gemm_kernel`, slots sorted by expert, one `tl.dot` tile of one expert's rows
at a time, the router weight in the epilogue). Separate: the epilogue writes a `[T*k, H]`
intermediate that the combine (`moe_sum`) reads back. Fused: the epilogue scatter-adds each
weighted row into its token's row of an fp32 `[T, H]` accumulator (TensorRT-LLM's fused
finalize), so the intermediate rows never exist. The older token-major GEMV (no tensor cores,
the k rows summed in registers in slot order) is kept as a third variant.

Records, per expert-weight format (BF16, W4A16, MXFP4) and decode batch T:
- `<fmt>-T<T>-separate` / `-fused` / `-token-major` (and, W4A16 and MXFP4, `-decode`: the fused finalize on
  the decode kernels' Marlin-style loop, `moe_decode_tail_kernel`): launches, the buffers each call
  allocated against their independent byte formulas, the bytes each kernel requests (weights counted
  per expert row block, or per slot for the token-major kernel), the checks (each against fp32; fused
  vs separate within the bound that summation order allows; token-major fused == its separate
  pass with an fp32 intermediate, bit for bit; for MXFP4 also the kernel's in-register decode
  against `numerics.mx.dequantize`, bit for bit, in both the tl.dot and the decode kernel), and on CUDA the Triton kernels' times. On CPU
  (interpreter) the Triton paths are checked, not timed.
- `cpu-<fmt>-T<T>`: on CPU, the PyTorch tail timed with its combine pass timed on its own, so the
  combine's share of the tail on this machine is measured, labelled CPU.
MXFP4 experts (the format of the seed's #53152) are quantized by `inferbook.numerics.mx`
(e2m1, E8M0 scale per 32 along K, OCP floor rule), packed two codes per byte by `moe.mxfp4`,
and decoded inside the same tail kernel: the bytes counted are the bytes the kernel reads.
Only the down projection is in the tail; its input activations are given (BF16).
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..measure import benchmark
from .. import tolerance
from ..presets import Param
from ..record import RunRecord
from ..moe import fused_moe as FM, latent_tail as LT, mxfp4 as MXF, routing, w4a16 as W
from ..moe.routing import cpu_threads, on_gpu
from ..moe.timing import gpu_time
from .chord_w4a16 import parse_ints

FORMATS = ("bf16", "w4a16", "mxfp4")
VARIANTS = {  # record variant -> (moe_tail kernel, fused)
    "separate": ("expert-major", False),
    "fused": ("expert-major", True),
    "token-major": ("token-major", True),
    "decode": ("decode", True),      # W4A16 and MXFP4: the Marlin-style decode loop, the same fused finalize
}
DECODE_FORMATS = FM.DECODE_FORMATS


def variants(fmt: str) -> dict:
    """The tail variants this chapter runs for weight format `fmt` (the decode kernel reads W4A16 and MXFP4)."""
    return {v: kf for v, kf in VARIANTS.items() if v != "decode" or fmt in DECODE_FORMATS}
QUANT_LABEL = {"bf16": "none (bf16)", "w4a16": "w4a16 g32", "mxfp4": MXF.LABEL}

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('cpu-bf16', 'combine_share', "The top-k combine's share of the MoE tail's time (PyTorch, bf16)")

PARAMETERS = {
    "hidden": Param(int, help="output size of the down projection (model hidden)"),
    "inter": Param(int, help="expert FFN size (down projection input)"),
    "experts": Param(int, help="routed experts"),
    "top_k": Param(int, help="experts per token"),
    "tokens": Param(str, help="comma-separated decode batch sizes T"),
    "formats": Param(str, help="comma-separated expert weight formats: bf16, w4a16, mxfp4"),
    "reps": Param(int, help="minimum timed repetitions"),
    "ranks": Param(int, help="tensor-parallel ranks of the latent tail (K3 serves at TP8)"),
    "up_hidden": Param(int, help="model hidden size the latent tail's up projection writes (K3: 7168; latent = hidden)"),
}

# Kimi K3's public MoE shapes (vLLM #53152 / #50088 / #53556): routed experts in a 3584-wide latent
# space, 896 experts, top-16, hidden 7168, served at TP8. The expert FFN size per rank is ours
# (Kimi K2's moe_intermediate_size 2048 over 8 ranks): the public sources we read do not state K3's.
K3 = dict(latent=3584, hidden=7168, experts=896, top_k=16, inter_per_rank=256, ranks=8)

PRESETS = {
    "smoke": dict(hidden=64, inter=32, experts=16, top_k=8, tokens="1,4", formats="bf16,w4a16,mxfp4", reps=3,
                  ranks=2, up_hidden=96),
    "cpu": dict(hidden=64, inter=64, experts=16, top_k=8, tokens="1,8", formats="bf16,w4a16,mxfp4", reps=5,
                ranks=2, up_hidden=128),
    # K3's shapes: the down projection writes the latent (hidden = 3584) from one rank's expert slice
    "gpu": dict(hidden=K3["latent"], inter=K3["inter_per_rank"], experts=K3["experts"], top_k=K3["top_k"],
                tokens="1,8,32,128", formats="bf16,w4a16,mxfp4", reps=50, ranks=K3["ranks"], up_hidden=K3["hidden"]),
}


def parse_formats(text: str) -> list[str]:
    vals = [v.strip() for v in str(text).split(",") if v.strip()]
    bad = [v for v in vals if v not in FORMATS]
    if not vals or bad:
        raise UserError(f"formats must be a comma-separated subset of {', '.join(FORMATS)}, got {text!r}")
    return vals


def check_params(P: dict) -> None:
    """Token counts and formats parse, shapes fit the kernels, before any work (`setup` calls this)."""
    parse_ints(P["tokens"], "tokens")
    parse_formats(P["formats"])
    if P["inter"] % 32:
        raise UserError(f"inter must be a multiple of the group size 32, got {P['inter']}")
    if not 1 <= P["top_k"] <= P["experts"]:
        raise UserError(f"top_k must be in [1, experts={P['experts']}], got {P['top_k']}")


def make_tail(ctx, hidden, inter, experts, top_k, T, fmt):
    """Random down weights (BF16, W4A16 indexed or MXFP4), routed activations [T*k, I] and routing."""
    g = ctx.generator(1000 + T)
    w2 = torch.randn(experts, hidden, inter, generator=g, device=ctx.device) / math.sqrt(inter)
    w2 = {"bf16": lambda w: w.bfloat16(), "w4a16": lambda w: W.quantize(w, layout="indexed"),
          "mxfp4": MXF.quantize}[fmt](w2)
    act = torch.randn(T * top_k, inter, generator=g, device=ctx.device).bfloat16()
    logits = torch.randn(T, experts, generator=g, device=ctx.device)
    tw, ids = logits.softmax(-1).topk(top_k)
    return w2, act, tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)


def weight_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one [N, K] expert weight: BF16 16 bits, W4A16 4.5, MXFP4 4.25 bits per weight."""
    return MXF.weight_bytes(n, k) if fmt == "mxfp4" else W.weight_bytes(n, k, fmt)


def dense_weights(w2, dtype=torch.bfloat16) -> torch.Tensor:
    """The expert weights as a dense tensor (dequantized; exact in BF16 for MXFP4, as in the kernel)."""
    if isinstance(w2, torch.Tensor):
        return w2.to(dtype)
    return MXF.dequantize(w2, dtype) if isinstance(w2, MXF.PackedMXFP4) else W.dequantize(w2, dtype)


def decode_probe(w2, kernel: str = "expert-major", w=None) -> tuple[bool, float]:
    """Run the tail kernel `kernel` (on `w`, w2 repacked for it; default w2) with one-hot activations
    (token t = unit vector t, one slot of weight 1 on expert t mod E): output row t is then column t of
    that expert's weight, exactly, so the kernel's in-register MXFP4 decode is compared bit for bit with
    `numerics.mx.dequantize`."""
    E, H, I = w2.shape
    dev = w2.device
    ids = (torch.arange(I, device=dev) % E).to(torch.int32)[:, None]
    act = torch.eye(I, device=dev).bfloat16()
    out, _, _ = FM.moe_tail(act, w2 if w is None else w, torch.ones((I, 1), device=dev), ids, fused=True, kernel=kernel)
    want = torch.empty((I, H), dtype=torch.float32, device=dev)
    for e in range(min(E, I)):  # one expert at a time: the whole fp32 table can be gigabytes
        cols = torch.arange(e, I, E, device=dev)
        one = MXF.PackedMXFP4(w2.qweight[e:e + 1], w2.scales[e:e + 1], (1, H, I))
        want[cols] = MXF.dequantize(one)[0][:, cols].T
    return torch.equal(out.float(), want), float((out.float() - want).abs().max())


def traffic(T: int, k: int, H: int, I: int, fmt: str, counts: list[int], block_m: int,
            decode_block_m: int = FM.DECODE_TAIL_BLOCK_M) -> dict:
    """Bytes each tail variant requests from memory, counted from the routing (not from the kernels):

    - weights: the expert-major kernels read an expert's [H, I] weights once per BLOCK_M-row block
      of its slots (Σ_e ceil(c_e / BLOCK_M) reads); the token-major kernel streams its slot's expert
      for every slot (T*k reads; an L2 hit can save some of them, the count is what is requested).
    - activations T*k*I BF16, routing ids and weights 8 bytes per slot, output T*H BF16; the
      expert-major kernels also read the sorted slot ids and block experts (4 bytes each).
    - separate: the [T*k, H] BF16 rows written, then read by the combine.
    - fused: the fp32 [T, H] accumulator zero-filled, written back by the atomics (at least once),
      and read by the cast to BF16.
    - decode (W4A16, MXFP4): the fused tail at row blocks of `decode_block_m` (`FM.decode_tail_block_m`:
      16, or 8 on B200's swap-AB W4A16 loop), weights in
      `pack_decode`'s layout (K padded to 256, `FM.decode_weight_bytes`; 0 for BF16, which it does not read).
    """
    wb = weight_bytes(H, I, fmt)
    blocks = sum(-(-c // block_m) for c in counts if c)
    E = len(counts)
    P = routing.padded_rows(T * k, E, block_m)  # align_indexed's worst-case size
    common = T * k * I * 2 + T * k * 8 + T * H * 2
    sort = P * 4 + (P // block_m) * 4
    rows, acc = T * k * H * 2, T * H * 4
    dbm = decode_block_m
    decode_blocks = sum(-(-c // dbm) for c in counts if c)
    Pd = routing.padded_rows(T * k, E, dbm)
    dwb = FM.decode_weight_bytes(H, I, fmt) if fmt in DECODE_FORMATS else 0
    return {"weight_reads_expert_major": blocks, "weight_reads_token_major": T * k, "weight_reads_decode": decode_blocks,
            "weight_bytes_each": wb, "decode_weight_bytes_each": dwb,
            "rows_bytes": rows, "accumulator_bytes": acc,
            "separate": blocks * wb + common + sort + 2 * rows,
            "fused": blocks * wb + common + sort + 3 * acc,
            "token-major": T * k * wb + common,
            "decode": decode_blocks * dwb + common + Pd * 4 + (Pd // dbm) * 4 + 3 * acc}


def buffers_expected(T: int, k: int, H: int, variant: str, inter_bytes_per: int = 2) -> dict:
    """The intermediate buffers a variant must allocate, from the shapes alone."""
    if variant == "separate":
        return {"rows": T * k * H * inter_bytes_per, "accumulator": 0}
    if variant in ("fused", "decode"):
        return {"rows": 0, "accumulator": T * H * 4}
    return {"rows": 0, "accumulator": 0}


def _record(ctx, name, variant, fmt, T, p, backend, why):
    rec = ctx.new_record(name, variant=variant, workload={
        "model": f"MoE tail: E{p['experts']} H{p['hidden']} I{p['inter']} top-{p['top_k']}",
        "quantization": QUANT_LABEL[fmt], "batch": T, "dtype": "bfloat16"})
    rec.set_backend("moe_tail", backend, reason=why, shapes={"act": [T * p["top_k"], p["inter"]],
                                                              "w2": [p["experts"], p["hidden"], p["inter"]]})
    return rec


BACKEND = {"separate": "expert-major tl.dot down GEMM, router weight in the epilogue, then moe_sum",
           "fused": "expert-major tl.dot down GEMM, router weight + atomic scatter-add into token rows",
           "decode": "expert-major decode GEMM (Marlin-style loop, 16-row blocks), router weight + atomic scatter-add",
           "token-major": "token-major GEMV per slot (no tensor cores), k rows summed in registers"}


def measure(ctx, *, hidden, inter, experts, top_k, tokens, formats, reps, ranks, up_hidden) -> list[RunRecord]:
    Ts = parse_ints(tokens, "tokens")
    fmts = parse_formats(formats)
    if inter % 32:
        raise UserError(f"inter must be a multiple of the group size 32, got {inter}")
    if not 1 <= top_k <= experts:
        raise UserError(f"top_k must be in [1, experts={experts}], got {top_k}")
    p = dict(hidden=hidden, inter=inter, experts=experts, top_k=top_k)
    name, why = FM.backend(ctx.device)
    triton_ok = name == "triton"
    interp = ctx.device.type != "cuda"
    records = []
    for fmt in fmts:
        for T in Ts:
            w2, act, tw, ids = make_tail(ctx, hidden, inter, experts, top_k, T, fmt)
            ref = FM.moe_tail_reference(act, w2, tw, ids)
            torch_out = FM.moe_tail_torch(act, w2, tw, ids)
            counts = torch.bincount(ids.flatten().long(), minlength=experts).tolist()
            block_m = FM.moe_config(T * top_k / experts, interp)["BLOCK_M"]
            tr = traffic(T, top_k, hidden, inter, fmt, counts, block_m, FM.decode_tail_block_m(fmt, ctx.device))
            outs, recs = {}, {}
            d2 = FM.pack_for_decode(w2) if fmt in DECODE_FORMATS else None   # load time, once: not in the timed tail
            for variant, (kernel, fused) in variants(fmt).items():
                w = d2 if kernel == "decode" else w2
                out, launches, buffers = FM.moe_tail(act, w, tw, ids, fused=fused, kernel=kernel)
                outs[variant] = out
                tail_backend = f"{name}: {BACKEND[variant]}" + (", MXFP4 decoded in registers" if fmt == "mxfp4" else "")
                rec = _record(ctx, f"{fmt}-T{T}-{variant}", variant, fmt, T, p, tail_backend, why)
                rec.notes = BACKEND[variant]
                err, tol, ok = FM.within_tolerance(out, ref, torch_out)
                rec.add_check(f"{variant} vs fp32 reference", ok, error=err, tolerance=tol)
                rec.add("max_abs_error", err, "abs", phase="check")
                rec.add("launches", launches, "kernels", phase="analysis",
                        note="fused: zero-fill, GEMM, cast" if variant == "fused" else "")
                rec.add("intermediate_bytes", buffers["rows"], "bytes", phase="analysis")
                rec.add("accumulator_bytes", buffers["accumulator"], "bytes", phase="analysis")
                reads = tr[{"token-major": "weight_reads_token_major", "decode": "weight_reads_decode"}.get(
                    variant, "weight_reads_expert_major")]
                each = tr["decode_weight_bytes_each" if variant == "decode" else "weight_bytes_each"]
                rec.add("tail_bytes", tr[variant], "bytes", phase="analysis", weight_bytes=each * reads,
                        weight_reads=reads)
                rec.add("weight_bits_per_weight", 8 * weight_bytes(hidden, inter, fmt) / (hidden * inter), "bits",
                        phase="analysis")
                if triton_ok:  # the buffers the call allocated against the shapes' formula (0 cannot pass for rows)
                    want = buffers_expected(T, top_k, hidden, variant)
                    ok_buf = buffers == want and (variant != "separate" or buffers["rows"] > 0)
                    rec.add_check("intermediate buffers == the shapes' byte count", ok_buf,
                                  error=float(buffers["rows"] + buffers["accumulator"]),
                                  tolerance=float(want["rows"] + want["accumulator"]))
                recs[variant] = rec
            if triton_ok:
                sep32, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32)
                ok_order, worst = FM.reorder_bound(outs["fused"], sep32, act, w2, tw, ids)
                recs["fused"].add_check("fused == separate (fp32 rows) up to summation order (bound)", ok_order,
                                        error=worst, tolerance=1.0)
                if d2 is not None:   # the decode kernel's own separate pass (fp32 rows): the same terms, slot order
                    dec32, _, _ = FM.moe_tail(act, d2, tw, ids, fused=False, inter_dtype=torch.float32, kernel="decode")
                    ok_dec, worst_dec = FM.reorder_bound(outs["decode"], dec32, act, w2, tw, ids)
                    recs["decode"].add_check("decode fused == its separate pass (fp32 rows) up to summation order (bound)",
                                             ok_dec, error=worst_dec, tolerance=1.0)
                tm32, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32, kernel="token-major")
                recs["token-major"].add_check("token-major fused == its separate pass with fp32 rows (bitwise)",
                                              torch.equal(outs["token-major"], tm32),
                                              error=float((outs["token-major"].float() - tm32.float()).abs().max()),
                                              tolerance=0.0)
            if fmt == "mxfp4" and T == Ts[0] and triton_ok:  # once per run: the decode does not depend on T
                same, err = decode_probe(w2)
                recs["fused"].add_check("in-kernel MXFP4 decode == numerics.mx.dequantize (bitwise, one-hot probe)",
                                        same, error=err, tolerance=0.0)
                same, err = decode_probe(w2, "decode", d2)
                recs["decode"].add_check("decode loop's MXFP4 decode == numerics.mx.dequantize (bitwise, one-hot probe)",
                                         same, error=err, tolerance=0.0)
            if on_gpu(ctx) and triton_ok:
                for variant, (kernel, fused) in variants(fmt).items():
                    fn = (lambda kernel=kernel, fused=fused, w=(d2 if kernel == "decode" else w2):
                          FM.moe_tail(act, w, tw, ids, fused=fused, kernel=kernel, check=False))
                    t, how = gpu_time(fn, ctx.device, label=f"{fmt} T={T} {variant}", reps=reps)
                    recs[variant].add_timing("tail", t, phase="decode", how=how)
                    recs[variant].add("tail_gbps", tr[variant] / t.median_s / 1e9, "GB/s", phase="decode")
            records += list(recs.values())
            if not on_gpu(ctx):
                records.append(cpu_record(ctx, act, w2, tw, ids, fmt, T, p, reps))
            if fmt in LATENT_FORMATS:
                records += latent_records(ctx, fmt, T, p, ranks, up_hidden, reps, triton_ok, name, why)
    return records


# #53152's experts are MXFP4; BF16 beside them. (The latent tail runs W4A16 too; this chapter leaves it out.)
LATENT_FORMATS = ("bf16", "mxfp4")


def latent_gemm2(fmt: str) -> str:
    """The latent tail's GEMM2 kernel for `fmt`: the decode loop for 4-bit weights (at decode a row block
    holds a slot or two, so the tl.dot kernel's dequantization would set its time), tl.dot for BF16."""
    return "decode" if fmt in DECODE_FORMATS else "expert-major"


def latent_block_m(fmt: str, T: int, k: int, E: int, interpreted: bool, device=None) -> int:
    """GEMM2's row block: the decode tail's on the decode loop (`FM.decode_tail_block_m`), else `moe_config`'s."""
    if latent_gemm2(fmt) == "decode":
        return FM.decode_tail_block_m(fmt, device if device is not None or not interpreted else torch.device("cpu"))
    return FM.moe_config(T * k / E, interpreted)["BLOCK_M"]

LATENT_BACKEND = {
    "separate": "GEMM2 rows (permuted, unweighted) -> finalize kernel (gather, x router weight, fp32 top-k sum) "
                "-> collective (rank sum, RMSNorm) -> up-projection + shared",
    "atomic": "zero-fill fp32 -> GEMM2 with router weight + atomic add -> cast -> collective -> up-projection + shared",
    "deferred": "GEMM2 rows -> collective that gathers, weights and sums the rows as it loads them (#53152, "
                "do_finalize=False) -> up-projection + shared",
}


def latent_counts(T: int, k: int, E: int, L: int, H: int, I: int, N: int, fmt: str, variant: str,
                  counts: list[int], block_m: int) -> dict:
    """Launches and bytes of one rank's latent tail, summed over `LT.tail_costs`'s launches."""
    costs = LT.tail_costs(T, k, E, L, H, I, N, fmt, variant, counts, block_m, latent_gemm2(fmt))
    return {"launches": len(costs), "bytes": sum(c["read"] + c["written"] for c in costs), "per_launch": costs}


def latent_records(ctx, fmt, T, p, ranks, up_hidden, reps, triton_ok, backend_name, why) -> list[RunRecord]:
    """The latent tail at this run's shapes (latent = `hidden`, `ranks` TP slices of `inter` each):
    one record per variant, with launches and bytes per rank, the checks, and GPU times on CUDA."""
    E, k, L, I = p["experts"], p["top_k"], p["hidden"], p["inter"]
    x = LT.make_inputs(ranks, T, L, up_hidden, E, k, I * ranks, fmt=fmt, device=ctx.device, seed=ctx.seed + 77 + T,
                       gemm2=latent_gemm2(fmt))
    ref = LT.latent_tail_reference(x)
    torch_out = LT.latent_tail_torch(x)
    counts = torch.bincount(x.topk_ids.flatten().long(), minlength=E).tolist()
    block_m = latent_block_m(fmt, T, k, E, ctx.device.type != "cuda", ctx.device)
    outs, recs = {}, {}
    for variant in LT.VARIANTS:
        out, names, buffers = LT.run_tail(x, variant)
        outs[variant] = out
        rec = ctx.new_record(f"latent-{fmt}-T{T}-{variant}", variant=f"latent {variant}", workload={
            "model": f"latent MoE tail: E{E} L{L} I{I}/rank top-{k}, TP{ranks}, up-projection to {up_hidden}",
            "quantization": QUANT_LABEL[fmt], "batch": T, "dtype": "bfloat16", "ranks": ranks})
        gemm2 = " (GEMM2 on the decode loop)" if latent_gemm2(fmt) == "decode" else ""
        rec.set_backend("latent_tail", f"{backend_name}: {LATENT_BACKEND[variant]}{gemm2}" if triton_ok else "torch", reason=why,
                        shapes={"rows": [ranks, T * k, L], "w_up": [up_hidden, L]})
        c = latent_counts(T, k, E, L, up_hidden, I, ranks, fmt, variant, counts, block_m)
        rec.add("launches", c["launches"], "kernels per rank", phase="analysis", launches=list(LT.LAUNCHES[variant]),
                ran=names)
        rec.add("tail_bytes", c["bytes"], "bytes per rank", phase="analysis",
                per_launch=c["per_launch"], note="one rank of the real protocol (tail_costs)")
        rec.add("intermediate_bytes", buffers.get("partial", 0) + buffers.get("accumulator", 0), "bytes per rank",
                phase="analysis", buffers=buffers)
        err, tol, ok = FM.within_tolerance(out, ref, torch_out)
        rec.add_check(f"latent {variant} vs fp32 reference", ok, error=err, tolerance=tol)
        rec.add("max_abs_error", err, "abs", phase="check")
        if triton_ok:   # the launches that ran, less the stand-in's per-rank repeats of GEMM2
            rec.add_check("launches that ran == the variant's launch list", len(names) - (ranks - 1) == c["launches"],
                          error=float(len(names) - (ranks - 1)), tolerance=float(c["launches"]))
        recs[variant] = rec
    if triton_ok:
        # Two kernels (the finalize kernel, the collective's load) run the same `_finalize_row` loop with
        # fp fusion off, so they should agree in bits; but a GPU guarantees bits only for one kernel and
        # one launch (CONTRIBUTING's audit), so the check is FlashAttention's rule against the fp32
        # gold, and the bits that differ are counted, not asserted.
        tol = tolerance.within_reference_error(outs["deferred"], outs["separate"], LT.latent_tail_reference(x, None),
                                               torch.bfloat16)
        recs["deferred"].add_check("deferred within 2 x the separate path's error vs the fp32 gold (+1 ulp)",
                                   tol["passed"], error=tol["error"], tolerance=tol["tolerance"])
        recs["deferred"].add("bits_differ_from_separate", int((outs["deferred"].view(torch.int16)
                                                               != outs["separate"].view(torch.int16)).sum()),
                             "elements", phase="check", elements=outs["deferred"].numel(),
                             note="counted, not asserted: two kernels with the same per-element arithmetic")
        recs["deferred"].add_check("deferred takes fewer launches and bytes than separate",
                                   recs["deferred"].value("launches") < recs["separate"].value("launches")
                                   and recs["deferred"].value("tail_bytes") < recs["separate"].value("tail_bytes"))
    if on_gpu(ctx) and triton_ok:
        for variant in LT.VARIANTS:
            t, how = gpu_time(lambda v=variant: LT.run_tail(x, v), ctx.device, label=f"latent {fmt} T={T} {variant}",
                              reps=reps)
            recs[variant].add_timing("latent_tail", t, phase="decode", how=how,
                                     note=f"{ranks} ranks' GEMM2 in one process (the AllReduce stand-in)")
    return list(recs.values())


def k3_table(tokens=(1, 8, 32, 128), fmt: str = "mxfp4") -> list[dict]:
    """Launches and bytes per rank of the three latent-tail variants at K3's public shapes, counted
    launch by launch (`LT.tail_costs`) for T tokens spread evenly over the experts."""
    E, k, L, H, I, N = K3["experts"], K3["top_k"], K3["latent"], K3["hidden"], K3["inter_per_rank"], K3["ranks"]
    rows = []
    for T in tokens:
        counts = [T * k // E + (1 if e < T * k % E else 0) for e in range(E)]
        block_m = latent_block_m(fmt, T, k, E, False)
        for variant in LT.VARIANTS:
            c = latent_counts(T, k, E, L, H, I, N, fmt, variant, counts, block_m)
            rows.append({"T": T, "variant": variant, "launches per rank": c["launches"],
                         "bytes per rank MB": c["bytes"] / 1e6})
    return rows


def cpu_record(ctx, act, w2, tw, ids, fmt, T, p, reps) -> RunRecord:
    """PyTorch on this CPU: the whole tail (per-expert GEMMs into [T*k, H], then the sum), and the
    combine pass alone, so its share of the tail is a measured number (labelled CPU)."""
    rec = ctx.new_record(f"cpu-{fmt}-T{T}", variant="pytorch separate combine", workload={
        "model": f"MoE tail: E{p['experts']} H{p['hidden']} I{p['inter']} top-{p['top_k']}",
        "quantization": QUANT_LABEL[fmt], "batch": T, "dtype": "bfloat16"})
    rec.set_backend("moe_tail", "torch (one matmul per active expert + sum over k)", reason="CPU: PyTorch paths only",
                    shapes={"act": list(act.shape)})
    W2 = dense_weights(w2)  # resident BF16 copy: time the tail, not dequant
    flat = ids.flatten().long()
    wts = tw.float().flatten()[:, None]
    k = ids.shape[1]
    groups = [(e, (flat == e).nonzero().flatten()) for e in torch.unique(flat).tolist()]
    H = W2.shape[1]

    def down():  # one GEMM per active expert: no [T*k, H, I] gather of the weights
        y = torch.empty((T * k, H), dtype=torch.bfloat16)
        for e, slots in groups:
            y[slots] = ((act[slots] @ W2[e].T).float() * wts[slots]).bfloat16()
        return y

    y = down()
    with cpu_threads(1):
        t_down = benchmark(down, ctx.device, label="down", warmup=1, min_reps=reps, min_time_s=0.2)
        t_comb = benchmark(lambda: y.reshape(T, k, -1).float().sum(1).bfloat16(), ctx.device, label="combine",
                           warmup=1, min_reps=reps, min_time_s=0.2)
    rec.add_timing("down_projection", t_down, phase="decode", device_label="CPU (PyTorch)", threads=1)
    rec.add_timing("combine_pass", t_comb, phase="decode", device_label="CPU (PyTorch)", threads=1)
    rec.add("combine_share", t_comb.median_s / (t_comb.median_s + t_down.median_s), "fraction", phase="decode")
    return rec


def latent_rows(records: list[RunRecord]) -> list[dict]:
    """One row per latent-tail record: launches and bytes per rank, intermediate buffer, error, time."""
    out = []
    for r in records:
        if not r.name.startswith("latent-"):
            continue
        row = {"format": r.workload["quantization"], "T": r.workload["batch"], "variant": r.variant,
               "launches per rank": int(r.value("launches")), "tail MB per rank (counted)": r.value("tail_bytes") / 1e6,
               "finalized / fp32 intermediate MB": r.value("intermediate_bytes") / 1e6,
               "max |err| vs fp32": r.value("max_abs_error")}
        try:
            row["elements differing from separate"] = int(r.value("bits_differ_from_separate"))
        except KeyError:
            row["elements differing from separate"] = None
        try:
            row["time µs"] = 1e6 * r.value("latent_tail")
        except KeyError:
            pass
        out.append(row)
    return out


def rows(records: list[RunRecord]) -> list[dict]:
    """One row per (format, T, variant) for the chapter's table."""
    out = []
    for r in records:
        if r.name.startswith(("cpu-", "latent-")):
            continue
        row = {"format": r.workload["quantization"], "T": r.workload["batch"], "variant": r.variant,
               "launches": int(r.value("launches")), "intermediate rows MB": r.value("intermediate_bytes") / 1e6,
               "fp32 accumulator MB": r.value("accumulator_bytes") / 1e6,
               "weight reads": r.get("tail_bytes")["weight_reads"],
               "tail MB (counted)": r.value("tail_bytes") / 1e6, "max |err| vs fp32": r.value("max_abs_error")}
        try:
            row["time µs"] = 1e6 * r.value("tail")
        except KeyError:
            pass
        out.append(row)
    return out


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): in every weight
    format at every token count, each tail variant (`variants`: expert-major separate and fused,
    token-major fused, and for W4A16 and MXFP4 the decode kernel's fused tail) and the fp32-row separate pass
    of each of those kernels, which the checks compare with; the MXFP4 decode probes (one-hot, T = inter,
    k = 1; the tl.dot and the decode kernel), the decode kernel's exact-scale MXFP4 path at the first T (compiled
    only: the preset's scales all fold) and the MXFP4 weight packing (MX quantize of W2)."""
    from .. import compiled
    from ..numerics import mx as MX

    p = params
    E, k, H, I = p["experts"], p["top_k"], p["hidden"], p["inter"]
    launches = []
    for fmt in parse_formats(p["formats"]):
        for T in parse_ints(p["tokens"], "tokens"):
            for variant, (kernel, fused) in variants(fmt).items():
                launches += FM.moe_tail_launches(T, k, E, H, I, fmt, fused=fused, kernel=kernel, name=variant)
            for kernel in dict.fromkeys(kernel for kernel, _ in variants(fmt).values()):
                launches += FM.moe_tail_launches(T, k, E, H, I, fmt, fused=False, inter_dtype=torch.float32,
                                                 kernel=kernel, name="check: fp32 rows")
        for T in parse_ints(p["tokens"], "tokens") if fmt in LATENT_FORMATS else ():
            for variant in LT.VARIANTS:
                launches += LT.tail_launches(T, k, E, H, p["up_hidden"], I, p["ranks"], fmt, variant, name="latent",
                                             gemm2=latent_gemm2(fmt))
        if fmt == "mxfp4":
            launches += FM.moe_tail_launches(I, 1, E, H, I, fmt, fused=True, name="MXFP4 decode probe")
            launches += FM.moe_tail_launches(I, 1, E, H, I, fmt, fused=True, kernel="decode", name="MXFP4 decode probe")
            # the exact-scale path (a scale byte outside FOLD_SCALES), which the preset's weights never take: compiled
            # so its registers and spills are on record (at the folded loop's one warp it spilled 1.8 KB on sm_90)
            T0 = parse_ints(p["tokens"], "tokens")[0]
            launches += FM.moe_tail_launches(T0, k, E, H, I, fmt, fused=True, kernel="decode", fold=False,
                                             name="compile check: MXFP4 exact scales")
            launches += MX.quantize_launches((E, H, I), torch.float32, MXF.ELEMENT, axis=-1, block=MXF.BLOCK,
                                             scale_rounding=MXF.SCALE_ROUNDING, name=f"MXFP4 pack of W2 [{E}, {H}, {I}]")
    # the tail GEMMs keep a row per token count: their grids (and so waves and residency) follow T
    return compiled.dedupe(launches, keep_grids=("moe_gemm_kernel", "moe_decode_tail_kernel", "down_tail_kernel"))


def roofline_work(params: dict) -> list[dict]:
    """The fused tail per format at the largest T as {name, bytes, flops}: bytes `traffic` for the
    T·k slots spread evenly over the experts (uniform routing: the counts a trained router only
    approximates), at the GPU's BLOCK_M; flops 2·T·k·H·I."""
    E, k, H, I = params["experts"], params["top_k"], params["hidden"], params["inter"]
    T = parse_ints(params["tokens"], "tokens")[-1]
    counts = [T * k // E + (1 if e < T * k % E else 0) for e in range(E)]
    block_m = FM.moe_config(T * k / E, False)["BLOCK_M"]
    out = []
    for fmt in parse_formats(params["formats"]):
        tr = traffic(T, k, H, I, fmt, counts, block_m)
        out.append({"name": f"{fmt} tail fused T{T}", "bytes": tr["fused"], "flops": 2 * T * k * H * I,
                    "record": f"{fmt}-T{T}-fused", "metric": "tail"})
    return out
