"""Speculative budget policies, the vectorised n-gram drafter and its place in the step breakdown."""
import random

import pytest
import torch

from inferbook.chapters import kimi_spec_budget as spec_budget_chapter
from inferbook.serving.config import EngineConfig, draft_slots_for
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


class SlotDrafter:
    """Repeats the last token (one-hot); no `kind`, so the test sets its draft slots."""

    vocab = CFG.vocab

    def propose(self, seqs, k, device):
        return torch.tensor([[s.token_ids[-1]] * k for s in seqs]), None


def run(model, prompt_lens, policy, drafter=None, **kw):
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(CFG.vocab, (n,), generator=g).tolist() for n in prompt_lens]
    engine = LLMEngine(model, EngineConfig(spec_budget=policy, chunked_prefill=True, **kw), drafter=drafter)
    engine.generate(ps, SamplingParams(max_tokens=4))
    return engine


def test_decode_only_does_not_reserve_for_a_request_still_prefilling(model):
    # budget 100, k=4, a parallel drafter (3 slots): step 1 takes 97 of 196 prompt tokens under adaptive
    # (97 + 3 slots) and 100 under decode-only; adaptive charges 3 slots per scheduled step, so its
    # prompt takes three chunks (97, 97, 2); decode-only reserves nothing for a prefill (100, 96).
    kw = dict(max_num_batched_tokens=100, max_num_seqs=2, num_spec_tokens=4, draft_slots=3)
    adaptive = run(model, [196], "adaptive", SlotDrafter(), **kw)
    decode_only = run(model, [196], "decode-only", SlotDrafter(), **kw)
    assert adaptive.finished[0].num_prefill_chunks == 3
    assert decode_only.finished[0].num_prefill_chunks == 2
    assert [s.reserved for s in adaptive.steps[:2]] == [3, 3]
    assert [s.reserved for s in decode_only.steps[:2]] == [0, 0]


def test_static_reserves_for_every_seat_even_alone(model):
    kw = dict(max_num_batched_tokens=120, max_num_seqs=8, num_spec_tokens=4, draft_slots=3)   # static: 8 x 3 = 24
    static, adaptive = run(model, [100], "static", SlotDrafter(), **kw), run(model, [100], "adaptive", SlotDrafter(), **kw)
    assert static.finished[0].num_prefill_chunks == 2 and adaptive.finished[0].num_prefill_chunks == 1
    assert all(s.reserved == 24 for s in static.steps)
    assert all(s.reserved == 3 * s.num_scheduled for s in adaptive.steps)


@pytest.mark.parametrize("kind,k,slots", [("ngram", 7, 0), ("eagle", 7, 0), ("draft-model", 7, 1),
                                          ("parallel", 7, 6), ("dflash", 7, 7), ("parallel", 1, 0)])
def test_draft_slots_per_kind(kind, k, slots):
    assert draft_slots_for(kind, k) == slots


def test_pr_51725_table_from_the_scheduler():
    """vLLM #51725's own table: 1024 seats, budget 8192, K = 7 DSpark (6 slots): 2048 schedulable tokens
    before, 8192 - 6 n after, for n = 1, 32, 128, 1024 requests — scheduled by `Scheduler.schedule`."""
    rows = {r["requests"]: r for r in spec_budget_chapter.reservation_table()}
    assert {n: (r["static"], r["adaptive"]) for n, r in rows.items()} == {
        1: (2048, 8186), 32: (2048, 8000), 128: (2048, 7424), 1024: (2048, 2048)}
    assert all(r["adaptive"] == r["adaptive (schedulable_tokens)"] for r in rows.values())
    assert all(r["static"] == r["static (schedulable_tokens)"] for r in rows.values())


def test_pr_51725_table_fails_with_the_wrong_slot_count():
    """The check can fail: DFlash's K slots (#51256) give 8185, not 8186, for one request."""
    rows = {r["requests"]: r for r in spec_budget_chapter.reservation_table(kind="dflash")}
    assert rows[1]["adaptive"] == 8185 and rows[1]["static"] == 1024


def test_host_drafter_time_is_engine_overhead(model):
    engine = run(model, [30, 40], "adaptive", max_num_batched_tokens=128, max_num_seqs=2, num_spec_tokens=4)
    spec_steps = [s for s in engine.steps if s.num_decode]
    assert spec_steps and all(s.draft_on_host for s in spec_steps)
    for s in spec_steps:
        assert s.overhead_s == pytest.approx(s.schedule_s + s.prepare_s + s.update_s + s.draft_s)
