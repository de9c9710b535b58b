"""Timing, phases and rooflines.

- `benchmark(fn, device)` times a callable: CUDA events on a GPU, `perf_counter` on a CPU,
  after warm-up, and returns the median with p10/p90 and the sample count (never a mean
  dressed as a median). On a GPU it measures the kernel, not the cache or Python: L2 is
  flushed before each sample (opt out with `flush_l2=False`), the stream is held while the
  host enqueues so launch overhead is not timed, and microsecond calls that need no flush run
  back to back within a sample. Inside `time_budget(s)` it sizes its repetitions to what is left.
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
    """Seconds per call of one benchmarked callable.

    On CUDA, `inner` calls ran back to back inside each sample (samples are per call: the sample's
    time / inner); `flush_bytes` were written before each sample to evict L2 (0: not flushed);
    `launch_hidden` says the stream was held busy while the host enqueued the sample, so host
    launch overhead is not in it; `budget_limited` says the time budget cut the repetitions.
    """

    label: str
    samples_s: list[float]
    timer: str  # "cuda-events" or "perf_counter"
    warmup: int
    inner: int = 1
    flush_bytes: int = 0
    launch_hidden: bool = False
    budget_limited: bool = False

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
        """What a RunRecord stores: median/p10/p90 in seconds, n, timer, and how it was timed."""
        out = {"median_s": self.median_s, "p10_s": self.p10_s, "p90_s": self.p90_s,
               "n": self.n, "timer": self.timer, "warmup": self.warmup}
        if self.timer == "cuda-events" or self.inner != 1:
            out.update(inner=self.inner, l2_flush_bytes=self.flush_bytes, launch_hidden=self.launch_hidden)
        if self.budget_limited:
            out["budget_limited"] = True
        return out


# --- time budgets ---------------------------------------------------------------------------------
# A chapter run may carry a time budget (`Context.budget_s`, from `presets.BUDGETS_S` for the gpu
# preset): `Context.measure` opens `time_budget(seconds)` around the chapter's measure function, and
# every `benchmark` inside sizes its repetitions to what is left, taking at most BUDGET_SHARE of it.
# Because each call takes a share of the remainder, the calls together stay inside the budget
# however many there are; past the deadline a benchmark takes its floor of BUDGET_FLOOR_REPS.

BUDGET_SHARE = 0.1
BUDGET_FLOOR_REPS = 3   # still a median and a spread, and enough for compare_timings to refuse
_deadline: list[float] = []


@contextlib.contextmanager
def time_budget(seconds: float | None):
    """Benchmarks inside share `seconds` of wall time (None: no budget). Nested budgets: the tighter wins."""
    if seconds is None:
        yield
        return
    end = time.perf_counter() + float(seconds)
    _deadline.append(min([end, *_deadline]))
    try:
        yield
    finally:
        _deadline.pop()


def budget_left() -> float | None:
    """Seconds left of the innermost time budget (negative once past it), or None without one."""
    return _deadline[-1] - time.perf_counter() if _deadline else None


@dataclass
class _Plan:
    warmup: int
    min_reps: int
    max_reps: int
    min_time_s: float
    wall_cap_s: float | None    # stop sampling past this (once `floor` samples are in)
    floor: int
    limited: bool

    def stop_early(self, n: int, t_start: float) -> bool:
        if self.wall_cap_s is None or n < self.floor:
            return False
        if time.perf_counter() - t_start > self.wall_cap_s:
            self.limited = True
            return True
        return False


def _budget_plan(warmup: int, min_reps: int, max_reps: int, min_time_s: float) -> _Plan:
    """The repetitions a benchmark may take under the current budget: at most BUDGET_SHARE of what
    is left, and never fewer than BUDGET_FLOOR_REPS samples (or `min_reps` if that is fewer)."""
    left = budget_left()
    floor = min(min_reps, BUDGET_FLOOR_REPS)
    if left is None:
        return _Plan(warmup, min_reps, max_reps, min_time_s, None, floor, False)
    cap = max(0.0, left) * BUDGET_SHARE
    if left <= 0:
        return _Plan(min(warmup, 1), floor, floor, 0.0, 0.0, floor, floor < min_reps or min_time_s > 0)
    return _Plan(warmup, min_reps, max_reps, min(min_time_s, cap), cap, floor, cap < min_time_s)


# --- CUDA: L2 flush, launch hiding, back-to-back launches -----------------------------------------
# As triton.testing.do_bench does, a buffer of twice the L2 size is written before each sample,
# outside the timed events, so a memory-bound kernel reads its inputs from HBM, not from the L2 the
# previous call warmed (an H200 has 60 MB of L2: many decode-sized operands fit in it). Microsecond
# kernels are timed without the host: before each sample the stream is held by a spin kernel
# (`torch.cuda._sleep`) long enough for the host to enqueue the events and the calls, so the
# events bracket only GPU work; and without a flush, `inner` calls run back to back per sample
# so the events' ~0.5 us resolution is a small part of a sample.

L2_FLUSH_FACTOR = 2
MIN_SAMPLE_S = 100e-6   # without a flush, back-to-back calls until a sample is at least this long
MAX_INNER = 1000


def l2_flush_bytes(device: torch.device) -> int:
    """Bytes written to evict L2: L2_FLUSH_FACTOR x the device's L2 (64 MiB if torch cannot say)."""
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return L2_FLUSH_FACTOR * (l2 or 32 << 20)


