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


# Knobs that hold sizes under names, taken from the smoke preset in the dry run as every other size is:
# attention-test-matrix's `shapes` ("1023x1024" is a size, and its one case costs the interpreter minutes
# here); `inferbook.budgets` scales the counts by the number of shapes.
SIZE_NAMES: dict[str, tuple[str, ...]] = {
    "attention-test-matrix": ("shapes",),
    "omni-h3-workflows": ("model",),    # the served model's size must match the smoke sizes (its presets)
}


# The dress-rehearsal test's extra shrinking (`rehearsal_params(slug, fast=True)`): sizes and counts
# only (attention-test-matrix's `shapes` names shapes, a size list under names), so each chapter's gpu
# branches still run, in seconds.
FAST: dict[str, dict] = {
    "attention-test-matrix": {"shapes": "base,q>k,empty-q,empty-k"},   # the smoke shapes; the gpu kv layouts
    "upgrade-record": {"new_tokens": 2, "reps": 1, "serve_requests": 2},
    # the served model's size is a choice, not a code path: its presets (sizes) must match the smoke sizes
    "omni-h3-workflows": {"model": "toy-h3-tiny"},
    # bfloat16 and timer='wall' are the gpu branches: one request per slot, one repeat of each level
    "kimi-spec-budget": {"requests_per_slot": 1, "repeats": 1},
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
        keep = ((_is_branch(value, param) and name not in SIZE_NAMES.get(slug, ())) or name in KEEP_GPU.get(slug, ())
                or name not in smoke)
        out[name] = value if keep else smoke[name]
    return {**out, **(FAST.get(slug, {}) if fast else {})}


class _LaunchCounter:
    """Counts Triton launches (compiled or interpreted) by kernel and by specialisation key, and the CPU
    seconds spent inside them (the interpreter running a kernel is device work, not host work). While a
    launch runs, `torch_counter` (if set) is paused: the interpreter's own torch calls are not the
    chapter's."""

    def __init__(self, torch_counter=None):
        self.launches: Counter = Counter()
        self.specialisations: set = set()
        self.seconds = 0.0
        self.torch_counter = torch_counter

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
                if warmup:
                    return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
                name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")
                counter.launches[name] += 1
                counter.specialisations.add(counter._key(name, args, kwargs))
                tc = counter.torch_counter
                if tc is not None:
                    tc.paused += 1
                t0 = time.thread_time()
                try:
                    return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
                finally:
                    counter.seconds += time.thread_time() - t0
                    if tc is not None:
                        tc.paused -= 1
            return run

        try:
            for cls, orig in originals:
                cls.run = wrap(orig)
            yield self
        finally:
            for cls, orig in originals:
                cls.run = orig


# Tensor methods that read a value back to the host: on a GPU each one waits for the stream.
SCALAR_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
                          "is_nonzero"})
# Calls that read a tensor's metadata (no dispatch to a device, well under a microsecond natively).
METADATA = frozenset({"__get__", "size", "numel", "dim", "ndimension", "is_contiguous", "stride", "data_ptr",
                      "element_size", "storage_offset", "is_floating_point", "is_complex", "__len__", "__hash__",
                      "get_device", "nelement", "has_names", "is_pinned", "untyped_storage", "__format__",
                      "__repr__", "__str__", "requires_grad_", "__dlpack_device__"})
# Calls that dispatch but make a view (no kernel on the device: host cost only). A cast or `.contiguous()`
# may copy, so it counts as a kernel.
VIEWS = frozenset({"view", "view_as", "reshape", "__getitem__", "permute", "transpose", "t", "unsqueeze", "squeeze",
                   "expand", "expand_as", "narrow", "select", "split", "chunk", "as_strided", "flatten", "unflatten",
                   "unbind", "detach", "movedim", "swapaxes", "split_with_sizes", "tensor_split", "diagonal"})
# Calls whose device work is flop-bound: their flops are counted (2 * M * N * K).
MATMULS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "__matmul__", "einsum",
                     "scaled_dot_product_attention", "conv1d", "conv2d", "conv3d", "conv_transpose3d", "_scaled_mm",
                     "_int_mm"})


