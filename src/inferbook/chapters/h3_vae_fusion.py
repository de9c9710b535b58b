"""Chapter `h3-vae-fusion`: fused video-VAE decode (norm + SiLU + padding + residual), its fallbacks,
its two gates, and the stage timing that keeps a VAE change from being judged by whole-run time.

`measure(ctx, **params)` returns RunRecords:

- `block:<op>[<norm>]` (variants eager, torch.compile, and on a GPU triton fused): the memory-bound
  operations around a 3D convolution at the decoder's largest stage, with the bytes-moved model of
  each path and achieved GB/s against the copy bandwidth measured in the same run;
- `decoder[<norm>]`: the whole decoder per backend, with its error against a float64 decode;
- `pipeline` (one per VAE backend): denoise / VAE decode / audio / save, each stage timed apart;
- `gates`: the FP16-accumulation and INT8-attention gates checked on this device.

On a CPU, Triton runs in the interpreter: the fused path is *checked* there, never timed.
"""
from __future__ import annotations

import torch

from ..measure import benchmark, ceilings
from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..diffusion import toy_pipeline
from ..diffusion.fused import (BackendLog, Norm, Ops, add_norm_silu_pad_eager, eager_bytes_moved,
                    fused_bytes_moved, norm_silu_pad_eager, norm_silu_pad_triton, triton_usable)
from ..diffusion.vae import (VAEConfig, compiled_decoder, decoder_fp64_reference, init_decoder, make_latent,
                  quantize_decoder_int8)

# Optional packages this chapter cannot run without (`setup` says so in one line when missing).
REQUIRES = {"av": "PyAV: the toy pipeline saves its video as H.264 + AAC in MP4"}

PARAMETERS = {
    "channels": Param(str, help="decoder stage widths, bottleneck first, comma-separated (e.g. 384,384,192,96)"),
    "z_dim": Param(int, help="latent channels"),
    "latent_frames": Param(int, help="latent frames T (video frames: 1 + 4 (T - 1))"),
    "latent_h": Param(int, help="latent height (video: 8x)"),
    "latent_w": Param(int, help="latent width (video: 8x)"),
    "norms": Param(str, help="norm variants to build", choices=("rms", "group", "rms,group")),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "compile": Param(bool, True, help="also run the torch.compile backend"),
    "reps": Param(int, help="minimum timed repetitions per benchmark"),
    "steps": Param(int, help="denoising steps of the toy pipeline"),
    "fps": Param(int, 24, help="frames per second of the saved video"),
    "check_latent": Param(str, help="T,h,w of the small latent used for the decoder correctness check"),
}

PRESETS = {
    "smoke": dict(channels="32,32,32", z_dim=4, latent_frames=2, latent_h=4, latent_w=6, norms="rms",
                  dtype="float32", compile=False, reps=2, steps=2, check_latent="2,3,5"),
    "cpu": dict(channels="96,96,64,32", z_dim=16, latent_frames=3, latent_h=12, latent_w=16, norms="rms",
                dtype="float32", compile=True, reps=3, steps=4, check_latent="2,3,5"),
    "gpu": dict(channels="384,384,192,96", z_dim=16, latent_frames=5, latent_h=60, latent_w=104, norms="rms,group",
                dtype="bfloat16", compile=True, reps=10, steps=8, check_latent="2,8,12"),
}


def parse_ints(name: str, text: str, n: int | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise UserError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals) or (n is not None and len(vals) != n):
        raise UserError(f"{name} must be {n or 'some'} positive integers, got {text!r}")
    return vals


def check_params(P: dict) -> None:
    """Decoder widths and latent sizes, before any work (`setup` calls this)."""
    config_from(P, "rms")
    parse_ints("check_latent", P["check_latent"], 3)
    if P["latent_h"] % 2 or P["latent_w"] % 2:
        raise UserError(f"latent_h and latent_w must be even (the toy DiT's 2x2 patches), "
                        f"got {P['latent_h']}x{P['latent_w']}")


