"""Hybrid attention + recurrent model inside the serving engine: the recurrent state lives per KV
block beside the KV, so the device prefix cache and every KV tier save and restore both together;
the state is large next to a block's KV, as in real hybrid models."""
from __future__ import annotations

import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving import kv_offload as kt
from inferbook.serving.config import EngineConfig
from inferbook.serving.hybrid import HybridDecoder, hybrid_engine
from inferbook.serving.model import TinyConfig, init_weights
from inferbook.serving.sequence import SamplingParams

CFG = TinyConfig(vocab=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn=128, max_seq=160)


def fresh_seed():
    return torch.randint(1 << 30, ()).item()


@pytest.fixture(scope="module")
def model():
    return init_weights(HybridDecoder(CFG, recurrent_layers=(1,), heads=4, key_dim=32, value_dim=32),
                        seed=fresh_seed()).eval()


def greedy_reference(model, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(model.reference_logits(toks)[-1].argmax()))
    return toks[len(prompt):]


def shared(g, n_prefixes=4, n=10, prefix_len=64):
    pre = [torch.randint(CFG.vocab, (prefix_len,), generator=g).tolist() for _ in range(n_prefixes)]
    return [pre[i % n_prefixes] + torch.randint(CFG.vocab, (3 + i,), generator=g).tolist() for i in range(n)]


def test_hybrid_engine_matches_the_whole_sequence_reference(model):
    """Chunked prefill (24-token budget) and decode through the paged runner give the tokens of the
    model run on the whole sequence at once."""
    g = torch.Generator().manual_seed(fresh_seed())
    ps = [torch.randint(CFG.vocab, (n,), generator=g).tolist() for n in (40, 17)]
    e = hybrid_engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=24))
    assert e.generate(ps, SamplingParams(max_tokens=6)) == [greedy_reference(model, p, 6) for p in ps]


@pytest.mark.parametrize("tier", ["device", "host", "file"])
def test_kv_and_state_restored_together(model, tier, tmp_path):
    """Shared prefixes; a device pool too small to keep them (device: one large enough). The tokens
    equal an engine without any prefix cache, and blocks were served from the tier."""
    g = torch.Generator().manual_seed(fresh_seed())
    ps = shared(g)
    ref = hybrid_engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=96)).generate(
        ps, SamplingParams(max_tokens=6))
    e = hybrid_engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=96, enable_prefix_caching=True,
                                          num_blocks=200 if tier == "device" else 11))
    t = None
    if tier != "device":
        kw = {"host_capacity_blocks": 64 if tier == "host" else 1, "background": False, "durable": False}
        if tier == "file":
            kw["file_dir"] = tmp_path
        t = kt.EngineKVTiers(e, kw)
        assert [f[0] for f in t.layout.fields] == ["kv", "state"]
    try:
        assert e.generate(ps, SamplingParams(max_tokens=6)) == ref
        if t is None:
            assert sum(s.num_cached_tokens for s in e.finished) >= 4 * 48
        else:
            assert t.stats.restored_blocks[tier] >= 4, t.stats
    finally:
        if t is not None:
            t.close()


def test_restoring_kv_without_the_state_is_wrong(model, monkeypatch):
    """The negative control: restore the KV but leave the state slots zero — the first new token's
    logits move away from the reference, so the state has to travel with the KV."""
    g = torch.Generator().manual_seed(fresh_seed())
    prefix = torch.randint(CFG.vocab, (64,), generator=g).tolist()
    p2 = prefix + [5, 6, 7]

    def first_logits(drop_state: bool):
        e = hybrid_engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=96, enable_prefix_caching=True,
                                              num_blocks=10))
        t = kt.EngineKVTiers(e, {"host_capacity_blocks": 16, "background": False})
        try:
            e.generate([prefix + [1]], SamplingParams(max_tokens=1))
            assert t.flush(10)
            e.generate([torch.randint(CFG.vocab, (100,), generator=g).tolist()], SamplingParams(max_tokens=1))
            assert t.flush(10)                  # the prefix is gone from the device, kept on the host
            if drop_state:
                real = kt.copy_rows_to_blocks

                def without_state(runner, layout, pairs):
                    n = real(runner, layout, pairs)
                    for block, _ in pairs:
                        runner.state_blocks[block].zero_()
                    return n
                monkeypatch.setattr(kt.block_copy, "copy_rows_to_blocks", without_state)
            seq = e.add_request(p2, SamplingParams(max_tokens=1))
            logits = {}
            real_forward = e.runner.forward

            def capture(batch):
                out = real_forward(batch)
                logits.setdefault("first", out[0][-1].clone())
                return out
            e.runner.forward = capture
            while e.has_unfinished():
                e.step()
            assert seq.num_cached_tokens == 64 and t.stats.restored_blocks["host"] == 4
            return logits["first"]
        finally:
            monkeypatch.undo()
            t.close()

    ref = model.reference_logits(p2)[-1]
    with_state, without = first_logits(False), first_logits(True)
    err_with, err_without = (with_state - ref).abs().max().item(), (without - ref).abs().max().item()
    assert err_with < 1e-4, err_with
    assert err_without > 100 * max(err_with, 1e-6), (err_with, err_without)


def test_state_is_large_next_to_a_blocks_kv(model):
    """The recurrent state of one layer (4 x 32 x 32 float32 = 16 KiB) is the KV of 32 tokens of
    the two attention layers: a block's host row is mostly state, as in real hybrid models."""
    assert model.state_bytes() == 4 * 32 * 32 * 4
    assert model.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    assert model.state_bytes() // model.kv_bytes_per_token(torch.float32) == 32


def test_hybrid_bad_input(model):
    with pytest.raises(UserError, match="speculative"):
        hybrid_engine(model, EngineConfig(num_spec_tokens=2, max_num_batched_tokens=2048))
    with pytest.raises(UserError, match="recurrent_layers"):
        HybridDecoder(CFG, recurrent_layers=(0, 1, 2))
