"""Which device runs, whether Triton runs compiled or interpreted, and what the hardware is.

On a machine without CUDA, Triton kernels can still run in the Triton interpreter
(TRITON_INTERPRET=1). The interpreter is decided when a kernel is *decorated*, so the
variable must be set before any module defining a kernel is imported: `inferbook`'s
`__init__` calls `configure_triton_interpreter()` first thing.

The interpreter is for correctness only. Its times say nothing about kernel speed,
and `inferbook.measure` refuses to time Triton while it is on.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import re
import subprocess

import torch

from .errors import UserError, choices

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def configure_triton_interpreter() -> bool:
    """Turn the Triton interpreter on when there is no CUDA device (unless the user chose), and quiet
    the PyTorch profiler's own log (see `quiet_profiler_log`).

    Returns whether the interpreter is on. Must run before `triton.jit` decorates kernels.
    """
    quiet_profiler_log()
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    on = triton_interpreted()
    if on:
        skip_repatching_in_device_calls()
    return on


def skip_repatching_in_device_calls() -> bool:
    """Let the Triton interpreter patch `triton.language` once per launch, not again at every call of a
    @triton.jit helper inside the kernel. Returns whether the shortcut is in place.

    Triton 3.9's interpreter patches the language modules (`_patch_lang`: `inspect.getmembers` over
    tl, tl.core, tl.math and the tensor class) when a launch starts, undoing it when the launch ends, and
    again at each device-function call, per program, without undoing that. Inside a launch the
    second patch finds every builtin already replaced and re-sets the other attributes to fresh but
    equal definitions: it changes nothing, and was 28 % of deterministic-attention's CPU run (a py-spy
    profile of its engine steps). So a device function whose language modules the enclosing launch
    already patched skips it; one seeing another module (or a call outside a launch) is patched as
    before. Only the interpreter's bookkeeping changes, never what a kernel computes. Left alone
    when this Triton's interpreter lacks the internals it relies on."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as ti
    except Exception:
        return False
    if getattr(ti, "_inferbook_skips_repatching", False):
        return True
    original = getattr(ti, "_patch_lang", None)
    scope_class = getattr(ti, "_LangPatchScope", None)
    if original is None or scope_class is None or not hasattr(ti, "GridExecutor") or not hasattr(ti, "InterpretedFunction"):
        return False
    launches: list[dict] = []   # the launch in progress: its kernel, its language modules, whether patched

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        launch = launches[-1] if launches else None
        langs = langs_of(fn)
        if launch is not None and launch["patched"] and langs and langs <= launch["langs"]:
            return scope_class()          # already in force for this launch: an empty scope, nothing to undo
        scope = original(fn)
        if launch is not None and fn is launch["fn"]:
            launch["patched"] = True      # the launch's own patch, which the launch undoes when it ends
        return scope

    grid_call = ti.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        launches.append({"fn": self.fn, "langs": langs_of(self.fn), "patched": False})
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    # The launch's own patch lists each module's members with `inspect.getmembers` (a dir(), a getattr
    # and a sort over hundreds of names), at every launch: 17 % of the same profile once the above was
    # in place, the engine launching thousands of small kernels. A module's members do not change, so
    # the names that can be builtins are listed once per module (those that are builtins, and those an
    # unfinished patch replaced by its wrapper); each launch still reads every one of them and patches
    # those that are builtins now, as Triton's loop does.
    patch_builtin = getattr(ti, "_patch_builtin", None)
    patch_attr = getattr(ti, "_patch_attr", None)
    builtin_names: dict[int, tuple] = {}

    def patch_builtin_listed(pkg, builder, scope):
        names = builtin_names.get(id(pkg))
        if names is None:
            names = builtin_names[id(pkg)] = tuple(
                name for name, member in inspect.getmembers(pkg)
                if tl.core.is_builtin(member) or getattr(member, "__qualname__", "") == "_patch_attr.<locals>.<lambda>")
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    ti._inferbook_originals = (original, grid_call, patch_builtin)   # for the test comparing both paths' bits
    ti.GridExecutor.__call__ = launch
    ti._patch_lang = patch_lang
    if patch_builtin is not None and patch_attr is not None:
        ti._patch_builtin = patch_builtin_listed
    ti._inferbook_skips_repatching = True
    return True


# Kineto (torch.profiler's engine, used where a chapter observes which kernel ran) logs every
# profiler start and stop on stderr at its USDT level (5): up to ten lines a run, so an error was
# never the only line. Level 6 is above all of Kineto's levels; read at the profiler's first use.
# A user who wants Kineto's log sets KINETO_LOG_LEVEL themselves.
KINETO_QUIET_LEVEL = "6"


def quiet_profiler_log() -> None:
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)


