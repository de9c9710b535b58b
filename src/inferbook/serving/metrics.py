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

import torch

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
    coinciding_share: float = 0.0     # open loop: share of requests that entered a step with another

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


class SkippingClock:
    """A clock that can jump over idle time: `base()` plus every gap skipped so far. An open-loop
    client with nothing in flight waits for its next arrival by `skip_to(t)` instead of sleeping, so
    idle time costs nothing (and a process-time clock, which does not advance while sleeping, still
    sees the arrivals apart)."""

    def __init__(self, base):
        self.base, self.skipped = base, 0.0

    def __call__(self) -> float:
        return self.base() + self.skipped

    def skip_to(self, t: float) -> None:
        self.skipped += max(0.0, t - self())


def poisson_arrivals(n: int, rate: float, g: torch.Generator) -> list[float]:
    """n arrival offsets (s) of a Poisson process of `rate` requests/s: exponential gaps, the first at 0."""
    if rate <= 0 or n < 1:
        raise ValueError(f"need rate > 0 and n >= 1, got rate={rate!r}, n={n!r}")
    gaps = torch.empty(n - 1, dtype=torch.float64).exponential_(1.0, generator=g) / rate
    return [0.0] + torch.cumsum(gaps, 0).tolist()


def output_lengths(n: int, mean: int, g: torch.Generator) -> list[int]:
    """n output lengths drawn uniformly from [mean/2, 3 mean/2] (mean `mean`, at least 1): requests
    finish at different steps, so arrivals gated on completions do not fall into phase."""
    lo, hi = max(1, mean // 2), max(1, mean + mean // 2)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def run_open_loop(engine, prompts: list[list[int]], max_tokens: list[int], arrivals: list[float],
                  max_concurrency: int) -> RunMetrics:
    """Send request i at `arrivals[i]` seconds after the start (open loop, as `vllm bench serve
    --request-rate`), at most `max_concurrency` in flight (its `--max-concurrency`): a request that
    arrives while the client is full is sent when a slot frees, and its TTFT counts from then, as
    the benchmark's does. The engine's clock must be a `SkippingClock` (an idle engine skips to the
    next arrival). Each request's arrival is when it was sent; its queueing in the engine counts."""
    if len(prompts) != len(max_tokens) or len(prompts) != len(arrivals):
        raise ValueError("prompts, max_tokens and arrivals must have the same length")
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency!r} must be a positive int")
    clock = engine.clock
    if not isinstance(clock, SkippingClock):
        raise ValueError("run_open_loop needs the engine's clock to be a SkippingClock")
    start = clock()
    pending = deque(sorted(zip(arrivals, prompts, max_tokens), key=lambda a: a[0]))
    seqs, freed_at, admitted_in_step = [], start, []
    while pending or engine.has_unfinished():
        now = clock()
        batch = 0
        while pending and start + pending[0][0] <= now and engine.num_unfinished < max_concurrency:
            t, prompt, n = pending.popleft()
            seq = engine.add_request(prompt, SamplingParams(max_tokens=n))
            seq.arrival_s = max(start + t, freed_at)     # sent at its time, or when a slot freed
            seqs.append(seq)
            batch += 1
        if batch:
            admitted_in_step.append(batch)
        if not engine.has_unfinished():
            clock.skip_to(start + pending[0][0])
            continue
        full = engine.num_unfinished >= max_concurrency
        engine.step()
        if full and engine.num_unfinished < max_concurrency:
            freed_at = clock()
    duration = clock() - start
    reqs = [request_metrics(s) for s in seqs]
    run = RunMetrics(concurrency=max_concurrency, num_requests=len(seqs), duration_s=duration,
                     output_tokens=sum(r.output_len for r in reqs), input_tokens=sum(r.input_len for r in reqs),
                     requests=reqs, outputs=[s.output_ids for s in seqs],
                     # requests that entered the engine in the same step as another: they share its budget
                     coinciding_share=sum(b for b in admitted_in_step if b > 1) / len(seqs))
    return run
