"""KV tiers moving blocks as vLLM's offloading connector does: one batched copy per transfer, blocks
stored as they fill (decode included, not only when a request finishes), the reuse gate before a
block crosses to the host (`FilterReusedOffloadingManager`), and one compute-stream sync per step."""
from __future__ import annotations

import pytest
import torch

from inferbook.serving import kv_offload as kt
from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
from inferbook.serving.sequence import SamplingParams

CFG = TinyConfig(vocab=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn=176, max_seq=160)
BS = 16


@pytest.fixture(scope="module")
def model():
    return init_weights(TinyDecoder(CFG), seed=11).eval()


def engine(model, prefix_caching=False, num_blocks=40, max_num_seqs=2):
    return LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=96,
                                         enable_prefix_caching=prefix_caching, num_blocks=num_blocks))


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(CFG.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kv_layout, pieces_per_block", [("cross_layer", 1), ("layer_major", 2 * CFG.n_layers)])
def test_one_batched_copy_per_transfer(model, kv_layout, pieces_per_block, monkeypatch):
    calls = []
    real = torch._foreach_copy_

    def counting(dsts, srcs, **kw):
        calls.append(len(dsts))
        return real(dsts, srcs, **kw)
    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    e = engine(model, prefix_caching=False)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 64}, kv_layout=kv_layout)
    try:
        p = prompt(1, 5 * BS + 3)
        ref = engine(model).generate([p, p], SamplingParams(max_tokens=4))
        first = e.generate([p], SamplingParams(max_tokens=4))
        assert t.flush(10)  # the first request's stores run on the copy thread: the second must find them done
        assert first + e.generate([p], SamplingParams(max_tokens=4)) == ref
        assert t.flush(10)
        assert t.stats.restored_blocks["host"] == 5 and t.stats.transfers == len(calls) >= 2
        # every transfer moved all its blocks in one call: pieces a multiple of the block's pieces
        assert all(n % pieces_per_block == 0 for n in calls) and max(calls) >= 5 * pieces_per_block
    finally:
        t.close()


def test_blocks_are_stored_as_they_fill_during_decode(model):
    e = engine(model)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 64})
    try:
        seq = e.add_request(prompt(2, BS + 4), SamplingParams(max_tokens=3 * BS))
        while len(seq.output_ids) < 2 * BS + 2:          # the prompt block and two decode blocks have filled
            e.step()
        assert seq in e.scheduler.running                 # still running
        assert t.copier.wait_idle(10)
        keys = kt.prefix_keys(seq.token_ids[:3 * BS], BS, t.ns)
        assert all(t.store.host.contains(k) for k in keys), "a filled decode block is not in the host tier"
        assert t.stats.stored_while_running >= 3 and t.stats.offloads == 0
        while e.has_unfinished():
            e.step()
        assert t.flush(10)
    finally:
        t.close()


def test_reuse_gate_before_the_host(model):
    """store_threshold=2: a block looked up once never crosses to the host; looked up a second time, it
    is stored as it fills; a third request restores it. With threshold 1 the first request's blocks
    are stored at once — the gate is what keeps them back."""
    p = prompt(3, 4 * BS + 5)
    for threshold in (2, 1):
        e = engine(model)                                  # no device prefix cache: every admission looks up
        t = kt.EngineKVTiers(e, {"host_capacity_blocks": 64}, store_threshold=threshold)
        try:
            e.generate([p], SamplingParams(max_tokens=2))
            assert t.flush(10)
            first = t.store.host.stats.writes
            if threshold == 2:
                assert first == 0 and t.stats.not_stored_unreused >= 4
                e.generate([p], SamplingParams(max_tokens=2))
                assert t.flush(10) and t.store.host.stats.writes >= 4 and t.stats.restored_blocks["host"] == 0
                e.generate([p], SamplingParams(max_tokens=2))
                assert t.stats.restored_blocks["host"] == 4
            else:
                assert first >= 4 and t.stats.not_stored_unreused == 0
        finally:
            t.close()


def test_one_compute_stream_sync_per_step_with_tiers(model, monkeypatch):
    from inferbook.serving import engine as engine_mod

    syncs = []
    monkeypatch.setattr(engine_mod, "synchronize", lambda device: syncs.append(1))
    plain = engine(model)
    plain.generate([prompt(4, 40)], SamplingParams(max_tokens=4))
    assert len(syncs) >= 6 * len(plain.steps)              # phases timed apart: six per step
    syncs.clear()
    e = engine(model, prefix_caching=True, num_blocks=12)
    t = kt.EngineKVTiers(e, {"host_capacity_blocks": 16})
    try:
        n_steps = [0]
        real_step = e.step

        def counted():
            n_steps[0] += 1
            return real_step()
        e.step = counted
        e.generate([prompt(5, 40), prompt(5, 40), prompt(6, 70)], SamplingParams(max_tokens=6))
        assert n_steps[0] > 0 and len(syncs) == e.compute_syncs <= n_steps[0]
    finally:
        t.close()
