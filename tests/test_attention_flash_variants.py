"""Sliding window, softcap, sinks and dv != d (up to MLA's 576/512) in the main flash kernel, combined with
varlen and paged KV, against the PyTorch definition with FlashAttention's rule; window tiles outside the band
are never loaded; the checks can fail."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.attention import flash, matrix

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(**kw):
    base = dict(head_dim=64, causal=False, layout="fixed", kv="contiguous", heads="GQA", pack_gqa=True,
                direction="fwd", dtype="bfloat16", shape="base", sinks=False)
    return matrix.Case(**{**base, **kw})


VARIANTS = [
    dict(window="left", causal=True, direction="bwd", layout="varlen", sinks=True),
    dict(window="band", softcap=True, kv="paged-16", layout="varlen", shape="113x203"),
    dict(softcap=True, direction="bwd", heads="MHA", dtype="float16", causal=True),
    dict(dv="half", direction="bwd", window="band", shape="q>k", sinks=True),
    dict(dv="mla", kv="paged-1", layout="varlen", heads="MQA", shape="q>k"),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_variant_cases_pass_the_rule(kw):
    rows = matrix.run_case(_case(**kw), batch=1, n_heads=4, base=(24, 40), device=DEV,
                           generator=torch.Generator(device=DEV).manual_seed(1))
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]


def test_window_tiles_outside_the_band_are_never_loaded():
    """One query tile at the end of 512 keys with a left window of 32 needs the last two 64-key tiles: NaN in
    every other tile's values is never read (forward, dK/dV and dQ). Without the window every tile is read and
    the NaN shows — the check can fail."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 64, 2, 64, generator=g).bfloat16().to(DEV)
    k = torch.randn(1, 512, 2, 64, generator=g).bfloat16().to(DEV)
    v = torch.randn(1, 512, 2, 64, generator=g).bfloat16()
    v[:, :384] = float("nan")
    v = v.to(DEV)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash.attention(*leaves, causal=True, window_size=(32, -1))
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(leaves[0].grad).all()
    assert (leaves[1].grad[:, :384] == 0).all() and (leaves[2].grad[:, :384] == 0).all()
    ref, _ = flash.attention_reference(q, k, torch.nan_to_num(v), causal=True, window_size=(32, -1))
    assert (out.float() - ref).abs().max() < 0.05
    with torch.no_grad():
        assert torch.isnan(flash.attention(q, k, v, causal=True)).any()


def test_window_softcap_and_dv_semantics():
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 6, 1, 16, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 6, 1, 32, generator=g).bfloat16()
    with torch.no_grad():
        out = flash.attention(q.to(DEV), k.to(DEV), v.to(DEV), window_size=(0, 0))   # each query sees its own key
    assert out.shape == (1, 6, 1, 32) and torch.allclose(out.cpu().float(), v.float(), atol=1e-2)
    # softcap bounds every logit by the cap: a huge q gives the same attention as the cap's saturation
    big = (q * 1e4).to(DEV)
    with torch.no_grad():
        o1 = flash.attention(big, k.to(DEV), v.to(DEV), softcap=1.0)
    r1, _ = flash.attention_reference(big.cpu(), k, v, softcap=1.0)
    assert torch.isfinite(o1).all() and (o1.cpu().float() - r1).abs().max() < 2e-2
    # q > k with a causal band: the first queries see no key -> out 0, lse -inf
    with torch.no_grad():
        o3, l3 = flash.attention(torch.randn(1, 8, 1, 16, generator=g).bfloat16().to(DEV), k.to(DEV), v.to(DEV),
                                 causal=True, window_size=(2, -1), return_lse=True)
    assert (o3[0, :2] == 0).all() and torch.isinf(l3[0, 0, :2]).all()


def test_bad_variant_input_is_one_clear_error():
    x = torch.randn(1, 4, 2, 16).bfloat16()
    with pytest.raises(ValueError, match="window_size"):
        flash.attention(x, x, x, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flash.attention(x, x, x, softcap=-1.0)
    big = torch.randn(1, 4, 1, 576).bfloat16()
    with pytest.raises(ValueError, match="backward takes head dims up to 256"):
        flash.attention(big.requires_grad_(), big, big[..., :512])
    with pytest.raises(ValueError, match="value head dim 640"):
        flash.attention(big, big, torch.randn(1, 4, 1, 640).bfloat16())
