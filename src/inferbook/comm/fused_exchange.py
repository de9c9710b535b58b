"""Finalize *before* the exchange, and the vocab-gather transport chosen by size (SGLang #39653).

**Finalize into the peers' buffers.** In the PR's fused path the MoE finalize (the weighted top-k
combine of a rank's expert outputs) is computed in registers and pushed straight into the peers'
receive buffers; the all-reduce's reduction, the shared expert and the RMSNorm then run in one pass
over those buffers. Here every rank holds one receive buffer `buf [N, T, H]` (a symmetric layout:
slot r is rank r's partial on every rank). `finalize_push` runs the finalize kernel with its store
(rounding point 1) aimed at this rank's own slot `buf[rank]` and sends that slot to every peer's
`buf[rank]`, receiving the peers' partials into the other slots: no staging tensor, no stack copy.
`tail.fused_tail(buf, ...)` then reduces in rank order 0..N-1 (rounding point 2) and finishes the
tail. On CPU the transport is gloo point-to-point; on GPUs (one per rank) NCCL point-to-point into
the same slices. Not built: `torch.distributed._symmetric_memory`, where the finalize kernel's
store would go to the peer's memory directly (an NVLink store instead of a send); the order of
operations and so the bits are the same.

**Vocab gather.** Sampling that needs the full logits (not greedy's (max, index) pairs, see
`vocab_greedy`) gathers every rank's vocab slice. Two transports: `push-slot` (every rank sends its
slice straight into each peer's slot of a [N, B, V/N] buffer: one step, N - 1 messages per rank)
and `ring` (`torch.distributed.all_gather`, NCCL's ring on GPUs: N - 1 neighbour steps). Small
slices are latency-bound (one step wins), large ones bandwidth-bound (the ring's one message per
step wins); `choose_gather_transport` picks by slice bytes against a crossover measured where the
model is served. A `pull` transport (each rank loads the peers' slices) needs peer-readable memory
(symmetric memory); point-to-point cannot express it, so it is not built here.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import allreduce as ar, tail, vocab_greedy as vg

GATHER_TRANSPORTS = ("push-slot", "ring")


def finalize_into(expert_out: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                  backend: str = "auto") -> torch.Tensor:
    """The finalize of `tail.finalize` (rounding point 1), stored into `out` [T, H] (a buffer slot)."""
    T, K, H = tail.check_finalize_inputs(expert_out, topk_weights)
    if tuple(out.shape) != (T, H) or not out.is_contiguous() or out.dtype != expert_out.dtype:
        raise UserError(f"out must be a contiguous [{T}, {H}] {expert_out.dtype} slot, got {tuple(out.shape)} {out.dtype}")
    if tail.select_backend(expert_out.device, backend)[0] == "torch" or T == 0:
        out.copy_(tail.finalize_reference(expert_out, topk_weights))
        return out
    # the launch `tail.finalize` makes (so the tail's compile check covers it), into the slot
    tail._run(tail._finalize_launch(expert_out.contiguous(), topk_weights.contiguous(), out, device=expert_out.device))
    return out


def finalize_push(expert_out, topk_weights, buf: torch.Tensor, group=None, backend: str = "auto") -> torch.Tensor:
    """This rank's finalize stored into buf[rank], pushed to every peer's buf[rank]; the peers'
    partials received into the other slots. buf [N, T, H]; returns buf."""
    dist = ar._dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if buf.dim() != 3 or buf.shape[0] != world:
        raise UserError(f"buf must be [N={world}, T, H], got {tuple(buf.shape)}")
    finalize_into(expert_out, topk_weights, buf[rank], backend)
    peers = [p for p in range(world) if p != rank]
    ar._p2p(dist, {p: buf[rank] for p in peers}, {p: buf[p] for p in peers}, group)
    return buf


def fused_moe_tail(expert_out, topk_weights, shared, residual, norm_weight, eps=1e-6, group=None,
                   backend: str = "auto"):
    """Finalize before the exchange, then one pass: (out, residual_out), bitwise equal to the
    unfused chain finalize -> one-shot all-reduce (rank order, fp32, one rounding) -> + shared ->
    + residual -> RMSNorm."""
    dist = ar._dist()
    world = dist.get_world_size(group)
    T, _, H = tail.check_finalize_inputs(expert_out, topk_weights)
    buf = torch.empty(world, T, H, dtype=expert_out.dtype, device=expert_out.device)
    finalize_push(expert_out, topk_weights, buf, group, backend)
    return tail.fused_tail(buf, shared, residual, norm_weight, eps, backend=backend)


def unfused_moe_tail(expert_out, topk_weights, shared, residual, norm_weight, eps=1e-6, group=None,
                     backend: str = "auto"):
    """The reference chain: finalize, a one-shot pull all-reduce in fixed order, then the tail."""
    partial = tail.finalize(expert_out, topk_weights, backend=backend)
    reduced = ar.all_reduce(partial, "one-shot", "pull", "fixed", "fp32", group=group)
    return tail.after_allreduce(reduced, shared, residual, norm_weight, eps, backend=backend)


# ---------------------------------------------------------------------------
# Vocab gather

def vocab_gather(local: torch.Tensor, vocab: int, transport: str, group=None) -> torch.Tensor:
    """Every rank's logits slice [B, V_r] -> the full logits [B, vocab] on every rank (slices in rank
    order, `vg.shard_bounds`), by `transport` ('push-slot' or 'ring')."""
    if transport not in GATHER_TRANSPORTS:
        raise UserError(f"transport must be one of {GATHER_TRANSPORTS}, got {transport!r}")
    dist = ar._dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = vg.shard_bounds(vocab, world)
    width = max(e - s for s, e in bounds)
    B = local.shape[0]
    mine = torch.zeros(B, width, dtype=local.dtype, device=local.device)
    mine[:, :local.shape[1]] = local
    if transport == "push-slot":
        slots = torch.empty(world, B, width, dtype=local.dtype, device=local.device)
        slots[rank].copy_(mine)
        peers = [p for p in range(world) if p != rank]
        ar._p2p(dist, {p: slots[rank] for p in peers}, {p: slots[p] for p in peers}, group)
        parts = list(slots)
    else:
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
    return torch.cat([parts[r][:, :e - s] for r, (s, e) in enumerate(bounds)], dim=1)


def choose_gather_transport(vocab: int, batch: int, tp: int, itemsize: int = 2,
                            crossover_bytes: float | None = None) -> tuple[str, str]:
    """('push-slot' | 'ring', why): push while one rank's slice (batch x V/TP x itemsize) is at most
    the crossover, measured where the model is served (default 64 KiB, a placeholder, not a measurement)."""
    vg.shard_bounds(vocab, tp)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise UserError(f"batch must be an int >= 0, got {batch!r}")
    threshold = 65536.0 if crossover_bytes is None else float(crossover_bytes)
    source = "default" if crossover_bytes is None else "measured"
    slice_bytes = vg.exchanged_bytes("gather", batch, vocab, tp, itemsize)
    if slice_bytes <= threshold:
        return "push-slot", f"slice {slice_bytes} B <= {source} crossover {threshold:.0f} B"
    return "ring", f"slice {slice_bytes} B > {source} crossover {threshold:.0f} B"
