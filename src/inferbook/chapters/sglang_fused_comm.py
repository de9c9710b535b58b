"""Chapter `sglang-fused-comm`: a fused MoE tail with fixed rounding points, all-reduce orders,
and vocab-parallel greedy sampling (seed §六, SGLang #39653).

`measure(ctx, ...)` returns these records:

- `tail` — on this device, one process: the fused pass against the unfused chain (bits), the
  naive fp32 fusion against both (differences counted), bytes each moves; on a GPU, their times.
- `tail-distributed` — the same tail, the all-reduce variants and vocab greedy on `world_size`
  ranks (torch.distributed: NCCL with one GPU per rank where there are enough GPUs, else gloo on
  CPU), every check as a record check.
- `allreduce-order` — how many elements' bits depend on the summation order, per dtype,
  algorithm and accumulation (single-process simulation of the ranks; the distributed run
  matches it bit for bit, see `tail-distributed`).
- `allreduce-time` — one-shot/two-shot x push/pull and torch.distributed.all_reduce over sizes.
- `greedy` — pairs vs gather over vocab sizes and batches, the crossover and the selector's choice.
- `vocab-gather` — the full-logit gather by push-slot or ring over sizes, the crossover, the
  transport selector scored out of sample.
"""
from __future__ import annotations

import statistics

import torch

from ..measure import benchmark, ceilings, compare_timings, roofline
from ..presets import Param
from ..record import RunRecord
from ..comm import allreduce as ar, tail, vocab_greedy as vg, workers

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('tail', 'naive_bits_differ_out', 'Output elements of the naive tail whose bits differ from the fixed-rounding one')

PARAMETERS = {
    "world_size": Param(int, help="ranks (processes) for the distributed parts, 2-8"),
    "tokens": Param(int, help="tokens in the MoE tail"),
    "hidden": Param(int, help="hidden size of the MoE tail"),
    "topk_per_rank": Param(int, help="top-k expert slots each rank combines per token"),
    "dtype": Param(str, "bfloat16", help="data dtype of the tail", choices=("bfloat16", "float16")),
    "check_numel": Param(int, help="elements per rank in the distributed all-reduce checks"),
    "order_numel": Param(int, help="elements per rank in the summation-order demonstration"),
    "allreduce_numels": Param(tuple, help="bf16 elements per all-reduce timing (comma list)"),
    "vocab": Param(int, 163840, help="the vocabulary of the headline greedy comparison (Kimi-like)"),
    "vocabs": Param(tuple, help="vocabulary sizes of the greedy crossover sweep (comma list)"),
    "batches": Param(tuple, help="batch sizes of the greedy crossover sweep (comma list)"),
    "reps": Param(int, help="timed repetitions per configuration"),
    "use_cuda": Param(bool, True, help="NCCL with one GPU per rank when there are at least 2 GPUs"),
    "decode_tokens": Param(tuple, (1, 8, 64), help="decode-sized token counts timed beside `tokens` (GPU only)"),
    "timeout_s": Param(int, 300, help="deadline of the multi-process part (seconds)"),
}

