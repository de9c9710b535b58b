"""Ahead-of-time compilation of the launches a chapter's `gpu` preset makes, for real NVIDIA targets.

A launch is described, not run: `Launch(name, kernel, args, kwargs, source)` carries the positional
arguments as the launcher passes them (tensors may be `ptr(dtype)` stand-ins or `meta` tensors: only
dtype and alignment matter to the compiler; Python ints as the launcher passes them, since Triton
specialises on ints equal to 1 and divisible by 16) and the keyword arguments (constexprs,
`num_warps`, `num_stages`). Each launcher builds its `Launch` from the same config function it
launches with, so the check sees what a GPU would run. Each chapter module with Triton kernels
declares `gpu_launches(params) -> list[Launch]` for its resolved `gpu` preset.

Compiling needs no GPU and no driver: a stand-in driver reports the target (sm_80, sm_90, sm_100)
and `JITFunction.run(..., warmup=True)` compiles without launching; registers and spills come from
the `ptxas -v` log of Triton's bundled ptxas. The Triton interpreter must be off in the compiling
process, so compiles run in subprocesses (`python -m inferbook.compiled _worker ...`) with
`TRITON_INTERPRET=0`, whatever the calling process uses. The Triton cache lives in
`.cache/triton-aot/` under the repository root (ignored by git), so a rerun only reads it.

    rows = inspect(["chord-w4a16"], ["sm_90"])       # one dict per (launch, target)
    print(format_table(rows))

`data/compiled/<slug>.json` keeps the table for all three targets (`inferbook inspect --all --save`);
the chapter pages read it (`compile_table`, `predicted_roofline`) and never compile. Each row carries
the launch's fingerprint (`launch_fingerprint`: name, kernel and its source hash, argument
specialisation, keyword arguments), so a table that no longer describes what the builders make is
detected without compiling. Code that launches kernels directly (a whole model) is traced instead:
`with recording() as launches:` records each launch rather than running it (on `meta` tensors).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError, choices

# Per-block opt-in shared-memory limits (CUDA programming guide, "Technical specifications per
# compute capability"): A100 163 KB, H100/H200 and B200 227 KB; LDS per workgroup on CDNA: 64 KB on
# gfx942 (MI300X), 160 KB on gfx950 (MI355X) (AMD CDNA3 / CDNA4 ISA guides).
TARGETS = {"sm_80": 80, "sm_90": 90, "sm_100": 100, "gfx942": "gfx942", "gfx950": "gfx950"}
NVIDIA_TARGETS = ("sm_80", "sm_90", "sm_100")
AMD_TARGETS = ("gfx942", "gfx950")
SMEM_LIMIT_KB = {80: 163, 90: 227, 100: 227, "gfx942": 64, "gfx950": 160}
TARGET_GPUS = {"sm_80": "A100", "sm_90": "H100/H200", "sm_100": "B200", "gfx942": "MI300X", "gfx950": "MI355X"}
DATA_DIR = "data/compiled"


@dataclass
class Launch:
    name: str          # one line of the table, e.g. "gate_up decode M16 N4096 K7168 cfg 16x64x128"
    kernel: Any        # the @triton.jit function
    args: list         # positional arguments as the launcher passes them
    kwargs: dict = field(default_factory=dict)  # constexprs + num_warps / num_stages
    source: str = ""   # where the launch happens, e.g. "moe/fused_moe.py:moe_gemm"
    grid: tuple = ()   # the launch grid the launcher would use (the cost model's CTA count; compiling ignores it)
    dram_bytes: float | None = None   # DRAM bytes the launch moves, when not every tensor argument once


def launch_shape_facts(launch: Launch) -> dict:
    """What the cost model needs from the launch itself: the grid and its CTA count (a grid the
    launcher computes from a callable is not known: 1), the DRAM bytes (`Launch.dram_bytes`, else
    every tensor argument's extent once; `ptr` stand-ins count one element) and the integer
    arguments by parameter name (the Triton IR's loop bounds are evaluated on them)."""
    grid = tuple(int(g) for g in launch.grid) if launch.grid and all(isinstance(g, int) for g in launch.grid) else ()
    seen, nbytes = set(), 0
    for a in list(launch.args) + list(launch.kwargs.values()):
        if isinstance(a, torch.Tensor) and id(a) not in seen:
            seen.add(id(a))
            if a.numel():
                extent = 1 + sum((s - 1) * abs(st) for s, st in zip(a.shape, a.stride()))
                nbytes += extent * a.element_size()
    names = list(getattr(launch.kernel, "arg_names", []) or [])
    ints = {n: int(a) for n, a in zip(names, launch.args) if isinstance(a, int) and not isinstance(a, bool)}
    ints.update({k: int(v) for k, v in launch.kwargs.items() if isinstance(v, int) and not isinstance(v, bool)})
    return {"grid": list(grid), "ctas": math.prod(grid) if grid else 1,
            "dram_bytes": float(launch.dram_bytes) if launch.dram_bytes is not None else float(nbytes),
            "dram_from": "builder" if launch.dram_bytes is not None else "tensor arguments", "int_args": ints}


def ptr(dtype: torch.dtype) -> torch.Tensor:
    """A one-element CPU tensor standing for a device pointer of `dtype`, 16-byte aligned as CUDA
    allocations are (the compiler reads only its dtype and alignment)."""
    return torch.empty(64, dtype=dtype)[:1]


def meta(shape, dtype: torch.dtype, strides=None) -> torch.Tensor:
    """A storage-less tensor of `shape`/`dtype` (and `strides`) for building launches: launchers'
    own argument code reads shapes and strides from it; compiling replaces it by `ptr(dtype)`."""
    shape = tuple(int(s) for s in shape)
    if strides is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, tuple(int(s) for s in strides), dtype=dtype, device="meta")


def gpu_device() -> torch.device:
    """The device launch builders pass to the config functions: only its `.type` is read."""
    return torch.device("cuda")


def specialization_key(launch: Launch) -> tuple:
    """What Triton compiles a separate kernel for: the kernel, tensor dtypes, for each int whether
    it is 1, divisible by 16 or needs 64 bits, float vs int, and the keyword arguments."""
    parts = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            parts.append(("t", str(a.dtype)))
        elif isinstance(a, bool):
            parts.append(("b", a))
        elif isinstance(a, int):
            parts.append(("i", a == 1, a % 16 == 0, not -2**31 <= a < 2**31))
        elif isinstance(a, float):
            parts.append(("f",))
        elif a is None:
            parts.append(("none",))
        else:
            parts.append((type(a).__name__,))
    fn = getattr(launch.kernel, "fn", launch.kernel)
    return (getattr(fn, "__module__", ""), getattr(fn, "__qualname__", str(fn)), tuple(parts),
            tuple(sorted((k, repr(v)) for k, v in launch.kwargs.items())))


def arg_spec(launch: Launch) -> str:
    """The positional arguments as Triton specialises them, one token each: a tensor's dtype
    ('bfloat16'), an int as 'i1' (== 1), 'i16' (divisible by 16), 'i64' (needs 64 bits) or 'i',
    'f' for a float, 'b' for a bool, 'none'."""
    out = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            out.append(str(a.dtype).replace("torch.", ""))
        elif isinstance(a, bool):
            out.append("b")
        elif isinstance(a, int):
            out.append("i1" if a == 1 else "i64" if not -2**31 <= a < 2**31 else "i16" if a % 16 == 0 else "i")
        elif isinstance(a, float):
            out.append("f")
        elif a is None:
            out.append("none")
        else:
            out.append(type(a).__name__)
    return ",".join(out)


def kernel_source_hash(kernel) -> str:
    """12 hex digits of sha256 of the @triton.jit function's own source (not its line number, not
    the helpers it calls): a change to the kernel's body makes a saved table stale."""
    import hashlib
    import inspect as _inspect

    fn = getattr(kernel, "fn", kernel)
    try:
        src = _inspect.getsource(fn)
    except (OSError, TypeError):
        src = getattr(kernel, "src", "") or repr(fn)
    return hashlib.sha256(src.encode()).hexdigest()[:12]


def kernel_name(launch: Launch) -> str:
    """The launched @triton.jit function's name (a table row's 'kernel')."""
    fn = getattr(launch.kernel, "fn", launch.kernel)
    return getattr(fn, "__name__", str(fn))


def launch_fingerprint(launch: Launch) -> dict:
    """What a saved table row must match for the table to describe this launch: its name, the kernel
    (name and source hash), the argument specialisation and the keyword arguments."""
    return {"launch": launch.name, "kernel": kernel_name(launch), "kernel_src": kernel_source_hash(launch.kernel),
            "args": arg_spec(launch), "constexprs": {k: _jsonable(v) for k, v in launch.kwargs.items()}}


def row_fingerprint(row: dict) -> dict:
    """`launch_fingerprint`'s fields of a saved row."""
    return {k: row.get(k) for k in ("launch", "kernel", "kernel_src", "args", "constexprs")}


_EVERY_LAUNCH: contextvars.ContextVar[bool] = contextvars.ContextVar("inferbook_every_launch", default=False)


@contextlib.contextmanager
def every_launch():
    """Inside this block `dedupe` keeps every launch: a config sweep (`compiled.sweep`) builds a chapter's
    launches at several configs and must find the same launch at the same place in each, where another
    tile could make two launches one specialisation."""
    token = _EVERY_LAUNCH.set(True)
    try:
        yield
    finally:
        _EVERY_LAUNCH.reset(token)


def dedupe(launches: list[Launch], keep_grids: tuple[str, ...] = ()) -> list[Launch]:
    """Launches that compile to different kernels, first of each kind kept (a sweep over sizes
    that Triton does not specialise on is one compile). A kernel named in `keep_grids` keeps one
    launch per specialisation *and grid*: the cost model's waves, residency and trips depend on the
    grid, so a launch of the same kernel at another grid is another row of the table (its compile
    comes from the cache). Inside `every_launch()`: all of them."""
    if _EVERY_LAUNCH.get():
        return list(launches)
    seen, out = set(), []
    for la in launches:
        key = specialization_key(la)
        if kernel_name(la) in keep_grids:
            key += (tuple(launch_shape_facts(la)["grid"]),)
        if key not in seen:
            seen.add(key)
            out.append(la)
    return out


class recording:
    """Inside `with recording() as launches:` every Triton launch is appended to `launches` (a
    `Launch` named `<kernel>`, with the arguments, keyword arguments and grid the launcher passed)
    instead of running, and the device questions are answered as on a GPU: `triton_backend_for`
    says yes, `dot_needs_fp32` and `bf16_cast_needs_emulation` say no (in every loaded inferbook
    module that imported them). With `meta` tensors this traces a whole model's launches (shapes,
    strides, dtypes, constexprs) without computing anything: for code that launches kernels
    directly rather than through a builder (the diffusion VAE's fused ops)."""

    _FLAGS = {"dot_needs_fp32": lambda d: False, "bf16_cast_needs_emulation": lambda d: False,
              "triton_backend_for": lambda d: (True, "recorded as for a GPU (inferbook.compiled.recording)")}

    def __init__(self, source: str = "", patch: dict | None = None):
        """`patch`: {(module, attribute): value} set for the duration too (a launcher's own device
        question, e.g. a config function that asks `device.type == "cuda"`)."""
        self.source = source
        self.patch = dict(patch or {})
        self.launches: list[Launch] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> list[Launch]:
        from .. import device as _device

        current = {name: getattr(_device, name) for name in self._FLAGS}
        for mod in [m for n, m in list(sys.modules.items()) if n == "inferbook" or n.startswith("inferbook.")]:
            for name, fake in self._FLAGS.items():
                f = getattr(mod, name, None)
                # the device module's function, or a module's own import of it (also when patched since)
                if f is not None and (f is current[name] or getattr(f, "__module__", None) == _device.__name__):
                    self._undo.append((mod, name, f))
                    setattr(mod, name, fake)
        for (obj, name), value in self.patch.items():
            self._undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        launches, source = self.launches, self.source

        def record(kernel, *args, grid, warmup, **kwargs):
            fn = getattr(kernel, "fn", kernel)
            launches.append(Launch(getattr(fn, "__name__", str(fn)), kernel, list(args), dict(kwargs),
                                   source or getattr(fn, "__module__", ""), tuple(grid) if isinstance(grid, tuple) else ()))

        try:
            from triton.runtime.jit import JITFunction
            self._undo.append((JITFunction, "run", JITFunction.__dict__["run"]))
            JITFunction.run = record
        except Exception:  # pragma: no cover - no triton
            pass
        try:
            from triton.runtime.interpreter import InterpretedFunction
            self._undo.append((InterpretedFunction, "run", InterpretedFunction.__dict__["run"]))
            InterpretedFunction.run = record
        except Exception:  # pragma: no cover
            pass
        return launches

    def __exit__(self, *exc) -> None:
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()


def describe(launch: Launch) -> str:
    """A short description of a recorded launch's tensors for its table name: 'bf16[1,128,17,256,448]'."""
    for a in launch.args:
        if isinstance(a, torch.Tensor) and a.dim():
            return f"{str(a.dtype).replace('torch.', '')}[{','.join(map(str, a.shape))}]"
    return ""


# ---------------------------------------------------------------------------------------------------
# What the compiler made: parsing PTX and the ptxas log (pure functions, unit-tested on fixed text)

_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_WGMMA = re.compile(r"\bwgmma\.mma_async(?:\.sp)?\.sync\.aligned\.(m\d+n\d+k\d+)")
_RE_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)")
_RE_TCGEN05 = re.compile(r"\btcgen05\.mma(?:\.sp)?(?:\.cta_group::\d)?(?:\.(kind::\w+))?")
_RE_LD = re.compile(r"\bld\.global((?:\.[A-Za-z0-9_:]+)*)")
_RE_ST = re.compile(r"\bst\.global((?:\.[A-Za-z0-9_:]+)*)")
_RE_CP_ASYNC = re.compile(r"\bcp\.async\.(?:ca|cg)\.shared(?:::cta)?\.global(?:\.[A-Za-z0-9_:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(\w+)")
_RE_TMA = re.compile(r"\bcp\.async\.bulk\.tensor")
_TYPE_BITS = re.compile(r"^[bsuf](8|16|32|64|128)$")


