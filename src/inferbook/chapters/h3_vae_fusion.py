"""Chapter `h3-vae-fusion`: the H3 VAE's fused paths as ComfyUI builds them, their fallbacks, the two gates,
and the stage timing that keeps a VAE change from being judged by whole-run time.

The model follows `comfy/ldm/minimax/vae.py`: a 3D causal CNN encoder, where each convolution's pre-norm
(per-frame GroupNorm) + SiLU + reflect/causal padding is one pass and the residual is added in the conv's
epilogue, and a ViT3D decoder whose linears take RMSNorm, SwiGLU and a scaled residual as parameters.

`measure(ctx, **params)` returns RunRecords:

- `block:norm_silu_pad[group]` (variants eager, torch.compile, and on a GPU triton fused): the encoder's
  first-level pre-conv pass, with the bytes-moved model of each path and GB/s against the copy ceiling;
- `encoder`, `decoder` (one per backend): the whole model, with the fused path's error against float64;
- `profile:encoder`, `profile:decoder`: the eager model's share of self time in library kernels (conv,
  matmul, attention), which torch.compile leaves to the same libraries;
- `pipeline` (one per decoder backend): denoise / VAE decode / audio / save, each stage timed apart;
- `gate:fp16_accumulation`, `gate:int8` (one per path): error against fp32 on every device, time where the
  path can be timed (the Triton kernels only on a GPU);
- `gates`: what each gate does and refuses to do.

On a CPU, Triton runs in the interpreter: the fused paths are *checked* there, never timed.
"""
from __future__ import annotations

import copy
import statistics

import torch

from ..errors import UserError
from ..measure import benchmark, ceilings, compare_timings
from ..presets import Param
from ..record import RunRecord
from ..diffusion import toy_pipeline
from ..diffusion.fused import (BackendLog, Norm, Ops, conv3d_eager, conv3d_triton, eager_bytes_moved, fa_rule_check,
                               fp16_conv_usable, fused_bytes_moved, norm_silu_pad_eager, norm_silu_pad_triton,
                               triton_usable)
from ..diffusion import int8 as int8_mod
from ..diffusion.profiling import int8_kernels_seen, library_share
from ..diffusion.vae import H3Config, compiled, fp64_reference, init_h3, int8_ops_report, make_video, quantize_decoder_int8

# Optional packages this chapter cannot run without (`setup` says so in one line when missing).
REQUIRES = {"av": "PyAV: the toy pipeline saves its video as H.264 + AAC in MP4"}

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('pipeline', 'vae_share')

PARAMETERS = {
    "ch": Param(int, help="encoder base width (ComfyUI's H3: 128)"),
    "ch_mult": Param(str, help="encoder width multipliers per level, comma-separated (H3: 1,2,2,4,4,8)"),
    "video": Param(str, help="T,H,W of the video the encoder reads (its latent is what the decoder decodes)"),
    "heads": Param(int, help="decoder attention heads (H3: 32)"),
    "dim_head": Param(int, help="decoder head width (H3: 64)"),
    "layers": Param(int, help="decoder transformer blocks (H3: 36)"),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "compile": Param(bool, True, help="also run the torch.compile backend"),
    "reps": Param(int, help="minimum timed repetitions per benchmark"),
    "steps": Param(int, help="denoising steps of the toy pipeline"),
    "fps": Param(int, 24, help="frames per second of the saved video"),
    "check_video": Param(str, help="T,H,W of the small video used for the whole-model correctness checks"),
}

PRESETS = {
    "smoke": dict(ch=32, ch_mult="1,1", video="5,16,16", heads=2, dim_head=24, layers=1, dtype="float32",
                  compile=False, reps=2, steps=2, check_video="3,8,8"),
    # cpu: a 5 x 32 x 32 video and three timed calls a side: the encoder dominated a cold `make book` at
    # 5 x 64 x 96, and still bound it at 5 x 32 x 64; 32 x 32 halves every timed call and the pipeline's decodes
    # again. The encoder's last level, 2 x 2, is the least its reflect padding takes; one 2 x 2 DiT patch tiles it
    "cpu": dict(ch=32, ch_mult="1,2,2,4", video="5,32,32", heads=4, dim_head=48, layers=2, dtype="float32",
                compile=True, reps=3, steps=4, check_video="2,32,32"),
    # float16 on a GPU, as ComfyUI runs H3's VAE (`working_dtypes = [torch.float16, torch.float32]`): the
    # fp16-accumulation gate then meets the path that is measured
    "gpu": dict(ch=128, ch_mult="1,2,2,4", video="17,256,448", heads=16, dim_head=64, layers=8, dtype="float16",
                compile=True, reps=20, steps=8, check_video="5,32,32"),
}


def parse_ints(name: str, text: str, n: int | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise UserError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals) or (n is not None and len(vals) != n):
        raise UserError(f"{name} must be {n or 'some'} positive integers, got {text!r}")
    return vals


