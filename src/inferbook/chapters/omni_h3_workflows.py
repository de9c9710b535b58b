"""Chapter `omni-h3-workflows`: text->video+audio and reference->video+audio workflows, checked media.

vLLM-Omni #7423 added an H3 text-to-video/audio workflow JSON; #7483 added `references` and a
Ref2VA workflow. Ours (`data/workflows/h3_t2va.json`, `h3_ref2va.json`) have the real workflows'
shape — loaders, Video References, Remote LoRA, one Generate Video request, Save Video — and run on
the loop chapter's executor against a toy in-process server (`workflow.omni_server`: random-weight
DiT and video VAE from `inferbook.diffusion`). In the real workflows the server owns text encoding,
denoising and both VAEs; so does ours. The seed's advice is followed literally: save a short
fixed-seed sample, check its audio track and frame count, then scale up references and duration.

Records (one per workflow): the stages a ComfyUI client sees — loading the references, the Generate
Video request's round trip, the save — timed per node, cold and warm (all warm samples kept); and the
server's own stages (load, text encoding, denoising, video VAE, audio decoder), which a client cannot
see and our in-process server reports, labelled as server-side. A check decodes the saved MP4 whole
(`diffusion.media.check_media`: frames, fps, size, H.264, a non-silent 32 kHz stereo AAC track whose
duration matches the video's). The seed's own run is `seed_record()`: a quoted record, never saved
among ours.
"""
from __future__ import annotations

import json
import tempfile
import wave
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..measure import Timing
from ..presets import Param
from ..record import RunRecord
from ..workflow import nodes, omni_server, segments
from ..workflow.executor import Executor
from ..workflow.references import check_service_mapping

# Optional packages this chapter cannot run without (`setup` says so in one line when missing).
REQUIRES = {"av": "PyAV: the workflows write, read and probe MP4 video and audio"}

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('t2va', 'request', 'Time of one text-to-video+audio request')

PARAMETERS = {
    "model": Param(str, help="toy served model (size)", choices=("toy-h3-tiny", "toy-h3-small", "toy-h3-base")),
    "width": Param(int, help="video width: one of the served model's five presets"),
    "height": Param(int, help="video height: one of the served model's five presets"),
    "duration": Param(float, help="seconds (Generate Video's input; frames = round(duration x 24), then rounded "
                                  "up to 17k + 5 by the server)"),
    "recipe": Param(str, help="which presets Generate Video links: Base (50 steps, flow shift 12) or Turbo "
                              "(5 steps, flow shift 6, the Turbo LoRA); the seed's run was Turbo",
                    choices=("base", "turbo")),
    "repeats": Param(int, help="warm runs per workflow (>= 2; all samples kept)"),
}

PRESETS = {
    "smoke": dict(model="toy-h3-tiny", width=96, height=96, duration=0.208, recipe="turbo", repeats=2),
    "cpu": dict(model="toy-h3-small", width=128, height=96, duration=0.917, recipe="turbo", repeats=5),
    "gpu": dict(model="toy-h3-base", width=512, height=384, duration=1.625, recipe="turbo", repeats=5),
}
RECIPES = {"base": ("base_sampling", "base_h3", False), "turbo": ("turbo_sampling", "turbo_h3", True)}

FPS, SAMPLE_RATE, CHANNELS = 24, 32000, 2
SAMPLE_DURATION = 0.208   # 5 frames at 24 FPS: the short fixed-seed sample checked before scaling up (the seed's advice)
# What a ComfyUI client can time: its own nodes. The Generate Video node's time is the request's round trip.
CLIENT_STAGE_OF = {"LoadImage": "references", "LoadVideo": "references", "LoadAudio": "references",
                   "OmniVideoReferences": "references", "OmniRemoteLoRA": "references",
                   "OmniGenerateVideo": "request", "SaveVideo": "save"}
