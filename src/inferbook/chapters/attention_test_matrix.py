"""Chapter `attention-test-matrix`: the acceptance matrix a FlashAttention pre-release must pass.

Seed section 八: FlashAttention 4 beta31 touched the SM100 attention sink, head_dim=256 with
paged KV, varlen scheduling, SM90 backward, zero gradients for empty Q/K and the padded
head-dim predication in PackGQA; the seed's advice is to keep your own GPU, head dims,
causal/non-causal, varlen, paged KV and backward combinations as the acceptance test.

`measure` returns:
- `matrix`: one check per (case, checked tensor) of our Triton FlashAttention against a float32
  reference, with FlashAttention's tolerance rule (see `matrix.py`); on CPU it runs in the
  Triton interpreter (correctness only — no time is recorded for it);
- `throughput-*`: forward and backward TFLOP/s at head dim 128. On CUDA: our kernel and
  `scaled_dot_product_attention` in the same run, against the bf16 matmul rate measured here.
  On CPU: PyTorch paths only (SDPA in float32), labelled CPU; the Triton kernel is not timed.
"""
from __future__ import annotations

import torch

from .. import measure as _measure
from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..attention import flash, matrix

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('matrix', 'failed_checks', 'Checks of the acceptance matrix that failed in this run')

PARAMETERS = {
    "mode": Param(str, help="pairwise (every pair of axis values) or product (every combination)",
                  choices=("pairwise", "product")),
    "head_dims": Param(str, help="comma list of head dims, from 64,96,128,192,256"),
    "kv": Param(str, help="comma list of KV layouts: contiguous, paged-1, paged-16, paged-128"),
    "shapes": Param(str, help="comma list of shapes: base, 113x203, 1023x1024, q>k, empty-q, empty-k"),
    "batch": Param(int, help="sequences per case"),
    "n_heads": Param(int, help="query heads (GQA uses half as many KV heads, MQA one)"),
    "base_q": Param(int, help="query length of the 'base' shape"),
    "base_k": Param(int, help="key length of the 'base' shape"),
    "tp_seqlen": Param(int, help="sequence length of the throughput runs (head dim 128)"),
    "tp_batch": Param(int, help="batch of the throughput runs"),
    "tp_heads": Param(int, help="heads of the throughput runs"),
}

PRESETS = {
    # smoke: the Triton interpreter costs ~1 s of CPU per case; head dim 256, paged-1/128 and the
    # 113x203 shape are covered by the unit tests and by the cpu preset instead
    "smoke": dict(mode="pairwise", head_dims="64,96", kv="contiguous,paged-16",
                  shapes="base,q>k,empty-q,empty-k", batch=2, n_heads=4, base_q=40, base_k=56,
                  tp_seqlen=256, tp_batch=1, tp_heads=2),
    # cpu: the interpreter's time goes with the key tiles a case walks; 113x203 (four tiles) held about half
    # of the covering array's, so it runs here in the named window-band case alone (and in the gpu preset's
    # matrix); the throughput runs time SDPA only (a yardstick), at sequence 512
    "cpu": dict(mode="pairwise", head_dims="64,96,128,192,256", kv="contiguous,paged-1,paged-16,paged-128",
                shapes="base,q>k,empty-q,empty-k", batch=2, n_heads=4, base_q=64, base_k=96,
                tp_seqlen=512, tp_batch=1, tp_heads=8),
    "gpu": dict(mode="pairwise", head_dims="64,96,128,192,256", kv="contiguous,paged-1,paged-16,paged-128",
                shapes="base,113x203,1023x1024,q>k,empty-q,empty-k", batch=2, n_heads=8, base_q=512,
                base_k=512, tp_seqlen=8192, tp_batch=2, tp_heads=16),
}


def _split(name: str, text: str, cast=str) -> tuple:
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"parameter {name!r} must be a comma list, got {text!r}") from None


