"""Sliding window, softcap and dv != d: the variants kernel (at its GPU tiles, in the interpreter on CPU)
against its PyTorch definition with FlashAttention's rule, forward and backward; the checks can fail."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.attention import matrix, variants
from inferbook.errors import UserError

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_variant_rows_pass():
    rows = matrix.variant_rows(head_dim=32, base=(24, 40), batch=1, n_heads=2, device=DEV, seed=0)
    assert len(rows) == 5 * 5
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]


def test_window_masks_and_empty_rows():
    q = torch.randn(1, 6, 1, 16).bfloat16()
    k = torch.randn(1, 6, 1, 16).bfloat16()
    v = torch.randn(1, 6, 1, 16).bfloat16()
    out, lse = variants.reference(q, k, v, window=(0, 0))          # each query sees exactly its own key
    assert torch.allclose(out[0, :, 0].float(), v[0, :, 0].float())
    o2, l2 = variants.attention(q.to(DEV), k.to(DEV), v.to(DEV), window=(0, 0))
    assert torch.allclose(o2.cpu().float(), v.float(), atol=1e-2)
    # q > k with causal: the first queries see no key -> out 0, lse -inf, in both
    o3, l3 = variants.attention(torch.randn(1, 8, 1, 16).bfloat16().to(DEV), k.to(DEV), v.to(DEV), causal=True)
    assert (o3[0, :2] == 0).all() and torch.isinf(l3[0, 0, :2]).all()


def test_softcap_gradient_without_its_derivative_fails(monkeypatch):
    """Drop the cap's derivative from the reference's backward: the kernel's dq no longer matches it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g).bfloat16() for _ in range(3))
    q = q * 4
    ql = q.clone().requires_grad_()
    out, _ = variants.attention(ql.to(DEV), k.to(DEV), v.to(DEV), softcap=1.0)
    out.float().sum().backward()
    qr = q.clone().float().requires_grad_()
    s = torch.einsum("bqhd,bkhd->bhqk", qr, k.float()) / 4.0
    capped = 1.0 * torch.tanh(s / 1.0)
    wrong = s + (capped - s).detach()                 # value capped, gradient of the uncapped logit
    p = torch.softmax(wrong, -1)
    torch.einsum("bhqk,bkhd->bqhd", p, v.float()).sum().backward()
    assert (ql.grad.float().cpu() - qr.grad).abs().max() > 0.05


def test_bad_input():
    x = torch.randn(1, 4, 2, 16).bfloat16()
    with pytest.raises(UserError, match="window"):
        variants.attention(x, x, x, window=(-2, 0))
    with pytest.raises(UserError, match="softcap"):
        variants.attention(x, x, x, softcap=-1.0)