def parse_ptxas(log: str) -> dict:
    """Registers per thread and spill bytes from a `ptxas -v` log (the last function reported)."""
    regs = _RE_REGS.findall(log)
    spill = _RE_SPILL.findall(log)
    st, ld = (int(spill[-1][0]), int(spill[-1][1])) if spill else (0, 0)
    return {"regs": int(regs[-1]) if regs else None, "spill_stores": st, "spill_loads": ld,
            "spill_bytes": st + ld}


def mma_family(ptx: str) -> dict:
    """The matrix instructions in a kernel's PTX: {'family', 'shapes', 'counts'}.

    family: 'tcgen05' (Blackwell, sm_100), 'wgmma' (Hopper warpgroup MMA), 'mma.sync' (warp-level,
    Ampere and the fallback elsewhere), several joined by '+', or '-' when the kernel has no MMA.
    tcgen05.mma carries its shape in the instruction descriptor, not the mnemonic: its 'kind' is
    reported instead (e.g. kind::f16)."""
    counts: dict[str, int] = {}
    shapes: list[str] = []
    tc = _RE_TCGEN05.findall(ptx)
    if tc:
        counts["tcgen05"] = len(tc)
        shapes += sorted({k for k in tc if k})
    wg = _RE_WGMMA.findall(ptx)
    if wg:
        counts["wgmma"] = len(wg)
        shapes += sorted(set(wg), key=_shape_key)
    ms = _RE_MMA_SYNC.findall(ptx)
    if ms:
        counts["mma.sync"] = len(ms)
        shapes += sorted(set(ms), key=_shape_key)
    return {"family": "+".join(counts) or "-", "shapes": shapes, "counts": counts}


