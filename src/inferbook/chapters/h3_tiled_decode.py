"""Chapter `h3-tiled-decode`: tiled VAE decode as ComfyUI's H3 VAE does it (tiles of a row batched by free
memory, up to four, blended into a preallocated canvas), what the overlap costs, and what batching costs.

`measure(ctx, **params)` returns RunRecords:

- `full`: the untiled decode (time, peak memory);
- `tiled[max_batch=k]` for k = 1, 2, 4: time and peak memory with at most k tiles per decoder call (GPU:
  `torch.cuda.max_memory_allocated`; CPU: peak bytes of live tensors, counted at the dispatcher by
  `tiled.peak_live_tensor_bytes`), the predicted overlap work ratio, the per-tile estimate;
- `budget[k tile(s)]`: the chooser under a memory budget that leaves room for k tiles after the weights,
  the canvas and the blend strip: the batch sizes it picked;
- `batching`: batch 1 vs batch 4, against the working precision's own error (bf16-aware);
- `seam[<decoder>, overlap=o]`: tiled vs full decode error, in the overlap bands and elsewhere, for the
  decoder with its global mid attention and for the same decoder without it;
- `temporal[<norm>, context=c]`: temporal tiles of two latent frames with c frames of causal context,
  against the full decode, for an RMSNorm and a per-frame GroupNorm decoder (both causal).
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..measure import benchmark, compare_timings
from ..presets import Param
from ..record import RunRecord
from ..diffusion.fused import Ops, fa_rule_check
from ..diffusion.tiled import (batching_check, decode_tiled, overlap_work_ratio, peak_live_tensor_bytes, seam_mask,
                               tiles_for_budget_sweep)
from ..diffusion.vae import VAEConfig, fp64_reference, init_decoder, make_latent
from .h3_vae_fusion import annotate_load, parse_ints
from ..words import count


def decoder_config_from(params: dict, norm: str) -> VAEConfig:
    """The conv decoder's config: temporal 2x at all but the last upsampling, at most two (Wan: 4x in time,
    8x in space)."""
    ch = parse_ints("channels", params["channels"])
    if len(ch) < 2:
        raise UserError(f"channels needs at least two stages, got {params['channels']!r}")
    ups = len(ch) - 1
    temporal = tuple((i < min(2, ups - 1)) if ups > 1 else True for i in range(ups))
    return VAEConfig(z_dim=params["z_dim"], channels=ch, temporal_up=temporal, norm=norm)


# The results page's headline: (record name prefix, measurement).
HEADLINE = ('tiled[max_batch=4]', 'time')

PARAMETERS = {
    "channels": Param(str, help="decoder stage widths, bottleneck first, comma-separated"),
    "z_dim": Param(int, help="latent channels"),
    "latent_frames": Param(int, help="latent frames T"),
    "latent_h": Param(int, help="latent height"),
    "latent_w": Param(int, help="latent width"),
    "norm": Param(str, "rms", help="decoder norm", choices=("rms", "group")),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "tile": Param(int, help="tile size in latent pixels"),
    "overlap": Param(int, min=0, help="overlap of neighbouring tiles in latent pixels (budget sweep)"),
    "overlaps": Param(str, help="overlaps for the seam-error sweep, comma-separated (0 allowed)"),
    "max_batch": Param(int, 4, help="most tiles decoded together (the seed: four)"),
    "reps": Param(int, help="minimum timed repetitions"),
    "vit": Param(str, help="H3's ViT decoder for sd.py's accounting: heads,dim_head,layers (H3: 32,64,36)"),
    "vit_latent": Param(str, help="T,h,w of the latent the ViT decoder decodes"),
    "vit_tile_budget_mib": Param(float, help="per-tile budget of the streamed ViT decode (ComfyUI: 128 MiB)"),
}

PRESETS = {
    "smoke": dict(channels="32,32,32", z_dim=4, latent_frames=2, latent_h=8, latent_w=10, dtype="float32",
                  tile=6, overlap=2, overlaps="0,4", reps=2, vit="2,24,1", vit_latent="3,4,4",
                  vit_tile_budget_mib=1.5),
    "cpu": dict(channels="64,64,32,32", z_dim=16, latent_frames=2, latent_h=12, latent_w=24, dtype="float32",
                tile=12, overlap=4, overlaps="0,6,8", reps=3, vit="4,48,2", vit_latent="5,6,8",
                vit_tile_budget_mib=3.0),
    # float16, as ComfyUI runs H3's VAE (`working_dtypes = [torch.float16, torch.float32]`)
    "gpu": dict(channels="384,384,192,96", z_dim=16, latent_frames=5, latent_h=60, latent_w=104, dtype="float16",
                tile=32, overlap=8, overlaps="0,8,16", reps=3, vit="16,64,8", vit_latent="5,16,28",
                vit_tile_budget_mib=128.0),
}


def _peak(ctx, fn):
    """(result, peak bytes, how) for one call of fn on this device."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        out = fn()
        torch.cuda.synchronize(ctx.device)
        return out, torch.cuda.max_memory_allocated(ctx.device) - base, "torch.cuda.max_memory_allocated - allocated before"
    return peak_live_tensor_bytes(fn)


