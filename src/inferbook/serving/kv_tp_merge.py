"""How TP ranks split a block's KV heads, and how the shards merge back into one row.

With tensor parallelism each rank holds the K/V of its own heads. The seed: "the fragments of
several TP ranks are gathered into one unified layout, so secondary storage sees fewer, larger
I/Os; nodes with a different TP configuration can use the same cached data through that host
representation." The TP engine (`tensor_parallel`) stores its blocks so: rank 0 gathers the
shards and merges them (`merge_shards`) into the TP-1 row; a restore hands each rank its slice
(`shard_of`).

Heads are split as vLLM splits them (`head_range`). When the KV heads divide by tp, rank r owns
heads [r*H/tp, (r+1)*H/tp). When tp is a multiple of H (more ranks than KV heads, e.g. GQA with
few KV heads, or MLA's single latent "head" that every rank holds whole), each head is
*replicated* on tp/H consecutive ranks: rank r holds head r // (tp/H). The merged row keeps each
head once (replicas are checked equal in bits and dropped), in the full-head layout, so any TP
size — replicating or not — can slice it. Other combinations (kv_heads % tp != 0 and
tp % kv_heads != 0) are refused, as vLLM refuses them.
"""
from __future__ import annotations

import torch

from ..errors import UserError


def head_range(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads [a, b) that rank `rank` of a TP-`tp` group holds: an even split when tp divides
    kv_heads, one replicated head (rank // (tp // kv_heads)) when kv_heads divides tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or (kv_heads % tp and tp % kv_heads):
        raise UserError(f"tp={tp!r} must divide kv_heads={kv_heads} or be a multiple of it "
                        "(more ranks than KV heads replicate them)")
    if not 0 <= rank < tp:
        raise UserError(f"rank={rank!r} must lie in 0..{tp - 1}")
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // kv_heads)
    return head, head + 1


def replicas(kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 when tp divides kv_heads)."""
    head_range(kv_heads, tp, 0)
    return 1 if kv_heads % tp == 0 else tp // kv_heads


def merge_shards(shards: list[torch.Tensor], kv_heads: int | None = None) -> torch.Tensor:
    """[..., heads of rank r, D] per rank (rank order) -> [..., kv_heads, D], each head once.

    kv_heads None: the shards partition the heads (concatenated). Otherwise the ranks' head
    ranges come from `head_range(kv_heads, len(shards), r)`; a replicated head is taken from its
    first rank, and every other replica must equal it in bits (else RuntimeError: the ranks'
    caches disagree, and no merged row is made)."""
    if kv_heads is None:
        return torch.cat(shards, dim=-2)
    tp = len(shards)
    first: dict[tuple[int, int], torch.Tensor] = {}
    for r, shard in enumerate(shards):
        rng = head_range(kv_heads, tp, r)
        if shard.shape[-2] != rng[1] - rng[0]:
            raise UserError(f"rank {r}'s shard has {shard.shape[-2]} heads; TP {tp} of {kv_heads} KV heads gives it "
                            f"{rng[1] - rng[0]}")
        if rng in first:
            if not torch.equal(first[rng].flatten().view(torch.uint8), shard.contiguous().flatten().view(torch.uint8)):
                raise RuntimeError(f"replicas of KV heads {rng} differ between ranks (rank {r}); refusing to merge")
            continue
        first[rng] = shard.contiguous()
    return torch.cat([first[k] for k in sorted(first)], dim=-2)


def shard_of(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The heads rank `rank` of a TP-`tp` group holds, from a merged [..., H, D] tensor (a replicated
    head when tp > H)."""
    a, b = head_range(full.shape[-2], tp, rank)
    return full[..., a:b, :]
