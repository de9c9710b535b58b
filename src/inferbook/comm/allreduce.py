"""All-reduce built from exchange primitives: one-shot and two-shot, push and pull, and the order
in which each element's N contributions are added.

- **one-shot**: every rank receives every other rank's whole buffer, then reduces all N of them
  itself. One exchange step; each rank receives (N-1)*S bytes. Best for small messages.
- **two-shot**: reduce-scatter then all-gather. Rank c owns chunk c: it receives chunk c from
  every rank, reduces it, then sends the reduced chunk to every rank. Two steps; each rank
  receives 2*(N-1)/N*S bytes. Best for large messages.
- **push / pull**: who moves the bytes. In SGLang's CustomAllReduceV2 (#39653) a push kernel
  writes its data into the peers' buffers, a pull kernel reads the peers' buffers. Over
  `torch.distributed` we model push with point-to-point sends issued by the data's producer
  (`isend`/`irecv`) and pull with collectives issued by the reader (`all_gather`,
  `all_to_all_single`): the bytes and the summation order are the same; the real difference on a GPU
  (who issues the loads/stores over NVLink or xGMI, and when the buffer can be reused) does not
  exist on gloo.
- **order**: `fixed` adds the contributions in rank order 0..N-1 on every rank. `owner-first`
  starts from the reducing rank's own contribution (r, r+1, ..., wrapping), a natural choice
  when the local copy is already in registers. For one-shot this makes the bits depend on which
  rank computed the element, so ranks disagree; for two-shot ranks agree, but the bits depend on
  which rank owns the chunk (change N or the chunk map and they change).
- **accumulate**: `fp32` adds in fp32 and rounds once (a custom all-reduce kernel); `per-step`
  rounds to the data dtype after every addition (a ring whose every hop stores the data dtype).

Floating-point addition is not associative, so order matters whenever a sum rounds. With fp32
accumulation of bf16 inputs over a few ranks, the fp32 sums are usually exact and order rarely
shows; with per-step rounding, or fp32 payloads, it shows at once. `simulate` computes every
rank's result in one process; the distributed functions give the same bits (tested).
"""
from __future__ import annotations

import torch

from ..errors import UserError

ALGORITHMS = ("one-shot", "two-shot")
MODES = ("push", "pull")
ORDERS = ("fixed", "owner-first")
ACCUMULATE = ("fp32", "per-step")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_options(algorithm: str, mode: str, order: str, accumulate: str) -> None:
    for name, value, allowed in (("algorithm", algorithm, ALGORITHMS), ("mode", mode, MODES),
                                 ("order", order, ORDERS), ("accumulate", accumulate, ACCUMULATE)):
        if value not in allowed:
            raise UserError(f"{name} must be one of {allowed}, got {value!r}")


def sum_order(order: str, world_size: int, reducer: int) -> list[int]:
    """The ranks whose contributions are added, in order, by the rank that reduces."""
    if order == "fixed":
        return list(range(world_size))
    if order == "owner-first":
        return [(reducer + i) % world_size for i in range(world_size)]
    raise UserError(f"order must be one of {ORDERS}, got {order!r}")


def reduce_in_order(parts, order: list[int], accumulate: str = "fp32") -> torch.Tensor:
    """Add parts[order[0]] + parts[order[1]] + ... left to right."""
    dt = parts[0].dtype
    if accumulate == "fp32":
        acc = parts[order[0]].float()
        for i in order[1:]:
            acc = acc + parts[i].float()
        return acc.to(dt)
    if accumulate == "per-step":
        acc = parts[order[0]]
        for i in order[1:]:
            acc = (acc.float() + parts[i].float()).to(dt)
        return acc.clone() if len(order) == 1 else acc
    raise UserError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous chunks, rank c owns [start, end); the first numel % N chunks are one longer."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for c in range(world_size):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def simulate(inputs: list[torch.Tensor], algorithm: str = "one-shot", order: str = "fixed",
             accumulate: str = "fp32") -> list[torch.Tensor]:
    """Every rank's all-reduce result, computed in one process. inputs[r] is rank r's buffer."""
    check_options(algorithm, "pull", order, accumulate)
    if not inputs:
        raise UserError("simulate needs at least one rank's input")
    shape, dtype = inputs[0].shape, inputs[0].dtype
    if any(x.shape != shape or x.dtype != dtype for x in inputs):
        raise UserError("every rank's input must have the same shape and dtype")
    N = len(inputs)
    flat = [x.reshape(-1) for x in inputs]
    if algorithm == "one-shot":
        return [reduce_in_order(flat, sum_order(order, N, r), accumulate).reshape(shape) for r in range(N)]
    out = torch.empty_like(flat[0])
    for c, (s, e) in enumerate(chunk_bounds(out.numel(), N)):
        out[s:e] = reduce_in_order([f[s:e] for f in flat], sum_order(order, N, c), accumulate)
    return [out.reshape(shape).clone() for _ in range(N)]