CLIENT_STAGES = ("references", "request", "save")
# What only the server sees (reported by our in-process server; a real client gets none of these).
SERVER_STAGES = omni_server.SERVER_STAGES
WORKFLOWS = {"t2va": "h3_t2va.json", "ref2va": "h3_ref2va.json"}
REFERENCE_VIDEO_FRAMES = 50     # 2.08 s at 24 FPS: reference clips must last 2-15 s
REFERENCE_AUDIO_SECONDS = 3.0


def workflow_path(name: str) -> Path:
    from ..context import repo_root

    return repo_root() / "data" / "workflows" / name


def h3_workflow(kind: str, *, model: str, width: int, height: int, duration: float, recipe: str = "turbo",
                seed: int = 1101) -> dict:
    """The workflow file with the request written into its inputs (as an API client would), and Generate
    Video's sampling / H3-params / LoRA inputs linked to the recipe's nodes (as the template's note says:
    Turbo replaces the two Base links and connects the LoRA)."""
    wf = json.loads(workflow_path(WORKFLOWS[kind]).read_text())
    sampling, params, lora = RECIPES[recipe]
    gen = wf["generate"]["inputs"]
    gen.update(model=model, width=width, height=height, duration=duration, fps=FPS,
               sampling_params=[sampling, 0], model_params=[params, 0])
    if lora:
        gen["lora"] = ["lora", 0]
    else:
        gen.pop("lora", None)
    wf[sampling]["inputs"]["seed"] = seed
    wf["save"]["inputs"]["fps"] = FPS
    return wf


def served_frames(model: str, duration: float) -> int:
    """The frames the server returns for a request of `duration` s at FPS: the client's conversion, then the
    server's rounding up to 17k + 5."""
    return omni_server.contract_for(model).served_frames(nodes.frames_for(duration, FPS))


def recipe_steps(recipe: str) -> int:
    wf = json.loads(workflow_path(WORKFLOWS["t2va"]).read_text())
    return wf[RECIPES[recipe][0]]["inputs"]["num_inference_steps"]


def check_params(P: dict) -> None:
    """The served model's presets and frame lattice, the repeats, and the executor's work cap, before any work
    (`setup`, `measure` and `budgets` call this)."""
    from ..workflow.executor import MAX_NODE_WORK

    if not 0.1 <= P["duration"] <= 60:
        raise UserError(f"duration must be in [0.1, 60] s, got {P['duration']}")
    contract = omni_server.contract_for(P["model"])
    try:
        contract.aspect_ratio(P["width"], P["height"])
        frames = served_frames(P["model"], P["duration"])
    except ValueError as e:
        raise UserError(str(e)) from None
    if not 2 <= P["repeats"] <= 1000:
        raise UserError(f"repeats must be in [2, 1000], got {P['repeats']}")
    work = frames * recipe_steps(P["recipe"])
    if work > MAX_NODE_WORK:
        raise UserError(f"{frames} frames x {recipe_steps(P['recipe'])} steps = {work} is over the executor's "
                        f"per-node cap {MAX_NODE_WORK}")


