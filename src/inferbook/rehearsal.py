"""The dress rehearsal: a chapter's gpu-preset code path, run on CPU at a scaled-down size.

A GPU run is lent for minutes, once; a branch that only the gpu preset takes (bfloat16, compile on,
a mode the cpu preset never picks) must not meet its first run there. `rehearsal_params(slug)` is the
gpu preset with every *size* knob (ints, floats, comma lists, tuples) taken from the smoke preset and
every *branch* knob (a dtype or other choice, a bool, a named mode) kept from the gpu preset; knobs
in `KEEP_GPU` are kept too (a shape a gpu-only branch needs). `rehearse(slug)` runs `measure` with
them on CPU and counts what a step-count model needs (`inferbook.budgets`): torch calls from Python
(one host dispatch each on a GPU), host reads (`.item()`, `.tolist()`, `.cpu()`: a device sync each),
Triton launches and their distinct specialisations (one JIT compile each, cold), and torch.compile
graphs.

What it cannot show: a branch guarded by `device.type == "cuda"` (GPU timing, CUDA streams, NCCL)
does not run here; the rehearsal reports those chapters' GPU-only work through their `gpu_launches`
(compiled ahead of time, `inferbook inspect`) instead.
"""
from __future__ import annotations

import contextlib
import importlib
import time
from collections import Counter

import torch

# Knobs that stay at the gpu preset's value although they look like sizes: the branch depends on them.
KEEP_GPU: dict[str, tuple[str, ...]] = {
    "kimi-topk-tail-fusion": ("formats",),     # every weight format the gpu preset times
    "minimax-m3-moe": ("routed_scaling_factor",),
}


# The dress-rehearsal test's extra shrinking (`rehearsal_params(slug, fast=True)`): sizes and counts
# only (attention-test-matrix's `shapes` names shapes, a size list under names), so each chapter's gpu
# branches still run, in seconds.
FAST: dict[str, dict] = {
    "attention-test-matrix": {"shapes": "base,q>k,empty-q,empty-k"},   # the smoke shapes; the gpu kv layouts
    "upgrade-record": {"new_tokens": 2, "reps": 1, "serve_requests": 2},
    # the served model's size is a choice, not a code path: its presets (sizes) must match the smoke sizes
    "omni-h3-workflows": {"model": "toy-h3-tiny"},
}


def _is_branch(value, param) -> bool:
    if isinstance(value, bool) or getattr(param, "choices", None):
        return True
    if isinstance(value, str):   # a comma list of numbers is a size; a name is a branch
        return not all(p.strip().replace(".", "", 1).lstrip("-").isdigit() for p in value.split(",") if p.strip())
    return False


def chapter_module(slug: str):
    return importlib.import_module("inferbook.chapters." + slug.replace("-", "_"))


def rehearsal_params(slug: str, fast: bool = False) -> dict:
    """The gpu preset's branches at the smoke preset's sizes (see the module docstring); `fast`: with
    `FAST`'s further shrinking, for the test."""
    m = chapter_module(slug)
    gpu, smoke = m.PRESETS["gpu"], m.PRESETS["smoke"]
    out = {}
    for name, value in gpu.items():
        param = m.PARAMETERS.get(name)
        keep = _is_branch(value, param) or name in KEEP_GPU.get(slug, ()) or name not in smoke
        out[name] = value if keep else smoke[name]
    return {**out, **(FAST.get(slug, {}) if fast else {})}


class _LaunchCounter:
    """Counts Triton launches (compiled or interpreted) by kernel and by specialisation key."""

    def __init__(self):
        self.launches: Counter = Counter()
        self.specialisations: set = set()

    @staticmethod
    def _key(name, args, kwargs):
        def sig(v):
            if isinstance(v, torch.Tensor):
                return str(v.dtype)
            if isinstance(v, bool) or v is None:
                return v
            if isinstance(v, int):   # Triton specialises 1 and multiples of 16
                return "1" if v == 1 else ("d16" if v % 16 == 0 else "i")
            return v if isinstance(v, (float, str)) else type(v).__name__
        return (name, tuple(sig(a) for a in args), tuple(sorted((k, sig(v)) for k, v in kwargs.items())))

    @contextlib.contextmanager
    def patched(self):
        from triton.runtime import interpreter, jit

        originals = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]
        counter = self

        def wrap(orig):
            def run(self, *args, grid, warmup, **kwargs):
                if not warmup:
                    name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")
                    counter.launches[name] += 1
                    counter.specialisations.add(counter._key(name, args, kwargs))
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            return run

        try:
            for cls, orig in originals:
                cls.run = wrap(orig)
            yield self
        finally:
            for cls, orig in originals:
                cls.run = orig


# Tensor methods that read a value back to the host: on a GPU each one waits for the stream.
SCALAR_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})


class _TorchCallCounter:
    """Counts torch calls made from Python (torch.*, F.*, Tensor methods: one host dispatch each on a
    GPU; inside a compiled graph they are not made, so they are not counted) and host reads. A
    TorchFunctionMode, so it nests with a chapter's own profiler (a second Kineto profiler would not)."""

    def __init__(self):
        self.calls = 0
        self.scalar_reads = 0

    @contextlib.contextmanager
    def counting(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                counter.calls += 1
                if getattr(func, "__name__", "") in SCALAR_READS:
                    counter.scalar_reads += 1
                return func(*args, **(kwargs or {}))

        with Mode():
            yield self


def rehearse(slug: str, params: dict | None = None, seed: int = 0) -> dict:
    """Run `slug`'s measure on CPU with `params` (default `rehearsal_params(slug)`) and count its steps.
    Returns {slug, params, cpu_s, records, checks_failed, torch_calls, scalar_reads, triton_launches,
    triton_specialisations, compiled_graphs}. Raises what the chapter raises: that is the point."""
    from .context import setup

    params = dict(rehearsal_params(slug) if params is None else params)
    ctx = setup(slug, device="cpu", preset="gpu", seed=seed, budget_s="none", **params)
    graphs_before = _unique_graphs()
    launches, calls = _LaunchCounter(), _TorchCallCounter()
    t0 = time.perf_counter()
    with launches.patched(), calls.counting():
        records = ctx.measure()
    cpu_s = time.perf_counter() - t0
    ops = {"torch_calls": calls.calls, "scalar_reads": calls.scalar_reads}
    failed = [f"{r.name}: {c['name']}" for r in records for c in r.checks if not c["passed"]]
    return {"slug": slug, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
            "cpu_s": cpu_s, "records": len(records), "checks_failed": failed, **ops,
            "triton_launches": int(sum(launches.launches.values())),
            "triton_specialisations": len(launches.specialisations),
            "compiled_graphs": _unique_graphs() - graphs_before}


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:   # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])