def video_shapes(cfg, video: str, check_video: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(T, H, W) of the video and of the check video, refused (UserError) unless the encoder can read them."""
    shapes = parse_ints("video", video, 3), parse_ints("check_video", check_video, 3)
    p = cfg.patch
    for nm, (_, hh, ww) in zip(("video", "check_video"), shapes):
        if hh % p or ww % p:
            raise UserError(f"{nm} H and W must be multiples of the encoder's downsampling {p}, got {hh}x{ww}")
        if hh // p < 2 or ww // p < 2:
            raise UserError(f"{nm} {hh}x{ww} leaves the last level {hh // p}x{ww // p}: reflect padding needs "
                            f"at least 2x2 (H, W >= {2 * p})")
    H, W = shapes[0][1:]
    if (H // p) % 2 or (W // p) % 2:
        raise UserError(f"video H/{p} and W/{p} must be even (the toy DiT's 2x2 patches), got {H // p}x{W // p}")
    return shapes


def check_params(P: dict) -> None:
    """Encoder widths, the video and the check video's sizes, before any work (`setup` calls this)."""
    video_shapes(config_from(P), P["video"], P["check_video"])
    if P["reps"] < 2:
        raise UserError(f"reps must be >= 2 (a comparison needs two samples a side), got {P['reps']}")


def config_from(params: dict) -> H3Config:
    """H3Config from the chapter's parameters. Levels follow H3's pattern: spatial 2x down at the first four
    levels, temporal 2x down at the second and third (H3: space (2,2,2,2,1,1), time (1,2,2,1,1,1))."""
    mult = parse_ints("ch_mult", params["ch_mult"])
    n = len(mult)
    return H3Config(ch=params["ch"], ch_mult=mult, space_down=tuple(2 if i < 4 else 1 for i in range(n)),
                    time_down=tuple(2 if i in (1, 2) else 1 for i in range(n)), heads=params["heads"],
                    dim_head=params["dim_head"], layers=params["layers"])


def dtype_of(params: dict) -> torch.dtype:
    return getattr(torch, params["dtype"])


# ---------------------------------------------------------------------------------------------------
# Correctness: the fused ops and the whole models against eager, both against float64.

relative_check = fa_rule_check

# op cells: norm (None = pad only), shape [B, C, T, H, W], dtype, pad (l, r, t, b, front), layout, scale, offset
MATRIX = [
    ("group", (1, 64, 3, 5, 7), torch.float32, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),
    ("group", (2, 32, 4, 6, 9), torch.bfloat16, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),
    ("group", (1, 32, 1, 5, 6), torch.bfloat16, (1, 1, 1, 1, 0), "ndhwc", 1.0, 0.0),       # T = 1: no front
    ("group", (1, 32, 3, 6, 8), torch.float32, (0, 1, 0, 1, 2), "ndhwc", 1.0, 0.0),       # Downsample3D's pad
    ("group", (1, 64, 2, 4, 5), torch.float32, (1, 1, 1, 1, 2), "ncdhw", 1.0, 0.0),       # transposed input
    ("group", (1, 32, 2, 4, 6), torch.float32, (1, 1, 1, 1, 2), "ndhwc", 1.0, 1e3),       # mean 1000: Welford
    ("group", (1, 32, 3, 5, 6), torch.bfloat16, (1, 1, 1, 1, 2), "ndhwc", 0.05, 0.0),     # small: eps matters
    ("group", (1, 96, 2, 3, 70), torch.bfloat16, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),     # gpu blocks 64 x 32
    ("group", (1, 192, 2, 2, 40), torch.bfloat16, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),    # gpu blocks 32 x 64
    ("rms", (1, 40, 2, 5, 7), torch.float32, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),         # C = 8 x 5
    ("rms", (2, 33, 3, 3, 9), torch.bfloat16, (1, 1, 1, 1, 2), "ndhwc", 1.0, 0.0),        # odd C: masked lanes
    (None, (1, 3, 3, 8, 8), torch.float32, (1, 1, 1, 1, 2), "ncdhw", 1.0, 0.0),           # conv_in: pad only
]


def _cell_id(cell) -> str:
    norm, shape, dt, pad, layout, scale, off = cell
    return (f"{norm or 'pad'}-{'x'.join(map(str, shape))}-{str(dt)[6:]}-p{''.join(map(str, pad))}-{layout}"
            + (f"-s{scale:g}" if scale != 1 else "") + (f"-m{off:g}" if off else ""))


def make_case(cell, seed: int, device="cpu"):
    """Fresh random inputs of one matrix cell: (x, norm, pad) in the cell's dtype, and their float64 twins."""
    norm_kind, shape, dtype, pad, layout, scale, offset = cell
    B, C, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = (offset + scale * torch.randn(B, C, T, H, W, generator=g)).to(device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last_3d) if layout == "ndhwc" else x.contiguous()
    w = 1.0 + 0.2 * torch.randn(C, generator=g)
    b = 0.1 * torch.randn(C, generator=g)
    norm = None if norm_kind is None else Norm(norm_kind, w.to(device), b.to(device))
    norm64 = None if norm_kind is None else Norm(norm_kind, w.double(), b.double())
    return x, norm, x.double().cpu(), norm64, pad


def check_op(cell, seed: int, device="cpu", *, eps_override: float | None = None) -> dict:
    """One cell: fused Triton op vs eager (same precision) vs float64, by the FlashAttention rule.
    `eps_override` runs the fused kernel with another eps: a deliberately broken kernel."""
    x, norm, x64, norm64, pad = make_case(cell, seed, device)
    silu = norm is not None
    ref = norm_silu_pad_eager(x64, norm64, pad, silu)
    eager = norm_silu_pad_eager(x, norm, pad, silu)
    n_fused = norm if eps_override is None else Norm(norm.kind, norm.weight, norm.bias, eps_override, norm.groups)
    out = norm_silu_pad_triton(x, n_fused, pad, silu)
    res = fa_rule_check(out, eager, ref)
    res["ndhwc_out"] = bool(out.is_contiguous(memory_format=torch.channels_last_3d))
    res["passed"] = res["passed"] and res["ndhwc_out"]
    return {"case": _cell_id(cell), "norm": cell[0] or "pad only", "dtype": str(cell[2])[6:], **res}


def correctness_matrix(seed: int, device="cpu") -> list[dict]:
    """The chapter's matrix: per-frame GroupNorm and RMSNorm and pad-only, T = 1 and T > kernel, Downsample3D's
    one-sided pad, a transposed (NCDHW) input, a mean of 1000, small inputs where eps matters, odd channels,
    fp32 and bf16, and the exact block shapes the GPU preset's launches use."""
    return [check_op(cell, seed + i, device) for i, cell in enumerate(MATRIX)]


def eps_break(seed: int, device="cpu", eps: float = 1e-2) -> list[dict]:
    """The matrix's bf16 GroupNorm cells with the fused kernel's eps set to `eps` (the model's is 1e-6):
    the small-input cell must fail (unit-variance cells hide a 0.5 % shift under bf16 rounding). Returns
    the cells as checked."""
    return [check_op(cell, seed + i, device, eps_override=eps) for i, cell in enumerate(MATRIX)
            if cell[0] == "group" and cell[2] == torch.bfloat16]


def check_model(model, x: torch.Tensor) -> dict:
    """A whole model (encoder or decoder): fused dispatch vs eager, both against the float64 model.
    Returns the check and the fused run's backend log."""
    ref = fp64_reference(model, x)
    with torch.no_grad():
        eager = model(x, Ops("eager")).cpu()
        ops = Ops("fused")
        fused = model(x, ops).cpu()
    return {**fa_rule_check(fused, eager, ref), "log": ops.log}


# ---------------------------------------------------------------------------------------------------
# The gates.

def fp16_gate_paths(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> dict:
    """The conv paths the fp16 gate chooses between, on fp16 inputs x (padded, NDHWC), w, b, residual r.
    Returns {path: (callable, uses_triton)}."""
    paths = {"default conv (F.conv3d, fp16 in, fp32 accumulate)": (lambda: conv3d_eager(x, w, b, 1, r), False)}
    ok, _ = fp16_conv_usable(x, w)
    if ok:
        paths["gate: triton conv, fp16 accumulate"] = (lambda: conv3d_triton(x, w, b, 1, r, fp16_accumulation=True), True)
        paths["triton conv, fp32 accumulate (same kernel)"] = (
            lambda: conv3d_triton(x, w, b, 1, r, fp16_accumulation=False), True)
    return paths


def fp16_gate_case(shape, seed: int, device) -> tuple:
    """A ResnetBlock3D conv2 at `shape` [B, C, T, H, W]: padded fp16 input, weight, bias, residual, and the
    fp32 reference (the same fp16 values, convolved in fp32 with the residual)."""
    B, C, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, T + 2, H + 2, W + 2, generator=g).half()
    w = (torch.randn(C, C, 3, 3, 3, generator=g) / (27 * C) ** 0.5).half()
    b = (0.02 * torch.randn(C, generator=g)).half()
    r = torch.randn(B, C, T, H, W, generator=g).half()
    cl = lambda t: t.to(device).contiguous(memory_format=torch.channels_last_3d)  # noqa: E731
    x, w, b, r = cl(x), w.to(device), b.to(device), cl(r)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # a true fp32 reference, not TF32
        ref = torch.nn.functional.conv3d(x.float(), w.float(), b.float()) + r.float()
    return x, w, b, r, ref


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm())


