"""Chapter `gdn-backward-check`: a NaN/accuracy harness for Gated DeltaNet backward.

Records:
- `harness:<backend>` for our `recurrent` and `chunked` implementations, and for `chunked` with a
  NaN injected into dq at head_dim 32 (the harness must flag it: proof that it can fail). Each
  case of the sweep is one check; measurements count passing cases and the worst errors.
- `speed:recurrent` and `speed:chunked`: forward + backward time of the PyTorch paths (on a CPU,
  labelled CPU). Same workload and backend, so `compare()` accepts the pair.
"""
from __future__ import annotations

import math

import torch

from ..device import triton_backend_for
from ..errors import UserError
from ..measure import benchmark, ceilings
from ..presets import Param
from ..record import RunRecord
from ..numerics import gdn, gdn_chunk, gdn_chunk_bwd, small_op_threads

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('harness:recurrent', 'cases passed', 'Harness cases the recurrent reference passes')

PARAMETERS = {
    "head_dims": Param(str, help="comma-separated head dims swept by the harness"),
    "lengths": Param(str, help="comma-separated sequence lengths (odd on purpose)"),
    "gates": Param(str, "random,zero,very_negative", help="gate regimes: random, zero, very_negative"),
    "dtypes": Param(str, "bfloat16,float32", help="input dtypes swept"),
    "batch": Param(int, 1, help="batch in the harness"),
    "heads": Param(int, 2, help="heads in the harness"),
    "chunk_size": Param(int, help="chunk size of the chunked backend"),
    "bench_batch": Param(int, help="batch of the timed problem"),
    "bench_len": Param(int, help="sequence length of the timed problem"),
    "bench_heads": Param(int, help="heads of the timed problem"),
    "bench_head_dim": Param(int, help="head dim (K = V) of the timed problem"),
    "coverage": Param(str, "kv,varlen,l2norm,long", help="extra harness cases: kv (K != V), varlen (packed THD), "
                      "l2norm (in-kernel q/k L2 normalisation), long (one long sequence); 'none' for none"),
    "long_len": Param(int, help="length of the 'long' coverage case"),
}

COVERAGE = ("kv", "varlen", "l2norm", "long")