def _tensors(args, out):
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _matmul_flops(name, args, result) -> float:
    ts = _tensors(args, [])
    try:
        if name in ("conv1d", "conv2d", "conv3d", "conv_transpose3d") and len(ts) >= 2:
            w = ts[1]   # 2 * output elements * (in channels / groups * kernel volume)
            return 2.0 * result.numel() * (w[0].numel())
        if name == "scaled_dot_product_attention" and len(ts) >= 3:
            q, k = ts[0], ts[1]   # QK^T and PV: 4 * B*H * Lq * Lk * D
            return 4.0 * q.numel() * k.shape[-2]
        if isinstance(result, torch.Tensor) and len(ts) >= 2:
            k_dim = ts[-1].shape[-2] if name not in ("linear",) and ts[-1].dim() >= 2 else ts[0].shape[-1]
            return 2.0 * result.numel() * k_dim
    except Exception:
        return 0.0
    return 0.0


class _TorchCallCounter:
    """Counts torch calls made from Python (torch.*, F.*, Tensor methods; inside a compiled graph they
    are not made, so they are not counted), split by what each costs on a GPU host: `kernels` (dispatch
    and a device launch), `views` (dispatch, no launch), `metadata` (neither), `scalar_reads` (a host
    read: the stream drains). For kernel calls it also adds the bytes of their tensor arguments and
    results and, for matmul-like calls, their flops (the device work at the rehearsal's sizes), and it
    times the CPU seconds (of the calling thread) spent inside torch calls. A TorchFunctionMode, so it nests with a chapter's
    own profiler (a second Kineto profiler would not)."""

    def __init__(self):
        self.calls = 0
        self.scalar_reads = 0
        self.kernels = 0
        self.views = 0
        self.metadata = 0
        self.bytes = 0.0
        self.flops = 0.0
        self.seconds = 0.0
        self.paused = 0

    def snapshot(self) -> dict:
        return {"torch_calls": self.calls, "kernel_calls": self.kernels, "view_calls": self.views,
                "metadata_calls": self.metadata, "scalar_reads": self.scalar_reads,
                "torch_bytes": self.bytes, "torch_flops": self.flops, "torch_cpu_s": self.seconds}

    @contextlib.contextmanager
    def counting(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                # while Dynamo traces (torch.compile), the calls are not made at run time: not counted,
                # and nothing here may break the graph
                if counter.paused or torch.compiler.is_compiling():
                    return func(*args, **(kwargs or {}))
                name = getattr(func, "__name__", "")
                counter.calls += 1
                if name in METADATA:
                    counter.metadata += 1
                    return func(*args, **(kwargs or {}))
                t0 = time.thread_time()
                result = func(*args, **(kwargs or {}))
                counter.seconds += time.thread_time() - t0
                if name in SCALAR_READS:
                    counter.scalar_reads += 1
                elif name in VIEWS:
                    counter.views += 1
                else:
                    counter.kernels += 1
                    try:
                        ts = _tensors(args, _tensors(result if isinstance(result, (list, tuple)) else [result], []))
                        counter.bytes += sum(t.numel() * t.element_size() for t in ts)
                        if name in MATMULS:
                            counter.flops += _matmul_flops(name, args, result)
                    except Exception:
                        pass
                return result

        with Mode():
            yield self


def counting_overhead_s(n: int = 20000) -> dict:
    """CPU seconds the counting adds to one torch call beyond the call, on this CPU, per kind: loops of
    `n` cheap calls (an add: a kernel call; a view; a shape read: metadata) with and without
    `_TorchCallCounter` (`inferbook.budgets.COUNTING_OVERHEAD_S` holds the values measured here)."""
    x = torch.zeros(8, 8)
    loops = {"kernel_calls": lambda: x.add(1.0), "view_calls": lambda: x.view(64), "metadata_calls": lambda: x.shape}
    out = {}
    for kind, call in loops.items():
        t0 = time.thread_time()
        for _ in range(n):
            call()
        base = time.thread_time() - t0
        with _TorchCallCounter().counting():
            t0 = time.thread_time()
            for _ in range(n):
                call()
            counted = time.thread_time() - t0
        out[kind] = max(0.0, (counted - base) / n)
    return out


def _compile_seconds() -> float:
    """CPU seconds torch.compile has spent so far in this process (Dynamo + Inductor, cold)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except Exception:   # pragma: no cover - torch without dynamo
        return 0.0
    return float(sum(sum(v) for k, v in compilation_time_metrics.items() if k.endswith("compile_inner")))


def rehearse(slug: str, params: dict | None = None, seed: int = 0) -> dict:
    """Run `slug`'s measure on CPU with `params` (default `rehearsal_params(slug)`) and count its steps.
    Returns {slug, params, cpu_s, records, checks_failed, torch_calls (kernel_calls + view_calls +
    metadata_calls + scalar_reads), torch_bytes, torch_flops, triton_launches, triton_specialisations,
    triton_kernels ({name: launches}), compiled_graphs, and the CPU seconds split: torch_cpu_s (inside
    torch calls), triton_cpu_s (inside Triton launches), compile_cpu_s (torch.compile), python_cpu_s (the
    rest of the main thread's CPU time: the chapter's and the engine's own Python, with the counting's
    own cost in it, which `counting_overhead_s` measures per call), load_average_1m (the machine's load
    at the end: a loaded CPU runs Python slower); cpu_s is the dry
    run's wall time} and `phases`: the same counts between the
    creation of one record and the next, as [the earlier record's name, the later one's, counts] (a
    chapter that builds a record after measuring it does that work before the record's creation); a
    phase's counts are kernel_calls, view_calls, scalar_reads, metadata_calls, torch_bytes, torch_flops,
    triton_launches and its python_cpu_s (as the run's, between the two records' creation).
    Raises what the chapter raises: that is the point."""
    from .context import setup

    params = dict(rehearsal_params(slug) if params is None else params)
    ctx = setup(slug, device="cpu", preset="gpu", seed=seed, budget_s="none", **params)
    graphs_before, compile_before = _unique_graphs(), _compile_seconds()
    calls = _TorchCallCounter()
    launches = _LaunchCounter(calls)
    phases: list[list] = []

    def python_s():   # the main thread's CPU seconds outside torch calls, Triton launches and torch.compile
        return time.thread_time() - calls.seconds - launches.seconds - _compile_seconds()

    last = {"snap": calls.snapshot(), "launches": 0, "name": "(before the first record)", "python": python_s()}
    new_record = ctx.new_record

    def close_phase(next_name):
        snap, n, py = calls.snapshot(), int(sum(launches.launches.values())), python_s()
        delta = {k: snap[k] - last["snap"][k] for k in ("kernel_calls", "view_calls", "scalar_reads", "metadata_calls",
                                                        "torch_bytes", "torch_flops")}
        delta["triton_launches"] = n - last["launches"]
        if any(delta.values()):
            # the phase's own Python, so a phase scales its Python by its own knobs (`budgets.predict`)
            delta["python_cpu_s"] = max(0.0, py - last["python"])
            phases.append([last["name"], next_name, delta])
            last["python"] = py
        last.update(snap=snap, launches=n, name=next_name)   # a phase without calls: its Python goes to the next

    def counted_new_record(name, **kw):
        close_phase(name)
        return new_record(name, **kw)

    ctx.new_record = counted_new_record
    t0, c0 = time.perf_counter(), time.thread_time()
    with launches.patched(), calls.counting():
        records = ctx.measure()
    cpu_s, thread_s = time.perf_counter() - t0, time.thread_time() - c0
    close_phase("")
    compile_s = _compile_seconds() - compile_before
    snap = calls.snapshot()
    failed = [f"{r.name}: {c['name']}" for r in records for c in r.checks if not c["passed"]]
    return {"slug": slug, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
            "cpu_s": cpu_s, "records": len(records), "checks_failed": failed, **snap,
            "triton_launches": int(sum(launches.launches.values())),
            "triton_specialisations": len(launches.specialisations),
            "triton_kernels": dict(sorted(launches.launches.items())),
            "triton_cpu_s": launches.seconds, "compile_cpu_s": compile_s,
            "thread_cpu_s": thread_s, "load_average_1m": _load(),
            "python_cpu_s": max(0.0, thread_s - snap["torch_cpu_s"] - launches.seconds - compile_s),
            "compiled_graphs": _unique_graphs() - graphs_before, "phases": phases}


def _load() -> float | None:
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:   # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])
