"""FlashAttention kernel (Triton; the interpreter on CPU) against its PyTorch references.

Tolerances follow FlashAttention's rule (matrix.run_case): our error vs a float32 reference at
most 2x (gradients 3x) PyTorch's own error in the same low precision, plus a rounding floor.
Shapes are small because the interpreter's tl.dot runs at ~1e8 flop/s; the edge cases stay.
"""
import itertools
import math
import zlib

import pytest
import torch

from inferbook.tolerance import within_reference_error

import inferbook  # noqa: F401  (turns the Triton interpreter on where there is no GPU)
from inferbook.attention import flash, matrix

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gen(seed=0):
    return torch.Generator(device=DEV).manual_seed(seed)


def rnd(g, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=DEV)


def assert_case_passes(case, **sizes):
    rows = matrix.run_case(case, device=DEV, generator=gen(zlib.crc32(case.label.encode()) % 1000), **sizes)
    bad = [(r["check"], r["error"], r["tolerance"]) for r in rows if not r["passed"]]
    assert not bad, f"{case.label}: {bad}"
    return rows


def case(**kw):
    base = dict(head_dim=64, causal=False, layout="fixed", kv="contiguous", heads="MHA", pack_gqa=False,
                direction="fwd", dtype="bfloat16", shape="base", sinks=False)
    return matrix.Case(**{**base, **kw})


# --- forward/backward against the references -------------------------------------------------

@pytest.mark.parametrize("head_dim", flash.HEAD_DIMS)
def test_forward_every_head_dim(head_dim):
    # 96 and 192 run padded to 128/256 with the tail lanes predicated off
    assert_case_passes(case(head_dim=head_dim, causal=True, heads="GQA", pack_gqa=True,
                            dtype="float16" if head_dim % 64 else "bfloat16"),
                       batch=1, n_heads=4, base=(19, 37))


def test_odd_shape_113x203_fwd_bwd_varlen_causal():
    assert_case_passes(case(shape="113x203", layout="varlen", causal=True, direction="bwd"),
                       batch=1, n_heads=2, base=(8, 12))


def test_backward_gqa_sinks_fixed_noncontiguous():
    # fixed-layout inputs are head slices of a fused QKV buffer: strided, not contiguous
    rows = assert_case_passes(case(direction="bwd", heads="GQA", sinks=True, causal=True, shape="q>k",
                                   dtype="float16", head_dim=96), batch=2, n_heads=4, base=(24, 40))
    assert {r["check"] for r in rows} == {"out", "lse", "dq", "dk", "dv", "dsinks"}