def check_params(P: dict) -> None:
    """The matrix axes exist (head dims, KV layouts, shapes), before any work (`setup` calls this)."""
    try:
        axes_from(P)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from None


def axes_from(params: dict) -> dict:
    """The matrix axes a run's parameters select (UserError names a bad value)."""
    try:
        return matrix.check_axes({"head_dim": _split("head_dims", params["head_dims"], int),
                                  "kv": _split("kv", params["kv"]),
                                  "shape": _split("shapes", params["shapes"])})
    except UserError:
        raise
    except ValueError as e:
        raise UserError(str(e)) from None


def run(ctx, *, mode, head_dims, kv, shapes, batch, n_heads, base_q, base_k, progress=None) -> list[dict]:
    """The matrix rows for this run's parameters (what `measure` records)."""
    axes = axes_from(dict(head_dims=head_dims, kv=kv, shapes=shapes))
    rows = matrix.run_matrix(axes, preset=ctx.preset, device=ctx.device, seed=ctx.seed, mode=mode,
                             batch=batch, n_heads=n_heads, base=(base_q, base_k), progress=progress)
    # named cases with their own references: head dim 256 with paged KV, >= 8 backward cases,
    # the deterministic-backward repeat, split-KV decoding with its combine
    full = matrix.check_axes({**matrix.MATRIX_PRESETS[ctx.preset]["axes"], **axes}) \
        if ctx.preset in matrix.MATRIX_PRESETS else axes
    return rows + matrix.run_special(full, batch=batch, n_heads=n_heads, base=(base_q, base_k), device=ctx.device,
                                     seed=ctx.seed)


def matrix_record(ctx, rows: list[dict], params: dict) -> RunRecord:
    backend, reason = flash.select_backend(ctx.device)
    cases = sorted({r["label"] for r in rows})
    rec = ctx.new_record("matrix", variant="triton flash-attention vs torch references", workload={
        "model": "attention acceptance matrix", "quantization": "none",
        "dtype": "bfloat16 and float16", "batch": params["batch"],
        "shapes": {"base": [params["base_q"], params["base_k"]], "others": dict(matrix.FIXED_SHAPES)},
        "mode": params["mode"], "axes": {k: list(v) for k, v in axes_from(params).items()},
    }, topology={"ranks": 1})
    rec.set_backend("attention", f"triton flash ({'compiled' if ctx.device.type == 'cuda' else 'interpreter'})"
                    if backend == "triton" else "torch reference", reason=reason,
                    shapes={"n_heads": params["n_heads"], "batch": params["batch"]})
    for r in rows:
        rec.add_check(f"{r['label']} :: {r['check']}", r["passed"], error=r["error"], tolerance=r["tolerance"],
                      ref_error=r["ref_error"], check=r["check"], case=r["label"],
                      axes={k: r[k] for k in matrix.AXES}, seqlens=[r["seqlen_q"], r["seqlen_k"]],
                      special=r.get("special", ""))
    rec.add("cases", len(cases), "cases", phase="steady")
    rec.add("named_cases", len({r["label"] for r in rows if r.get("special")}), "cases", phase="steady",
            names=sorted({r["special"] for r in rows if r.get("special")}))
    rec.add("backward_cases", len({r["label"] for r in rows if r["direction"] == "bwd"}), "cases", phase="steady")
    rec.add("checks", len(rows), "checks", phase="steady")
    rec.add("failed_checks", sum(not r["passed"] for r in rows), "checks", phase="steady")
    return rec


def rows_from_record(rec: RunRecord) -> list[dict]:
    """Rebuild the matrix table (label, check, error, tolerance, passed) from a record's checks."""
    return [{"case": c["case"], "check": c["check"], "error": c["error"], "ref_error": c.get("ref_error"),
             "tolerance": c["tolerance"], "passed": c["passed"], "special": c.get("special", ""),
             **c.get("axes", {})} for c in rec.checks]


