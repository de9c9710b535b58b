"""Serving metrics and the chapters' parameter checks."""
import itertools

import pytest

from inferbook.chapters import kimi_dspark_acceptance as dspark_acceptance, kimi_spec_budget as spec_budget
from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.metrics import (SkippingClock, output_lengths, poisson_arrivals, run_closed_loop,
                                      run_open_loop)
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
from inferbook.serving.sequence import SamplingParams
from inferbook.serving.speculative import NgramDrafter



def test_closed_loop_metrics_with_a_step_clock():
    """A clock that ticks once per reading makes every time a count of engine events: the
    relations between TTFT, TPOT, end-to-end and the two throughputs can be checked exactly."""
    cfg = TinyConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn=64, max_seq=96)
    model = init_weights(TinyDecoder(cfg), 0).eval()
    ticks = itertools.count()
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=32, max_num_seqs=4), clock=lambda: float(next(ticks)))
    prompts = [[1] * n for n in (5, 40, 12, 3, 20)]
    run = run_closed_loop(engine, prompts, SamplingParams(max_tokens=6), concurrency=2)
    assert run.num_requests == 5 and run.output_tokens == 30 and run.input_tokens == 80
    assert max(s.num_running for s in engine.steps) <= 2
    assert run.total_throughput == pytest.approx(run.output_throughput * (30 + 80) / 30)
    for r in run.requests:
        assert 0 < r.ttft_s < r.e2e_s
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (r.output_len - 1))
    assert [r.prefill_chunks > 1 for r in run.requests][1]   # 40 tokens > 32-token budget: split
    with pytest.raises(ValueError, match="concurrency"):
        run_closed_loop(engine, prompts, SamplingParams(), concurrency=0)


def test_open_loop_with_a_step_clock():
    """Open loop on a clock that ticks once per reading: arrivals far apart find an idle engine (the
    clock skips ahead, no request waits), arrivals at 0 queue behind the concurrency cap."""
    cfg = TinyConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn=64, max_seq=96)
    model = init_weights(TinyDecoder(cfg), 0).eval()
    ticks = itertools.count()
    clock = SkippingClock(lambda: float(next(ticks)))
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=32, max_num_seqs=4), clock=clock)
    prompts = [[1] * n for n in (5, 12, 3)]
    apart = run_open_loop(engine, prompts, [3, 4, 5], [0.0, 1e4, 2e4], max_concurrency=2)
    assert [r.output_len for r in apart.requests] == [3, 4, 5]
    assert clock.skipped > 1e4 and apart.coinciding_share == 0
    together = run_open_loop(engine, prompts, [3, 4, 5], [0.0, 0.0, 0.0], max_concurrency=2)
    assert together.coinciding_share == pytest.approx(2 / 3)        # two entered the first step together
    assert max(s.num_running for s in engine.steps) <= 2
    with pytest.raises(ValueError, match="SkippingClock"):
        run_open_loop(LLMEngine(model, EngineConfig()), prompts, [3, 3, 3], [0, 0, 0], 1)


def test_poisson_arrivals_and_output_lengths():
    import torch
    g = torch.Generator().manual_seed(0)
    t = poisson_arrivals(4000, 50.0, g)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0 and min(gaps) >= 0
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.1 / 50          # mean gap 1/rate, within 10 %
    lens = output_lengths(2000, 64, g)
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 30


def test_ngram_drafter_proposes_the_continuation_of_the_last_match():
    class S:
        token_ids = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    toks, probs = NgramDrafter(16).propose([S()], 4, "cpu")
    assert toks.tolist() == [[8, 9, 1, 5]] and probs is None   # None: one-hot at the tokens


@pytest.mark.parametrize("text,ok", [("1,4,16", (1, 4, 16)), (" 2 ", (2,)), ("0,4", None), ("a", None), ("", None)])
def test_concurrencies_parameter(text, ok):
    if ok:
        assert spec_budget.parse_concurrencies(text) == ok
    else:
        with pytest.raises(ValueError, match="concurrencies"):
            spec_budget.parse_concurrencies(text)


def test_task_prompts_end_where_the_answer_starts():
    for task in ("math", "qa"):
        for p in dspark_acceptance.task_prompts(task, 3, 96):
            assert bytes(p).endswith(b"\nA:")
    with pytest.raises(ValueError, match="held-out prompts"):
        dspark_acceptance.task_prompts("qa", 10_000, 96)
