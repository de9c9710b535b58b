"""Speculative budget policies, the vectorised n-gram drafter and its place in the step breakdown."""
import random

import pytest
import torch

from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
from inferbook.serving.sequence import SamplingParams
from inferbook.serving.speculative import NgramDrafter, ngram_reference, rejection_sample

CFG = TinyConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn=64, max_seq=320)


@pytest.fixture(scope="module")
def model():
    return init_weights(TinyDecoder(CFG), seed=torch.randint(1 << 30, ()).item()).eval()


class Req:
    def __init__(self, ids):
        self.token_ids = list(ids)


def test_vectorised_ngram_equals_the_loop_rule():
    rng = random.Random(torch.randint(1 << 30, ()).item())
    drafter = NgramDrafter(50)
    for _ in range(400):   # small alphabets make long, overlapping and repeated matches common
        V = rng.choice([1, 2, 3, 7, 50])
        reqs = [Req(rng.randrange(V) for _ in range(rng.randint(1, 40))) for _ in range(rng.randint(1, 5))]
        k = rng.randint(1, 8)
        toks, probs = drafter.propose(reqs, k, "cpu")
        assert probs is None
        assert toks.tolist() == [ngram_reference(r.token_ids, k) for r in reqs]


def test_ngram_buffers_follow_growing_requests():
    rng = random.Random(1)
    drafter, reqs = NgramDrafter(8), [Req([1, 2, 3]), Req([4])]
    for _ in range(60):
        for r in reqs:
            r.token_ids.extend(rng.randrange(4) for _ in range(rng.randint(0, 9)))   # 0..k+1 new tokens per step
        assert drafter.propose(reqs, 5, "cpu")[0].tolist() == [ngram_reference(r.token_ids, 5) for r in reqs]
    reqs[0].token_ids[:] = [7, 7]   # a request whose tokens shrank (a new request reusing the object) is rebuilt
    assert drafter.propose(reqs[:1], 3, "cpu")[0].tolist() == [[7, 7, 7]]


def test_the_overlapping_match_counts():
    # [5, 5, 5]: the tail [5, 5] also starts at 0, overlapping itself
    assert NgramDrafter(8).propose([Req([5, 5, 5])], 2, "cpu")[0].tolist() == [[5, 5]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_hot_none_is_the_same_as_explicit_one_hot(temperature):
    n, k, V = 6, 5, 11
    g = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(n, k + 1, V, generator=g) / max(temperature, 0.05), -1)
    drafts = torch.randint(V, (n, k), generator=g)
    drafts[0] = target[0, :k].argmax(-1)     # one request whose drafts the target likes
    a = rejection_sample(target, None, drafts, torch.Generator().manual_seed(9))
    b = rejection_sample(target, torch.nn.functional.one_hot(drafts, V).float(), drafts,
                         torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def run(model, prompt_lens, policy, **kw):
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(CFG.vocab, (n,), generator=g).tolist() for n in prompt_lens]
    engine = LLMEngine(model, EngineConfig(spec_budget=policy, chunked_prefill=True, **kw))
    engine.generate(ps, SamplingParams(max_tokens=4))
    return engine


def test_decode_only_does_not_reserve_for_a_request_still_prefilling(model):
    # budget 100, k=4: step 1 takes 100 of 196 prompt tokens; in step 2 the request is running but
    # still prefilling. adaptive reserves 1 x (1 + k) = 5 for it (95 + 1 left: three chunks);
    # decode-only reserves nothing (two chunks).
    kw = dict(max_num_batched_tokens=100, max_num_seqs=2, num_spec_tokens=4)
    adaptive, decode_only = run(model, [196], "adaptive", **kw), run(model, [196], "decode-only", **kw)
    assert adaptive.finished[0].num_prefill_chunks == 3
    assert decode_only.finished[0].num_prefill_chunks == 2
    assert [s.reserved for s in adaptive.steps[:2]] == [0, 5]
    assert [s.reserved for s in decode_only.steps[:2]] == [0, 0]


def test_static_reserves_for_every_seat_even_alone(model):
    kw = dict(max_num_batched_tokens=120, max_num_seqs=8, num_spec_tokens=2)   # static: 8 x 3 = 24 -> 96 < 100
    static, adaptive = run(model, [100], "static", **kw), run(model, [100], "adaptive", **kw)
    assert static.finished[0].num_prefill_chunks == 2 and adaptive.finished[0].num_prefill_chunks == 1
    assert all(s.reserved == 24 for s in static.steps)


def test_host_drafter_time_is_engine_overhead(model):
    engine = run(model, [30, 40], "adaptive", max_num_batched_tokens=128, max_num_seqs=2, num_spec_tokens=4)
    spec_steps = [s for s in engine.steps if s.num_decode]
    assert spec_steps and all(s.draft_on_host for s in spec_steps)
    for s in spec_steps:
        assert s.overhead_s == pytest.approx(s.schedule_s + s.prepare_s + s.update_s + s.draft_s)
