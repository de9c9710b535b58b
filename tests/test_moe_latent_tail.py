"""K3's latent MoE tail with the finalize separate, in an atomic epilogue, or deferred into the
collective (vLLM #53152): deferred == separate bit for bit, every variant near the fp32 reference,
launches and bytes counted per launch, and a check that fails when the finalize is wrong."""
import dataclasses

import pytest
import torch

from inferbook.moe import fused_moe as FM, latent_tail as LT


def _err(a, b):
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("ranks,tokens,top_k", [(1, 1, 4), (2, 3, 4), (3, 2, 1)], ids=lambda v: str(v))
def test_variants_against_the_reference(fmt, ranks, tokens, top_k):
    x = LT.make_inputs(ranks, tokens, 80, 48, 8, top_k, 64 * ranks, fmt=fmt, seed=ranks * 10 + tokens)
    ref = LT.latent_tail_reference(x)
    torch_err = _err(LT.latent_tail_torch(x), ref)
    outs = {v: LT.run_tail(x, v)[0] for v in LT.VARIANTS}
    for v, out in outs.items():
        assert torch.isfinite(out.float()).all()
        # the BF16 rounding points bound the error: 2x the PyTorch path's own error (+ one BF16 ulp)
        assert _err(out, ref) <= 2 * torch_err + 2 ** -7 * float(ref.float().abs().max()), v
    # the same arithmetic in the same order: the same bits
    assert torch.equal(outs["deferred"], outs["separate"])


def test_launch_counts_and_buffers():
    x = LT.make_inputs(2, 2, 64, 32, 8, 4, 64, seed=3)
    n = {}
    for v in LT.VARIANTS:
        _, names, buffers = LT.run_tail(x, v)
        n[v] = len(names) - (2 - 1)            # GEMM2 runs once per rank in this one process
        assert n[v] == len(LT.LAUNCHES[v])
        if v == "deferred":
            assert "partial" not in buffers     # the [T, L] round trip is gone
    assert n == {"separate": 4, "atomic": 5, "deferred": 3}


@pytest.mark.parametrize("T", [1, 8, 32])
def test_deferred_moves_fewer_bytes_at_k3_shapes(T):
    E, k, L, H, I, N = 896, 16, 3584, 7168, 256, 8
    counts = [T * k // E + (1 if e < T * k % E else 0) for e in range(E)]
    cost = {v: LT.tail_costs(T, k, E, L, H, I, N, "mxfp4", v, counts, 16) for v in LT.VARIANTS}
    total = {v: sum(c["read"] + c["written"] for c in cs) for v, cs in cost.items()}
    assert len(cost["deferred"]) < len(cost["separate"]) < len(cost["atomic"])
    assert total["deferred"] < total["separate"]
    # the saving is exactly the finalized [T, L] BF16 tensor's write and re-read (the collective reads the
    # rank's own rows and N - 1 partials instead of the finalize reading the rows and it reading N partials)
    assert total["separate"] - total["deferred"] == 2 * T * L * 2


def test_the_check_catches_a_wrong_finalize():
    """Swap two slots' router weights for the deferred run only: the tolerance check the chapter asserts
    (FlashAttention's rule against the fp32 gold, the separate path as the reference) fails, and so
    does bit equality; the right deferred run passes it."""
    from inferbook import tolerance

    x = LT.make_inputs(2, 3, 64, 32, 8, 4, 64, seed=5)
    sep = LT.run_tail(x, "separate")[0]
    gold = LT.latent_tail_reference(x, None)
    assert gold.dtype == torch.float32
    good = tolerance.within_reference_error(LT.run_tail(x, "deferred")[0], sep, gold, torch.bfloat16)
    assert good["passed"], good
    bad = dataclasses.replace(x, topk_weights=x.topk_weights[:, [1, 0, 2, 3]].contiguous())
    wrong = LT.run_tail(bad, "deferred")[0]
    assert not torch.equal(wrong, sep)
    res = tolerance.within_reference_error(wrong, sep, gold, torch.bfloat16)
    assert not res["passed"], res


def test_gpu_launches_build_at_k3_shapes():
    for v in LT.VARIANTS:
        las = LT.tail_launches(8, 16, 896, 3584, 7168, 256, 8, "mxfp4", v)
        assert len(las) == len([n for n in LT.LAUNCHES[v] if not n.startswith(("zero", "cast"))])


@pytest.mark.parametrize("fmt", ["mxfp4", "w4a16", "w4a16 swap-AB"])
@pytest.mark.parametrize("ranks,tokens,top_k", [(1, 1, 4), (2, 3, 4), (3, 2, 1)], ids=lambda v: str(v))
def test_decode_gemm2_variants_against_the_reference(fmt, ranks, tokens, top_k):
    # GEMM2 on the decode loop (weights repacked at load time): rows written at their sorted positions, or
    # weighted and added atomically; the finalize placements agree as with the tl.dot GEMM2. "swap-AB": B200's
    # W4A16 tiles (8-slot row blocks, the transposed epilogue), run here in the interpreter
    block = FM.DECODE_TAIL_NVIDIA["sm_100"] if fmt.endswith("swap-AB") else None
    x = LT.make_inputs(ranks, tokens, 80, 48, 8, top_k, 64 * ranks, fmt=fmt.split()[0], seed=ranks * 10 + tokens,
                       gemm2="decode")
    assert FM.is_decode_packed(x.w2[0])
    ref = LT.latent_tail_reference(x)
    torch_err = _err(LT.latent_tail_torch(x), ref)
    outs = {}
    for v in LT.VARIANTS:
        outs[v], names, _ = LT.run_tail(x, v, block=block)
        assert any(n.startswith("latent GEMM2 decode") for n in names), names
        assert _err(outs[v], ref) <= 2 * torch_err + 2 ** -7 * float(ref.float().abs().max()), v
    assert torch.equal(outs["deferred"], outs["separate"])


def test_decode_gemm2_launches_and_bad_input():
    las = LT.tail_launches(8, 16, 896, 3584, 7168, 256, 8, "mxfp4", "deferred", gemm2="decode")
    g2 = las[0]
    assert g2.kernel is FM.moe_decode_tail_kernel and g2.kwargs["OUT_SORTED"] and not g2.kwargs["ROW_WEIGHT"]
    assert g2.grid[1] == 8 * 16                # a 16-row block a slot at most, 128 slots (vLLM's cap)
    at = LT.tail_launches(8, 16, 896, 3584, 7168, 256, 8, "mxfp4", "atomic", gemm2="decode")[0]
    assert at.kwargs["ATOMIC"] and "ROW_WEIGHT" not in at.kwargs and "OUT_SORTED" not in at.kwargs
    with pytest.raises(ValueError, match="gemm2"):
        LT.make_inputs(1, 1, 64, 32, 8, 2, 64, fmt="bf16", gemm2="decode")
    with pytest.raises(ValueError, match="decode kernels read"):
        LT.tail_launches(1, 2, 8, 64, 32, 64, 1, "bf16", "atomic", gemm2="decode")
