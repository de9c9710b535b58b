"""The book's agreement rule: logits within 2 x the reference path's own error, tokens compared only
where the gold top-2 gap decides them; each check shown failing on a broken candidate."""
import pytest
import torch

from inferbook.tolerance import decisive_agreement, rounding_floor, within_reference_error


def _paths(dtype, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(64, n, generator=g, dtype=torch.float64), torch.randn(n, 32, generator=g, dtype=torch.float64)
    gold = a @ b
    ref = (a.to(dtype) @ b.to(dtype)).double()                      # one summation order
    perm = torch.randperm(n, generator=g)
    cand = (a.to(dtype)[:, perm] @ b.to(dtype)[perm]).double()       # another order, same precision
    return gold, ref, cand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_another_summation_order_passes(dtype):
    gold, ref, cand = _paths(dtype)
    r = within_reference_error(cand, ref, gold, dtype)
    assert r["passed"] and r["tolerance"] > r["reference_error"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("defect", ["noise", "nan", "lower precision"])
def test_defects_fail(dtype, defect):
    gold, ref, cand = _paths(dtype)
    if defect == "noise":        # every element off by more than the rule allows (2 x reference error + floor)
        cand = cand + (3 * (ref - gold).abs().max() + 2 * rounding_floor(gold, dtype)) * torch.randn_like(cand).sign()
    elif defect == "nan":
        cand = cand.clone()
        cand[3, 5] = float("nan")
    else:                        # the candidate computes in fp16-with-bf16-range: 8 bits fewer than fp32
        cand = cand.to(torch.bfloat16).double() if dtype == torch.float32 else cand.to(torch.float8_e4m3fn).double()
    assert not within_reference_error(cand, ref, gold, dtype)["passed"]


def test_rounding_floor_tracks_the_dtype():
    x = torch.full((4,), 3.0, dtype=torch.float64) + torch.linspace(0, 1, 4, dtype=torch.float64)
    assert rounding_floor(x, torch.bfloat16) > 100 * rounding_floor(x, torch.float32) > 0


def test_tokens_compared_only_where_decisive():
    gold = torch.tensor([[[5.0, 1.0, 0.0], [1.0, 1.0 + 1e-6, 0.0], [0.0, 2.0, 9.0]]], dtype=torch.float64)
    ref = gold.argmax(-1)
    flipped_close = ref.clone()
    flipped_close[0, 1] = 0                   # the near-tie: rounding may pick either
    r = decisive_agreement(flipped_close, ref, gold, tolerance=1e-3)
    assert r["passed"] and r["decisive"] == 2 and r["agree_all"] == 2
    flipped_decisive = ref.clone()
    flipped_decisive[0, 2] = 1                # a 7-unit gap: a real difference
    assert not decisive_agreement(flipped_decisive, ref, gold, tolerance=1e-3)["passed"]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        within_reference_error(torch.zeros(3), torch.zeros(3), torch.zeros(4), torch.float32)