def config_from(params: dict, norm: str) -> VAEConfig:
    ch = parse_ints("channels", params["channels"])
    if len(ch) < 2:
        raise UserError(f"channels needs at least two stages, got {params['channels']!r}")
    ups = len(ch) - 1
    # temporal 2x at all but the last upsampling, at most two (Wan: 4x in time, 8x in space)
    temporal = tuple((i < min(2, ups - 1)) if ups > 1 else True for i in range(ups))
    return VAEConfig(z_dim=params["z_dim"], channels=ch, temporal_up=temporal, norm=norm)


def dtype_of(params: dict) -> torch.dtype:
    return getattr(torch, params["dtype"])


# ---------------------------------------------------------------------------------------------------
# Correctness: the fused ops and the whole decoder against eager, both against float64.

def relative_check(out: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor) -> dict:
    """FlashAttention's rule: the fused error against float64 may be at most twice the eager path's own
    error in the same precision, plus a floor of 2 ulp of the output's scale (eager can be exact).
    NaN or inf never passes."""
    eps = torch.finfo(out.dtype).eps
    scale = float(ref64.abs().max())
    err = float((out.double() - ref64).abs().max())
    err_eager = float((eager.double() - ref64).abs().max())
    tol = 2 * err_eager + 2 * eps * max(scale, 1e-30)
    finite = bool(torch.isfinite(out).all())
    return {"error": err, "eager_error": err_eager, "tolerance": tol, "passed": finite and err <= tol}


def check_op(op: str, norm_kind: str, shape, dtype: torch.dtype, seed: int, *, noncontig: bool = False,
             scale: float = 1.0, device="cpu") -> dict:
    """One cell of the correctness matrix: fused Triton op vs eager vs float64 on fresh random inputs."""
    B, C, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    mk = lambda: (scale * torch.randn(B, C, T, H, W + (1 if noncontig else 0), generator=g))
    x64, r64 = mk(), mk()
    if noncontig:
        x64, r64 = x64[..., 1:], r64[..., 1:]  # a strided view: last dim not contiguous from 0
    w = 1.0 + 0.2 * torch.randn(C, generator=g)
    b = 0.1 * torch.randn(C, generator=g)
    pad = (2, 1, 1)
    n64 = Norm(norm_kind, w.double(), b.double())
    x, r = x64.to(device=device, dtype=dtype), r64.to(device=device, dtype=dtype)
    x64, r64 = x.double().cpu(), r.double().cpu()  # the reference sees the rounded inputs
    n = Norm(norm_kind, w.to(device), b.to(device))
    if op == "norm_silu_pad":
        ref = norm_silu_pad_eager(x64, n64, pad)
        eager = norm_silu_pad_eager(x, n, pad)
        out = norm_silu_pad_triton(x, n, pad)
        res = relative_check(out.cpu(), eager.cpu(), ref)
    else:
        y_ref, ref = add_norm_silu_pad_eager(x64, r64, n64, pad)
        y_e, eager = add_norm_silu_pad_eager(x, r, n, pad)
        y_f, out = norm_silu_pad_triton(x, n, pad, residual=r)
        res = relative_check(out.cpu(), eager.cpu(), ref)
        ry = relative_check(y_f.cpu(), y_e.cpu(), y_ref)
        res["passed"] = res["passed"] and ry["passed"]
        res["y_error"] = ry["error"]
    return {"op": op, "norm": norm_kind, "shape": "x".join(map(str, shape)), "dtype": str(dtype).replace("torch.", ""),
            "non_contiguous": noncontig, **res}


