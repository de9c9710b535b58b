"""Chapter `upgrade-record`: the record to keep before upgrading, made on a real small workload.

The seed's last section asks every comparison to keep commit, model revision, quantization
format, hardware, request lengths and the real backend, and to keep cold start, model load
and steady state apart, and TTFT, decode and total apart. This module runs a tiny decoder
(`model.py`) in four configurations and returns one RunRecord each:

- `eager` and `compiled` (torch.compile): comparable — same weights, backend, quantization;
- `int8`: INT8 weight-only — `compare()` refuses it against `eager` (quantization differs);
- `math-attention`: explicit-softmax attention — refused too (attention backend differs).

The attention backend recorded is the kernel that ran, not the one configured: for the `sdpa`
model, `inferbook.sdpa.sdpa_record` runs SDPA on the prefill's and decode's own shapes, dtype, mask
and device, restricted to each backend in priority order, and records the first that runs
(flash / efficient / math / cuDNN) with the ATen op the profiler saw.
"""
from __future__ import annotations

import statistics

import torch

from ..measure import PhaseTimer
from ..presets import Param
from ..record import RunRecord
from ..serving.model import (TinyConfig, TinyDecoder, generate, init_weights, load_weights, quantize_int8_,
                    reference_logits, save_weights)
from ..sdpa import attention_kernels_in, sdpa_record
from ..tolerance import decisive_agreement, within_reference_error

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('eager', 'total', 'Total time of the eager run the record keeps')

PARAMETERS = {
    "d_model": Param(int, help="model width"),
    "n_layers": Param(int, help="decoder layers"),
    "n_heads": Param(int, help="query heads"),
    "n_kv_heads": Param(int, help="key/value heads (grouped-query attention)"),
    "ffn": Param(int, help="SwiGLU hidden size"),
    "vocab": Param(int, help="vocabulary size"),
    "batch": Param(int, help="requests per generate call"),
    "prompt_len": Param(int, help="prompt tokens per request"),
    "new_tokens": Param(int, help="generated tokens per request"),
    "dtype": Param(str, help="weights and activations", choices=("float32", "bfloat16", "float16")),
    "compile": Param(bool, True, help="also run the torch.compile configuration"),
    "reps": Param(int, help="steady-state repetitions"),
    "serve_requests": Param(int, min=0, help="requests of the open-loop serving run (0: skip)"),
    "request_rate": Param(float, help="open-loop arrivals per second (vLLM --request-rate)"),
    "burstiness": Param(float, 1.0, help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier (vLLM --burstiness)"),
    "max_concurrency": Param(int, help="requests in flight at most (vLLM --max-concurrency)"),
}

PRESETS = {
    # smoke: one layer, "does it run": torch.compile's cold graph is most of it (one layer: 71 CPU-s cold
    # against 104 with two, measured here; the test suite compiles it twice, float32 and the rehearsal's bfloat16)
    "smoke": dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, batch=2,
                  prompt_len=16, new_tokens=8, dtype="float32", reps=3, serve_requests=6, request_rate=50.0,
                  max_concurrency=2),
    # cpu: two layers, where most of the time is torch.compile's (its graph grows with the layers)
    "cpu": dict(d_model=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn=688, vocab=2048, batch=4,
                prompt_len=128, new_tokens=16, dtype="float32", reps=3, serve_requests=8, request_rate=20.0,
                max_concurrency=4),
    # gpu: sized to the lent machine's minutes (`inferbook budgets --preset gpu`): torch.compile's cold
    # graphs bind it, and they grow with the layers
    "gpu": dict(d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn=2816, vocab=32000, batch=8,
                prompt_len=2048, new_tokens=32, dtype="bfloat16", reps=5, serve_requests=16, request_rate=16.0,
                max_concurrency=16),
}

PHASES = ("load", "cold_start", "ttft", "decode", "total")


