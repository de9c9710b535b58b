"""Chapter `comfy-generic-loops`: a multi-segment clip built with StartLoop / EndLoop.

Two workflows from `data/workflows/` are run with the chapter's sizes patched in:

- `loop_segments.json`: the loop carries [clip so far, audio so far, prompt]; each segment
  sees only the clip's last frame;
- `loop_segments_continuous.json`: the same loop, but each segment sees the last two frames
  (so the pan can be continued) and the audio length so far (so the tone's phase can be).

Records:
- `continuity-last-frame`, `continuity-two-frames+audio`: frame change, motion-compensated
  residual, pan change and audio jumps inside segments vs at segment boundaries; checks that the
  saved MP4 holds the frames and audio asked for and that the per-iteration side effect ran once
  per iteration, in order;
- `cache-on`, `cache-off` (`cache_iterations` true / false): wall time and node counts of a cold
  run, `repeats` re-runs of the same workflow (all samples kept) and a run with one more segment.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..presets import Param
from ..record import RunRecord
from ..errors import UserError
from ..workflow import segments
from ..workflow import segments as segments_mod   # `segments` is also a parameter name in measure()
from ..workflow.executor import Executor

# Optional packages this chapter cannot run without (`setup` says so in one line when missing).
REQUIRES = {"av": "PyAV: the workflow's SaveVideo node writes and probes MP4 files"}

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('cache-on', 'wall_same', 'Wall time of a re-run with iteration caching on and nothing changed')

PARAMETERS = {
    "width": Param(int, help="frame width (multiple of 4)"),
    "height": Param(int, help="frame height (multiple of 4)"),
    "segments": Param(int, help="loop iterations (segments)"),
    "segment_frames": Param(int, help="frames per segment"),
    "steps": Param(int, help="toy denoiser passes per segment (where the generator's time goes)"),
    "repeats": Param(int, help="timed re-runs of the same workflow per cache setting (>= 2)"),
}

PRESETS = {
    "smoke": dict(width=32, height=24, segments=2, segment_frames=4, steps=2, repeats=2),
    "cpu": dict(width=96, height=64, segments=4, segment_frames=12, steps=24, repeats=5),
    # gpu: sized to the lent machine's minutes (`inferbook budgets --preset gpu`): each denoising step's
    # Python and eager calls bind it
    "gpu": dict(width=512, height=288, segments=4, segment_frames=24, steps=12, repeats=3),
}

FPS, SAMPLE_RATE = 24, 32000
WORKFLOWS = {"last-frame": "loop_segments.json", "two-frames+audio": "loop_segments_continuous.json"}


def workflow_path(name: str) -> Path:
    from ..context import repo_root

    return repo_root() / "data" / "workflows" / name


def loop_workflow(variant: str, *, width: int, height: int, segments: int, segment_frames: int, steps: int,
                  cache_iterations: bool = False, seed: int = 0) -> dict:
    """The variant's workflow (API-format dict) with the chapter's sizes written into its inputs."""
    wf = json.loads(workflow_path(WORKFLOWS[variant]).read_text())
    wf["scene"]["inputs"].update(width=width, height=height, seed=seed)
    wf["loop"]["inputs"].update(num_iterations=segments, cache_iterations=cache_iterations)
    wf["segment"]["inputs"].update(frames=segment_frames, steps=steps, seed=seed, fps=FPS, sample_rate=SAMPLE_RATE)
    wf["save"]["inputs"]["fps"] = FPS
    return wf


def executor_for(ctx, output_dir) -> Executor:
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.device.type == "cuda" else None
    return Executor(output_dir=output_dir, device=ctx.device, sync=sync)


def segment_samples(segment_frames: int) -> int:
    return int(round(segment_frames / FPS * SAMPLE_RATE))


def _workload(p: dict, n_segments: int) -> dict:
    return {"model": "toy segment generator (segments.py), no weights", "model_revision": "procedural",
            "quantization": "none (fp32)", "frames": 1 + n_segments * p["segment_frames"],
            "resolution": f"{p['width']}x{p['height']}", "steps": p["steps"], "segments": n_segments,
            "segment_frames": p["segment_frames"], "fps": FPS,
            "audio": f"AAC {SAMPLE_RATE // 1000} kHz stereo in the saved file; raw float32 for the measurements"}


def run_continuity(ctx, variant: str, p: dict, out_dir: Path) -> tuple[RunRecord, dict]:
    """Run one variant once and measure what crosses its segment boundaries."""
    from ..diffusion.media import check_media

    wf = loop_workflow(variant, **{k: p[k] for k in ("width", "height", "segments", "segment_frames", "steps")},
                       seed=ctx.seed)
    result = executor_for(ctx, out_dir).run(wf)
    clip, track = result.output("final_clip"), result.output("final_track")
    m = segments.continuity(clip, track["waveform"], first_segment_start=1, segment_frames=p["segment_frames"],
                            segment_samples=segment_samples(p["segment_frames"]))
    rec = ctx.new_record(f"continuity-{variant}", variant=variant, workload=_workload(p, p["segments"]),
                         topology={"ranks": 1})
    rec.set_backend("generator", f"torch eager on {ctx.device.type}", reason="toy generator, no kernel choice",
                    shapes={"frames": list(clip.shape)}, dtype="float32")
    for key in ("frame_change", "residual"):
        for where in ("inside", "boundary"):
            rec.add(f"{key}_{where}", m[f"{key}_{where}"], "mean |Δ| per pixel (0-1 scale)", phase=where)
    for where in ("inside", "boundary"):
        rec.add(f"pan_change_{where}", m[f"pan_change_{where}_px"], "px per frame (L1)", phase=where)
        rec.add(f"audio_jump_{where}", m[f"audio_jump_{where}_max"], "max |2nd difference|", phase=where)
    previews = [e for e in result.events if e["kind"] == "preview_image"]
    order_ok = [e["node"] for e in previews] == [f"preview#{i}" for i in range(p["segments"])]
    rec.add_check("side effect once per iteration, in order", order_ok and len(previews) == p["segments"],
                  error=float(len(previews)), tolerance=float(p["segments"]))
    info = check_media(result.output("save"), frames=1 + p["segments"] * p["segment_frames"], fps=FPS,
                       width=p["width"], height=p["height"], sample_rate=SAMPLE_RATE, channels=2)
    rec.add_check("saved MP4 holds the frames and a non-silent 32 kHz stereo track of the clip's length", info["ok"],
                  error=float(len(info["problems"])), tolerance=0.0, problems="; ".join(info["problems"]),
                  audio_duration_s=info["audio_duration"], video_duration_s=info["video_duration"])
    return rec, {"metrics": m, "probe": info, "result": result, "clip": clip}


def run_cache_experiment(ctx, p: dict, out_dir: Path) -> list[RunRecord]:
    """cache_iterations on and off, each in its own executor: one cold run, then `repeats` re-runs of
    the same workflow (the two settings alternating, so drift in the machine's load hits both alike),
    then one run with one more segment. The re-runs are the timed samples (`wall_same`, with every
    sample kept for `measure.compare_timings`); node counts are exact. Returns `cache-on`, `cache-off`."""
    from ..measure import Timing

    sizes = {k: p[k] for k in ("width", "height", "segment_frames", "steps")}
    n = p["segments"]
    wfs = {flag: loop_workflow("last-frame", segments=n, cache_iterations=flag, seed=ctx.seed, **sizes)
           for flag in (True, False)}
    grown = {flag: loop_workflow("last-frame", segments=n + 1, cache_iterations=flag, seed=ctx.seed, **sizes)
             for flag in (True, False)}
    executors = {flag: executor_for(ctx, out_dir) for flag in (True, False)}
    times: dict = {True: {"cold": [], "same": [], "plus_one": []}, False: {"cold": [], "same": [], "plus_one": []}}
    counts: dict = {True: {}, False: {}}

    def timed(flag, name, wf):
        t0 = time.perf_counter()
        r = executors[flag].run(wf)
        times[flag][name].append(time.perf_counter() - t0)
        counts[flag][name] = (len(r.ran) - len(r.side_effects), len(r.cached), len(r.side_effects))

    for flag in (True, False):
        timed(flag, "cold", wfs[flag])
    for _ in range(p["repeats"]):
        for flag in (True, False):
            timed(flag, "same", wfs[flag])
    for flag in (True, False):
        timed(flag, "plus_one", grown[flag])
    records = []
    phase = {"cold": "run 1: cold", "same": "run 2: same workflow", "plus_one": "run 3: one more segment"}
    timer = "perf_counter around Executor.run (includes the MP4 save)"
    for flag in (True, False):
        label = "on" if flag else "off"
        rec = ctx.new_record(f"cache-{label}", variant=f"cache_iterations={label}",
                             workload=_workload(p, p["segments"]), topology={"ranks": 1})
        rec.set_backend("generator", f"torch eager on {ctx.device.type}", reason="toy generator, no kernel choice",
                        shapes={"frame": [p["height"], p["width"], 3]}, dtype="float32")
        for name in ("cold", "same", "plus_one"):
            xs = times[flag][name]
            if len(xs) > 1:
                rec.add_timing(f"wall_{name}", Timing(f"wall_{name}", xs, "perf_counter", 0), phase=phase[name],
                               note=timer)
            else:
                rec.add(f"wall_{name}", xs[0], "s", phase=phase[name], n=1, note=timer)
            ran, cached, side = counts[flag][name]
            rec.add(f"nodes_ran_{name}", ran, "nodes", phase=phase[name])
            rec.add(f"nodes_cached_{name}", cached, "nodes", phase=phase[name])
            rec.add(f"side_effects_{name}", side, "nodes", phase=phase[name])
        records.append(rec)
    return records


LIMITS = {"segments": (1, 100), "segment_frames": (1, 1000), "steps": (1, 10_000), "repeats": (2, 1000)}


def check_params(P: dict) -> None:
    """Sizes, counts and the workflow's work (segments x frames x steps, the executor's per-workflow cap), before
    any work (`setup`, `measure` and `budgets` call this)."""
    from ..workflow.executor import MAX_NODE_WORK, MAX_WORKFLOW_WORK

    segments_mod.check_size(P["width"], P["height"])
    for name, (lo, hi) in LIMITS.items():
        if not lo <= P[name] <= hi:
            raise UserError(f"parameter {name!r} must be in [{lo}, {hi}], got {P[name]}")
    per_segment = P["segment_frames"] * P["steps"]
    if per_segment > MAX_NODE_WORK:
        raise UserError(f"segment_frames x steps = {per_segment} is over the executor's per-node cap {MAX_NODE_WORK}")
    if (P["segments"] + 1) * per_segment > MAX_WORKFLOW_WORK:
        raise UserError(f"(segments + 1) x segment_frames x steps = {(P['segments'] + 1) * per_segment} is over the "
                        f"executor's per-workflow cap {MAX_WORKFLOW_WORK}")


def measure(ctx, *, width, height, segments, segment_frames, steps, repeats) -> list[RunRecord]:
    """Continuity of both variants, then the cache experiment with cache_iterations on and off."""
    p = dict(width=width, height=height, segments=segments, segment_frames=segment_frames, steps=steps,
             repeats=repeats)
    check_params(p)            # bad sizes fail here, before any work
    records = []
    with tempfile.TemporaryDirectory(prefix="inferbook-loops-") as tmp:
        for variant in WORKFLOWS:
            rec, _ = run_continuity(ctx, variant, p, Path(tmp))
            records.append(rec)
        records += run_cache_experiment(ctx, p, Path(tmp))
    return records
