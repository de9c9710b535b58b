"""A chapter's gpu-preset wall time on one H200, *predicted* before the GPU run from a CPU dry run.

    predicted = host + compile + device            (each part predicted; the largest binds)

The dry run (`inferbook.rehearsal.rehearse`: the gpu preset's branches at the smoke preset's sizes, on
this CPU) counts the chapter's work; each count is scaled to the gpu preset and priced:

- **host** (the Python host steps). Torch calls made from Python, split by what each costs on a GPU
  host: a kernel call (dispatch and a CUDA launch), a view (dispatch, no launch), a metadata read, a
  host read (`.item()`, `.tolist()`, `.cpu()`: the stream drains); Triton launches (Triton's Python
  launcher), each priced at `HOST_S`; and the chapter's and engine's own Python: the dry run's
  main-thread CPU seconds outside torch calls, Triton launches and torch.compile, less what the counting
  itself cost (`COUNTING_OVERHEAD_S`), at `PYTHON_SPEED` — measured on a loaded shared CPU, where cache
  contention slows Python, so an upper estimate. Counts scale from the dry run to the gpu preset by the knobs that multiply steps
  (`COUNT_KNOBS`, less the timed repetitions: see REPETITION_KNOBS), per record where the chapter's phases grow by different knobs (`PHASE_KNOBS`: the
  dry run keeps the counts between one record's creation and the next, and in a newer dry run each
  phase's own Python seconds, so its Python scales by its knobs too). A record whose work is a branch
  only this CPU takes (`CPU_ONLY_RECORDS`: a CPU timing path where the GPU times Triton kernels) is
  left out.
- **compile**. Triton: the distinct specialisations of the chapter's gpu-preset launches
  (`compiled.launches_for`, the launches the committed compile tables list, at the gpu shapes), plus
  the dry run's specialisations of kernels those lists do not hold. `scripts/gpu_measure.sh` compiles
  the listed launches ahead, in parallel, before the chapters (`WARMED`): the chapter then pays a cache
  load per specialisation, and the warm step's share is counted in the run's total, not the chapter's
  budget. torch.compile: `TORCH_COMPILE_GRAPH_S` per graph the dry run built.
- **device**. Triton launches at the cost model's predicted time (`compiled.predicted_seconds`, from
  the SASS of the sm_90 compile table), each timed as one benchmark of BENCH_SAMPLES samples (their
  launches and syncs are host work too); torch ops at the H200's datasheet ceilings: the dry run's bytes and flops
  (tensor arguments and results of each kernel call; 2·M·N·K of each matmul-like call), scaled by the
  knobs that grow the number of ops (`DEVICE_KNOBS`: the count knobs less the timed repetitions; per
  phase, its knobs, where the dry run kept its bytes) and one op's size (`WORK_KNOBS`; not for the
  `PHASE_SIZED` phases, whose knobs are sizes), as max(bytes / HBM bandwidth, flops / dense BF16
  rate) — a floor for those ops, not their time.

Host and device are added although a GPU overlaps them (asynchronous launches): an upper estimate.
Every constant is stated below with where it comes from. It is a model, not a measurement: the first GPU
run's records are what calibrate it (compare `predicted_s` with the run's seconds in logs/summary.tsv).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Seconds per counted host step on the H200 machine's CPU, eager PyTorch 2.x with CUDA.
HOST_S = {
    # dispatcher + cudaLaunchKernel: PyTorch's eager overhead is ~5-10 µs per op on a GPU host (the
    # launch-bound regime of Horace He, "Making Deep Learning Go Brrrr From First Principles", 2022);
    # cudaLaunchKernel alone is ~2-4 µs (NVIDIA's CUDA Graphs blog, 2019)
    "kernel_call": 6e-6,
    "view_call": 2e-6,        # dispatch and a new TensorImpl, no launch (the dispatcher share of the above)
    "metadata_call": 0.3e-6,  # .shape/.size()/.dim(): a C++ getter behind the Python binding
    # cudaStreamSynchronize + a small device-to-host copy on an idle stream (~10-20 µs; the queued work it
    # waits for is the device part's)
    "scalar_read": 20e-6,
    # Triton 3.x's Python launcher: argument binding, specialisation key, cache lookup, cuLaunchKernel
    # (tens of µs per launch are reported in Triton's issues; 20 µs taken)
    "triton_launch": 20e-6,
}
# The chapter's own Python (scheduler, bookkeeping) runs at this CPU's speed times this factor on the
# H200 host: 1.0, taken equal (both are x86 server cores; an assumption, not a measurement).
PYTHON_SPEED = 1.0
# What counting one torch call costs the dry run beyond the call itself (the TorchFunctionMode's Python),
# subtracted from its Python time: per kind, the median of three 20,000-call loops with and without the
# counter on this CPU under load (`rehearsal.counting_overhead_s()`): a kernel call (an add, its bytes
# counted) 15 µs, a view 6.3 µs, a metadata read 2.7 µs; a host read is counted as a kernel call.
COUNTING_OVERHEAD_S = {"kernel_calls": 15e-6, "view_calls": 6.3e-6, "metadata_calls": 2.7e-6, "scalar_reads": 15e-6}
# One Triton specialisation compiled cold for sm_90 (TTIR -> TTGIR -> LLIR -> PTX -> ptxas, and the
# disassembly `compiled.compile_launch` adds), CPU seconds of the process and its ptxas, measured on this
# CPU for eight launches (chord-w4a16's decode linear and MoE GEMM, attention's flash forward and dQ,
# GDN's recurrent and chunk kernels, the MoE GEMMs of minimax-m3-moe and kimi-topk-tail-fusion): 1.2 to
# 8.4 s, median 2.6 s, mean 3.1 s; 3.0 s taken (the warm step's length is a sum), per core of the H200 host.
TRITON_COMPILE_S = 3.0
CACHE_HIT_S = 0.03     # a warmed specialisation: the cache key, reading the cubin, cuModuleLoad (estimate)
WARM_JOBS = 16         # the warm step compiles on every core of the lent machine (16)
WARM_START_S = 8.0     # the warm step's processes start and import torch + triton (estimate)
# One torch.compile graph cold on the H200 host: Dynamo's trace, AOTAutograd, Inductor's lowering and
# the Triton compiles of its generated kernels (in parallel, on the host's 16 cores). 15 s, an estimate
# for graphs of this book's size (a few hundred ops, tens of generated kernels); the dry run's own
# compile seconds are wall time of Inductor's C++ backend on a loaded 2-core CPU and are not used.
TORCH_COMPILE_GRAPH_S = 15.0
WARMUP_REPS = 3        # `measure.benchmark` warm-up calls before the timed ones
# `measure.benchmark` takes samples until `min_time_s` (0.2 s) and at most `max_reps` (200): a launch of
# microseconds is sampled 200 times. Triton kernels are timed only on a GPU (never in the dry run), so
# each gpu-preset launch is priced as one such benchmark: its samples' device time (cost model) and host
# time (the launch plus the per-sample sync and events).
BENCH_SAMPLES = 200
SAMPLE_SYNC_S = 30e-6  # a timed sample's CUDA events, synchronize and L2 flush on the host (estimate)
CARD = "H200"

# Chapters whose gpu-preset launches `scripts/gpu_measure.sh` compiles ahead (`compiled.inspect` into
# the Triton cache the chapter's JIT reads), before the first chapter of each part.
WARMED = ("chord-w4a16", "attention-test-matrix", "deterministic-attention", "gdn-backward-check", "h3-vae-fusion",
          "kimi-topk-tail-fusion", "minimax-m3-moe", "sglang-fused-comm", "te-mxfp8-recipes")

# How each chapter's step count grows from the dry run to the gpu preset: (knob, how), how is
# "value" (count = the knob), "len" (a list knob: its length), "sum" (its sum) or "prod" (its product),
# or (what, function of the params) for a count several knobs make together.
COUNT_KNOBS: dict[str, tuple[tuple[str, str], ...]] = {
    "h3-vae-fusion": (("reps", "value"), ("layers", "value")),
    "h3-tiled-decode": (("reps", "value"), ("overlaps", "len"), ("latent_frames", "value")),
    "comfy-generic-loops": (("segments", "value"), ("steps", "value"), ("repeats", "value")),
    "omni-h3-workflows": (("frames", "value"), ("repeats", "value")),
    "kimi-spec-budget": (("output_len", "value"), ("requests_per_slot", "value"), ("concurrencies", "sum"),
                         ("repeats", "value"), ("n_layers", "value")),
    "kimi-dspark-acceptance": (("prompts_per_task", "value"), ("output_len", "value")),
    "kimi-topk-tail-fusion": (("tokens", "len"), ("reps", "value")),
    "chord-w4a16": (("m_sweep", "len"), ("decode_m", "len"), ("reps", "value")),
    "minimax-m3-moe": (("concurrency", "len"), ("tps", "len"), ("eps", "len"), ("reps", "value")),
    # engine runs: 2 workloads x 4 configurations per repeat, and the host sweep once; steps per run grow
    # with the requests and their output tokens, torch calls per step with the layers
    "tiered-kv-offload": (("engine runs", lambda p: 8 * p["repeats"] + len(str(p["host_sweep"]).split(","))),
                          ("num_requests", "value"), ("output_len", "value"), ("n_layers", "value")),
    "sglang-fused-comm": (("reps", "value"), ("allreduce_numels", "len"), ("vocabs", "len"), ("batches", "len")),
    "deterministic-attention": (("batch_sizes", "len"),),
    "te-mxfp8-recipes": (("train_steps", "value"), ("ep_reps", "value")),
    "gdn-backward-check": (("head_dims", "len"), ("lengths", "len")),
    "attention-test-matrix": (("head_dims", "len"), ("shapes", "len")),
    "upgrade-record": (("new_tokens", "value"), ("reps", "value"), ("n_layers", "value")),
}
# Per record (name prefix -> knobs): the dry run's counts between that record's creation and the next
# grow by these knobs instead of the chapter's. The longest matching prefix wins.
PHASE_KNOBS: dict[str, dict[str, tuple]] = {
    # the copy and file-tier benchmarks (records made after), every engine run (the later repeats' too,
    # before the restores' records), then the restores (records made before)
    "tiered-kv-offload": {"copy-": (("copy blocks", lambda p: sum(float(p["copy_total_mb"]) / float(mb) for mb in
                                                                  str(p["copy_block_mb"]).split(",") if mb.strip())),),
                          "filesystem": (("file_total_mb", "value"),),
                          "^restore-": (("restore_reps", "value"),)},
    # the sweeps (records made after them), the fixed-size correctness rows, the matmul sweep, and the
    # engine's runs, which follow the creation of their record
    "deterministic-attention": {"batch-invariance": (("batch_sizes", "len"),),
                                "lean-invariance": (("batch_sizes", "len"),),
                                "matmul-invariance": (),
                                "engine-determinism": (("mm_m_values", "len"),),
                                "^engine-determinism": (("e2e_requests", "value"), ("e2e_new_tokens", "value"),
                                                        ("e2e_layers", "value"))},
    "upgrade-record": {"serving": (("serve_requests", "value"), ("new_tokens", "value"), ("n_layers", "value"))},
    # each recipe's training steps and the EP exchange's repetitions (made before its record); the rest
    # ("": every other phase) once: their timed repetitions are `measure.benchmark`'s, or Triton's on a GPU
    "te-mxfp8-recipes": {"": (), "^recipe:": (("train_steps", "value"),), "mxfp8-dispatch": (("ep_reps", "value"),)},
    # the router (one batch, its size only), the kernel checks and the layouts (once per layout, at the
    # model's shapes) do not repeat per M; the roofline table has a row per M of the sweep; the sweeps
    # themselves are the GPU's Triton benchmarks (priced apart) and, on this CPU, CPU_ONLY_RECORDS
    "chord-w4a16": {"routing": (), "^routing": (), "^kernel-checks": (), "^layouts": (),
                    "^roofline-model": (("m_sweep", "len"),)},
}
# How one torch op's work grows from the dry run to the gpu preset: {"bytes": knobs, "flops": knobs}, each
# (knob, how, power). Unlisted: the op sizes are taken as the dry run's (then the device part is a floor).
WORK_KNOBS: dict[str, dict[str, tuple[tuple[str, str, int], ...]]] = {
    "h3-vae-fusion": {"bytes": (("video", "prod", 1), ("ch", "value", 1)),
                      "flops": (("video", "prod", 1), ("ch", "value", 2))},
    "h3-tiled-decode": {"bytes": (("latent_h", "value", 1), ("latent_w", "value", 1), ("channels", "sum", 1)),
                        "flops": (("latent_h", "value", 1), ("latent_w", "value", 1), ("channels", "sum", 2))},
    "comfy-generic-loops": {"bytes": (("width", "value", 1), ("height", "value", 1), ("segment_frames", "value", 1)),
                            "flops": (("width", "value", 1), ("height", "value", 1), ("segment_frames", "value", 1))},
    "omni-h3-workflows": {"bytes": (("width", "value", 1), ("height", "value", 1)),
                          "flops": (("width", "value", 1), ("height", "value", 1))},
    "kimi-spec-budget": {"bytes": (("d_model", "value", 2),), "flops": (("d_model", "value", 2),)},
    "tiered-kv-offload": {"bytes": (("d_model", "value", 2),), "flops": (("d_model", "value", 2),)},
    "upgrade-record": {"bytes": (("d_model", "value", 2),),
                       "flops": (("d_model", "value", 2), ("batch", "value", 1))},
    "kimi-topk-tail-fusion": {"bytes": (("hidden", "value", 1), ("inter", "value", 1)),
                              "flops": (("hidden", "value", 1), ("inter", "value", 1))},
    "chord-w4a16": {"bytes": (("hidden", "value", 1), ("inter", "value", 1)),
                    "flops": (("hidden", "value", 1), ("inter", "value", 1), ("tokens", "value", 1))},
    "minimax-m3-moe": {"bytes": (("hidden", "value", 1), ("inter", "value", 1)),
                       "flops": (("hidden", "value", 1), ("inter", "value", 1))},
    "sglang-fused-comm": {"bytes": (("hidden", "value", 1), ("tokens", "value", 1)),
                          "flops": (("hidden", "value", 1), ("tokens", "value", 1))},
    "deterministic-attention": {"bytes": (("heads", "value", 1), ("head_dim", "value", 1), ("max_seqlen", "value", 1)),
                                "flops": (("heads", "value", 1), ("head_dim", "value", 1), ("max_seqlen", "value", 1))},
    "te-mxfp8-recipes": {"bytes": (("m", "value", 1), ("k", "value", 1)),
                         "flops": (("m", "value", 1), ("k", "value", 1), ("n", "value", 1))},
    "gdn-backward-check": {"bytes": (("bench_len", "value", 1), ("bench_heads", "value", 1),
                                     ("bench_head_dim", "value", 1)),
                           "flops": (("bench_len", "value", 1), ("bench_heads", "value", 1),
                                     ("bench_head_dim", "value", 2))},
    "attention-test-matrix": {"bytes": (("base_k", "value", 1), ("n_heads", "value", 1)),
                              "flops": (("base_q", "value", 1), ("base_k", "value", 1), ("n_heads", "value", 1))},
}
# The timed repetitions do not scale the counts: `measure.benchmark` repeats a call for at least
# `min_time_s`, so at the dry run's small sizes it already ran at least as many as the gpu preset's `reps`
# (and Triton's timed loops, GPU only, are priced apart: BENCH_SAMPLES). How the number of torch ops on
# the device grows (their size is WORK_KNOBS'): the count knobs less the repetitions, unless listed here.
# The chapters whose `reps` is `measure.benchmark`'s `min_reps` (elsewhere a repetition is a whole run,
# and it scales the counts).
REPETITION_KNOBS: dict[str, frozenset] = {s: frozenset({"reps"}) for s in (
    "chord-w4a16", "deterministic-attention", "h3-tiled-decode", "h3-vae-fusion", "kimi-topk-tail-fusion",
    "minimax-m3-moe", "sglang-fused-comm")}


def _steps_only(knobs, slug: str):
    reps = REPETITION_KNOBS.get(slug, frozenset())
    return tuple(k for k in knobs if k[0] not in reps)
DEVICE_KNOBS: dict[str, tuple] = {
    "h3-vae-fusion": (),    # the encoder's convolutions dominate; the decoder's layers are a small share
    # its torch ops on a GPU (the checks' fp32 references, the weights' quantization) run once per
    # layout, not once per M of the sweeps: those are Triton launches, priced by the cost model
    "chord-w4a16": (),
}
# Records whose work is a branch the gpu preset does not take on a GPU: a CPU-only timing path, where the
# GPU run times Triton kernels instead (priced above: the compile tables' launches, BENCH_SAMPLES each,
# and the cost model). The dry run's counts from such a record's creation to the next record's are left
# out of the host and device parts (prefixes of the record made before that work, as PHASE_KNOBS' "^NAME").
CPU_ONLY_RECORDS: dict[str, tuple[str, ...]] = {
    "chord-w4a16": ("cpu-",),   # `cpu_timings`: torch bf16 vs dequantize + matmul on this CPU; `gpu_timings` on a GPU
}
# List knobs whose entries are distinct shapes, so distinct kernel specialisations, for the kernels the
# compile tables do not list (their dry-run specialisations are scaled by these).
SHAPE_KNOBS: dict[str, tuple[str, ...]] = {
    "kimi-topk-tail-fusion": ("tokens",), "chord-w4a16": ("m_sweep", "decode_m"), "minimax-m3-moe": ("concurrency",),
    "deterministic-attention": ("batch_sizes", "mm_m_values"), "gdn-backward-check": ("head_dims", "lengths"),
    "attention-test-matrix": ("head_dims",), "sglang-fused-comm": ("vocabs", "batches"),
}

DRY_RUN_FILE = Path(__file__).resolve().parents[2] / "data" / "budgets" / "gpu-dry-run.json"


def _measure(value, how: str) -> float:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
        if how == "len":   # a list of names counts too
            return float(len(value))
        value = [float(v) for v in value]
    if how == "len":
        return float(len(value))
    if how == "sum":
        return float(sum(value))
    if how == "prod":
        return float(math.prod(value))
    return float(value)


def count_scale(slug: str, gpu: dict, rehearsal: dict, knobs=None) -> float:
    """The product over `slug`'s count knobs of gpu / rehearsal (1 where they agree or a value is 0);
    `knobs` entries are (name, how) or (name, how, power)."""
    scale = 1.0
    for k in (COUNT_KNOBS.get(slug, ()) if knobs is None else knobs):
        name, how, power = (k + (1,))[:3]
        if callable(how):          # a count several knobs make together: how(params)
            a, b = float(how(gpu)), float(how(rehearsal))
        elif name not in gpu or name not in rehearsal:
            continue
        else:
            a, b = _measure(gpu[name], how), _measure(rehearsal[name], how)
        if a > 0 and b > 0:
            scale *= (a / b) ** power
    return scale


def shape_scale(slug: str, gpu: dict, rehearsal: dict) -> float:
    return count_scale(slug, gpu, rehearsal, [(k, "len") for k in SHAPE_KNOBS.get(slug, ())])


# Phases whose knobs already hold the size of their ops (a copy or a file of N MB): their bytes and
# flops grow by those knobs, not also by WORK_KNOBS (keys as PHASE_KNOBS').
PHASE_SIZED: dict[str, tuple[str, ...]] = {"tiered-kv-offload": ("copy-", "filesystem")}


def _phase_key(table, before: str, after: str):
    hits = [k for k in table if (k.startswith("^") and before.startswith(k[1:])) or
            (not k.startswith("^") and after.startswith(k))]
    return max(hits, key=len, default=None)


def phase_knobs(slug: str, before: str, after: str):
    """The knobs of the work done between the creation of record `before` and of record `after`: a
    PHASE_KNOBS key "NAME" matches `after` (a record made once its work is done), "^NAME" matches
    `before` (a record made before its work); the longest match wins ("" matches every phase: the
    chapter's default), else the chapter's COUNT_KNOBS."""
    table = PHASE_KNOBS.get(slug, {})
    best = _phase_key(table, before, after)
    return COUNT_KNOBS.get(slug, ()) if best is None else table[best]


def _phases(counts: dict) -> list[tuple[str, str, dict]]:
    """(before, after, counts) of each phase; an older dry run kept [before, counts] only (the next
    phase's `before` is taken as `after` then)."""
    raw = counts.get("phases") or []
    out = []
    for i, ph in enumerate(raw):
        if len(ph) == 3:
            out.append((ph[0], ph[1], ph[2]))
        else:
            out.append((ph[0], raw[i + 1][0] if i + 1 < len(raw) else "", ph[1]))
    return out


@functools.lru_cache(maxsize=None)
def gpu_compiles(slug: str) -> tuple[int, frozenset, int]:
    """(distinct specialisations, kernel names, launches) of the chapter's gpu-preset launches, as the
    compile tables list them ((0, {}, 0) for a chapter without `gpu_launches`)."""
    from . import compiled

    try:
        if not compiled.has_launches(slug):
            return 0, frozenset(), 0
        launches = compiled.launches_for(slug)
    except Exception:
        return 0, frozenset(), 0
    names = frozenset(getattr(getattr(la.kernel, "fn", la.kernel), "__name__", "?") for la in launches)
    return len(compiled.dedupe(launches)), names, len(launches)


def triton_device_seconds(slug: str) -> tuple[float, str]:
    """One pass over the chapter's gpu-preset Triton launches on the H200 (cost model), and its source."""
    from . import compiled

    try:
        if not compiled.has_launches(slug):
            return 0.0, "no Triton launches"
        return float(compiled.predicted_seconds(slug, target="sm_90", card=CARD)), "cost model (sm_90 SASS)"
    except Exception as e:   # a chapter the cost model cannot price: the chapter's roofline floor, named
        from .rehearsal import chapter_module

        work = getattr(chapter_module(slug), "roofline_work", None)
        if work is None:
            return 0.0, f"cost model failed ({type(e).__name__}), no roofline work declared"
        total = sum(compiled.roofline_seconds(w["bytes"], w["flops"], CARD) for w in work(compiled.gpu_params(slug)))
        return total, f"cost model failed ({type(e).__name__}): ideal roofline floor"


@dataclass
class Prediction:
    slug: str
    budget_s: float
    parts: dict            # {"host": {item: seconds}, "compile": {...}, "device": {...}}
    warm_s: float          # this chapter's share of the script's warm step (in the run's total, not the budget)
    scale: float           # the step scale (count knobs), kernel-call weighted over the phases
    dry_run_cpu_s: float | None
    counts: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def part_s(self, part: str) -> float:
        return float(sum(self.parts.get(part, {}).values()))

    @property
    def host_s(self) -> float:
        return self.part_s("host")

    @property
    def compile_s(self) -> float:
        return self.part_s("compile")

    @property
    def device_s(self) -> float:
        return self.part_s("device")

    @property
    def total_s(self) -> float:
        return self.host_s + self.compile_s + self.device_s

    @property
    def binding(self) -> str:
        parts = {"host": self.host_s, "compile": self.compile_s, "device": self.device_s}
        return max(parts, key=parts.get)

    @property
    def binds(self) -> str:
        """What binds: the largest part and, within it, its largest item."""
        items = self.parts.get(self.binding, {})
        top = max(items, key=items.get) if items else "nothing"
        return f"{self.binding}: {top}"

    @property
    def fits(self) -> bool:
        return math.isfinite(self.total_s) and self.total_s <= self.budget_s


def _fmt(n: float) -> str:
    for unit, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.3g}{unit}"
    return f"{n:.3g}"


def predict(slug: str, counts: dict, budget_s: float) -> Prediction:
    """The model above for one chapter from its dry-run `counts` (`rehearsal.rehearse`'s dict)."""
    from .rehearsal import chapter_module

    m = chapter_module(slug)
    gpu, small = m.PRESETS["gpu"], counts["params"]
    u = HOST_S
    # -- host: the counted steps, scaled per phase (or chapter-wide), priced per step
    phases = _phases(counts)
    cpu_only = CPU_ONLY_RECORDS.get(slug, ())
    left_out = [ph for ph in phases if ph[0].startswith(cpu_only)] if cpu_only else []
    phases = [ph for ph in phases if ph not in left_out]
    scaled = {"kernel_calls": 0.0, "view_calls": 0.0, "scalar_reads": 0.0, "triton_launches": 0.0}
    # a newer dry run keeps each phase's metadata reads, Python seconds, bytes and flops too
    per_phase = bool(phases) and all("python_cpu_s" in d for _, _, d in phases)
    phase_python, phase_metadata = 0.0, 0.0
    if phases:
        for before, after, d in phases:
            s = count_scale(slug, gpu, small, _steps_only(phase_knobs(slug, before, after), slug))
            for k in scaled:
                scaled[k] += s * d.get(k, 0)
            if per_phase:   # its Python less what counting its calls cost, at its own scale
                phase_python += s * max(0.0, d["python_cpu_s"] - sum(d.get(k, 0) * v for k, v in COUNTING_OVERHEAD_S.items()))
                phase_metadata += s * d.get("metadata_calls", 0)
    elif counts.get("phases"):
        pass    # every phase is a CPU-only branch: nothing of it runs on the GPU
    else:   # a dry run without phases (older counts): every torch call is a kernel call
        s = count_scale(slug, gpu, small, _steps_only(COUNT_KNOBS.get(slug, ()), slug))
        scaled["kernel_calls"] = s * (counts.get("kernel_calls", counts.get("torch_calls", 0)) -
                                      (0 if "kernel_calls" in counts else counts.get("scalar_reads", 0)))
        scaled["view_calls"] = s * counts.get("view_calls", 0)
        scaled["scalar_reads"] = s * counts.get("scalar_reads", 0)
        scaled["triton_launches"] = s * counts.get("triton_launches", 0)
    raw_kernels = max(1.0, float(sum(d.get("kernel_calls", 0) for _, _, d in phases)) if phases
                      else float(counts.get("kernel_calls", counts.get("torch_calls", 0)) or 1))
    scale = scaled["kernel_calls"] / raw_kernels if scaled["kernel_calls"] else \
        count_scale(slug, gpu, small, _steps_only(COUNT_KNOBS.get(slug, ()), slug))
    python_s = counts.get("python_cpu_s")
    if python_s is not None:   # the counting's own Python, out
        python_s = max(0.0, python_s - sum(counts.get(k, 0) * v for k, v in COUNTING_OVERHEAD_S.items()))
    metadata = phase_metadata if per_phase else scale * counts.get("metadata_calls", 0)
    host = {
        f"{_fmt(scaled['kernel_calls'])} torch kernel calls": scaled["kernel_calls"] * u["kernel_call"],
        f"{_fmt(scaled['view_calls'])} torch view calls": scaled["view_calls"] * u["view_call"],
        f"{_fmt(metadata)} metadata reads": metadata * u["metadata_call"],
        f"{_fmt(scaled['scalar_reads'])} host reads (syncs)": scaled["scalar_reads"] * u["scalar_read"],
        f"{_fmt(scaled['triton_launches'])} Triton launches": scaled["triton_launches"] * u["triton_launch"],
    }
    if per_phase:
        host["the chapter's own Python"] = phase_python * PYTHON_SPEED
    elif python_s is not None:
        host["the chapter's own Python"] = scale * python_s * PYTHON_SPEED
    # -- compile
    n_gpu, listed, n_launch = gpu_compiles(slug)
    if n_launch:
        host[f"{n_launch} timed Triton benchmarks x {BENCH_SAMPLES} samples (GPU only)"] = \
            n_launch * (BENCH_SAMPLES + WARMUP_REPS) * (u["triton_launch"] + SAMPLE_SYNC_S)
    kernels = counts.get("triton_kernels") or {}
    unlisted_specs = 0.0
    if kernels and listed:
        share = sum(v for k, v in kernels.items() if k not in listed) / max(1, sum(kernels.values()))
        unlisted_specs = share * counts.get("triton_specialisations", 0) * shape_scale(slug, gpu, small)
    elif not listed:
        unlisted_specs = counts.get("triton_specialisations", 0) * shape_scale(slug, gpu, small)
    warmed = slug in WARMED and n_gpu > 0
    comp, warm_s = {}, 0.0
    if n_gpu:
        if warmed:
            comp[f"{n_gpu} Triton specialisations (warmed: cache loads)"] = n_gpu * CACHE_HIT_S
            warm_s = n_gpu * TRITON_COMPILE_S / WARM_JOBS
        else:
            comp[f"{n_gpu} Triton specialisations (cold)"] = n_gpu * TRITON_COMPILE_S
    if unlisted_specs:
        comp[f"{unlisted_specs:.3g} Triton specialisations not in the compile table (cold)"] = \
            unlisted_specs * TRITON_COMPILE_S
    graphs = int(counts.get("compiled_graphs", 0) or 0)
    if graphs:
        comp[f"{graphs} torch.compile graphs ({TORCH_COMPILE_GRAPH_S:g} s each, cold)"] = graphs * TORCH_COMPILE_GRAPH_S
    # -- device
    one_pass, model = triton_device_seconds(slug)
    device = {}
    if one_pass:
        device[f"Triton launches x {BENCH_SAMPLES + WARMUP_REPS}, {model}"] = one_pass * (BENCH_SAMPLES + WARMUP_REPS)
    from . import compiled

    card = compiled.CARDS[CARD]
    w = WORK_KNOBS.get(slug, {})
    dknobs = DEVICE_KNOBS.get(slug, _steps_only(COUNT_KNOBS.get(slug, ()), slug))
    wb, wf = count_scale(slug, gpu, small, w.get("bytes", ())), count_scale(slug, gpu, small, w.get("flops", ()))
    if per_phase and all("torch_bytes" in d for _, _, d in phases):
        # each phase's ops grow by its own knobs (as its host steps), unless DEVICE_KNOBS names the chapter's;
        # the CPU-only phases' ops are not the GPU's
        b = f = 0.0
        for before, after, d in phases:
            steps = count_scale(slug, gpu, small, dknobs if slug in DEVICE_KNOBS else
                                _steps_only(phase_knobs(slug, before, after), slug))
            sized = _phase_key(PHASE_SIZED.get(slug, ()), before, after) is not None
            b += d["torch_bytes"] * steps * (1.0 if sized else wb)
            f += d.get("torch_flops", 0.0) * steps * (1.0 if sized else wf)
    else:
        steps = count_scale(slug, gpu, small, dknobs)
        b = counts.get("torch_bytes", 0.0) * steps * wb
        f = counts.get("torch_flops", 0.0) * steps * wf
    if b or f:
        t = max(b / (card["hbm_tbps"] * 1e12), f / (card["bf16_tflops"] * 1e12))
        device[f"torch ops at datasheet ceilings ({_fmt(b)}B, {_fmt(f)}FLOP)"] = t
    notes = [] if not counts.get("checks_failed") else [f"dry run failed {len(counts['checks_failed'])} check(s)"]
    if left_out:
        notes.append(f"{len(left_out)} CPU-only phase(s) left out ({', '.join(sorted({ph[0] for ph in left_out}))})")
    return Prediction(slug, budget_s, {"host": host, "compile": comp, "device": device}, warm_s, scale,
                      counts.get("cpu_s"), counts, notes)


def warm_step_s(predictions: list[Prediction]) -> float:
    """The script's warm step for these chapters (one part): start-up plus the parallel compiles."""
    w = sum(p.warm_s for p in predictions)
    return WARM_START_S + w if w else 0.0


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
