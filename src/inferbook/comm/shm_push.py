"""The push path on CPU: the finalize stored by the kernel into every peer's slot of one shared-memory
segment that all gloo ranks map, with a flag per (destination, source) slot that the peers wait on.

SGLang #39653's CustomAllReduceV2 computes the finalize in registers and stores it straight into each
peer's buffer slot through symmetric memory, then raises a Lamport-style flag; a peer spins on its
flags and reduces as soon as every slot has landed, with no host-side send/receive. This is the same
protocol over `multiprocessing.shared_memory`:

    segment = data [2 parity, N dst, N src, numel] (dtype) | flags [N dst, N src] int64
    push  (rank r, epoch e): for every dst, the finalize kernel writes its output into data[e % 2, dst, r];
                             then flags[dst, r] = e
    wait  (rank r, epoch e): spin until flags[r, s] >= e for every s; data[e % 2, r] holds the N partials
                             in rank order, what a one-shot push all-reduce leaves in the receive buffer

Epochs only grow, so a segment serves many steps without being cleared (Lamport's trick is to poll a
value that cannot be stale; ours is the epoch). Two buffers by epoch parity keep a fast rank's epoch
e + 1 stores off the slots a slow peer is still reading for epoch e: a rank can reach epoch e + 2 only
after every peer raised e + 1, which each does after it finished reading e. The flag store follows the data stores in program
order; x86-64 keeps stores in order for other processes (TSO). On a weaker memory model a fence would be
needed between them. GPU ranks use `comm.symm_push.SymmSlots` (`torch.distributed._symmetric_memory`:
`empty`, `rendezvous`, peers' buffers, a stream-ordered flag store) with the same slots, flags and the
functions below; `symm_push.push_slots` picks one by the group's backend and the device. That GPU path has
not run on a GPU yet. Rank 0 creates the segment and broadcasts its name over the gloo group; every rank
maps it.
"""
from __future__ import annotations

import time
from multiprocessing import shared_memory

import torch

from ..errors import UserError


class ShmSlots:
    """Receive slots for every rank in one shared segment. Call collectively (every rank of the default
    process group), then `push` / `wait` / `slots` per step and `close` at the end."""

    def __init__(self, numel: int, dtype: torch.dtype):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UserError("ShmSlots needs an initialised torch.distributed group (gloo, one host)")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel, self.dtype = int(numel), dtype
        item = torch.empty((), dtype=dtype).element_size()
        self.data_bytes = 2 * self.world * self.world * self.numel * item
        size = self.data_bytes + self.world * self.world * 8
        name = [None]
        if self.rank == 0:
            self.shm = shared_memory.SharedMemory(create=True, size=size)
            name = [self.shm.name]
        dist.broadcast_object_list(name, src=0)
        if self.rank != 0:
            self.shm = shared_memory.SharedMemory(name=name[0])
        raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=size)
        self.data = raw[:self.data_bytes].view(dtype).view(2, self.world, self.world, self.numel)
        self.flags = raw[self.data_bytes:].view(torch.int64).view(self.world, self.world)
        if self.rank == 0:
            self.flags.zero_()
        dist.barrier()

    def slot(self, dst: int, epoch: int) -> torch.Tensor:
        """This rank's slot in rank `dst`'s receive buffer for `epoch`: where a kernel stores what it pushes."""
        return self.data[epoch % 2, dst, self.rank]

    def own_slot(self, epoch: int) -> torch.Tensor:
        """This rank's slot of its own receive buffer (where the pull path stores its slice)."""
        return self.data[epoch % 2, self.rank, self.rank]

    def peer_slot(self, src: int, epoch: int) -> torch.Tensor:
        """Rank `src`'s own slot of its own buffer (what the pull path reads)."""
        return self.data[epoch % 2, src, src]

    def raise_flags(self, epoch: int) -> None:
        """After the stores: tell every peer that this rank's slot holds epoch `epoch`."""
        self.flags[:, self.rank] = int(epoch)

    def wait(self, epoch: int, timeout_s: float = 60.0) -> torch.Tensor:
        """Spin until every source has raised its flag for `epoch`; -> this rank's slots [N, numel]."""
        deadline = time.monotonic() + timeout_s
        mine = self.flags[self.rank]
        while int(mine.min()) < epoch:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: flags {mine.tolist()} never reached epoch {epoch}")
            time.sleep(0)
        return self.data[epoch % 2, self.rank]

    def close(self) -> None:
        import torch.distributed as dist

        dist.barrier()              # nobody reads the segment any more
        del self.data, self.flags
        self.shm.close()
        if self.rank == 0:
            self.shm.unlink()


def push_finalize(slots, expert_out: torch.Tensor, topk_weights: torch.Tensor, epoch: int,
                  backend: str = "auto") -> None:
    """Rounding point 1 computed by the finalize kernel straight into every peer's slot (one launch
    per destination: the interpreter and a CPU have no peer-mapped stores in one kernel), then the flags."""
    from . import tail

    T, K, H = tail.check_finalize_inputs(expert_out, topk_weights)
    if slots.numel != T * H or slots.dtype != expert_out.dtype:
        raise UserError(f"slots hold {slots.numel} {slots.dtype} elements; the finalize writes {T * H} {expert_out.dtype}")
    use_torch = tail.select_backend(expert_out.device, backend)[0] == "torch"
    e, w = expert_out.contiguous(), topk_weights.contiguous()
    for dst in range(slots.world):
        out = slots.slot(dst, epoch).view(T, H)
        if use_torch:
            out.copy_(tail.finalize_reference(e, w))
        elif T:
            tail._run(tail._finalize_launch(e, w, out, device=expert_out.device))
    slots.raise_flags(epoch)


def pushed_tail(slots, expert_out, topk_weights, shared, residual, norm_weight, eps=1e-6, epoch: int = 1,
                backend: str = "auto"):
    """The MoE tail with the push path: finalize into the peers' slots, wait on the flags, one fused
    pass over the N partials in rank order. Returns (out, residual_out) [T, H]."""
    from . import tail

    T, _, H = expert_out.shape
    push_finalize(slots, expert_out, topk_weights, epoch, backend)
    partials = slots.wait(epoch).view(slots.world, T, H)
    return tail.fused_tail(partials.clone(), shared, residual, norm_weight, eps, backend=backend)


def pull_gather(slots, local: torch.Tensor, epoch: int) -> torch.Tensor:
    """Vocab pull path: each rank stores its [B, V/N] slice once into its own slot of its own buffer
    and raises its flag; every rank then *reads* its peers' slots (the peers' buffers, mapped) and
    concatenates them in rank order -> [B, V]. Slices must have equal widths (V divisible by N)."""
    B, w = local.shape
    if slots.numel != B * w or slots.dtype != local.dtype:
        raise UserError(f"slots hold {slots.numel} {slots.dtype} elements; the slice has {B * w} {local.dtype}")
    slots.own_slot(epoch).copy_(local.reshape(-1))
    slots.raise_flags(epoch)
    slots.wait(epoch)          # every owner has stored its slice and raised its flag to this rank
    parts = [slots.peer_slot(s, epoch).view(B, w) for s in range(slots.world)]
    return torch.cat(parts, dim=1).clone()
