"""Chapter `kimi-spec-budget`: how much of the step budget speculation holds back.

The seed (section 二) explains part of Kimi K3's cumulative speed-up by vLLM #51725: the
scheduler used to reserve speculative tokens for the *configured* maximum number of requests
(`max_num_seqs * k`), so with few requests running a prefill that would fit the step was split;
the adaptive budget reserves for the requests actually running. A third policy, FastDeploy's
#7499, reserves only for the running requests that are decoding. Each reserves 1 + k tokens per
request it counts (`EngineConfig.spec_reservation`).

We run the same fixed synthetic load (the seed's 8K-in / 1K-out shape, scaled to the device;
prefix caching off, as in the seed's table) at concurrency 1, 4 and 16 with all three policies,
on our engine, with a closed-loop client that keeps `concurrency` requests in flight over
`requests_per_slot` waves, so that after the first wave every arrival finds the other c - 1
decoding (the steady state). The presets are sized so that such an arrival's prompt fits the
step under the adaptive reservation ((c - 1) x (1 + k)) but not under the static one
(max_num_seqs x (1 + k)). Greedy decoding makes all policies produce the same tokens (checked),
so only scheduling differs between them. One RunRecord per (policy, concurrency).
"""
from __future__ import annotations

import statistics
import time

import torch

from ..device import torch_threads
from ..errors import UserError
from ..measure import compare_timings, significant
from ..presets import Param
from ..record import RunRecord
from ..serving.config import EngineConfig
from ..serving.engine import LLMEngine
from ..serving.metrics import run_closed_loop
from ..serving.model_runner import observed_paged_kernels, paged_kernels_label
from ..serving.model import TinyConfig, TinyDecoder, init_weights, save_weights, load_weights
from ..serving.sequence import SamplingParams
from ..serving.speculative import NgramDrafter

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('adaptive-c', 'mean_ttft')

PARAMETERS = {
    "d_model": Param(int, help="target model width"),
    "n_layers": Param(int, help="target decoder layers"),
    "n_heads": Param(int, help="query heads"),
    "n_kv_heads": Param(int, help="key/value heads"),
    "ffn": Param(int, help="SwiGLU hidden size"),
    "vocab": Param(int, help="vocabulary size"),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "input_len": Param(int, help="prompt tokens per request (the seed: 8K)"),
    "output_len": Param(int, help="generated tokens per request (the seed: 1K)"),
    "concurrencies": Param(str, help="client concurrency levels, comma-separated (the seed: '1,4,16')"),
    "requests_per_slot": Param(int, help="requests per concurrency level = this x concurrency; arrivals after "
                                         "the first `concurrency` are the steady state"),
    "repeats": Param(int, help="runs of each (policy, concurrency); records keep the median"),
    "max_num_seqs": Param(int, help="engine's configured maximum of requests in flight"),
    "max_num_batched_tokens": Param(int, help="per-step token budget"),
    "num_spec_tokens": Param(int, help="draft tokens per round, k (the seed: 8)"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
    "timer": Param(str, help="'wall' (perf_counter, device synchronised) or 'process' (CPU seconds of this "
                             "process: on a shared CPU machine, leaves out time spent waiting for a core)",
                   choices=("wall", "process")),
}

# Sizing (see `budget_arithmetic`): max_num_batched_tokens - max_num_seqs x (1 + k) < input_len
# <= max_num_batched_tokens - (c_max - 1) x (1 + k), so a steady-state arrival's prompt is split
# under the static reservation only. max_num_seqs (the configured seats) is above the highest
# concurrency, as a server's is (vLLM's default is 256 or 1024 seats).
PRESETS = {
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, dtype="float32",
                  input_len=64, output_len=8, concurrencies="1,4", requests_per_slot=3, repeats=2, timer="process",
                  max_num_seqs=8,
                  max_num_batched_tokens=88, num_spec_tokens=4),
    "cpu": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn=688, vocab=512, dtype="float32",
                input_len=512, output_len=64, concurrencies="1,4,16", requests_per_slot=3, repeats=3, timer="process",
                max_num_seqs=32,
                max_num_batched_tokens=704, num_spec_tokens=8),
    "gpu": dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn=2816, vocab=32000, dtype="bfloat16",
                input_len=8192, output_len=1024, concurrencies="1,4,16", requests_per_slot=2, repeats=3, timer="wall",
                max_num_seqs=32,
                max_num_batched_tokens=8384, num_spec_tokens=8),
}