def coverage_rows(rows: list[dict], axes: dict) -> list[dict]:
    """One row per axis value: how many cases carried it, how many of those failed a check."""
    cov = matrix.coverage([{**r, "label": r["case"]} for r in rows], axes)
    return [{"axis": name, "value": str(v), "cases": n, "failed cases": f}
            for name, values in cov.items() for v, (n, f) in values.items()]


def _sdpa_fn(q, k, v, causal):
    """SDPA on [B, H, S, D] views of our [B, S, H, D] tensors; FlashAttention backend forced on
    CUDA so the record says which kernel ran (falls back to PyTorch's choice if it refuses)."""
    F = torch.nn.functional
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.device.type != "cuda":
        return (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)), "torch sdpa (CPU default)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forced():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    try:
        forced()
        return forced, "torch sdpa: FLASH_ATTENTION (forced)"
    except RuntimeError as e:
        return (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)), \
            f"torch sdpa (default choice; FLASH_ATTENTION refused: {str(e)[:80]})"


def throughput(ctx, *, seqlen: int, batch: int, heads: int, head_dim: int = 128) -> list[RunRecord]:
    """Forward and backward TFLOP/s, causal and not. CUDA: ours and SDPA, bf16, vs the measured
    bf16 matmul rate. CPU: SDPA only in float32 (the Triton interpreter is never timed)."""
    dev = ctx.device
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ceil = _measure.ceilings(dev)
    g = ctx.generator(17)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, do = (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype) for _ in range(4))
    impls = []
    if on_gpu:
        impls.append(("triton", lambda qq, kk, vv, c: (lambda: flash.attention(qq, kk, vv, causal=c)),
                      f"triton flash (ours), {flash.select_backend(dev)[1]}"))
    impls.append(("sdpa", None, None))
    records = []
    for causal in (False, True):
        for name, make, label in impls:
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            if name == "sdpa":
                fn, label = _sdpa_fn(qq, kk, vv, causal)
                fwd = lambda fn=fn: fn().transpose(1, 2)  # noqa: E731
            else:
                fwd = make(qq, kk, vv, causal)
            t_f = _measure.benchmark(fwd, dev, label=f"{name} fwd", uses_triton=name == "triton",
                                     warmup=3, min_reps=5, min_time_s=0.5 if on_gpu else 0.3, max_reps=50)
            out = fwd()
            t_b = _measure.benchmark(lambda out=out: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True),
                                     dev, label=f"{name} bwd", uses_triton=name == "triton", warmup=2, min_reps=5,
                                     min_time_s=0.5 if on_gpu else 0.3, max_reps=50)
            kind = "causal" if causal else "full"
            rec = ctx.new_record(f"throughput-{name}-{kind}", variant=name, workload={
                "model": f"attention d{head_dim}", "quantization": "none", "input_len": seqlen, "batch": batch,
                "dtype": str(dtype).replace("torch.", ""), "causal": causal,
                "shapes": {"q": list(shape), "k": list(shape)}}, topology={"ranks": 1})
            rec.set_backend("attention", label, reason="timed side by side in this run", shapes={"q": list(shape)},
                            dtype=str(dtype).replace("torch.", ""))
            for direction, t in (("fwd", t_f), ("bwd", t_b)):
                flops = flash.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, direction=direction)
                rec.add_timing(f"{direction}_time", t, phase=direction)
                tf = flops / t.median_s / 1e12
                rec.add(f"{direction}_tflops", tf, "TFLOP/s", phase=direction, flops=flops,
                        matmul_ceiling_tflops=ceil.matmul_tflops, matmul_dtype=ceil.matmul_dtype)
                rec.add(f"{direction}_frac_matmul", tf / ceil.matmul_tflops, "fraction", phase=direction)
            records.append(rec)
            del out
    if on_gpu:  # the two forwards should agree; the size is the evidence, not a pass/fail
        with torch.no_grad():
            ours = flash.attention(q, k, v, causal=True)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        for r in records:
            if r.name == "throughput-triton-causal":
                r.add("max_abs_diff_vs_sdpa", float((ours.float() - ref.float()).abs().max()), "abs", phase="fwd")
    ceil_rec = ctx.new_record("ceilings", variant="measured", workload={"model": "device ceilings"},
                              topology={"ranks": 1})
    ceil_rec.add("matmul_tflops", ceil.matmul_tflops, "TFLOP/s", phase="steady", dtype=ceil.matmul_dtype,
                 shape=list(ceil.matmul_shape))
    ceil_rec.add("copy_gbps", ceil.copy_gbps, "GB/s", phase="steady")
    records.append(ceil_rec)
    return records


