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
    module: str  # dotted path of the measure module


PARTS = {
    "h3": "MiniMax-H3: video and audio generation",
    "kimi": "Kimi K3: serving and speculative decoding",
    "moe": "MoE kernels: W4A16 and shared experts",
    "systems": "KV tiers, communication and determinism",
    "numerics": "Low-precision recipes and correctness harnesses",
    "upgrade": "Pre-releases and the upgrade record",
}

CHAPTERS: dict[str, ChapterInfo] = {c.slug: c for c in [
    ChapterInfo("h3-vae-fusion", "h3", "Fused video-VAE decode and its fallbacks", "一", "inferbook.diffusion.vae_fusion"),
    ChapterInfo("h3-tiled-decode", "h3", "Tiled decode batched by free memory", "一", "inferbook.diffusion.tiled_decode"),
    ChapterInfo("comfy-generic-loops", "h3", "Generic loops in a workflow executor", "一", "inferbook.workflow.loops_chapter"),
    ChapterInfo("omni-h3-workflows", "h3", "H3 workflows, references and checked media", "一", "inferbook.workflow.omni_chapter"),
    ChapterInfo("kimi-spec-budget", "kimi", "Speculative token budgets in the scheduler", "二", "inferbook.serving.spec_budget"),
    ChapterInfo("kimi-dspark-acceptance", "kimi", "Draft acceptance depends on the task", "二", "inferbook.serving.dspark_acceptance"),
    ChapterInfo("kimi-topk-tail-fusion", "kimi", "Folding the top-k combine into the down projection", "二", "inferbook.moe.topk_tail"),
    ChapterInfo("chord-w4a16", "moe", "W4A16 MoE kernels and their layouts", "三", "inferbook.moe.chord_chapter"),
    ChapterInfo("minimax-m3-moe", "moe", "Shared-expert fusion and per-rank backends", "四", "inferbook.moe.m3_chapter"),
    ChapterInfo("tiered-kv-offload", "systems", "Host-centred KV tiers", "五", "inferbook.serving.kv_tiers_chapter"),
    ChapterInfo("sglang-fused-comm", "systems", "A fused MoE tail with fixed rounding points", "六", "inferbook.comm.fused_comm_chapter"),
    ChapterInfo("deterministic-attention", "systems", "Batch-invariant decode attention", "六", "inferbook.attention.deterministic_chapter"),
    ChapterInfo("te-mxfp8-recipes", "numerics", "Microscaling recipes per direction", "七", "inferbook.numerics.mx_chapter"),
    ChapterInfo("gdn-backward-check", "numerics", "A NaN harness for Gated DeltaNet backward", "七", "inferbook.numerics.gdn_chapter"),
    ChapterInfo("attention-test-matrix", "upgrade", "The acceptance matrix a FlashAttention pre-release must pass", "八", "inferbook.attention.matrix_chapter"),
    ChapterInfo("upgrade-record", "upgrade", "The record to keep before upgrading", "升级前留一份什么样的记录", "inferbook.serving.upgrade_record"),
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