def check_params(P: dict) -> None:
    """The model's shape (the tiny decoder's own rules: head dim even, GQA, sizes), the serving run's arrival
    process and its engine budget, before any work (`setup` calls this)."""
    import math

    from ..errors import UserError
    from ..serving.config import EngineConfig

    config_from(P)
    if P["serve_requests"]:
        if not (math.isfinite(P["request_rate"]) and P["request_rate"] > 0):
            raise UserError(f"parameter 'request_rate' must be > 0 arrivals per second, got {P['request_rate']}")
        if not (math.isfinite(P["burstiness"]) and P["burstiness"] > 0):
            raise UserError(f"parameter 'burstiness' must be > 0 (the gamma shape of the arrival gaps), "
                            f"got {P['burstiness']}")
        EngineConfig(max_num_seqs=P["max_concurrency"], max_num_batched_tokens=max(256, P["prompt_len"]),
                     block_size=16)


def config_from(params: dict) -> TinyConfig:
    return TinyConfig(vocab=params["vocab"], d_model=params["d_model"], n_layers=params["n_layers"],
                      n_heads=params["n_heads"], n_kv_heads=params["n_kv_heads"], ffn=params["ffn"],
                      max_seq=params["prompt_len"] + params["new_tokens"])


def write_model(ctx, cfg: TinyConfig) -> tuple[str, str]:
    """Random weights from the run's seed, saved as safetensors. Returns (path, sha256)."""
    from ..context import results_dir

    path = results_dir() / ctx.chapter.slug / "tiny-decoder.safetensors"
    sha = save_weights(init_weights(TinyDecoder(cfg), ctx.seed), path)
    return str(path), sha


def make_prompt(ctx, cfg: TinyConfig, batch: int, prompt_len: int):
    g = torch.Generator().manual_seed(ctx.seed + 1)
    return torch.randint(cfg.vocab, (batch, prompt_len), generator=g).to(ctx.device)


def cache_consistency_error(model: TinyDecoder, prompt, new_tokens: int) -> tuple[float, float]:
    """Incremental decode (KV cache) against one full forward over the same tokens.

    Returns (max abs error of the last position's logits, the logits' max abs value).
    """
    tokens, _ = generate(model, model, model, prompt, new_tokens)
    full = torch.cat([prompt, tokens[:, :-1]], dim=1)
    ref = reference_logits(model, full)[:, -1]
    k, v = model.new_cache(prompt.shape[0])
    model(prompt, torch.arange(prompt.shape[1], device=prompt.device), k, v)
    last = None
    for i in range(new_tokens - 1):
        pos = torch.tensor([prompt.shape[1] + i], device=prompt.device)
        last = model(tokens[:, i:i + 1], pos, k, v)[:, -1]
    if last is None:  # one new token: the prefill's last position is the check
        last = model(prompt, torch.arange(prompt.shape[1], device=prompt.device), *model.new_cache(prompt.shape[0]))[:, -1]
        ref = reference_logits(model, prompt)[:, -1]
    return float((last - ref).abs().max()), float(ref.abs().max())


@torch.no_grad()
def forced_logits(step, model: TinyDecoder, prompt, tokens, out_dtype=torch.float32) -> torch.Tensor:
    """The logits each greedy step saw when fed `tokens` (another run's output) instead of its own:
    the prefill over `prompt` [B, S], then one decode step per token of `tokens` [B, N] but the
    last, in the same shapes `generate` uses (so a compiled `step` reuses its graphs).
    Returns [B, N, vocab] in `out_dtype`: position i is the distribution token i was chosen from."""
    B, S = prompt.shape
    k_cache, v_cache = model.new_cache(B)
    out = [step(prompt, torch.arange(S, device=prompt.device), k_cache, v_cache)[:, -1].to(out_dtype)]
    for i in range(1, tokens.shape[1]):
        pos = torch.tensor([S + i - 1], device=prompt.device)
        out.append(step(tokens[:, i - 1:i], pos, k_cache, v_cache)[:, -1].to(out_dtype))
    return torch.stack(out, dim=1)


def gold_logits(path: str, device, prompt, tokens) -> torch.Tensor:
    """`forced_logits` of the same weights in float64, eager math attention: the answer both
    eager and compiled are judged against. [B, N, vocab] float64."""
    gold = load_weights(path, device, dtype=torch.float64, attention="math")
    return forced_logits(gold, gold, prompt, tokens, out_dtype=torch.float64)


