"""A chapter's gpu-preset wall time, predicted before the GPU run: the step-count model.

    predicted = host + compile + device

- **host**: the CPU dry run's counts (`inferbook.rehearsal`: the gpu preset's branches at smoke sizes),
  scaled to the gpu preset by `COUNT_KNOBS` (the knobs that multiply the number of steps), times a
  per-step host cost: one eager torch call, one Triton launch, one host read (a device sync).
- **compile**: distinct Triton specialisations (one cold JIT compile each, scaled by the list knobs in
  `SHAPE_KNOBS`) and torch.compile graphs, times a cold-compile cost each.
- **device**: the chapter's gpu-preset launches, each at the cost model's predicted time
  (`compiled.predicted_seconds`, from the SASS; until it exists, the ideal roofline of the chapter's
  `roofline_work`, labelled so), times (warm-up + timed repetitions) and the two sides of each
  interleaved comparison.

Every constant is in `UNIT_COSTS_S` with its reason; `inferbook budgets --preset gpu` prints each
part and fails when a prediction exceeds the chapter's budget. It is a model, not a measurement:
the first GPU run's records are what calibrate it (compare `predicted_s` with the run's wall time).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Seconds per counted step on an H200 host (Sapphire Rapids class CPU, CUDA build of PyTorch 2.x).
UNIT_COSTS_S = {
    "torch_call": 8e-6,       # one torch call from Python, eager: dispatch + CUDA launch (PyTorch's ~5-10 µs per op)
    "scalar_read": 30e-6,     # .item()/.tolist(): the stream drains and the value crosses PCIe
    "triton_launch": 25e-6,   # Triton's Python launcher: argument binding, specialisation key, cache lookup
    "triton_compile": 1.0,    # one specialisation compiled cold: TTIR -> PTX -> ptxas, H200 host
    "compiled_graph": 12.0,   # one Inductor graph, cold cache (codegen + Triton compiles of its kernels)
}
TIMED_SIDES = 2              # each timed launch runs beside the one it is compared with (interleaved)
WARMUP_REPS = 3              # `measure.benchmark` warm-up calls before the timed ones

# How each chapter's step count grows from the rehearsal to the gpu preset: (knob, how), how is
# "value" (count = the knob), "len" (a list knob: its length) or "sum" (a list knob: its sum).
COUNT_KNOBS: dict[str, tuple[tuple[str, str], ...]] = {
    "h3-vae-fusion": (("reps", "value"), ("steps", "value"), ("layers", "value")),
    "h3-tiled-decode": (("reps", "value"), ("overlaps", "len"), ("latent_frames", "value")),
    "comfy-generic-loops": (("segments", "value"), ("steps", "value"), ("repeats", "value")),
    "omni-h3-workflows": (("frames", "value"), ("repeats", "value")),
    "kimi-spec-budget": (("output_len", "value"), ("requests_per_slot", "value"), ("concurrencies", "sum"),
                         ("repeats", "value"), ("n_layers", "value")),
    "kimi-dspark-acceptance": (("prompts_per_task", "value"), ("output_len", "value")),
    "kimi-topk-tail-fusion": (("tokens", "len"), ("reps", "value")),
    "chord-w4a16": (("m_sweep", "len"), ("decode_m", "len"), ("reps", "value")),
    "minimax-m3-moe": (("concurrency", "len"), ("tps", "len"), ("eps", "len"), ("reps", "value")),
    "tiered-kv-offload": (("num_requests", "value"), ("output_len", "value"), ("n_layers", "value"),
                          ("repeats", "value"), ("host_sweep", "len")),
    "sglang-fused-comm": (("reps", "value"), ("allreduce_numels", "len"), ("vocabs", "len"), ("batches", "len")),
    "deterministic-attention": (("batch_sizes", "len"), ("e2e_requests", "value"), ("e2e_new_tokens", "value"),
                                ("e2e_layers", "value")),
    "te-mxfp8-recipes": (("train_steps", "value"), ("ep_reps", "value")),
    "gdn-backward-check": (("head_dims", "len"), ("lengths", "len")),
    "attention-test-matrix": (("head_dims", "len"),),
    "upgrade-record": (("new_tokens", "value"), ("reps", "value"), ("n_layers", "value")),
}
# List knobs whose entries are distinct shapes, so distinct kernel specialisations, at the gpu preset.
SHAPE_KNOBS: dict[str, tuple[str, ...]] = {
    "kimi-topk-tail-fusion": ("tokens",), "chord-w4a16": ("m_sweep", "decode_m"), "minimax-m3-moe": ("concurrency",),
    "deterministic-attention": ("batch_sizes", "mm_m_values"), "gdn-backward-check": ("head_dims", "lengths"),
    "attention-test-matrix": ("head_dims",), "sglang-fused-comm": ("vocabs", "batches"),
}

DRY_RUN_FILE = Path(__file__).resolve().parents[2] / "data" / "budgets" / "gpu-dry-run.json"


def _measure(value, how: str) -> float:
    if isinstance(value, str):
        value = [float(v) for v in value.split(",") if v.strip()]
    if how == "len":
        return float(len(value))
    if how == "sum":
        return float(sum(value))
    return float(value)


def count_scale(slug: str, gpu: dict, rehearsal: dict, knobs=None) -> float:
    """The product over `slug`'s count knobs of gpu / rehearsal (1 where they agree or a value is 0)."""
    scale = 1.0
    for name, how in (COUNT_KNOBS.get(slug, ()) if knobs is None else knobs):
        if name not in gpu or name not in rehearsal:
            continue
        a, b = _measure(gpu[name], how), _measure(rehearsal[name], how)
        if a > 0 and b > 0:
            scale *= a / b
    return scale