def correctness_matrix(seed: int, device="cpu", small: bool = True) -> list[dict]:
    """The chapter's matrix: both norms, channels incl. non-multiples of 32 (RMS), odd H/W, T=1 and T
    larger than the kernel, a non-contiguous input, large-magnitude inputs, float32 and bfloat16."""
    cases = [
        ("norm_silu_pad", "rms", (1, 40, 1, 5, 7), torch.float32, False, 1.0),
        ("norm_silu_pad", "rms", (2, 24, 4, 3, 9), torch.bfloat16, False, 1.0),
        ("norm_silu_pad", "rms", (1, 33, 3, 6, 5), torch.float32, True, 1.0),
        ("norm_silu_pad", "group", (1, 64, 4, 3, 5), torch.float32, False, 1.0),
        ("norm_silu_pad", "group", (2, 32, 1, 5, 3), torch.bfloat16, False, 1.0),
        ("add_norm_silu_pad", "rms", (1, 40, 4, 5, 3), torch.float32, False, 1.0),
        ("add_norm_silu_pad", "rms", (1, 72, 1, 3, 7), torch.bfloat16, True, 1.0),
        ("add_norm_silu_pad", "group", (1, 64, 4, 3, 5), torch.float32, False, 1e3),
        ("add_norm_silu_pad", "group", (1, 32, 3, 5, 5), torch.bfloat16, False, 1.0),
    ]
    return [check_op(op, nk, shp, dt, seed + i, noncontig=nc, scale=sc, device=device)
            for i, (op, nk, shp, dt, nc, sc) in enumerate(cases)]


def check_decoder(decoder, z: torch.Tensor) -> dict:
    """Whole decoder: fused dispatch vs eager, both against the float64 decode. Returns the check and
    the fused run's backend log."""
    ref = decoder_fp64_reference(decoder, z)
    with torch.no_grad():
        eager = decoder(z, Ops("eager")).cpu()
        ops = Ops("fused")
        fused = decoder(z, ops).cpu()
    return {**relative_check(fused, eager, ref), "log": ops.log}


# ---------------------------------------------------------------------------------------------------
# The gates.

def check_fp16_gate(seed: int, device) -> dict:
    """Default conv = F.conv3d, bit for bit; fp16_accumulation=True on float16 takes the fp16 path
    (error within an fp16-accumulation bound, and different from the default); on bfloat16 the flag
    falls back to the default path with the reason recorded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 24, 4, 6, 7, generator=g)
    w = torch.randn(16, 24, 3, 3, 3, generator=g) / (24 * 27) ** 0.5
    out = {}
    for dt in (torch.float16, torch.bfloat16):
        xd, wd = x.to(device, dt), w.to(device, dt)
        default = Ops("eager").conv3d(xd, wd)
        ref_default = torch.nn.functional.conv3d(xd, wd)
        gated = Ops("eager", fp16_accumulation=True)
        acc = gated.conv3d(xd, wd)
        ref64 = torch.nn.functional.conv3d(xd.double(), wd.double())
        err = float((acc.double() - ref64).abs().max())
        # fp16 partial sums: each of the 27 tap additions rounds at 2^-11 of the running value
        bound = 27 * 2 ** -11 * float(ref64.abs().max()) + float((default.double() - ref64).abs().max())
        out[str(dt).replace("torch.", "")] = {
            "default_bitwise_equal_conv3d": bool(torch.equal(default, ref_default)),
            "gated_backend": gated.log.backend("conv3d"), "gated_reason": gated.log.ops["conv3d"]["reason"],
            "gated_error": err, "gated_bound": bound, "gated_differs_from_default": not torch.equal(acc, default),
        }
    return out


def check_int8_gate(decoder, z: torch.Tensor) -> dict:
    """A float decoder keeps its attention precision; only `quantize_decoder_int8()` yields INT8 attention,
    as a copy (the original unchanged)."""
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    with torch.no_grad():
        ops_f = Ops("eager")
        out_f = decoder(z, ops_f)
        q = quantize_decoder_int8(decoder)
        ops_q = Ops("eager")
        out_q = q(z, ops_q)
        again = decoder(z, Ops("eager"))
    unchanged = all(torch.equal(before[k], v) for k, v in decoder.state_dict().items())
    rel = float((out_q.double() - out_f.double()).norm() / out_f.double().norm())
    return {"float_backend": ops_f.log.backend("attention"), "int8_backend": ops_q.log.backend("attention"),
            "float_quantization": decoder.quantization, "int8_quantization": q.quantization,
            "original_unchanged": unchanged and torch.equal(again, out_f), "int8_relative_l2": rel}


# ---------------------------------------------------------------------------------------------------
# Measurement.

def largest_stage_shape(cfg: VAEConfig, latent_shape) -> tuple[int, ...]:
    """[B, C, T, H, W] entering the last stage's residual block: where the memory-bound ops cost most."""
    B, T, h, w = latent_shape
    out = cfg.output_shape((B, cfg.z_dim, T, h, w))
    return (B, cfg.channels[-1], out[2], out[3], out[4])


