"""Chapter `kimi-spec-budget`: how much of the step budget speculation holds back.

The seed (section 二) explains part of Kimi K3's cumulative speed-up by vLLM #51725: the scheduler
used to take `max_num_seqs x draft_slots` off the step budget (the drafter's extra input slots for
every *configured* seat), so with few requests running a prefill that would fit was split; the
adaptive budget charges the slots per *scheduled* request. The unit is the drafter's slots
(`config.draft_slots_for`): 0 for n-gram and EAGLE chains — for them #51725 changes nothing — and
K - 1 for a parallel drafter such as DSpark. FastDeploy's #7499 (kept as a third policy) reserves
1 + k verify tokens per *decoding* request instead.

First, before any timing, `reservation_table` reproduces #51725's own table (1024 seats, budget
8192, K = 7: 2048 schedulable tokens before, 8186 after, for one request) from `Scheduler.schedule`.
Then the seed's load shape (long prompts, shorter outputs; prefix caching off), scaled to the
device, runs on our engine with a DSpark-shaped parallel drafter (`block_draft.BlockDrafter`,
random weights: its cost and slots are real, its acceptance is not), under the three policies:
open-loop Poisson arrivals at an offered load relative to the engine's measured single-request
time, at most `concurrency` in flight (`vllm bench serve --request-rate --max-concurrency`), output
lengths drawn from a distribution so arrivals do not fall into phase. Greedy decoding makes every
policy produce the target's tokens (checked in fp32), so only scheduling differs. One RunRecord per
(policy, concurrency), saved as each concurrency level completes.
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
from ..serving.block_draft import BlockDraft, BlockDraftConfig, BlockDrafter
from ..serving.config import draft_slots_for
from ..serving.metrics import SkippingClock, output_lengths, poisson_arrivals, run_open_loop
from ..serving.model_runner import observed_paged_kernels, paged_kernels_label
from ..serving.model import TinyConfig, TinyDecoder, init_weights, save_weights, load_weights
from ..serving.sequence import SamplingParams
from ..serving.speculative import NgramDrafter

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('adaptive-c', 'mean_ttft', 'Mean time to first token under the adaptive (#51725) budget, lowest concurrency')

DRAFTERS = ("parallel", "ngram")

PARAMETERS = {
    "d_model": Param(int, help="target model width"),
    "n_layers": Param(int, help="target decoder layers"),
    "n_heads": Param(int, help="query heads"),
    "n_kv_heads": Param(int, help="key/value heads"),
    "ffn": Param(int, help="SwiGLU hidden size"),
    "vocab": Param(int, help="vocabulary size"),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "input_len": Param(int, help="prompt tokens per request (the seed: 8K)"),
    "output_len": Param(int, help="mean generated tokens per request, drawn from [1/2, 3/2] of it (the seed: 1K)"),
    "concurrencies": Param(str, help="client max concurrency levels, comma-separated (the seed: '1,4,16')"),
    "requests_per_slot": Param(int, help="requests per concurrency level = this x concurrency"),
    "load": Param(float, min=0.05, max=4.0, help="offered load: Poisson rate = load x concurrency / (one request's "
                                                 "time alone, measured here)"),
    "drafter": Param(str, help="'parallel' (DSpark-shaped block draft, K - 1 slots) or 'ngram' (0 slots)",
                     choices=DRAFTERS),
    "repeats": Param(int, help="runs of each (policy, concurrency); records keep the median"),
    "max_num_seqs": Param(int, help="engine's configured maximum of requests in flight"),
    "max_num_batched_tokens": Param(int, help="per-step token budget"),
    "num_spec_tokens": Param(int, help="draft tokens per round, k (the seed: 8)"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
    "timer": Param(str, help="'wall' (perf_counter, device synchronised) or 'process' (CPU seconds of this "
                             "process: on a shared CPU machine, leaves out time spent waiting for a core)",
                   choices=("wall", "process")),
}

# Sizing (see `budget_arithmetic`): with a parallel drafter (slots = k - 1), max_num_batched_tokens -
# max_num_seqs x slots < input_len, so the static policy splits even a lone prompt, while
# input_len + slots + (c_max - 1) x (1 + k + slots) <= max_num_batched_tokens, so the adaptive one keeps
# a prompt whole while the others decode. max_num_seqs (the configured seats) is above the highest
# concurrency, as a server's is (vLLM's default is 256 or 1024 seats). The gpu preset is cut to fit its
# 35 s budget: the engine's per-request, per-layer attention loop makes a step cost ~ requests x layers
# Python calls.
PRESETS = {
    "smoke": dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, dtype="float32",
                  input_len=56, output_len=6, concurrencies="1,4", requests_per_slot=2, repeats=2, timer="process",
                  load=0.8, drafter="parallel", max_num_seqs=16, max_num_batched_tokens=96, num_spec_tokens=4),
    "cpu": dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn=352, vocab=512, dtype="float32",
                input_len=256, output_len=16, concurrencies="1,8", requests_per_slot=3, repeats=2, timer="process",
                load=0.8, drafter="parallel", max_num_seqs=32, max_num_batched_tokens=448, num_spec_tokens=8),
    # gpu: sized to the lent machine's minutes (`inferbook budgets --preset gpu`): the engine's per-request,
    # per-layer Python each step binds it
    "gpu": dict(d_model=1024, n_layers=2, n_heads=16, n_kv_heads=4, ffn=2816, vocab=32000, dtype="bfloat16",
                input_len=2048, output_len=12, concurrencies="1,8", requests_per_slot=2, repeats=2, timer="wall",
                load=0.8, drafter="parallel", max_num_seqs=64, max_num_batched_tokens=2304, num_spec_tokens=8),
}

POLICIES = ("static", "adaptive", "decode-only")
POLICY_LABELS = {"static": "static: max_num_seqs x draft slots up front (vLLM before #51725)",
                 "adaptive": "adaptive: draft slots per scheduled request (vLLM #51725)",
                 "decode-only": "decode-only: decoding x (1+k) up front (FastDeploy #7499)"}

# The seed's table (vLLM write-up of 2026-09-13): v0.27.1 vs main commit 82a85dc1, B300 node,
# CUDA 13.3, TP8, 8K in / 1K out, 8-token DSpark speculation, prefix caching off on both sides.
SEED_TABLE = [
    {"concurrency": 1, "old_tok_s": 83.3, "new_tok_s": 183.3, "new_mean_ttft_ms": 376.3},
    {"concurrency": 4, "old_tok_s": 166.7, "new_tok_s": 416.7, "new_mean_ttft_ms": 640.5},
    {"concurrency": 16, "old_tok_s": 258.3, "new_tok_s": 725.0, "new_mean_ttft_ms": 1121.0},
]
SEED_SETUP = ("vLLM v0.27.1 vs main 82a85dc1; B300 node, CUDA 13.3, TP8; Kimi K3; 8K in / 1K out; "
              "8-token DSpark speculation; prefix caching off")


# vLLM #51725's example: the defaults max_num_seqs=1024, max_num_batched_tokens=8192, and the PR's own serve
# command (Kimi-K3-DSpark, num_speculative_tokens=7); the PR's table: 1, 32, 128, 1024 requests running
PR_51725 = dict(max_num_seqs=1024, max_num_batched_tokens=8192, num_spec_tokens=7, requests=(1, 32, 128, 1024))
PR_51725_TABLE = {1: (2048, 8186), 32: (2048, 8000), 128: (2048, 7424), 1024: (2048, 2048)}   # (old, now)


def reservation_table(kind: str = "parallel", *, max_num_seqs=PR_51725["max_num_seqs"],
                      max_num_batched_tokens=PR_51725["max_num_batched_tokens"],
                      num_spec_tokens=PR_51725["num_spec_tokens"], requests=PR_51725["requests"]) -> list[dict]:
    """New tokens one step schedules with n requests waiting, per policy, from `Scheduler.schedule`
    itself: n requests whose prompts split the budget evenly (each (budget - n x slots) / n tokens,
    at least 1) are admitted into a fresh scheduler and the scheduled tokens are summed; beside it the
    scheduler's own `schedulable_tokens(n)`. With a parallel drafter (K - 1 slots) at K = 7 this is
    #51725's table."""
    from ..serving.block_manager import BlockManager
    from ..serving.config import draft_slots_for
    from ..serving.scheduler import Scheduler
    from ..serving.sequence import Sequence

    slots = draft_slots_for(kind, num_spec_tokens)
    rows = []
    for n in requests:
        prompt = max(1, (max_num_batched_tokens - n * slots) // n)
        row = {"requests": n, "drafter": kind, "draft slots": slots, "prompt each": prompt}
        for policy in ("static", "adaptive", "decode-only"):
            cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               num_spec_tokens=num_spec_tokens, spec_budget=policy, draft_slots=slots)
            need = -(-(prompt + 1 + num_spec_tokens) // cfg.block_size)
            sched = Scheduler(cfg, BlockManager(n * need, cfg.block_size))
            for _ in range(n):
                sched.add(Sequence([0] * prompt, SamplingParams(max_tokens=1)))
            out = sched.schedule()
            row[policy] = out.num_prefill_tokens
            row[f"{policy} requests"] = len(out.chunks)
            row[f"{policy} (schedulable_tokens)"] = sched.schedulable_tokens(n)
        rows.append(row)
    return rows


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
    # the target model as `measure` builds it (its context holds the longest drawn output: 3/2 output_len)
    config_from({**P, "output_len": P["output_len"] + P["output_len"] // 2})
    # the engine's budget under every policy (one KV block at least, one speculative step), as `measure` builds it
    for policy in POLICIES:
        engine_config(policy, max_num_seqs=P["max_num_seqs"], max_num_batched_tokens=P["max_num_batched_tokens"],
                      num_spec_tokens=P["num_spec_tokens"], seed=0, drafter=P["drafter"])
    if P["drafter"] == "parallel":   # the block draft `make_drafter` builds on the target's shape
        BlockDraftConfig(d_model=P["d_model"], vocab=P["vocab"], block=P["num_spec_tokens"], n_layers=1, ffn=P["ffn"],
                         n_heads=P["n_heads"], n_kv_heads=P["n_kv_heads"], markov_rank=min(64, P["d_model"] // 2),
                         window=64)


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
                  seed: int, drafter: str = "parallel") -> EngineConfig:
    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        num_spec_tokens=num_spec_tokens, spec_budget=policy, chunked_prefill=True,
                        draft_slots=draft_slots_for(drafter, num_spec_tokens),
                        enable_prefix_caching=False, seed=seed)


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
TIMER_LABELS = {"wall": "perf_counter, device synchronised", "process": "process CPU time (time.process_time)"}


def make_drafter(kind: str, model, k: int, seed: int):
    """The run's drafter: a DSpark-shaped block draft with random weights (one layer; its forward,
    K query rows per request, is real work; its proposals are not trained), or the n-gram lookup."""
    if kind == "ngram":
        return NgramDrafter(model.cfg.vocab)
    c = model.cfg
    cfg = BlockDraftConfig(d_model=c.d_model, vocab=c.vocab, block=k, n_layers=1, ffn=c.ffn, n_heads=c.n_heads,
                           n_kv_heads=c.n_kv_heads, markov_rank=min(64, c.d_model // 2), window=64)
    torch.manual_seed(seed + 31)
    draft = BlockDraft(cfg, model)
    for prm in draft.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    dt = model.embed.weight.dtype
    return BlockDrafter(draft.to(device=model.embed.weight.device, dtype=dt).eval())


def new_engine(model, drafter, ecfg: EngineConfig, timer: str) -> LLMEngine:
    return LLMEngine(model, ecfg, drafter=drafter, clock=SkippingClock(CLOCKS[timer]))


def service_time(model, drafter, ecfg: EngineConfig, timer: str, prompt, output_len: int) -> float:
    """One request's end-to-end time alone on a fresh engine (after a short warm-up): the unit of
    the offered load (rate = load x concurrency / this)."""
    engine = new_engine(model, drafter, ecfg, timer)
    engine.generate([prompt], SamplingParams(max_tokens=min(4, output_len)))      # warm-up
    t0 = engine.clock()
    engine.generate([prompt], SamplingParams(max_tokens=output_len))
    return engine.clock() - t0


def run_level(model, drafter, concurrency: int, prompts, max_tokens, arrivals, ecfg: EngineConfig, timer: str):
    """One open-loop run on a fresh engine: one untimed warm-up request, then the load."""
    engine = new_engine(model, drafter, ecfg, timer)
    engine.generate(prompts[:1], SamplingParams(max_tokens=min(4, max(max_tokens))))   # warm-up, not measured
    engine.steps.clear()
    engine.acceptance.accepted.clear()
    run = run_open_loop(engine, prompts, max_tokens, arrivals, concurrency)
    return engine, run


def overhead_share(steps, min_running: int) -> tuple[float, float, int]:
    """Median of (scheduling + bookkeeping) / step time over steps with >= min_running requests decoding."""
    sel = [s for s in steps if s.num_decode >= min_running] or list(steps)
    shares = [s.overhead_s / s.total_s for s in sel if s.total_s > 0]
    return statistics.median(shares), statistics.median(s.total_s for s in sel), len(sel)


def measure(ctx, *, cpu_threads, **params) -> list[RunRecord]:
    """One RunRecord per (policy, concurrency) plus the #51725 table; see the module docstring."""
    with torch_threads(ctx.device, cpu_threads) as threads:
        records = _measure(ctx, threads=threads, **params)
    return records


# (metric, unit, phase) of each number a run yields; records keep the median over repeats
METRICS = {
    "output_throughput": ("output tok/s", "total"),
    "total_throughput": ("total tok/s", "total"),
    "mean_ttft": ("s", "ttft"),
    "median_ttft": ("s", "ttft"),
    "p90_ttft": ("s", "ttft"),
    "mean_tpot": ("s", "decode"),
    "mean_e2e": ("s", "total"),
    "duration": ("s", "total"),
    "split_prefill_share": ("fraction of requests", "ttft"),
    "splits": ("requests", "ttft"),
    "coinciding_share": ("fraction of requests", "ttft"),
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
    """The METRICS of one open-loop run, plus every request's TTFT (`_ttfts`)."""
    share, step_s, _ = overhead_share(engine.steps, min(conc, 2))
    spec_steps = [s for s in engine.steps if s.num_decode] or list(engine.steps)
    ttfts = sorted(r.ttft_s for r in run.requests)
    out = {
        "output_throughput": run.output_throughput, "total_throughput": run.total_throughput,
        "mean_ttft": run.mean("ttft_s"), "median_ttft": run.median("ttft_s"),
        "p90_ttft": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "mean_tpot": run.mean("tpot_s"), "mean_e2e": run.mean("e2e_s"), "duration": run.duration_s,
        "split_prefill_share": run.split_prefill_share,
        "splits": sum(r.prefill_chunks > 1 for r in run.requests),
        "coinciding_share": run.coinciding_share,
        "mean_prefill_steps": run.mean("prefill_chunks"),
        "mean_reserved": statistics.fmean(s.reserved for s in engine.steps),
        "mean_step_tokens": statistics.fmean(s.num_tokens for s in engine.steps),
        "mean_acceptance_length": engine.acceptance.mean_acceptance_length(),
        "overhead_share": share, "step_time": step_s,
    }
    for phase in STEP_PHASES:   # median per phase over the steps that verified drafts
        out[f"{phase}_time"] = statistics.median(getattr(s, f"{phase}_s") for s in spec_steps)
    out["_ttfts"] = ttfts
    return out


def expected_reservation(policy: str, step, *, max_num_seqs: int, num_spec_tokens: int, draft_slots: int) -> int:
    """What the policy must have held back in a recorded step (StepStats): the check of the engine."""
    return {"static": max_num_seqs * draft_slots, "adaptive": step.num_scheduled * draft_slots,
            "decode-only": step.num_decode * (1 + num_spec_tokens)}[policy]


def _measure(ctx, *, threads, d_model, n_layers, n_heads, n_kv_heads, ffn, vocab, dtype, input_len, output_len,
             concurrencies, requests_per_slot, repeats, max_num_seqs, max_num_batched_tokens,
             num_spec_tokens, timer, load, drafter) -> list[RunRecord]:
    concurrencies = parse_concurrencies(concurrencies)
    if timer == "process" and ctx.device.type == "cuda":
        raise UserError("timer='process' measures CPU seconds and cannot time GPU work; use timer='wall' on cuda")
    if max(concurrencies) > max_num_seqs:
        raise UserError(f"concurrency {max(concurrencies)} exceeds max_num_seqs={max_num_seqs}; "
                         "raise max_num_seqs or lower the concurrency")
    if repeats < 1 or requests_per_slot < 1:
        raise UserError(f"repeats={repeats} and requests_per_slot={requests_per_slot} must be at least 1")
    slots = draft_slots_for(drafter, num_spec_tokens)
    # the config checks the budget against every policy before any work
    for policy in POLICIES:
        engine_config(policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      num_spec_tokens=num_spec_tokens, seed=ctx.seed, drafter=drafter)

    # 1. the reservation unit, from the scheduler itself, before any timing
    table = reservation_table("parallel")
    tab = ctx.new_record("pr51725-table", variant="scheduler", workload={
        **{k: v for k, v in PR_51725.items() if k != "requests"}, "drafter": "parallel (DSpark), K - 1 = 6 slots",
        "what": "new tokens one schedule() call schedules with n requests waiting"}, topology={"ranks": 1})
    for row in table:
        print(f"#51725 table: {row['requests']:5d} requests -> static {row['static']:5d}, "
              f"adaptive {row['adaptive']:5d} schedulable tokens (scheduler)")
        for policy in POLICIES:
            tab.add(f"{policy}_n{row['requests']}", row[policy], "tokens", phase="schedule",
                    scheduled_requests=row[f"{policy} requests"])
    tab.add_check("#51725's table reproduced (2048 before, 8192 - 6 n after)",
                  all((r["static"], r["adaptive"]) == PR_51725_TABLE[r["requests"]] for r in table))
    records = [tab]

    cfg = config_from(dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           ffn=ffn, input_len=input_len, output_len=output_len + output_len // 2,
                           num_spec_tokens=num_spec_tokens))
    path, sha = write_model(ctx, cfg)
    model = load_weights(path, ctx.device, dtype=getattr(torch, dtype))
    draft = make_drafter(drafter, model, num_spec_tokens, ctx.seed)
    n_max = requests_per_slot * max(concurrencies)
    prompts = make_prompts(ctx.seed, n_max, input_len, vocab)
    g = torch.Generator().manual_seed(ctx.seed + 41)
    lengths = output_lengths(n_max, output_len, g)
    # the offered load's unit: one request alone (adaptive, so its prompt is not split)
    ecfg = {pol: engine_config(pol, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               num_spec_tokens=num_spec_tokens, seed=ctx.seed, drafter=drafter) for pol in POLICIES}
    alone = service_time(model, draft, ecfg["adaptive"], timer, prompts[0], output_len)
    kernels = observed_paged_kernels(cfg, getattr(torch, dtype), ctx.device, prefill_len=input_len,
                                     context_len=input_len + output_len, k=num_spec_tokens)

    # 2. the load, one concurrency level at a time: its records are made (and saved) as it completes
    for conc in concurrencies:
        n = requests_per_slot * conc
        rate = load * conc / alone
        arrivals = poisson_arrivals(n, rate, torch.Generator().manual_seed(ctx.seed + 43 + conc))
        runs: dict[str, list[dict]] = {pol: [] for pol in POLICIES}
        outputs, budget_ok, reserve_ok, max_step, engines = {}, {}, {}, {}, {}
        last_run_s = 0.0
        # repeats outermost and policies interleaved, so drift in machine load hits every policy alike
        for rep in range(repeats):
            left = ctx.budget_left()
            if rep and left is not None and left < 3 * last_run_s * len(POLICIES):
                break           # keep what this level has; the next repeat would not fit the budget
            for policy in POLICIES:
                t0 = time.perf_counter()
                engine, run = run_level(model, draft, conc, prompts[:n], lengths[:n], arrivals, ecfg[policy], timer)
                last_run_s = max(last_run_s, time.perf_counter() - t0)
                runs[policy].append(run_numbers(engine, run, conc))
                outputs.setdefault(policy, run.outputs)
                engines[policy] = engine
                # the drafter's slots take budget too (vLLM's policies): tokens + slots of the scheduled requests
                charged = [s.num_tokens + (0 if policy == "decode-only" else s.num_scheduled * slots)
                           for s in engine.steps]
                max_step[policy] = max(max_step.get(policy, 0), max(charged))
                budget_ok[policy] = budget_ok.get(policy, True) and max_step[policy] <= max_num_batched_tokens
                expected = [expected_reservation(policy, s, max_num_seqs=max_num_seqs, num_spec_tokens=num_spec_tokens,
                                                 draft_slots=slots) for s in engine.steps]
                reserve_ok[policy] = reserve_ok.get(policy, True) and expected == [s.reserved for s in engine.steps]
        for policy in POLICIES:
            engine = engines[policy]
            rec = ctx.new_record(f"{policy}-c{conc}", variant=policy, workload={
                "model": f"tiny-decoder L{n_layers} d{d_model} h{n_heads}/{n_kv_heads} V{vocab} "
                         f"({cfg.n_params() / 1e6:.2f}M params)",
                "model_revision": f"sha256:{sha[:16]} (random init, seed {ctx.seed})",
                "quantization": f"none ({dtype})", "dtype": dtype,
                "input_len": input_len, "output_len": f"uniform [{max(1, output_len // 2)}, "
                                                      f"{output_len + output_len // 2}], mean {output_len}",
                "batch": f"max concurrency {conc}", "concurrency": conc, "num_requests": n,
                "repeats": len(runs[policy]), "repeats_planned": repeats,
                "arrivals": f"open loop, Poisson at {significant(rate)} req/s = {load} x {conc} / "
                            f"{significant(alone)} s (one request alone), at most {conc} in flight",
                "request_rate": rate, "single_request_s": alone, "load": load,
                "prefix_caching": False, "num_spec_tokens": num_spec_tokens, "drafter": draft.name,
                "draft_slots": slots, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "timer": TIMER_LABELS[timer], "torch_threads": threads,
            }, topology={"ranks": 1, "tp": 1})
            rec.set_backend("attention", paged_kernels_label(kernels),
                            reason="PyTorch reference path of this engine; SDPA kernel observed on its call shapes",
                            dtype=dtype,
                            shapes={"kv_pool": [n_layers, engine.block_manager.num_blocks * engine.config.block_size,
                                                n_kv_heads, cfg.head_dim], "block_size": engine.config.block_size})
            rec.backends["attention"]["kernels"] = {c: {"kernel": r["kernel"], "op": r["op"]} for c, r in kernels.items()}
            rec.set_backend("spec_budget", policy, reason="the variant under study",
                            shapes={"hold-back": {"static": f"{max_num_seqs} x {slots} slots",
                                                  "adaptive": f"{slots} slots per scheduled request",
                                                  "decode-only": "decoding x (1+k)"}[policy]})
            for name, (unit, phase) in METRICS.items():
                values = [r[name] for r in runs[policy]]
                extra = {}
                if name == "mean_ttft":   # every request's TTFT, over all repeats
                    extra["samples_s"] = [t for r in runs[policy] for t in r["_ttfts"]]
                rec.add(name, statistics.median(values), unit, phase=phase, runs=values,
                        aggregate=f"median of {len(values)} run(s)", **extra)
            rec.get("overhead_share")["definition"] = (
                "(schedule + host drafting + batch preparation + state update) / step time, median over steps "
                f"with >= {min(conc, 2)} requests decoding")
            rec.add_check("step tokens (with charged draft slots) within budget", budget_ok[policy],
                          error=max_step[policy], tolerance=max_num_batched_tokens)
            rec.add_check("reservation follows the policy", reserve_ok[policy])
            if policy != "static" and dtype == "float32":
                # exact only in fp32 here: other batch shapes may round differently in low precision
                rec.add_check("same tokens as the static policy (greedy, fp32)", outputs[policy] == outputs["static"])
            elif policy != "static":
                same = sum(a == b for a, b in zip(outputs[policy], outputs["static"])) / len(outputs[policy])
                rec.add("same_output_share", same, "fraction of requests", phase="total",
                        note=f"{dtype}: batch shapes differ between policies, so greedy tokens may too")
            records.append(rec)
    return records


def seed_beside_ours(records: list[RunRecord]) -> list[dict]:
    """The seed's table next to this run's, one row per concurrency (seed's hardware is not ours).
    Ours: each policy's output tok/s, mean TTFT, and how many requests were split."""
    ours = {(r.variant, r.workload["concurrency"]): r for r in records if "concurrency" in r.workload}
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
            row[f"ours {policy} TTFT ms"] = significant(1e3 * r.value("mean_ttft"))
            row[f"ours {policy} split"] = f"{int(r.value('splits'))}/{r.workload['num_requests']}"
        rows.append(row)
    return rows


def budget_arithmetic(*, input_len: int, max_num_batched_tokens: int, max_num_seqs: int, num_spec_tokens: int,
                      concurrencies, drafter: str = "parallel") -> list[dict]:
    """What a request arriving at concurrency c finds when the other c - 1 are decoding: what each
    policy holds back and what is left for its prompt (the decodes' 1 + k verify tokens are paid first)."""
    slots = draft_slots_for(drafter, num_spec_tokens)
    rows = []
    for c in concurrencies:
        others = int(c) - 1
        for policy in POLICIES:
            held = {"static": max_num_seqs * slots, "adaptive": (others + 1) * slots,
                    "decode-only": others * (1 + num_spec_tokens)}[policy]
            decodes = 0 if policy == "decode-only" else others * (1 + num_spec_tokens)
            left = max_num_batched_tokens - held - decodes
            rows.append({"concurrency": int(c), "policy": policy, "others decoding": others,
                         "held back for speculation": held, "their verify tokens (charged)": decodes,
                         "left for the prompt": left, "prompt": input_len,
                         "prompt split?": "yes" if left < input_len else "no"})
    return rows


def comparisons(records: list[RunRecord], base: str = "static") -> list[dict]:
    """Each policy against `base` at each concurrency: output throughput (over repeats) and the
    TTFT (over every request of every repeat), via `compare_timings`."""
    by = {(r.variant, r.workload["concurrency"]): r for r in records if "concurrency" in r.workload}
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
        ta, tb = r.get("mean_ttft").get("samples_s", []), b.get("mean_ttft").get("samples_s", [])
        if len(ta) >= 2 and len(tb) >= 2 and min(ta + tb) > 0:
            cmp = compare_timings(ta, tb)
            row.update({"TTFT ratio": significant(cmp.ratio), "TTFT interval": cmp.interval(),
                        "TTFT verdict": {"faster": "shorter", "slower": "longer"}.get(cmp.verdict, cmp.verdict),
                        "_ttft": cmp})
        else:
            row.update({"TTFT verdict": "fewer than two requests a side"})
        rows.append(row)
    return rows


def load_records(records: list[RunRecord]) -> list[RunRecord]:
    """The (policy, concurrency) records, without the #51725 table's."""
    return [r for r in records if "concurrency" in r.workload]


def chart_rows(records: list[RunRecord], metric: str, scale: float = 1.0) -> list[dict]:
    """One row per record: concurrency, policy and the metric's value (times `scale`)."""
    return [{"concurrency": str(r.workload["concurrency"]), "policy": r.variant, "value": scale * r.value(metric)}
            for r in load_records(records)]


def step_breakdown_rows(records: list[RunRecord]) -> list[dict]:
    """Median time of each step phase (ms) over the steps that verified drafts, per record."""
    rows = []
    for r in load_records(records):
        for phase in STEP_PHASES:
            rows.append({"record": r.name, "concurrency": str(r.workload["concurrency"]), "policy": r.variant,
                         "phase": phase, "ms": 1e3 * r.value(f"{phase}_time")})
    return rows


def overhead_rows(records: list[RunRecord]) -> list[dict]:
    """Median per-step time split into the engine's own work and the rest, per record."""
    rows = []
    for r in load_records(records):
        step, share = r.value("step_time"), r.value("overhead_share")
        rows.append({"record": r.name, "concurrency": r.workload["concurrency"], "policy": r.variant,
                     "median step ms": significant(1e3 * step), "overhead share": significant(share),
                     "of which draft ms": significant(1e3 * r.value("draft_time")),
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
