"""The acceptance matrix: covering design, tolerance rule (it must be able to fail), a small
interpreted run, and the chapter at preset=smoke."""
import itertools

import pytest
import torch

import inferbook  # noqa: F401
from inferbook.attention import flash, matrix

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_pairwise_covers_every_valid_pair():
    axes = matrix.check_axes({})
    cases = matrix.pairwise_cases(axes, seed=1)
    assert len(cases) < len(matrix.product_cases(axes)) / 100
    assert all(matrix.valid(vars(c)) for c in cases)
    for (a, va), (b, vb) in itertools.combinations([(n, v) for n in axes for v in axes[n]], 2):
        if a == b or not matrix.valid({a: va, b: vb}):
            continue
        assert any(getattr(c, a) == va and getattr(c, b) == vb for c in cases), (a, va, b, vb)


def test_bad_axes_are_refused():
    with pytest.raises(ValueError, match="unknown matrix axis"):
        matrix.check_axes({"headdim": (64,)})
    with pytest.raises(ValueError, match="head_dim"):
        matrix.check_axes({"head_dim": (80,)})
    with pytest.raises(ValueError, match="mode"):
        matrix.run_matrix(mode="all", device="cpu")


def _case(**kw):
    base = dict(head_dim=64, causal=True, layout="varlen", kv="contiguous", heads="GQA", pack_gqa=True,
                direction="fwd", dtype="bfloat16", shape="base", sinks=False)
    return matrix.Case(**{**base, **kw})


@pytest.mark.parametrize("damage", ["bias", "nan", "lse"])
def test_tolerance_rule_fails_a_damaged_kernel(monkeypatch, damage):
    real = flash.attention

    def damaged(*a, **kw):
        out, lse = real(*a, **kw)
        if damage == "bias":       # outputs reach ~3 here: a 3% error, that allclose(rtol=5e-2) would accept
            out = out + 0.1
        elif damage == "nan":
            out = out.clone()
            out.view(-1)[3] = float("nan")
        else:                       # a query with no key must stay exactly -inf
            lse = torch.where(torch.isinf(lse), torch.full_like(lse, -1e4), lse)
        return out, lse

    monkeypatch.setattr(flash, "attention", damaged)
    shape = "q>k" if damage == "lse" else "base"
    rows = matrix.run_case(_case(shape=shape), batch=1, n_heads=4, base=(20, 30), device=DEV,
                           generator=torch.Generator(device=DEV).manual_seed(0))
    bad = {r["check"] for r in rows if not r["passed"]}
    assert bad == ({"lse"} if damage == "lse" else {"out"}), rows


def test_run_matrix_small_interpreted():
    rows = matrix.run_matrix({"head_dim": (96,), "kv": ("contiguous", "paged-16"), "shape": ("base", "empty-k"),
                              "heads": ("MQA",), "dtype": ("float16",), "sinks": (True,)},
                             preset="smoke", device=DEV, base=(24, 40), batch=1)
    assert rows and not matrix.failures(rows), matrix.failures(rows)
    labels = {r["label"] for r in rows}
    assert any("paged-16" in lbl for lbl in labels) and any("bwd" in lbl for lbl in labels)
    cov = matrix.coverage(rows, matrix.check_axes({"head_dim": (96,)}))
    assert cov["head_dim"][96][0] == len(labels)