def _workload(ctx, cfg: VAEConfig, latent_shape, dtype, **extra) -> dict:
    w = {"model": f"causal video VAE decoder {cfg.norm} channels {','.join(map(str, cfg.channels))} z{cfg.z_dim}",
         "model_revision": f"random init, seed {ctx.seed}", "quantization": "none",
         "dtype": str(dtype).replace("torch.", "")}
    if latent_shape is not None:  # a whole decode: the video it makes
        out = cfg.output_shape((latent_shape[0], cfg.z_dim, *latent_shape[1:]))
        w.update(frames=out[2], resolution=f"{out[4]}x{out[3]}", batch=latent_shape[0])
    return {**w, **extra}


def _block_records(ctx, cfg: VAEConfig, shape, dtype, reps: int, do_compile: bool, ceil) -> list[RunRecord]:
    g = ctx.generator(11)
    x = torch.randn(shape, generator=g, device=ctx.device).to(dtype)
    r = torch.randn(shape, generator=g, device=ctx.device).to(dtype)
    C = shape[1]
    norm = Norm(cfg.norm, (1 + 0.1 * torch.randn(C, generator=g, device=ctx.device)),
                0.02 * torch.randn(C, generator=g, device=ctx.device))
    pad = (2, 1, 1)
    blocks = {
        "norm_silu_pad": (lambda: norm_silu_pad_eager(x, norm, pad), lambda: norm_silu_pad_triton(x, norm, pad), False),
        "add_norm_silu_pad": (lambda: add_norm_silu_pad_eager(x, r, norm, pad),
                              lambda: norm_silu_pad_triton(x, norm, pad, residual=r), True),
    }
    records = []
    for op, (eager_fn, fused_fn, has_res) in blocks.items():
        name = f"block:{op}[{cfg.norm}]"
        eager_bytes, per_op = eager_bytes_moved(eager_fn)
        fused_bytes = fused_bytes_moved(shape, x.element_size(), pad, norm=cfg.norm, residual=has_res)
        # eager and torch.compile run the same PyTorch ops (the variant is the difference under study, so
        # compare() accepts the pair); the Triton kernel is another backend, and compare() says so.
        torch_ops = "PyTorch ops (eager, or as traced by torch.compile)"
        variants = [("eager", eager_fn, False, torch_ops, eager_bytes)]
        if do_compile:
            fn_c = torch.compile(_eager_block(op), dynamic=False)
            args = (x, r, norm.weight, norm.bias, pad, cfg.norm) if has_res else (x, norm.weight, norm.bias, pad, cfg.norm)
            variants.append(("torch.compile", lambda f=fn_c, a=args: f(*a), False, torch_ops, None))
        ok, why = triton_usable(x)
        if ctx.device.type == "cuda" and ok:
            variants.append(("triton fused", fused_fn, True, f"triton fused kernel ({why})", fused_bytes))
        eager_t = None
        for variant, fn, uses_triton, backend, bytes_model in variants:
            rec = ctx.new_record(name, variant=variant, workload=_workload(
                ctx, cfg, None, dtype, batch=shape[0], shapes={"x": list(shape), "pad": list(pad)}),
                topology={"ranks": 1})
            rec.set_backend(op, backend, reason=f"variant {variant}", shapes={"x": list(shape)},
                            dtype=str(dtype).replace("torch.", ""))
            t = benchmark(fn, ctx.device, label=f"{name} {variant}", warmup=2, min_reps=reps,
                          min_time_s=0.2, uses_triton=uses_triton)
            rec.add_timing("time", t)
            rec.add("bytes_eager_model", eager_bytes, "B", per_op=len(per_op))
            rec.add("bytes_fused_model", fused_bytes, "B")
            # achieved rate on the *minimum* traffic (the fused model): what the op must move at least
            rec.add("gbps_on_fused_bytes", fused_bytes / t.median_s / 1e9, "GB/s")
            rec.add("frac_copy_ceiling", fused_bytes / t.median_s / 1e9 / ceil.copy_gbps, "fraction",
                    copy_gbps=ceil.copy_gbps)
            if bytes_model is not None:
                rec.add("gbps_on_own_bytes", bytes_model / t.median_s / 1e9, "GB/s")
            if eager_t is None:
                eager_t = t.median_s
            rec.add("speedup_vs_eager", eager_t / t.median_s, "x")
            records.append(rec)
    return records


