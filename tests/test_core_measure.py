import math
import os

import pytest
import torch

from inferbook import measure
from inferbook.errors import InterpreterTimingError

CPU = torch.device("cpu")


def test_benchmark_reports_median_and_quantiles():
    calls = []
    t = measure.benchmark(lambda: calls.append(1), CPU, warmup=2, min_reps=7, min_time_s=0.0)
    assert t.n == 7 and len(calls) == 9 and t.timer == "perf_counter"
    s = t.summary()
    assert s["p10_s"] <= s["median_s"] <= s["p90_s"]


def test_quantiles_exact():
    t = measure.Timing("x", [5.0, 1.0, 3.0, 2.0, 4.0], "perf_counter", 0)
    assert t.median_s == 3.0 and t.quantile(0.0) == 1.0 and t.quantile(1.0) == 5.0
    assert math.isclose(t.p10_s, 1.4) and math.isclose(t.p90_s, 4.6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only without CUDA")
def test_refuses_to_time_triton_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    with pytest.raises(InterpreterTimingError, match="interpreter"):
        measure.benchmark(lambda: None, CPU, uses_triton=True)


def test_phase_timer_keeps_phases_apart():
    ph = measure.PhaseTimer(CPU)
    with ph("load"):
        sum(range(1000))
    with ph("steady"):
        pass
    with ph("steady"):
        pass
    d = ph.as_dict()
    assert set(d) == {"load", "steady"} and all(v >= 0 for v in d.values())


def test_ceilings_measured_and_cached():
    c1 = measure.ceilings(CPU)
    c2 = measure.ceilings(CPU)
    assert c1 is c2
    assert c1.copy_gbps > 0.05 and c1.matmul_tflops > 1e-4 and c1.matmul_dtype == "float32"


def test_roofline_fractions():
    ceil = measure.Ceilings(copy_gbps=100.0, matmul_tflops=10.0, matmul_dtype="bf16", copy_bytes=1,
                            matmul_shape=(1, 1, 1), timer="x")
    r = measure.roofline(bytes_moved=50e9, flops=1e12, seconds=1.0, ceil=ceil)
    assert math.isclose(r["achieved_gbps"], 50.0) and math.isclose(r["frac_copy"], 0.5)
    assert math.isclose(r["frac_matmul"], 0.1) and r["bound"] == "memory"  # 20 flop/B < ridge 100
    r = measure.roofline(bytes_moved=1e9, flops=5e12, seconds=1.0, ceil=ceil)
    assert r["bound"] == "compute"


# --- the CUDA path's logic, with a fake GPU clock (no GPU needed) ------------------------------------

class FakeGPU:
    """A stream clock in seconds: each call of the timed function adds `call_s`; a spin kernel and
    the L2 flush add their own time, outside the events if benchmark orders them right."""

    def __init__(self, call_s):
        self.t, self.call_s, self.log = 0.0, call_s, []

    def fn(self):
        self.t += self.call_s
        self.log.append("call")

    def event_cls(gpu):
        class Event:
            def __init__(self, enable_timing=True):
                self.at = None

            def record(self):
                self.at = gpu.t
                gpu.log.append("event")

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.at - self.at) * 1e3

        return Event


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(call_s):
        gpu = FakeGPU(call_s)

        class Buf:
            def zero_(self):
                gpu.t += 25e-6
                gpu.log.append("flush")

            def numel(self):
                return 120 << 20

        def sleep(cycles):
            gpu.t += cycles / 1.5e9
            gpu.log.append("hold")

        monkeypatch.setattr(torch.cuda, "Event", gpu.event_cls())
        monkeypatch.setattr(torch.cuda, "_sleep", sleep, raising=False)
        monkeypatch.setattr(measure, "_flush_buffer", lambda d: Buf())
        monkeypatch.setattr(measure, "_sleep_cycles_per_s", lambda d: 1.5e9)
        monkeypatch.setattr(measure, "synchronize", lambda d: None)
        return gpu
    return make


CUDA = torch.device("cuda")


def test_cuda_flushes_l2_before_each_sample_outside_the_events(fake_cuda):
    gpu = fake_cuda(3e-6)
    t = measure.benchmark(gpu.fn, CUDA, warmup=1, min_reps=6, min_time_s=0.0)
    assert t.timer == "cuda-events" and t.inner == 1 and t.flush_bytes == 120 << 20 and t.launch_hidden
    assert all(s == pytest.approx(3e-6) for s in t.samples_s), "flush or hold leaked into the timed span"
    timed = gpu.log[gpu.log.index("call") + 1:]  # after warm-up
    samples = [timed[i:i + 5] for i in range(timed.index("flush", 1), len(timed), 5)]
    assert samples and all(s == ["flush", "hold", "event", "call", "event"] for s in samples), samples
    assert t.summary()["l2_flush_bytes"] == 120 << 20 and t.summary()["inner"] == 1