PRESETS = {
    "smoke": dict(head_dims="32,64", lengths="9", chunk_size=8, bench_batch=1, bench_len=32, bench_heads=2,
                  bench_head_dim=32, long_len=65),
    # cpu: the seed's head dim 32 and 64 (the gpu preset sweeps 32-256); ~25 s on an idle 2-core machine
    "cpu": dict(head_dims="32,64", lengths="17,45", chunk_size=16, bench_batch=1, bench_len=64,
                bench_heads=4, bench_head_dim=64, long_len=130),
    "gpu": dict(head_dims="32,64,128,256", lengths="17,45,129", chunk_size=64, bench_batch=4, bench_len=1024,
                bench_heads=8, bench_head_dim=128, long_len=4096),
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_ints(name: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{name} must be comma-separated positive ints, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"{name} must be comma-separated positive ints, got {text!r}")
    return vals


def parse_choices(name: str, text: str, allowed) -> tuple[str, ...]:
    vals = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise UserError(f"{name} {text!r}: {bad or 'empty'} not allowed; choose from {list(allowed)}")
    return vals


def check_params(P: dict) -> None:
    """Every list parameter parses, before any work (`setup` calls this)."""
    parse_ints("head_dims", P["head_dims"])
    parse_ints("lengths", P["lengths"])
    parse_choices("gates", P["gates"], gdn.GATES)
    parse_choices("dtypes", P["dtypes"], DTYPES)
    if P["coverage"].strip() != "none":
        parse_choices("coverage", P["coverage"], COVERAGE)


def coverage_cases(coverage: str, head_dims: tuple, chunk_size: int, long_len: int) -> list[dict]:
    """The extra harness cases the `coverage` parameter names (see `gdn.harness_cases`)."""
    if coverage.strip() == "none":
        return []
    chosen = parse_choices("coverage", coverage, COVERAGE)
    K = 64 if 64 in head_dims else head_dims[0]
    out = []
    if "kv" in chosen:   # K != V both ways (V = 2K, V = K/2)
        out += [dict(K=K, V=2 * K, lengths=[45]), dict(K=K, V=max(8, K // 2), lengths=[45])]
    if "varlen" in chosen:   # packed sequences incl. one token and a partial chunk
        out += [dict(K=K, lengths=[1, 17, chunk_size + 3, 45], varlen=True),
                dict(K=K, lengths=[chunk_size, 9], varlen=True, gate="very_negative")]
    if "l2norm" in chosen:
        out += [dict(K=K, lengths=[45], l2norm=True), dict(K=K, lengths=[3, 30], varlen=True, l2norm=True)]
    if "long" in chosen:
        out += [dict(K=K, lengths=[int(long_len)], tag="long")]
    return out


TRITON_FWD = "triton fused recurrent (forward only)"
TRITON_CHUNK = "triton chunked on tl.dot (forward only)"
TRITON_CHUNK_BWD = "ours: chunked tl.dot, forward + backward"
TRITON_BACKENDS = (TRITON_FWD, TRITON_CHUNK, TRITON_CHUNK_BWD)
FLA_EMULATED = "fla precision, emulated in PyTorch"
BF16_STATE = "recurrent, state kept in BF16 (must fail)"
NOISY = "fla precision + 0.4 % noise on o (must fail)"
DG_ERROR = "fla precision + 5 % error on dg (must fail)"


def backends(chunk_size: int, device=None) -> dict:
    def chunked(q, k, v, g, beta, scale=None, initial_state=None, **kw):
        return gdn.chunked(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, **kw)

    def exp_before_mask(q, k, v, g, beta, scale=None, initial_state=None, **kw):
        return gdn.chunked(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                           _exp_before_mask=True, **kw)

    out = {"recurrent": gdn.recurrent, f"chunked (C={chunk_size})": chunked,
           "chunked + NaN in dq at K=32 (injected)": gdn.inject_backward_nan(chunked, 32),
           "chunked, exp before mask (bug)": exp_before_mask,
           FLA_EMULATED: gdn.fla_precision,
           BF16_STATE: gdn.bf16_state_recurrent,
           NOISY: gdn.noisy_output(gdn.fla_precision, 0.004),
           DG_ERROR: gdn.scaled_gradient(gdn.fla_precision, "g", 0.05)}
    if device is not None and triton_backend_for(device)[0]:
        out[TRITON_FWD] = gdn.recurrent_triton
        out[TRITON_CHUNK] = gdn_chunk.chunked_triton
        out[TRITON_CHUNK_BWD] = gdn_chunk_bwd.chunked_triton_autograd
        if torch.device(device).type == "cuda":   # bf16/fp16 on a GPU: its fp32 cases are "not run"
            for name, fn in ((TRITON_CHUNK, gdn_chunk.chunked_triton),
                             (TRITON_CHUNK_BWD, gdn_chunk_bwd.chunked_triton_autograd)):
                def chunk_gpu(*a, _fn=fn, **kw):
                    return _fn(*a, **kw)
                chunk_gpu.dtypes, chunk_gpu.supports = {torch.bfloat16, torch.float16}, fn.supports
                out[name] = chunk_gpu
    if device is not None:
        out.update(gdn.fla_backends(device)[0])   # flash-linear-attention's kernels, where they run
    return out


def is_fla_kernel(name: str) -> bool:
    """fla-core's own kernels (run only on a GPU), as opposed to our emulation of their precision."""
    return name in (gdn.FLA_CHUNK, gdn.FLA_RECURRENT)


def is_demo(name: str) -> bool:
    """Backends that are *meant* to fail: the harness must flag them."""
    return "injected" in name or "(bug)" in name or "must fail" in name


def harness_records(ctx, reports: dict, sweep: dict) -> list[RunRecord]:
    out = []
    for name, rep in reports.items():
        injected = is_demo(name)
        rec = ctx.new_record(f"harness:{name}", variant=name, workload={
            "model": "Gated DeltaNet (one layer's recurrence)", "shapes": sweep, "dtype": ",".join(sweep["dtypes"])})
        if name in (TRITON_FWD, TRITON_CHUNK):
            rec.set_backend("gdn", "triton", reason=triton_backend_for(ctx.device)[1] + "; forward only: o and S "
                            "checked, no gradients", shapes={"q": ["B", "T", "H", "K"], "state": ["B", "H", "K", "V"]})
        elif name == TRITON_CHUNK_BWD:
            rec.set_backend("gdn", "triton", reason=triton_backend_for(ctx.device)[1] + "; chunked forward and "
                            "backward on tl.dot (fla's kernels, numerics/gdn_chunk_bwd.py): o, S and every gradient "
                            "checked", shapes={"q": ["B", "T", "H", "K"], "state": ["N", "H", "K", "V"]})
        elif is_fla_kernel(name):
            rec.set_backend("gdn", "flash-linear-attention (fla-core) Triton kernels", reason=name,
                            shapes={"q": ["B", "T", "H", "K"], "state": ["N", "H", "K", "V"]})
        else:
            rec.set_backend("gdn", "torch autograd", reason=f"{name}: PyTorch implementation, backward by autograd",
                            shapes={"q": ["B", "T", "H", "K"], "state": ["B", "H", "K", "V"]})
        for r in ([] if injected else rep.rows):  # the injected backend's cases are meant to fail
            rec.add_check(f"{r['case']} {r['dtype']}", r["passed"],
                          error=r.get("err_dq"), tolerance=r.get("tol_dq"), reason=r["reason"],
                          nonfinite=r.get("nonfinite", ""))
        n_pass = sum(r["passed"] for r in rep.rows)
        rec.add("cases passed", n_pass, "cases", cases=len(rep.rows),
                rows=[{k: r.get(k) for k in ("head_dim", "value_dim", "T", "gate", "dtype", "case", "passed",
                                             "nonfinite", "reason")} for r in rep.rows])
        rec.add("cases not run", len(rep.skipped), "cases",
                rows=[{k: r.get(k) for k in ("case", "dtype", "reason")} for r in rep.skipped])
        for dt in sweep["dtypes"]:
            rows = [r for r in rep.rows if r["dtype"] == dt and r["passed"]]
            for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
                errs = [r[f"err_{key}"] for r in rows if r.get(f"err_{key}") is not None
                        and math.isfinite(r[f"err_{key}"])]
                if errs:
                    rec.add(f"max rel-RMS err {key} ({dt})", max(errs), "relative", phase="check")
        if injected:
            flagged = {r["head_dim"] for r in rep.rows if not r["passed"]}
            gates_flagged = {r["gate"] for r in rep.rows if not r["passed"]}
            rec.notes = "a demonstration backend, meant to fail: the harness's own test"
            rec.add("head dims flagged", len(flagged), "head dims", flagged=sorted(flagged))
            rec.add("gate regimes flagged", len(gates_flagged), "gate regimes", flagged=sorted(gates_flagged))
        out.append(rec)
    return out


def speed_record(ctx, name: str, fn, *, B, T, H, K) -> RunRecord:
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    g = ctx.generator(5)
    q = torch.randn(B, T, H, K, generator=g, device=ctx.device)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, device=ctx.device), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, device=ctx.device)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g, device=ctx.device) + 2)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, device=ctx.device))
    leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v, gate, beta)]

    def step():
        o, S = fn(*leaves)
        torch.autograd.grad(o.float().sum() + S.sum(), leaves)

    is_gpu = ctx.device.type == "cuda"
    # enough samples a side for compare_timings to separate a real 10 % difference
    t = benchmark(step, ctx.device, label=name, warmup=1 if not is_gpu else 2, min_reps=10 if not is_gpu else 20,
                  max_reps=30, min_time_s=0.1 if not is_gpu else 0.5)
    algo = name.split(" ")[0]
    rec = ctx.new_record(f"speed:{algo}", variant=algo, workload={
        "model": "Gated DeltaNet (one layer's recurrence)", "batch": B, "input_len": T,
        "shapes": {"B": B, "T": T, "H": H, "K": K, "V": K}, "dtype": str(dtype).replace("torch.", "")})
    rec.set_backend("gdn", "torch autograd" + (" (CPU)" if not is_gpu else ""),
                    reason="PyTorch implementation; no Triton GDN kernel in this chapter",
                    shapes={"q": [B, T, H, K], "state": [B, H, K, K]}, dtype=str(dtype).replace("torch.", ""))
    rec.add_timing("forward+backward", t)
    rec.add("tokens/s (fwd+bwd)", B * T / t.median_s, "tok/s")
    return rec


