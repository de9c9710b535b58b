"""An open-loop serving benchmark, reported under the names vLLM's `vllm bench serve` JSON uses.

Arrivals (vLLM `benchmarks/serve.py`, `get_request`): inter-arrival gaps drawn from a gamma distribution
with shape = `burstiness` and scale = 1 / (request_rate x burstiness), so the mean rate is
`request_rate` and burstiness 1 is a Poisson process (< 1 burstier, > 1 more regular); rate inf sends
everything at once. `max_concurrency` caps the requests in flight: an arrival past the cap waits (its
TTFT still counts from its arrival, as vLLM's semaphore-gated client measures from when it sends —
ours from when it arrives, which is the stricter reading; `queue_wait` says how much of TTFT that was).

Per request: TTFT (arrival to first token), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (each gap
between consecutive output tokens). Per run: `mean_*_ms`, `median_*_ms`, `p50_*_ms`, `p99_*_ms`,
`std_*_ms` for ttft/tpot/itl/e2el, `request_throughput`, `output_throughput`, `total_token_throughput`,
`duration`, `completed`. The engine steps in this process, so the clock includes the client; vLLM's
client is a separate process talking HTTP.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque

from .sequence import SamplingParams


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival offsets in seconds from the start (vLLM's gamma process, see the module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness!r}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return out


def _stats(name: str, xs_s: list[float], percentiles=(50, 99)) -> dict:
    ms = sorted(x * 1e3 for x in xs_s)
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0}
    for p in percentiles:   # numpy's default (linear) percentile, as vLLM computes them
        if not ms:
            out[f"p{p}_{name}_ms"] = 0.0
            continue
        k = (len(ms) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}_{name}_ms"] = ms[lo] + (ms[hi] - ms[lo]) * (k - lo)
    return out


def run_open_loop(engine, prompts: list[list[int]], params: SamplingParams, *, request_rate: float,
                  burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0) -> dict:
    """Send `prompts` at open-loop arrival times, step the engine until all finish; vLLM's bench JSON
    fields (module docstring) plus the per-request lists `ttfts`, `itls`, `queue_waits`, `outputs`."""
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be a positive int or None, got {max_concurrency!r}")
    offsets = arrival_times(len(prompts), request_rate, burstiness, seed)
    start = engine.clock()
    waiting = deque(zip(offsets, prompts))
    live: list[tuple[float, float, object, list[float]]] = []   # (arrival, admitted, seq, token times)
    done = []
    while waiting or live:
        now = engine.clock() - start
        while waiting and waiting[0][0] <= now and (max_concurrency is None or len(live) < max_concurrency):
            arrival, prompt = waiting.popleft()
            live.append((arrival, now, engine.add_request(prompt, params), []))
        if not live:              # idle until the next arrival: the clock runs, nothing to step
            continue
        engine.step()
        t = engine.clock() - start
        for arrival, admitted, seq, times in live:
            while len(times) < len(seq.output_ids):
                times.append(t)
        done += [x for x in live if x[2].finished]
        live = [x for x in live if not x[2].finished]
    duration = engine.clock() - start
    ttft, tpot, itl, e2el, waits = [], [], [], [], []
    for arrival, admitted, seq, times in done:
        ttft.append(times[0] - arrival)
        e2el.append(times[-1] - arrival)
        waits.append(admitted - arrival)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl += [b - a for a, b in zip(times, times[1:])]
    n_in = sum(s.num_prompt_tokens for _, _, s, _ in done)
    n_out = sum(len(s.output_ids) for _, _, s, _ in done)
    out = {"request_rate": request_rate, "burstiness": burstiness, "max_concurrency": max_concurrency,
           "completed": len(done), "duration": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(done) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, xs))
    order = sorted(range(len(done)), key=lambda i: done[i][2].seq_id)
    out.update({"ttfts": [ttft[i] for i in order], "itls": itl, "queue_waits": [waits[i] for i in order],
                "outputs": [list(done[i][2].output_ids) for i in order]})
    return out