PRESETS = {
    "smoke": dict(world_size=2, tokens=4, hidden=96, topk_per_rank=2, check_numel=256, order_numel=4096,
                  allreduce_numels=(512, 16384), vocab=16384, vocabs=(1024, 16384), batches=(1, 8), reps=3,
                  timeout_s=150),
    # cpu: the tail's Triton kernels run in the interpreter (one Python step per program), so 8 tokens; the
    # ranks' timing loops share 2 cores among 4 processes, so 5 reps and all-reduce sizes up to 256K elements
    "cpu": dict(world_size=4, tokens=8, hidden=1024, topk_per_rank=2, check_numel=4096, order_numel=1 << 16,
                allreduce_numels=(1024, 16384, 262144), vocab=163840, vocabs=(4096, 32768, 163840),
                batches=(1, 16, 64), reps=5),
    "gpu": dict(world_size=4, tokens=2048, hidden=7168, topk_per_rank=2, check_numel=65536, order_numel=1 << 20,
                allreduce_numels=(4096, 65536, 1 << 20, 1 << 22), vocab=163840,
                vocabs=(8192, 32768, 65536, 163840, 262144), batches=(1, 8, 64, 256), reps=15, timeout_s=500),
}


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def check_params(P: dict) -> None:
    """The ranks, the vocabularies they split, the tail's size and the sweep lists, before any work (`setup`
    calls this)."""
    from ..errors import UserError

    ws = P["world_size"]
    if not 2 <= ws <= workers.MAX_WORLD:
        raise UserError(f"parameter 'world_size' must be in 2..{workers.MAX_WORLD} (ranks), got {ws}")
    for name in ("allreduce_numels", "vocabs", "batches", "decode_tokens"):
        if not P[name]:
            raise UserError(f"parameter {name!r} must be a non-empty comma list of ints >= 1, got {P[name]!r}")
    for v in sorted(set(_ints(P["vocabs"])) | {P["vocab"]}):
        if v < ws:
            raise UserError(f"vocab size {v} cannot be split over world_size={ws} ranks (each rank needs at least "
                            f"one vocabulary entry); use vocab sizes >= {ws}")
        vg.shard_bounds(v, ws)
    n = ws * P["tokens"] * P["topk_per_rank"] * P["hidden"]
    if n >= 2**31:
        raise UserError(f"world_size x tokens x topk_per_rank x hidden = {n} elements of expert output exceed the "
                        "tail kernels' int32 offsets (< 2**31)")


# ---------------------------------------------------------------------------
# Pieces the notebook also calls

def tail_comparison(ctx, *, world_size, tokens, hidden, topk_per_rank, dtype, offset=0) -> dict:
    """Fresh random tail inputs on this device; every variant's outputs and the differences."""
    dt = getattr(torch, dtype)
    inp = tail.make_tail_inputs(world_size, tokens, hidden, topk_per_rank, dt,
                                generator=torch.Generator().manual_seed(ctx.seed + 100 + offset), device=ctx.device)
    outs = {v: tail.run_tail(inp, v) for v in tail.VARIANTS}
    diffs = []
    for a, b in (("fused", "unfused"), ("reference", "unfused"), ("naive", "unfused"), ("naive", "reference")):
        for i, what in enumerate(("out", "residual_out")):
            x, y = outs[a][i], outs[b][i]
            mask = tail.bits_differ(x, y)
            ulps = tail.ulp_distance(x, y)
            diffs.append({"pair": f"{a} vs {b}", "output": what, "elements": x.numel(),
                          "bits_differ": int(mask.sum()), "fraction": float(mask.float().mean()),
                          "max_ulp": int(ulps.max()), "max_abs": float((x.float() - y.float()).abs().max()),
                          "nan": bool(x.isnan().any() or y.isnan().any())})
    return {"inputs": inp, "outputs": outs, "diffs": diffs}


def order_demonstration(world_size: int, numel: int, seed: int) -> list[dict]:
    """Single-process simulation of the ranks: for each dtype, algorithm, order and accumulation,
    how many elements' bits differ between ranks, and from the fixed-order one-shot result."""
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(seed + 7)
        inputs = list(torch.randn(world_size, numel, generator=g).to(dt))
        for acc in ar.ACCUMULATE:
            fixed = ar.simulate(inputs, "one-shot", "fixed", acc)[0]
            for alg in ar.ALGORITHMS:
                for order in ar.ORDERS:
                    res = ar.simulate(inputs, alg, order, acc)
                    across = torch.zeros(numel, dtype=torch.bool)
                    for r in res[1:]:
                        across |= tail.bits_differ(r, res[0])
                    vs_fixed = torch.zeros(numel, dtype=torch.bool)
                    for r in res:
                        vs_fixed |= tail.bits_differ(r, fixed)
                    rows.append({"dtype": str(dt).replace("torch.", ""), "accumulate": acc, "algorithm": alg,
                                 "order": order, "ranks_disagree": int(across.sum()),
                                 "differs_from_fixed": int(vs_fixed.sum()), "numel": numel})
    return rows