def measure(ctx, *, head_dims, lengths, gates, dtypes, batch, heads, chunk_size, bench_batch, bench_len,
            bench_heads, bench_head_dim, coverage="kv,varlen,l2norm,long", long_len=65) -> list[RunRecord]:
    hd = parse_ints("head_dims", head_dims)
    ls = parse_ints("lengths", lengths)
    gs = parse_choices("gates", gates, gdn.GATES)
    dts = parse_choices("dtypes", dtypes, DTYPES)
    extra = coverage_cases(coverage, hd, chunk_size, long_len)
    fns = backends(chunk_size, ctx.device)
    fla_why = gdn.fla_backends(ctx.device)[1]
    sweep = {"head_dims": list(hd), "lengths": list(ls), "gates": list(gs), "dtypes": list(dts), "batch": batch,
             "heads": heads, "chunk_size": chunk_size, "coverage": [gdn.case_label({"varlen": False, "l2norm": False,
                                                                                     "gate": "random", **c,
                                                                                     "V": c.get("V", c["K"])})
                                                                    for c in extra], "fla": fla_why}
    kw = dict(gates=gs, dtypes=tuple(DTYPES[d] for d in dts), batch=batch, heads=heads, device=ctx.device,
              seed=ctx.seed, forward_only=(TRITON_FWD, TRITON_CHUNK, gdn.FLA_RECURRENT))
    # Under the interpreter a Triton kernel costs seconds per case: there the Triton backends run the
    # smallest head dim and the first length (every gate and dtype) and the coverage cases but the long
    # one; on a GPU they run the whole sweep.
    slow = {n: f for n, f in fns.items() if ctx.interpreted and n in TRITON_BACKENDS}
    with small_op_threads(ctx.device):
        reports = gdn.check_backends({n: f for n, f in fns.items() if n not in slow}, head_dims=hd, lengths=ls,
                                     extra_cases=extra, **kw)
        if slow:
            reports.update(gdn.check_backends(slow, head_dims=hd[:1], lengths=ls[:1], **kw,
                                              extra_cases=[c for c in extra if c.get("tag") != "long"]))
    reports = {n: reports[n] for n in fns}
    records = harness_records(ctx, reports, sweep)
    # The harness's own check: ours pass, the injected backend fails exactly at K = 32.
    for rec, (name, rep) in zip(records, reports.items()):
        if "injected" in name:
            if 32 in hd:
                bad = {r["head_dim"] for r in rep.failures()}
                rec.add_check("harness flags the injected NaN at K=32, and only there", bad == {32},
                              error=float(len(bad)))
        elif "(bug)" in name:
            # exp(+large) overflows only where the gates are extreme: the bug fails the very negative
            # gate cases and passes the mild and zero ones (the chapter's prose relies on both halves).
            bad = {r["gate"] for r in rep.failures()}
            expected = {"very_negative"} & set(gs)
            rec.add_check("exp-before-mask fails exactly the very negative gate cases", bad == expected,
                          error=float(len(rep.failures())))
        elif "must fail" in name:
            # wrong but finite: only a tolerance anchored to the working precision's own error catches these
            low = [r for r in rep.rows if r["dtype"] == "bfloat16"] or rep.rows
            where = ""
            if name == DG_ERROR:   # g = -1e3 leaves no gradient to g (exp underflows): 5 % of 0 is 0
                low, where = [r for r in low if r["gate"] != "very_negative"] or low, " with a gradient to g"
            missed = [r for r in low if r["passed"]]
            rec.add_check(f"harness rejects every {low[0]['dtype']} case{where}", not missed, error=float(len(missed)))
        elif is_fla_kernel(name):
            # a peer's kernel: what the harness finds is a finding for the page, never a stop
            rec.add("cases failed", len(rep.failures()), "cases", phase="finding",
                    rows=[{k: r.get(k) for k in ("case", "dtype", "reason")} for r in rep.failures()])
        else:
            rec.add_check("all harness cases pass", rep.passed, error=float(len(rep.failures())))
    for name, fn in list(fns.items())[:2]:
        records.append(speed_record(ctx, name, fn, B=bench_batch, T=bench_len, H=bench_heads, K=bench_head_dim))
    records.append(forward_speed_record(ctx, fns, chunk_size, B=bench_batch, T=bench_len, H=bench_heads,
                                        K=bench_head_dim))
    return records


