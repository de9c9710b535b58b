"""Rules a reference-to-video+audio request must satisfy, and the service mapping a workflow names.

vLLM-Omni #7483 (merged 2026-09-16) added `references` and a Ref2VA workflow for MiniMax-H3. The
workflow's notes (`example_workflows/vLLM-Omni MiniMax-H3 Reference to Video.json`) state the rules,
and `validate_references` checks every one of them by name and reports every broken rule in one error:

    images            at most 9 image references
    videos            at most 3 video references
    audios            at most 3 audio references
    total             at most 12 references in total
    image or video    at least one image or video reference
    clip length       each reference video or audio clip lasts 2-15 s
    video total       the reference videos last at most 15 s together
    audio total       the standalone audio references last at most 15 s together (a video's own
                      soundtrack travels with it and does not count)
    frame count       the request's frame count is 17k + 5, one of 107, 124, ..., 345 (24 FPS)
    resolution        width x height is a preset: 1344x768 (16:9), 1024x768 (4:3), 768x768 (1:1),
                      768x1024 (3:4), 768x1344 (9:16)
    prompt tags       every <Picture N>, <Video N>, <Audio N> in the prompt names a connected
                      reference (slots are numbered per kind from 1)

The same seed item warns that a workflow graph that imports has only passed front-end checks:
the remote endpoint, the model name and the server-side LoRA path must each match what the server
actually serves. `check_service_mapping` lists every mismatch in a workflow against a served-model
table before anything is sent.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..errors import UserError, choices
from .executor import _where, as_graph, is_link
from ..words import count

KINDS = ("image", "video", "audio")
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_TOTAL = 9, 3, 3, 12
CLIP_SECONDS = (2.0, 15.0)          # each reference video / audio clip
MAX_VIDEO_SECONDS = 15.0            # all reference videos together
MAX_AUDIO_SECONDS = 15.0            # all standalone audio references together
FRAME_COUNTS = tuple(17 * k + 5 for k in range(6, 21))        # 107, 124, ..., 345
RESOLUTIONS = {(1344, 768): "16:9", (1024, 768): "4:3", (768, 768): "1:1", (768, 1024): "3:4", (768, 1344): "9:16"}
TAG = re.compile(r"<(Picture|Video|Audio)\s+(\d+)>")
TAG_KIND = {"Picture": "image", "Video": "video", "Audio": "audio"}
RULES = ("images", "videos", "audios", "total", "image or video", "clip length", "video total", "audio total",
         "frame count", "resolution", "prompt tags")


class ReferenceRuleError(UserError):
    """A request that breaks one or more of the Ref2VA rules (all of them listed, each by name)."""

    def __init__(self, violations: list[str], counts: dict):
        self.violations, self.counts = list(violations), dict(counts)
        self.rules = [v.split(":", 1)[0] for v in self.violations]
        super().__init__("references break " + ("a rule" if len(violations) == 1 else f"{len(violations)} rules") +
                         ": " + "; ".join(violations))


def _count(x: int | Sequence | None, name: str) -> int:
    if x is None:
        return 0
    if isinstance(x, bool):
        raise UserError(f"{name} must be a count or a sequence of references, got {x!r}")
    if isinstance(x, int):
        if x < 0:
            raise UserError(f"{name} count must be >= 0, got {x}")
        return x
    try:
        return len(x)
    except TypeError:
        raise UserError(f"{name} must be a count or a sequence of references, got {type(x).__name__}") from None


def _seconds(values: Sequence | None, name: str) -> list[float]:
    out = []
    for i, v in enumerate(values or ()):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UserError(f"{name} {i + 1} must last a finite number of seconds >= 0, got {v!r}")
        out.append(float(v))
    return out


def validate_references(images: int | Sequence = (), videos: int | Sequence = (), audios: int | Sequence = (), *,
                        video_seconds: Sequence[float] | None = None, audio_seconds: Sequence[float] | None = None,
                        prompt: str | None = None, frames: int | None = None, width: int | None = None,
                        height: int | None = None) -> dict:
    """Check the Ref2VA rules (see the module docstring). `images`, `videos`, `audios` are counts or
    sequences of references; `video_seconds` / `audio_seconds` the length of each video / standalone
    audio reference; `prompt`, `frames`, `width`, `height` the request's. A rule whose input is not
    given is not checked.

    Returns the counts {"images", "videos", "audios", "total"}; raises `ReferenceRuleError`
    naming every broken rule ("rule: detail") and the numbers that break it."""
    n_img, n_vid, n_aud = _count(images, "images"), _count(videos, "videos"), _count(audios, "audios")
    counts = {"images": n_img, "videos": n_vid, "audios": n_aud, "total": n_img + n_vid + n_aud}
    vsec, asec = _seconds(video_seconds, "video"), _seconds(audio_seconds, "audio")
    bad = []
    if n_img > MAX_IMAGES:
        bad.append(f"images: at most {MAX_IMAGES} images (got {n_img})")
    if n_vid > MAX_VIDEOS:
        bad.append(f"videos: at most {MAX_VIDEOS} videos (got {n_vid})")
    if n_aud > MAX_AUDIOS:
        bad.append(f"audios: at most {MAX_AUDIOS} audios (got {n_aud})")
    if counts["total"] > MAX_TOTAL:
        bad.append(f"total: at most {MAX_TOTAL} references in total (got {counts['total']}: {n_img} images + "
                   f"{n_vid} videos + {n_aud} audios)")
    if n_img + n_vid == 0:
        bad.append(f"image or video: at least one image or video (got 0 images, 0 videos"
                   f"{f', {n_aud} audios' if n_aud else ''})")
    lo, hi = CLIP_SECONDS
    short = [f"{kind} {i + 1} lasts {significant_s(t)}" for kind, ts in (("video", vsec), ("audio", asec))
             for i, t in enumerate(ts) if not lo <= t <= hi]
    if short:
        bad.append(f"clip length: each reference video or audio clip lasts {lo:g}-{hi:g} s ({', '.join(short)})")
    if sum(vsec) > MAX_VIDEO_SECONDS:
        bad.append(f"video total: reference videos last at most {MAX_VIDEO_SECONDS:g} s together (got "
                   f"{' + '.join(significant_s(t) for t in vsec)} = {significant_s(sum(vsec))})")
    if sum(asec) > MAX_AUDIO_SECONDS:
        bad.append(f"audio total: standalone audio references last at most {MAX_AUDIO_SECONDS:g} s together (got "
                   f"{' + '.join(significant_s(t) for t in asec)} = {significant_s(sum(asec))})")
    if frames is not None and frames not in FRAME_COUNTS:
        bad.append(f"frame count: 17k + 5 frames, one of {FRAME_COUNTS[0]}, {FRAME_COUNTS[1]}, ..., "
                   f"{FRAME_COUNTS[-1]} (got {frames!r})")
    if (width is not None or height is not None) and (width, height) not in RESOLUTIONS:
        presets = ", ".join(f"{w}x{h} ({r})" for (w, h), r in RESOLUTIONS.items())
        bad.append(f"resolution: one of the presets {presets} (got {width}x{height})")
    if prompt is not None:
        have = {"image": n_img, "video": n_vid, "audio": n_aud}
        dangling = []
        for m in TAG.finditer(prompt):
            kind, k = TAG_KIND[m.group(1)], int(m.group(2))
            if not 1 <= k <= have[kind]:
                dangling.append(f"{m.group(0)} with {count(have[kind], kind + ' reference')} connected")
        if dangling:
            bad.append(f"prompt tags: every tag names a connected reference ({'; '.join(dict.fromkeys(dangling))})")
    if bad:
        raise ReferenceRuleError(bad, counts)
    return counts


def significant_s(t: float) -> str:
    from ..measure import significant

    return f"{significant(t)} s"


def group_references(refs: Iterable[tuple]) -> dict[str, list]:
    """[(kind, media) or (kind, media, seconds), ...] -> {"image": [...], "video": [...], "audio": [...],
    "video_seconds": [...], "audio_seconds": [...]} (a reference without seconds has none listed);
    an unknown kind is an error."""
    out: dict[str, list] = {k: [] for k in KINDS}
    out["video_seconds"], out["audio_seconds"] = [], []
    for i, item in enumerate(refs):
        if not (isinstance(item, (tuple, list)) and len(item) in (2, 3)):
            raise UserError(f"reference {i} must be a (kind, media) pair or a (kind, media, seconds) triple, got "
                            f"{type(item).__name__}")
        kind, media = item[0], item[1]
        if kind not in KINDS:
            raise UserError(f"reference {i} has unknown kind {kind!r}; kinds are {choices(KINDS)}")
        out[kind].append(media)
        if len(item) == 3 and kind in ("video", "audio"):
            out[f"{kind}_seconds"].append(item[2])
    return out


# ---------------------------------------------------------------------------
# Service mapping


@dataclass(frozen=True)
class Served:
    """One row of the served-model table: what an endpoint really serves."""

    endpoint: str
    model: str
    loras: tuple[str, ...] = ()


class ServiceMappingError(UserError):
    def __init__(self, mismatches: list[str]):
        self.mismatches = list(mismatches)
        super().__init__(f"{len(mismatches)} service mapping mismatch(es): " + "; ".join(mismatches))


# Inputs that name something on a server. A node naming any of them is checked.
# vLLM-Omni's Generate Video names the endpoint `url`; `endpoint` is accepted too. A LoRA is either a
# literal `lora_path` or a `lora` link to a Remote LoRA node, whose `local_path` is the server-side path.
ENDPOINT_INPUTS, MODEL_INPUT, LORA_INPUT, LORA_LINK = ("url", "endpoint"), "model", "lora_path", "lora"


def _literal(graph, value):
    """A literal, or the literal of a String node a link points to; None when not knowable."""

    if not is_link(value):
        return value
    src = graph.get(value[0])
    if src is not None and src.class_type == "String" and not is_link(src.inputs.get("value")):
        return src.inputs.get("value")
    return None


def check_service_mapping(workflow, served: Iterable[Served | dict], *, raise_on_mismatch: bool = False) -> list[str]:
    """Every remote endpoint, model name and server-side LoRA path named by `workflow` must match
    the served-model table. Returns the list of mismatches (empty: all match); with
    `raise_on_mismatch`, raises `ServiceMappingError` listing them all."""

    graph = as_graph(workflow)
    table = [s if isinstance(s, Served) else Served(s["endpoint"], s["model"], tuple(s.get("loras", ())))
             for s in served]
    by_endpoint: dict[str, dict[str, Served]] = {}
    for s in table:
        by_endpoint.setdefault(s.endpoint, {})[s.model] = s
    out = []

    for nid, spec in graph.items():
        ep_input = next((k for k in ENDPOINT_INPUTS if k in spec.inputs), None)
        if ep_input is None:
            continue
        where = _where(nid, spec.class_type)
        ep = _literal(graph, spec.inputs[ep_input])
        model = _literal(graph, spec.inputs.get(MODEL_INPUT))
        lora = _literal(graph, spec.inputs.get(LORA_INPUT, ""))
        link = spec.inputs.get(LORA_LINK)
        if is_link(link) and link[0] in graph:
            lora = _literal(graph, graph[link[0]].inputs.get("local_path", "")) or lora
        if ep is None or (MODEL_INPUT in spec.inputs and model is None):
            out.append(f"{where}: endpoint or model comes from a computed link and cannot be checked before running")
            continue
        if ep not in by_endpoint:
            out.append(f"{where}: endpoint {ep!r} is not in the served table (served endpoints: "
                       f"{choices(sorted(by_endpoint)) or 'none'})")
            continue
        models = by_endpoint[ep]
        if model not in models:
            out.append(f"{where}: model {model!r} is not served at {ep!r} (served there: {choices(sorted(models))})")
            continue
        if lora and lora not in models[model].loras:
            out.append(f"{where}: LoRA {lora!r} is not on the server for {model!r} at {ep!r} (server-side LoRAs: "
                       f"{choices(models[model].loras) or 'none'})")
    if out and raise_on_mismatch:
        raise ServiceMappingError(out)
    return out