def _eager_block(op: str):
    if op == "norm_silu_pad":
        def f(x, w, b, pad, kind):
            return norm_silu_pad_eager(x, Norm(kind, w, b), pad)
    else:
        def f(x, r, w, b, pad, kind):
            return add_norm_silu_pad_eager(x, r, Norm(kind, w, b), pad)
    return f



def _decoder_records(ctx, cfg, decoder, z, reps, do_compile, check) -> tuple[list[RunRecord], dict]:
    records, fns = [], {}
    latent_shape = (z.shape[0], z.shape[2], z.shape[3], z.shape[4])
    variants = [("eager", lambda: decoder(z, Ops("eager")), False)]
    if do_compile:
        cd = compiled_decoder(decoder)
        variants.append(("torch.compile", lambda: cd(z), False))
        fns["torch.compile"] = cd
    ok, why = triton_usable(z)
    if ctx.device.type == "cuda" and ok:
        variants.append(("triton fused", lambda: decoder(z, Ops("fused")), True))
    eager_t = None
    for variant, fn, uses_triton in variants:
        log = BackendLog()
        with torch.no_grad():
            if variant == "eager":
                decoder(z, Ops("eager", log=log))
            elif variant == "triton fused":
                decoder(z, Ops("fused", log=log))
            else:
                decoder(z, Ops("eager", log=log))  # what the compiled graph was traced from
            rec = ctx.new_record(f"decoder[{cfg.norm}]", variant=variant,
                                 workload=_workload(ctx, cfg, latent_shape, z.dtype, shapes={"latent": list(z.shape)}),
                                 topology={"ranks": 1})
            log.to_record(rec)
            if variant == "torch.compile":
                for e in rec.backends.values():
                    e["reason"] = "the eager ops, traced and fused by torch.compile (inductor)"
            t = benchmark(fn, ctx.device, label=f"decoder {variant}", warmup=1, min_reps=reps, min_time_s=0.1,
                          uses_triton=uses_triton)
        rec.add_timing("time", t)
        if eager_t is None:
            eager_t = t.median_s
        rec.add("speedup_vs_eager", eager_t / t.median_s, "x")
        # the fused path's correctness (interpreter on CPU, small latent) goes with every record
        rec.add_check("fused decoder within 2x eager error vs float64", check["passed"], error=check["error"],
                      tolerance=check["tolerance"], eager_error=check["eager_error"])
        records.append(rec)
    return records, fns


