"""When do two runs agree? The book's rule for every check that compares numbers.

Exact (bitwise) equality only where the same kernel runs the same inputs with the same launch:
a byte copy, integer code, one compiled kernel called twice, a kernel whose per-element arithmetic
is fixed by construction. Everywhere else, a GPU, cuDNN, Inductor or another dtype may round
differently, so two paths agree when the candidate's error against a higher-precision *gold*
answer is at most twice the reference path's own error in the same working precision, plus the
working precision's rounding floor (FlashAttention's test rule).

Greedy tokens are a discrete function of logits: two paths whose logits both lie within the
tolerance can still pick different tokens where the top-2 gap is smaller than twice the tolerance.
So tokens are compared only at *decisive* positions, where the gold top-2 gap exceeds twice the
tolerance; at the others a flip is rounding, not a bug, and is counted, not asserted.
"""
from __future__ import annotations

import torch


def rounding_floor(gold: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at `gold`'s largest magnitude (eps x max|gold|): the
    smallest honest tolerance of any result stored in that precision, larger than one rounding of
    any of its values. (FlashAttention's tests estimate the same floor as `(x + 0.3 - 0.3) - x`.)
    gold: any shape, any float dtype."""
    return float(torch.finfo(dtype).eps) * float(gold.detach().abs().max()) if gold.numel() else 0.0


def within_reference_error(candidate: torch.Tensor, reference: torch.Tensor, gold: torch.Tensor,
                           dtype: torch.dtype, factor: float = 2.0) -> dict:
    """FlashAttention's rule: |candidate - gold| <= factor x |reference - gold| + rounding floor.

    candidate, reference: the two paths' results in the working precision `dtype` (same shape);
    gold: the same quantity in a higher precision (float64 on CPU or GPU). Returns
    {error, reference_error, tolerance, nan, passed}; NaN anywhere fails."""
    g = gold.detach().to(torch.float64)
    c, r = candidate.detach().to(torch.float64).to(g.device), reference.detach().to(torch.float64).to(g.device)
    if c.shape != g.shape or r.shape != g.shape:
        raise ValueError(f"shapes differ: candidate {tuple(c.shape)}, reference {tuple(r.shape)}, gold {tuple(g.shape)}")
    nan = bool(c.isnan().any() or r.isnan().any() or g.isnan().any())
    err = float((c - g).abs().max()) if c.numel() else 0.0
    ref_err = float((r - g).abs().max()) if r.numel() else 0.0
    tol = factor * ref_err + rounding_floor(g, dtype)
    return {"error": err, "reference_error": ref_err, "tolerance": tol, "nan": nan,
            "passed": (not nan) and err <= tol}


def decisive_agreement(candidate_tokens: torch.Tensor, reference_tokens: torch.Tensor, gold_logits: torch.Tensor,
                       tolerance: float) -> dict:
    """Greedy tokens compared where the choice is decided by more than rounding.

    candidate_tokens, reference_tokens: [..., N] int64 argmaxes at the same positions (the same
    forced prefix); gold_logits: [..., N, V] at those positions in high precision. A position is
    decisive when its gold top-2 gap exceeds 2 x `tolerance` (then logits within the tolerance
    cannot reorder the top two). Returns {positions, decisive, agree_decisive, agree_all,
    min_gap, passed}: passed when every decisive position agrees (vacuously if none is)."""
    g = gold_logits.detach().to(torch.float64)
    top2 = g.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).cpu()
    a, b = candidate_tokens.detach().cpu(), reference_tokens.detach().cpu()
    if a.shape != b.shape or a.shape != gap.shape:
        raise ValueError(f"shapes differ: tokens {tuple(a.shape)} / {tuple(b.shape)}, logits {tuple(g.shape)}")
    decisive = gap > 2 * tolerance
    same = a == b
    return {"positions": int(same.numel()), "decisive": int(decisive.sum()),
            "agree_decisive": int((same & decisive).sum()), "agree_all": int(same.sum()),
            "min_gap": float(gap.min()) if gap.numel() else None,
            "passed": bool(same[decisive].all())}