def test_transposed_inputs_and_extreme_values():
    g = gen(3)
    # [B, H, S, D] storage viewed as [B, S, H, D]; logits of a few hundred: the online softmax's
    # running max must keep exp2 in range
    q = rnd(g, 1, 2, 45, 64, scale=6.0).transpose(1, 2)
    k = rnd(g, 1, 2, 70, 64, scale=6.0).transpose(1, 2)
    v = rnd(g, 1, 2, 70, 64).transpose(1, 2)
    assert not q.is_contiguous()
    out, lse = flash.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = flash.attention_reference(q, k, v, causal=True)
    low, _ = flash.attention_reference(q, k, v, causal=True, upcast=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.max() > 100  # really extreme
    err = (out.float() - ref).abs().max().item()
    ref_err = (low.float() - ref).abs().max().item()
    assert err <= 2 * ref_err + 2 * 2.0 ** -8, (err, ref_err)
    assert torch.allclose(lse, ref_lse, rtol=1e-3, atol=1e-2)


# --- the empty-sequence contract ----------------------------------------------------------------

def test_empty_k_gives_zero_and_minus_inf():
    g = gen(4)
    q, k, v = rnd(g, 2, 9, 4, 64), rnd(g, 2, 0, 2, 64), rnd(g, 2, 0, 2, 64)
    out, lse = flash.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.shape == (2, 4, 9) and torch.all(lse == -math.inf)
    # with sinks: out 0, lse = the sink logit
    sinks = torch.randn(4, generator=g, device=DEV)
    out, lse = flash.attention(q, k, v, return_lse=True, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks[None, :, None].expand_as(lse))


def test_causal_queries_without_keys_and_their_gradients():
    g = gen(5)
    # Sq > Sk, causal, bottom-right aligned: the first Sq - Sk queries see no key
    q, k, v = (rnd(g, *s).requires_grad_() for s in ((1, 40, 2, 64), (1, 15, 2, 64), (1, 15, 2, 64)))
    out, lse = flash.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :25] == 0) and torch.all(lse[:, :, :25] == -math.inf)
    assert torch.isfinite(lse[:, :, 25:]).all()
    out.backward(rnd(g, *out.shape))
    assert torch.all(q.grad[:, :25] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_empty_q_returns_and_unattended_keys_get_zero_grad():
    g = gen(6)
    lq, lk = [6, 0, 9], [11, 13, 8]
    q = rnd(g, sum(lq), 4, 64).requires_grad_()
    k = rnd(g, sum(lk), 2, 64).requires_grad_()
    v = rnd(g, sum(lk), 2, 64).requires_grad_()
    out = flash.attention(q, k, v, cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), causal=True)
    out.backward(rnd(g, *out.shape))
    assert torch.all(k.grad[11:24] == 0) and torch.all(v.grad[11:24] == 0)
    assert k.grad[:11].abs().sum() > 0 and v.grad[24:].abs().sum() > 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # a batch with no query at all
    q0 = rnd(g, 2, 0, 4, 64).requires_grad_()
    k0, v0 = rnd(g, 2, 7, 4, 64).requires_grad_(), rnd(g, 2, 7, 4, 64).requires_grad_()
    out, lse = flash.attention(q0, k0, v0, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    out.sum().backward()
    assert torch.equal(k0.grad, torch.zeros_like(k0)) and torch.equal(v0.grad, torch.zeros_like(v0))


# --- paths that must agree bit for bit ------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_equals_contiguous_bitwise(page_size):
    g = gen(7)
    lq, lk = [5, 0, 31], [17, 9, 0 if page_size == 1 else 70]
    q, k, v = rnd(g, sum(lq), 4, 96), rnd(g, sum(lk), 2, 96), rnd(g, sum(lk), 2, 96)
    sinks = torch.randn(4, generator=g, device=DEV)
    want, want_lse = flash.attention(q, k, v, cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), causal=True, sinks=sinks,
                                     return_lse=True)
    pk = flash.paged_from_contiguous(k, v, cu(lk), page_size, generator=torch.Generator().manual_seed(page_size))
    assert torch.isnan(pk.k_cache).any()  # unused slots are NaN: reading one would show
    got, got_lse = flash.paged_attention(q, pk.k_cache, pk.v_cache, pk.kv_indptr, pk.kv_indices, pk.kv_last_page_len,
                                         causal=True, cu_seqlens_q=cu(lq), sinks=sinks, return_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    back_k, back_v, back_cu = flash.gather_paged_kv(pk.k_cache, pk.v_cache, pk.kv_indptr, pk.kv_indices,
                                                    pk.kv_last_page_len)
    assert torch.equal(back_k, k) and torch.equal(back_v, v) and torch.equal(back_cu, cu(lk))


def test_paged_batched_q_matches_reference():
    g = gen(8)
    q = rnd(g, 2, 12, 4, 64)
    k, v = rnd(g, 2 * 30, 1, 64), rnd(g, 2 * 30, 1, 64)
    pk = flash.paged_from_contiguous(k, v, cu([30, 30]), 16, generator=torch.Generator().manual_seed(0))
    out = flash.paged_attention(q, pk.k_cache, pk.v_cache, pk.kv_indptr, pk.kv_indices, pk.kv_last_page_len,
                                causal=True)
    ref, _ = flash.attention_reference(q, k.view(2, 30, 1, 64), v.view(2, 30, 1, 64), causal=True)
    low, _ = flash.attention_reference(q, k.view(2, 30, 1, 64), v.view(2, 30, 1, 64), causal=True, upcast=False)
    err, ref_err = (out.float() - ref).abs().max().item(), (low.float() - ref).abs().max().item()
    assert err <= 2 * ref_err + 2 * 2.0 ** -8


@pytest.mark.parametrize("sq, sk", [(23, 50), (130, 130)])
@pytest.mark.parametrize("hk", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_pack_gqa_on_off_agree(hk, sq, sk):
    """PackGQA changes which (position, head) rows share a tile, not any row's arithmetic: the same
    K/V tiles in the same order, and fully masked tiles add exactly 0 with alpha exactly 1. Compiled,
    the two agree bitwise; in the interpreter the dot products are numpy/BLAS calls whose summation
    order may depend on the tile's shape (seen on AMD EPYC: one ulp in one LSE element), so across
    different tilings only agreement to the rounding of fp32 is guaranteed. With one query head per
    KV head (MHA) PackGQA is a no-op, the tiles are the same, and the results must be bitwise equal.
    130x130 spans several packed row tiles on the causal diagonal, where a packed tile's key range
    must come from its query positions (row // group), not its packed rows."""
    g = gen(9)
    q, k, v = rnd(g, 2, sq, 4, 64), rnd(g, 2, sk, hk, 64), rnd(g, 2, sk, hk, 64)
    on = flash.attention(q, k, v, causal=True, pack_gqa=True, return_lse=True)
    off = flash.attention(q, k, v, causal=True, pack_gqa=False, return_lse=True)
    assert torch.isfinite(on[1]).all() and not on[0].isnan().any()
    if hk == q.shape[2]:
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
        return
    # lse: a few fp32 ulps of its magnitude. out: the kernel rounds P to bf16 before P @ V, so a
    # one-ulp fp32 difference in a score can move a P element by one bf16 ulp, and a small output (a
    # weighted mean of O(1) values that cancel) can then differ by several of its own ulps (seen: 1
    # element of 66,560, 7.6e-5 on an output of 3.4e-3). What the math guarantees is the book's rule:
    # each side within twice the bf16 reference's own error of the fp32 answer, plus bf16's rounding
    # floor. A wrong head or position mapping errs by O(0.1) and fails.
    lse_tol = 8 * torch.finfo(torch.float32).eps * float(off[1].abs().max())
    assert float((on[1] - off[1]).abs().max()) <= lse_tol
    gold, _ = flash.attention_reference(q, k, v, causal=True)
    low, _ = flash.attention_reference(q, k, v, causal=True, upcast=False)
    for side in (on[0], off[0]):
        check = within_reference_error(side, low, gold, q.dtype)
        assert check["passed"], check


# --- bad input is refused before any work -------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda g: dict(q=rnd(g, 1, 4, 2, 64, dtype=torch.float32)), "dtype"),
    (lambda g: dict(q=rnd(g, 1, 4, 3, 64)), "multiple of the KV heads"),
    (lambda g: dict(q=rnd(g, 1, 4, 2, 640), k=rnd(g, 1, 5, 2, 640), v=rnd(g, 1, 5, 2, 64)), "head dim 640"),
    (lambda g: dict(softmax_scale=-1.0), "softmax_scale"),
    (lambda g: dict(causal=1), "causal"),
    (lambda g: dict(sinks=torch.zeros(3, device=DEV)), "sinks"),
    (lambda g: dict(q=rnd(g, 4, 2, 64), k=rnd(g, 5, 2, 64), v=rnd(g, 5, 2, 64),
                    cu_seqlens_q=torch.tensor([0, 4], device=DEV), cu_seqlens_k=cu([5])), "int32"),
    (lambda g: dict(q=rnd(g, 4, 2, 64), k=rnd(g, 5, 2, 64), v=rnd(g, 5, 2, 64),
                    cu_seqlens_q=cu([3]), cu_seqlens_k=cu([5])), "packed length 4"),
    (lambda g: dict(backend="cuda"), "backend"),
])
def test_bad_input_is_a_clear_value_error(make, match):
    g = gen(10)
    args = dict(q=rnd(g, 1, 4, 2, 64), k=rnd(g, 1, 5, 2, 64), v=rnd(g, 1, 5, 2, 64))
    args.update(make(g))
    with pytest.raises(ValueError, match=match):
        flash.attention(**args)