POLICIES = ("static", "adaptive", "decode-only")
POLICY_LABELS = {"static": "static: max_num_seqs x (1+k) (vLLM before #51725)",
                 "adaptive": "adaptive: running x (1+k) (vLLM #51725)",
                 "decode-only": "decode-only: decoding x (1+k) (FastDeploy #7499)"}

# The seed's table (vLLM write-up of 2026-09-13): v0.27.1 vs main commit 82a85dc1, B300 node,
# CUDA 13.3, TP8, 8K in / 1K out, 8-token DSpark speculation, prefix caching off on both sides.
SEED_TABLE = [
    {"concurrency": 1, "old_tok_s": 83.3, "new_tok_s": 183.3, "new_mean_ttft_ms": 376.3},
    {"concurrency": 4, "old_tok_s": 166.7, "new_tok_s": 416.7, "new_mean_ttft_ms": 640.5},
    {"concurrency": 16, "old_tok_s": 258.3, "new_tok_s": 725.0, "new_mean_ttft_ms": 1121.0},
]
SEED_SETUP = ("vLLM v0.27.1 vs main 82a85dc1; B300 node, CUDA 13.3, TP8; Kimi K3; 8K in / 1K out; "
              "8-token DSpark speculation; prefix caching off")


def parse_concurrencies(text) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16); ValueError naming the value otherwise."""
    try:
        values = tuple(int(c) for c in str(text).replace(" ", "").split(",") if c)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UserError(f"concurrencies={text!r} must be comma-separated positive ints, e.g. '1,4,16'")
    return values


def check_params(P: dict) -> None:
    """Concurrency levels parse and fit the engine, before any work (`setup` calls this)."""
    conc = parse_concurrencies(P["concurrencies"])
    if max(conc) > P["max_num_seqs"]:
        raise UserError(f"concurrency {max(conc)} exceeds max_num_seqs={P['max_num_seqs']}")


def config_from(params: dict) -> TinyConfig:
    return TinyConfig(vocab=params["vocab"], d_model=params["d_model"], n_layers=params["n_layers"],
                      n_heads=params["n_heads"], n_kv_heads=params["n_kv_heads"], ffn=params["ffn"],
                      max_seq=params["input_len"] + params["output_len"] + params["num_spec_tokens"])


def write_model(ctx, cfg: TinyConfig) -> tuple[str, str]:
    """Random weights from the run's seed, saved as safetensors. Returns (path, sha256)."""
    from ..context import results_dir

    path = results_dir() / ctx.chapter.slug / "target.safetensors"
    return str(path), save_weights(init_weights(TinyDecoder(cfg), ctx.seed), path)


def make_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 17)
    return torch.randint(vocab, (n, length), generator=g).tolist()


def engine_config(policy: str, *, max_num_seqs: int, max_num_batched_tokens: int, num_spec_tokens: int,
                  seed: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        num_spec_tokens=num_spec_tokens, spec_budget=policy, chunked_prefill=True,
                        enable_prefix_caching=False, seed=seed)


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
TIMER_LABELS = {"wall": "perf_counter, device synchronised", "process": "process CPU time (time.process_time)"}


def run_level(model, policy: str, concurrency: int, prompts, params: SamplingParams, ecfg: EngineConfig,
              timer: str = "wall"):
    """One closed-loop run: a fresh engine, one untimed warm-up request, then the load."""
    engine = LLMEngine(model, ecfg, drafter=NgramDrafter(model.cfg.vocab), clock=CLOCKS[timer])
    engine.generate(prompts[:1], SamplingParams(max_tokens=min(4, params.max_tokens)))   # warm-up, not measured
    engine.steps.clear()
    engine.acceptance.accepted.clear()
    run = run_closed_loop(engine, prompts, params, concurrency)
    return engine, run


def overhead_share(steps, min_running: int) -> tuple[float, float, int]:
    """Median of (scheduling + bookkeeping) / step time over steps with >= min_running requests."""
    sel = [s for s in steps if s.num_running >= min_running and s.num_decode >= min_running] or list(steps)
    shares = [s.overhead_s / s.total_s for s in sel if s.total_s > 0]
    return statistics.median(shares), statistics.median(s.total_s for s in sel), len(sel)