def test_cuda_microsecond_calls_run_back_to_back_without_flush(fake_cuda):
    gpu = fake_cuda(2e-6)
    t = measure.benchmark(gpu.fn, CUDA, warmup=0, min_reps=4, min_time_s=0.0, flush_l2=False)
    assert t.inner == 50 and t.flush_bytes == 0 and "flush" not in gpu.log
    assert all(s == pytest.approx(2e-6) for s in t.samples_s)
    assert measure.benchmark(gpu.fn, CUDA, warmup=0, min_reps=2, min_time_s=0.0, inner=7).inner == 7


def test_cuda_opt_outs(fake_cuda):
    gpu = fake_cuda(1e-3)
    t = measure.benchmark(gpu.fn, CUDA, warmup=0, min_reps=3, min_time_s=0.0, flush_l2=False, hide_launch=False)
    assert t.inner == 1 and not t.launch_hidden and "hold" not in gpu.log and "flush" not in gpu.log


def test_plan_inner_and_hold_cycles():
    assert measure.plan_inner(2e-6, flush=True, inner=None) == 1
    assert measure.plan_inner(2e-6, flush=False, inner=None) == 50
    assert measure.plan_inner(1e-9, flush=False, inner=None) == measure.MAX_INNER
    assert measure.plan_inner(1e-3, flush=False, inner=None) == 1
    with pytest.raises(ValueError):
        measure.plan_inner(1.0, flush=False, inner=0)
    assert measure.hold_cycles(10e-6, 1e9) == int(1e9 * 20e-6)   # floor
    assert measure.hold_cycles(1e-3, 1e9) == int(1e9 * 1.5e-3)
    assert measure.hold_cycles(1.0, 1e9) == 0                    # a host-bound call: no hold


def test_l2_flush_bytes_is_twice_l2(monkeypatch):
    class Props:
        L2_cache_size = 60 << 20

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    assert measure.l2_flush_bytes(CUDA) == 120 << 20


def test_budget_sizes_repetitions():
    calls = []

    def slow():
        calls.append(1)
        import time
        time.sleep(0.002)

    with measure.time_budget(0.0):
        t = measure.benchmark(slow, CPU, warmup=3, min_reps=20, min_time_s=1.0)
    assert t.n == measure.BUDGET_FLOOR_REPS and t.budget_limited and t.warmup == 1
    with measure.time_budget(0.2):  # 10 % of 0.2 s: ~20 ms of a 2 ms call, not 20 reps
        t = measure.benchmark(slow, CPU, warmup=0, min_reps=20, min_time_s=1.0)
    assert measure.BUDGET_FLOOR_REPS <= t.n < 20 and t.budget_limited
    t = measure.benchmark(slow, CPU, warmup=0, min_reps=4, min_time_s=0.0)
    assert t.n == 4 and not t.budget_limited and measure.budget_left() is None
    with measure.time_budget(0.0):  # the ceilings are exempt: every roofline divides by them
        t = measure.benchmark(slow, CPU, warmup=0, min_reps=6, min_time_s=0.0, budgeted=False)
    assert t.n == 6 and not t.budget_limited
    with measure.time_budget(100.0):
        with measure.time_budget(1.0):
            assert measure.budget_left() <= 1.0
        assert measure.budget_left() > 50


def test_roofline_names_the_ceiling_it_divided_by():
    ceil = measure.Ceilings(copy_gbps=4300.0, matmul_tflops=790.0, matmul_dtype="bfloat16", copy_bytes=1,
                            matmul_shape=(1, 1, 1), timer="cuda-events")
    r = measure.roofline(bytes_moved=43e9, flops=0.0, seconds=0.02, ceil=ceil)
    assert r["ceiling_copy_gbps"] == 4300.0 and r["frac_copy"] == pytest.approx(0.5)


def test_rotating_inputs_run_back_to_back_without_flush(fake_cuda, monkeypatch):
    gpu = fake_cuda(2e-6)
    seen = []

    def kernel(i):
        seen.append(i)
        gpu.fn()

    t = measure.benchmark(kernel, CUDA, warmup=0, min_reps=3, min_time_s=0.0, rotate=4)
    assert t.flush_bytes == 0 and t.inner == 50 and "flush" not in gpu.log
    assert seen[:9] == [0, 1, 2, 3, 0, 1, 2, 3, 0]

    class Props:
        L2_cache_size = 60 << 20

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    assert measure.l2_rotations(16 << 20, CUDA) == 8 and measure.l2_rotations(1 << 30, CUDA) == 1
    assert measure.l2_rotations(16 << 20, CPU) == 1
    calls = []
    measure.benchmark(lambda i: calls.append(i), CPU, warmup=1, min_reps=3, min_time_s=0.0, rotate=2)
    assert calls == [0, 1, 0, 1]
