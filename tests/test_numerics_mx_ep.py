"""MXFP8 dispatch/combine over gloo: the MXFP8 payload (quantized before the exchange) equals the BF16
payload quantized after it bit for bit, and the no-communication layer to one BF16 ulp, forward and backward."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.errors import UserError
from inferbook.numerics import mx_ep

PROBLEM = dict(tokens=7, hidden=96, inter=40, experts=4, topk=2, seed=3)


def test_two_ranks_mxfp8_payload_is_bit_exact():
    results = mx_ep.launch(2, **PROBLEM, timeout_s=90)
    rows = mx_ep.check(results, **PROBLEM)
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    m = results[0]["results"]
    assert m["mxfp8"]["bytes_sent"] < m["bf16"]["bytes_sent"]
    # the check can fail: one flipped scale byte on one rank's received rows changes its output bits
    bad = [dict(r) for r in results]
    res = {k: dict(v) for k, v in bad[1]["results"].items()}
    out = res["mxfp8"]["out"].clone()
    out.view(torch.int16)[0, 0] ^= 1
    res["mxfp8"] = {**res["mxfp8"], "out": out}
    bad[1] = {**bad[1], "results": res}
    assert not all(r["passed"] for r in mx_ep.check(bad, **PROBLEM))


def test_single_process_reference_matches_a_per_token_loop_closely():
    """The no-communication layer against an independent per-token fp64 computation (not bitwise:
    another summation order), so a routing or combine bug in both paths alike would still show."""
    import math

    from inferbook.numerics import mx
    probs = [mx_ep.make_problem(r, 5, 64, 24, 4, 2, 1) for r in range(2)]
    ref = mx_ep.single_process_reference(probs, 2)
    for p, got in zip(probs, ref):
        xq = mx.dequantize(mx_ep.quantize_rows(p["x"])).double()
        want = torch.zeros(5, 24, dtype=torch.float64)
        for t in range(5):
            for s in range(2):
                want[t] += p["weights"][t, s].double() * (xq[t] @ p["w"][int(p["ids"][t, s])].double().T)
        err = (got["out"].double() - want).abs().max() / want.abs().max()
        assert err < 2 ** -7, err
        assert math.isfinite(float(err))


def test_within_one_ulp_is_what_it_says():
    a = torch.tensor([1.0, -1.0, 0.0, 3.0], dtype=torch.bfloat16)
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)
    assert mx_ep.within_one_ulp(a, a) and mx_ep.within_one_ulp(a[:2], up[:2])
    two = (a.view(torch.int16) + 2).view(torch.bfloat16)
    assert not mx_ep.within_one_ulp(a[:1], two[:1])
    assert not mx_ep.within_one_ulp(a, torch.full_like(a, float("nan")))
    tiny = torch.tensor([0.0], dtype=torch.bfloat16).view(torch.int16) + torch.tensor([1], dtype=torch.int16)
    assert mx_ep.within_one_ulp(torch.tensor([-0.0], dtype=torch.bfloat16), tiny.view(torch.bfloat16))


def test_bytes_and_bad_layout():
    assert mx_ep.payload_bytes(10, 64, "mxfp8") == 10 * 64 + 10 * 2
    assert mx_ep.payload_bytes(10, 64, "bf16") == 10 * 64 * 2
    with pytest.raises(UserError, match="multiple"):
        mx_ep.check_layout(3, 4, 2, 64)
    with pytest.raises(UserError, match="payload"):
        mx_ep.payload_bytes(1, 32, "fp4")


def test_one_process_slices_match_the_process_group_bit_for_bit():
    """The one-GPU path (every rank's slice in one process, SlicesWire) runs the same layer code as the
    NCCL/gloo ranks: here on CPU, its results equal the gloo ranks' in bits and pass the same checks."""
    assert mx_ep.transport(2, "cpu") == "gloo"
    sliced = mx_ep.launch(2, **PROBLEM, how="slices", reps=2)
    rows = mx_ep.check(sliced, **PROBLEM)
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    ranks = mx_ep.launch(2, **PROBLEM, timeout_s=90)
    for a, b in zip(sliced, ranks):
        for pl in mx_ep.PAYLOADS:
            for what in ("out", "dx", "received_codes", "received_scales"):
                assert mx_ep.bits_equal(a["results"][pl][what], b["results"][pl][what]), (a["rank"], pl, what)
    assert set(sliced[0]["times"]) == set(mx_ep.PAYLOADS) and all(len(v) == 2 for v in sliced[0]["times"].values())
