"""The book's table of contents: six parts, sixteen chapters, and the module that measures each.

A chapter is *built* when `chapters/<slug>.md` exists and its measure module imports.
Each measure module declares `PARAMETERS`, `PRESETS` and `measure(ctx, **params)`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .errors import UserError, choices


@dataclass(frozen=True)
class ChapterInfo:
    slug: str
    part: str
    title: str
    seed_section: str
    module: str = ""  # dotted path of the measure module; default inferbook.chapters.<slug with _>

    def __post_init__(self):
        if not self.module:
            object.__setattr__(self, "module", "inferbook.chapters." + self.slug.replace("-", "_"))


PARTS = {
    "h3": "MiniMax-H3: video and audio generation",
    "kimi": "Kimi K3: serving and speculative decoding",
    "moe": "MoE kernels: W4A16 and shared experts",
    "systems": "KV tiers, communication and determinism",
    "numerics": "Low-precision recipes and correctness harnesses",
    "upgrade": "Pre-releases and the upgrade record",
}

CHAPTERS: dict[str, ChapterInfo] = {c.slug: c for c in [
    ChapterInfo("h3-vae-fusion", "h3", "Fused video-VAE decode and its fallbacks", "一"),
    ChapterInfo("h3-tiled-decode", "h3", "Tiled decode batched by free memory", "一"),
    ChapterInfo("comfy-generic-loops", "h3", "Generic loops in a workflow executor", "一"),
    ChapterInfo("omni-h3-workflows", "h3", "H3 workflows, references and checked media", "一"),
    ChapterInfo("kimi-spec-budget", "kimi", "Speculative token budgets in the scheduler", "二"),
    ChapterInfo("kimi-dspark-acceptance", "kimi", "Draft acceptance depends on the task", "二"),
    ChapterInfo("kimi-topk-tail-fusion", "kimi", "Folding the top-k combine into the down projection", "二"),
    ChapterInfo("chord-w4a16", "moe", "W4A16 MoE kernels and their layouts", "三"),
    ChapterInfo("minimax-m3-moe", "moe", "Shared-expert fusion and per-rank backends", "四"),
    ChapterInfo("tiered-kv-offload", "systems", "Host-centred KV tiers", "五"),
    ChapterInfo("sglang-fused-comm", "systems", "A fused MoE tail with fixed rounding points", "六"),
    ChapterInfo("deterministic-attention", "systems", "Batch-invariant decode attention", "六"),
    ChapterInfo("te-mxfp8-recipes", "numerics", "Microscaling recipes per direction", "七"),
    ChapterInfo("gdn-backward-check", "numerics", "A NaN harness for Gated DeltaNet backward", "七"),
    ChapterInfo("attention-test-matrix", "upgrade", "The acceptance matrix a FlashAttention pre-release must pass", "八"),
    ChapterInfo("upgrade-record", "upgrade", "The record to keep before upgrading", "升级前留一份什么样的记录"),
]}


def get_chapter(slug: str) -> ChapterInfo:
    if not isinstance(slug, str) or slug not in CHAPTERS:
        raise UserError(f"unknown chapter {slug!r}; chapters are {choices(CHAPTERS)}")
    return CHAPTERS[slug]


def load_module(info: ChapterInfo) -> ModuleType:
    """Import a chapter's measure module; a planned-but-unbuilt chapter is a clear error."""
    try:
        return importlib.import_module(info.module)
    except ModuleNotFoundError as e:
        if e.name and (info.module == e.name or info.module.startswith(e.name + ".")):
            raise UserError(f"chapter {info.slug!r} is planned but not built yet (no module {info.module})") from None
        raise