def agreement_checks(rec: RunRecord, logits: torch.Tensor, tokens: torch.Tensor, reference: dict, dtype) -> dict:
    """The checks a variant of the same weights must pass against eager (`reference`: eager's
    forced logits, tokens and the float64 gold logits on eager's tokens). Logits: FlashAttention's
    rule, error against gold <= 2 x eager's own error + the dtype's rounding floor. Tokens: the
    variant's argmax equals eager's at every decisive position (gold top-2 gap > 2 x tolerance);
    the free-running token match is kept as a measurement, not asserted."""
    lc = within_reference_error(logits, reference["logits"], reference["gold"], dtype)
    forced_argmax = logits.argmax(-1)
    ag = decisive_agreement(forced_argmax, reference["tokens"], reference["gold"], lc["tolerance"])
    rec.add_check("logits on eager's tokens within 2 x eager's own error (vs float64)", lc["passed"],
                  error=lc["error"], tolerance=lc["tolerance"], reference_error=lc["reference_error"], nan=lc["nan"])
    rec.add_check("greedy choice equals eager's where the top-2 gap exceeds 2 x tolerance", ag["passed"],
                  error=float(ag["decisive"] - ag["agree_decisive"]), tolerance=0.0, decisive=ag["decisive"],
                  positions=ag["positions"], min_gap=ag["min_gap"])
    rec.add("greedy_match_free_running", float((tokens == reference["tokens"]).float().mean()), "fraction",
            phase="check", note="free-running tokens; diverges after the first rounding-level flip, not asserted")
    rec.add("decisive_positions", ag["decisive"], "positions", phase="check", of=ag["positions"])
    return {**lc, **ag}


