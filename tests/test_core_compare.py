"""The comparison helper: a verdict only when the run's own spread allows it."""
import random

import pytest

from inferbook.measure import Timing, compare_timings, significant
from inferbook.record import RunRecord


def _noisy(center, spread, n, seed):
    r = random.Random(seed)
    return [center * (1 + spread * (r.random() - 0.5)) for _ in range(n)]


def test_separated_runs_get_a_verdict_both_ways():
    fast, slow = _noisy(1.0, 0.04, 25, 1), _noisy(1.3, 0.04, 25, 2)
    c = compare_timings(fast, slow)
    assert c.verdict == "faster" and c.a_better is True and c.hi < 1
    assert compare_timings(slow, fast).verdict == "slower"
    assert "faster than" in c.sentence("the fused kernel", "eager")


def test_overlapping_runs_get_no_verdict():
    a, b = _noisy(1.0, 0.3, 12, 3), _noisy(1.03, 0.3, 12, 4)
    c = compare_timings(a, b)
    assert c.verdict == "no difference this run can see" and c.a_better is None
    assert c.lo <= 1 <= c.hi
    assert "no difference this run can see" in c.sentence("A", "B")


def test_a_real_ten_percent_difference_separates_with_enough_samples():
    c = compare_timings(_noisy(1.0, 0.05, 30, 5), _noisy(1.1, 0.05, 30, 6))
    assert c.verdict == "faster"


def test_rates_flip_the_sense():
    c = compare_timings(_noisy(200, 0.02, 10, 7), _noisy(100, 0.02, 10, 8), higher_is_better=True)
    assert c.verdict == "faster"


def test_record_measurements_keep_samples_and_compare():
    ta = Timing("a", _noisy(1.0, 0.02, 10, 9), "perf_counter", 1)
    tb = Timing("b", _noisy(2.0, 0.02, 10, 10), "perf_counter", 1)
    hw = {"device_type": "cpu", "cpu_model": "T", "cpu_cores": 2}
    ra, rb = RunRecord(chapter="x", name="a", hardware=hw), RunRecord(chapter="x", name="b", hardware=hw)
    ra.add_timing("t", ta)
    rb.add_timing("t", tb)
    rb2 = RunRecord.from_dict(rb.to_dict())
    assert compare_timings(ra.get("t"), rb2.get("t")).verdict == "faster"


@pytest.mark.parametrize("bad", [[1.0], [], [1.0, float("nan")], [1.0, -1.0], [0.0, 1.0]])
def test_bad_samples_are_refused(bad):
    with pytest.raises(ValueError):
        compare_timings(bad, [1.0, 1.1, 1.2])


def test_no_samples_kept_is_a_clear_error():
    with pytest.raises(ValueError, match="kept no samples"):
        compare_timings({"name": "t", "value": 1.0}, [1.0, 1.1])


@pytest.mark.parametrize("x, shown", [(0.03712, "0.0371"), (61.056121, "61.1"), (16384.0, "16384"),
                                       (1.0004, "1.00"), (float("nan"), "—"), (0, "0")])
def test_significant_figures(x, shown):
    assert significant(x) == shown