def _workload(ctx, cfg: VAEConfig, latent, **extra) -> dict:
    out = cfg.output_shape(tuple(latent.shape))
    return {"model": f"causal video VAE decoder {cfg.norm} channels {','.join(map(str, cfg.channels))} z{cfg.z_dim}"
                     + ("" if cfg.attention else " (no attention)"),
            "model_revision": f"random init, seed {ctx.seed}", "quantization": "none", "frames": out[2],
            "resolution": f"{out[4]}x{out[3]}", "batch": latent.shape[0],
            "dtype": str(latent.dtype).replace("torch.", ""), **extra}


def seam_errors(decoder, latent, tile: int, overlap: int, full: torch.Tensor) -> dict:
    """Max |tiled - full| inside the overlap bands and outside them, relative to max |full|."""
    with torch.no_grad():
        video, info = decode_tiled(decoder, latent, tile, overlap)
    err = (video.double() - full.double()).abs().amax(dim=(0, 1, 2)).cpu()  # per output pixel
    mask = seam_mask(latent.shape[3], latent.shape[4], tile, overlap, decoder.cfg.spatial_factor)
    scale = float(full.double().abs().max())
    band = float(err[mask].max()) if mask.any() else 0.0
    rest = float(err[~mask].max()) if (~mask).any() else 0.0
    return {"seam_rel": band / scale, "interior_rel": rest / scale, "max_rel": float(err.max()) / scale,
            "tiles": info["tiles"], "overlaps_h": info["overlaps_h"], "overlaps_w": info["overlaps_w"],
            "finite": bool(torch.isfinite(video).all())}


BATCHES = (1, 2, 4)


def vit_config_from(P: dict) -> tuple:
    """(H3Config of the ViT decoder, (T, h, w) latent) from the chapter's parameters."""
    from ..diffusion.vae import H3Config

    heads, dim_head, layers = parse_ints("vit", P["vit"], 3)
    T, h, w = parse_ints("vit_latent", P["vit_latent"], 3)
    if h < 2 or w < 2:
        raise UserError(f"vit_latent h and w must be >= 2, got {h}x{w}")
    if not 0 < P["vit_tile_budget_mib"] <= 65536:
        raise UserError(f"vit_tile_budget_mib must be in (0, 65536], got {P['vit_tile_budget_mib']}")
    return H3Config(heads=heads, dim_head=dim_head, layers=layers, z_dim=P["z_dim"]), (T, h, w)


def check_params(P: dict) -> None:
    """Decoder widths, tile and overlaps, before any work (`setup` calls this)."""
    decoder_config_from(dict(channels=P["channels"], z_dim=P["z_dim"]), P["norm"])
    vit_config_from(P)
    if P["reps"] < 2:
        raise UserError(f"reps must be >= 2 (a comparison needs two samples a side), got {P['reps']}")
    tile = P["tile"]
    if not 0 <= P["overlap"] < tile:
        raise UserError(f"overlap must be in [0, tile={tile}), got {P['overlap']}")
    try:
        ov = tuple(int(v) for v in P["overlaps"].split(",") if v.strip())
    except ValueError:
        raise UserError(f"overlaps must be comma-separated integers, got {P['overlaps']!r}") from None
    if not ov or any(o < 0 or o >= tile for o in ov):
        raise UserError(f"overlaps must each be in [0, tile={tile}), got {P['overlaps']!r}")