def write_wav(path: Path, audio: np.ndarray, rate: int) -> Path:
    """float32 [C, N] in [-1, 1] -> 16-bit PCM WAV (the format the real workflow's audio loader reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (np.clip(audio, -1, 1).T * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(audio.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def write_reference_media(folder: Path, *, width: int, height: int, seed: int) -> dict[str, Path]:
    """The files the Ref2VA workflow names: references/boat.png, references/harbour.mp4 (2.08 s, with
    its own soundtrack) and references/gulls.wav (3 s of standalone audio)."""
    from ..diffusion import media

    ref = Path(folder) / "references"
    img = segments.scene(width, height, "a paper boat", seed)
    png = nodes.write_png(ref / "boat.png", nodes.to_uint8(img)[0])
    clip, audio = segments.generate_segment(segments.scene(width, height, "a harbour", seed + 1), "a harbour",
                                            REFERENCE_VIDEO_FRAMES, seed, 0, steps=2, fps=FPS, sample_rate=SAMPLE_RATE)
    mp4 = media.write_mp4(ref / "harbour.mp4", nodes.to_uint8(clip), FPS,
                          audio["waveform"].numpy().astype(np.float32), SAMPLE_RATE)
    t = np.arange(int(REFERENCE_AUDIO_SECONDS * SAMPLE_RATE)) / SAMPLE_RATE
    gulls = 0.2 * np.sin(2 * np.pi * (900 + 300 * np.sin(2 * np.pi * 0.7 * t)) * t)
    wav = write_wav(ref / "gulls.wav", np.stack([gulls, 0.7 * gulls]).astype(np.float32), SAMPLE_RATE)
    return {"image": png, "video": mp4, "audio": wav}


def expected_media(width: int, height: int, frames: int) -> dict:
    """What `check_media` must find in a saved file for this request."""
    return dict(frames=frames, fps=FPS, width=width, height=height, sample_rate=SAMPLE_RATE, channels=CHANNELS)


def executor_for(ctx, out_dir: Path, in_dir: Path, *, cache: bool = False) -> Executor:
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.device.type == "cuda" else None
    return Executor(cache=cache, output_dir=out_dir, input_dir=in_dir, device=ctx.device, sync=sync)


def client_seconds(result) -> dict[str, float]:
    """Seconds per client-visible stage of one run (the executor's per-node timer)."""
    out = {s: 0.0 for s in CLIENT_STAGES}
    for r in result.log:
        stage = CLIENT_STAGE_OF.get(r.class_type)
        if stage:
            out[stage] += r.seconds
    return out


def server_seconds(result) -> dict[str, float]:
    """Seconds per server stage of one run, as the in-process server reported them."""
    ev = next(e for e in result.events if e["kind"] == "server_stages")
    return {s: float(ev["seconds"].get(s, 0.0)) for s in ("load",) + SERVER_STAGES}


def run_workflows_timed(ctx, p: dict, out_dir: Path, in_dir: Path) -> dict[str, tuple[RunRecord, dict]]:
    """Both workflows: one cold run each, then `repeats` warm runs each, the two workflows
    alternating so that drift in the machine's load hits both alike. The executor's cache is
    off, so every node runs every time. Returns {kind: (record, details)}."""
    wfs = {kind: h3_workflow(kind, model=p["model"], width=p["width"], height=p["height"], duration=p["duration"],
                             recipe=p["recipe"], seed=1101 + ctx.seed) for kind in WORKFLOWS}
    for kind, wf in wfs.items():
        mismatches = check_service_mapping(wf, omni_server.TOY_SERVED)
        if mismatches:
            raise ValueError(f"{kind}: " + "; ".join(mismatches))
    runs = {kind: [] for kind in wfs}
    out: dict[str, tuple[RunRecord, dict]] = {}
    omni_server.restart(ctx.device, torch.float32)   # so the first request pays the server's model load
    # each record is made (and so saved, `Context.new_record`) once its cold run is done, and its warm
    # timings are added as its last warm run completes: a run stopped in the repeats keeps the cold numbers
    for i in range(1 + p["repeats"]):
        for kind, wf in wfs.items():
            runs[kind].append(executor_for(ctx, out_dir / kind, in_dir).run(wf))
            if i == 0:
                out[kind] = _cold_record(ctx, kind, wf, runs[kind][0], p)
            if i == p["repeats"]:
                _add_warm(ctx, out[kind][0], runs[kind][1:])
                out[kind][1]["warm"] = runs[kind][1:]
    return out


def _cold_record(ctx, kind: str, wf: dict, cold, p: dict) -> tuple[RunRecord, dict]:
    """The workflow's record from its first (cold) run: workload, backends, cold time, the saved file's check."""
    from ..diffusion.media import check_media

    frames = served_frames(p["model"], p["duration"])
    ev = next(e for e in cold.events if e["kind"] == "server_stages")
    info = check_media(cold.output("save"), **expected_media(p["width"], p["height"], frames))
    lora = (wf.get("lora") or {}).get("inputs", {}).get("local_path")
    rec = ctx.new_record(kind, variant=kind, workload={
        "model": f"{p['model']} (toy DiT + causal video VAE, random init)",
        "model_revision": "random init, seed 0" + (f" + LoRA {lora}" if lora else ""),
        "quantization": "none (fp32)", "frames": frames, "duration_s": p["duration"],
        "requested_frames": nodes.frames_for(p["duration"], FPS), "resolution": f"{p['width']}x{p['height']}",
        "aspect_ratio": ev["aspect_ratio"], "recipe": p["recipe"], "steps": ev["steps"], "flow_shift": ev["flow_shift"],
        "fps": FPS, "audio": f"AAC {SAMPLE_RATE // 1000} kHz, {CHANNELS} channels",
        "batch": 1, "references": _reference_counts(cold) if kind == "ref2va" else "none",
    }, topology={"ranks": 1, "tp": 1})
    B, T, h, w = omni_server.latent_shape(p["width"], p["height"], frames)
    rec.set_backend("dit_attention", "torch nn.TransformerEncoderLayer (SDPA inside)",
                    reason="toy DiT from inferbook.diffusion.toy_pipeline, on the server",
                    shapes={"tokens": [1, T * h * w // 4]}, dtype="float32")
    rec.set_backend("vae_decode", "eager", reason="inferbook.diffusion.vae Ops('eager'), on the server",
                    shapes={"latent": [1, 16, T, h, w]}, dtype="float32")
    rec.set_backend("save", "PyAV libx264 + aac", shapes={"frames": [frames, p["height"], p["width"], 3]})
    rec.add("cold_total", cold.seconds, "s", phase="cold_start", note="first run: the server builds its model")
    rec.add("server_load", server_seconds(cold)["load"], "s", phase="server: model load",
            note="server-side, first request only; a ComfyUI client cannot see it")
    rec.add_check("saved MP4 matches the request (decoded whole: frames, fps, size, non-silent 32 kHz stereo, "
                  "durations agree)", info["ok"], error=float(len(info["problems"])), tolerance=0.0,
                  problems="; ".join(info["problems"]), audio_duration_s=info["audio_duration"],
                  video_duration_s=info["video_duration"])
    return rec, {"probe": info, "cold": cold, "warm": [], "path": cold.output("save")}


def _add_warm(ctx, rec: RunRecord, warm: list) -> None:
    """The warm runs' client and server stage timings, wall times and the round-trip check, into `rec`."""
    timer = "perf_counter around the node" + (" + cuda sync" if ctx.device.type == "cuda" else "")
    for stage in CLIENT_STAGES:
        xs = [client_seconds(r)[stage] for r in warm]
        rec.add_timing(stage, Timing(stage, xs, "perf_counter", 0), phase=f"client: {stage}", note=timer,
                       visible_to="client")
    for stage in SERVER_STAGES:
        xs = [server_seconds(r)[stage] for r in warm]
        rec.add_timing(f"server_{stage}", Timing(stage, xs, "perf_counter", 0), phase=f"server: {stage}",
                       note="inside the request; only the server sees it (our server is in-process and reports it)",
                       visible_to="server only")
    walls = [r.seconds for r in warm]
    rec.add_timing("workflow_wall", Timing("workflow_wall", walls, "perf_counter", 0), phase="total",
                   note="Executor.run, warm")
    inside = [sum(server_seconds(r)[s] for s in ("load",) + SERVER_STAGES) for r in warm]
    request = [client_seconds(r)["request"] for r in warm]
    rec.add_check("the request's round trip covers the server's stages", all(a >= b for a, b in zip(request, inside)),
                  error=min(a - b for a, b in zip(request, inside)), tolerance=0.0)


def _reference_counts(result) -> dict:
    ev = next(e for e in result.events if e["kind"] == "server_stages")
    return dict(ev.get("references") or {})


def measure(ctx, *, model, width, height, duration, recipe, repeats) -> list[RunRecord]:
    """Both workflows, client stages and server stages timed apart, outputs decoded and checked."""
    p = dict(model=model, width=width, height=height, duration=duration, recipe=recipe, repeats=repeats)
    check_params(p)   # bad sizes fail here (UserError), before any work
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
