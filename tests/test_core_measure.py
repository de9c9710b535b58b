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