def forward_speed_record(ctx, fns: dict, chunk_size: int, *, B, T, H, K) -> RunRecord:
    """Forward only (inference), no autograd: the PyTorch paths, and on a GPU the Triton kernel, with
    achieved bandwidth: each step reads q, k, v (and g, beta) once and writes o once; S stays on chip."""
    is_gpu = ctx.device.type == "cuda"
    dtype = torch.bfloat16 if is_gpu else torch.float32
    g = ctx.generator(6)
    q = torch.randn(B, T, H, K, generator=g, device=ctx.device).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, device=ctx.device), dim=-1).to(dtype)
    v = torch.randn(B, T, H, K, generator=g, device=ctx.device).to(dtype)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g, device=ctx.device) + 2).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, device=ctx.device)).to(dtype)
    rec = ctx.new_record("speed-forward", variant="forward only", workload={
        "model": "Gated DeltaNet (one layer's recurrence)", "batch": B, "input_len": T,
        "shapes": {"B": B, "T": T, "H": H, "K": K, "V": K}, "dtype": str(dtype).replace("torch.", "")})
    paths = {"recurrent (torch)": gdn.recurrent,
             f"chunked C={chunk_size} (torch)": lambda *a: gdn.chunked(*a, chunk_size=chunk_size)}
    if is_gpu and TRITON_FWD in fns:
        paths["fused recurrent (triton)"] = gdn.recurrent_triton
        paths["chunked on tl.dot (triton)"] = gdn_chunk.chunked_triton
    rec.set_backend("gdn_forward", ", ".join(paths), reason="triton timed only on a GPU; on CPU it runs in the "
                    "interpreter (correctness only)" if not is_gpu else "all paths on this GPU",
                    shapes={"q": [B, T, H, K]}, dtype=str(dtype).replace("torch.", ""))
    nbytes = B * T * H * (3 * K + 2) * q.element_size() + B * T * H * K * q.element_size()
    ceil = ceilings(ctx.device) if is_gpu else None
    with torch.no_grad():
        for name, fn in paths.items():
            t = benchmark(lambda: fn(q, k, v, gate, beta), ctx.device, label=name, uses_triton="triton" in name,
                          warmup=1 if not is_gpu else 3, min_reps=3 if not is_gpu else 10, max_reps=50,
                          min_time_s=0.1 if not is_gpu else 0.5)
            rec.add_timing(f"forward {name}", t, bytes=nbytes)
            gbps = nbytes / t.median_s / 1e9
            rec.add(f"effective GB/s {name}", gbps, "GB/s",
                    frac_of_copy=(gbps / ceil.copy_gbps) if ceil else None,
                    note="minimal traffic (q, k, v, g, beta read once, o written once) / time; only a kernel that "
                         "keeps the state on chip comes near moving just that")
        beside_fla(ctx, rec, paths, (q, k, v, gate, beta), nbytes)
    return rec


