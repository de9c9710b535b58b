"""Serving metrics, named as common serving benchmarks name them.

Per request: TTFT (arrival to first output token), TPOT (mean time per output token after the
first: (end-to-end - TTFT) / (output tokens - 1)) and end-to-end latency. Per run: output
tokens/s (generated tokens only) and total tokens/s (prompt + generated), named apart because
they differ by the input/output ratio (8:1 in the seed's load), and the client concurrency.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from .sequence import SamplingParams, Sequence


@dataclass
class RequestMetrics:
    ttft_s: float
    tpot_s: float
    e2e_s: float
    input_len: int
    output_len: int
    prefill_chunks: int


def request_metrics(seq: Sequence) -> RequestMetrics:
    if seq.first_token_s is None or seq.finish_s is None:
        raise ValueError(f"request {seq.seq_id} has not finished")
    ttft, e2e, n = seq.first_token_s - seq.arrival_s, seq.finish_s - seq.arrival_s, len(seq.output_ids)
    return RequestMetrics(ttft_s=ttft, tpot_s=(e2e - ttft) / (n - 1) if n > 1 else 0.0, e2e_s=e2e,
                          input_len=seq.num_prompt_tokens, output_len=n, prefill_chunks=seq.num_prefill_chunks)


@dataclass
class RunMetrics:
    concurrency: int
    num_requests: int
    duration_s: float
    output_tokens: int
    input_tokens: int
    requests: list[RequestMetrics]
    outputs: list[list[int]]          # generated tokens, in arrival order

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_throughput(self) -> float:
        return (self.output_tokens + self.input_tokens) / self.duration_s

    def mean(self, field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in self.requests)

    def median(self, field: str) -> float:
        return statistics.median(getattr(r, field) for r in self.requests)

    @property
    def split_prefill_share(self) -> float:
        """Share of requests whose prompt was computed in more than one step."""
        return sum(r.prefill_chunks > 1 for r in self.requests) / len(self.requests)


def run_closed_loop(engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> RunMetrics:
    """Keep `concurrency` requests in flight (a new one enters as one finishes) until all are done,
    like a benchmark client with `max_concurrency`. Times come from the engine's clock."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be a positive int")
    pending, seqs = deque(prompts), []
    start = engine.clock()
    while pending or engine.has_unfinished():
        while pending and engine.num_unfinished < concurrency:
            seqs.append(engine.add_request(pending.popleft(), params))
        engine.step()
    duration = engine.clock() - start
    reqs = [request_metrics(s) for s in seqs]
    return RunMetrics(concurrency=concurrency, num_requests=len(seqs), duration_s=duration,
                      output_tokens=sum(r.output_len for r in reqs), input_tokens=sum(r.input_len for r in reqs),
                      requests=reqs, outputs=[s.output_ids for s in seqs])