def _shape_key(s: str):
    return tuple(int(x) for x in re.findall(r"\d+", s))


def _access_bytes(suffixes: str) -> int | None:
    """Bytes one thread moves in one ld/st.global: vector width times element bits."""
    vec, bits = 1, None
    for part in suffixes.split("."):
        if part in ("v2", "v4", "v8"):
            vec = int(part[1:])
        m = _TYPE_BITS.match(part)
        if m:
            bits = int(m.group(1))
    return vec * bits // 8 if bits else None


def global_loads(ptx: str) -> dict:
    """Global-memory access widths in the PTX: {'ld': {bytes: count}, 'st': {bytes: count},
    'cp_async': {bytes: count}, 'tma': count}. 16-byte accesses are what full bandwidth needs."""
    def by_width(matches):
        out: dict[int, int] = {}
        for m in matches:
            w = _access_bytes(m)
            if w is not None:
                out[w] = out.get(w, 0) + 1
        return dict(sorted(out.items(), reverse=True))

    cp: dict[int, int] = {}
    for size in _RE_CP_ASYNC.findall(ptx):
        try:
            w = int(size, 0)
        except ValueError:
            continue
        cp[w] = cp.get(w, 0) + 1
    return {"ld": by_width(_RE_LD.findall(ptx)), "st": by_width(_RE_ST.findall(ptx)),
            "cp_async": dict(sorted(cp.items(), reverse=True)), "tma": len(_RE_TMA.findall(ptx))}


def loads_summary(loads: dict) -> str:
    """'ld 16B×8 2B×1 · cp.async 16B×48 · tma×0' (counts of instructions in the PTX, not executions)."""
    parts = []
    if loads.get("ld"):
        parts.append("ld " + " ".join(f"{w}B×{n}" for w, n in loads["ld"].items()))
    if loads.get("cp_async"):
        parts.append("cp.async " + " ".join(f"{w}B×{n}" for w, n in loads["cp_async"].items()))
    if loads.get("tma"):
        parts.append(f"tma×{loads['tma']}")
    return " · ".join(parts) or "-"


def mma_summary(mma: dict) -> str:
    if mma["family"] == "-":
        return "-"
    return f"{mma['family']} {','.join(mma['shapes'])}".strip()


# Kernels that must not spill registers, per target (issue 13: moe_gemm and mx_quantize on sm_90).
NO_SPILL = {"sm_80": ("moe_gemm_kernel",),
            "sm_90": ("moe_gemm_kernel", "mx_quantize_kernel", "mx_quantize_rowcol_kernel")}


def problems(row: dict) -> list[str]:
    """What makes a row a failure: a compile error, shared memory over the per-block limit, or spills
    in a kernel that `NO_SPILL` says must not spill on that target."""
    if not row.get("ok"):
        return [f"compile error: {row.get('error', '?')}"]
    out = []
    if row["shared_kb"] > row["smem_limit_kb"]:
        out.append(f"shared memory {row['shared_kb']:.1f} KB > {row['smem_limit_kb']} KB per-block limit "
                   f"of {row['target']} ({TARGET_GPUS.get(row['target'], '')})")
    if row.get("spill_bytes") and row.get("kernel") in NO_SPILL.get(row["target"], ()):
        out.append(f"{row['spill_bytes']} bytes of register spills ({row['regs']} registers) in "
                   f"{row['kernel']} on {row['target']}, which must not spill")
    return out


# ---------------------------------------------------------------------------------------------------
# Which launches: the chapters' gpu presets

def gpu_params(slug: str) -> dict:
    """The resolved `gpu` preset of a chapter."""
    from .. import toc
    from ..presets import resolve_params

    info = toc.get_chapter(slug)
    mod = toc.load_module(info)
    return resolve_params(slug, mod.PARAMETERS, mod.PRESETS, "gpu", {})


def has_launches(slug: str) -> bool:
    from .. import toc

    return hasattr(toc.load_module(toc.get_chapter(slug)), "gpu_launches")


def launches_for(slug: str, target: str | None = None) -> list[Launch]:
    """The Triton launches chapter `slug` makes at its gpu preset ([] for chapters without kernels),
    built for `target` (inside `device.building_for(target)`: config functions that ask
    `device.pick_config` choose that target's config; None: the NVIDIA configs, as a CUDA device has).
    `py:package.module:function` names a function returning launches instead (the cost model's
    hand-checked kernels: `py:inferbook.compiled.calibration:launches`)."""
    return _build_launches(slug, target)[0]


def _build_launches(slug: str, target: str | None) -> tuple[list[Launch], bool]:
    """(launches, whether a config asked the target)."""
    from .. import toc
    from ..device import building_for

    with building_for(target) as build:
        if slug.startswith("py:"):
            import importlib

            mod_name, fn_name = slug[3:].split(":")
            launches = list(getattr(importlib.import_module(mod_name), fn_name)({}))
        else:
            fn = getattr(toc.load_module(toc.get_chapter(slug)), "gpu_launches", None)
            launches = [] if fn is None else list(fn(gpu_params(slug)))
    return launches, build.asked