def measure(ctx, *, channels, z_dim, latent_frames, latent_h, latent_w, norm, dtype, tile, overlap, overlaps,
            max_batch, reps, vit, vit_latent, vit_tile_budget_mib) -> list[RunRecord]:
    for name, v in (("z_dim", z_dim), ("latent_frames", latent_frames), ("latent_h", latent_h),
                    ("latent_w", latent_w), ("tile", tile), ("max_batch", max_batch), ("reps", reps)):
        if v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if reps < 2:
        raise UserError(f"reps must be >= 2 (a comparison needs two samples a side), got {reps}")
    if not 0 <= overlap < tile:
        raise UserError(f"overlap must be in [0, tile={tile}), got {overlap}")
    try:
        ov_list = tuple(int(v) for v in overlaps.split(",") if v.strip())
    except ValueError:
        raise UserError(f"overlaps must be comma-separated integers, got {overlaps!r}") from None
    if any(o < 0 or o >= tile for o in ov_list):
        raise UserError(f"overlaps must each be in [0, tile={tile}), got {overlaps!r}")
    dt = getattr(torch, dtype)
    cfg = decoder_config_from(dict(channels=channels, z_dim=z_dim), norm)
    decoder = init_decoder(cfg, ctx.seed, device=ctx.device, dtype=dt)
    latent = make_latent(cfg, (1, latent_frames, latent_h, latent_w), ctx.seed + 1, device=ctx.device, dtype=dt)
    topo = {"ranks": 1}
    predicted = overlap_work_ratio(latent_h, latent_w, tile, overlap)

    runs = {"full": lambda: decoder(latent, Ops("eager"))}
    for k in BATCHES:
        runs[f"max_batch={k}"] = (lambda k=k: decode_tiled(decoder, latent, tile, overlap, max_batch=k))
    # times first; peak memory after, in separate calls (the CPU's dispatcher hook slows the call down)
    timings, infos = {}, {}
    with torch.no_grad():
        for label, fn in runs.items():
            first = fn()  # warm-up, and the tiled runs' batch choices
            if label != "full":
                infos[label] = first[1]
            timings[label] = benchmark(fn, ctx.device, label=label, warmup=0, min_reps=reps, min_time_s=0.0)
        peaks = {label: _peak(ctx, fn)[1:] for label, fn in runs.items()}

    records = []
    full_rec = ctx.new_record("full", variant="untiled", workload=_workload(ctx, cfg, latent), topology=topo)
    full_rec.set_backend("decode", "untiled eager decode", shapes={"latent": list(latent.shape)})
    full_rec.add_timing("time", timings["full"])
    full_rec.add("peak_memory", peaks["full"][0], "B", how=peaks["full"][1])
    records.append(full_rec)
    for k in BATCHES:
        label = f"max_batch={k}"
        info = infos[label]
        rec = ctx.new_record(f"tiled[{label}]", variant=label, workload=_workload(
            ctx, cfg, latent, tile=tile, overlap=overlap), topology=topo)
        rec.set_backend("decode", f"tiled eager decode, batches {info['batch_sizes']}", reason=info["batch_reasons"][0],
                        shapes={"tile_latent": info["tile_latent"], "tiles": info["tiles"]})
        rec.add("per_tile_estimate", info["per_tile_estimate_bytes"], "B")
        rec.add("tiles_per_batch", max(info["batch_sizes"]), "tiles", batch_sizes=info["batch_sizes"],
                reasons=info["batch_reasons"])
        rec.add("predicted_work_ratio", predicted, "x", tiles=info["tiles"], tile_latent=info["tile_latent"])
        rec.add("weight_bytes", info["weight_bytes"], "B")
        rec.add("canvas_bytes", info["canvas_bytes"], "B")
        rec.add_timing("time", timings[label])
        rec.add("peak_memory", peaks[label][0], "B", how=peaks[label][1])
        records.append(rec)

    # the chooser under budgets that leave room for k tiles after weights, canvas and strip
    sweep = tiles_for_budget_sweep(decoder, latent, tile, overlap)
    for k in range(1, 5):
        if k not in sweep:
            continue
        with torch.no_grad():
            _, info = decode_tiled(decoder, latent, tile, overlap, max_batch=max_batch, memory_budget=sweep[k])
        rec = ctx.new_record(f"budget[{k} tile(s)]", variant=f"{k} tile(s) fit", workload=_workload(
            ctx, cfg, latent, tile=tile, overlap=overlap), topology=topo)
        rec.add("memory_budget", sweep[k], "B", fixed=sweep["fixed"], per_tile=sweep["per_tile"])
        rec.add("tiles_per_batch", max(info["batch_sizes"]), "tiles", batch_sizes=info["batch_sizes"],
                reasons=info["batch_reasons"])
        rec.add_check(f"chooser picks {k} tile(s) per batch", max(info["batch_sizes"]) == k)
        records.append(rec)

    # batching changes nothing beyond the working precision's own error: one frame, one tile row of up to
    # four tiles (the float64 reference decode is the cost)
    small = latent[:, :, :1, : min(latent_h, tile), : min(latent_w, 4 * tile - 3 * overlap)]
    with torch.no_grad():
        bc = batching_check(decoder, small, tile, overlap)
    rec = ctx.new_record("batching", variant="1 vs 4 tiles per call", workload=_workload(
        ctx, cfg, small, tile=tile, overlap=overlap), topology=topo)
    rec.add("batching_difference", bc["difference"], "abs")
    rec.add("precision_error", bc["precision_error"], "abs")
    rec.add_check("batch 1 and batch 4 agree within 2x the working precision's error vs float64", bc["passed"],
                  error=bc["difference"], tolerance=bc["tolerance"])
    records.append(rec)

    # seams: the decoder as built (global mid attention) and the same decoder without attention
    local_cfg = VAEConfig(**{**cfg.__dict__, "attention": False})
    local = init_decoder(local_cfg, ctx.seed, device=ctx.device, dtype=dt)
    for dec, label in ((decoder, "with attention"), (local, "no attention")):
        with torch.no_grad():
            full = dec(latent, Ops("eager"))
        for ov in ov_list:
            e = seam_errors(dec, latent, tile, ov, full)
            rec = ctx.new_record(f"seam[{label}, overlap={ov}]", variant=label,
                                 workload=_workload(ctx, dec.cfg, latent, tile=tile, overlap=ov), topology=topo)
            # split_tiles spreads the spare length over the overlaps: `ov` is only their minimum
            rec.add("seam_rel_error", e["seam_rel"], "fraction of max |full|", tiles=e["tiles"],
                    overlaps_h=e["overlaps_h"], overlaps_w=e["overlaps_w"])
            rec.add("interior_rel_error", e["interior_rel"], "fraction of max |full|")
            rec.add_check("tiled output finite", e["finite"])
            records.append(rec)
    records += temporal_records(ctx, cfg, dt)
    records += h3_decode_records(ctx, dict(vit=vit, vit_latent=vit_latent, vit_tile_budget_mib=vit_tile_budget_mib,
                                           z_dim=z_dim), dt, reps)
    return annotate_load(records)


