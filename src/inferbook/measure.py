"""Timing, phases and rooflines.

- `benchmark(fn, device)` times a callable: CUDA events on a GPU, `perf_counter` on a CPU,
  after warm-up, and returns the median with p10/p90 and the sample count (never a mean
  dressed as a median).
- `PhaseTimer` keeps named phases apart (cold start, load, steady state; TTFT, decode, total).
- `ceilings(device)` measures this device's copy bandwidth and matmul rate once per process;
  `roofline(...)` states an achieved rate as a fraction of those measured ceilings.

A Triton kernel running in the interpreter is never timed: pass `uses_triton=True` and
`benchmark` raises `InterpreterTimingError` when the interpreter is on.
"""
from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .device import synchronize, triton_interpreted
from .errors import InterpreterTimingError


@dataclass
class Timing:
    """Seconds per call of one benchmarked callable."""

    label: str
    samples_s: list[float]
    timer: str  # "cuda-events" or "perf_counter"
    warmup: int

    @property
    def n(self) -> int:
        return len(self.samples_s)

    def quantile(self, q: float) -> float:
        xs = sorted(self.samples_s)
        if not xs:
            return math.nan
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s) if self.samples_s else math.nan

    @property
    def p10_s(self) -> float:
        return self.quantile(0.10)

    @property
    def p90_s(self) -> float:
        return self.quantile(0.90)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def summary(self) -> dict:
        """What a RunRecord stores: median/p10/p90 in seconds, n, timer."""
        return {"median_s": self.median_s, "p10_s": self.p10_s, "p90_s": self.p90_s,
                "n": self.n, "timer": self.timer, "warmup": self.warmup}


def benchmark(fn: Callable[[], object], device: torch.device, *, label: str = "",
              warmup: int = 3, min_reps: int = 5, max_reps: int = 200,
              min_time_s: float = 0.2, uses_triton: bool = False) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then at least `min_reps` timed calls and until
    `min_time_s` of samples (capped at `max_reps`). One sample per call.

    On CUDA each call is bracketed by events (GPU time, launch overhead included, host
    gaps between calls excluded); on CPU by `perf_counter`.
    """
    if uses_triton and triton_interpreted() and device.type != "cuda":
        raise InterpreterTimingError(
            f"refusing to time {label or fn!r}: it runs a Triton kernel in the Triton interpreter, "
            "whose times say nothing about kernel speed; time the PyTorch paths on CPU instead")
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples: list[float] = []
    total = 0.0
    if device.type == "cuda":
        while len(samples) < min_reps or (total < min_time_s and len(samples) < max_reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            s = start.elapsed_time(end) / 1e3
            samples.append(s)
            total += s
        timer = "cuda-events"
    else:
        while len(samples) < min_reps or (total < min_time_s and len(samples) < max_reps):
            t0 = time.perf_counter()
            fn()
            s = time.perf_counter() - t0
            samples.append(s)
            total += s
        timer = "perf_counter"
    return Timing(label=label, samples_s=samples, timer=timer, warmup=warmup)


@dataclass
class Phase:
    name: str
    seconds: float


@dataclass
class PhaseTimer:
    """Wall time of named phases, synchronizing the device at each boundary.

    >>> phases = PhaseTimer(torch.device("cpu"))
    >>> with phases("load"):
    ...     pass
    """

    device: torch.device
    phases: list[Phase] = field(default_factory=list)

    @contextlib.contextmanager
    def __call__(self, name: str):
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.phases.append(Phase(name, time.perf_counter() - t0))

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.name] = out.get(p.name, 0.0) + p.seconds
        return out


# ---------------------------------------------------------------------------
# Ceilings measured on this device, and rooflines against them.

@dataclass(frozen=True)
class Ceilings:
    """What this device actually does, measured in this process."""

    copy_gbps: float          # bytes read + written per second by a large device copy
    matmul_tflops: float      # dense matmul rate
    matmul_dtype: str
    copy_bytes: int
    matmul_shape: tuple[int, int, int]
    timer: str

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=8)
def _ceilings(device_str: str) -> Ceilings:
    device = torch.device(device_str)
    if device.type == "cuda":
        copy_bytes, mm_n, mm_dtype = 1 << 30, 8192, torch.bfloat16
    else:
        # fp32: CPU bf16 matmul paths vary widely by build; fp32 is the honest CPU peak.
        copy_bytes, mm_n, mm_dtype = 1 << 27, 1024, torch.float32
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t_copy = benchmark(lambda: dst.copy_(src), device, label="copy", warmup=2, min_reps=5, min_time_s=0.3)
    copy_gbps = 2 * copy_bytes / t_copy.median_s / 1e9
    del src, dst
    a = torch.randn(mm_n, mm_n, device=device).to(mm_dtype)
    b = torch.randn(mm_n, mm_n, device=device).to(mm_dtype)
    t_mm = benchmark(lambda: a @ b, device, label="matmul", warmup=2, min_reps=5, min_time_s=0.3)
    tflops = 2 * mm_n**3 / t_mm.median_s / 1e12
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=tflops, matmul_dtype=str(mm_dtype).replace("torch.", ""),
                    copy_bytes=2 * copy_bytes, matmul_shape=(mm_n, mm_n, mm_n), timer=t_copy.timer)


def ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth and matmul rate of `device`, measured once per process and cached."""
    return _ceilings(str(device))