def order_ranks_for(world_size: int) -> int:
    """Ranks simulated in the order demonstration: at least 4 (two contributions commute)."""
    return max(4, world_size)


def _faster(gather: dict, pairs: dict) -> str:
    """'gather', 'pairs', or 'either' when this run's spread cannot separate them (compare_timings
    on the slowest rank's samples; rows without samples fall back to comparing p10-p90 ranges)."""
    if gather.get("samples_s") and pairs.get("samples_s") and len(gather["samples_s"]) > 1 \
            and len(pairs["samples_s"]) > 1:
        v = compare_timings(gather["samples_s"], pairs["samples_s"]).verdict
        return {"faster": "gather", "slower": "pairs"}.get(v, "either")
    if gather["p90_s"] < pairs["p10_s"]:
        return "gather"
    if pairs["p90_s"] < gather["p10_s"]:
        return "pairs"
    return "either"


def crossover_of(configs: list[dict]) -> float:
    """The selector's threshold fitted on `configs`: the largest slice size at which gathering
    was not slower than pairs (0 when pairs won everywhere)."""
    return max([float(c["slice_bytes"]) for c in configs if c["faster"] in ("gather", "either")], default=0.0)


def greedy_crossover(rows: list[dict]) -> tuple[float, list[dict]]:
    """From timed rows (strategy, vocab, batch, median_s, p10_s, p90_s, slice_bytes, samples_s):
    the crossover fitted on every configuration, and one row per config with `faster` in
    {'gather', 'pairs', 'either'} (either: the run cannot separate them)."""
    by_cfg: dict = {}
    for r in rows:
        by_cfg.setdefault((r["vocab"], r["batch"]), {})[r["strategy"]] = r
    configs = []
    for (vocab, batch), d in sorted(by_cfg.items()):
        if not {"pairs", "gather"} <= set(d):
            continue
        configs.append({"vocab": vocab, "batch": batch, "slice_bytes": d["gather"]["bytes_sent"],
                        "pairs_s": d["pairs"]["median_s"], "gather_s": d["gather"]["median_s"],
                        "gather_over_pairs": d["gather"]["median_s"] / d["pairs"]["median_s"],
                        "faster": _faster(d["gather"], d["pairs"])})
    return crossover_of(configs), configs


def selector_held_out(configs: list[dict], tp: int) -> list[dict]:
    """Leave-one-out score of the selector: for each configuration, the crossover is fitted on
    all the *other* configurations and the selector's choice for this one is compared with what
    was measured. `agrees` is None where the run could not separate the two strategies."""
    out = []
    for i, c in enumerate(configs):
        fitted = crossover_of(configs[:i] + configs[i + 1:])
        choice, why = vg.choose_strategy(c["vocab"], c["batch"], tp, 2, crossover_bytes=fitted)
        agrees = None if c["faster"] == "either" else choice == c["faster"]
        out.append({**c, "held_out_crossover": fitted, "choice": choice, "reason": why, "agrees": agrees})
    return out


# ---------------------------------------------------------------------------

def gather_transport_configs(rows: list[dict]) -> list[dict]:
    """One row per (vocab, batch) from timed gather rows (slowest rank's samples): the slice bytes and
    which transport was faster ('push-slot', 'ring', or 'either' when the run cannot separate them)."""
    by_cfg: dict = {}
    for r in rows:
        by_cfg.setdefault((r["vocab"], r["batch"]), {})[r["transport"]] = r
    out = []
    for (vocab, batch), d in sorted(by_cfg.items()):
        if not {"push-slot", "ring"} <= set(d):
            continue
        v = _faster(d["push-slot"], d["ring"])     # 'gather' here means push-slot, 'pairs' ring
        out.append({"vocab": vocab, "batch": batch, "slice_bytes": d["ring"]["bytes_sent"],
                    "push_s": d["push-slot"]["median_s"], "ring_s": d["ring"]["median_s"],
                    "faster": {"gather": "push-slot", "pairs": "ring"}.get(v, "either")})
    return out


