"""Which attention backend a rank can use depends on that rank's shapes, not on the config's name.

A tiny registry: each backend states its requirement on the *local* (per-rank) shapes, and
`select_backends(config, tp)` returns the first that accepts, with the reasons the others
refused and the local shapes that decided it. The seed's example: MiniMax M3 on MI355X, where
AITER's sparse-attention path needs exactly one KV head per rank (met at TP4) and TP2 falls back
to a Triton path. Our config is MiniMax-M3-*like*: its numbers are assumptions, stated as such.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from ..words import count


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_inter: int
    shared_experts: int
    note: str


# Assumed, not published in the seed: only "4 KV heads" matters for the argument (TP4 -> one KV
# head per rank). The other sizes are placeholders of plausible magnitude.
MINIMAX_M3_LIKE = ModelConfig(name="MiniMax-M3-like (assumed shapes)", hidden=6144, num_heads=64, num_kv_heads=4,
                              head_dim=128, num_experts=128, top_k=8, moe_inter=1536, shared_experts=1,
                              note="assumed: 4 KV heads (inferred from the seed: TP4 gives one KV head per "
                                   "rank); other sizes are placeholders")


def local_shapes(cfg: ModelConfig, tp: int, ep: int = 1) -> dict:
    """Per-rank shapes under tensor parallel `tp` (and expert parallel `ep`, 1 = experts replicated
    and their FFN split by TP). KV heads fewer than ranks are replicated: each rank holds one."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if cfg.num_heads % tp:
        raise ValueError(f"tp = {tp} must divide the {cfg.num_heads} query heads")
    if cfg.num_kv_heads >= tp:
        if cfg.num_kv_heads % tp:
            raise ValueError(f"tp = {tp} must divide the {cfg.num_kv_heads} KV heads (or be a multiple of them)")
        kv, replicas = cfg.num_kv_heads // tp, 1
    else:
        if tp % cfg.num_kv_heads:
            raise ValueError(f"tp = {tp} must be a multiple of the {cfg.num_kv_heads} KV heads when it exceeds them")
        kv, replicas = 1, tp // cfg.num_kv_heads
    if ep <= 0 or cfg.num_experts % ep:
        raise ValueError(f"ep = {ep} must be a positive divisor of the {cfg.num_experts} experts")
    return {"q_heads": cfg.num_heads // tp, "kv_heads": kv, "kv_replicas": replicas, "head_dim": cfg.head_dim,
            "gqa_group": (cfg.num_heads // tp) // kv, "experts": cfg.num_experts // ep,
            "moe_inter": cfg.moe_inter // tp if ep == 1 else cfg.moe_inter}


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    requirement: str
    accepts: Callable[[dict], bool]


REGISTRY = (
    AttentionBackend("aiter-sparse (AITER-like sparse attention)", "exactly one KV head per rank",
                     lambda s: s["kv_heads"] == 1),
    AttentionBackend("triton-fallback", "any shapes", lambda s: True),
)


def select_backends(cfg: ModelConfig, tp: int, ep: int = 1) -> dict:
    """The attention backend each rank takes under `tp`, why, and the local shapes it saw."""
    local = local_shapes(cfg, tp, ep)
    refused = []
    for b in REGISTRY:
        if b.accepts(local):
            reason = f"accepts {b.requirement}; this rank has {count(local['kv_heads'], 'KV head')}"
            return {"tp": tp, "ep": ep, "attention": b.name, "reason": reason, "refused": refused, "local": local,
                    "config": asdict(cfg)}
        refused.append(f"{b.name}: requires {b.requirement}, rank has {local['kv_heads']} KV heads")
    raise RuntimeError("no attention backend accepted the shapes")  # unreachable: the fallback accepts all


def selection_table(cfg: ModelConfig, tps=(1, 2, 4, 8)) -> list[dict]:
    rows = []
    for tp in tps:
        s = select_backends(cfg, tp)
        loc = s["local"]
        rows.append({"TP": tp, "q heads / rank": loc["q_heads"], "KV heads / rank": loc["kv_heads"],
                     "KV replicas": loc["kv_replicas"], "expert FFN / rank": loc["moe_inter"],
                     "attention backend": s["attention"], "why": s["reason"],
                     "refused": "; ".join(s["refused"]) or "-"})
    return rows
