"""Chapter `kimi-dspark-acceptance`: how far a hidden-state draft gets, per task, and what it costs.

The seed (section 二, DSpark) quotes the model card of a five-layer, eight-position Kimi K3 draft:
mean acceptance length 6.42 on math reasoning, 4.96 on HumanEval, 3.28 on QA — the task
distribution changes acceptance — and warns that choosing a draft by acceptance alone, without
measuring per-round time, can pick a larger draft that is not faster.

Here a small byte-level target and two hidden-state drafts (`draft.py`; 1 and 3 layers, each reading
three target layers and attending over its own KV cache as EAGLE-3 does) were
trained on three corpora (`corpora.py`: math, code, qa) by `train.py`, hidden-state extraction and
draft training in separate processes; the weights are committed in `data/models/`. `measure`
generates from held-out prompts of each task with k = 8 draft positions and returns records of
acceptance (per position, cumulative and conditional), Leviathan et al.'s expected length, and the
measured cost model: per-round time = draft time x k + verify time, and time per generated token.
Beside them the DSpark-style parallel block draft (`block_draft.py`): one draft forward + one verify,
once verifying the whole block and once with its confidence head cutting the block at the first slot
below `confidence_threshold` (DeepSpec's rule), so the verify covers the anchor + the kept drafts.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..errors import UserError
from ..measure import significant
from ..presets import Param
from ..record import RunRecord
from ..serving.config import EngineConfig
from ..serving.corpora import TASKS, encode, load_corpus
from ..serving.draft import HiddenStateDrafter, draft_metadata, load_draft
from ..serving.engine import LLMEngine
from ..serving.metrics import run_closed_loop
from ..serving.model import load_weights
from ..serving.model_runner import observed_paged_kernels, paged_kernels_label
from ..serving.sequence import SamplingParams
from ..device import torch_threads
from ..serving.speculative import leviathan_expected_length
from ..serving.block_draft import BlockDrafter, load_block_draft
from ..serving.config import draft_slots_for
from ..serving.train import BLOCK_DRAFT_FILE, DRAFTS, TARGET_FILE, draft_file, run_all

PARALLEL = "parallel"   # the DSpark-style block draft (one forward per round), beside the chain drafts
PARALLEL_CUT = "parallel-cut"   # the same draft with its confidence head cutting each block (DSpark's threshold)

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('small-math', 'mean_acceptance_length', 'Mean acceptance length of the small draft on math prompts')

PARAMETERS = {
    "num_spec_tokens": Param(int, 8, help="draft positions per round, k (the seed: 8)"),
    "prompts_per_task": Param(int, help="held-out prompts per task"),
    "code_prompt_chars": Param(int, 96, help="characters of a code document used as its prompt"),
    "output_len": Param(int, help="generated tokens per prompt"),
    "temperature": Param(float, 0.7, help="sampling temperature of target and drafts (0: greedy)"),
    "retrain": Param(bool, False, help="train target and drafts again in this run (minutes on CPU)"),
    "target_steps": Param(int, 600, help="target training steps when retraining"),
    "draft_steps": Param(int, 800, help="draft training steps when retraining"),
    "confidence_threshold": Param(float, 0.2, min=0.0, max=1.0, help="DSpark's confidence cut for the parallel draft: each block is "
                                                   "cut at its first slot with sigmoid(confidence) below this, and "
                                                   "only the slots before it are verified (0: no cut run)"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
    "timer": Param(str, help="'wall' (perf_counter, device synchronised) or 'process' (CPU seconds of this "
                             "process: on a shared CPU machine, excludes time spent waiting for a core)",
                   choices=("wall", "process")),
}

PRESETS = {
    "smoke": dict(prompts_per_task=2, output_len=12, timer="process"),   # two a task: the page compares per-request rates
    # cpu: the decode rounds bind a cold `make book` (three tasks x six engine runs): eight requests a task
    # (from 12) of 36 output tokens (from 64, 96 before that) cut them by almost two thirds; the per-request
    # comparison still reads eight requests a side per task and 24 pooled (standard errors grow by about
    # sqrt(2.7))
    "cpu": dict(prompts_per_task=8, output_len=36, timer="process"),
    # gpu: sized to the lent machine's minutes (`inferbook budgets --preset gpu`): the engine's Python and
    # eager calls per token bind it; the cpu preset holds the larger sample. 18 output tokens (from 24)
    # since the confidence-cut pass joined the drafts: four prompts per task kept, fewer rounds each
    "gpu": dict(prompts_per_task=4, output_len=18, timer="wall"),
}

# The seed's model-card numbers (RedHatAI Kimi K3 DSpark draft: 5 layers, 8 draft positions).
SEED_ACCEPTANCE = {"math": ("math reasoning", 6.42), "code": ("HumanEval", 4.96), "qa": ("QA", 3.28)}


def models_dir() -> Path:
    from ..context import repo_root

    return repo_root() / "data" / "models"


def model_paths(root: Path) -> dict[str, Path]:
    return {"target": root / TARGET_FILE, **{name: root / draft_file(name) for name in DRAFTS},
            PARALLEL: root / BLOCK_DRAFT_FILE}


REBUILD_MODELS = ("python -m inferbook.serving.train all --out data/models --shards _build/dspark-shards "
                  "(data/models/README.md), or run with -p retrain true")


def committed_models() -> dict[str, Path]:
    """The committed weights; a missing file is one UserError naming the command that rebuilds it
    (never a silent retrain: that takes minutes and gives other weights)."""
    paths = model_paths(models_dir())
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        raise UserError(f"model file(s) {', '.join(missing)} missing from data/models; rebuild with {REBUILD_MODELS}")
    return paths


def ensure_models(ctx, retrain: bool, target_steps: int, draft_steps: int) -> tuple[dict[str, Path], str]:
    """The committed weights, or (retrain=True) freshly trained ones."""
    if not retrain:
        return committed_models(), "committed (data/models, see its README)"
    from ..context import results_dir

    out = results_dir() / ctx.chapter.slug / "models"
    run_all(out, results_dir() / ctx.chapter.slug / "shards", target_steps=target_steps, draft_steps=draft_steps,
            threads=max(1, torch.get_num_threads()), log=lambda *_: None)
    return model_paths(out), f"retrained in this run ({target_steps} target / {draft_steps} draft steps)"


def task_prompts(task: str, n: int, code_chars: int) -> list[list[int]]:
    """Held-out prompts: math and qa up to the answer marker 'A:', code the first lines of a block."""
    docs = [d for d in load_corpus(task, "test") if len(d) > 40]
    prompts = []
    for doc in docs[:n]:
        if task in ("math", "qa"):
            text = doc[:doc.index("\nA:") + 3] if "\nA:" in doc else doc[:code_chars]
        else:
            text = doc[:code_chars]
            text = text[:text.rfind("\n") + 1] or text
        prompts.append(encode(text))
    if len(prompts) < n:
        raise UserError(f"task {task!r} has only {len(prompts)} held-out prompts, {n} asked")
    return prompts


def sha(path: Path) -> str:
    """The weights' revision: a hash of the tensors (names, dtypes, shapes, bytes), not of the file."""
    from ..record import safetensors_revision

    return safetensors_revision(path)