def gather_held_out(configs: list[dict], tp: int) -> list[dict]:
    """Leave-one-out score of the transport selector: the crossover (largest slice where push-slot
    was not slower) is fitted on the other configurations, then applied to this one."""
    from ..comm import fused_exchange as fx

    out = []
    for i, c in enumerate(configs):
        others = configs[:i] + configs[i + 1:]
        fitted = max([float(o["slice_bytes"]) for o in others if o["faster"] in ("push-slot", "either")], default=0.0)
        choice, why = fx.choose_gather_transport(c["vocab"], c["batch"], tp, 2, crossover_bytes=fitted)
        out.append({**c, "held_out_crossover": fitted, "choice": choice, "reason": why,
                    "agrees": None if c["faster"] == "either" else choice == c["faster"]})
    return out


def gather_record(ctx, results: list[dict], world_size: int, vocabs, batches, topo: dict) -> RunRecord:
    """Full-logit vocab gather: push-slot vs ring over vocab sizes and batches (slowest rank), the
    measured crossover and the transport selector scored out of sample."""
    rows = []
    for row in results[0].get("gather", []):
        worst = max((r for res in results for r in res["gather"]
                     if (r["transport"], r["vocab"], r["batch"]) == (row["transport"], row["vocab"], row["batch"])),
                    key=lambda r: r["median_s"])
        rows.append({**row, "median_s": worst["median_s"], "p10_s": worst["p10_s"], "p90_s": worst["p90_s"],
                     "samples_s": worst.get("samples_s", [])})
    rec = ctx.new_record("vocab-gather", variant=topo["backend"], workload={
        "model": "full-logit vocab gather", "dtype": "bfloat16", "batch": list(batches),
        "shapes": {"vocabs": list(vocabs), "tp": world_size}}, topology=topo)
    rec.set_backend("collectives", topo["backend"], shapes={"ranks": world_size})
    for r in rows:
        rec.add("gather_time", r["median_s"], "s", transport=r["transport"], vocab=r["vocab"], batch=r["batch"],
                bytes_sent=r["bytes_sent"], p10_s=r["p10_s"], p90_s=r["p90_s"], samples_s=r["samples_s"])
    configs = gather_transport_configs(rows)
    scored = gather_held_out(configs, world_size)
    for c in scored:
        rec.add("transport_choice", 1.0 if c["choice"] == "ring" else 0.0, "1=ring", phase="derived",
                vocab=c["vocab"], batch=c["batch"], choice=c["choice"], faster=c["faster"], agrees=c["agrees"],
                held_out_crossover=c["held_out_crossover"], reason=c["reason"])
    decided = [c for c in scored if c["agrees"] is not None]
    rec.add("transport_held_out_decided", len(decided), "configurations", phase="derived", of=len(scored))
    if decided:
        rec.add("transport_held_out_agreement", sum(c["agrees"] for c in decided) / len(decided), "fraction",
                phase="derived")
    return rec