def bytes_per_rank(algorithm: str, nbytes: int, world_size: int) -> dict[str, float]:
    """Bytes each rank sends and receives for one all-reduce of an `nbytes` buffer."""
    N = world_size
    if algorithm == "one-shot":
        moved = (N - 1) * nbytes
    elif algorithm == "two-shot":
        moved = 2 * (N - 1) / N * nbytes
    else:
        raise UserError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return {"sent": moved, "received": moved, "steps": 1 if algorithm == "one-shot" else 2}


# ---------------------------------------------------------------------------
# Over torch.distributed (gloo on CPU, NCCL on GPUs). Every rank calls with its own buffer.

def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UserError("torch.distributed is not initialized: run under inferbook.comm.workers.launch or torchrun")
    return dist


def _p2p(dist, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group=None) -> None:
    """Post every send and receive as one batch (NCCL groups them, so no pairwise ordering can
    deadlock; gloo runs them as plain isend/irecv), then wait for all."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), p, group) for p, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, p, group) for p, t in recvs.items()]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _push_to_all(dist, mine: torch.Tensor, recv: list[torch.Tensor], rank: int, group=None) -> None:
    """Each rank sends `mine` to every peer and receives every peer's into recv[p]."""
    recv[rank].copy_(mine)
    peers = [p for p in range(len(recv)) if p != rank]
    _p2p(dist, {p: mine for p in peers}, {p: recv[p] for p in peers}, group)


def _push_chunks_to_owners(dist, chunks: list[torch.Tensor], recv: list[torch.Tensor], rank: int, group=None) -> None:
    """Rank r sends chunks[p] to rank p, and receives every rank's chunk r into recv[p]."""
    recv[rank].copy_(chunks[rank])
    peers = [p for p in range(len(chunks)) if p != rank]
    _p2p(dist, {p: chunks[p] for p in peers}, {p: recv[p] for p in peers}, group)


def exchange_all(x: torch.Tensor, mode: str = "pull", group=None) -> list[torch.Tensor]:
    """Every rank's full buffer, in rank order (the one-shot exchange)."""
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    recv = [torch.empty_like(x) for _ in range(world)]
    if mode == "pull":
        dist.all_gather(recv, x.contiguous(), group=group)
    elif mode == "push":
        _push_to_all(dist, x, recv, rank, group)
    else:
        raise UserError(f"mode must be one of {MODES}, got {mode!r}")
    return recv


def all_reduce(x: torch.Tensor, algorithm: str = "one-shot", mode: str = "pull", order: str = "fixed",
               accumulate: str = "fp32", group=None) -> torch.Tensor:
    """This rank's all-reduce result (a new tensor). Equal in bits to `simulate(...)[rank]`."""
    check_options(algorithm, mode, order, accumulate)
    if x.dtype not in DTYPES:
        raise UserError(f"all_reduce supports {[str(d) for d in DTYPES]}, got {x.dtype}")
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = x.reshape(-1).contiguous()
    if algorithm == "one-shot":
        parts = exchange_all(flat, mode, group)
        return reduce_in_order(parts, sum_order(order, world, rank), accumulate).reshape(x.shape)
    # two-shot: reduce-scatter to chunk owners, then all-gather the reduced chunks
    bounds = chunk_bounds(flat.numel(), world)
    size = max(e - s for s, e in bounds)
    padded = torch.zeros(world * size, dtype=flat.dtype, device=flat.device)
    for c, (s, e) in enumerate(bounds):
        padded[c * size:c * size + (e - s)] = flat[s:e]
    chunks = list(padded.split(size))
    recv = [torch.empty(size, dtype=flat.dtype, device=flat.device) for _ in range(world)]
    if mode == "push":
        _push_chunks_to_owners(dist, chunks, recv, rank, group)
    else:  # all_to_all_single (gloo's alltoall_base) is older and wider supported than the list form
        flat_recv = torch.empty(world * size, dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(flat_recv, padded, group=group)
        recv = list(flat_recv.split(size))
    reduced = reduce_in_order(recv, sum_order(order, world, rank), accumulate)
    gathered = [torch.empty(size, dtype=flat.dtype, device=flat.device) for _ in range(world)]
    if mode == "push":
        _push_to_all(dist, reduced, gathered, rank, group)
    else:
        dist.all_gather(gathered, reduced, group=group)
    out = torch.empty_like(flat)
    for c, (s, e) in enumerate(bounds):
        out[s:e] = gathered[c][:e - s]
    return out.reshape(x.shape)