def decode_steps(engine) -> list:
    return [s for s in engine.steps if s.num_prefill_tokens == 0]


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def run_task(target, prompts, params: SamplingParams, k: int, drafter=None, timer: str = "wall"):
    """Requests one at a time (batch 1, where speculation matters most); returns (engine, run)."""
    kind = getattr(drafter, "kind", None)
    slots = draft_slots_for(kind, k) if drafter is not None and kind else 0
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=max(512, max(map(len, prompts)) + k + 1 + slots),
                       num_spec_tokens=k if drafter is not None else 0, draft_slots=slots)
    engine = LLMEngine(target, cfg, drafter=drafter, clock=CLOCKS[timer])
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=params.temperature))   # warm-up
    engine.steps.clear()
    engine.acceptance.clear()
    return engine, run_closed_loop(engine, prompts, params, 1)


def quantile(xs, q: float) -> float:
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q))


def per_request_rates(run) -> list[float]:
    """Decode tokens per second of each request: (output tokens - 1) / (end-to-end - TTFT)."""
    return [(r.output_len - 1) / (r.e2e_s - r.ttft_s) for r in run.requests if r.output_len > 1 and r.e2e_s > r.ttft_s]


def cost_spread(steps, accepted: list[int], k: int, *, seed: int = 0, n_boot: int = 2000,
                confidence: float = 0.9) -> dict:
    """Per-round samples and bootstrap intervals of what a draft choice rests on.

    `steps` are the decode steps (batch 1: one verification round each) and `accepted` the accepted
    drafts of each round, in order. Returns the draft and verify time of each round, the mean
    acceptance length with its interval, and the expected rate sum(accepted + 1) / sum(round time)
    with its interval, both by resampling rounds (percentile bootstrap)."""
    n = min(len(steps), len(accepted))
    if n < 2:
        raise UserError(f"only {n} verification round(s) were measured; raise output_len or prompts_per_task")
    steps, accepted = steps[-n:], accepted[-n:]   # a round per decode step; both in order
    a = torch.tensor(accepted, dtype=torch.float64) + 1
    t = torch.tensor([s.total_s for s in steps], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (n_boot, n), generator=g)
    tail = (1 - confidence) / 2
    qs = torch.tensor([tail, 1 - tail], dtype=torch.float64)
    tau_lo, tau_hi = torch.quantile(a[idx].mean(1), qs).tolist()
    rate_lo, rate_hi = torch.quantile(a[idx].sum(1) / t[idx].sum(1), qs).tolist()
    return {"draft_s": [s.draft_s for s in steps], "verify_s": [s.forward_s for s in steps],
            "tau_lo": tau_lo, "tau_hi": tau_hi, "rate": float(a.sum() / t.sum()), "rate_lo": rate_lo,
            "rate_hi": rate_hi}


