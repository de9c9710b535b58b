"""The open-loop benchmark: vLLM's gamma arrivals and bench-JSON names, TTFT/TPOT/ITL from token times."""
import math
import statistics

import pytest
import torch

from inferbook.serving import bench
from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
from inferbook.serving.sequence import SamplingParams


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_have_the_rate_and_the_burstiness(burstiness):
    t = bench.arrival_times(4000, 20.0, burstiness, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.08)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2   # gamma: CV^2 = 1 / shape
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)
    assert bench.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [dict(request_rate=0), dict(request_rate=1.0, burstiness=0)])
def test_bad_arrival_parameters(bad):
    with pytest.raises(ValueError):
        bench.arrival_times(3, **{"burstiness": 1.0, **bad})


def test_open_loop_run_reports_vllm_names_and_consistent_latencies():
    model = init_weights(TinyDecoder(TinyConfig(max_seq=48)), 0).eval()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(256, (n,), generator=g).tolist() for n in (5, 9, 12, 7, 3, 16)]
    r = bench.run_open_loop(engine, prompts, SamplingParams(max_tokens=5), request_rate=200.0, burstiness=0.5,
                            max_concurrency=2, seed=3)
    for key in ("request_rate", "burstiness", "max_concurrency", "completed", "duration", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms"):
        assert key in r, key
    assert r["completed"] == 6 and r["total_output_tokens"] == 30
    assert len(r["itls"]) == 6 * 4 and all(x >= 0 for x in r["itls"])
    assert r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["median_ttft_ms"] == pytest.approx(r["p50_ttft_ms"])
    assert all(w <= t for w, t in zip(r["queue_waits"], r["ttfts"]))   # a capped arrival waits, TTFT includes it
    assert r["mean_tpot_ms"] == pytest.approx(statistics.fmean(r["itls"]) * 1e3, rel=0.5)