def beside_fla(ctx, rec, paths: dict, args: tuple, nbytes: int) -> None:
    """On a GPU with fla-core: our chunked forward and fla's `chunk_gated_delta_rule` (the peer the compiler
    section predicts beside ours, `inferbook.compiled.peers`) timed in the same run, warmed and interleaved
    (`peers.time_beside`), with ours / fla from `compare_timings`. Elsewhere a note says why not."""
    from ..compiled import peers
    from ..measure import compare_timings

    fla, why = gdn.fla_backends(ctx.device)
    ours = paths.get("chunked on tl.dot (triton)")
    if ours is None or gdn.FLA_CHUNK not in fla:
        rec.notes = (rec.notes + " " if rec.notes else "") + f"fla-core beside ours: not timed ({why})"
        return
    sides = {"ours chunked (triton)": lambda: ours(*args), "fla-core chunk_gated_delta_rule": lambda: fla[gdn.FLA_CHUNK](*args)}
    rec.set_backend("peer", "fla-core chunk_gated_delta_rule (Triton), timed beside ours", reason="interleaved, same run")
    times = peers.time_beside(sides, ctx.device, rounds=4, min_reps=5, max_reps=25, min_time_s=0.1)
    for label, t in times.items():
        rec.add_timing(f"beside fla-core: {label}", t, bytes=nbytes, interleaved=True)
    c = compare_timings(times["ours chunked (triton)"], times["fla-core chunk_gated_delta_rule"])
    rec.add("ours / fla-core forward time (same run, interleaved)", c.ratio, "x", lo=c.lo, hi=c.hi,
            confidence=c.confidence)


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): the fused recurrent
    forward at every head dim in bf16 and fp32, the chunked forward (three kernels) and backward (four,
    `gdn_chunk_bwd`) in bf16, at the checked and the timed lengths, plus the chunked kernels for the coverage
    cases (K != V, in-kernel L2 norm: the backward normalizes in PyTorch, so it has no L2-norm launch)."""
    from .. import compiled

    launches = []
    B, H = params["bench_batch"], params["bench_heads"]
    for K in [int(x) for x in str(params["head_dims"]).split(",")]:
        for dtype in (torch.bfloat16, torch.float32):
            for T in [int(x) for x in str(params["lengths"]).split(",")] + [params["bench_len"]]:
                launches += gdn.recurrent_launches(B, T, H, K, K, dtype)
                if dtype != torch.float32:   # bf16/fp16 only on a GPU
                    launches += gdn_chunk.chunked_launches(B, T, H, K, K, dtype)
                    launches += gdn_chunk_bwd.chunked_bwd_launches(B, T, H, K, K, dtype)
    K = 64
    for V in (2 * K, K // 2):
        launches += gdn_chunk.chunked_launches(1, params["long_len"], H, K, V, torch.bfloat16)
        launches += gdn_chunk_bwd.chunked_bwd_launches(1, params["long_len"], H, K, V, torch.bfloat16)
    launches += gdn_chunk.chunked_launches(1, params["long_len"], H, K, K, torch.bfloat16, l2norm=True)
    return compiled.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """The timed forward as {name, bytes, flops}: bytes as `speed_forward` counts them (bf16), flops
    `gdn.gdn_flops`."""
    B, T, H, K = params["bench_batch"], params["bench_len"], params["bench_heads"], params["bench_head_dim"]
    nbytes = B * T * H * (3 * K + 2) * 2 + B * T * H * K * 2
    return [{"name": f"GDN recurrent forward B{B} T{T} H{H} K=V={K} bf16", "bytes": nbytes,
             "flops": gdn.gdn_flops(B, T, H, K, K), "record": "speed-forward", "metric": "forward fused recurrent (triton)"}]