def recommend(records: list[RunRecord], a: str = "small", b: str = "large") -> list[dict]:
    """Per task, and over all tasks pooled: which draft gives more decode tokens per second, by more
    than the noise. Samples are the requests' own decode rates (`request_tokens_per_s` runs);
    `compare_timings(higher_is_better=True)` gives the verdict. 'cannot tell' where the interval of
    the ratio contains 1."""
    from ..measure import compare_timings

    rates = {(r.variant, r.workload["task"]): r.get("request_tokens_per_s")["runs"]
             for r in records if r.variant.startswith("draft ")}
    tasks = sorted({t for _, t in rates}, key=TASKS.index)
    rows = []
    for task in tasks + ["all tasks"]:
        pick = (lambda d: rates[(f"draft {d}", task)]) if task != "all tasks" else (
            lambda d: [x for t in tasks for x in rates[(f"draft {d}", t)]])
        xa, xb = pick(a), pick(b)
        cmp = compare_timings(xb, xa, higher_is_better=True)
        choice = {True: b, False: a, None: "cannot tell"}[cmp.a_better]
        rows.append({"task": task, "recommended": choice, "ratio": cmp.ratio, f"{b} / {a} tokens/s": cmp.ratio,
                     "lo": cmp.lo,
                     "hi": cmp.hi, "requests": f"{len(xb)} and {len(xa)}", "sentence": cmp.sentence(
                         f"the {b} draft", f"the {a} draft"), "_cmp": cmp})
    return rows