def push_time_record(ctx, results: list[dict], topo: dict) -> RunRecord | None:
    """The push path timed against gloo send/receive on CPU (`workers.time_push_against_gloo`): per
    iteration the slowest rank's time (a collective ends when its last rank does), both transports
    interleaved in one loop; the comparison is `measure.compare_timings` with its interval. None where
    the ranks did not time it (GPU ranks: the symmetric-memory path has not run)."""
    from ..measure import compare_timings

    if "push_time" not in results[0]:
        return None
    pt = results[0]["push_time"]
    worst = {name: [max(r["push_time"]["samples_s"][name][i] for r in results)
                    for i in range(len(pt["samples_s"][name]))] for name in workers.PUSH_TIMED}
    rec = ctx.new_record("push-time", variant=topo["backend"], workload={
        "model": "MoE tail, finalize before the exchange: gloo send/recv vs shared-memory push",
        "dtype": pt["dtype"], "batch": pt["tokens"],
        "shapes": {"tokens": pt["tokens"], "hidden": pt["hidden"], "topk_per_rank": pt["topk_per_rank"]},
        "timer": pt["timer"], "warmup": pt["warmup"], "interleaved": True}, topology=topo)
    rec.set_backend("finalize and fused pass", "torch reference",
                    reason="CPU: the Triton kernels would run in the interpreter, which is never timed")
    for name in workers.PUSH_TIMED:
        xs = sorted(worst[name])
        q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]
        rec.add("tail_time", statistics.median(xs), "s", transport=name, p10_s=q(0.1), p90_s=q(0.9),
                samples_s=worst[name], n=len(xs), note="slowest rank per iteration, CPU loopback processes")
    cmp = compare_timings(worst[workers.PUSH_TIMED[1]], worst[workers.PUSH_TIMED[0]])
    rec.add("push_over_gloo", cmp.ratio, "x", phase="derived", lo=cmp.lo, hi=cmp.hi,
            sentence=cmp.sentence("the shared-memory push", "gloo send/receive"),
            definition="median push time / median gloo time, bootstrap interval of the ratio")
    return rec


def _tail_record(ctx, *, world_size, tokens, hidden, topk_per_rank, dtype, reps, decode_tokens=()) -> RunRecord:
    cmp = tail_comparison(ctx, world_size=world_size, tokens=tokens, hidden=hidden, topk_per_rank=topk_per_rank,
                          dtype=dtype)
    dt = getattr(torch, dtype)
    backend, why = tail.select_backend(ctx.device)
    rec = ctx.new_record("tail", variant="fused vs unfused vs naive", workload={
        "model": "MoE layer tail (finalize, all-reduce, shared expert, residual, RMSNorm)",
        "quantization": f"none ({dtype})", "batch": tokens, "dtype": dtype,
        "shapes": {"partials": [world_size, tokens, hidden], "hidden": hidden, "topk_per_rank": topk_per_rank},
    }, topology={"ranks": 1, "simulated_ranks": world_size, "note": "ranks' partials stacked in one process"})
    rec.set_backend("tail", f"triton ({'interpreter' if ctx.interpreted else 'compiled'})" if backend == "triton"
                    else "torch reference", reason=why, shapes={"partials": [world_size, tokens, hidden]}, dtype=dtype)
    d = {(r["pair"], r["output"]): r for r in cmp["diffs"]}
    for what in ("out", "residual_out"):
        fu = d[("fused vs unfused", what)]
        rec.add_check(f"fused == unfused chain in bits ({what})", fu["bits_differ"] == 0 and not fu["nan"],
                      error=fu["bits_differ"], tolerance=0)
        nv = d[("naive vs unfused", what)]
        rec.add(f"naive_bits_differ_{what}", nv["bits_differ"], "elements", naive_fraction=nv["fraction"],
                max_ulp=nv["max_ulp"], max_abs=nv["max_abs"], elements=nv["elements"])
        ref = d[("reference vs unfused", what)]
        rec.add(f"reference_bits_differ_{what}", ref["bits_differ"], "elements", max_ulp=ref["max_ulp"])
        # the kernels may differ from PyTorch only by the RMSNorm's fp32 summation order: <= 1 ulp
        tol = 0 if what == "residual_out" else 1
        rec.add_check(f"Triton chain within {tol} ulp of the PyTorch reference ({what})",
                      0 <= ref["max_ulp"] <= tol and not ref["nan"], error=ref["max_ulp"], tolerance=tol)
    rec.add_check("the naive fp32 fusion differs from the reference rounding (the check can fail)",
                  d[("naive vs unfused", "out")]["bits_differ"] > 0, error=d[("naive vs unfused", "out")]["bits_differ"])
    nbytes = tail.tail_bytes(world_size, tokens, hidden, dt.itemsize)
    for variant, b in nbytes.items():
        rec.add(f"bytes_{variant}", b, "bytes", variant=variant)
    if ctx.device.type == "cuda" and backend == "triton":
        ceil = ceilings(ctx.device)
        kw = dict(uses_triton=True, min_reps=max(reps, 20), warmup=5)
        # decode-sized T (one step of a few sequences) beside the preset's prefill-sized T
        for T in sorted({int(t) for t in decode_tokens} | {tokens}):
            inp = cmp["inputs"] if T == tokens else tail.make_tail_inputs(
                world_size, T, hidden, topk_per_rank, dt, generator=torch.Generator().manual_seed(ctx.seed + 200 + T),
                device=ctx.device)
            parts = torch.stack([tail.finalize(inp["expert_out"][r], inp["topk_weights"][r]) for r in range(world_size)])
            parts32 = torch.stack([tail.finalize(inp["expert_out"][r], inp["topk_weights"][r], torch.float32)
                                   for r in range(world_size)])
            rest = (inp["shared"], inp["residual"], inp["norm_weight"])
            nb_T = tail.tail_bytes(world_size, T, hidden, dt.itemsize)
            for variant, fn in (("unfused", lambda: tail.unfused_tail(parts, *rest)),
                                ("fused", lambda: tail.fused_tail(parts, *rest)),
                                ("naive", lambda: tail.naive_fused_tail(parts32, *rest))):
                t = benchmark(fn, ctx.device, label=f"{variant} T={T}", **kw)
                rl = roofline(bytes_moved=nb_T[variant], flops=0.0, seconds=t.median_s, ceil=ceil)
                name = f"time_{variant}" if T == tokens else "time_decode"
                rec.add_timing(name, t, variant=variant, tokens=T, achieved_gbps=rl["achieved_gbps"],
                               frac_copy=rl["frac_copy"])
        rec.add("copy_ceiling", ceil.copy_gbps, "GB/s", phase="ceiling")
    else:
        rec.notes = "No tail timings: on CPU the Triton kernels run in the interpreter (correctness only)."
    return rec


