"""Top-k routing, and the three ways to lay the routed tokens out for the expert GEMMs.

Every routed (token, slot) pair has a flat *slot id* `t * k + j`. The layouts differ in how
rows reach the kernel:

- indexed (`align_indexed`): slot ids sorted by expert, each expert's run padded to a multiple
  of `block_m` with the sentinel `T * k`; the kernel gathers `x[slot // k]` itself (vLLM's
  `moe_align_block_size` shape).
- grouped contiguous (`permute_contiguous`): the activations themselves copied into
  per-expert segments aligned to `block_m` (prefill: long segments, one GEMM per segment).
- grouped masked (`to_masked`): activations `[E, max_m, K]` plus a per-expert count of valid
  rows (decode: fixed shapes, e.g. for CUDA graphs; most rows are padding).

The number of rows each expert receives is the M its GEMM actually runs at.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_topk(topk_ids: torch.Tensor, num_experts: int) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be a [T, k] tensor, got {getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, *, scoring: str = "sigmoid",
          bias: torch.Tensor | None = None, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: scores = sigmoid or softmax of `hidden [T, H] @ gate_weight[E, H].T` (fp32).

    Selection uses `scores + bias` (DeepSeek-V3 / Kimi-K2 style load-balancing bias; None = 0);
    the weights are the unbiased scores of the selected experts, renormalized to sum to 1.
    Returns (topk_weights fp32 [T, k], topk_ids int32 [T, k]).
    """
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    E = gate_weight.shape[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}], got {top_k!r}")
    logits = hidden.float() @ gate_weight.float().T
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows each expert's GEMM receives (the M it runs at), int64 [E]."""
    _check_topk(topk_ids, num_experts)
    return torch.bincount(topk_ids.flatten().long(), minlength=num_experts)


@dataclass
class Indexed:
    sorted_ids: torch.Tensor    # int32 [P]: slot ids grouped by expert, padded with T*k
    block_expert: torch.Tensor  # int32 [P / block_m]: expert of each row block
    counts: torch.Tensor        # int64 [E]
    block_m: int


def _positions(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Stable order of slots by expert and each slot's row in the padded, expert-grouped layout."""
    flat = topk_ids.flatten().long()
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)              # slots, grouped by expert, ascending within
    start = torch.cumsum(counts, 0) - counts
    start_pad = torch.cumsum(padded, 0) - padded
    e_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - start[e_sorted]
    pos = start_pad[e_sorted] + rank
    return order, pos, counts, padded