def test_paged_bad_page_table_and_grad_refused():
    g = gen(11)
    q, k, v = rnd(g, 1, 4, 2, 64), rnd(g, 8, 2, 64), rnd(g, 8, 2, 64)
    pk = flash.paged_from_contiguous(k, v, cu([8]), 4)
    args = (q, pk.k_cache, pk.v_cache, pk.kv_indptr, pk.kv_indices, pk.kv_last_page_len)
    with pytest.raises(ValueError, match="kv_indices must lie"):
        flash.paged_attention(*args[:4], pk.kv_indices + 100, args[5])
    with pytest.raises(ValueError, match="kv_last_page_len"):
        flash.paged_attention(*args[:5], pk.kv_last_page_len + 4)
    with pytest.raises(ValueError, match="forward-only"):
        flash.paged_attention(q.requires_grad_(), *args[1:])


def test_torch_backend_is_the_reference():
    g = gen(12)
    q, k, v = rnd(g, 1, 6, 2, 64), rnd(g, 1, 9, 2, 64), rnd(g, 1, 9, 2, 64)
    out = flash.attention(q, k, v, backend="torch")
    ref, _ = flash.attention_reference(q, k, v)
    assert torch.equal(out, ref.to(q.dtype))


def test_d256_configs_per_target():
    # d 192/256: dQ takes two stages on NVIDIA (one spilled 8 B at d192 on sm_90/sm_100), AMD keeps one;
    # the sm_100 forward lifts ptxas's 128-register cap (`maxnreg`; it spilled 32 B), other targets don't
    from inferbook.device import building_for

    cpu = torch.device("cpu")
    for target, stages, maxnreg in (("sm_80", 2, None), ("sm_90", 2, None), ("sm_100", 2, 255), ("gfx942", 1, None)):
        with building_for(target):
            assert flash.block_config(cpu, 192, "dq")["num_stages"] == stages, target
            assert flash.block_config(cpu, 256, "fwd").get("maxnreg") == maxnreg, target
            assert flash.block_config(cpu, 128, "dq")["num_stages"] == 1
            assert "maxnreg" not in flash.block_config(cpu, 128, "fwd")


