"""Chapter `kimi-spec-budget`: how much of the step budget speculation holds back.

The seed (section 二) explains part of Kimi K3's cumulative speed-up by vLLM #51725: the
scheduler used to reserve speculative tokens for the *configured* maximum number of requests
(`max_num_seqs * k`), so with few requests running a prefill that would fit the step was split;
the adaptive budget reserves for the requests actually running (`len(running) * k`).

We run the same fixed synthetic load (the seed's 8K-in / 1K-out shape, scaled to the device;
prefix caching off, as in the seed's table) at concurrency 1, 4 and 16 with both policies, on
our engine, and return one RunRecord per (policy, concurrency). Greedy decoding makes both
policies produce the same tokens (checked), so only scheduling differs between them.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..serving.config import EngineConfig
from ..serving.engine import LLMEngine
from ..serving.metrics import run_closed_loop
from ..serving.model import TinyConfig, TinyDecoder, init_weights, save_weights, load_weights
from ..serving.sequence import SamplingParams
from ..serving.speculative import NgramDrafter

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
    "requests_per_slot": Param(int, help="requests per concurrency level = this x concurrency"),
    "repeats": Param(int, help="runs of each (policy, concurrency); records keep the median"),
    "max_num_seqs": Param(int, help="engine's configured maximum of requests in flight"),
    "max_num_batched_tokens": Param(int, help="per-step token budget"),
    "num_spec_tokens": Param(int, help="draft tokens per round, k (the seed: 8)"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
    "timer": Param(str, help="'wall' (perf_counter, device synchronised) or 'process' (CPU seconds of this "
                             "process: on a shared CPU machine, leaves out time spent waiting for a core)",
                   choices=("wall", "process")),
}

PRESETS = {
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, dtype="float32",
                  input_len=64, output_len=8, concurrencies="1,4", requests_per_slot=1, repeats=1, timer="process",
                  max_num_seqs=4,
                  max_num_batched_tokens=72, num_spec_tokens=4),
    "cpu": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn=688, vocab=512, dtype="float32",
                input_len=512, output_len=64, concurrencies="1,4,16", requests_per_slot=1, repeats=3, timer="process",
                max_num_seqs=16,
                max_num_batched_tokens=576, num_spec_tokens=8),
    "gpu": dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn=2816, vocab=32000, dtype="bfloat16",
                input_len=8192, output_len=1024, concurrencies="1,4,16", requests_per_slot=2, repeats=3, timer="wall",
                max_num_seqs=16,
                max_num_batched_tokens=9216, num_spec_tokens=8),
}

POLICIES = ("static", "adaptive")

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


@contextlib.contextmanager
def torch_threads(device, n: int):
    """On CPU, run with `n` torch threads (restored afterwards). The engine's matmuls are small
    (at most a few hundred rows); on a shared 2-core machine a second thread mostly waits on the
    first, and an oversubscribed machine makes that wait dominate. Yields the thread count used."""
    if device.type != "cpu" or n <= 0:
        yield torch.get_num_threads()
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


# (metric, unit, phase) of each number a run yields; records keep the median over repeats
METRICS = {
    "output_throughput": ("output tok/s", "total"),
    "total_throughput": ("total tok/s", "total"),
    "mean_ttft": ("s", "ttft"),
    "median_ttft": ("s", "ttft"),
    "mean_tpot": ("s", "decode"),
    "mean_decode_time": ("s", "decode"),
    "mean_e2e": ("s", "total"),
    "duration": ("s", "total"),
    "split_prefill_share": ("fraction of requests", "ttft"),
    "mean_prefill_steps": ("steps per request", "ttft"),
    "mean_reserved": ("tokens per step", "steady"),
    "mean_step_tokens": ("tokens per step", "steady"),
    "mean_acceptance_length": ("tokens per round", "decode"),
    "overhead_share": ("fraction of step time", "steady"),
    "step_time": ("s", "steady"),
    "schedule_time": ("s", "steady"),
}


def run_numbers(engine, run, conc: int) -> dict:
    """The METRICS of one closed-loop run."""
    share, step_s, n = overhead_share(engine.steps, conc)
    return {
        "output_throughput": run.output_throughput, "total_throughput": run.total_throughput,
        "mean_ttft": run.mean("ttft_s"), "median_ttft": run.median("ttft_s"), "mean_tpot": run.mean("tpot_s"),
        "mean_decode_time": statistics.fmean(r.e2e_s - r.ttft_s for r in run.requests),
        "mean_e2e": run.mean("e2e_s"), "duration": run.duration_s,
        "split_prefill_share": run.split_prefill_share, "mean_prefill_steps": run.mean("prefill_chunks"),
        "mean_reserved": statistics.fmean(s.reserved for s in engine.steps),
        "mean_step_tokens": statistics.fmean(s.num_tokens for s in engine.steps),
        "mean_acceptance_length": engine.acceptance.mean_acceptance_length(),
        "overhead_share": share, "step_time": step_s,
        "schedule_time": statistics.median(s.schedule_s for s in engine.steps),
    }


def _measure(ctx, *, d_model, n_layers, n_heads, n_kv_heads, ffn, vocab, dtype, input_len, output_len,
             concurrencies, requests_per_slot, repeats, max_num_seqs, max_num_batched_tokens,
             num_spec_tokens, timer) -> list[RunRecord]:
    concurrencies = parse_concurrencies(concurrencies)
    if timer == "process" and ctx.device.type == "cuda":
        raise UserError("timer='process' measures CPU seconds and cannot time GPU work; use timer='wall' on cuda")
    if max(concurrencies) > max_num_seqs:
        raise UserError(f"concurrency {max(concurrencies)} exceeds max_num_seqs={max_num_seqs}; "
                         "raise max_num_seqs or lower the concurrency")
    if repeats < 1:
        raise UserError(f"repeats={repeats} must be at least 1")
    cfg = config_from(dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           ffn=ffn, input_len=input_len, output_len=output_len, num_spec_tokens=num_spec_tokens))
    path, sha = write_model(ctx, cfg)
    model = load_weights(path, ctx.device, dtype=getattr(torch, dtype))
    params = SamplingParams(max_tokens=output_len)
    prompts = make_prompts(ctx.seed, requests_per_slot * max(concurrencies), input_len, vocab)
    runs: dict[tuple[str, int], list[dict]] = {}
    outputs, budget_ok, reserve_ok, max_step, engines = {}, {}, {}, {}, {}
    # repeats outermost and policies interleaved, so drift in machine load hits both policies alike
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
                expected = [(max_num_seqs if policy == "static" else s.num_running) * num_spec_tokens
                            for s in engine.steps]
                reserve_ok[key] = reserve_ok.get(key, True) and expected == [s.reserved for s in engine.steps]
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
                "prefix_caching": False, "num_spec_tokens": num_spec_tokens, "drafter": NgramDrafter.name,
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "timer": TIMER_LABELS[timer],
            }, topology={"ranks": 1, "tp": 1})
            rec.set_backend("attention", "paged sdpa, one call per request",
                            reason="PyTorch reference path of this engine", dtype=dtype,
                            shapes={"kv_pool": [n_layers, engine.block_manager.num_blocks * engine.config.block_size,
                                                n_kv_heads, cfg.head_dim], "block_size": engine.config.block_size})
            rec.set_backend("spec_budget", policy, reason="the variant under study",
                            shapes={"reserve": f"{max_num_seqs}*k" if policy == "static" else "running*k"})
            for name, (unit, phase) in METRICS.items():
                values = [r[name] for r in runs[key]]
                rec.add(name, statistics.median(values), unit, phase=phase, runs=values,
                        aggregate=f"median of {len(values)} run(s)")
            rec.get("overhead_share")["definition"] = (
                "(schedule + batch preparation + state update) / step time, median over steps with "
                f">= {conc} requests decoding")
            rec.add_check("step tokens within budget", budget_ok[key], error=max_step[key],
                          tolerance=max_num_batched_tokens)
            rec.add_check("reservation follows the policy", reserve_ok[key])
            if policy == "adaptive":
                rec.add_check("same tokens under both policies (greedy)", outputs[key] == outputs[("static", conc)])
            records.append(rec)
    return records


def seed_beside_ours(records: list[RunRecord]) -> list[dict]:
    """The seed's table next to this run's, one row per concurrency (seed's hardware is not ours)."""
    ours = {(r.variant, r.workload["concurrency"]): r for r in records}
    rows = []
    for seed_row in SEED_TABLE:
        c = seed_row["concurrency"]
        s, a = ours.get(("static", c)), ours.get(("adaptive", c))
        row = {"concurrency": c,
               "seed old tok/s": seed_row["old_tok_s"], "seed new tok/s": seed_row["new_tok_s"],
               "seed new/old": round(seed_row["new_tok_s"] / seed_row["old_tok_s"], 2),
               "seed new TTFT ms": seed_row["new_mean_ttft_ms"]}
        if s and a:
            row.update({"ours static out tok/s": round(s.value("output_throughput"), 1),
                        "ours adaptive out tok/s": round(a.value("output_throughput"), 1),
                        "ours adaptive/static": round(a.value("output_throughput") / s.value("output_throughput"), 2),
                        "ours static TTFT ms": round(1e3 * s.value("mean_ttft"), 1),
                        "ours adaptive TTFT ms": round(1e3 * a.value("mean_ttft"), 1)})
        rows.append(row)
    return rows


def budget_arithmetic(*, input_len: int, max_num_batched_tokens: int, max_num_seqs: int, num_spec_tokens: int,
                      concurrencies) -> list[dict]:
    """What a request arriving at concurrency c finds, when the other c - 1 are decoding:
    the reservation, their decode tokens, and the budget left for its prompt."""
    rows = []
    for c in concurrencies:
        others = int(c) - 1
        for policy in POLICIES:
            reserved = (max_num_seqs if policy == "static" else others) * num_spec_tokens
            left = max_num_batched_tokens - reserved - others
            rows.append({"concurrency": int(c), "policy": policy, "others decoding": others, "reserved": reserved,
                         "their decode tokens": others, "left for the prompt": left, "prompt": input_len,
                         "prompt split?": "yes" if left < input_len else "no"})
    return rows


def chart_rows(records: list[RunRecord], metric: str, scale: float = 1.0) -> list[dict]:
    """One row per record: concurrency, policy and the metric's value (times `scale`)."""
    return [{"concurrency": str(r.workload["concurrency"]), "policy": r.variant, "value": scale * r.value(metric)}
            for r in records]


def overhead_rows(records: list[RunRecord]) -> list[dict]:
    """Median per-step time split into the engine's own work and the rest, per record."""
    rows = []
    for r in records:
        step, share = r.value("step_time"), r.value("overhead_share")
        rows.append({"record": r.name, "concurrency": r.workload["concurrency"], "policy": r.variant,
                     "median step ms": round(1e3 * step, 2), "overhead share": round(share, 4),
                     "overhead ms (approx.)": round(1e3 * step * share, 3),
                     "runs": len(r.get("overhead_share")["runs"])})
    return rows
