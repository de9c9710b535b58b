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


def test_special_cases_cover_backward_and_paged_d256():
    axes = matrix.check_axes({"head_dim": (64, 96)})
    named = matrix.special_cases(axes)
    bwd = [c for _, c in named if c.direction == "bwd"]
    assert len(bwd) >= matrix.MIN_BACKWARD_CASES > 7
    assert {c.shape for c in bwd} >= {"empty-q", "empty-k"} and any(c.sinks for c in bwd)
    assert any(c.head_dim == 256 and c.kv.startswith("paged") for _, c in named)


def test_split_kv_combines_and_deterministic_backward_pass_and_can_fail(monkeypatch):
    rows = matrix.split_kv_rows(head_dim=32, dtype="bfloat16", device=DEV, seed=0, split_size=32, ctas=3)
    assert len(rows) == 3 and all(r["passed"] for r in rows), rows
    case = _case(direction="bwd", heads="GQA", pack_gqa=False)
    det = matrix.deterministic_backward_rows(case, batch=1, n_heads=4, base=(20, 30), device=DEV,
                                             generator=torch.Generator(device=DEV).manual_seed(0), repeats=2)
    assert len(det) == 3 and all(r["passed"] for r in det), det
    # a backward that is not repeatable (noise in dQ) is caught
    real = matrix._run
    calls = {"n": 0}

    def flaky(case, inp, impl):
        res = real(case, inp, impl)
        calls["n"] += 1
        if calls["n"] == 2:
            res["dq"] = res["dq"].clone()
            res["dq"].view(-1)[0] += 1.0
        return res
    monkeypatch.setattr(matrix, "_run", flaky)
    bad = matrix.deterministic_backward_rows(case, batch=1, n_heads=4, base=(20, 30), device=DEV,
                                             generator=torch.Generator(device=DEV).manual_seed(0), repeats=2)
    assert [r["passed"] for r in bad] == [False, True, True]


@pytest.mark.parametrize("target,case", [
    ("sm_90", _case(causal=False, kv="paged-16", window="left")),                      # d64 forward, 32 keys
    ("sm_80", _case(direction="bwd", sinks=True, window="left")),                      # and sm_80 dK/dV, 32 keys
    ("sm_80", _case(head_dim=128, causal=False, layout="fixed", kv="paged-16", shape="113x203", sinks=True)),  # 64 rows
    ("sm_100", _case(head_dim=128, pack_gqa=False, heads="MHA", direction="bwd")),      # dK/dV at 4 warps
    ("sm_90", _case(kv="paged-1", dtype="float16", window="left", dv="mla")),          # MLA 16x16
])
def test_register_saving_nvidia_tiles_pass_interpreted(target, case):
    # the smaller tiles `block_config` gives these features on NVIDIA (the interpreter's own config is
    # 64x64), run in the interpreter: every checked tensor within the tolerance rule
    from inferbook.device import building_for

    with building_for(target):
        rows = matrix.run_case(case, batch=2, n_heads=4, base=(24, 40), device=DEV, generator=torch.Generator().manual_seed(0))
    assert rows and not matrix.failures(rows), matrix.failures(rows)


@pytest.mark.parametrize("target,case", [
    ("gfx942", _case(head_dim=128, causal=False, pack_gqa=False, heads="MHA", direction="bwd")),   # dK/dV 128x64
    ("gfx950", _case(head_dim=96, direction="bwd", softcap=True)),                    # 128x32 (causal, softcap)
    ("gfx942", _case(head_dim=192, direction="bwd", dv="half", sinks=True)),          # d192: 64x32 on 4 waves
    ("gfx950", _case(kv="paged-16", dtype="float16", window="left", dv="mla")),       # MLA forward 32x16 on 4 waves
    ("gfx942", _case(head_dim=128, kv="paged-16", window="left", sinks=True)),        # forward 128x64 on 4 waves
    ("gfx950", _case(head_dim=256, causal=False, window="left", softcap=True)),      # d256 forward 64x32 on 4 waves
])
def test_cdna_tiles_pass_interpreted(target, case):
    # CDNA's own dK/dV, dQ and MLA forward tiles (`block_config`'s 'hip' entries) in the interpreter, on 150 queries x
    # 200 keys so that the 128-row tiles loop twice with a ragged tail: every checked tensor within the tolerance rule
    from inferbook.device import building_for

    with building_for(target):
        kind = "fwd" if case.direction == "fwd" else "dkdv"
        assert flash.block_config(DEV, case.dims[0], kind, case.dims[1], causal=case.causal,
                                  softcap=case.softcap)["num_warps"] == 4
        rows = matrix.run_case(case, batch=2, n_heads=4, base=(150, 200), device=DEV, generator=torch.Generator().manual_seed(0))
    assert rows and not matrix.failures(rows), matrix.failures(rows)



@pytest.mark.parametrize("case", [
    _case(head_dim=128, causal=True, pack_gqa=False, heads="MHA", direction="bwd"),    # dK/dV 64x64, dQ 64x32
    _case(head_dim=64, causal=False, heads="GQA", direction="bwd", sinks=True),        # d64: the same tiles
])
def test_sm90_backward_tiles_pass_interpreted(case):
    # sm_90's d <= 128 backward tiles (`block_config`): 64-row dK/dV (one warpgroup) and 64x32 dQ, interpreted on 150
    # queries x 200 keys so that both loop with ragged tails
    from inferbook.device import building_for

    with building_for("sm_90"):
        c = flash.block_config(DEV, case.dims[0], "dkdv", case.dims[1], causal=case.causal, softcap=case.softcap)
        assert (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]) == (64, 64, 4)
        rows = matrix.run_case(case, batch=2, n_heads=4, base=(150, 200), device=DEV, generator=torch.Generator().manual_seed(0))
    assert rows and not matrix.failures(rows), matrix.failures(rows)