def check_params(params: dict) -> None:
    """Every knob, before any work: k, sizes, the held-out corpus (prompts per task), the committed
    models (present, and the target's context holds prompt + output + k)."""
    from ..serving.config import check_spec_tokens
    from ..serving.weights import open_model_file

    k = check_spec_tokens(params["num_spec_tokens"])
    for name, low in (("prompts_per_task", 1), ("code_prompt_chars", 1), ("output_len", 2),
                      ("target_steps", 1), ("draft_steps", 1)):
        if params[name] < low:
            raise UserError(f"{name}={params[name]} must be >= {low}")
    t = params["temperature"]
    if not (t == t and 0 <= t <= 100):
        raise UserError(f"temperature={t!r} must be a number in [0, 100]")
    for task in TASKS:
        have = sum(1 for d in load_corpus(task, "test") if len(d) > 40)
        if params["prompts_per_task"] > have:
            raise UserError(f"prompts_per_task={params['prompts_per_task']}: task {task!r} has only {have} held-out "
                            "prompts")
    if params["retrain"]:
        return
    meta, _ = open_model_file(committed_models()["target"], kind="target", rebuild=REBUILD_MODELS)
    try:
        max_seq = int(meta.get("max_seq", 0))
    except ValueError:
        return  # the loader names the bad metadata
    longest = max(len(p) for task in TASKS for p in task_prompts(task, params["prompts_per_task"],
                                                                  params["code_prompt_chars"]))
    if max_seq and longest + params["output_len"] + k > max_seq:
        raise UserError(f"prompts of {longest} tokens + output_len={params['output_len']} + k={k} exceed the "
                        f"target's context ({max_seq}); lower output_len to at most {max_seq - longest - k}")
    block_file = committed_models()[PARALLEL]
    if block_file.is_file():   # the parallel draft drafts a fixed block: k must be that block
        import json

        meta, _ = open_model_file(block_file, kind="parallel draft", rebuild=REBUILD_MODELS)
        try:
            block = int(json.loads(meta.get("config", "{}")).get("block", k))
        except (ValueError, TypeError, AttributeError):
            return  # the loader names the bad metadata
        if block != k:
            raise UserError(f"num_spec_tokens={k}: the committed parallel draft drafts {block} positions per forward; "
                            f"use num_spec_tokens {block} (or retrain it with --block {k})")


def measure(ctx, *, cpu_threads, **params) -> list[RunRecord]:
    with torch_threads(ctx.device, cpu_threads) as threads:
        records = _measure(ctx, **params)
    for r in records:
        r.workload["torch_threads"] = threads
    return records


