"""Vocab-parallel greedy sampling: exchange (max, index) pairs, not the vocabulary's logits.

With the LM head split over TP ranks, rank r holds logits [B, V_r] for the contiguous vocabulary
slice [start_r, end_r). Greedy decoding needs only the argmax, so each rank sends its local
(max value, global index) for every row — 8 bytes per row (an fp32 value and an int32 index)
instead of V_r logits — and every rank picks the winner from the N pairs (seed §六, SGLang #39653:
"greedy 采样交换局部最大值与位置，无需总是汇集完整 vocab logits").

Semantics, identical to `torch.argmax` over the gathered [B, V] logits:

- ties go to the lowest global index: within a rank `torch.argmax` returns the first maximum,
  across ranks the lowest rank wins a tie, and rank slices are in index order;
- NaN counts as larger than every number (as `torch.argmax` does): a row with a NaN anywhere
  returns the index of its first NaN;
- -inf is an ordinary value: a row of all -inf returns index 0;
- values are compared in fp32 (exact for bf16/fp16 logits); +0.0 and -0.0 tie.

Both strategies are kept, and `choose_strategy` picks by the bytes a rank would send to gather
its whole slice (batch x V/TP x itemsize): below a crossover measured on the machine, one gather
is as cheap as the pairs' extra work; above it, pairs win. Sampling with temperature needs the
full distribution, so this only applies to greedy rows.
"""
from __future__ import annotations

import torch

from ..errors import UserError

STRATEGIES = ("pairs", "gather")
PAIR_BYTES = 8  # an fp32 value and an int32 index per row
DEFAULT_CROSSOVER_BYTES = 16 * 1024  # used only when no measured crossover is given


def shard_bounds(vocab: int, tp: int) -> list[tuple[int, int]]:
    """Contiguous vocabulary slices in rank order; the first vocab % tp slices are one longer."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or isinstance(tp, bool) or not isinstance(tp, int):
        raise UserError(f"vocab and tp must be ints, got {vocab!r} and {tp!r}")
    if tp < 1 or vocab < tp:
        raise UserError(f"need 1 <= tp <= vocab, got tp={tp}, vocab={vocab}")
    if vocab >= 2**31:
        raise UserError(f"vocab {vocab} does not fit the int32 index of a pair (< 2**31)")
    base, extra = divmod(vocab, tp)
    out, start = [], 0
    for r in range(tp):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


def local_candidates(local_logits: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (max value as fp32, its global index as int64) of this rank's slice."""
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2 or local_logits.shape[1] < 1:
        raise UserError(f"local_logits must be [B, V_local] with V_local >= 1, got "
                        f"{tuple(local_logits.shape) if isinstance(local_logits, torch.Tensor) else type(local_logits).__name__}")
    if not local_logits.is_floating_point():
        raise UserError(f"local_logits must be floating point, got {local_logits.dtype}")
    idx = torch.argmax(local_logits, dim=-1)  # first maximum; NaN counts as the maximum
    val = local_logits.gather(1, idx[:, None])[:, 0].float()
    return val, idx + start