def launches_by_target(slug: str, targets) -> dict[str, list[Launch]]:
    """{target: `launches_for(slug, target)`} for each of `targets`, built once when no config asked
    the target (the path to a config's first question is the same for every target, so a build that
    asked nothing is every target's)."""
    return _launches_and_asked(slug, targets)[0]


def _launches_and_asked(slug: str, targets) -> tuple[dict[str, list[Launch]], bool]:
    out: dict[str, list[Launch]] = {}
    for t in targets:
        launches, asked = _build_launches(slug, t)
        out[t] = launches
        if not asked:
            return {t2: launches for t2 in targets}, False
    return out, True


def kernel_chapters() -> list[str]:
    """Slugs of the chapters whose modules declare `gpu_launches`."""
    from .. import toc

    out = []
    for slug in toc.CHAPTERS:
        try:
            if has_launches(slug):
                out.append(slug)
        except UserError:
            continue
    return out


# ---------------------------------------------------------------------------------------------------
# Compiling (only in a process whose Triton interpreter is off)

class _AOTDriver:
    """Stands in for the CUDA driver: reports the target; nothing is ever launched."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return f"aot-sm{self.target.arch}"   # one JIT device cache per target

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def _stand_in(a):
    return ptr(a.dtype) if isinstance(a, torch.Tensor) else a


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return repr(v)


def _facts_dir() -> Path:
    d = Path(os.environ["TRITON_CACHE_DIR"]) / "inferbook-ptxas"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _ptxas_log(ptx: str, arch: int, fp_fusion: bool) -> str:
    """`ptxas -v` on the PTX with Triton's flags, for a kernel that came from Triton's cache (Triton
    runs ptxas only on a cold compile, and the log is where registers and spills are)."""
    from triton.backends.nvidia import compiler as nvc

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        cmd = [nvc.get_ptxas(arch).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={nvc.sm_arch_from_capability(arch)}", str(src),
               "-o", str(Path(d) / "k.o")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        return r.stdout + r.stderr


def compile_launch(launch: Launch, target: str) -> dict:
    """Compile one launch for `target` ('sm_80' | 'sm_90' | 'sm_100' | 'gfx942' | 'gfx950') and describe it.

    Must run where TRITON_INTERPRET=0 was set before Triton was imported (see `inspect`)."""
    import contextlib
    import io

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    arch = TARGETS[target]
    kw = dict(launch.kwargs)
    row = {**launch_fingerprint(launch), "target": target, "source": launch.source,
           "num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3),
           "smem_limit_kb": SMEM_LIMIT_KB[arch]}
    if not hasattr(launch.kernel, "run") or type(launch.kernel).__name__ == "InterpretedFunction":
        return {**row, "ok": False, "error": "the Triton interpreter is on in the compiling process"}
    if target in AMD_TARGETS:
        return _compile_hip(launch, target, row)
    knobs.nvidia.dump_ptxas_log = True
    driver.set_active(_AOTDriver(GPUTarget("cuda", arch, 32)))
    t0 = time.perf_counter()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            ck = launch.kernel.run(*[_stand_in(a) for a in launch.args], grid=(1,), warmup=True, **kw)
    except Exception as e:  # a compile error is a result: keep its first lines
        return {**row, "ok": False, "error": _error_text(e),
                "compile_s": round(time.perf_counter() - t0, 2)}
    ptx = ck.asm.get("ptx", "")
    facts = _facts_dir() / f"{ck.hash}-{arch}.log"
    log = buf.getvalue()
    if _RE_REGS.search(log):
        facts.write_text(log)
    elif facts.is_file():
        log = facts.read_text()
    else:
        log = _ptxas_log(ptx, arch, kw.get("enable_fp_fusion", True))
        facts.write_text(log)
    md = ck.metadata
    row.update(machine_facts(ck, launch, "sass"))
    mma = mma_family(ptx)
    loads = global_loads(ptx)
    row.update(ok=True, compile_s=round(time.perf_counter() - t0, 2), shared_kb=round(int(md.shared) / 1024, 1),
               num_warps=int(md.num_warps), num_stages=int(md.num_stages), **parse_ptxas(log),
               mma=mma_summary(mma), mma_family=mma["family"], mma_counts=mma["counts"], loads=loads,
               loads_summary=loads_summary(loads))
    row["smem_ok"] = row["shared_kb"] <= row["smem_limit_kb"]
    return row


_RE_MFMA = re.compile(r"\bv_(s?mfma|wmma)_(?:[a-z0-9]+_)?(\d+x\d+x\d+)(?:_?(\w+))?")
_RE_AMD_LOAD = re.compile(r"\b(global|buffer)_load_(?:lds_)?(\w+)")


def amd_metadata(asm: str) -> dict:
    """VGPRs, AGPRs, spills, scratch bytes per lane and the compiler's occupancy (waves per SIMD) from
    the AMDGCN assembly's metadata and its closing comments. 'vgprs' is the code object's `.vgpr_count`:
    on gfx90a and later (CDNA3/4) the unified register file's whole allocation, the AGPRs ('agprs')
    included (the listing's TotalNumVgprs: arch VGPRs up to the accum offset, then the AGPRs)."""
    def num(pattern, default=0):
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else default
    return {"vgprs": num(r"\.vgpr_count:\s+(\d+)"), "agprs": num(r"\.agpr_count:\s+(\d+)"),
            "vgpr_spills": num(r"\.vgpr_spill_count:\s+(\d+)"), "sgpr_spills": num(r"\.sgpr_spill_count:\s+(\d+)"),
            "scratch_bytes": num(r"\.private_segment_fixed_size:\s+(\d+)"),
            "compiler_occupancy": num(r"; Occupancy: (\d+)", None)}


def mfma_family(asm: str) -> dict:
    """The matrix instructions in AMDGCN: {'family': 'mfma' | 'smfmac' | 'wmma' | '-', 'shapes':
    ['32x32x8 bf16', ...], 'counts'}."""
    counts: dict[str, int] = {}
    shapes: list[str] = []
    for fam, shape, ty in _RE_MFMA.findall(asm):
        counts[fam] = counts.get(fam, 0) + 1
        label = f"{shape} {ty}".strip()
        if label not in shapes:
            shapes.append(label)
    return {"family": "+".join(counts) or "-", "shapes": shapes, "counts": counts}


def amd_loads(asm: str) -> dict:
    """Global loads in AMDGCN by bytes per lane: {'ld': {bytes: count}, 'st': {}, 'cp_async': {...} (loads
    straight into LDS), 'tma': 0}, in the shape `loads_summary` reads."""
    from .machine import _amd_global_bytes

    ld: dict[int, int] = {}
    lds: dict[int, int] = {}
    for line in asm.splitlines():
        s = line.strip()
        if _RE_AMD_LOAD.match(s):
            w = _amd_global_bytes(s)
            target = lds if ("_lds_" in s.split()[0] or " lds" in s) else ld
            target[w] = target.get(w, 0) + 1
    return {"ld": dict(sorted(ld.items(), reverse=True)), "st": {}, "cp_async": dict(sorted(lds.items(), reverse=True)),
            "tma": 0}


def _error_text(e: Exception) -> str:
    """A compile error for the table: its first three lines (where in the kernel) and, when the
    message is longer, its last line (Triton's CompilationError puts the reason there)."""
    msg = [x.strip() for x in f"{type(e).__name__}: {e}".strip().splitlines() if x.strip()]
    head = " ".join(msg[:3])
    if len(msg) <= 3:
        return head[:600]
    return head[:590 - len(msg[-1][:300])] + " … " + msg[-1][:300]


def _compile_hip_kernel(launch: Launch, target: str):
    """The CompiledKernel of one launch for a CDNA target, through Triton's AMD backend (no GPU, no ROCm)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    driver.set_active(_AOTDriver(GPUTarget("hip", target, 64)))
    return launch.kernel.run(*[_stand_in(a) for a in launch.args], grid=(1,), warmup=True, **dict(launch.kwargs))


def amdgcn(launch: Launch, target: str) -> str:
    """One launch's AMDGCN listing for `target` ('gfx942' | 'gfx950'), for a test or a reader to read the
    machine code itself. Must run where TRITON_INTERPRET=0 was set before Triton was imported."""
    if target not in AMD_TARGETS:
        raise ValueError(f"amdgcn: target {target!r} is not one of {sorted(AMD_TARGETS)}")
    return _compile_hip_kernel(launch, target).asm.get("amdgcn", "")


def _compile_hip(launch: Launch, target: str, row: dict) -> dict:
    """`compile_launch` for a CDNA target: HSACO through Triton's AMD backend (no GPU, no ROCm);
    LDS from the kernel's metadata, VGPRs/AGPRs, spills and scratch from the AMDGCN."""
    t0 = time.perf_counter()
    try:
        ck = _compile_hip_kernel(launch, target)
    except Exception as e:
        return {**row, "ok": False, "error": _error_text(e), "compile_s": round(time.perf_counter() - t0, 2)}
    asm = ck.asm.get("amdgcn", "")
    md = ck.metadata
    meta_ = amd_metadata(asm)
    mma = mfma_family(asm)
    loads = amd_loads(asm)
    row.update(machine_facts(ck, launch, "amdgcn"))
    spill = meta_["scratch_bytes"]
    row.update(ok=True, compile_s=round(time.perf_counter() - t0, 2), shared_kb=round(int(md.shared) / 1024, 1),
               num_warps=int(md.num_warps), num_stages=int(getattr(md, "num_stages", row["num_stages"]) or 0),
               wave_size=int(getattr(md, "warp_size", 64) or 64), regs=meta_["vgprs"], **meta_,
               spill_stores=meta_["vgpr_spills"] + meta_["sgpr_spills"], spill_loads=0, spill_bytes=spill,
               mma=mma_summary(mma), mma_family=mma["family"], mma_counts=mma["counts"], loads=loads,
               loads_summary=loads_summary(loads).replace("cp.async", "to LDS"))
    row["smem_ok"] = row["shared_kb"] <= row["smem_limit_kb"]
    from .cost import residency

    occ = residency(row)
    row["waves_per_simd"] = occ["ctas_per_sm"] * -(-row["num_warps"] // 4)
    return row


def _nvdisasm(cubin: bytes) -> str:
    """The SASS listing of a cubin from Triton's bundled nvdisasm (labels and branch targets kept)."""
    from triton.backends.nvidia import compiler as nvc

    tool = Path(nvc.get_ptxas(90).path).with_name("nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cubin"
        src.write_bytes(cubin)
        r = subprocess.run([str(tool), "-c", str(src)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"nvdisasm failed: {r.stderr[:300]}")
        return r.stdout


def machine_facts(ck, launch: Launch, isa: str) -> dict:
    """The cost model's inputs from a compiled kernel: the launch's grid, DRAM bytes and integer
    arguments, the main loop of its machine code (`machine.main_loop`), and the trips and dot FLOPs
    of its Triton IR (`machine.ttir_loops`; across the grid: `machine.program_trips`)."""
    from . import machine

    shape = launch_shape_facts(launch)
    if isa == "sass":
        loop = machine.main_loop(machine.sass_instructions(_nvdisasm(ck.asm["cubin"])), "sass")
    else:
        loop = machine.main_loop(machine.amdgcn_instructions(ck.asm.get("amdgcn", "")), "amdgcn")
    ttir, grid = ck.asm.get("ttir", ""), shape["grid"] or (1,)
    ir = machine.ttir_loops(ttir, shape["int_args"], grid)
    key = "sass" if isa == "sass" else "isa_loop"
    # the trips of the other programs too: the busiest SM may hold the longest CTAs (an uneven split)
    spread = machine.program_trips(ttir, shape["int_args"], grid) if ir["trips_known"] else {}
    return {"grid": shape["grid"], "ctas": shape["ctas"], "dram_bytes": shape["dram_bytes"], "dram_from": shape["dram_from"],
            key: loop, "trips": ir["main_trips"], "trips_known": ir["trips_known"], **spread,
            "flops_per_cta": ir["flops_per_cta"], "dots": ir["dots"], "sync_atomics": machine.sync_atomics(ttir)}


def _worker(out_path: str, slugs: list[str], targets: list[str], shard: int, shards: int,
            only: dict[str, list[int]] | None = None) -> None:
    """Compile every shards-th (launch, target) job of `slugs`, starting at `shard`; one JSON row per line.
    `only` ({slug: launch indices}): just those launches (see `inspect`)."""
    from .. import device

    assert not device.triton_interpreted(), "the Triton interpreter is on in the compiling process"
    jobs = []
    rows = []
    for slug in slugs:
        try:       # each target's own launches: a config may differ per target (device.pick_config)
            by_target, asked = _launches_and_asked(slug, targets)
        except Exception as e:  # a builder that no longer matches its kernel: a failure row, named
            if shard == 0:
                for t in targets:
                    rows.append({"slug": slug, "index": -1, "launch": f"{slug}: gpu_launches()", "target": t,
                                 "ok": False, "error": f"building the launches failed: {type(e).__name__}: {e}"[:600],
                                 "smem_limit_kb": SMEM_LIMIT_KB[TARGETS[t]], "source": "", "kernel": ""})
            continue
        nvidia = None
        for t in targets:
            if t in AMD_TARGETS and nvidia is None and asked:     # a build that asked no target: nothing differs
                # sm_90's launches, as a single-target run takes them: the first NVIDIA target of a full run
                # (sm_80) has configs of its own, and pairing with it left rows unpaired
                nvidia = by_target.get("sm_90") or launches_for(slug, "sm_90")
            pairs = (nvidia_counterparts(by_target[t], nvidia) if t in AMD_TARGETS and nvidia is not None
                     else [None] * len(by_target[t]))
            jobs += [(slug, i, launch, t, nv) for i, (launch, nv) in enumerate(zip(by_target[t], pairs))
                     if only is None or i in only.get(slug, ())]
    sampled: dict[tuple, int] = {}
    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for j, (slug, i, launch, t, nv) in enumerate(jobs):
            if nv is not None:      # the NVIDIA config compiled for the first COUNTERPARTS_PER_KIND of a kind
                kind = (slug, t, getattr(launch.kernel, "__name__", str(launch.kernel)),
                        json.dumps(nvidia_config_facts(launch, nv, {})["differ"], sort_keys=True, default=str))
                sampled[kind] = sampled.get(kind, 0) + 1
            if j % shards != shard:
                continue
            r = compile_launch(launch, t)
            if nv is not None:
                r["nvidia_config"] = (nvidia_config_facts(launch, nv, compile_launch(nv, t))
                                      if sampled[kind] <= COUNTERPARTS_PER_KIND else
                                      {**nvidia_config_facts(launch, nv, {}), "ok": None, "compiled": False})
            f.write(json.dumps({"slug": slug, "index": i, **r}, default=str) + "\n")
            f.flush()


# An AMD row whose config differs from NVIDIA's gets the NVIDIA config compiled beside it for the first
# few launches of each kind (same kernel, same differing keyword arguments on a target); the rest say
# `compiled: False` (the attention matrix has dozens of one kind, each a slow compile on a CPU).
COUNTERPARTS_PER_KIND = 3


def nvidia_counterparts(amd: list[Launch], nvidia: list[Launch]) -> list[Launch | None]:
    """For each launch built for an AMD target, the launch the NVIDIA configs make in its place where
    the two differ (None where they are the same): paired by position when both lists have the same
    kernels in the same order, else by name and kernel."""
    def kern(la):
        return getattr(la.kernel, "fn", la.kernel)

    if len(amd) == len(nvidia) and all(kern(a) is kern(b) for a, b in zip(amd, nvidia)):
        pairs = list(nvidia)
    else:
        by_name = {}
        for b in nvidia:
            by_name.setdefault((b.name, kern(b)), b)
        pairs = [by_name.get((a.name, kern(a))) for a in amd]
    return [b if b is not None and launch_fingerprint(b) != launch_fingerprint(a) else None for a, b in zip(amd, pairs)]


def nvidia_config_facts(launch: Launch, nvidia: Launch, row: dict) -> dict:
    """What the NVIDIA config of a launch made on an AMD target (`row`, from `compile_launch`): the
    keyword arguments that differ ({name: [nvidia, amd]}) and its LDS, VGPRs, AGPRs, scratch, or its
    compile error. Kept in the AMD row as `nvidia_config`, so a page can say how the NVIDIA tile fares."""
    differ = {k: [_jsonable(nvidia.kwargs.get(k)), _jsonable(launch.kwargs.get(k))]
              for k in sorted(set(launch.kwargs) | set(nvidia.kwargs)) if nvidia.kwargs.get(k) != launch.kwargs.get(k)}
    out = {"launch": nvidia.name, "differ": differ, "ok": bool(row.get("ok"))}
    if not row.get("ok"):
        out["error"] = row.get("error", "")[:300]
        return out
    out.update({k: row.get(k) for k in ("shared_kb", "smem_limit_kb", "smem_ok", "vgprs", "agprs", "scratch_bytes",
                                         "num_warps", "num_stages", "mma")})
    return out


def restart_compiling(module: str, argv: list[str]) -> None:
    """Where the Triton interpreter is on (the test suite, a notebook), run `python -m module argv` in this
    process's place with the interpreter off, as `inspect`'s workers compile (fp fusion on unless
    set): the sweep tools compile for real. Returns where it is already off."""
    if os.environ.get("TRITON_INTERPRET") == "0":
        return
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def run_tool(name: str, argv: list[str], parse, run) -> int:
    """A compiling tool's main: `parse(argv)` (a `UserError` is one line `name: ...` and exit 2, before any
    compile), then `run(args)` with the Triton cache in a temporary folder of the tool's own unless set."""
    try:
        a = parse(argv)
    except UserError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"inferbook-{name.replace('_', '-')}"))
    run(a)
    return 0


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def default_cache_dir() -> Path:
    """.cache/triton-aot under the repository root (INFERBOOK_AOT_CACHE overrides): kept between runs."""
    return Path(os.environ.get("INFERBOOK_AOT_CACHE") or repo_root() / ".cache" / "triton-aot")


def inspect(slugs: list[str], targets: list[str], *, jobs: int = 2, cache_dir: str | Path | None = None,
            timeout_s: float = 7200, only: dict[str, list[int]] | None = None) -> list[dict]:
    """Compile every gpu-preset launch of `slugs` for `targets` in `jobs` subprocesses with the
    interpreter off; returns one row per (launch, target), in launch order. `only` ({slug: launch
    indices, as in the saved tables}) compiles just those launches of each slug (the test suite's
    representatives); the jobs are dealt out after that choice, so the processes share them evenly."""
    for t in targets:
        if t not in TARGETS:
            raise UserError(f"unknown target {t!r}; choose {choices(TARGETS)} or all")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache),
           "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
           "PYTHONPATH": os.pathsep.join([str(repo_root() / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    jobs = max(1, int(jobs))
    with tempfile.TemporaryDirectory() as d:
        extra = []
        if only is not None:
            (Path(d) / "only.json").write_text(json.dumps({s: sorted(map(int, ix)) for s, ix in only.items()}))
            extra = [str(Path(d) / "only.json")]
        procs = []
        for k in range(jobs):
            out = Path(d) / f"rows{k}.jsonl"
            cmd = [sys.executable, "-m", "inferbook.compiled", "_worker", str(out), ",".join(slugs),
                   ",".join(targets), str(k), str(jobs), *extra]
            log = open(Path(d) / f"log{k}.txt", "w")   # a file, not a pipe: a full pipe would stall the worker
            procs.append((out, log, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        rows = []
        for out, log, p in procs:
            p.wait(timeout=timeout_s)
            log.close()
            if p.returncode != 0:
                text = Path(log.name).read_text()
                raise RuntimeError(f"compile worker failed (exit {p.returncode}):\n{text[-3000:]}")
            rows += [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    order = {s: n for n, s in enumerate(slugs)}
    tix = {t: n for n, t in enumerate(TARGETS)}
    rows.sort(key=lambda r: (order[r["slug"]], r["index"], tix[r["target"]]))
    return rows


# ---------------------------------------------------------------------------------------------------
# The table: printed by `inferbook inspect`, kept in data/compiled/<slug>.json, shown on the pages

def format_row(r: dict, prediction: dict | None = None) -> str:
    name = r["launch"][:60]
    if not r.get("ok"):
        return f"{name:60s} {r['target']:6s} ERROR {r.get('error', '')[:200]}"
    flag = "" if r["shared_kb"] <= r["smem_limit_kb"] else "  <-- over the shared-memory limit"
    regs = r.get("regs") if r.get("regs") is not None else (r.get("vgprs") or 0)
    pred = "-"
    if prediction is not None:
        from ..measure import significant

        pred = f"{significant(prediction['seconds'] * 1e6)} µs {prediction['bound']}"
    loop = r.get("sass") or r.get("isa_loop") or {}
    rounds = "-" if loop.get("load_rounds") is None else str(loop["load_rounds"])
    return (f"{name:60s} {r['target']:6s} {pred:>20s}  {r['shared_kb']:6.1f}/{r['smem_limit_kb']:<3d} "
            f"{regs or 0:4d} {r['spill_bytes']:6d} {rounds:>6s}  {r['mma']:30s} {r['loads_summary']}{flag}")


def format_table(rows: list[dict]) -> str:
    """One line per row with the cost model's predicted time and binding bound on the target's default
    card (`TARGET_CARD`; '-' for a row without machine-code facts), then the resources."""
    preds = {}
    for t in {r["target"] for r in rows}:
        tr = [r for r in rows if r["target"] == t and r.get("ok") and ("sass" in r or "isa_loop" in r)]
        for r, p in zip(tr, predict_rows(tr, TARGET_CARD[t])):
            preds[id(r)] = p
    head = (f"{'launch':60s} {'target':6s} {'predicted, bound':>20s}  {'smem KB':>10s} {'regs':>4s} {'spill':>6s} "
            f"{'rounds':>6s}  {'MMA':30s} global loads (PTX instructions by width)")
    cards = ", ".join(f"{t} on {TARGET_CARD[t]}" for t in sorted({r["target"] for r in rows}))
    foot = (f"predicted (not measured) by the cost model of inferbook.compiled.cost ({cards}); the ideal roofline "
            f"is only the floor; rounds: the loads one trip of the main loop waits one after another "
            f"(machine.load_rounds), which the prediction does not charge")
    return "\n".join([head] + [format_row(r, preds.get(id(r))) for r in rows] + [foot])


def record_path(slug: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / DATA_DIR / f"{slug}.json"


def save_table(slug: str, rows: list[dict], root: Path | None = None) -> Path:
    """Write data/compiled/<slug>.json: the rows plus the versions that made them."""
    import triton

    from ..context import git_state

    path = record_path(slug, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = [{k: v for k, v in r.items() if k not in ("compile_s",)} for r in rows if r["slug"] == slug]
    done = {r["target"] for r in keep}
    old = load_table(slug, root)
    if old is not None:        # targets not compiled this time keep their rows
        keep += [r for r in old["rows"] if r["target"] not in done]
    tix = {t: n for n, t in enumerate(TARGETS)}
    keep.sort(key=lambda r: (r.get("index", 0), tix.get(r["target"], 99)))
    doc = {"chapter": slug, "triton": triton.__version__, "torch": torch.__version__,
           "git": git_state().get("commit", "unknown"), "targets": sorted({r["target"] for r in keep}, key=list(TARGETS).index),
           "note": "ahead-of-time compile on a CPU machine (no GPU, no driver); NVIDIA: registers and spills from "
                   "ptxas -v, MMA and load widths from the PTX, the main loop from nvdisasm's SASS; AMD: VGPRs, AGPRs, "
                   "scratch, MFMA and loads from the AMDGCN; trips and dot FLOPs from the Triton IR",
           "rows": keep}
    path.write_text(_dump(doc))
    return path


def _dump(doc: dict) -> str:
    """The record as JSON with one row per line (small diffs when a kernel changes)."""
    head = {k: v for k, v in doc.items() if k != "rows"}
    lines = json.dumps(head, indent=1, default=str)[:-2]
    rows = ",\n".join("  " + json.dumps(r, default=str, ensure_ascii=False) for r in doc["rows"])
    return f'{lines},\n "rows": [\n{rows}\n ]\n}}\n'



def load_table(slug: str, root: Path | None = None) -> dict | None:
    path = record_path(slug, root)
    return json.loads(path.read_text()) if path.is_file() else None


def compile_table(slug: str, root: Path | None = None):
    """The chapter page's table (a DataFrame) from data/compiled/<slug>.json: launch, target,
    shared KB (of the limit), registers, spills, MMA, load widths. Never compiles."""
    import pandas as pd

    doc = load_table(slug, root)
    if doc is None:
        return pd.DataFrame([{"launch": f"no compile record: run `inferbook inspect {slug} --target all --save`"}])
    out = []
    for r in doc["rows"]:
        if not r.get("ok"):
            out.append({"launch": r["launch"], "target": r["target"], "shared KB": "—", "regs": "—", "spill B": "—",
                        "MMA": "compile error", "global loads": r.get("error", "")[:80]})
            continue
        out.append({"launch": r["launch"], "target": r["target"],
                    "shared KB": f"{r['shared_kb']:.1f} / {r['smem_limit_kb']}" + (" ✗" if not r["smem_ok"] else ""),
                    "regs": r["regs"], "spill B": r["spill_bytes"], "MMA": r["mma"],
                    "global loads": r["loads_summary"]})
    return pd.DataFrame(out)


def table_facts(slug: str, root: Path | None = None) -> dict:
    """Summary facts of a chapter's compile record for glued prose: counts of launches and
    failures, the largest shared memory and spills with their launch, MMA families per target."""
    doc = load_table(slug, root) or {"rows": []}
    rows = doc["rows"]
    facts: dict[str, Any] = {"launches": len({r["launch"] for r in rows}), "failures": [], "targets": {}}
    for t in TARGETS:
        tr = [r for r in rows if r["target"] == t]
        if not tr:
            continue
        ok = [r for r in tr if r.get("ok")]
        fam = sorted({f for r in ok for f in r["mma_family"].split("+") if f != "-"})
        top_smem = max(ok, key=lambda r: r["shared_kb"], default=None)
        top_regs = max(ok, key=lambda r: r["regs"] or 0, default=None)
        spills = [r for r in ok if r["spill_bytes"]]
        facts["targets"][t] = {
            "compiled": len(ok), "of": len(tr), "mma_families": fam,
            "max_shared_kb": top_smem["shared_kb"] if top_smem else 0.0,
            "max_shared_launch": top_smem["launch"] if top_smem else "",
            "max_regs": (top_regs["regs"] or 0) if top_regs else 0,
            "max_regs_launch": top_regs["launch"] if top_regs else "",
            "spilling": [(r["launch"], r["spill_bytes"]) for r in spills],
        }
        facts["failures"] += [f"{r['launch']} on {t}: {'; '.join(problems(r))}" for r in tr if problems(r)]
    return facts


# ---------------------------------------------------------------------------------------------------
# Predicted time: the cost model (compiled/cost.py) on the committed tables

from . import machine  # noqa: E402,F401
from .cost import (CARDS, SM_LIMITS, bar_columns, bound_sentence, latency_floor_fraction, measured_copy_gbps,  # noqa: E402,F401
                   predict, residency)

# The card each target's table is predicted on by default (inspect, the pages).
TARGET_CARD = {"sm_80": "A100", "sm_90": "H200", "sm_100": "B200", "gfx942": "MI300X", "gfx950": "MI355X"}


def _check_card(target: str, card: str) -> None:
    if card not in CARDS:
        raise UserError(f"unknown card {card!r}; choose {choices(CARDS)}")
    if target not in SM_LIMITS:
        raise UserError(f"unknown target {target!r}; choose {choices(SM_LIMITS)}")
    if CARDS[card]["vendor"] != SM_LIMITS[target]["vendor"]:
        raise UserError(f"card {card} cannot run {target} code; {target} runs on "
                        f"{', '.join(c for c, v in CARDS.items() if v['vendor'] == SM_LIMITS[target]['vendor'])}")


def predict_rows(rows: list[dict], card: str, root: Path | None = None) -> list[dict]:
    """`cost.predict` for each compiled row (a row without machine-code facts or that did not compile
    is skipped), at the measured copy ceiling of `card` where a committed record has one."""
    measured = measured_copy_gbps(card, root)
    out = []
    for r in rows:
        if not r.get("ok") or ("sass" not in r and "isa_loop" not in r):
            continue
        p = predict(r, card, copy_gbps=measured[0] if measured else None)
        if measured:
            p["ceiling_record"] = measured[1]
        out.append(p)
    return out


def predict_launches(slug: str, target: str = "sm_90", card: str = "H200", root: Path | None = None) -> list[dict]:
    """The cost model's prediction for every gpu-preset launch of chapter `slug` compiled for `target`,
    read from the committed table (data/compiled/<slug>.json; nothing is compiled): one dict per
    launch, in launch order, with at least {'kernel', 'launch', 'seconds', 'bound', 'ceiling'
    ('measured'|'datasheet'), 'bounds': {name: seconds}} (see `cost.predict`)."""
    _check_card(target, card)
    doc = load_table(slug, root)
    if doc is None:
        raise UserError(f"no compile table for {slug!r}: run `inferbook inspect {slug} --target all --save`")
    rows = sorted((r for r in doc["rows"] if r["target"] == target), key=lambda r: r["index"])
    if not rows:
        raise UserError(f"the compile table of {slug!r} has no {target} rows: run `inferbook inspect {slug} "
                        f"--target {target} --save`")
    return predict_rows(rows, card, (root / "data" / "results") if root is not None else None)


def predicted_seconds(slug: str, target: str = "sm_90", card: str = "H200", root: Path | None = None) -> float:
    """Sum of `predict_launches`' seconds: the chapter's gpu-preset launches, one after another."""
    return sum(p["seconds"] for p in predict_launches(slug, target, card, root))


def occupancy(row: dict) -> dict:
    """CTAs per SM a launch can keep resident, and what bounds it (`cost.residency`)."""
    return residency(row)


# The ideal roofline, kept only as the floor no kernel beats: max(bytes / datasheet bandwidth,
# flops / dense BF16 rate) for a chapter's own byte and flop counts.

def _si(x: float, unit: str) -> str:
    """16537600 B -> '16.5 MB' (decimal prefixes, 3 significant figures)."""
    from ..measure import significant

    if not x:
        return "0"
    for p, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{significant(x / f, 3)} {p}{unit}"
    return f"{significant(x, 3)} {unit}"


FLOOR_CARDS = ("H100", "H200", "B200", "MI300X", "MI355X")


def roofline_seconds(bytes_moved: float, flops: float, card: str) -> float:
    """max(bytes / datasheet bandwidth, flops / dense BF16 rate): the floor no kernel on `card` beats."""
    c = CARDS[card]
    return max(bytes_moved / (c["hbm_tbps"] * 1e12), flops / (c["bf16_tflops"] * 1e12))


def roofline_bound(bytes_moved: float, flops: float, card: str) -> str:
    c = CARDS[card]
    return "memory" if bytes_moved / c["hbm_tbps"] >= flops / c["bf16_tflops"] else "compute"


def predicted_roofline(chapter: str, work: list[dict], measured: dict | None = None):
    """A DataFrame: for each workload {'name', 'bytes', 'flops'} (the chapter's own counts at the gpu
    preset) the ideal roofline floor on each card, labelled *floor, not a prediction*; where `measured`
    ({(name, card): seconds}, from a reference run in data/results/) has a value, it is shown instead."""
    import pandas as pd

    from ..measure import significant

    measured = measured or {}
    rows = []
    for w in work:
        row = {"workload": w["name"], "bytes": _si(w["bytes"], "B"), "flops": _si(w["flops"], "FLOP")}
        for card in FLOOR_CARDS:
            m = measured.get((w["name"], card))
            if m is not None:
                row[card] = f"{significant(m * 1e6, 3)} µs (measured)"
            else:
                t = roofline_seconds(w["bytes"], w["flops"], card)
                row[card] = (f"{significant(t * 1e6, 3)} µs ({roofline_bound(w['bytes'], w['flops'], card)} floor, "
                             f"not a prediction)")
        rows.append(row)
    return pd.DataFrame(rows)


def reference_times(chapter: str, work: list[dict]) -> dict:
    """{(workload, card): seconds} from committed reference runs (data/results/<hw>/<chapter>.json):
    each workload may name the record and measurement holding its measured time ('record', optional
    'variant', 'metric', and 'match': extra fields the measurement must carry, e.g. {'batch': 1})."""
    from ..context import reference_records
    from .cost import _CARD_KEYS

    out = {}
    try:
        refs = reference_records(chapter)
    except Exception:
        return out
    for _slug, records in refs.items():
        for r in records:
            label = " ".join(str(v) for v in (r.hardware or {}).values()).lower()
            card = next((c for c, keys in _CARD_KEYS.items() if any(k in label for k in keys)), None)
            if card is None:
                continue
            for w in work:
                if w.get("record") != r.name or ("variant" in w and w["variant"] != r.variant):
                    continue
                for m in r.measurements:
                    if m["name"] == w.get("metric") and m.get("unit") == "s" and \
                            all(m.get(k) == v for k, v in (w.get("match") or {}).items()):
                        out[(w["name"], card)] = float(m["value"])
    return out


def launch_row(slug: str, prefix: str, target: str, root: Path | None = None) -> dict | None:
    """The first row of a chapter's compile record whose launch name starts with `prefix`."""
    doc = load_table(slug, root) or {"rows": []}
    return next((r for r in doc["rows"] if r["launch"].startswith(prefix) and r["target"] == target), None)


def launch_mma(slug: str, prefix: str, target: str, root: Path | None = None) -> str:
    """The MMA instructions of the first launch named `prefix...` on `target`, for glued prose."""
    r = launch_row(slug, prefix, target, root)
    if r is None:
        return "not compiled"
    if not r.get("ok"):
        return "a compile error"
    return "no MMA instruction" if r["mma"] == "-" else r["mma"]


from .section import CompilerSection, chapter_section  # noqa: E402,F401


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "_worker":
        out, slugs, targets, shard, shards = argv[1:6]
        only = json.loads(Path(argv[6]).read_text()) if len(argv) > 6 else None
        _worker(out, [s for s in slugs.split(",") if s], targets.split(","), int(shard), int(shards), only)
        return 0
    print("usage: inferbook inspect CHAPTER [--target sm_80|sm_90|sm_100|all]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
