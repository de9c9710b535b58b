"""Rules a reference-to-video+audio request must satisfy, and the service mapping a workflow names.

vLLM-Omni #7483 (merged 2026-09-16) added `references` and a Ref2VA workflow for MiniMax-H3: at
most nine images, three videos and three audios, at most twelve in total, and at least one image
or video. `validate_references` states each rule once and reports every violated rule with the
counts, not only the first.

The same seed item warns that a workflow graph that imports has only passed front-end checks:
the remote endpoint, the model name and the server-side LoRA path must each match what the server
actually serves. `check_service_mapping` lists every mismatch in a workflow against a served-model
table before anything is sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..errors import UserError, choices

KINDS = ("image", "video", "audio")
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_TOTAL = 9, 3, 3, 12


class ReferenceRuleError(UserError):
    """A reference set that breaks one or more of the Ref2VA rules (all of them listed)."""

    def __init__(self, violations: list[str], counts: dict):
        self.violations, self.counts = list(violations), dict(counts)
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


def validate_references(images: int | Sequence = (), videos: int | Sequence = (), audios: int | Sequence = ()) -> dict:
    """Check the Ref2VA reference rules. Each argument is a sequence of references or a count.

    Returns the counts {"images", "videos", "audios", "total"}; raises `ReferenceRuleError`
    naming every violated rule and the counts that violate it."""
    n_img, n_vid, n_aud = _count(images, "images"), _count(videos, "videos"), _count(audios, "audios")
    counts = {"images": n_img, "videos": n_vid, "audios": n_aud, "total": n_img + n_vid + n_aud}
    bad = []
    if n_img > MAX_IMAGES:
        bad.append(f"at most {MAX_IMAGES} images (got {n_img})")
    if n_vid > MAX_VIDEOS:
        bad.append(f"at most {MAX_VIDEOS} videos (got {n_vid})")
    if n_aud > MAX_AUDIOS:
        bad.append(f"at most {MAX_AUDIOS} audios (got {n_aud})")
    if counts["total"] > MAX_TOTAL:
        bad.append(f"at most {MAX_TOTAL} references in total (got {counts['total']}: {n_img} images + {n_vid} videos "
                   f"+ {n_aud} audios)")
    if n_img + n_vid == 0:
        bad.append(f"at least one image or video (got 0 images, 0 videos{f', {n_aud} audios' if n_aud else ''})")
    if bad:
        raise ReferenceRuleError(bad, counts)
    return counts


def group_references(refs: Iterable[tuple[str, Any]]) -> dict[str, list]:
    """[(kind, media), ...] -> {"image": [...], "video": [...], "audio": [...]}; an unknown kind is an error."""
    out: dict[str, list] = {k: [] for k in KINDS}
    for i, item in enumerate(refs):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UserError(f"reference {i} must be a (kind, media) pair, got {type(item).__name__}")
        kind, media = item
        if kind not in KINDS:
            raise UserError(f"reference {i} has unknown kind {kind!r}; kinds are {choices(KINDS)}")
        out[kind].append(media)
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
ENDPOINT_INPUT, MODEL_INPUT, LORA_INPUT = "endpoint", "model", "lora_path"


def _literal(graph, value):
    """A literal, or the literal of a String node a link points to; None when not knowable."""
    from .executor import is_link

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
    from .executor import _where, as_graph

    graph = as_graph(workflow)
    table = [s if isinstance(s, Served) else Served(s["endpoint"], s["model"], tuple(s.get("loras", ())))
             for s in served]
    by_endpoint: dict[str, dict[str, Served]] = {}
    for s in table:
        by_endpoint.setdefault(s.endpoint, {})[s.model] = s
    out = []
    for nid, spec in graph.items():
        if ENDPOINT_INPUT not in spec.inputs:
            continue
        where = _where(nid, spec.class_type)
        ep = _literal(graph, spec.inputs[ENDPOINT_INPUT])
        model = _literal(graph, spec.inputs.get(MODEL_INPUT))
        lora = _literal(graph, spec.inputs.get(LORA_INPUT, ""))
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