def measure(ctx, *, cpu_threads, **params) -> list[RunRecord]:
    """One RunRecord per (policy, concurrency); see the module docstring."""
    with torch_threads(ctx.device, cpu_threads) as threads:
        records = _measure(ctx, **params)
    for r in records:
        r.workload["torch_threads"] = threads
    return records


# (metric, unit, phase) of each number a run yields; records keep the median over repeats
METRICS = {
    "output_throughput": ("output tok/s", "total"),
    "total_throughput": ("total tok/s", "total"),
    "mean_ttft": ("s", "ttft"),
    "median_ttft": ("s", "ttft"),
    "steady_mean_ttft": ("s", "ttft"),
    "mean_tpot": ("s", "decode"),
    "mean_decode_time": ("s", "decode"),
    "mean_e2e": ("s", "total"),
    "duration": ("s", "total"),
    "split_prefill_share": ("fraction of requests", "ttft"),
    "steady_split_share": ("fraction of steady-state requests", "ttft"),
    "first_wave_split_share": ("fraction of first-wave requests", "ttft"),
    "steady_splits": ("requests", "ttft"),
    "mean_prefill_steps": ("steps per request", "ttft"),
    "mean_reserved": ("tokens per step", "steady"),
    "mean_step_tokens": ("tokens per step", "steady"),
    "mean_acceptance_length": ("tokens per round", "decode"),
    "overhead_share": ("fraction of step time", "steady"),
    "step_time": ("s", "steady"),
    "schedule_time": ("s", "steady"),
    "draft_time": ("s", "steady"),
    "prepare_time": ("s", "steady"),
    "forward_time": ("s", "steady"),
    "sample_time": ("s", "steady"),
    "update_time": ("s", "steady"),
}
STEP_PHASES = ("schedule", "draft", "prepare", "forward", "sample", "update")


def run_numbers(engine, run, conc: int) -> dict:
    """The METRICS of one closed-loop run, plus the steady-state requests' TTFTs (`_steady_ttfts`).
    Requests are in arrival order: the first `conc` arrived together (the first wave); every later
    one arrived when another finished, with the others decoding (the steady state)."""
    share, step_s, n = overhead_share(engine.steps, conc)
    first, steady = run.requests[:conc], run.requests[conc:]
    spec_steps = [s for s in engine.steps if s.num_decode] or list(engine.steps)
    out = {
        "output_throughput": run.output_throughput, "total_throughput": run.total_throughput,
        "mean_ttft": run.mean("ttft_s"), "median_ttft": run.median("ttft_s"),
        "steady_mean_ttft": statistics.fmean(r.ttft_s for r in steady) if steady else run.mean("ttft_s"),
        "mean_tpot": run.mean("tpot_s"),
        "mean_decode_time": statistics.fmean(r.e2e_s - r.ttft_s for r in run.requests),
        "mean_e2e": run.mean("e2e_s"), "duration": run.duration_s,
        "split_prefill_share": run.split_prefill_share,
        "steady_split_share": (sum(r.prefill_chunks > 1 for r in steady) / len(steady)) if steady else 0.0,
        "first_wave_split_share": sum(r.prefill_chunks > 1 for r in first) / len(first),
        "steady_splits": sum(r.prefill_chunks > 1 for r in steady),
        "mean_prefill_steps": run.mean("prefill_chunks"),
        "mean_reserved": statistics.fmean(s.reserved for s in engine.steps),
        "mean_step_tokens": statistics.fmean(s.num_tokens for s in engine.steps),
        "mean_acceptance_length": engine.acceptance.mean_acceptance_length(),
        "overhead_share": share, "step_time": step_s,
    }
    for phase in STEP_PHASES:   # median per phase over the steps that verified drafts
        out[f"{phase}_time"] = statistics.median(getattr(s, f"{phase}_s") for s in spec_steps)
    out["_steady_ttfts"] = [r.ttft_s for r in steady]
    return out