def merge_candidates(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """values, indices [TP, B] in rank order -> the global argmax per row [B] (int64).

    `torch.argmax` over the rank axis keeps the rules: NaN first, then the largest value, ties to
    the first (lowest) rank, whose indices are the lowest."""
    winner = torch.argmax(values, dim=0)
    return indices.gather(0, winner[None, :])[0].long()


def greedy_reference(logits: torch.Tensor) -> torch.Tensor:
    """The definition: argmax over the full [B, V] logits."""
    return torch.argmax(logits, dim=-1)


def simulate_pairs(logits: torch.Tensor, tp: int) -> torch.Tensor:
    """The pairs strategy on tp simulated ranks, in one process."""
    vals, idxs = zip(*(local_candidates(logits[:, s:e], s) for s, e in shard_bounds(logits.shape[-1], tp)))
    return merge_candidates(torch.stack(vals), torch.stack(idxs))


def exchanged_bytes(strategy: str, batch: int, vocab: int, tp: int, itemsize: int) -> int:
    """Bytes one rank sends per exchange (the largest slice when vocab % tp != 0)."""
    if strategy == "pairs":
        return batch * PAIR_BYTES
    if strategy == "gather":
        return batch * -(-vocab // tp) * itemsize
    raise UserError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def choose_strategy(vocab: int, batch: int, tp: int, itemsize: int = 2,
                    crossover_bytes: float | None = None) -> tuple[str, str]:
    """('pairs' | 'gather', why). Gather the slices while one rank's slice bytes (batch x V/TP x
    itemsize) stay at or below `crossover_bytes` — the measured point where pairs start to win —
    else exchange pairs. With tp == 1 there is nothing to exchange: 'gather' is the local argmax."""
    shard_bounds(vocab, tp)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise UserError(f"batch must be an int >= 0, got {batch!r}")
    threshold = DEFAULT_CROSSOVER_BYTES if crossover_bytes is None else float(crossover_bytes)
    source = "default" if crossover_bytes is None else "measured"
    if tp == 1:
        return "gather", "tp=1: the local argmax is the answer"
    slice_bytes = exchanged_bytes("gather", batch, vocab, tp, itemsize)
    if slice_bytes <= threshold:
        return "gather", f"slice {slice_bytes} B <= {source} crossover {threshold:.0f} B"
    return "pairs", f"slice {slice_bytes} B > {source} crossover {threshold:.0f} B"


# ---------------------------------------------------------------------------
# Over torch.distributed: every rank calls with its own slice [B, V_r] and its start index.

def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UserError("torch.distributed is not initialized: run under inferbook.comm.workers.launch or torchrun")
    return dist


def greedy_pairs(local_logits: torch.Tensor, start: int, group=None) -> torch.Tensor:
    """All ranks get the global argmax [B]; each sends B x (fp32 value, int32 index)."""
    dist = _dist()
    val, idx = local_candidates(local_logits, start)
    pair = torch.stack([val.view(torch.int32), idx.to(torch.int32)], dim=1).contiguous()  # [B, 2] int32
    world = dist.get_world_size(group)
    recv = [torch.empty_like(pair) for _ in range(world)]
    dist.all_gather(recv, pair, group=group)
    pairs = torch.stack(recv)  # [TP, B, 2]
    return merge_candidates(pairs[..., 0].contiguous().view(torch.float32), pairs[..., 1].long())


def greedy_gather(local_logits: torch.Tensor, vocab: int, group=None) -> torch.Tensor:
    """All ranks get the global argmax [B] by gathering every slice (padded to equal size)."""
    dist = _dist()
    world = dist.get_world_size(group)
    bounds = shard_bounds(vocab, world)
    width = max(e - s for s, e in bounds)
    B, V_local = local_logits.shape
    buf = local_logits.new_empty(B, width)
    buf[:, :V_local] = local_logits
    if V_local < width:
        buf[:, V_local:] = 0  # padding, dropped below
    recv = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(recv, buf.contiguous(), group=group)
    full = torch.cat([recv[r][:, :e - s] for r, (s, e) in enumerate(bounds)], dim=1)
    return torch.argmax(full, dim=-1)


def tie_nan_inf_matrix(batch: int, vocab: int, tp: int, dtype=torch.bfloat16,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[str]]:
    """Logits [rows, vocab] with the hard rows named: ties inside a slice and across slices (at
    slice boundaries), NaN (one, several, in several slices), -inf rows and columns, +inf, -0.0 vs
    +0.0, all-equal rows, then `batch` random rows. Returns (logits, row labels)."""
    if vocab < 4 * tp:
        raise UserError(f"the tie/NaN/-inf matrix needs vocab >= 4 * tp, got vocab={vocab}, tp={tp}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    bounds = shard_bounds(vocab, tp)
    rows, labels = [], []

    def base():
        return torch.randn(vocab, generator=g).to(dtype).float()

    def add(label, row):
        rows.append(row)
        labels.append(label)

    b1 = bounds[1][0] if tp > 1 else vocab // 2
    last = bounds[-1][0]
    r = base(); m = float(r.max()) + 1; r[3] = m; r[vocab - 1] = m; add("tie first and last slice", r)
    r = base(); m = float(r.max()) + 1; r[b1 - 1] = m; r[b1] = m; add("tie across a slice boundary", r)
    r = base(); m = float(r.max()) + 1; r[b1 + 1] = m; r[last] = m; add("tie in later slices only", r)
    r = base(); m = float(r.max()) + 1; r[1] = m; r[2] = m; add("tie inside slice 0", r)
    add("all equal", torch.full((vocab,), 0.5))
    add("all -inf", torch.full((vocab,), float("-inf")))
    r = torch.full((vocab,), float("-inf")); r[last + 1 if last + 1 < vocab else last] = -3.0; add("-inf except one in last slice", r)
    r = base(); r[:b1] = float("-inf"); add("slice 0 all -inf", r)
    r = base(); r[b1 + 2 if b1 + 2 < vocab else b1] = float("nan"); add("one NaN", r)
    r = base(); r[vocab - 1] = float("nan"); r[b1] = float("nan"); add("NaN in two slices", r)
    r = base(); r[0] = float("inf"); r[vocab - 1] = float("nan"); add("+inf then NaN", r)
    r = base(); r[vocab - 2] = float("inf"); r[b1] = float("inf"); add("+inf tie across slices", r)
    r = torch.full((vocab,), -1.0); r[b1] = -0.0; r[last] = 0.0; add("-0.0 ties +0.0", r)
    for i in range(batch):
        add(f"random {i}", base())
    return torch.stack(rows).to(dtype), labels
