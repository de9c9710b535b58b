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


# The seed's sections: numeral -> (English heading, Chinese heading as the seed writes it).
SEED_SECTIONS = {
    "一": ("MiniMax-H3: the VAE starts cutting repeated work, and ComfyUI workflows fill in",
          "一、MiniMax-H3：VAE 开始减掉重复工作，ComfyUI 工作流继续补齐"),
    "二": ("Kimi K3: this week's two sets of results, serving optimisation and draft training",
          "二、Kimi K3：本周的两组结果，分别看服务优化与 draft 训练"),
    "三": ("Chord: W4A16 for Kimi K2.x has to match both the layout and the expert load",
          "三、Chord：Kimi K2.x 的 W4A16，要同时匹配布局和专家负载"),
    "四": ("MiniMax M3 / MI355X: the local shapes changed, and so does the best backend",
          "四、MiniMax M3 / MI355X：局部形状变了，最优后端也会变"),
    "五": ("Tiered KV offload: the GPU hands over to the host, and the host manages slow storage",
          "五、分层 KV offload：GPU 先交给主机，再由主机管理慢存储"),
    "六": ("SGLang: DeepSeek V4.1 communication primitives, and an AMD determinism fix",
          "六、SGLang：DeepSeek V4.1 通信基础件，以及 AMD 确定性修正"),
    "七": ("Transformer Engine 2.19: more low-precision paths; check the constraints before upgrading",
          "七、Transformer Engine 2.19：低精度路径更多，升级前先看约束"),
    "八": ("FlashAttention / FlashInfer: accept pre-releases path by path",
          "八、FlashAttention / FlashInfer：测试版要按具体路径验收"),
    "升级前留一份什么样的记录": ("What record to keep before upgrading", "升级前留一份什么样的记录"),
}

# The upstream changes each chapter's seed item cites (plain links; the book loads nothing from them).
_COMFY, _OMNI, _VLLM, _SGL = ("https://github.com/comfyanonymous/ComfyUI", "https://github.com/vllm-project/vllm-omni",
                              "https://github.com/vllm-project/vllm", "https://github.com/sgl-project/sglang")
UPSTREAM = {
    "h3-vae-fusion": [("ComfyUI #16187", f"{_COMFY}/pull/16187"), ("ComfyUI #16332", f"{_COMFY}/pull/16332"),
                      ("ComfyUI v0.36.0", f"{_COMFY}/releases/tag/v0.36.0")],
    "h3-tiled-decode": [("ComfyUI #16187", f"{_COMFY}/pull/16187"), ("ComfyUI v0.36.0", f"{_COMFY}/releases/tag/v0.36.0")],
    "comfy-generic-loops": [("ComfyUI #16227", f"{_COMFY}/pull/16227")],
    "omni-h3-workflows": [("vLLM-Omni #7423", f"{_OMNI}/pull/7423"), ("vLLM-Omni #7483", f"{_OMNI}/pull/7483")],
    "kimi-spec-budget": [("vLLM #51725", f"{_VLLM}/pull/51725")],
    "kimi-dspark-acceptance": [],
    "kimi-topk-tail-fusion": [("vLLM #53152", f"{_VLLM}/pull/53152")],
    "chord-w4a16": [],
    "minimax-m3-moe": [],
    "tiered-kv-offload": [],
    "sglang-fused-comm": [("SGLang #39653", f"{_SGL}/pull/39653")],
    "deterministic-attention": [("SGLang #37740", f"{_SGL}/pull/37740")],
    "te-mxfp8-recipes": [("Transformer Engine v2.19", "https://github.com/NVIDIA/TransformerEngine/releases/tag/v2.19"),
                         ("TE #3475", "https://github.com/NVIDIA/TransformerEngine/pull/3475"),
                         ("TE #2937", "https://github.com/NVIDIA/TransformerEngine/pull/2937")],
    "gdn-backward-check": [("Transformer Engine v2.19", "https://github.com/NVIDIA/TransformerEngine/releases/tag/v2.19")],
    "attention-test-matrix": [
        ("FlashAttention fa4-v4.0.0.beta31", "https://github.com/Dao-AILab/flash-attention/releases/tag/fa4-v4.0.0.beta31"),
        ("FlashInfer v0.7.0rc3", "https://github.com/flashinfer-ai/flashinfer/releases/tag/v0.7.0rc3")],
    "upgrade-record": [],
}

PARTS = {
    "h3": "MiniMax-H3: video and audio generation",
    "kimi": "Kimi K3: serving and speculative decoding",
    "moe": "MoE kernels: W4A16 and shared experts",
    "systems": "KV tiers, communication and determinism",
    "numerics": "Low-precision recipes and correctness harnesses",
    "upgrade": "Pre-releases and the upgrade record",
}

CHAPTERS: dict[str, ChapterInfo] = {c.slug: c for c in [
    ChapterInfo("h3-vae-fusion", "h3", "Fused H3 VAE paths and their fallbacks", "一"),
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