def _pipeline_records(ctx, cfg, decoder, latent_shape, dtype, steps, fps, compiled) -> list[RunRecord]:
    from ..context import results_dir

    dit = toy_pipeline.init_dit(toy_pipeline.DiTConfig(z_dim=cfg.z_dim), ctx.seed + 5, device=ctx.device, dtype=dtype)
    decoders = {"eager": lambda lat: decoder(lat, Ops("eager"))}
    if compiled is not None:
        decoders["torch.compile"] = compiled
    ok, _ = triton_usable(torch.empty(1, device=ctx.device, dtype=dtype))
    if ctx.device.type == "cuda" and ok:
        decoders["triton fused"] = lambda lat: decoder(lat, Ops("fused"))
    records = []
    for variant, decode in decoders.items():
        path = results_dir() / ctx.chapter.slug / f"toy-{cfg.norm}-{variant.replace(' ', '_').replace('.', '_')}.mp4"
        kw = dict(steps=steps, fps=fps, out_path=path, device=ctx.device, dtype=dtype, seed=ctx.seed + 6)
        toy_pipeline.run(dit, decode, latent_shape, **kw)  # warm-up: first calls, caches, encoder start
        res = toy_pipeline.run(dit, decode, latent_shape, **kw)
        probe = res["probe"]
        rec = ctx.new_record(f"pipeline[{cfg.norm}]", variant=variant, workload=_workload(
            ctx, cfg, latent_shape, dtype, steps=steps,
            audio=f"{probe['audio_codec']} {probe['sample_rate']} Hz x{probe['channels']}"), topology={"ranks": 1})
        rec.set_backend("vae_decode", "triton fused" if variant == "triton fused" else "PyTorch ops",
                        reason=f"variant {variant}", shapes={"latent": [1, cfg.z_dim, *latent_shape[1:]]})
        for stage, s in res["seconds"].items():
            rec.add(stage, s, "s", phase=stage)
        rec.add("total", res["total"], "s", phase="total")
        rec.add("vae_share", res["seconds"]["vae_decode"] / res["total"], "fraction", phase="total")
        rec.add_check("saved file decodes with the expected frames, size, audio",
                      probe["frames"] == res["frames"].shape[0] and probe["video_codec"] == "h264"
                      and probe["audio_codec"] == "aac" and probe["channels"] == 2 and probe["sample_rate"] == 32000,
                      error=None, tolerance=None, probe=probe)
        records.append(rec)
    return records