def measure(ctx, *, world_size, tokens, hidden, topk_per_rank, dtype, check_numel, order_numel, allreduce_numels,
            vocab, vocabs, batches, reps, use_cuda, timeout_s, decode_tokens=(1, 8, 64)) -> list[RunRecord]:
    from ..errors import UserError

    if not 2 <= world_size <= workers.MAX_WORLD:
        raise UserError(f"world_size must be in 2..{workers.MAX_WORLD}, got {world_size}")
    vocabs, batches, numels = _ints(vocabs), _ints(batches), _ints(allreduce_numels)
    if vocab not in vocabs:
        vocabs = sorted(set(vocabs) | {vocab})
    for v in vocabs:
        vg.shard_bounds(v, world_size)
    records = [_tail_record(ctx, world_size=world_size, tokens=tokens, hidden=hidden, topk_per_rank=topk_per_rank,
                            dtype=dtype, reps=reps, decode_tokens=_ints(decode_tokens))]

    # --- distributed: checks and timings in one process group
    args = {"seed": ctx.seed, "numel": check_numel, "vocab": max(64, 4 * world_size), "batch": 4,
            "tokens": min(tokens, 8), "hidden": hidden, "topk_per_rank": topk_per_rank,
            "allreduce_numels": numels, "vocabs": vocabs, "batches": batches, "reps": reps,
            "use_cuda": bool(use_cuda)}
    ranks, planned_backend, run_label = workers.rank_plan(world_size, bool(use_cuda) and ctx.device.type == "cuda")
    args["use_cuda"] = planned_backend == "nccl"
    results = workers.launch("all", ranks, args, timeout_s=timeout_s)
    world_size = ranks
    r0 = results[0]
    rank_device = r0["device"]
    topo = {"ranks": world_size, "tp": world_size, "backend": r0["backend"], "rank_device": rank_device.split(":")[0],
            "launcher": "torch.multiprocessing spawn on 127.0.0.1", "run_label": run_label}
    if ctx.device.type == "cuda" and r0["backend"] != "nccl":
        topo["note"] = (f"{torch.cuda.device_count()} GPU(s) for {world_size} ranks: the ranks ran on CPU with gloo; "
                        "the tail kernels ran on the GPU in the single-process record")
    dist_rec = ctx.new_record("tail-distributed", variant="checks", workload={
        "model": "all-reduce variants, vocab greedy, MoE tail on ranks", "dtype": "bfloat16, float32",
        "shapes": {"allreduce_numel": check_numel, "tail": [args["tokens"], hidden]}}, topology=topo)
    dist_rec.set_backend("collectives", r0["backend"], reason="nccl needs one GPU per rank" if r0["backend"] == "gloo" else "",
                         shapes={"ranks": world_size})
    dist_rec.set_backend("tail (on ranks)", r0["tail/backend"], reason=r0["tail/backend_reason"],
                         shapes={"partials": [world_size, args["tokens"], hidden]})
    for row in workers.check_results(results, args):
        dist_rec.add_check(row["check"], row["passed"], detail=row["detail"])
    dist_rec.add("checks_passed", sum(c["passed"] for c in dist_rec.checks), "checks")
    # the real ranks, not the simulation: how many elements they disagree on with an owner-first one-shot
    for dt in ("torch.bfloat16", "torch.float32"):
        for acc in ar.ACCUMULATE:
            key = f"allreduce/{dt}/one-shot/push/owner-first/{acc}"
            n = workers.elements_where_ranks_disagree([r[key] for r in results])
            dist_rec.add("ranks_disagree_owner_first", n, "elements", dtype=dt.replace("torch.", ""), accumulate=acc,
                         numel=check_numel, ranks=world_size)
    records.append(dist_rec)

    # with 2 ranks a + b == b + a: order needs at least 3 contributions to show, so simulate >= 4
    order_ranks = order_ranks_for(world_size)
    order_rec = ctx.new_record("allreduce-order", variant="simulation", workload={
        "model": "all-reduce summation order", "shapes": {"numel": order_numel}, "dtype": "bfloat16, float32"},
        topology={"ranks": order_ranks, "simulated": True})
    for row in order_demonstration(order_ranks, order_numel, ctx.seed):
        order_rec.add("ranks_disagree", row["ranks_disagree"], "elements", **{k: row[k] for k in
                      ("dtype", "accumulate", "algorithm", "order", "numel")}, differs_from_fixed=row["differs_from_fixed"])
        if row["order"] == "fixed" or row["algorithm"] == "two-shot":
            order_rec.add_check(f"{row['dtype']} {row['algorithm']} {row['order']} {row['accumulate']}: ranks agree",
                                row["ranks_disagree"] == 0, error=row["ranks_disagree"], tolerance=0)
    records.append(order_rec)

    # --- timings: the slowest rank's median bounds a collective
    def slowest(key, match):
        rows = [r for res in results for r in res[key] if match(r)]
        return max(rows, key=lambda r: r["median_s"])

    time_rec = ctx.new_record("allreduce-time", variant=r0["backend"], workload={
        "model": "all-reduce of a bf16 buffer", "dtype": "bfloat16", "shapes": {"numels": numels}}, topology=topo)
    time_rec.set_backend("collectives", r0["backend"], shapes={"ranks": world_size})
    for row in r0["allreduce"]:
        worst = slowest("allreduce", lambda r: r["variant"] == row["variant"] and r["numel"] == row["numel"])
        alg = row["variant"].split(" ")[0]
        moved = ar.bytes_per_rank(alg, row["bytes"], world_size)["received"] if alg in ar.ALGORITHMS else None
        time_rec.add("allreduce_time", worst["median_s"], "s", variant=row["variant"], bytes=row["bytes"],
                     received_per_rank=moved, p10_s=worst["p10_s"], p90_s=worst["p90_s"], n=worst["n"],
                     timer=worst["timer"], samples_s=worst.get("samples_s", []))
    records.append(time_rec)

    greedy_rows = []
    for row in r0["greedy"]:
        worst = slowest("greedy", lambda r: (r["strategy"], r["vocab"], r["batch"]) == (row["strategy"], row["vocab"], row["batch"]))
        greedy_rows.append({**row, "median_s": worst["median_s"], "p10_s": worst["p10_s"], "p90_s": worst["p90_s"],
                            "samples_s": worst.get("samples_s", [])})
    crossover, configs = greedy_crossover(greedy_rows)
    g_rec = ctx.new_record("greedy", variant=r0["backend"], workload={
        "model": "vocab-parallel greedy sampling", "dtype": "bfloat16", "batch": batches,
        "shapes": {"vocabs": vocabs, "tp": world_size}}, topology=topo)
    g_rec.set_backend("collectives", r0["backend"], shapes={"ranks": world_size})
    for row in greedy_rows:
        g_rec.add("greedy_time", row["median_s"], "s", strategy=row["strategy"], vocab=row["vocab"], batch=row["batch"],
                  bytes_sent=row["bytes_sent"], p10_s=row["p10_s"], p90_s=row["p90_s"])
    g_rec.add("crossover_slice_bytes", crossover, "bytes", phase="derived")
    scored = selector_held_out(configs, world_size)
    for c in scored:
        g_rec.add("selector_choice", 1.0 if c["choice"] == "pairs" else 0.0, "1=pairs", phase="derived",
                  vocab=c["vocab"], batch=c["batch"], choice=c["choice"], faster=c["faster"], reason=c["reason"],
                  gather_over_pairs=c["gather_over_pairs"], held_out_crossover=c["held_out_crossover"],
                  agrees=c["agrees"])
    decided = [c for c in scored if c["agrees"] is not None]
    g_rec.add("selector_held_out_decided", len(decided), "configurations", phase="derived", of=len(scored))
    if decided:  # out of sample: each configuration judged by a crossover fitted without it
        g_rec.add("selector_held_out_agreement", sum(c["agrees"] for c in decided) / len(decided), "fraction",
                  phase="derived", decided=len(decided), configurations=len(scored))
    records.append(gather_record(ctx, results, world_size, vocabs, batches, topo))
    push_rec = push_time_record(ctx, results, topo)
    if push_rec is not None:
        records.append(push_rec)
    for b in batches:
        g_rec.add("bytes_per_rank_pairs", vg.exchanged_bytes("pairs", b, vocab, world_size, 2), "bytes",
                  phase="derived", vocab=vocab, batch=b)
        g_rec.add("bytes_per_rank_gather", vg.exchanged_bytes("gather", b, vocab, world_size, 2), "bytes",
                  phase="derived", vocab=vocab, batch=b)
    records.append(g_rec)
    return records


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): the tail's
    finalize, unfused, fused and naive-fused kernels at the preset's shape."""
    dtype = getattr(torch, params["dtype"])
    return tail.tail_launches(params["world_size"], params["tokens"], params["hidden"], params["topk_per_rank"], dtype)


def roofline_work(params: dict) -> list[dict]:
    """The tail variants as {name, bytes, flops}: bytes `tail.tail_bytes` (per rank, after the
    exchange); memory-bound, flops not counted."""
    dt = getattr(torch, params["dtype"])
    nbytes = tail.tail_bytes(params["world_size"], params["tokens"], params["hidden"], dt.itemsize)
    return [{"name": f"tail {v} N{params['world_size']} T{params['tokens']} H{params['hidden']}", "bytes": b,
             "flops": 0.0, "record": "tail", "metric": f"time_{v}"} for v, b in nbytes.items()]