def check_fp16_gate(seed: int, device) -> dict:
    """What the gate does: the default conv is F.conv3d bit for bit; fp16_accumulation=True on float16 takes the
    fp16-accumulation kernel (where Triton runs), its error against fp32 larger than the default's; on bfloat16
    the flag falls back to the default conv with the reason recorded."""
    x, w, b, r, ref = fp16_gate_case((1, 16, 3, 5, 6), seed, device)
    out = {}
    for dt in (torch.float16, torch.bfloat16):
        xd, wd, bd, rd = (t.to(dt) for t in (x, w, b, r))
        default = Ops("eager").conv3d(xd, wd, bd, residual=rd)
        plain = conv3d_eager(xd, wd, bd, 1, rd)
        gated = Ops("eager", fp16_accumulation=True)
        acc = gated.conv3d(xd, wd, bd, residual=rd)
        out[str(dt)[6:]] = {
            "default_bitwise_equal_conv3d": bool(torch.equal(default, plain)),
            "gated_backend": gated.log.backend("conv3d"), "gated_reason": gated.log.ops["conv3d"]["reason"],
            "gated_rel_l2_vs_fp32": rel_l2(acc, ref), "default_rel_l2_vs_fp32": rel_l2(default, ref),
            "gated_differs_from_default": not torch.equal(acc, default),
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
    report = int8_ops_report(ops_q.log)
    kernels = int8_kernels_seen(lambda: q(z, Ops("eager")), z.device)
    out = {"float_backend": ops_f.log.backend("attention"), "int8_backend": ops_q.log.backend("attention"),
           "float_quantization": decoder.quantization, "int8_quantization": q.quantization,
           "int8_linear_backend": ops_q.log.backend("to_qkv[int8]"), "int8_ops": report["ops"],
           "int8_gemm_reported": report["all_int8_gemm"], "int8_kernels": kernels,
           "int8_kernel_ran": report["all_int8_gemm"] and kernels["seen"],
           "original_unchanged": unchanged and torch.equal(again, out_f), "int8_relative_l2": rel_l2(out_q, out_f),
           "triton": None}
    if triton_usable(z)[0]:   # the fused INT8 path: our Triton kernels, counted by their launcher and profiler
        before_launches = dict(int8_mod.LAUNCHES)
        with torch.no_grad():
            ops_t = Ops("fused")
            out_t = q(z, ops_t)
        launched = {k: int8_mod.LAUNCHES[k] - before_launches[k] for k in before_launches}
        rep_t = int8_ops_report(ops_t.log, attention=True)
        seen = {"seen": all(launched.values()), "names": [k for k, v in launched.items() if v], "how": "launch count"}
        if z.is_cuda:
            seen = int8_kernels_seen(lambda: q(z, Ops("fused")), z.device)
            seen["seen"] = seen["seen"] and any("int8_attention" in n for n in seen["names"])
        out["triton"] = {"ops": rep_t["ops"], "reported": rep_t["all_int8_gemm"], "kernels": seen,
                         "ran": rep_t["all_int8_gemm"] and seen["seen"], "relative_l2_vs_eager_int8": rel_l2(out_t, out_q)}
    return out


# ---------------------------------------------------------------------------------------------------
# Measurement.

def _workload(ctx, cfg: H3Config, what: str, dtype, **extra) -> dict:
    return {"model": f"H3-shaped VAE {what}: ch {cfg.ch} x ({','.join(map(str, cfg.ch_mult))}), ViT {cfg.layers} x "
                     f"{cfg.heads}x{cfg.dim_head}, z{cfg.z_dim}",
            "model_revision": f"random init, seed {ctx.seed}", "quantization": "none",
            "dtype": str(dtype).replace("torch.", ""), **extra}


def _time(fn, ctx, label, reps, uses_triton=False, warmup=2):
    with torch.no_grad():
        return benchmark(fn, ctx.device, label=label, warmup=warmup, min_reps=reps, min_time_s=0.2,
                         uses_triton=uses_triton)


def _block_records(ctx, cfg: H3Config, shape, dtype, reps: int, do_compile: bool, ceil) -> list[RunRecord]:
    """The encoder's first-level pre-conv pass (C = ch at full resolution: its largest activation)."""
    g = ctx.generator(11)
    x = torch.randn(shape, generator=g, device=ctx.device).to(dtype).contiguous(memory_format=torch.channels_last_3d)
    C = shape[1]
    norm = Norm("group", 1 + 0.1 * torch.randn(C, generator=g, device=ctx.device),
                0.02 * torch.randn(C, generator=g, device=ctx.device))
    pad = (1, 1, 1, 1, 2)
    name = "block:norm_silu_pad[group]"
    eager_bytes, per_op = eager_bytes_moved(norm_silu_pad_eager, x, norm, pad)
    fused_bytes = fused_bytes_moved(shape, x.element_size(), pad, norm="group")
    torch_ops = "PyTorch ops (eager, or as traced by torch.compile)"
    variants = [("eager", lambda: norm_silu_pad_eager(x, norm, pad), False, torch_ops, eager_bytes)]
    if do_compile:
        fc = torch.compile(lambda x_, w_, b_: norm_silu_pad_eager(x_, Norm("group", w_, b_), pad), dynamic=False)
        variants.append(("torch.compile", lambda: fc(x, norm.weight, norm.bias), False, torch_ops, None))
    ok, why = triton_usable(x)
    if ctx.device.type == "cuda" and ok:
        variants.append(("triton fused", lambda: norm_silu_pad_triton(x, norm, pad), True,
                         f"triton fused kernels ({why})", fused_bytes))
    records = []
    for variant, fn, uses_triton, backend, bytes_model in variants:
        rec = ctx.new_record(name, variant=variant, workload=_workload(
            ctx, cfg, "encoder block", dtype, batch=shape[0], shapes={"x": list(shape), "pad": list(pad)}),
            topology={"ranks": 1})
        rec.set_backend("norm_silu_pad", backend, reason=f"variant {variant}", shapes={"x": list(shape)},
                        dtype=str(dtype).replace("torch.", ""))
        t = _time(fn, ctx, f"{name} {variant}", reps, uses_triton)
        rec.add_timing("time", t)
        rec.add("bytes_eager_model", eager_bytes, "B", per_op=len(per_op))
        rec.add("bytes_fused_model", fused_bytes, "B")
        rec.add("gbps_on_fused_bytes", fused_bytes / t.median_s / 1e9, "GB/s")
        rec.add("frac_copy_ceiling", fused_bytes / t.median_s / 1e9 / ceil.copy_gbps, "fraction",
                copy_gbps=ceil.copy_gbps)
        if bytes_model is not None:
            rec.add("gbps_on_own_bytes", bytes_model / t.median_s / 1e9, "GB/s")
        records.append(rec)
    return records


FP16_ACC = "triton fused + fp16 accumulation"


def _model_records(ctx, cfg, name: str, model, x, reps, do_compile, check) -> tuple[list[RunRecord], dict]:
    variants = [("eager", lambda: model(x, Ops("eager")), False)]
    fns = {"eager": lambda v: model(v, Ops("eager"))}
    if do_compile:
        cm = compiled(model)
        variants.append(("torch.compile", lambda: cm(x), False))
        fns["torch.compile"] = cm
    ok, _ = triton_usable(x)
    if ctx.device.type == "cuda" and ok:
        variants.append(("triton fused", lambda: model(x, Ops("fused")), True))
        fns["triton fused"] = lambda v: model(v, Ops("fused"))
        if name == "encoder" and x.dtype == torch.float16:  # the gate on the measured path: fp16 sums in the convs
            variants.append((FP16_ACC, lambda: model(x, Ops("fused", fp16_accumulation=True)), True))
    ops_of = {"triton fused": lambda log: Ops("fused", log=log),
              FP16_ACC: lambda log: Ops("fused", fp16_accumulation=True, log=log)}
    records = []
    for variant, fn, uses_triton in variants:
        log = BackendLog()
        with torch.no_grad():
            out = model(x, ops_of.get(variant, lambda lg: Ops("eager", log=lg))(log))
        rec = ctx.new_record(name, variant=variant, workload=_workload(ctx, cfg, name, x.dtype,
                                                                       shapes={"input": list(x.shape)}),
                             topology={"ranks": 1})
        log.to_record(rec)
        if variant == "torch.compile":
            for e in rec.backends.values():
                e["reason"] = "the eager ops, traced and fused by torch.compile (inductor)"
        rec.add_timing("time", _time(fn, ctx, f"{name} {variant}", reps, uses_triton, warmup=1))
        if variant == FP16_ACC:   # a gate that trades accuracy: its error is measured, not held to the FA rule
            with torch.no_grad():
                rec.add("rel_l2_vs_default", rel_l2(out, model(x, Ops("fused"))), "fraction")
        else:
            rec.add_check("fused model within the FlashAttention rule vs float64", check["passed"], error=check["error"],
                          tolerance=check["tolerance"], eager_error=check["eager_error"], rms_error=check["rms_error"],
                          rms_tolerance=check["rms_tolerance"])
        records.append(rec)
    return records, fns


PROFILE_CALLS = 3  # profiled calls per model: the share is their median, never one sample


def _profile_records(ctx, cfg, models: dict) -> list[RunRecord]:
    records = []
    for name, (model, x) in models.items():
        sh = library_share(lambda m=model, v=x: m(v, Ops("eager")), ctx.device, calls=PROFILE_CALLS)
        rec = ctx.new_record(f"profile:{name}", variant="eager", workload=_workload(ctx, cfg, name, x.dtype,
                                                                                     shapes={"input": list(x.shape)}),
                             topology={"ranks": 1})
        rec.add("library_share", sh["library_share"], "fraction", how=sh["how"], samples=sh["samples"],
                library_kernels=sh["library_kernels"])
        rec.add("other_share", 1.0 - sh["library_share"], "fraction", how=sh["how"])
        records.append(rec)
    return records


PIPELINE_ROUNDS = 3  # timed generations per decoder backend, interleaved across backends after a warm-up each


def _pipeline_records(ctx, cfg, latent_shape, dtype, steps, fps, decoders) -> list[RunRecord]:
    """Each decoder backend in the same toy generation: every backend warmed first (first calls, compiles,
    the encoder's start), then PIPELINE_ROUNDS rounds, each running every backend once in turn, so a stage
    that no backend changes (denoise, audio, save) is timed under the same conditions for all of them."""
    from ..context import results_dir
    from ..measure import Timing

    dit = toy_pipeline.init_dit(toy_pipeline.DiTConfig(z_dim=cfg.z_dim), ctx.seed + 5, device=ctx.device, dtype=dtype)
    kws = {}
    for variant in decoders:
        path = results_dir() / ctx.chapter.slug / f"toy-{variant.replace(' ', '_').replace('.', '_')}.mp4"
        kws[variant] = dict(steps=steps, fps=fps, out_path=path, device=ctx.device, dtype=dtype, seed=ctx.seed + 6)
    for variant, decode in decoders.items():
        toy_pipeline.run(dit, decode, latent_shape, **kws[variant])  # warm-up
    runs = {v: [] for v in decoders}
    for _ in range(PIPELINE_ROUNDS):
        for variant, decode in decoders.items():
            runs[variant].append(toy_pipeline.run(dit, decode, latent_shape, **kws[variant]))
    records = []
    timer = "cuda-synchronized perf_counter per stage" if ctx.device.type == "cuda" else "perf_counter per stage"
    for variant, res_list in runs.items():
        res = res_list[-1]
        probe = res["probe"]
        rec = ctx.new_record("pipeline", variant=variant, workload=_workload(
            ctx, cfg, "decoder in a toy generation", dtype, steps=steps,
            audio=f"{probe['audio_codec']} {probe['sample_rate']} Hz x{probe['channels']}"), topology={"ranks": 1})
        rec.set_backend("vae_decode", "triton fused" if variant == "triton fused" else "PyTorch ops",
                        reason=f"variant {variant}", shapes={"latent": [1, cfg.z_dim, *latent_shape[1:]]})
        for stage in toy_pipeline.STAGES:
            samples = [r["seconds"][stage] for r in res_list]
            rec.add_timing(stage, Timing(f"pipeline {variant} {stage}", samples, timer, warmup=1), phase=stage)
        rec.add_timing("total", Timing(f"pipeline {variant} total", [r["total"] for r in res_list], timer, warmup=1),
                       phase="total")
        shares = [r["seconds"]["vae_decode"] / r["total"] for r in res_list]
        rec.add("vae_share", statistics.median(shares), "fraction", phase="total", samples=shares,
                how=f"median of {len(shares)} interleaved generations' VAE share")
        rec.add_check("saved file decodes with the expected frames, size, audio",
                      probe["frames"] == res["frames"].shape[0] and probe["video_codec"] == "h264"
                      and probe["audio_codec"] == "aac" and probe["channels"] == 2 and probe["sample_rate"] == 32000,
                      error=None, tolerance=None, probe=probe)
        records.append(rec)
    return records


def _gate_records(ctx, cfg: H3Config, shape, decoder, z, reps) -> list[RunRecord]:
    """Each gate's paths: error against fp32 on every device; time where the path can be timed."""
    records = []
    on_gpu = ctx.device.type == "cuda"
    # fp16: a conv2 of the encoder's first level (at most 9 x 128 x 224: the gate's timing needs no more);
    # on a CPU a small one (the Triton kernel is interpreted)
    cshape = (1, shape[1], min(shape[2], 9), min(shape[3], 128), min(shape[4], 224)) if on_gpu else (1, shape[1], 3, 6, 8)
    x, w, b, r, ref = fp16_gate_case(cshape, ctx.seed + 7, ctx.device)
    for path, (fn, uses_triton) in fp16_gate_paths(x, w, b, r).items():
        rec = ctx.new_record("gate:fp16_accumulation", variant=path, workload=_workload(
            ctx, cfg, "encoder conv", torch.float16, shapes={"x": list(cshape)}), topology={"ranks": 1})
        rec.set_backend("conv3d", path, shapes={"x": list(cshape)}, dtype="float16")
        with torch.no_grad():
            out = fn()
        rec.add("rel_l2_vs_fp32", rel_l2(out, ref), "fraction")
        rec.add("max_rel_vs_fp32", float((out.double() - ref.double()).abs().max() / ref.abs().max()), "fraction")
        if on_gpu or not uses_triton:
            rec.add_timing("time", _time(fn, ctx, f"fp16 gate {path}", reps, uses_triton))
        records.append(rec)
    # int8: the float decoder in the chapter's dtype vs its INT8 copy, both against the fp32 decoder
    with torch.no_grad():
        ref32 = copy.deepcopy(decoder).float()(z.float(), Ops("eager"))
        q = quantize_decoder_int8(decoder)
        paths = [("float decoder (sdpa)", decoder, "eager"), ("int8 decoder (torch._int_mm, reference attention)", q,
                                                               "eager")]
        if on_gpu and triton_usable(z)[0]:   # the kernels timed beside the float path (never in the interpreter)
            paths += [("float decoder, triton fused", decoder, "fused"), ("int8 decoder, triton INT8 kernels", q, "fused")]
        for path, model, backend in paths:
            rec = ctx.new_record("gate:int8", variant=path, workload=_workload(ctx, cfg, "decoder", z.dtype,
                                                                               shapes={"latent": list(z.shape)}),
                                 topology={"ranks": 1})
            log = BackendLog()
            out = model(z, Ops(backend, log=log))
            log.to_record(rec)
            rec.add("rel_l2_vs_fp32", rel_l2(out, ref32), "fraction")
            rec.add_timing("time", _time(lambda m=model, b=backend: m(z, Ops(b)), ctx, f"int8 gate {path}", reps,
                                         backend == "fused"))
            records.append(rec)
    return records


def measure(ctx, *, ch, ch_mult, video, heads, dim_head, layers, dtype, compile, reps, steps, fps,
            check_video) -> list[RunRecord]:
    for name, v in (("ch", ch), ("heads", heads), ("dim_head", dim_head), ("layers", layers), ("reps", reps),
                    ("steps", steps), ("fps", fps)):
        if v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if reps < 2:
        raise UserError(f"reps must be >= 2 (a comparison needs two samples a side), got {reps}")
    cfg = config_from(dict(ch=ch, ch_mult=ch_mult, heads=heads, dim_head=dim_head, layers=layers))
    (T, H, W), (ct, chh, cw) = video_shapes(cfg, video, check_video)
    p = cfg.patch
    lat = (H // p) * (W // p)
    dt = dtype_of({"dtype": dtype})
    ceil = ceilings(ctx.device)
    enc, dec = init_h3(cfg, ctx.seed, device=ctx.device, dtype=dt)
    records = []
    # correctness of the fused paths on a small video (Triton interpreter on a CPU)
    xc = make_video(cfg, (1, ct, chh, cw), ctx.seed + 100, device=ctx.device, dtype=dt)
    enc_check = check_model(enc, xc)
    with torch.no_grad():
        zc = enc(xc)[:, :cfg.z_dim]
    dec_check = check_model(dec, zc)
    x = make_video(cfg, (1, T, H, W), ctx.seed + 200, device=ctx.device, dtype=dt)
    with torch.no_grad():
        # the means half of the moments, copied to standard strides: the denoiser's latents in the pipeline have
        # them, and a compiled decoder (dynamic=False) would recompile for the slice's batch stride
        m = enc(x)[:, :cfg.z_dim]
        z = torch.empty(m.shape, device=m.device, dtype=m.dtype).copy_(m)
    recs, _ = _model_records(ctx, cfg, "encoder", enc, x, reps, compile, enc_check)
    records += recs
    recs, decoders = _model_records(ctx, cfg, "decoder", dec, z, reps, compile, dec_check)
    records += recs
    block_shape = (1, cfg.widths[0], T, H, W)
    records += _block_records(ctx, cfg, block_shape, dt, reps, compile, ceil)
    records += _profile_records(ctx, cfg, {"encoder": (enc, x), "decoder": (dec, z)})
    records += _pipeline_records(ctx, cfg, (1, z.shape[2], z.shape[3], z.shape[4]), dt, steps, fps, decoders)
    records += _gate_records(ctx, cfg, block_shape, dec, z, reps)
    records.append(_gate_checks(ctx, cfg, dec, zc, dt))
    return annotate_load(records)


def _gate_checks(ctx, cfg, dec, zc, dt) -> RunRecord:
    gates = ctx.new_record("gates", variant="checks", workload=_workload(ctx, cfg, "gates", dt))
    fp16 = check_fp16_gate(ctx.seed + 7, ctx.device)
    for d, r in fp16.items():
        gates.add_check(f"fp16 gate ({d}): default conv is F.conv3d + residual, bit for bit",
                        r["default_bitwise_equal_conv3d"])
    r16, rbf = fp16["float16"], fp16["bfloat16"]
    ok, why = fp16_conv_usable(torch.empty(1, 16, 1, 1, 1, device=ctx.device, dtype=torch.float16),
                               torch.empty(16, 16, 1, 1, 1))
    if ok:
        gates.add_check("fp16 gate (float16): flag selects the fp16-accumulation conv",
                        r16["gated_backend"] == "triton fp16-accumulation conv" and r16["gated_differs_from_default"])
        gates.add_check("fp16 gate (float16): fp16 accumulation costs accuracy against fp32",
                        r16["gated_rel_l2_vs_fp32"] > r16["default_rel_l2_vs_fp32"],
                        error=r16["gated_rel_l2_vs_fp32"], tolerance=None)
    else:
        gates.add_check("fp16 gate (float16): kernel unavailable, default conv kept, reason recorded",
                        r16["gated_backend"].startswith("F.conv3d") and "unavailable" in r16["gated_reason"])
    gates.add_check("fp16 gate (bfloat16): flag falls back to the default conv, reason recorded",
                    rbf["gated_backend"].startswith("F.conv3d") and "bfloat16" in rbf["gated_reason"])
    i8 = check_int8_gate(dec, zc)
    gates.add_check("int8 gate: float decoder keeps sdpa attention", i8["float_backend"] == "torch sdpa")
    # what ran, not what the label says: every INT8 op reported the INT8 GEMM (no float fallback), and the
    # profiler saw INT8 GEMM kernels (CUDA: kernel names; CPU: completed aten::_int_mm rows)
    gates.add_check("int8 gate: quantized copy runs INT8 GEMM kernels (backend report and profiler)",
                    i8["int8_kernel_ran"], kernels=i8["int8_kernels"]["names"], how=i8["int8_kernels"]["how"],
                    ops=i8["int8_ops"])
    if i8["triton"] is not None:
        t = i8["triton"]
        gates.add_check("int8 gate: fused path runs the Triton INT8 GEMM and attention kernels (report and launches)",
                        t["ran"], kernels=t["kernels"]["names"], how=t["kernels"]["how"], ops=t["ops"])
    gates.add_check("int8 gate: original decoder unchanged", i8["original_unchanged"])
    gates.notes = repr({"fp16": fp16, "int8": i8})
    return gates


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

def comparison(records, name: str, a: str, b: str):
    """compare_timings of two variants of one record name (a against b), or None when either is absent."""
    by = {r.variant: r for r in records if r.name == name}
    if a not in by or b not in by:
        return None
    return compare_timings(by[a].get("time"), by[b].get("time"))


def verdict_rows(records) -> list[dict]:
    """Every timed comparison the page states, each through compare_timings."""
    rows = []
    pairs = [("block:norm_silu_pad[group]", "torch.compile", "eager"),
             ("block:norm_silu_pad[group]", "triton fused", "eager"),
             ("encoder", "torch.compile", "eager"), ("encoder", "triton fused", "eager"),
             ("decoder", "torch.compile", "eager"), ("decoder", "triton fused", "eager"),
             ("encoder", FP16_ACC, "triton fused")]
    for name, a, b in pairs:
        c = comparison(records, name, a, b)
        if c is not None:
            rows.append({"what": name, "a": a, "b": b, "verdict": c.verdict, "ratio": c.ratio, "lo": c.lo, "hi": c.hi,
                         "sentence": c.sentence(f"{name} {a}", b), "comparison": (c, f"{name} {a}", b)})
    for name in ("gate:fp16_accumulation", "gate:int8"):
        recs = [r for r in records if r.name == name and any(m["name"] == "time" for m in r.measurements)]
        for r in recs[1:]:
            c = compare_timings(r.get("time"), recs[0].get("time"))
            rows.append({"what": name, "a": r.variant, "b": recs[0].variant, "verdict": c.verdict, "ratio": c.ratio,
                         "lo": c.lo, "hi": c.hi, "sentence": c.sentence(r.variant, recs[0].variant),
                         "comparison": (c, r.variant, recs[0].variant)})
    return rows


def gate_rows(records) -> list[dict]:
    """Speed against error: each gate path's error against fp32 and its median time (None: not timed here)."""
    rows = []
    for r in records:
        if r.name.startswith("gate:"):
            timed = any(m["name"] == "time" for m in r.measurements)
            rows.append({"gate": r.name[5:], "path": r.variant, "rel_l2_vs_fp32": r.value("rel_l2_vs_fp32"),
                         "median_ms": 1e3 * r.value("time") if timed else None})
    return rows


def block_rows(records) -> list[dict]:
    """One row per block variant: time, bytes models, achieved GB/s."""
    rows = []
    for r in records:
        if not r.name.startswith("block:"):
            continue
        rows.append({"block": r.name[len("block:"):], "variant": r.variant, "median_ms": 1e3 * r.value("time"),
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
    """The end-to-end speedup a VAE-only speedup can give, from the eager run's VAE share (the median of its
    interleaved generations, with their range), and the measured point (eager vs the fastest other VAE
    backend, each ratio through compare_timings). Returns (curve rows, summary)."""
    pipes = {r.variant: r for r in records if r.name.startswith("pipeline")}
    eager = pipes["eager"]
    f = eager.value("vae_share")
    shares = eager.get("vae_share").get("samples", [f])
    rows = [{"vae_speedup": s, "end_to_end_speedup": toy_pipeline.amdahl(f, s), "series": "Amdahl bound"}
            for s in speedups]
    bound = lambda x: 1.0 / (1.0 - x) if x < 1 else float("inf")  # noqa: E731
    summary = {"vae_share": f, "bound": bound(f), "bound_range": (bound(min(shares)), bound(max(shares))),
               "samples": len(shares), "measured": None}
    others = [v for v in pipes if v != "eager"]
    if others:
        best = min(others, key=lambda v: pipes[v].value("vae_decode"))
        s_vae = eager.value("vae_decode") / pipes[best].value("vae_decode")
        s_total = eager.value("total") / pipes[best].value("total")
        rows.append({"vae_speedup": s_vae, "end_to_end_speedup": s_total, "series": f"measured ({best})"})
        summary["measured"] = {
            "backend": best, "vae_speedup": s_vae, "end_to_end_speedup": s_total,
            "amdahl_prediction": toy_pipeline.amdahl(f, s_vae),
            "vae": compare_timings(pipes[best].get("vae_decode"), eager.get("vae_decode")),
            "total": compare_timings(pipes[best].get("total"), eager.get("total")),
            "denoise": compare_timings(pipes[best].get("denoise"), eager.get("denoise"))}
    return rows, summary


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`), traced: the
    encoder and decoder with `Ops("fused")` on the check video and on the timed video, the block's
    norm + SiLU + pad, and the fp16 gate's conv (gated and fp32-accumulating, at the gate's timed
    shape and at `check_fp16_gate`'s) run on storage-less `meta` tensors inside
    `compiled.recording()`, which records each launch instead of running it; one per distinct
    compiled kernel, named by where it was launched."""
    from .. import compiled as C
    from ..diffusion import fused as FU
    from ..diffusion.vae import H3Encoder, ViT3DDecoder

    cfg = config_from(params)
    dt = dtype_of(params)
    T, H, W = parse_ints("video", params["video"], 3)
    ct, chh, cw = parse_ints("check_video", params["check_video"], 3)
    meta = torch.device("meta")
    cl = torch.channels_last_3d
    with torch.device(meta):
        enc, dec = (m.to(dtype=dt).eval().requires_grad_(False) for m in (H3Encoder(cfg), ViT3DDecoder(cfg)))
    launches = []
    dec_int8 = quantize_decoder_int8(dec)

    from ..diffusion import int8 as I8

    # the fused and INT8 kernels ask their device for their tiles (the interpreter's are smaller): a GPU's
    cuda = torch.device("cuda")
    linear_config, gemm_config, attention_config = FU.linear_config, I8.gemm_config, I8.attention_config
    gpu_tiles = {(FU, "linear_config"): lambda device, M=4096, N=4096, swiglu=False, gpu_config=False:
                 linear_config(cuda, M, N, swiglu),
                 (I8, "gemm_config"): lambda M, N, device, gpu_config=False: gemm_config(M, N, cuda),
                 (I8, "attention_config"): lambda device, gpu_config=False: attention_config(cuda)}

    def traced(where, fn):
        with C.recording(patch=gpu_tiles) as rec, torch.no_grad():
            fn()
        for la in rec:
            la.name = f"{where}: {la.name} {C.describe(la)}".strip()
        launches.extend(rec)

    for where, (t, h, w) in (("check", (ct, chh, cw)), ("timed", (T, H, W))):
        x = torch.empty((1, cfg.in_channels, t, h, w), device=meta, dtype=dt)
        with torch.no_grad():
            z = torch.empty(enc(x, Ops("eager"))[:, :cfg.z_dim].shape, device=meta, dtype=dt)
        traced(f"{where} encoder", lambda x=x: enc(x, Ops("fused")))
        if where == "timed" and dt == torch.float16:
            traced("timed encoder fp16-accumulate", lambda x=x: enc(x, Ops("fused", fp16_accumulation=True)))
        traced(f"{where} decoder", lambda z=z: dec(z, Ops("fused")))
        traced(f"{where} int8 decoder", lambda z=z: dec_int8(z, Ops("fused")))
    block = (1, cfg.widths[0], T, H, W)                                        # _block_records
    xb = torch.empty(block, device=meta, dtype=dt).contiguous(memory_format=cl)
    norm = Norm("group", torch.empty(block[1], device=meta), torch.empty(block[1], device=meta))
    traced("block", lambda: norm_silu_pad_triton(xb, norm, (1, 1, 1, 1, 2)))
    gate = (1, block[1], min(T, 9), min(H, 128), min(W, 224))                 # _gate_records, then check_fp16_gate
    for where, (B_, C_, t, h, w) in (("fp16 gate", gate), ("fp16 gate check", (1, 16, 3, 5, 6))):
        xp = torch.empty((B_, C_, t + 2, h + 2, w + 2), device=meta, dtype=torch.float16).contiguous(memory_format=cl)
        wt, bias = torch.empty((C_, C_, 3, 3, 3), device=meta, dtype=torch.float16), torch.empty(C_, device=meta,
                                                                                               dtype=torch.float16)
        r = torch.empty((B_, C_, t, h, w), device=meta, dtype=torch.float16).contiguous(memory_format=cl)
        for acc in (True, False):
            traced(f"{where} {'fp16' if acc else 'fp32'}-accumulate",
                   lambda xp=xp, wt=wt, bias=bias, r=r, acc=acc: conv3d_triton(xp, wt, bias, 1, r, fp16_accumulation=acc))
    return C.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """The fused norm + SiLU + pad pass the page times (the encoder's first level, its largest
    activation) as {name, bytes, flops}: bytes from `fused_bytes_moved` (memory-bound; flops not counted)."""
    from ..diffusion.fused import fused_bytes_moved

    dt = getattr(torch, params["dtype"])
    cfg = config_from(params)
    T, H, W = parse_ints("video", params["video"], 3)
    shape = (1, cfg.widths[0], T, H, W)
    return [{"name": f"norm_silu_pad[group] {'x'.join(map(str, shape))}",
             "bytes": fused_bytes_moved(shape, dt.itemsize, (1, 1, 1, 1, 2), norm="group"),
             "flops": 0.0, "record": "block:norm_silu_pad[group]", "variant": "triton fused", "metric": "time"}]