def padded_rows(n: int, num_experts: int, block_m: int) -> int:
    """Rows of the expert-grouped buffer for `n` routed slots: the worst case, each expert's run padded
    to `block_m` (n + E (block_m - 1), rounded up to block_m), but never more than n * block_m, since
    an expert holding c slots takes ceil(c / block_m) <= c blocks. vLLM's `moe_align_block_size` takes
    that cap when n < E; at decode over many experts (Kimi K3: 16 slots a token over 896 experts) it
    is the difference between 16 row blocks and 857, most of which a kernel would launch to skip."""
    return min((n + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m, n * block_m)


def max_blocks(n: int, num_experts: int, block_m: int) -> int:
    """The most row blocks `n` slots over `num_experts` experts can fill (each a read of one expert's
    weights by an expert-major kernel): min(n, E) experts hold a first block, and every further
    block_m slots at most one more. What a launch built from shapes alone can count, routing unseen."""
    first = min(n, num_experts)
    return first + (n - first) // block_m


def _check_block(block_m: int) -> None:
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")


def align_indexed(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, check: bool = True) -> Indexed:
    """Slot ids sorted by expert, each expert's run padded to `block_m`, in a buffer of the
    *worst-case* size `padded_rows` (T*k + E*(block_m - 1), at most T*k*block_m), as vLLM does: no
    device-to-host sync, so the step can be captured in a CUDA graph. Blocks past the last expert's run get
    expert -1 and hold only sentinels (T*k); the kernel skips them."""
    if check:
        _check_topk(topk_ids, num_experts)
    _check_block(block_m)
    order, pos, counts, padded = _positions(topk_ids, num_experts, block_m)
    n = topk_ids.numel()
    P = padded_rows(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.full((P,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    ends = torch.cumsum(padded // block_m, 0)                     # block index where each expert's run ends
    blocks = torch.arange(P // block_m, device=dev)
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return Indexed(sorted_ids, block_expert, counts, block_m)


@dataclass
class Contiguous:
    x: torch.Tensor             # [P, H]: each expert's rows in one segment, zero rows as padding
    dest: torch.Tensor          # int32 [P]: slot id of each row, -1 for padding
    block_expert: torch.Tensor  # int32 [P / block_m]
    counts: torch.Tensor
    block_m: int


def permute_contiguous(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                       check: bool = True) -> Contiguous:
    """Activations copied into per-expert segments, each padded to `block_m` rows, in a buffer of
    the worst-case size `padded_rows`, as `align_indexed` sizes its
    ids: nothing is read back to the host (check=False also skips the id-range check), so a prefill
    step can be timed or captured without a sync. Blocks past the last segment get expert -1."""
    if check:
        _check_topk(topk_ids, num_experts)
    _check_block(block_m)
    k = topk_ids.shape[1]
    order, pos, counts, padded = _positions(topk_ids, num_experts, block_m)
    n = topk_ids.numel()
    P = padded_rows(n, num_experts, block_m)
    xp = torch.zeros((P, x.shape[-1]), dtype=x.dtype, device=x.device)
    xp[pos] = x[order // k]
    dest = torch.full((P,), -1, dtype=torch.int32, device=x.device)
    dest[pos] = order.to(torch.int32)
    ends = torch.cumsum(padded // block_m, 0)
    blocks = torch.arange(P // block_m, device=x.device)
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return Contiguous(xp, dest, block_expert, counts, block_m)


@dataclass
class Masked:
    x: torch.Tensor       # [E, max_m, H]; rows >= counts[e] are padding (zeros)
    counts: torch.Tensor  # int32 [E]
    dest: torch.Tensor    # int32 [E * max_m]: slot id of each row, -1 for padding
    max_m: int


def to_masked(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_m: int | None = None, *,
              check: bool = True, skip_negative: bool = False) -> Masked:
    """Decode layout. `max_m` fixed ahead (CUDA-graph style) or the busiest expert's count.
    With `max_m` given and check=False nothing is read back to the host (the caller vouches that
    no expert gets more than max_m rows). skip_negative: a slot of id -1 (an expert not held here,
    as vLLM's `expert_map` marks it) gets no row and no `dest` entry."""
    if skip_negative:          # -1 slots as a sentinel expert past the last, whose rows are then dropped
        if check and topk_ids.numel() and int(topk_ids.min()) < -1:
            raise ValueError(f"topk_ids must lie in [-1, {num_experts}) with skip_negative, got {int(topk_ids.min())}")
        topk_ids = torch.where(topk_ids < 0, torch.full_like(topk_ids, num_experts), topk_ids)
    if check or max_m is None:
        _check_topk(topk_ids, num_experts + skip_negative)
    k = topk_ids.shape[1]
    order, pos, counts, _ = _positions(topk_ids, num_experts + skip_negative, 1)
    if skip_negative:
        counts = counts[:num_experts]
    if check or max_m is None:
        busiest = int(counts.max()) if counts.numel() and topk_ids.numel() else 0
        if max_m is None:
            max_m = max(busiest, 1)
        if isinstance(max_m, bool) or not isinstance(max_m, int) or max_m < max(busiest, 1):
            raise ValueError(f"max_m must be an int >= the busiest expert's count ({busiest}), got {max_m!r}")
    elif isinstance(max_m, bool) or not isinstance(max_m, int) or max_m < 1:
        raise ValueError(f"max_m must be a positive int, got {max_m!r}")
    flat = topk_ids.flatten().long()
    e_sorted = flat[order]
    n = num_experts * max_m
    start = torch.cumsum(counts, 0) - counts
    if skip_negative:          # the sentinel's slots all go to one spare row past the slabs, cut off below
        held = e_sorted < num_experts
        e_sorted = torch.where(held, e_sorted, torch.zeros_like(e_sorted))
        where = torch.where(held, e_sorted * max_m + pos - start[e_sorted], torch.full_like(pos, n))
    else:
        where = e_sorted * max_m + pos - start[e_sorted]     # row within the expert's slab
    xm = torch.zeros((n + skip_negative, x.shape[-1]), dtype=x.dtype, device=x.device)
    xm[where] = x[order // k]
    dest = torch.full((n + skip_negative,), -1, dtype=torch.int32, device=x.device)
    dest[where] = order.to(torch.int32)
    return Masked(xm[:n].reshape(num_experts, max_m, -1), counts.to(torch.int32), dest[:n].contiguous(), max_m)


def to_contiguous_from_masked(m: Masked, block_m: int) -> Contiguous:
    """Explicit conversion decode -> prefill layout (same rows, re-segmented)."""
    E = m.counts.numel()
    keep = m.dest >= 0
    slots = m.dest[keep].long()
    rows = m.x.reshape(E * m.max_m, -1)[keep]
    experts = torch.arange(E, device=m.x.device).repeat_interleave(m.max_m)[keep]
    counts = m.counts.long()
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    start_pad = torch.cumsum(padded, 0) - padded
    rank = torch.arange(rows.shape[0], device=rows.device) - start[experts]
    pos = start_pad[experts] + rank
    P = int(padded.sum())
    xp = torch.zeros((P, rows.shape[-1]), dtype=rows.dtype, device=rows.device)
    xp[pos] = rows
    dest = torch.full((P,), -1, dtype=torch.int32, device=rows.device)
    dest[pos] = slots.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(E, device=rows.device, dtype=torch.int32), padded // block_m)
    return Contiguous(xp, dest, block_expert, counts, block_m)


def cpu_threads(n: int = 1):
    """Time CPU paths with a fixed intra-op thread count (restored on exit): `device.torch_threads`."""
    from ..device import torch_threads

    return torch_threads("cpu", n)


def on_gpu(ctx) -> bool:
    """Whether a chapter run takes its GPU branch (Triton timed, rooflines against measured ceilings)."""
    return ctx.device.type == "cuda"