def test_softcap_backward_lifts_the_register_cap_on_sm100_only():
    from inferbook.device import building_for

    def regs(target, softcap):
        q = torch.zeros(1, 64, 2, 96)
        with building_for(target):
            las = flash.attention_launches(q, q, q, backward=True, softcap=softcap)
        return {la.name: la.kwargs.get("maxnreg") for la in las if la.name.startswith("bwd")}

    assert set(regs("sm_100", 30.0).values()) == {255}
    assert set(regs("sm_100", 0.0).values()) == {None} and set(regs("sm_90", 30.0).values()) == {None}


def test_register_heavy_features_take_smaller_nvidia_tiles_only():
    # paged KV / PackGQA / window / softcap spilled at the default tiles on NVIDIA (see `block_config`):
    # those launches take smaller tiles there; AMD and the feature-free launches keep the defaults
    from inferbook.device import building_for

    cpu = torch.device("cpu")

    def cfg(target, *args, **flags):
        with building_for(target):
            c = flash.block_config(cpu, *args, **flags)
        return c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]

    for target in ("sm_80", "sm_90", "sm_100"):
        assert cfg(target, 64, "fwd", paged=True) == (128, 32, 4) and cfg(target, 64, "fwd") == (128, 64, 4)
        assert cfg(target, 576, "fwd", 512, pack=True, window=True) == (16, 16, 4)
        assert cfg(target, 576, "fwd", 512, pack=True) == (32, 32, 8)
    for target in ("gfx942", "gfx950"):
        assert cfg(target, 64, "fwd", paged=True) == (128, 64, 4)
        assert cfg(target, 576, "fwd", 512, pack=True, window=True) == (32, 16, 4) == cfg(target, 576, "fwd", 512)
        # CDNA's own dK/dV: 128-row tiles on 4 waves, 32 keys under a causal mask or softcap
        assert cfg(target, 64, "dkdv") == (128, 64, 4) and cfg(target, 128, "dkdv", causal=True) == (128, 32, 4)
        assert cfg(target, 96, "dkdv", softcap=True) == (128, 32, 4) and cfg(target, 256, "dkdv") == (64, 32, 4)
        assert cfg(target, 128, "dq") == (128, 64, 4) and cfg(target, 256, "dq") == (32, 16, 2)
        with building_for(target):
            assert flash.block_config(cpu, 96, "fwd", pack=True)["num_stages"] == 1 == flash.block_config(cpu, 64, "fwd")["num_stages"]
            assert (flash.block_config(cpu, 256, "fwd")["num_warps"], flash.block_config(cpu, 192, "fwd")["num_stages"]) == (4, 1)
    assert all(cfg(t, 192, "dkdv") == (32, 64, 8) and cfg(t, 128, "dq") == (64, 32, 4) for t in ("sm_80", "sm_90", "sm_100"))
    assert cfg("sm_80", 128, "fwd", pack=True) == (64, 64, 8) and cfg("sm_90", 128, "fwd", pack=True) == (128, 64, 8)
    assert cfg("sm_80", 96, "fwd", 48, pack=True) == (128, 64, 8)
    assert cfg("sm_80", 64, "dkdv") == (32, 32, 8) and cfg("sm_90", 64, "dkdv") == (64, 64, 4)
    # d 192/256 dQ: 4 warps on NVIDIA, 64 rows on sm_90 (32 on 4 warps spilled there)
    assert cfg("sm_80", 256, "dq") == cfg("sm_100", 192, "dq") == (32, 16, 4) and cfg("sm_90", 256, "dq") == (64, 16, 4)
    # sm_90 d <= 128 dK/dV: one warpgroup of 64 rows (wgmma), except under softcap (it spilled there)
    assert cfg("sm_90", 128, "dkdv") == cfg("sm_90", 96, "dkdv", causal=True) == (64, 64, 4)
    assert cfg("sm_90", 96, "dkdv", softcap=True) == (32, 64, 8) and cfg("sm_80", 128, "dkdv") == (32, 64, 8)
    assert cfg("sm_100", 128, "dkdv", causal=True) == (32, 64, 4)
    assert cfg("sm_100", 128, "dkdv", causal=True, softcap=True) == (32, 64, 8) and cfg("sm_100", 128, "dkdv") == (32, 64, 8)
    # the interpreter's config is unchanged by the flags
    assert flash.block_config(cpu, 64, "fwd", paged=True, pack=True, window=True) == flash.block_config(cpu, 64, "fwd")