def roofline(*, bytes_moved: float, flops: float, seconds: float, ceil: Ceilings) -> dict:
    """Achieved GB/s and TFLOP/s for one call, as fractions of the measured ceilings.

    `bound` says which ceiling the kernel's arithmetic intensity puts it under.
    """
    gbps = bytes_moved / seconds / 1e9 if seconds > 0 else math.nan
    tflops = flops / seconds / 1e12 if seconds > 0 else math.nan
    intensity = flops / bytes_moved if bytes_moved else math.inf
    ridge = ceil.matmul_tflops * 1e12 / (ceil.copy_gbps * 1e9)
    return {
        "bytes": bytes_moved, "flops": flops, "seconds": seconds,
        "achieved_gbps": gbps, "achieved_tflops": tflops,
        "frac_copy": gbps / ceil.copy_gbps, "frac_matmul": tflops / ceil.matmul_tflops,
        "intensity_flop_per_byte": intensity, "ridge_flop_per_byte": ridge,
        "bound": "memory" if intensity < ridge else "compute",
    }


# --- comparing two measurements -------------------------------------------------------------------

def significant(x: float, digits: int = 3) -> str:
    """`x` to `digits` significant figures, never as '0.0' for a small non-zero number
    (0.03712 -> '0.0371', 61.056121 -> '61.1', 16384.0 -> '16384')."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) >= 10 ** (digits - 1):
        return str(int(x))
    return f"{float(x):#.{digits}g}".rstrip(".") if abs(x) < 10 ** digits else str(int(round(x)))


def _samples(x) -> list[float]:
    """Samples of a `Timing`, of a record measurement dict that kept them, or a plain sequence."""
    if isinstance(x, Timing):
        return list(x.samples_s)
    if isinstance(x, dict):
        if "samples_s" in x:
            return [float(v) for v in x["samples_s"]]
        raise ValueError(f"measurement {x.get('name', '?')!r} kept no samples; record it with add_timing")
    return [float(v) for v in x]


@dataclass(frozen=True)
class TimingComparison:
    """`a` against `b`: ratio = median(a) / median(b) of times, with a bootstrap interval.

    `verdict` is "faster" / "slower" (a against b) only when the interval excludes 1; otherwise
    "no difference this run can see". `higher_is_better` flips the sense for rates (tokens/s).
    """
    ratio: float
    lo: float
    hi: float
    n_a: int
    n_b: int
    confidence: float
    higher_is_better: bool = False

    @property
    def separated(self) -> bool:
        return self.hi < 1.0 or self.lo > 1.0

    @property
    def verdict(self) -> str:
        if not self.separated:
            return "no difference this run can see"
        a_smaller = self.hi < 1.0
        return "faster" if a_smaller != self.higher_is_better else "slower"

    @property
    def a_better(self) -> bool | None:
        """True / False when the run separates them, None when it cannot."""
        return None if not self.separated else self.verdict == "faster"

    def interval(self, digits: int = 3) -> str:
        return f"{significant(self.lo, digits)}–{significant(self.hi, digits)}"

    def sentence(self, a: str, b: str, *, digits: int = 3) -> str:
        """One sentence that is true for every outcome, e.g.
        'the fused kernel is faster than eager: 0.62× its time (90 % interval 0.58–0.66, 20 and 20 samples)'."""
        what = "rate" if self.higher_is_better else "time"
        pct = int(round(self.confidence * 100))
        spread = (f"{significant(self.ratio, digits)}× its {what} ({pct} % interval {self.interval(digits)}, "
                  f"{self.n_a} and {self.n_b} samples)")
        if not self.separated:
            return (f"{a} and {b} show no difference this run can see ({a} at {significant(self.ratio, digits)}× "
                    f"the {what} of {b}, {pct} % interval {self.interval(digits)}, {self.n_a} and {self.n_b} samples)")
        return f"{a} is {self.verdict} than {b}: {spread}"


def compare_timings(a, b, *, higher_is_better: bool = False, confidence: float = 0.9,
                    n_boot: int = 2000, seed: int = 0) -> TimingComparison:
    """Compare two repeated measurements of the same work (Timings, record measurements that kept
    `samples_s`, or sequences of seconds / rates). The interval is a percentile bootstrap of the
    ratio of medians, resampling each side independently; deterministic for a given `seed`."""
    xa, xb = _samples(a), _samples(b)
    if len(xa) < 2 or len(xb) < 2:
        raise ValueError(f"need at least 2 samples a side to compare (got {len(xa)} and {len(xb)})")
    if not all(math.isfinite(v) and v > 0 for v in xa + xb):
        raise ValueError("samples must be finite and positive")
    ta, tb = torch.tensor(xa, dtype=torch.float64), torch.tensor(xb, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    ia = torch.randint(len(xa), (n_boot, len(xa)), generator=g)
    ib = torch.randint(len(xb), (n_boot, len(xb)), generator=g)
    ratios = ta[ia].median(dim=1).values / tb[ib].median(dim=1).values
    tail = (1 - confidence) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    ratio = statistics.median(xa) / statistics.median(xb)
    return TimingComparison(ratio=ratio, lo=lo, hi=hi, n_a=len(xa), n_b=len(xb), confidence=confidence,
                            higher_is_better=higher_is_better)