def expected_reservation(policy: str, step, *, max_num_seqs: int, num_spec_tokens: int) -> int:
    """What the policy must have reserved in a recorded step (StepStats): the check of the engine."""
    count = {"static": max_num_seqs, "adaptive": step.num_running, "decode-only": step.num_decode}[policy]
    return count * (1 + num_spec_tokens)


def _measure(ctx, *, d_model, n_layers, n_heads, n_kv_heads, ffn, vocab, dtype, input_len, output_len,
             concurrencies, requests_per_slot, repeats, max_num_seqs, max_num_batched_tokens,
             num_spec_tokens, timer) -> list[RunRecord]:
    concurrencies = parse_concurrencies(concurrencies)
    if timer == "process" and ctx.device.type == "cuda":
        raise UserError("timer='process' measures CPU seconds and cannot time GPU work; use timer='wall' on cuda")
    if max(concurrencies) > max_num_seqs:
        raise UserError(f"concurrency {max(concurrencies)} exceeds max_num_seqs={max_num_seqs}; "
                         "raise max_num_seqs or lower the concurrency")
    if repeats < 1 or requests_per_slot < 1:
        raise UserError(f"repeats={repeats} and requests_per_slot={requests_per_slot} must be at least 1")
    # the config checks the budget against the policies before any work
    engine_config("static", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  num_spec_tokens=num_spec_tokens, seed=ctx.seed)
    cfg = config_from(dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           ffn=ffn, input_len=input_len, output_len=output_len, num_spec_tokens=num_spec_tokens))
    path, sha = write_model(ctx, cfg)
    model = load_weights(path, ctx.device, dtype=getattr(torch, dtype))
    params = SamplingParams(max_tokens=output_len)
    prompts = make_prompts(ctx.seed, requests_per_slot * max(concurrencies), input_len, vocab)
    runs: dict[tuple[str, int], list[dict]] = {}
    outputs, budget_ok, reserve_ok, max_step, engines = {}, {}, {}, {}, {}
    # repeats outermost and policies interleaved, so drift in machine load hits every policy alike
    for _ in range(repeats):
        for conc in concurrencies:
            for policy in POLICIES:
                ecfg = engine_config(policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     num_spec_tokens=num_spec_tokens, seed=ctx.seed)
                engine, run = run_level(model, policy, conc, prompts[:requests_per_slot * conc], params, ecfg, timer)
                key = (policy, conc)
                runs.setdefault(key, []).append(run_numbers(engine, run, conc))
                outputs.setdefault(key, run.outputs)
                engines[key] = engine
                max_step[key] = max(max_step.get(key, 0), max(s.num_tokens for s in engine.steps))
                budget_ok[key] = budget_ok.get(key, True) and max_step[key] <= max_num_batched_tokens
                expected = [expected_reservation(policy, s, max_num_seqs=max_num_seqs,
                                                 num_spec_tokens=num_spec_tokens) for s in engine.steps]
                reserve_ok[key] = reserve_ok.get(key, True) and expected == [s.reserved for s in engine.steps]
    kernels = observed_paged_kernels(cfg, getattr(torch, dtype), ctx.device, prefill_len=input_len,
                                     context_len=input_len + output_len, k=num_spec_tokens)
    records = []
    for conc in concurrencies:
        for policy in POLICIES:
            key, engine = (policy, conc), engines[(policy, conc)]
            rec = ctx.new_record(f"{policy}-c{conc}", variant=policy, workload={
                "model": f"tiny-decoder L{n_layers} d{d_model} h{n_heads}/{n_kv_heads} V{vocab} "
                         f"({cfg.n_params() / 1e6:.2f}M params)",
                "model_revision": f"sha256:{sha[:16]} (random init, seed {ctx.seed})",
                "quantization": f"none ({dtype})", "dtype": dtype,
                "input_len": input_len, "output_len": output_len, "batch": f"concurrency {conc}",
                "concurrency": conc, "num_requests": requests_per_slot * conc, "repeats": repeats,
                "arrivals": f"closed loop: {conc} in flight, {requests_per_slot} waves",
                "steady_requests": (requests_per_slot - 1) * conc,
                "prefix_caching": False, "num_spec_tokens": num_spec_tokens, "drafter": NgramDrafter.name,
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "timer": TIMER_LABELS[timer],
            }, topology={"ranks": 1, "tp": 1})
            rec.set_backend("attention", paged_kernels_label(kernels),
                            reason="PyTorch reference path of this engine; SDPA kernel observed on its call shapes",
                            dtype=dtype,
                            shapes={"kv_pool": [n_layers, engine.block_manager.num_blocks * engine.config.block_size,
                                                n_kv_heads, cfg.head_dim], "block_size": engine.config.block_size})
            rec.backends["attention"]["kernels"] = {c: {"kernel": r["kernel"], "op": r["op"]} for c, r in kernels.items()}
            rec.set_backend("spec_budget", policy, reason="the variant under study",
                            shapes={"reserve": {"static": f"{max_num_seqs}*(1+k)", "adaptive": "running*(1+k)",
                                                "decode-only": "decoding*(1+k)"}[policy]})
            for name, (unit, phase) in METRICS.items():
                values = [r[name] for r in runs[key]]
                extra = {}
                if name == "steady_mean_ttft":   # every steady-state request's TTFT, over all repeats
                    extra["samples_s"] = [t for r in runs[key] for t in r["_steady_ttfts"]]
                rec.add(name, statistics.median(values), unit, phase=phase, runs=values,
                        aggregate=f"median of {len(values)} run(s)", **extra)
            rec.get("overhead_share")["definition"] = (
                "(schedule + n-gram drafting + batch preparation + state update) / step time, median over steps "
                f"with >= {conc} requests decoding")
            rec.add_check("step tokens within budget", budget_ok[key], error=max_step[key],
                          tolerance=max_num_batched_tokens)
            rec.add_check("reservation follows the policy", reserve_ok[key])
            if policy != "static":
                rec.add_check("same tokens as the static policy (greedy)", outputs[key] == outputs[("static", conc)])
            records.append(rec)
    return records