def observed_attention(cfg: TinyConfig, batch: int, prompt_len: int, dtype, device) -> dict:
    """The SDPA kernel the tiny decoder's attention runs in prefill and in decode, observed on
    inputs of its own shapes: q [B, H, S, D] against the whole static cache [B, H, max_seq, D]
    (after the GQA repeat) with a boolean causal mask [S, max_seq], as `model.Attention` calls it."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for phase, S in (("prefill", prompt_len), ("decode", 1)):
        q = torch.randn(batch, cfg.n_heads, S, cfg.head_dim, generator=g).to(device=device, dtype=dtype)
        kv = torch.randn(batch, cfg.n_heads, cfg.max_seq, cfg.head_dim, generator=g).to(device=device, dtype=dtype)
        positions = torch.arange(S, device=device) + (prompt_len if phase == "decode" else 0)
        mask = torch.arange(cfg.max_seq, device=device)[None, :] <= positions[:, None]
        out[phase] = sdpa_record(q, kv, kv, attn_mask=mask)
    return out


def profiled_forward_attention(step, model: TinyDecoder, prompt) -> dict:
    """The attention kernels the model's own forward ran (`step`: the eager or compiled forward),
    from the profiler: one prefill over `prompt` and one decode step, each profiled.
    {'prefill': {...}, 'decode': {...}} as `sdpa.attention_kernels_in` returns them."""
    B, S = prompt.shape
    k, v = model.new_cache(B)
    out = {"prefill": attention_kernels_in(lambda: step(prompt, torch.arange(S, device=prompt.device), k, v),
                                           prompt.device)}
    pos = torch.tensor([S], device=prompt.device)
    out["decode"] = attention_kernels_in(lambda: step(prompt[:, -1:], pos, k, v), prompt.device)
    return out


def attention_label(observed: dict) -> str:
    """'torch sdpa: flash (prefill), flash (decode)' from `observed_attention`."""
    return "torch sdpa: " + ", ".join(f"{r['kernel']} ({phase})" for phase, r in observed.items())


def _run_variant(ctx, *, name: str, variant: str, path: str, sha: str, dtype, attention: str, int8: bool,
                 compiled: bool, prompt, new_tokens: int, reps: int, reference: dict | None = None
                 ) -> tuple[RunRecord, dict]:
    phases = PhaseTimer(ctx.device)
    with phases("load"):
        model = load_weights(path, ctx.device, dtype=dtype, attention=attention)
        if int8:
            quantize_int8_(model)
    step = torch.compile(model, dynamic=False) if compiled else model
    with phases("cold_start"):  # first request after load: compilation, allocator and cache warm-up
        tokens, _ = generate(step, step, model, prompt, new_tokens)
    runs = [generate(step, step, model, prompt, new_tokens)[1] for _ in range(reps)]

    cfg = model.cfg
    B, S = prompt.shape
    # eager vs torch.compile is the difference under study, so it is the record's variant,
    # not a backend: compare() allows the variant to differ and nothing else.
    rec = ctx.new_record(name, variant=variant, workload={
        "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads} ({cfg.n_params() / 1e6:.2f}M params)",
        "model_revision": f"sha256:{sha[:16]} (random init, seed {ctx.seed})",
        "quantization": model.quantization,
        "input_len": S, "output_len": new_tokens, "batch": B, "dtype": str(dtype).replace("torch.", ""),
    }, topology={"ranks": 1, "tp": 1})
    shapes = {"q": [B, cfg.n_heads, S, cfg.head_dim], "kv_cache": [B, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim]}
    # observed in the model's own forward (the profiler's op and kernel names), recorded as observed
    ran = profiled_forward_attention(step, model, prompt)
    if attention == "sdpa":
        standin = observed_attention(cfg, B, S, dtype, ctx.device)
        rec.set_backend("attention", "torch sdpa: " + ", ".join(f"{r['backend']} ({ph})" for ph, r in ran.items()),
                        reason="observed: profiler op/kernel names in the model's own prefill and decode",
                        dtype=str(dtype).replace("torch.", ""), shapes=shapes)
        rec.backends["attention"]["kernels"] = {ph: r["events"] for ph, r in ran.items()}
        rec.backends["attention"]["stand_in"] = {ph: r["kernel"] for ph, r in standin.items()}
        rec.backends["attention"]["priority"] = standin["prefill"]["priority"]
        rec.add_check("an SDPA kernel ran in the model's own prefill and decode",
                      all(r["backend"] not in ("none", "math") or standin[ph]["kernel"] == "math"
                          for ph, r in ran.items()), kernels={ph: r["events"] for ph, r in ran.items()})
    else:
        rec.set_backend("attention", "explicit softmax (math)", reason="chosen by configuration: no SDPA call",
                        dtype=str(dtype).replace("torch.", ""), shapes=shapes)
        rec.add_check("no SDPA kernel ran (explicit softmax)", all(r["backend"] == "none" for r in ran.values()),
                      kernels={ph: r["events"] for ph, r in ran.items()})
    rec.set_backend("linear", "int8 dequantize + F.linear" if int8 else "F.linear",
                    shapes={"qkv_in": [B * S, cfg.d_model], "ffn": [cfg.d_model, cfg.ffn]})
    rec.add("load", phases.seconds("load"), "s", phase="load")
    rec.add("cold_start", phases.seconds("cold_start"), "s", phase="cold_start")
    for phase in ("ttft", "decode", "total"):
        xs = [getattr(r, f"{phase}_s") for r in runs]
        q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
        rec.add(phase, statistics.median(xs), "s", phase=phase, p10_s=q[0], p90_s=q[-1], n=len(xs),
                samples_s=xs, timer="perf_counter + device sync")
    decode_med = rec.value("decode")
    if new_tokens > 1 and decode_med > 0:
        rec.add("decode_throughput", B * (new_tokens - 1) / decode_med, "output tok/s", phase="decode")
    rec.add("throughput", B * new_tokens / rec.value("total"), "output tok/s", phase="total")
    logits = forced_logits(step, model, prompt, reference["tokens"] if reference else tokens)
    if reference is not None:
        agreement_checks(rec, logits, tokens, reference, dtype)
    return rec, {"tokens": tokens, "logits": logits}


def serving_record(ctx, *, path: str, sha: str, dtype, prompt_len: int, new_tokens: int, requests: int,
                   request_rate: float, burstiness: float, max_concurrency: int) -> RunRecord:
    """The tiny decoder behind the serving engine under open-loop arrivals: vLLM's bench-JSON fields
    (`serving.bench`), with the arrival process in the workload."""
    from ..serving import bench
    from ..serving.config import EngineConfig
    from ..serving.engine import LLMEngine
    from ..serving.sequence import SamplingParams

    model = load_weights(path, ctx.device, dtype=dtype)
    cfg = model.cfg
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_concurrency, max_num_batched_tokens=max(256, prompt_len),
                                           block_size=16))
    g = torch.Generator().manual_seed(ctx.seed + 2)
    prompts = [torch.randint(cfg.vocab, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    r = bench.run_open_loop(engine, prompts, SamplingParams(max_tokens=new_tokens), request_rate=request_rate,
                            burstiness=burstiness, max_concurrency=max_concurrency, seed=ctx.seed)
    rec = ctx.new_record("serving-open-loop", variant="eager", workload={
        "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads}",
        "model_revision": f"sha256:{sha[:16]} (random init, seed {ctx.seed})", "quantization": model.quantization,
        "input_len": prompt_len, "output_len": new_tokens, "batch": f"open loop, at most {max_concurrency}",
        "dtype": str(dtype).replace("torch.", ""), "request_rate": request_rate, "burstiness": burstiness,
        "max_concurrency": max_concurrency, "num_prompts": requests,
        "arrivals": "gamma inter-arrival gaps (shape = burstiness), as vllm bench serve"}, topology={"ranks": 1})
    rec.set_backend("engine", "inferbook.serving.LLMEngine (paged KV, chunked prefill, greedy)")
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        rec.add(key, r[key], "req/s" if key == "request_throughput" else "tok/s", phase="total")
    rec.add("duration", r["duration"], "s", phase="total", completed=r["completed"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        phase = {"ttft": "ttft", "e2el": "total"}.get(m, "decode")
        for stat in ("mean", "median", "p50", "p99", "std"):
            rec.add(f"{stat}_{m}_ms", r[f"{stat}_{m}_ms"], "ms", phase=phase)
    rec.add("mean_queue_wait_ms", 1e3 * sum(r["queue_waits"]) / len(r["queue_waits"]), "ms", phase="ttft",
            note="part of TTFT spent waiting for a max_concurrency slot")
    rec.add_check("every request completed", r["completed"] == requests, error=requests - r["completed"], tolerance=0)
    return rec


def measure(ctx, *, d_model, n_layers, n_heads, n_kv_heads, ffn, vocab, batch, prompt_len, new_tokens, dtype,
            compile, reps, serve_requests=0, request_rate=1.0, burstiness=1.0, max_concurrency=1) -> list[RunRecord]:
    """Four configurations of the same workload, one RunRecord each (see the module docstring)."""
    cfg = config_from(dict(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                           n_kv_heads=n_kv_heads, ffn=ffn, prompt_len=prompt_len, new_tokens=new_tokens))
    torch_dtype = getattr(torch, dtype)
    path, sha = write_model(ctx, cfg)
    prompt = make_prompt(ctx, cfg, batch, prompt_len)
    common = dict(path=path, sha=sha, dtype=torch_dtype, prompt=prompt, new_tokens=new_tokens, reps=reps)
    eager, eager_out = _run_variant(ctx, name="eager", variant="eager", attention="sdpa", int8=False,
                                    compiled=False, **common)
    records = [eager]
    if compile:
        reference = {**eager_out, "gold": gold_logits(path, ctx.device, prompt, eager_out["tokens"])}
        compiled, _ = _run_variant(ctx, name="compiled", variant="torch.compile", attention="sdpa", int8=False,
                                   compiled=True, reference=reference, **common)
        records.append(compiled)
    int8, _ = _run_variant(ctx, name="int8", variant="eager", attention="sdpa", int8=True, compiled=False, **common)
    math_attn, _ = _run_variant(ctx, name="math-attention", variant="eager", attention="math", int8=False,
                                compiled=False, **common)
    records += [int8, math_attn]
    if serve_requests:
        records.append(serving_record(ctx, path=path, sha=sha, dtype=torch_dtype, prompt_len=prompt_len,
                                      new_tokens=new_tokens, requests=serve_requests, request_rate=request_rate,
                                      burstiness=burstiness, max_concurrency=max_concurrency))
    return records