def shape_scale(slug: str, gpu: dict, rehearsal: dict) -> float:
    return count_scale(slug, gpu, rehearsal, [(k, "len") for k in SHAPE_KNOBS.get(slug, ())])


def device_seconds(slug: str, params: dict) -> tuple[float, str]:
    """One pass over the chapter's gpu-preset work on H200: (seconds, which model gave it)."""
    from . import compiled
    from .rehearsal import chapter_module

    predicted = getattr(compiled, "predicted_seconds", None)
    if predicted is not None:
        try:
            return float(predicted(slug, target="sm_90", card="H200")), "cost model (SASS)"
        except Exception as e:   # a chapter the cost model cannot price yet: say so, fall back
            why = f"cost model failed ({type(e).__name__}); "
    else:
        why = ""
    work = getattr(chapter_module(slug), "roofline_work", None)
    if work is None:
        return 0.0, why + "no kernel work declared"
    card = next((c for c in compiled.CARDS if c.startswith("H200")), "H200")
    try:
        full = compiled.gpu_params(slug)          # the preset with every Param default filled in
    except Exception:
        full = params
    total = sum(compiled.roofline_seconds(w["bytes"], w["flops"], card) for w in work(full))
    return total, why + "ideal roofline (a floor, not a prediction)"


@dataclass
class Prediction:
    slug: str
    budget_s: float
    host_s: float
    compile_s: float
    device_s: float
    device_model: str
    scale: float
    dry_run_cpu_s: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.host_s + self.compile_s + self.device_s

    @property
    def binding(self) -> str:
        parts = {"host": self.host_s, "compile": self.compile_s, "device": self.device_s}
        return max(parts, key=parts.get)

    @property
    def fits(self) -> bool:
        return math.isfinite(self.total_s) and self.total_s <= self.budget_s


def predict(slug: str, counts: dict, budget_s: float) -> Prediction:
    """The model above for one chapter from its dry-run `counts` (`rehearsal.rehearse`'s dict)."""
    from .rehearsal import chapter_module

    m = chapter_module(slug)
    gpu = m.PRESETS["gpu"]
    scale = count_scale(slug, gpu, counts["params"])
    u = UNIT_COSTS_S
    host = scale * (counts["torch_calls"] * u["torch_call"] + counts["scalar_reads"] * u["scalar_read"]
                    + counts["triton_launches"] * u["triton_launch"])
    comp = (counts["triton_specialisations"] * shape_scale(slug, gpu, counts["params"]) * u["triton_compile"]
            + counts["compiled_graphs"] * u["compiled_graph"])
    one_pass, model = device_seconds(slug, gpu)
    reps = int(gpu.get("reps", 1) or 1)
    device = one_pass * (reps + WARMUP_REPS) * TIMED_SIDES
    notes = [] if not counts.get("checks_failed") else [f"dry run failed {len(counts['checks_failed'])} check(s)"]
    return Prediction(slug, budget_s, host, comp, device, model, scale, counts.get("cpu_s"), notes)


def load_dry_run(path: Path | None = None) -> dict:
    p = Path(path or DRY_RUN_FILE)
    return json.loads(p.read_text())["chapters"] if p.exists() else {}


def save_dry_run(counts: dict, path: Path | None = None) -> Path:
    """Keep the dry run's counts (one entry per chapter, as `rehearsal.rehearse` returns them)."""
    import platform

    p = Path(path or DRY_RUN_FILE)
    p.parent.mkdir(parents=True, exist_ok=True)
    keep = {s: {k: v for k, v in c.items() if k != "trace"} for s, c in sorted(counts.items())}
    p.write_text(json.dumps({"how": "inferbook budgets --preset gpu --dry-run --save (CPU, rehearsal sizes)",
                             "cpu": platform.processor() or platform.machine(), "chapters": keep}, indent=1) + "\n")
    return p