def seed_beside_ours(records: list[RunRecord]) -> list[dict]:
    """The seed's table next to this run's, one row per concurrency (seed's hardware is not ours).
    Ours: each policy's output tok/s, mean TTFT of steady-state arrivals, and how many of them were split."""
    ours = {(r.variant, r.workload["concurrency"]): r for r in records}
    rows = []
    for seed_row in SEED_TABLE:
        c = seed_row["concurrency"]
        row = {"concurrency": c,
               "seed old tok/s": seed_row["old_tok_s"], "seed new tok/s": seed_row["new_tok_s"],
               "seed new TTFT ms": seed_row["new_mean_ttft_ms"]}
        for policy in POLICIES:
            r = ours.get((policy, c))
            if r is None:
                continue
            row[f"ours {policy} out tok/s"] = significant(r.value("output_throughput"))
            row[f"ours {policy} TTFT ms"] = significant(1e3 * r.value("steady_mean_ttft"))
            row[f"ours {policy} split"] = (f"{int(r.value('steady_splits'))}/{r.workload['steady_requests']}")
        rows.append(row)
    return rows


def budget_arithmetic(*, input_len: int, max_num_batched_tokens: int, max_num_seqs: int, num_spec_tokens: int,
                      concurrencies) -> list[dict]:
    """What a request arriving at concurrency c finds when the other c - 1 are decoding: the
    reservation of each policy and the budget left for its prompt (decode tokens are paid from it)."""
    rows = []
    for c in concurrencies:
        others = int(c) - 1
        for policy in POLICIES:
            count = max_num_seqs if policy == "static" else others   # adaptive = decode-only: all others decode
            reserved = count * (1 + num_spec_tokens)
            left = max_num_batched_tokens - reserved
            rows.append({"concurrency": int(c), "policy": policy, "others decoding": others,
                         "reserved (incl. their 1+k)": reserved, "left for the prompt": left, "prompt": input_len,
                         "prompt split?": "yes" if left < input_len else "no"})
    return rows