# The values Triton reads as true (triton.knobs env_bool -> libtriton getenv_bool, Triton 3.6-3.9):
# compared lower-cased, not stripped; everything else ("off", "2", " 1") is false.
TRITON_TRUE_VALUES = ("1", "true", "on", "yes", "y")


def env_flag_as_triton_reads_it(value: str | None) -> bool:
    return value is not None and value.lower() in TRITON_TRUE_VALUES


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter: TRITON_INTERPRET read exactly as Triton reads
    it (its own knob when Triton is importable, else Triton's rule), so a record never names the
    interpreter for a value such as 'off' that Triton reads as false."""
    value = os.environ.get("TRITON_INTERPRET")
    if value is None:
        return False
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except Exception:  # no triton, or one without knobs (< 3.4)
        return env_flag_as_triton_reads_it(value)


@functools.lru_cache(maxsize=1)
def triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or broken install: kernels fall back to torch
        return None
    return triton.__version__


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda when present, else cpu. Raises UserError for a device we cannot use."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise UserError(f"device must be a string, got {name!r}; choose {choices(DEVICE_CHOICES)}")
    base, _, index = name.partition(":")
    if base not in DEVICE_CHOICES or (index and (base != "cuda" or not index.isdigit())):
        raise UserError(f"unknown device {name!r}; choose {choices(DEVICE_CHOICES)} (or 'cuda:N')")
    if base == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if base == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} was asked for but this machine has no usable CUDA GPU (nor ROCm) "
                            f"(torch {torch.__version__}, cuda build: {torch.version.cuda}, hip build: "
                            f"{getattr(torch.version, 'hip', None)}); use 'cpu' or 'auto'")
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise UserError(f"device {name!r} does not exist: this machine has {n} CUDA device(s)")
        return torch.device(name)
    return torch.device("cpu")


def triton_backend_for(device: torch.device) -> tuple[bool, str]:
    """Can a Triton kernel run on tensors of this device? Returns (ok, how-or-why-not)."""
    if triton_version() is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
        if gpu_vendor() == "rocm":
            where += f" ({gcn_arch(device) or 'HIP'})"
        return True, f"triton {triton_version()} compiled for {where}"
    if triton_interpreted():
        return True, f"triton {triton_version()} interpreter (correctness only, never timed)"
    return False, "CPU tensors while TRITON_INTERPRET is off (a CUDA machine running device='cpu')"


BACKEND_CHOICES = ("auto", "triton", "torch")


def select_backend(device: torch.device, backend: str = "auto") -> tuple[str, str]:
    """('triton' | 'torch', reason) for a kernel with a PyTorch reference beside it.

    'auto' takes Triton where it can run (a GPU, or the interpreter on CPU) and falls back to the
    reference otherwise, saying why; 'triton' that cannot run is a UserError, not a silent fallback.
    """
    if backend not in BACKEND_CHOICES:
        raise UserError(f"backend must be one of {choices(BACKEND_CHOICES)}, got {backend!r}")
    ok, why = triton_backend_for(device)
    if backend == "torch":
        return "torch", "asked for the PyTorch reference"
    if backend == "triton" and not ok:
        raise UserError(f"backend 'triton' cannot run on {device}: {why}")
    return ("triton", why) if ok else ("torch", f"fallback to the PyTorch reference: {why}")


def dot_needs_fp32(device: torch.device) -> bool:
    """Known interpreter pitfall: `tl.dot` on bf16 operands returns garbage in the Triton
    interpreter (seen with Triton 3.9). Kernels take this as a constexpr and upcast the
    operands to fp32 only when it is True. The one place this decision is made."""
    return device.type != "cuda" and triton_interpreted()


def fp8_cast_needs_emulation(device: torch.device) -> bool:
    """Third interpreter pitfall: its fp32 -> fp8 casts (`tl.float8e4nv`, `tl.float8e5`) do not round to
    nearest even (Triton 3.9: 1708 of 20480 random and halfway e4m3 values differ from PyTorch's cast).
    Kernels that can cast to fp8 in hardware take the integer emulation there instead."""
    return device.type != "cuda" and triton_interpreted()


def bf16_cast_needs_emulation(device: torch.device) -> bool:
    """Second interpreter pitfall: its fp32 -> bf16 cast truncates instead of rounding to nearest
    even (Triton 3.9). Kernels that store bf16 take this as a constexpr for
    `triton_utils.cast_rtne`; compiled kernels round correctly and never emulate."""
    return device.type != "cuda" and triton_interpreted()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_vendor() -> str | None:
    """'rocm' on a ROCm build of PyTorch (it reports HIP devices through `torch.cuda`), 'cuda' on a
    CUDA build, None on a CPU-only build."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    return None


def gcn_arch(device: torch.device) -> str | None:
    """The gfx architecture of a HIP device ('gfx942' on MI300X, 'gfx950' on MI355X), from the device
    properties' gcnArchName ('gfx942:sramecc+:xnack-' -> 'gfx942'); None on CUDA."""
    if gpu_vendor() != "rocm":
        return None
    props = torch.cuda.get_device_properties(device)
    name = str(getattr(props, "gcnArchName", "") or "")
    return name.split(":")[0] or None


# ---------------------------------------------------------------------------------------------------
# Per-target launch configs: which compile target a kernel's config is chosen for
#
# A config function (tile sizes, warps, stages, a dot precision) that differs between NVIDIA and AMD asks
# `pick_config({"nvidia": ..., "hip": ..., "gfx942": ...}, device)`. The runtime launcher and its launch
# builder (what `inferbook inspect` compiles) call the same function: on a real GPU the device's own arch
# decides; inside `building_for(target)` (the compile tables' builds, or a test running a target's GPU
# tiles in the interpreter) the named target does. Outside both (a builder's stand-in CUDA device on a
# machine without a GPU) the NVIDIA config is taken, as before this mechanism existed.

class BuildTarget:
    """What `building_for` holds: the target, and whether any config asked it (`kernel_target`)."""

    def __init__(self, target: str | None):
        self.target = target
        self.asked = False


_BUILD: contextvars.ContextVar[BuildTarget | None] = contextvars.ContextVar("inferbook_build_target", default=None)


@contextlib.contextmanager
def building_for(target: str | None):
    """Inside this block, launch configs are chosen for `target` ('sm_90', 'gfx942', ...; None: no
    override), whatever the tensors' device: `compiled.launches_for(slug, target)` builds each target's
    launches in one. Yields a `BuildTarget` whose `asked` says afterwards whether a config asked the
    target: a build that never asked made the same launches for every target."""
    build = BuildTarget(target)
    token = _BUILD.set(build if target is not None else None)
    try:
        yield build
    finally:
        _BUILD.reset(token)


def build_target() -> str | None:
    """The target `building_for` set, or None outside it."""
    b = _BUILD.get()
    return b.target if b is not None else None


class ConfigOverride:
    """What `overriding_config` holds: the config's name, the values put over it, and what the builds
    saw (how many times the config was asked, and its keys)."""

    def __init__(self, name: str, values: dict):
        self.name, self.values = name, dict(values)
        self.asked = 0
        self.keys: set[str] = set()


_OVERRIDE: contextvars.ContextVar[ConfigOverride | None] = contextvars.ContextVar("inferbook_config_override",
                                                                                  default=None)


@contextlib.contextmanager
def overriding_config(name: str, values: dict):
    """Inside this block, the config named `name` (see `swept`) is returned with `values` put over it:
    the hook of `python -m inferbook.compiled.sweep`, which builds a chapter's launches at other tiles,
    warps or stages through the launchers' own code (so each grid follows the tile). Yields the
    `ConfigOverride`."""
    o = ConfigOverride(name, values)
    token = _OVERRIDE.set(o)
    try:
        yield o
    finally:
        _OVERRIDE.reset(token)


def swept(name: str, cfg: dict) -> dict:
    """`cfg` (a launch config: tiles, warps, stages), or inside `overriding_config(name, values)` a copy
    with `values` put over it. A value for a key `cfg` does not have raises `UserError` naming the keys."""
    o = _OVERRIDE.get()
    if o is None or o.name != name:
        return cfg
    o.asked += 1
    o.keys |= set(cfg)
    unknown = sorted(set(o.values) - set(cfg))
    if unknown:
        raise UserError(f"config {name!r} has no {', '.join(unknown)}; its keys are {', '.join(sorted(cfg))}")
    return {**cfg, **o.values}


def _device_target(device: torch.device) -> str | None:
    if gpu_vendor() == "rocm":
        return gcn_arch(device)
    props = torch.cuda.get_device_properties(device)
    return f"sm_{props.major}{props.minor}"


def kernel_target(device) -> str | None:
    """The compile target whose launch config a kernel for `device` takes: the `building_for` target
    when one is set; on a GPU its arch ('gfx942' on MI300X through a ROCm build, 'sm_90' on H100);
    None otherwise (CPU, the interpreter, a stand-in CUDA device where no GPU is present)."""
    b = _BUILD.get()
    if b is not None:
        b.asked = True
        return b.target
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _device_target(device)


def target_vendor(target: str | None) -> str | None:
    """'hip' for a gfx target, 'nvidia' for an sm target, None for None."""
    if target is None:
        return None
    return "hip" if str(target).startswith("gfx") else "nvidia"


def wants_gpu_config(device) -> bool:
    """Whether a launch for `device` takes a GPU config (its tensors are on a GPU, or `building_for`
    names a target: a GPU config checked in the interpreter) rather than the interpreter's own."""
    return torch.device(device).type == "cuda" or _BUILD.get() is not None


def pick_config(configs: dict, device):
    """The entry of `configs` for `kernel_target(device)`: keyed by a target ('gfx942', 'sm_90'), a
    vendor ('hip', 'nvidia'); the most specific key present wins and 'nvidia' (required) is the
    default, also where the target is unknown. Values are returned as they are (copy a dict you edit)."""
    t = kernel_target(device)
    for key in (t, target_vendor(t)):
        if key is not None and key in configs:
            return configs[key]
    return configs["nvidia"]


def _rocm_driver() -> str | None:
    """The driver version `rocm-smi` reports, or None where it is absent."""
    try:
        out = subprocess.run(["rocm-smi", "--showdriverversion"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        m = re.search(r"Driver version:\s*(\S+)", out.stdout)
        return m.group(1) if m else None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


@functools.lru_cache(maxsize=8)
def _hardware_info(device_str: str) -> dict:
    device = torch.device(device_str)
    info = {
        "device_type": device.type,
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "os": platform.platform(),
    }
    # `inferbook book --jobs N` on CPU: this chapter executed beside up to N-1 others, so its timings
    # shared the cores (torch_threads says its share). Absent when it ran alone.
    jobs = os.environ.get("INFERBOOK_BOOK_JOBS", "")
    if device.type == "cpu" and jobs.isdigit() and int(jobs) > 1:
        info["book_jobs"] = int(jobs)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({
            "gpu_name": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_sms": props.multi_processor_count,
            "gpu_capability": f"{props.major}.{props.minor}",
        })
        if gpu_vendor() == "rocm":       # a ROCm build: HIP through torch.cuda; CUs in multi_processor_count
            info.update({"gpu_vendor": "amd", "gpu_arch": gcn_arch(device), "hip_runtime": torch.version.hip,
                         "driver": _rocm_driver()})
        else:
            info.update({"gpu_vendor": "nvidia", "cuda_runtime": torch.version.cuda, "driver": _nvidia_driver()})
    return info


def hardware_info(device: torch.device) -> dict:
    """What the record says about the machine: GPU name, memory, SMs, driver; CPU model, cores."""
    return dict(_hardware_info(str(device)))


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|cpu @.*|@.*", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def hardware_label(info: dict) -> str:
    """Human label for charts and tables, e.g. 'NVIDIA H200', 'AMD Instinct MI300X (gfx942)' or
    'CPU: AMD EPYC 9B14 (2 cores)'."""
    info = info or {}
    if info.get("device_type") == "cuda":
        name = str(info.get("gpu_name") or "").strip() or "unnamed CUDA GPU"
        arch = info.get("gpu_arch")
        return f"{name} ({arch})" if arch and arch not in name else name
    return f"CPU: {info.get('cpu_model') or 'unknown model'} ({info.get('cpu_cores', '?')} cores)"


def hardware_slug(info: dict) -> str:
    """Folder name for reference results: 'nvidia-h200', 'cpu-amd-epyc-9b14-2c'. Never empty, never
    a path: a name that reduces to nothing (e.g. '(TM)') becomes 'gpu-unnamed-sm90' / 'cpu-unknown-2c',
    so no record is written into `data/results/` itself."""
    info = info or {}
    if info.get("device_type") == "cuda":
        slug = _slug(str(info.get("gpu_name") or ""))
        if info.get("gpu_arch") and slug and info["gpu_arch"] not in slug:
            slug = f"{slug}-{info['gpu_arch']}"        # 'amd-instinct-mi300x-gfx942'
        if not slug:
            cap = _slug(str(info.get("gpu_capability") or "")).replace("-", "")
            slug = "gpu-unnamed" + (f"-sm{cap}" if cap else "")
        return slug
    cores = info.get("cpu_cores")
    cores = f"{cores}c" if isinstance(cores, int) else "unknown-cores"
    return f"cpu-{_slug(str(info.get('cpu_model') or '')) or 'unknown'}-{cores}"


@contextlib.contextmanager
def torch_threads(device, n: int = 1):
    """On CPU, run with `n` intra-op torch threads, restored afterwards (n <= 0: leave as is); on other
    devices, nothing. Small ops on a small shared machine run faster on one thread: a second one mostly
    waits on a busy sibling, and OpenMP's barrier waits made loops of tiny ops tens of times slower.
    Yields the thread count in force."""
    if torch.device(device).type != "cpu" or n <= 0:
        yield torch.get_num_threads()
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