def measure(ctx, *, channels, z_dim, latent_frames, latent_h, latent_w, norms, dtype, compile, reps, steps, fps,
            check_latent) -> list[RunRecord]:
    for name, v in (("z_dim", z_dim), ("latent_frames", latent_frames), ("latent_h", latent_h),
                    ("latent_w", latent_w), ("reps", reps), ("steps", steps), ("fps", fps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if latent_h % 2 or latent_w % 2:
        raise ValueError(f"latent_h and latent_w must be even (the toy DiT's 2x2 patches), got {latent_h}x{latent_w}")
    dt = dtype_of({"dtype": dtype})
    params = dict(channels=channels, z_dim=z_dim)
    for norm in norms.split(","):
        config_from(params, norm)  # channel / norm errors before any work
    latent_shape = (1, latent_frames, latent_h, latent_w)
    ct, ch, cw = parse_ints("check_latent", check_latent, 3)
    ceil = ceilings(ctx.device)
    records = []
    for k, norm in enumerate(norms.split(",")):
        cfg = config_from(params, norm)
        decoder = init_decoder(cfg, ctx.seed, device=ctx.device, dtype=dt)
        # correctness of the fused path on a small latent (Triton interpreter on a CPU)
        z_check = make_latent(cfg, (1, ct, ch, cw), ctx.seed + 100 + k, device=ctx.device, dtype=dt)
        check = check_decoder(decoder, z_check)
        z = make_latent(cfg, latent_shape, ctx.seed + 200 + k, device=ctx.device, dtype=dt)
        recs, fns = _decoder_records(ctx, cfg, decoder, z, reps, compile, check)
        records += recs
        records += _block_records(ctx, cfg, largest_stage_shape(cfg, latent_shape), dt, reps, compile, ceil)
        if k == 0:
            records += _pipeline_records(ctx, cfg, decoder, latent_shape, dt, steps, fps, fns.get("torch.compile"))
            gates = ctx.new_record("gates", variant="checks", workload=_workload(ctx, cfg, latent_shape, dt))
            fp16 = check_fp16_gate(ctx.seed + 7, ctx.device)
            for d, r in fp16.items():
                gates.add_check(f"fp16 gate ({d}): default conv is F.conv3d bit for bit",
                                r["default_bitwise_equal_conv3d"])
            r16, rbf = fp16["float16"], fp16["bfloat16"]
            gates.add_check("fp16 gate (float16): flag selects the fp16-accumulation conv",
                            r16["gated_backend"] == "fp16-accumulation conv" and r16["gated_differs_from_default"],
                            error=r16["gated_error"], tolerance=r16["gated_bound"])
            gates.add_check("fp16 gate (float16): error within the fp16-accumulation bound",
                            r16["gated_error"] <= r16["gated_bound"], error=r16["gated_error"],
                            tolerance=r16["gated_bound"])
            gates.add_check("fp16 gate (bfloat16): flag falls back to the default conv, reason recorded",
                            rbf["gated_backend"].startswith("F.conv3d") and "bfloat16" in rbf["gated_reason"])
            i8 = check_int8_gate(decoder, z_check)
            gates.add_check("int8 gate: float decoder keeps sdpa attention", i8["float_backend"] == "torch sdpa")
            gates.add_check("int8 gate: quantized copy uses INT8 attention", i8["int8_backend"].startswith("int8"))
            gates.add_check("int8 gate: original decoder unchanged", i8["original_unchanged"])
            gates.add_check("int8 gate: INT8 output near the float one", i8["int8_relative_l2"] < 0.05,
                            error=i8["int8_relative_l2"], tolerance=0.05)
            gates.notes = repr({"fp16": fp16, "int8": i8})
            records.append(gates)
    return annotate_load(records)


def annotate_load(records: list[RunRecord]) -> list[RunRecord]:
    """Note the machine's load average on every record: CPU times taken on a shared, busy machine are noisy,
    and the record should say so."""
    import os

    if hasattr(os, "getloadavg"):
        l1, l5, _ = os.getloadavg()
        note = f"load average at end of run: {l1:.1f} (1 min), {l5:.1f} (5 min) on {os.cpu_count()} cores"
        for r in records:
            r.notes = f"{r.notes}; {note}" if r.notes else note
    return records


# ---------------------------------------------------------------------------------------------------
# What the chapter shows, computed from the records (the notebook only displays).

def block_rows(records) -> list[dict]:
    """One row per block and variant: time, speedup, bytes models, achieved GB/s."""
    rows = []
    for r in records:
        if not r.name.startswith("block:"):
            continue
        rows.append({"block": r.name[len("block:"):], "variant": r.variant, "median_ms": 1e3 * r.value("time"),
                     "speedup_vs_eager": r.value("speedup_vs_eager"),
                     "eager_bytes_MB": r.value("bytes_eager_model") / 1e6,
                     "fused_bytes_MB": r.value("bytes_fused_model") / 1e6,
                     "GBps_on_fused_bytes": r.value("gbps_on_fused_bytes"),
                     "frac_of_copy": r.value("frac_copy_ceiling")})
    return rows


def stage_rows(records) -> list[dict]:
    """Seconds and share of each toy-pipeline stage, per VAE backend."""
    rows = []
    for r in records:
        if not r.name.startswith("pipeline"):
            continue
        total = r.value("total")
        for stage in toy_pipeline.STAGES:
            rows.append({"vae_backend": r.variant, "stage": stage, "seconds": r.value(stage),
                         "share": r.value(stage) / total})
    return rows


def amdahl_rows(records, speedups=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64)) -> tuple[list[dict], dict]:
    """The end-to-end speedup a VAE-only speedup can give, from the eager run's measured VAE share, and
    the measured point (eager vs the fastest other VAE backend). Returns (curve rows, summary)."""
    pipes = {r.variant: r for r in records if r.name.startswith("pipeline")}
    eager = pipes["eager"]
    f = eager.value("vae_share")
    rows = [{"vae_speedup": s, "end_to_end_speedup": toy_pipeline.amdahl(f, s), "series": "Amdahl bound"}
            for s in speedups]
    summary = {"vae_share": f, "bound": 1.0 / (1.0 - f) if f < 1 else float("inf"), "measured": None}
    others = [v for v in pipes if v != "eager"]
    if others:
        best = min(others, key=lambda v: pipes[v].value("vae_decode"))
        s_vae = eager.value("vae_decode") / pipes[best].value("vae_decode")
        s_total = eager.value("total") / pipes[best].value("total")
        rows.append({"vae_speedup": s_vae, "end_to_end_speedup": s_total, "series": f"measured ({best})"})
        summary["measured"] = {"backend": best, "vae_speedup": s_vae, "end_to_end_speedup": s_total,
                               "amdahl_prediction": toy_pipeline.amdahl(f, s_vae)}
    return rows, summary


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): norm + SiLU +
    pad (with and without the residual, both norms) at the largest stage's shape with the blocks'
    fp32 norm weights and in the decoder (weights in the model dtype), the GroupNorm statistics
    pass, and the mid-block attention/FFN linears; one per distinct compiled kernel."""
    from .. import compiled
    from ..diffusion import fused as FU

    dt = getattr(torch, params["dtype"])
    pad = (2, 1, 1)
    latent = (1, params["latent_frames"], params["latent_h"], params["latent_w"])
    launches = []
    for norm in params["norms"].split(","):
        cfg = config_from(params, norm)
        shape = largest_stage_shape(cfg, latent)
        for res in (False, True):
            launches += FU.norm_silu_pad_launches(shape, dt, norm, pad, groups=cfg.groups, residual=res,
                                                  weight_dtype=torch.float32, name="block")
            wide = (shape[0], cfg.channels[-2], *shape[2:])            # the last stage's first ResBlock norm
            launches += FU.norm_silu_pad_launches(wide, dt, norm, pad, groups=cfg.groups, residual=res,
                                                  weight_dtype=dt, name="decoder")
        C0 = cfg.channels[0]
        M = latent[0] * latent[1] * latent[2] * latent[3]             # tokens of the mid attention
        Fm = cfg.ffn_mult * C0
        launches += FU.fused_linear_launches(M, 3 * C0, C0, dt, norm=True, name="attn.qkv")
        launches += FU.fused_linear_launches(M, C0, C0, dt, residual=True, name="attn.out")
        launches += FU.fused_linear_launches(M, Fm, C0, dt, norm=True, swiglu=True, name="ffn.up")
        launches += FU.fused_linear_launches(M, C0, Fm, dt, residual=True, name="ffn.down")
    return compiled.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """The fused blocks at the largest stage as {name, bytes, flops}: bytes `fused_bytes_moved`
    (memory-bound; flops not counted)."""
    from ..diffusion.fused import fused_bytes_moved

    dt = getattr(torch, params["dtype"])
    latent = (1, params["latent_frames"], params["latent_h"], params["latent_w"])
    out = []
    for norm in params["norms"].split(","):
        shape = largest_stage_shape(config_from(params, norm), latent)
        for op, res in (("norm_silu_pad", False), ("add_norm_silu_pad", True)):
            out.append({"name": f"{op}[{norm}] {'x'.join(map(str, shape))}",
                        "bytes": fused_bytes_moved(shape, dt.itemsize, (2, 1, 1), norm=norm, residual=res),
                        "flops": 0.0, "record": f"block:{op}[{norm}]", "variant": "triton fused", "metric": "time"})
    return out