H3_CHUNK, H3_CONTEXT = 2, 1   # latent frames per temporal chunk, and of context on each side


def h3_decode_records(ctx, P: dict, dt, reps: int) -> list[RunRecord]:
    """sd.py's H3 accounting on H3's ViT decoder: the untiled decode with its `memory_used_decode`-style estimate
    and measured peak; the streamed decode (temporal chunks, tiles sized to the per-tile budget, each tile written
    to the fp32 output buffer on the intermediate device) with its estimate, its measured peak and the budget
    checked against the measurement, not against the estimate that chose the tile."""
    from ..diffusion import h3_decode as HD
    from ..diffusion.vae import init_h3

    vcfg, (T, h, w) = vit_config_from(P)
    _, dec = init_h3(vcfg, ctx.seed, device=ctx.device, dtype=dt)
    z = make_latent(vcfg, (1, T, h, w), ctx.seed + 9, device=ctx.device, dtype=dt)
    budget = int(P["vit_tile_budget_mib"] * 2 ** 20)
    fixed = HD.fixed_workspace_bytes(dec, lambda f: _peak(ctx, f)[1], ctx.device, dt)
    inter = torch.device("cpu")   # ComfyUI's intermediate (output) device
    wl = {"model": f"H3 ViT3D decoder {vcfg.layers} x {vcfg.heads}x{vcfg.dim_head}, z{vcfg.z_dim}",
          "model_revision": f"random init, seed {ctx.seed}", "quantization": "none",
          "dtype": str(dt).replace("torch.", ""), "latent": [T, h, w], "batch": 1}
    with torch.no_grad():
        full_fn = lambda: dec(z, Ops("eager"))  # noqa: E731
        stream_fn = lambda: HD.decode_streamed(dec, z, chunk=H3_CHUNK, context=H3_CONTEXT, tile_budget=budget,  # noqa
                                               output_device=inter, fixed_bytes=fixed)
        full = full_fn()
        video, info = stream_fn()
        t_full = benchmark(full_fn, ctx.device, label="h3 untiled", warmup=0, min_reps=reps, min_time_s=0.0)
        t_stream = benchmark(stream_fn, ctx.device, label="h3 streamed", warmup=0, min_reps=reps, min_time_s=0.0)
        _, peak_full, how = _peak(ctx, full_fn)
        _, peak_stream, _ = _peak(ctx, stream_fn)
    on_device = ctx.device.type == "cuda"
    # on a CPU the intermediate device is the compute device: the output buffer is counted in the peak, and
    # taken out so that both numbers mean "held by the decode", as a GPU's max_memory_allocated would
    stream_held = peak_stream - (0 if on_device else info["output_bytes"])
    full_held = peak_full - (0 if on_device else full.numel() * full.element_size())
    est_full = HD.decode_estimate(dec, (T, h, w), z.element_size(), fixed_bytes=fixed)
    records = []
    rec = ctx.new_record("h3[untiled]", variant="untiled", workload=wl, topology={"ranks": 1})
    rec.set_backend("decode", "ViT3D decoder, eager, one call", shapes={"latent": list(z.shape)})
    rec.add("estimate", est_full["bytes"], "B", elements_per_pixel=est_full["elements_per_pixel"], fixed_bytes=fixed,
            form="(elements/pixel x frames x H x W) x itemsize + fixed, x 1.03 (sd.py's memory_used_decode)")
    rec.add("peak_memory", full_held, "B", how=how)
    rec.add_timing("time", t_full)
    records.append(rec)
    rec = ctx.new_record("h3[streamed]", variant=f"chunks of {H3_CHUNK}, tiles within {P['vit_tile_budget_mib']:g} MiB",
                         workload={**wl, "chunk": H3_CHUNK, "context": H3_CONTEXT}, topology={"ranks": 1})
    rec.set_backend("decode", f"streamed: {count(info['chunks'], 'chunk')} x {count(info['tiles_per_chunk'], 'tile')} of "
                              f"{info['tile'][0]}x{info['tile'][1]}", reason=info["tile_reason"],
                    shapes={"latent": list(z.shape), "tile": list(info["tile"])})
    rec.add("estimate", info["estimate_bytes"], "B", resident_frames=info["resident_frames"], fixed_bytes=fixed)
    rec.add("peak_memory", stream_held, "B", how=how, output_buffer_bytes=info["output_bytes"],
            output_device=str(inter))
    rec.add("tile_budget", budget, "B")
    rec.add_timing("time", t_stream)
    err = float((video.double() - full.double().cpu()).abs().max() / full.double().abs().max())
    rec.add("rel_error_vs_untiled", err, "fraction of max |untiled|")
    rec.add_check("measured peak within the per-tile budget (measured, not the chooser's estimate)",
                  stream_held <= budget, error=float(stream_held), tolerance=float(budget))
    rec.add_check("output is the fp32 buffer on the intermediate device",
                  video.dtype == torch.float32 and video.device == inter)
    rec.add_check("streamed output finite", bool(torch.isfinite(video).all()))
    records.append(rec)
    return records


