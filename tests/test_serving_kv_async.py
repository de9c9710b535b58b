"""The asynchronous data path of the KV tiers (seed section 五): device blocks are freed when their
device->host copy completes, not before and not by the engine waiting for it; a request whose
prefix comes from a slow tier waits while the engine keeps stepping others; one copy per block
with the cross-layer layout; slow-tier admission gated on reuse. On CPU, threads stand in for
CUDA streams: the same code paths run."""
from __future__ import annotations

import threading

import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving import kv_offload as kt
from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
from inferbook.serving.sequence import SamplingParams, Status

CFG = TinyConfig(vocab=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn=176, max_seq=160)
GATE_TIMEOUT_S = 10.0   # a gated copy or read gives up after this (so an old, blocking engine ends the test)


def fresh_seed():
    return torch.randint(1 << 30, ()).item()


@pytest.fixture(scope="module")
def model():
    return init_weights(TinyDecoder(CFG), seed=fresh_seed()).eval()


def prompts(n, length, g):
    return [torch.randint(CFG.vocab, (length,), generator=g).tolist() for _ in range(n)]


def engine(model, prefix_caching=False, num_blocks=40, max_num_seqs=2):
    return LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=96,
                                         enable_prefix_caching=prefix_caching, num_blocks=num_blocks))


def reference(model, ps, max_tokens):
    return engine(model).generate(ps, SamplingParams(max_tokens=max_tokens))


def test_engine_steps_while_a_fetch_is_held(model, tmp_path, monkeypatch):
    """Request A's prefix is in the file tier only, and its read is held; request B (nothing to
    restore) must run to completion meanwhile, A still waiting. Then the read is released and A
    finishes with the tokens of a run without tiers. The old engine fetched inside admission and
    blocked the step until the read returned: B could not finish while A's read was held."""
    g = torch.Generator().manual_seed(fresh_seed())
    prefix, other = prompts(2, 64, g)
    a_prompt = prefix + [1, 2, 3]
    ref = reference(model, [a_prompt, other], 6)
    e = engine(model)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 1, "file_dir": tmp_path, "background": False})
    try:
        e.generate([prefix], SamplingParams(max_tokens=1))      # puts the prefix's blocks in the file tier
        assert t.flush(30) and t.store.tier("file").stats.writes >= 3
        gate, reading = threading.Event(), threading.Event()
        real_read = kt.FileTier.read_into

        def held_read(self, key, row):
            reading.set()
            gate.wait(timeout=GATE_TIMEOUT_S)
            return real_read(self, key, row)
        monkeypatch.setattr(kt.FileTier, "read_into", held_read)
        a = e.add_request(a_prompt, SamplingParams(max_tokens=6))
        e.step()                                  # A is seen: its fetch starts, and it waits
        assert reading.wait(5)                    # the fetch thread is now held inside the file read
        b = e.add_request(other, SamplingParams(max_tokens=6))
        for _ in range(200):
            e.step()
            if b.finished:
                break
        assert b.finished, "the engine did not complete the other request while a fetch was held"
        assert not gate.is_set()
        assert a.status is Status.WAITING and not a.block_table     # no device blocks before its data is on host
        assert t.stats.steps_with_fetch_in_flight >= 6
        gate.set()
        while e.has_unfinished():
            e.step()
        assert [a.output_ids, b.output_ids] == ref
        assert t.stats.restored_blocks["file"] >= 3 and a.num_cached_tokens >= 48
        assert len(t.stats.fetch_wait_s) == 1
    finally:
        t.close()


def test_blocks_return_only_when_the_copy_completes(model, monkeypatch):
    """A held device->host copy keeps the finished request's blocks out of the free list and its
    host rows invisible, while the engine steps another request; once the copy completes the
    blocks come back and the rows are published."""
    g = torch.Generator().manual_seed(fresh_seed())
    first, second = prompts(2, 48, g)
    ref = reference(model, [first], 2) + reference(model, [second], 8)
    e = engine(model, num_blocks=40)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 16})
    gate, copying = threading.Event(), threading.Event()
    real_copy = kt.copy_blocks_to_rows

    def held_copy(*a, **k):
        copying.set()
        assert threading.current_thread() is not threading.main_thread()   # never the engine thread
        gate.wait(timeout=GATE_TIMEOUT_S)
        return real_copy(*a, **k)
    monkeypatch.setattr(kt.block_copy, "copy_blocks_to_rows", held_copy)
    try:
        bm = e.block_manager
        a = e.add_request(first, SamplingParams(max_tokens=2))
        while not a.finished:
            e.step()
        assert copying.wait(5)
        held = 48 // 16
        assert bm.num_free == 40 - held            # the full prompt blocks are held by the copy
        assert len(t.store.host) == 0              # nothing visible before the copy completed
        b = e.add_request(second, SamplingParams(max_tokens=8))
        for _ in range(4):
            e.step()                               # the engine steps while the copy is held
        assert not gate.is_set() and not b.finished and len(b.output_ids) >= 3
        gate.set()
        assert t.copier.wait_idle(10)
        while e.has_unfinished():
            e.step()
        assert t.flush(10)                         # B's own offload copy, launched as it finished
        assert bm.num_free == 40 and len(t.store.host) >= held
        assert [a.output_ids, b.output_ids] == ref
        assert len(t.stats.free_s) >= 1 and all(x > 0 for x in t.stats.free_s)
    finally:
        gate.set()
        t.close()