def measure(ctx, *, mode, head_dims, kv, shapes, batch, n_heads, base_q, base_k, tp_seqlen, tp_batch,
            tp_heads) -> list[RunRecord]:
    params = dict(mode=mode, head_dims=head_dims, kv=kv, shapes=shapes, batch=batch, n_heads=n_heads,
                  base_q=base_q, base_k=base_k)
    rows = run(ctx, **params)
    records = [matrix_record(ctx, rows, params)]
    records += throughput(ctx, seqlen=tp_seqlen, batch=tp_batch, heads=tp_heads)
    return records


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): every case of
    the matrix and of `run_special` (named cases with the window / softcap / dv != d / MLA variants,
    deterministic backward, split-KV decoding; one per distinct compiled kernel) and the d128 throughput runs, fwd and bwd."""
    import torch

    from .. import compiled

    axes = axes_from(params)
    cases = matrix.matrix_cases(axes, "gpu", mode=params["mode"])
    launches = []
    for case in cases:
        launches += matrix.case_launches(case, batch=params["batch"], n_heads=params["n_heads"],
                                         base=(params["base_q"], params["base_k"]))
    # run_special's cases: the named ones (head dim 256 paged, the backward cases), the deterministic
    # backward repeat and split-KV decoding (fixed, adaptive, stream-K)
    full = matrix.check_axes({**matrix.MATRIX_PRESETS["gpu"]["axes"], **axes})
    base, dims = (params["base_q"], params["base_k"]), full["head_dim"]
    special = [case for _, case in matrix.special_cases(full) + matrix.variant_cases(full)]
    special.append(matrix.Case(matrix._pick(dims, 1), True, "varlen", "contiguous", "GQA", True, "bwd", "bfloat16",
                               "base", True))                     # as run_special's deterministic case
    for case in special:
        launches += matrix.case_launches(case, batch=params["batch"], n_heads=params["n_heads"], base=base)
    launches += matrix.split_kv_launches(head_dim=matrix._pick(dims, 0), dtype="bfloat16")
    shape = (params["tp_batch"], params["tp_seqlen"], params["tp_heads"], 128)
    for causal in (False, True):
        q, k, v = (compiled.meta(shape, torch.bfloat16) for _ in range(3))
        launches += flash.attention_launches(q, k, v, causal=causal, backward=True,
                                             name=f"throughput d128 {'causal' if causal else 'full'} "
                                                  f"B{shape[0]} S{shape[1]} H{shape[2]}")
    return compiled.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """The throughput runs as {name, bytes, flops} (flops as `flash.attention_flops` counts them;
    bytes: q, k, v read and out written forward, plus dO read and dQ, dK, dV written backward)."""
    B, S, H, D = params["tp_batch"], params["tp_seqlen"], params["tp_heads"], 128
    tensor = B * S * H * D * 2
    out = []
    for causal in (False, True):
        kind = "causal" if causal else "full"
        for direction, n in (("fwd", 4), ("bwd", 9)):
            out.append({"name": f"{direction} d128 {kind} B{B} S{S} H{H}", "bytes": n * tensor,
                        "flops": flash.attention_flops(B, H, S, S, D, causal=causal, direction=direction),
                        "record": f"throughput-triton-{kind}", "metric": f"{direction}_time"})
    return out