def _measure(ctx, *, num_spec_tokens, prompts_per_task, code_prompt_chars, output_len, temperature, retrain,
             target_steps, draft_steps, timer, confidence_threshold=0.0) -> list[RunRecord]:
    from ..serving.config import check_spec_tokens

    k = check_spec_tokens(num_spec_tokens)
    thr = confidence_threshold
    if not (thr == thr and 0 <= thr <= 1):
        raise UserError(f"confidence_threshold={thr!r} must be a number in [0, 1] (0: no cut run)")
    if timer == "process" and ctx.device.type == "cuda":
        raise UserError("timer='process' measures CPU seconds and cannot time GPU work; use timer='wall' on cuda")
    if prompts_per_task < 1 or output_len < 2:
        raise UserError(f"prompts_per_task={prompts_per_task} must be >= 1 and output_len={output_len} >= 2")
    paths, provenance = ensure_models(ctx, retrain, target_steps, draft_steps)
    target = load_weights(paths["target"], ctx.device)
    drafts = {name: load_draft(paths[name], target) for name in DRAFTS}
    block = load_block_draft(paths[PARALLEL], target) if paths[PARALLEL].is_file() else None
    if block is not None and block.cfg.block != k:
        raise UserError(f"the committed parallel draft drafts {block.cfg.block} positions per forward; "
                        f"num_spec_tokens={k} asks for another block size (retrain it with --block)")
    target_sha = sha(paths["target"])
    kernels = observed_paged_kernels(target.cfg, torch.float32, ctx.device, prefill_len=code_prompt_chars,
                                     context_len=code_prompt_chars + output_len, k=k)
    records = []
    for task in TASKS:
        prompts = task_prompts(task, prompts_per_task, code_prompt_chars)
        if max(map(len, prompts)) + output_len + k > target.cfg.max_seq:
            raise UserError(f"prompts of {max(map(len, prompts))} tokens + output_len {output_len} + k exceed the "
                             f"target's context ({target.cfg.max_seq}); lower output_len")
        sp = SamplingParams(max_tokens=output_len, temperature=temperature, seed=ctx.seed)
        plain_engine, plain = run_task(target, prompts, sp, k, timer=timer)
        plain_steps = decode_steps(plain_engine)
        plain_tpot = sum(s.total_s for s in plain_steps) / len(plain_steps)
        common = {"model": f"byte-level tiny-decoder L{target.cfg.n_layers} d{target.cfg.d_model} "
                           f"({target.cfg.n_params() / 1e6:.2f}M params)",
                  "model_revision": f"sha256:{target_sha[:16]} ({provenance})",
                  "quantization": "none (float32)", "dtype": "float32", "task": task,
                  "input_len": round(statistics.fmean(map(len, prompts)), 1), "output_len": output_len,
                  "batch": 1, "num_prompts": len(prompts), "temperature": temperature, "num_spec_tokens": k,
                  "timer": {"wall": "perf_counter, device synchronised",
                            "process": "process CPU time (time.process_time)"}[timer]}
        rec = ctx.new_record(f"plain-{task}", variant="no speculation", workload={**common, "draft": "none"},
                             topology={"ranks": 1})
        rec.add("time_per_token", plain_tpot, "s", phase="decode", steps=len(plain_steps),
                definition="mean decode step time (one token per step)")
        rec.add("request_tokens_per_s", statistics.median(per_request_rates(plain)), "tokens/s", phase="decode",
                runs=per_request_rates(plain), definition="per request: (output tokens - 1) / decode time")
        records.append(rec)
        greedy = SamplingParams(max_tokens=min(32, output_len))
        greedy_plain = run_task(target, prompts[:2], greedy, k)[1].outputs
        entries = list(drafts.items()) + ([(PARALLEL, block)] if block is not None else []) + (
            [(PARALLEL_CUT, block)] if block is not None and thr > 0 else [])
        for name, draft in entries:
            parallel, cut = name in (PARALLEL, PARALLEL_CUT), name == PARALLEL_CUT
            make = ((lambda t=temperature, c=(thr if cut else 0.0): BlockDrafter(block, t, seed=ctx.seed,
                                                                                 confidence_threshold=c))
                    if parallel else (lambda t=temperature, d=draft: HiddenStateDrafter(d, t, seed=ctx.seed)))
            drafter = make()
            engine, run = run_task(target, prompts, sp, k, drafter, timer=timer)
            acc = engine.acceptance
            steps = decode_steps(engine)
            # a chain pays k draft steps per round, the parallel draft one forward
            t_draft = statistics.median(s.draft_s for s in steps) / (1 if parallel else k)
            t_verify = statistics.median(s.forward_s for s in steps)
            t_rest = statistics.median(s.total_s - s.draft_s - s.forward_s for s in steps)
            tau = acc.mean_acceptance_length()
            tau_err = statistics.stdev(acc.accepted) / len(acc.accepted) ** 0.5 if acc.rounds > 1 else float("inf")
            measured_tpot = sum(s.total_s for s in steps) / sum(a + 1 for a in acc.accepted)
            spread = cost_spread(steps, acc.accepted, k, seed=ctx.seed)
            meta = draft_metadata(paths[name]) if not parallel else _block_meta(paths[PARALLEL])
            n_par = sum(p.numel() for p in draft.parameters()) / 1e6
            desc = (f"DSpark-style parallel block draft: one forward over an anchored block of {k} positions, "
                    f"{draft.cfg.n_layers} layer(s) attending to the last {draft.cfg.window} target features, "
                    f"Markov head rank {draft.cfg.markov_rank}, confidence head ({n_par:.2f}M params)"
                    + (f"; blocks cut at the first slot with confidence < {thr}" if cut else "; whole block verified")
                    if parallel else
                    f"hidden-state draft, {draft.cfg.n_layers} layer(s) with own attention "
                    f"({draft.cfg.n_heads} heads, {draft.cfg.n_kv_heads} KV heads) and KV cache, "
                    f"ffn {draft.cfg.ffn}, reads "
                    f"target layers {draft.cfg.feature_layers or target.cfg.n_layers} "
                    f"({draft.cfg.n_params() / 1e6:.2f}M params)")
            rec = ctx.new_record(f"{name}-{task}", variant=f"draft {name}", workload={
                **common, "draft": desc,
                "confidence_threshold": thr if cut else 0.0,
                "draft_revision": f"sha256:{sha(paths[PARALLEL if parallel else name])[:16]} (trained "
                                  f"{meta.get('steps', '?')} steps from "
                                  f"{meta.get('trained_from', '?')})"}, topology={"ranks": 1})
            rec.set_backend("attention", paged_kernels_label(kernels),
                            reason="PyTorch path of this engine; SDPA kernel observed on its call shapes")
            rec.add("mean_acceptance_length", tau, "tokens per round", phase="decode", rounds=acc.rounds,
                    stderr=tau_err)
            for i, (cum, cond) in enumerate(zip(acc.cumulative(), acc.conditional()), start=1):
                rec.add(f"accepted_ge_{i}", cum, "fraction of rounds", phase="decode", position=i,
                        kind="cumulative P(accepted >= i)")
                rec.add(f"accept_given_{i - 1}", cond if cond == cond else 0.0, "fraction", phase="decode",
                        position=i, kind="conditional P(accepted >= i | accepted >= i-1)", defined=cond == cond)
            alpha = acc.alpha()
            rec.add("alpha", alpha, "fraction", phase="decode", definition="accepted / draft tokens examined")
            rec.add("leviathan_expected_length", leviathan_expected_length(alpha, k), "tokens per round",
                    phase="decode", formula="(1 - alpha^(k+1)) / (1 - alpha)")
            n_draft = 1 if parallel else k
            rec.add("draft_time_per_position" if not parallel else "draft_time_per_forward", t_draft, "s",
                    phase="decode", forwards_per_round=n_draft)
            n_verified = acc.mean_proposed()
            rec.add("verify_time", t_verify, "s", phase="decode", tokens=k + 1 if not cut else 1 + n_verified)
            rec.add("mean_verified_drafts", n_verified, "drafts per round", phase="decode",
                    definition="drafts put to the target per round: k, or the confidence cut's length")
            for i, reach in enumerate(acc.reached(), start=1):
                rec.add(f"verified_ge_{i}", reach, "fraction of rounds", phase="decode", position=i,
                        kind="P(block verified through slot i)")
            if cut:   # the cut as the drafter decided it is what the engine verified, round by round
                decided = [n for row in drafter.lengths_log for n in row]
                ran = acc.proposed
                rec.add_check("the engine verified exactly the drafts the confidence cut kept",
                              decided[-len(ran):] == ran and all(a <= n for a, n in zip(acc.accepted, ran))
                              and len(decided) >= len(ran),
                              error=sum(a != b for a, b in zip(decided[-len(ran):], ran)), tolerance=0)
                rec.add("cut_rounds", sum(n < k for n in ran) / len(ran), "fraction of rounds", phase="decode",
                        definition=f"rounds whose block was cut before slot {k}")
            rec.add("other_time_per_round", t_rest, "s", phase="decode")
            rec.add("round_time_model", n_draft * t_draft + t_verify, "s", phase="decode",
                    formula=("one draft forward + verify of the cut block" if cut else "one draft forward + verify time")
                    if parallel else "draft time x k + verify time")
            rec.add("time_per_token_model", (n_draft * t_draft + t_verify + t_rest) / tau, "s", phase="decode",
                    formula=("(draft forward + verify + other)" if parallel else "(draft x k + verify + other)")
                    + " / mean acceptance length")
            rec.add("round_time", statistics.median(s.total_s for s in steps), "s", phase="decode",
                    definition="median decode step (one round) time, measured")
            rec.add("time_per_token", measured_tpot, "s", phase="decode",
                    definition="total decode step time / tokens emitted, measured")
            rec.add("speedup_vs_plain", plain_tpot / measured_tpot, "x", phase="decode")
            # the numbers the choice rests on, each with its spread from this run
            rec.add("acceptance_length_ci", tau, "tokens per round", phase="decode", lo=spread["tau_lo"],
                    hi=spread["tau_hi"], definition="mean acceptance length, 90 % bootstrap interval over rounds")
            rec.add("draft_time_per_step", statistics.median(spread["draft_s"]), "s", phase="decode",
                    samples_s=spread["draft_s"], p10_s=quantile(spread["draft_s"], 0.1),
                    p90_s=quantile(spread["draft_s"], 0.9), definition=f"draft time of one round ({k} positions)")
            rec.add("verify_time_per_step", statistics.median(spread["verify_s"]), "s", phase="decode",
                    samples_s=spread["verify_s"], p10_s=quantile(spread["verify_s"], 0.1),
                    p90_s=quantile(spread["verify_s"], 0.9),
                    definition=(f"target forward over the anchor + the kept drafts (mean {significant(1 + n_verified)} "
                                "tokens)") if cut else f"target forward over 1 + k = {k + 1} tokens")
            rec.add("expected_tokens_per_s", spread["rate"], "tokens/s", phase="decode", lo=spread["rate_lo"],
                    hi=spread["rate_hi"], definition="sum(accepted + 1) / sum(round time) over rounds, 90 % "
                                                     "bootstrap interval resampling rounds")
            rec.add("request_tokens_per_s", statistics.median(per_request_rates(run)), "tokens/s", phase="decode",
                    runs=per_request_rates(run), definition="per request: (output tokens - 1) / decode time")
            # exactness, on two prompts: greedy speculation with this draft must give plain greedy's tokens
            greedy_spec = run_task(target, prompts[:2], greedy, k, make(0.0))[1].outputs
            rec.add_check("greedy speculative output equals plain greedy", greedy_spec == greedy_plain,
                          error=sum(a != b for a, b in zip(greedy_spec, greedy_plain)), tolerance=0)
            records.append(rec)
    return records