@functools.lru_cache(maxsize=8)
def _flush_buffer(device_str: str) -> torch.Tensor:
    device = torch.device(device_str)
    return torch.empty(l2_flush_bytes(device), dtype=torch.int8, device=device)


@functools.lru_cache(maxsize=8)
def _sleep_cycles_per_s(device_str: str) -> float:
    """Calibrate `torch.cuda._sleep`: GPU clock cycles it spins per second of event time."""
    device = torch.device(device_str)
    cycles = 2_000_000
    torch.cuda._sleep(cycles // 10)  # first launch out of the way
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    s = start.elapsed_time(end) / 1e3
    return cycles / s if s > 0 else 1.5e9


def l2_rotations(bytes_per_call: float, device: torch.device) -> int:
    """Input sets a `benchmark(..., rotate=k)` needs so that k calls' inputs are twice the L2 size
    (1 on CPU, where no flush is done either)."""
    if device.type != "cuda":
        return 1
    return max(1, math.ceil(l2_flush_bytes(device) / max(float(bytes_per_call), 1.0)))


def plan_inner(call_s: float, *, flush: bool, inner: int | None, min_sample_s: float = MIN_SAMPLE_S) -> int:
    """Calls per sample: `inner` when given; 1 when flushing (each call must find a cold L2);
    else enough back-to-back calls that a sample lasts `min_sample_s` (at most MAX_INNER)."""
    if inner is not None:
        if inner < 1:
            raise ValueError(f"inner must be >= 1, got {inner}")
        return int(inner)
    if flush or not math.isfinite(call_s) or call_s >= min_sample_s:
        return 1
    return max(1, min(MAX_INNER, math.ceil(min_sample_s / max(call_s, 1e-9) - 1e-9)))


def hold_cycles(host_s: float, cycles_per_s: float, *, margin: float = 1.5, floor_s: float = 20e-6,
                cap_s: float = 20e-3) -> int:
    """Spin-kernel length that covers the host's enqueue time of one sample (`host_s`), with a
    margin; 0 when the host needs longer than `cap_s` (then holding the GPU would only waste time)."""
    if not math.isfinite(host_s) or host_s > cap_s:
        return 0
    return int(cycles_per_s * max(floor_s, margin * host_s))


def benchmark(fn: Callable[[], object], device: torch.device, *, label: str = "",
              warmup: int = 3, min_reps: int = 5, max_reps: int = 200,
              min_time_s: float = 0.2, uses_triton: bool = False, flush_l2: bool | None = None,
              inner: int | None = None, hide_launch: bool = True, budgeted: bool = True,
              rotate: int | None = None) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then at least `min_reps` timed samples and until
    `min_time_s` of samples (capped at `max_reps`), all within the current `time_budget`.

    On CUDA each sample is bracketed by events (GPU time). Before it, L2 is flushed
    (`flush_l2`, default on; pass False to time a kernel whose inputs are meant to sit in L2) and,
    with `hide_launch`, the stream is held while the host enqueues, so launch overhead is not
    timed. Without a flush, microsecond calls run `inner` times back to back per sample (chosen
    from a first timed call unless given). Samples are seconds per call. On CPU: `perf_counter`
    around each call, as before. `budgeted=False` exempts a timing from the current `time_budget`
    (the device ceilings every roofline divides by).

    `rotate=k`: the other way to a cold L2, for microsecond memory-bound kernels that a flush would
    leave timed one call per sample: `fn(i)` takes an input-set index and the calls cycle through
    i = 0..k-1, k sets together larger than L2 (`l2_rotations(bytes_per_call, device)` says how many).
    Then no flush is needed (default off) and calls run back to back, each on inputs L2 has not seen
    since k calls ago.
    """
    if rotate is not None:
        if rotate < 1:
            raise ValueError(f"rotate must be >= 1, got {rotate}")
        user_fn, counter = fn, [0]

        def fn():
            i = counter[0] % rotate
            counter[0] += 1
            return user_fn(i)

        if flush_l2 is None:
            flush_l2 = False
    if uses_triton and triton_interpreted() and device.type != "cuda":
        raise InterpreterTimingError(
            f"refusing to time {label or fn!r}: it runs a Triton kernel in the Triton interpreter, "
            "whose times say nothing about kernel speed; time the PyTorch paths on CPU instead")
    plan = _budget_plan(warmup, min_reps, max_reps, min_time_s) if budgeted else \
        _Plan(warmup, min_reps, max_reps, min_time_s, None, min_reps, False)
    t_start = time.perf_counter()
    for _ in range(plan.warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        return _benchmark_cuda(fn, device, label=label, plan=plan, t_start=t_start,
                               flush=True if flush_l2 is None else bool(flush_l2), inner=inner,
                               hide_launch=hide_launch)
    samples: list[float] = []
    total = 0.0
    n_inner = plan_inner(math.inf, flush=False, inner=inner)
    while len(samples) < plan.min_reps or (total < plan.min_time_s and len(samples) < plan.max_reps):
        if plan.stop_early(len(samples), t_start):
            break
        t0 = time.perf_counter()
        for _ in range(n_inner):
            fn()
        s = (time.perf_counter() - t0) / n_inner
        samples.append(s)
        total += s * n_inner
    return Timing(label=label, samples_s=samples, timer="perf_counter", warmup=plan.warmup, inner=n_inner,
                  budget_limited=plan.limited)


def _benchmark_cuda(fn, device, *, label, plan: _Plan, t_start: float, flush, inner, hide_launch) -> Timing:
    flush_buf = _flush_buffer(str(device)) if flush else None

    def one_sample(n: int, cycles: int) -> float:
        if flush_buf is not None:
            flush_buf.zero_()
        if cycles:
            torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # One untimed-by-the-host probe: the host's enqueue time of a call, and the GPU time of one call.
    if flush_buf is not None:
        flush_buf.zero_()
    synchronize(device)
    h0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    host_s = time.perf_counter() - h0
    end.synchronize()
    call_s = start.elapsed_time(end) / 1e3
    n_inner = plan_inner(call_s, flush=flush, inner=inner)
    cycles = hold_cycles(host_s * n_inner, _sleep_cycles_per_s(str(device))) if hide_launch else 0
    samples: list[float] = []
    total = 0.0
    while len(samples) < plan.min_reps or (total < plan.min_time_s and len(samples) < plan.max_reps):
        if plan.stop_early(len(samples), t_start):
            break
        s = one_sample(n_inner, cycles) / n_inner
        samples.append(s)
        total += s * n_inner
    return Timing(label=label, samples_s=samples, timer="cuda-events", warmup=plan.warmup, inner=n_inner,
                  flush_bytes=int(flush_buf.numel()) if flush_buf is not None else 0,
                  launch_hidden=bool(cycles), budget_limited=plan.limited)


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
    # 1 GiB on a GPU dwarfs any L2; flushing it too keeps the ceiling a true HBM copy rate
    t_copy = benchmark(lambda: dst.copy_(src), device, label="copy", warmup=2, min_reps=5, min_time_s=0.3,
                       budgeted=False)
    copy_gbps = 2 * copy_bytes / t_copy.median_s / 1e9
    del src, dst
    a = torch.randn(mm_n, mm_n, device=device).to(mm_dtype)
    b = torch.randn(mm_n, mm_n, device=device).to(mm_dtype)
    t_mm = benchmark(lambda: a @ b, device, label="matmul", warmup=2, min_reps=5, min_time_s=0.3, budgeted=False)
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
        # the ceilings divided by: measured on this device in this process (`ceilings`)
        "ceiling_copy_gbps": ceil.copy_gbps, "ceiling_matmul_tflops": ceil.matmul_tflops,
        "ceiling_matmul_dtype": ceil.matmul_dtype,
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
