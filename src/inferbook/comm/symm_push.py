"""The push path on GPUs: the same slots and epoch flags as `shm_push`, through
`torch.distributed._symmetric_memory`. NOT RUN ON A GPU YET (written and tested on CPU only).

SGLang #39653's CustomAllReduceV2 stores the finalized partial straight into each peer's buffer slot
and raises a Lamport-style flag the peer waits on. `shm_push.ShmSlots` does that on CPU through one
shared-memory segment; `SymmSlots` here is the same protocol on CUDA ranks of an NCCL group:

    every rank allocates   buf   [2 parity, N src, numel] (dtype)   its receive buffer, `symm_mem.empty`
                           flags [N src]        int32     epochs, `symm_mem.empty`
    and calls `symm_mem.rendezvous(buf, group)` / `rendezvous(flags, group)` (collective);
    push  (rank r, epoch e): for every dst, the finalize kernel stores its output into
                             hdl.get_buffer(dst, ...)[e % 2, r] (the peer's memory, mapped); then
                             flags of dst [r] = e, a stream-ordered store (`stream_write_value32`)
    wait  (rank r, epoch e): spin until every flags[s] >= e; buf[e % 2] holds the N partials in rank order
    pull  (vocab gather):    each rank stores its slice into buf[e % 2, r] of its own buffer, raises the
                             flags, waits, and reads every peer's buf[e % 2, s] through get_buffer(s, ...)
    (two buffers by epoch parity, as in `shm_push`: a fast rank's next epoch never lands in slots a
    slow peer is still reading)

Which path runs is `select_push_transport`: an NCCL group on CUDA tensors gets symmetric memory, a
gloo group on CPU tensors the shared-memory segment; anything else is refused by name. On CPU the
symmetric-memory path is not selectable (torch's CPU build has no symmetric-memory allocator and an
NCCL group needs GPUs) and says so.

What a GPU run must still establish (none of it has run): that `stream_write_value32`'s flag store is
ordered after the finalize kernel's peer stores as the peers see them (upstream puts a release fence
in the kernel before its flag store), and the wait's cost: ours spins on the host (`flags.min()`,
a device-to-host read per poll), where upstream's kernel spins on the flags in device code.
"""
from __future__ import annotations

import time

import torch

from ..errors import UserError

SYMMETRIC = "symmetric-memory"
SHARED = "shared-memory"


def select_push_transport(backend: str, device_type: str, *, symm_available: bool | None = None) -> tuple[str, str]:
    """(transport, reason) for a process group's `backend` ('gloo', 'nccl', ...) and the tensors'
    `device_type`; UserError for a combination with no push path."""
    backend, device_type = str(backend).lower(), str(device_type).lower()
    if backend == "nccl" and device_type == "cuda":
        ok = symmetric_memory_available() if symm_available is None else symm_available
        if not ok:
            raise UserError("the symmetric-memory push path needs torch.distributed._symmetric_memory with CUDA; "
                            "this torch build has none")
        return SYMMETRIC, "NCCL group on CUDA tensors: torch.distributed._symmetric_memory (not yet run on a GPU)"
    if backend == "gloo" and device_type == "cpu":
        return SHARED, "gloo group on CPU tensors: one shared-memory segment all ranks map (comm.shm_push)"
    if device_type == "cpu":
        raise UserError(f"the symmetric-memory push path is not selectable on CPU: it needs an NCCL process group "
                        f"and CUDA tensors, and this is a {backend} group on {device_type} tensors; on CPU the "
                        "push path is the shared-memory segment, with a gloo group")
    raise UserError(f"no push path for a {backend} group on {device_type} tensors: symmetric memory needs NCCL on "
                    "CUDA, the shared-memory segment gloo on CPU")


def symmetric_memory_available() -> bool:
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def push_slots(numel: int, dtype: torch.dtype, device: torch.device, group=None):
    """The receive slots of the selected push path for this process group and device:
    `SymmSlots` (NCCL, CUDA) or `shm_push.ShmSlots` (gloo, CPU). Collective. -> (slots, transport)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError("the push path needs an initialised torch.distributed process group")
    transport, _ = select_push_transport(dist.get_backend(group), torch.device(device).type)
    if transport == SYMMETRIC:
        return SymmSlots(numel, dtype, torch.device(device), group), transport
    from .shm_push import ShmSlots

    return ShmSlots(numel, dtype), transport


class SymmSlots:
    """`ShmSlots`' interface (`slot`, `raise_flags`, `wait`, `own_slot`, `peer_slot`, `close`) over
    symmetric memory. `symm` is the module (torch.distributed._symmetric_memory; a test passes a
    stand-in to exercise the layout and the flags on CPU, which is not a run of symmetric memory)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, group=None, *, symm=None,
                 check_backend: bool = True):
        import torch.distributed as dist

        if symm is None:
            from torch.distributed import _symmetric_memory as symm
        if check_backend:
            backend = dist.get_backend(group)
            if select_push_transport(backend, device.type)[0] != SYMMETRIC:
                raise UserError(f"the symmetric-memory push path is not selectable on CPU: it needs an NCCL process "
                                f"group and CUDA tensors, and this is a {backend} group on {device.type} tensors; "
                                "use the shared-memory segment (symm_push.push_slots picks it)")
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel, self.dtype, self.device, self.symm = int(numel), dtype, device, symm
        self.buf = symm.empty(2, self.world, self.numel, dtype=dtype, device=device)
        self.flags = symm.empty(self.world, dtype=torch.int32, device=device)
        self.flags.zero_()
        self.hdl = symm.rendezvous(self.buf, self.group)
        self.flag_hdl = symm.rendezvous(self.flags, self.group)
        self.flag_hdl.barrier(channel=0)     # every rank's flags are zero before anyone pushes

    def _peer_buf(self, rank: int) -> torch.Tensor:
        return self.hdl.get_buffer(rank, (2, self.world, self.numel), self.dtype)

    def slot(self, dst: int, epoch: int) -> torch.Tensor:
        """This rank's slot in rank `dst`'s receive buffer for `epoch` (the peer's memory, mapped)."""
        return self._peer_buf(dst)[epoch % 2, self.rank]

    def own_slot(self, epoch: int) -> torch.Tensor:
        return self.buf[epoch % 2, self.rank]

    def peer_slot(self, src: int, epoch: int) -> torch.Tensor:
        """Rank `src`'s own slot of its own buffer (what the pull path reads)."""
        return self._peer_buf(src)[epoch % 2, src]

    def raise_flags(self, epoch: int) -> None:
        """After the stores (stream order): flags of every dst [this rank] = epoch."""
        for dst in range(self.world):
            peer = self.flag_hdl.get_buffer(dst, (self.world,), torch.int32)
            self.symm_write(peer, self.rank, int(epoch))

    def symm_write(self, flags: torch.Tensor, offset: int, value: int) -> None:
        from torch._C._distributed_c10d import _SymmetricMemory

        _SymmetricMemory.stream_write_value32(flags, offset, value)

    def wait(self, epoch: int, timeout_s: float = 60.0) -> torch.Tensor:
        """Spin (on the host) until every source's flag reached `epoch` -> this rank's slots [N, numel]."""
        deadline = time.monotonic() + timeout_s
        while int(self.flags.min()) < epoch:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: flags {self.flags.tolist()} never reached epoch {epoch}")
            time.sleep(0)
        return self.buf[epoch % 2]

    def close(self) -> None:
        self.flag_hdl.barrier(channel=0)     # nobody reads a peer's buffer any more
        del self.buf, self.flags, self.hdl, self.flag_hdl