def _block_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def acceptance_rows(records: list[RunRecord]) -> list[dict]:
    """Per (draft, task): mean acceptance length beside the seed's model-card number for that task."""
    rows = []
    for r in records:   # the cut draft has its own table (`cut_rows`): Leviathan's formula assumes k verified
        if not r.name.startswith(tuple(DRAFTS) + (PARALLEL,)) or r.name.startswith(PARALLEL_CUT):
            continue
        task = r.workload["task"]
        seed_name, seed_value = SEED_ACCEPTANCE[task]
        rows.append({"draft": r.variant, "task": task,
                     "ours: acceptance length": round(r.value("mean_acceptance_length"), 2),
                     "± std. error": round(r.get("mean_acceptance_length")["stderr"], 2),
                     "ours: Leviathan from alpha": round(r.value("leviathan_expected_length"), 2),
                     "ours: alpha": round(r.value("alpha"), 3), "rounds": r.get("mean_acceptance_length")["rounds"],
                     "seed task": seed_name, "seed: acceptance length": seed_value})
    return rows


def cut_rows(records: list[RunRecord]) -> list[dict]:
    """Per task (and pooled): the parallel draft verifying its whole block against the same draft with
    the confidence cut — acceptance, drafts verified, verify time, and which gives more decode tokens
    per second by more than the noise (`recommend`, the requests' own rates)."""
    full = {r.workload["task"]: r for r in records if r.variant == f"draft {PARALLEL}"}
    cut = {r.workload["task"]: r for r in records if r.variant == f"draft {PARALLEL_CUT}"}
    if not cut:
        return []
    label = {PARALLEL: "whole block", PARALLEL_CUT: "cut", "cannot tell": "cannot tell"}
    rows = []
    for r in recommend(records, PARALLEL, PARALLEL_CUT):
        t = r["task"]
        f, c = (full.get(t), cut.get(t)) if t != "all tasks" else (None, None)
        rows.append({"task": t, "threshold": next(iter(cut.values())).workload["confidence_threshold"],
                     "acceptance length, whole block": significant(f.value("mean_acceptance_length")) if f else None,
                     "acceptance length, cut": significant(c.value("mean_acceptance_length")) if c else None,
                     "drafts verified per round, cut": significant(c.value("mean_verified_drafts")) if c else None,
                     "rounds cut": significant(c.value("cut_rounds")) if c else None,
                     "verify ms / round, whole block": significant(1e3 * f.value("verify_time_per_step")) if f else None,
                     "verify ms / round, cut": significant(1e3 * c.value("verify_time_per_step")) if c else None,
                     "cut / whole tokens/s": significant(r["ratio"]),
                     "90 % interval": f"{significant(r['lo'])}–{significant(r['hi'])}",
                     "recommended": label[r["recommended"]],
                     "_sentence": r["sentence"]})
    return rows


