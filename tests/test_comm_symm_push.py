"""The push path's transport selection, and the symmetric-memory slots' protocol on CPU through a
stand-in for `torch.distributed._symmetric_memory` (the layout, the slots and the epoch flags; not a run
of symmetric memory, which needs CUDA and NCCL: that path has not run on a GPU yet)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from inferbook.comm import shm_push, symm_push
from inferbook.errors import UserError


def test_selection_by_group_backend_and_device():
    assert symm_push.select_push_transport("gloo", "cpu")[0] == symm_push.SHARED
    assert symm_push.select_push_transport("nccl", "cuda", symm_available=True)[0] == symm_push.SYMMETRIC
    assert "not yet run on a GPU" in symm_push.select_push_transport("NCCL", "cuda", symm_available=True)[1]
    with pytest.raises(UserError, match="not selectable on CPU: it needs an NCCL process group and CUDA"):
        symm_push.select_push_transport("nccl", "cpu")
    with pytest.raises(UserError, match="not selectable on CPU"):
        symm_push.select_push_transport("mpi", "cpu")
    with pytest.raises(UserError, match="no push path for a gloo group on cuda"):
        symm_push.select_push_transport("gloo", "cuda")
    with pytest.raises(UserError, match="has none"):
        symm_push.select_push_transport("nccl", "cuda", symm_available=False)
    if not torch.cuda.is_available():
        assert not symm_push.symmetric_memory_available()


@pytest.fixture
def one_rank_gloo():
    fd, path = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):   # the FileStore removes its file itself
            os.unlink(path)


def test_on_cpu_the_push_slots_are_the_shared_segment_and_symmetric_memory_is_refused(one_rank_gloo):
    slots, transport = symm_push.push_slots(6, torch.float32, torch.device("cpu"))
    try:
        assert transport == symm_push.SHARED and isinstance(slots, shm_push.ShmSlots)
    finally:
        slots.close()
    with pytest.raises(UserError, match="not selectable on CPU"):
        symm_push.SymmSlots(6, torch.float32, torch.device("cpu"))


class _FakeHandle:
    """What `rendezvous` returns, for N ranks simulated in one process: get_buffer(r) is rank r's tensor."""

    def __init__(self, tensors, rank):
        self.tensors, self.rank = tensors, rank

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        t = self.tensors[rank]
        assert t.dtype == dtype
        return t.view(*sizes)

    def barrier(self, channel=0, timeout_ms=0):
        pass


class _FakeSymm:
    """A stand-in for torch.distributed._symmetric_memory shared by N simulated ranks."""

    def __init__(self, world):
        self.world, self.allocs, self.rank = world, {}, 0

    def empty(self, *size, dtype, device):
        t = torch.full(size, -7, dtype=dtype, device=device) if dtype.is_floating_point is False else \
            torch.full(size, float("nan"), dtype=dtype, device=device)
        self.allocs.setdefault(len(self._order), {})[self.rank] = t
        self._order.append(t)
        return t

    def rendezvous(self, tensor, group):
        key = next(k for k, v in self.allocs.items() if v.get(self.rank) is tensor)
        return _FakeHandle(self.allocs[key], self.rank)