def work_rows(records) -> tuple[list[dict], dict]:
    """Measured cost of the tiled decode against the overlap's predicted extra work, and peak memory against
    the untiled peak, per tiles-per-batch. Each time ratio through compare_timings."""
    full = next(r for r in records if r.name == "full")
    rows = []
    for r in records:
        if not r.name.startswith("tiled["):
            continue
        c = compare_timings(r.get("time"), full.get("time"))
        rows.append({"tiles_per_batch": r.value("tiles_per_batch"), "predicted_work_ratio": r.value("predicted_work_ratio"),
                     "time_ratio": c.ratio, "time_ratio_lo": c.lo, "time_ratio_hi": c.hi,
                     "sentence": c.sentence(f"the tiled decode ({r.variant})", "the untiled one"),
                     "comparison": (c, f"the tiled decode ({r.variant})", "the untiled one"),  # for nb.verdicts
                     "peak_MiB": r.value("peak_memory") / 2**20, "untiled_peak_MiB": full.value("peak_memory") / 2**20,
                     "peak_ratio": r.value("peak_memory") / full.value("peak_memory"),
                     "estimate_per_tile_MiB": r.value("per_tile_estimate") / 2**20})
    return rows, {"predicted": rows[0]["predicted_work_ratio"] if rows else None}