def position_rows(records: list[RunRecord], draft: str) -> list[dict]:
    rows = []
    for r in records:
        if r.variant != f"draft {draft}":
            continue
        for m in r.measurements:
            if m["name"].startswith("accepted_ge_"):
                rows.append({"task": r.workload["task"], "position": m["position"], "value": m["value"],
                             "kind": "cumulative P(accepted >= i)"})
            elif m["name"].startswith("verified_ge_") and r.variant == f"draft {PARALLEL_CUT}":
                rows.append({"task": r.workload["task"], "position": m["position"], "value": m["value"],
                             "kind": "P(block verified through slot i)"})
            elif m["name"].startswith("accept_given_") and m.get("defined", True):
                rows.append({"task": r.workload["task"], "position": m["position"], "value": m["value"],
                             "kind": "conditional P(>= i | >= i-1)"})
    return rows


def cost_rows(records: list[RunRecord]) -> list[dict]:
    plain = {r.workload["task"]: r.value("time_per_token") for r in records if r.name.startswith("plain-")}
    rows = []
    for r in records:
        if not r.name.startswith(tuple(DRAFTS) + (PARALLEL,)):
            continue
        task = r.workload["task"]
        ci = r.get("acceptance_length_ci")
        dr, vr = r.get("draft_time_per_step"), r.get("verify_time_per_step")
        er = r.get("expected_tokens_per_s")
        rows.append({"task": task, "draft": r.variant,
                     "acceptance length": round(r.value("mean_acceptance_length"), 2),
                     "acceptance 90 % interval": f"{significant(ci['lo'])}–{significant(ci['hi'])}",
                     "draft ms / round (p10–p90)": f"{significant(1e3 * dr['value'])} "
                                                   f"({significant(1e3 * dr['p10_s'])}–{significant(1e3 * dr['p90_s'])})",
                     "verify ms / round (p10–p90)": f"{significant(1e3 * vr['value'])} "
                                                    f"({significant(1e3 * vr['p10_s'])}–{significant(1e3 * vr['p90_s'])})",
                     "expected tok/s (90 % interval)": f"{significant(er['value'])} "
                                                       f"({significant(er['lo'])}–{significant(er['hi'])})",
                     "ms / token (measured)": significant(1e3 * r.value("time_per_token")),
                     "ms / token, no speculation": significant(1e3 * plain[task]),
                     "speed-up": significant(r.value("speedup_vs_plain"))})
    return rows


def sample_continuations(temperatures, max_tokens: int, code_chars: int, seed: int, device,
                          threads: int = 1) -> list[dict]:
    """The committed target's continuation of one held-out prompt per task, at each temperature:
    what the drafts must guess."""
    from ..serving.corpora import decode

    rows = []
    with torch_threads(torch.device(device), threads):
        target = load_weights(committed_models()["target"], device)
        for task in TASKS:
            prompt = task_prompts(task, 1, code_chars)[0]
            for temp in temperatures:
                engine = LLMEngine(target, EngineConfig(max_num_seqs=1, max_num_batched_tokens=256))
                out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed))[0]
                rows.append({"task": task, "temperature": temp, "prompt": decode(prompt), "continuation": decode(out)})
    return rows