def test_symm_slots_protocol_on_a_stand_in(monkeypatch, one_rank_gloo):
    """N = 3 simulated ranks: each pushes its finalize into every peer's slot and raises the flags;
    each rank's buffer then holds the 3 partials in rank order and its flags the epoch. The pull path
    reads every owner's slice. Stores and flags go through the same functions as the CPU segment."""
    from inferbook.comm import tail

    N, T, K, H = 3, 2, 4, 8
    fake = _FakeSymm(N)
    fake._order = []
    writes = []

    def write(self, flags, offset, value):
        writes.append((self.rank, offset, value))
        flags[offset] = value

    monkeypatch.setattr(symm_push.SymmSlots, "symm_write", write)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: N)
    ranks = []
    for r in range(N):
        fake.rank = r
        fake._order = []
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=r: r)
        ranks.append(symm_push.SymmSlots(T * H, torch.float32, torch.device("cpu"), symm=fake, check_backend=False))
    for r, s in enumerate(ranks):   # every rank's handle sees every rank's buffers
        s.hdl.tensors = {q: ranks[q].buf for q in range(N)}
        s.flag_hdl.tensors = {q: ranks[q].flags for q in range(N)}
    g = torch.Generator().manual_seed(0)
    e = torch.randn(N, T, K, H, generator=g)
    w = torch.rand(N, T, K, generator=g)
    for epoch in (1, 2):
        for r, s in enumerate(ranks):
            shm_push.push_finalize(s, e[r], w[r], epoch, backend="torch")
        for r, s in enumerate(ranks):
            got = s.wait(epoch, timeout_s=1).view(N, T, H)
            for src in range(N):
                assert torch.equal(got[src], tail.finalize_reference(e[src], w[src])), (r, src)
            assert s.flags.tolist() == [epoch] * N
    assert len(writes) == 2 * N * N          # one flag store per (src, dst) per epoch
    with pytest.raises(TimeoutError):
        ranks[0].wait(3, timeout_s=0.05)     # epoch 3 was never pushed: the flags say so
    # the pull path: each rank's slice, read from its owner's buffer (epoch 5: parity 1)
    V, w_ = 3 * (T * H // 2), T * H // 2
    full = torch.randn(2, V, generator=g)
    for r, s in enumerate(ranks):   # store + flags first on every rank (the wait needs all of them)
        s.own_slot(5).copy_(full[:, w_ * r:w_ * (r + 1)].reshape(-1))
        s.raise_flags(5)
    pulls = []
    for s in ranks:
        s.wait(5, timeout_s=1)
        pulls.append(torch.cat([s.peer_slot(q, 5).view(2, w_) for q in range(N)], 1))
    assert all(torch.equal(p, full) for p in pulls)
    # the parity: epoch 5's stores left epoch 2's partials (parity 0) alone
    assert torch.equal(ranks[0].buf[0].view(N, T, H)[1], tail.finalize_reference(e[1], w[1]))


def test_push_path_is_timed_against_gloo_interleaved_and_compared():
    """Two gloo ranks time both transports (warmed up, interleaved); the chapter's record takes the
    slowest rank per iteration and compares with `compare_timings` (ratio and interval)."""
    from types import SimpleNamespace

    from inferbook.chapters import sglang_fused_comm as chapter
    from inferbook.comm import workers
    from inferbook.record import RunRecord

    results = workers.launch("push-time", 2, {"seed": 0, "tokens": 2, "hidden": 32, "topk_per_rank": 2, "reps": 5},
                             timeout_s=120)
    pt = results[0]["push_time"]
    assert set(pt["samples_s"]) == set(workers.PUSH_TIMED) and pt["warmup"] >= 1
    assert all(len(v) == pt["reps"] >= 10 and min(v) > 0 for v in pt["samples_s"].values())
    ctx = SimpleNamespace(new_record=lambda name, **kw: RunRecord(chapter="sglang-fused-comm", name=name, **kw))
    rec = chapter.push_time_record(ctx, results, {"ranks": 2, "backend": "gloo"})
    m = rec.get("push_over_gloo")
    assert m["lo"] <= m["value"] <= m["hi"] and "gloo send/receive" in m["sentence"]
    times = {x["transport"]: x for x in rec.measurements if x["name"] == "tail_time"}
    for name in workers.PUSH_TIMED:   # the slowest rank, iteration by iteration
        assert times[name]["samples_s"] == [max(r["push_time"]["samples_s"][name][i] for r in results)
                                            for i in range(pt["reps"])]
    assert chapter.push_time_record(ctx, [{"rank": 0}], {"ranks": 1, "backend": "nccl"}) is None
