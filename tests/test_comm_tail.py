"""The MoE tail: fused pass == unfused chain in bits; the naive fp32 fusion differs; the Triton
chain equals the PyTorch specification (bits for the residual stream, <= 1 ulp for the RMSNorm
output, whose fp32 sum of squares may be added in another order)."""
import pytest
import torch

import inferbook  # noqa: F401  (Triton interpreter on CPU)
from inferbook.comm import tail
from inferbook.errors import UserError

CASES = [  # ranks, tokens, hidden, topk per rank, dtype
    (2, 5, 96, 2, torch.bfloat16),
    (4, 3, 130, 1, torch.bfloat16),    # hidden not a power of two: masked lanes
    (3, 2, 7, 3, torch.float16),
    (1, 2, 64, 2, torch.bfloat16),
    (2, 2, 64, 2, torch.float32),
    (2, 0, 32, 2, torch.bfloat16),     # no tokens
]


def _ids(c):
    return f"N{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{str(c[4])[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fused_equals_unfused_in_bits_and_reference(case):
    N, T, H, K, dt = case
    g = torch.Generator().manual_seed(sum(map(ord, _ids(case))))
    inp = tail.make_tail_inputs(N, T, H, K, dt, generator=g)
    fused, unfused, ref = (tail.run_tail(inp, v) for v in ("fused", "unfused", "reference"))
    for f, u, r in zip(fused, unfused, ref):
        assert f.shape == (T, H) and f.dtype == dt
        assert not f.isnan().any() and not r.isnan().any()
        assert not tail.bits_differ(f, u).any()
    assert not tail.bits_differ(unfused[1], ref[1]).any(), "residual stream must equal the specification"
    if T:  # the RMSNorm's fp32 sum of squares may differ in order: 1 ulp after rounding, a few in fp32
        assert int(tail.ulp_distance(unfused[0], ref[0]).max()) <= (4 if dt == torch.float32 else 1)


def test_naive_fusion_differs_so_the_check_can_fail():
    inp = tail.make_tail_inputs(4, 6, 256, 2, torch.bfloat16, generator=torch.Generator().manual_seed(5))
    naive, unfused = tail.run_tail(inp, "naive"), tail.run_tail(inp, "unfused")
    assert tail.bits_differ(naive[0], unfused[0]).sum() > 0
    assert tail.bits_differ(naive[1], unfused[1]).sum() > 0
    # and the naive kernel is itself right: it equals its own fp32 specification
    parts = torch.stack([tail.finalize_reference(inp["expert_out"][r], inp["topk_weights"][r], torch.float32)
                         for r in range(4)])
    ref = tail.naive_tail_reference(parts, inp["shared"], inp["residual"], inp["norm_weight"])
    assert not tail.bits_differ(naive[1], ref[1]).any()
    assert int(tail.ulp_distance(naive[0], ref[0]).max()) <= 1


def test_bf16_rounding_is_nearest_even_like_pytorch():
    """The interpreter truncates fp32 -> bf16; the kernels' rounding must not."""
    base = torch.randn(500, generator=torch.Generator().manual_seed(1))
    halfway = (torch.arange(1, 65, dtype=torch.float32) + 0.5).bfloat16().float()  # exact bf16 values
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895314e38, 3.4e38, 1e-40, -0.0,
                         float("inf"), float("-inf")])
    x = torch.cat([base, halfway, ties])[None, None, :]          # one token, one slot: 1 program
    y = tail.finalize(x, torch.ones(1, 1), out_dtype=torch.bfloat16)[0]
    ref = tail.finalize_reference(x, torch.ones(1, 1), out_dtype=torch.bfloat16)[0]
    assert not tail.bits_differ(y, ref).any()
    x = x[0, 0]
    same = x != 0  # the finalize's accumulator starts at +0.0, so -0.0 becomes +0.0 in both
    assert not tail.bits_differ(y[same], x[same].bfloat16()).any()


def test_non_contiguous_inputs():
    N, T, H = 2, 3, 40
    inp = tail.make_tail_inputs(N, T, H, 2, generator=torch.Generator().manual_seed(2))
    parts = torch.stack([tail.finalize(inp["expert_out"][r], inp["topk_weights"][r]) for r in range(N)])
    shared_t = inp["shared"].t().contiguous().t()  # same values, transposed strides
    assert not shared_t.is_contiguous()
    a = tail.fused_tail(parts, shared_t, inp["residual"], inp["norm_weight"])
    b = tail.tail_reference(parts, inp["shared"], inp["residual"], inp["norm_weight"])
    assert not tail.bits_differ(a[1], b[1]).any()


def test_bytes_fused_less_than_unfused():
    b = tail.tail_bytes(4, 16, 7168, 2)
    assert b["fused"] < b["unfused"] and b["unfused"] - b["fused"] == 5 * 16 * 7168 * 2


@pytest.mark.parametrize("bad, match", [
    (dict(partials=torch.zeros(3, 4)), "3-D"),
    (dict(shared=torch.zeros(2, 5, dtype=torch.bfloat16)), "shared must have shape"),
    (dict(norm_weight=torch.zeros(9, dtype=torch.bfloat16)), "norm_weight must have shape"),
    (dict(residual=torch.zeros(2, 8, dtype=torch.float16)), "residual dtype"),
    (dict(eps=0.0), "eps"),
    (dict(partials=torch.zeros(2, 2, 8, dtype=torch.int32)), "not supported"),
])
def test_bad_input_is_named(bad, match):
    args = dict(partials=torch.zeros(2, 2, 8, dtype=torch.bfloat16), shared=torch.zeros(2, 8, dtype=torch.bfloat16),
                residual=torch.zeros(2, 8, dtype=torch.bfloat16), norm_weight=torch.ones(8, dtype=torch.bfloat16),
                eps=1e-6)
    args.update(bad)
    with pytest.raises(UserError, match=match):
        tail.fused_tail(**args)


def test_bad_finalize_and_variant():
    with pytest.raises(UserError, match="topk_weights must be float32"):
        tail.finalize(torch.zeros(2, 2, 4), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(UserError, match="variant"):
        tail.run_tail({}, "fast")
    with pytest.raises(UserError, match="backend"):
        tail.select_backend(torch.device("cpu"), "cuda")


@pytest.mark.parametrize("tokens,hidden", [(1, 7168), (4, 7168), (16, 4096), (256, 7168)])
def test_elementwise_kernels_split_rows_at_small_t(tokens, hidden):
    """At decode the finalize, rank sum and adds spread a row over CTAs (T x slices >= 132 where the
    row is long enough); RMSNorm and the fused pass keep one CTA per row."""
    from inferbook.comm import tail as TL

    las = TL.tail_launches(8, tokens, hidden, 4)
    split = [la for la in las if la.kernel in (TL._finalize_kernel, TL._allreduce_sum_kernel, TL._add_kernel)]
    assert split and all(la.grid[0] == tokens for la in split)
    ctas = split[0].grid[0] * split[0].grid[1]
    assert ctas >= min(TL.TARGET_CTAS, tokens * -(-hidden // TL.MIN_SPLIT_BLOCK))
    assert all(la.grid[1] * la.kwargs["BLOCK_H"] >= hidden for la in split)
    assert all(la.grid == (tokens,) for la in las if la.kernel in (TL._rmsnorm_kernel, TL._fused_tail_kernel))