TEMPORAL_LATENT = (1, 5, 4, 6)  # B, T, h, w: small in space, enough frames for three temporal tiles of 2


def temporal_records(ctx, cfg: VAEConfig, dt) -> list[RunRecord]:
    """Temporal tiles of 2 latent frames with 1..T-1 frames of causal context, for an RMSNorm decoder and a
    per-frame GroupNorm one: both causal, so both exact (to rounding) once the context reaches frame 0."""
    records = []
    for norm in ("rms", "group"):
        c = VAEConfig(**{**cfg.__dict__, "norm": norm})
        dec = init_decoder(c, ctx.seed, device=ctx.device, dtype=dt)
        z = make_latent(c, TEMPORAL_LATENT, ctx.seed + 3, device=ctx.device, dtype=dt)
        ref64 = fp64_reference(dec, z)   # the yardstick: the working precision's own error is full's vs it
        with torch.no_grad():
            full = dec(z, Ops("eager"))
            scale = float(full.double().abs().max())
            for context in range(1, TEMPORAL_LATENT[1]):
                video, info = decode_tiled(dec, z, tile=max(z.shape[3:]), overlap=0, temporal_tile=2,
                                           temporal_context=context)
                err = float((video.double() - full.double()).abs().max()) / scale
                rule = fa_rule_check(video, full, ref64)
                rec = ctx.new_record(f"temporal[{norm}, context={context}]", variant=norm, workload=_workload(
                    ctx, c, z, temporal_tile=2, temporal_context=context), topology={"ranks": 1})
                rec.add("temporal_rel_error", err, "fraction of max |full|", temporal_tiles=info["temporal_tiles"])
                rec.add("error_vs_fp64", rule["error"], "abs", full_decode_error=rule["eager_error"])
                rec.add("tolerance_vs_fp64", rule["tolerance"], "abs")
                # another batch shape may take another conv algorithm (cuDNN picks per shape): not bitwise,
                # but within 2x the full decode's own error against float64, as FlashAttention's tests judge
                rec.add_check("temporal tiles finite", bool(torch.isfinite(video).all()))
                if context == TEMPORAL_LATENT[1] - 1:   # context back to frame 0: exact up to rounding
                    rec.add_check("temporal tiles within the FlashAttention rule of the full decode vs float64",
                                  rule["passed"], error=rule["error"], tolerance=rule["tolerance"],
                                  rms_error=rule["rms_error"], rms_tolerance=rule["rms_tolerance"])
                records.append(rec)
    return records
