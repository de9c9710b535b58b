"""Chapter `omni-h3-workflows`: text->video+audio and reference->video+audio workflows, checked media.

vLLM-Omni #7423 added an H3 text-to-video/audio workflow JSON; #7483 added `references` and a
Ref2VA workflow. Ours (`data/workflows/h3_t2va.json`, `h3_ref2va.json`) run on the same executor
as the loop chapter, against a toy in-process "server" (`nodes.TOY_SERVED`: random-weight DiT and
video VAE from `inferbook.diffusion`). The seed's advice is followed literally: save a short
fixed-seed sample, check its audio track and frame count, then scale up references and duration.

Records (one per workflow): stage times measured apart — load, denoise, VAE decode, audio, save —
cold and warm, with checks that the saved MP4 holds what the request asked for (frames, fps,
size, H.264, AAC at 32 kHz, two channels). The seed's own run is `seed_record()`: a quoted record,
never saved among ours.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..workflow import nodes, segments
from ..workflow.executor import Executor
from ..workflow.references import check_service_mapping

# Optional packages this chapter cannot run without (`setup` says so in one line when missing).
REQUIRES = {"av": "PyAV: the workflows write, read and probe MP4 video and audio"}

PARAMETERS = {
    "model": Param(str, help="toy served model (size)", choices=("toy-h3-tiny", "toy-h3-small", "toy-h3-base")),
    "width": Param(int, help="video width (multiple of 16)"),
    "height": Param(int, help="video height (multiple of 16)"),
    "frames": Param(int, help="frames, 1 + 4k (the VAE's temporal factor)"),
    "steps": Param(int, help="denoising steps (the seed's run used five)"),
    "repeats": Param(int, help="warm runs per workflow (median reported)"),
}

PRESETS = {
    "smoke": dict(model="toy-h3-tiny", width=32, height=32, frames=5, steps=5, repeats=1),
    "cpu": dict(model="toy-h3-small", width=128, height=96, frames=17, steps=5, repeats=3),
    "gpu": dict(model="toy-h3-base", width=512, height=288, frames=49, steps=5, repeats=3),
}

FPS, SAMPLE_RATE, CHANNELS = 24, 32000, 2
SAMPLE_FRAMES = 5   # the short fixed-seed sample checked before scaling up (the seed's advice)
STAGE_OF = {"OmniModel": "load", "H3Denoise": "denoise", "H3VAEDecode": "vae_decode", "H3AudioDecode": "audio",
            "SaveVideo": "save"}
STAGES = ("denoise", "vae_decode", "audio", "save")
WORKFLOWS = {"t2va": "h3_t2va.json", "ref2va": "h3_ref2va.json"}


def workflow_path(name: str) -> Path:
    from ..context import repo_root

    return repo_root() / "data" / "workflows" / name


def h3_workflow(kind: str, *, model: str, width: int, height: int, frames: int, steps: int, seed: int = 42) -> dict:
    """The workflow file with the request written into its inputs (as an API client would)."""
    wf = json.loads(workflow_path(WORKFLOWS[kind]).read_text())
    wf["model"]["inputs"]["model"] = model
    wf["denoise"]["inputs"].update(width=width, height=height, frames=frames, steps=steps, seed=seed)
    wf["audio"]["inputs"].update(frames=frames, fps=FPS, sample_rate=SAMPLE_RATE)
    wf["save"]["inputs"]["fps"] = FPS
    return wf


def write_reference_media(folder: Path, *, width: int, height: int, seed: int) -> dict[str, Path]:
    """The files the Ref2VA workflow names: references/boat.png and references/harbour.mp4 (with audio)."""
    from ..diffusion import media

    ref = Path(folder) / "references"
    img = segments.scene(width, height, "a paper boat", seed)
    png = nodes.write_png(ref / "boat.png", nodes.to_uint8(img)[0])
    clip, audio = segments.generate_segment(segments.scene(width, height, "a harbour", seed + 1), "a harbour", 9,
                                            seed, 0, steps=2, fps=FPS, sample_rate=SAMPLE_RATE)
    mp4 = media.write_mp4(ref / "harbour.mp4", nodes.to_uint8(clip), FPS,
                          audio["waveform"].numpy().astype(np.float32), SAMPLE_RATE)
    return {"image": png, "video": mp4}


def expected_media(width: int, height: int, frames: int) -> dict:
    return {"frames": frames, "fps": float(FPS), "width": width, "height": height, "video_codec": "h264",
            "audio_codec": "aac", "sample_rate": SAMPLE_RATE, "channels": CHANNELS}


def media_mismatches(probe: dict, want: dict) -> dict:
    """Fields of `probe` that differ from the request (fps compared to 1e-6)."""
    bad = {}
    for k, v in want.items():
        got = probe.get(k)
        same = abs(got - v) < 1e-6 if k == "fps" and got is not None else got == v
        if not same:
            bad[k] = (got, v)
    return bad


def executor_for(ctx, out_dir: Path, in_dir: Path, *, cache: bool = False) -> Executor:
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.device.type == "cuda" else None
    return Executor(cache=cache, output_dir=out_dir, input_dir=in_dir, device=ctx.device, sync=sync)


def stage_seconds(result) -> dict[str, float]:
    out = {s: 0.0 for s in ("load",) + STAGES}
    for r in result.log:
        stage = STAGE_OF.get(r.class_type)
        if stage:
            out[stage] += r.seconds
    return out


def run_workflows_timed(ctx, p: dict, out_dir: Path, in_dir: Path) -> dict[str, tuple[RunRecord, dict]]:
    """Both workflows: one cold run each, then `repeats` warm runs each, the two workflows
    alternating so that drift in the machine's load hits both alike. The executor's cache is
    off, so every stage runs every time. Returns {kind: (record, details)}."""
    wfs = {kind: h3_workflow(kind, model=p["model"], width=p["width"], height=p["height"], frames=p["frames"],
                             steps=p["steps"], seed=42 + ctx.seed) for kind in WORKFLOWS}
    for kind, wf in wfs.items():
        mismatches = check_service_mapping(wf, nodes.TOY_SERVED)
        if mismatches:
            raise ValueError(f"{kind}: " + "; ".join(mismatches))
    runs = {kind: [] for kind in wfs}
    for _ in range(1 + p["repeats"]):
        for kind, wf in wfs.items():
            runs[kind].append(executor_for(ctx, out_dir / kind, in_dir).run(wf))
    return {kind: _record(ctx, kind, wfs[kind], runs[kind], p) for kind in wfs}


def _record(ctx, kind: str, wf: dict, runs: list, p: dict) -> tuple[RunRecord, dict]:
    from ..diffusion.media import probe_media

    cold, warm = runs[0], runs[1:]
    probe = probe_media(cold.output("save"))
    lora = wf["model"]["inputs"].get("lora_path")
    rec = ctx.new_record(kind, variant=kind, workload={
        "model": f"{p['model']} (toy DiT + causal video VAE, random init)",
        "model_revision": "random init, seed 0" + (f" + LoRA {lora}" if lora else ""),
        "quantization": "none (fp32)", "frames": p["frames"], "resolution": f"{p['width']}x{p['height']}",
        "steps": p["steps"], "fps": FPS, "audio": f"AAC {SAMPLE_RATE // 1000} kHz, {CHANNELS} channels",
        "batch": 1, "references": _reference_counts(cold) if kind == "ref2va" else "none",
    }, topology={"ranks": 1, "tp": 1})
    B, T, h, w = nodes.latent_shape(p["width"], p["height"], p["frames"])
    rec.set_backend("dit_attention", "torch nn.TransformerEncoderLayer (SDPA inside)",
                    reason="toy DiT from inferbook.diffusion.toy_pipeline", shapes={"tokens": [1, T * h * w // 4]},
                    dtype="float32")
    rec.set_backend("vae_decode", "eager", reason="inferbook.diffusion.vae Ops('eager'); the VAE chapter compares backends",
                    shapes={"latent": [1, 16, T, h, w]}, dtype="float32")
    rec.set_backend("save", "PyAV libx264 + aac", shapes={"frames": [p["frames"], p["height"], p["width"], 3]})
    rec.add("load", stage_seconds(cold)["load"], "s", phase="load", note="building the served model (first run)")
    rec.add("cold_total", cold.seconds, "s", phase="cold_start", note="first run: load + all stages")
    timer = "perf_counter around the node" + (" + cuda sync" if ctx.device.type == "cuda" else "")
    per_stage = {s: [stage_seconds(r)[s] for r in warm] for s in STAGES}
    totals = [sum(stage_seconds(r)[s] for s in STAGES) for r in warm]
    walls = [r.seconds for r in warm]
    for s in STAGES:
        rec.add(s, statistics.median(per_stage[s]), "s", phase=s, n=len(warm), min_s=min(per_stage[s]),
                max_s=max(per_stage[s]), timer=timer)
    rec.add("stages_total", statistics.median(totals), "s", phase="total", n=len(warm), min_s=min(totals),
            max_s=max(totals), note="denoise + VAE + audio + save; the model is rebuilt each run and timed as load, not here")
    rec.add("workflow_wall", statistics.median(walls), "s", phase="total", n=len(warm), min_s=min(walls),
            max_s=max(walls), note="Executor.run, model load included")
    want = expected_media(p["width"], p["height"], p["frames"])
    bad = media_mismatches(probe, want)
    rec.add_check("saved MP4 matches the request", not bad, error=float(len(bad)), tolerance=0.0, mismatches=str(bad))
    dur = probe["duration"] or 0.0
    rec.add_check("duration covers the frames", dur >= p["frames"] / FPS - 1e-3, error=dur, tolerance=p["frames"] / FPS)
    return rec, {"probe": probe, "cold": cold, "warm": warm, "path": cold.output("save")}


def _reference_counts(result) -> dict:
    lat = result.output("denoise")
    return dict(lat.get("references") or {})


def measure(ctx, *, model, width, height, frames, steps, repeats) -> list[RunRecord]:
    """Both workflows, stages timed apart, outputs probed. See the module docstring."""
    p = dict(model=model, width=width, height=height, frames=frames, steps=steps, repeats=repeats)
    nodes.latent_shape(width, height, frames)   # bad sizes fail here (UserError), before any work
    if steps < 1 or repeats < 1:
        raise UserError(f"steps and repeats must be >= 1, got steps={steps}, repeats={repeats}")
    records = []
    with tempfile.TemporaryDirectory(prefix="inferbook-omni-") as tmp:
        tmp = Path(tmp)
        write_reference_media(tmp / "inputs", width=max(width, 64), height=max(height, 48), seed=ctx.seed)
        for rec, _ in run_workflows_timed(ctx, p, tmp / "outputs", tmp / "inputs").values():
            records.append(rec)
    return records


def seed_record() -> RunRecord:
    """The seed's reported run of vLLM-Omni #7423, as a quoted record (not measured here).

    From the seed: vLLM 0.29.0, two H20-3e, TP2, TORCH_SDPA; 1344x768, 24 FPS, 124 frames, five
    sampling steps; 131.55 s from ComfyUI to the saved file; the file holds 32 kHz two-channel AAC."""
    return RunRecord(
        chapter="omni-h3-workflows", name="vllm-omni-7423", variant="t2va", source="quoted: vLLM-Omni #7423",
        hardware={"device_type": "cuda", "gpu_name": "2x NVIDIA H20-3e"}, device="cuda", preset="(theirs)",
        packages={"vllm": "0.29.0"},
        workload={"model": "MiniMax-H3", "frames": 124, "resolution": "1344x768", "steps": 5, "fps": 24,
                  "audio": "AAC 32 kHz, 2 channels", "batch": 1},
        topology={"tp": 2, "ranks": 2},
        backends={"attention": {"backend": "TORCH_SDPA", "reason": "as reported", "shapes": {}}},
        measurements=[{"name": "comfyui_to_saved", "value": 131.55, "unit": "s", "phase": "total",
                       "note": "whole request, ComfyUI to saved file; five steps, not the 50-step Base recipe"}],
        notes="Proves the path completes and yields decodable audio+video; did not evaluate full 50-step Base "
              "quality or subjective audio quality.")