def comparisons(records: list[RunRecord], base: str = "static") -> list[dict]:
    """Each policy against `base` at each concurrency: output throughput (over repeats) and the
    steady-state TTFT (over every steady-state request of every repeat), via `compare_timings`."""
    by = {(r.variant, r.workload["concurrency"]): r for r in records}
    rows = []
    for (policy, c), r in by.items():
        if policy == base or (base, c) not in by:
            continue
        b = by[(base, c)]
        row = {"concurrency": c, "policy": policy, "against": base}
        tput_a, tput_b = r.get("output_throughput")["runs"], b.get("output_throughput")["runs"]
        if len(tput_a) >= 2 and len(tput_b) >= 2:
            cmp = compare_timings(tput_a, tput_b, higher_is_better=True)
            row.update({"throughput ratio": significant(cmp.ratio), "throughput interval": cmp.interval(),
                        "throughput verdict": {"faster": "higher", "slower": "lower"}.get(cmp.verdict, cmp.verdict),
                        "_tput": cmp})
        else:
            row.update({"throughput verdict": "one run a side: no interval"})
        ta, tb = r.get("steady_mean_ttft").get("samples_s", []), b.get("steady_mean_ttft").get("samples_s", [])
        if len(ta) >= 2 and len(tb) >= 2 and min(ta + tb) > 0:
            cmp = compare_timings(ta, tb)
            row.update({"TTFT ratio": significant(cmp.ratio), "TTFT interval": cmp.interval(),
                        "TTFT verdict": {"faster": "shorter", "slower": "longer"}.get(cmp.verdict, cmp.verdict),
                        "_ttft": cmp})
        else:
            row.update({"TTFT verdict": "fewer than two steady-state requests a side"})
        rows.append(row)
    return rows


def chart_rows(records: list[RunRecord], metric: str, scale: float = 1.0) -> list[dict]:
    """One row per record: concurrency, policy and the metric's value (times `scale`)."""
    return [{"concurrency": str(r.workload["concurrency"]), "policy": r.variant, "value": scale * r.value(metric)}
            for r in records]


def step_breakdown_rows(records: list[RunRecord]) -> list[dict]:
    """Median time of each step phase (ms) over the steps that verified drafts, per record."""
    rows = []
    for r in records:
        for phase in STEP_PHASES:
            rows.append({"record": r.name, "concurrency": str(r.workload["concurrency"]), "policy": r.variant,
                         "phase": phase, "ms": 1e3 * r.value(f"{phase}_time")})
    return rows


def overhead_rows(records: list[RunRecord]) -> list[dict]:
    """Median per-step time split into the engine's own work and the rest, per record."""
    rows = []
    for r in records:
        step, share = r.value("step_time"), r.value("overhead_share")
        rows.append({"record": r.name, "concurrency": r.workload["concurrency"], "policy": r.variant,
                     "median step ms": significant(1e3 * step), "overhead share": significant(share),
                     "of which n-gram draft ms": significant(1e3 * r.value("draft_time")),
                     "overhead ms (approx.)": significant(1e3 * step * share),
                     "runs": len(r.get("overhead_share")["runs"])})
    return rows


def drafter_timings(n_requests: int, context: int, k: int, vocab: int, seed: int = 0) -> dict:
    """Host time of one drafting call for `n_requests` requests of `context` random tokens: the
    vectorised `NgramDrafter` against the same rule as a per-token Python loop (`ngram_reference`,
    what the engine ran before). Random tokens rarely match, so both scan the whole context for
    every n: the worst case. Returns {'vectorised': Timing, 'loop': Timing, 'equal': bool}."""
    from ..measure import benchmark
    from ..serving.speculative import ngram_reference

    g = torch.Generator().manual_seed(seed + 23)

    class _Request:   # the drafter reads only `token_ids`
        def __init__(self, ids):
            self.token_ids = ids

    reqs = [_Request(torch.randint(vocab, (context,), generator=g).tolist()) for _ in range(n_requests)]
    drafter = NgramDrafter(vocab)
    cpu = torch.device("cpu")
    vec = benchmark(lambda: drafter.propose(reqs, k, cpu), cpu, label="n-gram, vectorised", warmup=2, min_reps=7)
    loop = benchmark(lambda: [ngram_reference(r.token_ids, k) for r in reqs], cpu, label="n-gram, per-token loop",
                     warmup=1, min_reps=7, min_time_s=0.1)
    equal = drafter.propose(reqs, k, cpu)[0].tolist() == [ngram_reference(r.token_ids, k) for r in reqs]
    return {"vectorised": vec, "loop": loop, "equal": equal, "n_requests": n_requests, "context": context}