@pytest.mark.parametrize("kv_layout", ["cross_layer", "layer_major"])
def test_layouts_restore_exactly_and_copy_once_per_block_when_cross_layer(model, kv_layout, tmp_path):
    g = torch.Generator().manual_seed(fresh_seed())
    pre = prompts(4, 72, g)
    ps = [pre[i % 4] + torch.randint(CFG.vocab, (5,), generator=g).tolist() for i in range(10)]
    ref = reference(model, ps, 10)
    e = engine(model, prefix_caching=True, num_blocks=15)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 64}, kv_layout=kv_layout)
    try:
        assert e.generate(ps, SamplingParams(max_tokens=10)) == ref
        assert t.stats.restored_blocks["host"] >= 8, t.stats
        rows = [t.store.host.row(s) for s in range(2)]
        n = kt.copy_blocks_to_rows(t.runner, t.layout, [(0, rows[0]), (1, rows[1])])
        assert n == (2 if kv_layout == "cross_layer" else 2 * 2 * CFG.n_layers)
        assert torch.equal(rows[1], t.block_bytes(1))     # the row is the block's bytes, in order
    finally:
        t.close()


def test_cross_layer_engine_gives_the_same_bits_as_the_flat_pool(model):
    g = torch.Generator().manual_seed(fresh_seed())
    ps = prompts(3, 40, g)
    flat = engine(model)
    cross = engine(model)
    kt.use_cross_layer_blocks(cross.runner)
    assert flat.generate(ps, SamplingParams(max_tokens=5)) == cross.generate(ps, SamplingParams(max_tokens=5))
    seq_f = flat.add_request(ps[0], SamplingParams(max_tokens=5))
    seq_c = cross.add_request(ps[0], SamplingParams(max_tokens=5))
    flat.step(), cross.step()            # the prefill: the requests still own their blocks
    for pos in (0, 17, 39):   # same K in bits at the same positions, read through each pool's own layout
        sf = seq_f.block_table[pos // 16] * 16 + pos % 16
        sc = seq_c.block_table[pos // 16]
        assert torch.equal(flat.runner.k_cache[:, sf], cross.runner.k_cache[:, sc, pos % 16])


def test_slow_tier_admission_waits_for_reuse(model, tmp_path):
    """admit_after=2: a prefix used once stays in host memory only; its second use writes it below."""
    g = torch.Generator().manual_seed(fresh_seed())
    once, twice = prompts(2, 64, g)
    e = engine(model, prefix_caching=True, num_blocks=40, max_num_seqs=1)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 32, "file_dir": tmp_path, "admit_after": 2, "background": False})
    try:
        e.generate([once, twice], SamplingParams(max_tokens=2))
        assert t.flush(30)
        ft = t.store.tier("file")
        assert ft.stats.writes == 0 and t.store.not_admitted == 8
        e.generate([twice + [7]], SamplingParams(max_tokens=2))   # reuses `twice`'s 4 blocks (device hit)
        assert t.flush(30)
        keys = kt.prefix_keys(twice, 16, t.ns)
        assert ft.stats.writes == 4 and all(ft.contains(k) for k in keys)
        assert not any(ft.contains(k) for k in kt.prefix_keys(once, 16, t.ns))
    finally:
        t.close()


def test_bad_layout_and_admission_are_clear_errors(model):
    with pytest.raises(UserError, match="kv_layout"):
        kt.EngineKVTiers(engine(model), {"host_capacity_blocks": 4}, kv_layout="rows")
    with pytest.raises(UserError, match="admit_after"):
        kt.EngineKVTiers(engine(model), {"host_capacity_blocks": 4, "admit_after": 0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA stream path needs a GPU")
def test_cuda_stream_path_restores_exactly(tmp_path):
    """On a GPU: copies on the tiers' own stream into pinned rows, reloads waited on by the compute
    stream through an event; the tokens equal a run without tiers and every block comes back."""
    m = init_weights(TinyDecoder(CFG), seed=fresh_seed()).eval().cuda()
    g = torch.Generator().manual_seed(fresh_seed())
    pre = prompts(4, 72, g)
    ps = [pre[i % 4] + torch.randint(CFG.vocab, (5,), generator=g).tolist() for i in range(10)]
    ref = engine(m).generate(ps, SamplingParams(max_tokens=8))
    e = engine(m, prefix_caching=True, num_blocks=15)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 1, "file_dir": tmp_path})
    try:
        assert t.store.host.pinned_memory and t.copier.stream is not None
        assert e.generate(ps, SamplingParams(max_tokens=8)) == ref
        assert t.flush(30) and e.block_manager.num_free == 15
        assert t.stats.restored_blocks["file"] + t.stats.restored_blocks["host"] >= 8
    finally:
        t.close()
