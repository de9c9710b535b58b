"""The block-scaled MX GEMM (`mx.mx_gemm`, `tl.dot_scaled` on a GPU; the interpreter decodes the same
bits in integer ops) against dequantize-then-matmul, with a bound from fp32 summation only."""
import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on first)
from inferbook.numerics import mx


def _bound(a, b):
    # products of decoded values are exact in fp32 (<= 8-bit significands); only the K-term fp32 sum rounds
    mag = mx.dequantize(a).abs().double() @ mx.dequantize(b).abs().double().T
    return (a.elements.shape[1] * 2.0 ** -24 * mag).float() + 1e-30


@pytest.mark.parametrize("fa, fb", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_mx_gemm_matches_dequantize_then_matmul(fa, fb):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=g) * 3
    w = torch.randn(45, 128, generator=g) * 0.02
    x[0, :32] = 0.0                    # an all-zero block: scale byte 0 (2**-127)
    w[1, 32:64] *= 1e-30               # tiny block: subnormal codes
    a, b = mx.quantize(x, fa), mx.quantize(w, fb)
    c, ref = mx.mx_gemm(a, b), mx.mx_gemm_reference(a, b)
    assert c.shape == (37, 45) and torch.isfinite(c).all()
    assert ((c - ref).abs() <= _bound(a, b)).all()


def test_mx_gemm_nan_block_and_gpu_tiles():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 128, generator=g)
    x[3, 70] = float("nan")            # its block's scale is 0xFF: the whole row of C is NaN
    a, b = mx.quantize(x, "e4m3"), mx.quantize(torch.randn(8, 128, generator=g), "e4m3")
    c = mx.mx_gemm(a, b, block=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128))
    assert torch.isnan(c[3]).all() and torch.isfinite(c[torch.arange(16) != 3]).all()
    assert mx.mx_gemm_config(False)["BLOCK_K"] == 128


def test_mx_gemm_can_fail_and_refuses_bad_input():
    g = torch.Generator().manual_seed(2)
    a = mx.quantize(torch.randn(32, 128, generator=g), "e4m3")
    b = mx.quantize(torch.randn(32, 128, generator=g), "e4m3")
    bad = mx.MXTensor(b.elements, torch.flip(b.scales, (1,)), b.fmt, b.axis, b.block, b.scale_rounding)  # planted
    assert not ((mx.mx_gemm(a, bad) - mx.mx_gemm_reference(a, b)).abs() <= _bound(a, b)).all()
    with pytest.raises(ValueError, match="takes e4m3, e5m2"):
        mx.mx_gemm(mx.quantize(torch.randn(32, 128), "e2m1"), b)
    with pytest.raises(ValueError, match="last axis"):
        mx.mx_gemm(mx.quantize(torch.randn(128, 32), "e4m3", axis=0), b)
    with pytest.raises(ValueError, match="K = 96"):
        mx.mx_gemm(a, mx.quantize(torch.randn(32, 96), "e4m3"))


def test_mx_gemm_sm80_tile_is_its_own_and_correct():
    # sm_80 decodes both operands in registers: its config takes 32-wide K steps (128 spilled 36 KB);
    # the other targets keep 128. The sm_80 tile, run in the interpreter, still matches the reference
    # across several K steps and a masked M/N edge.
    from inferbook.device import building_for

    with building_for("sm_100"):
        assert mx.mx_gemm_config(False)["BLOCK_K"] == 128
    with building_for("sm_80"):
        cfg = mx.mx_gemm_config(False)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 128, 32)
        (la,) = mx.mx_gemm_launches(256, 256, 256)
        assert la.kwargs["BLOCK_K"] == 32
    g = torch.Generator().manual_seed(3)
    a = mx.quantize(torch.randn(20, 96, generator=g), "e4m3")
    b = mx.quantize(torch.randn(12, 96, generator=g), "e5m2")
    c = mx.mx_gemm(a, b, block=dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=cfg["BLOCK_K"]))
    assert ((c - mx.mx_gemm_reference(a, b)).abs() <= _bound(a, b)).all()


def test_mx_gemm_sm90_tile_is_its_own_and_correct():
    # sm_90 (no block-scaled MMA: the codes are decoded to bf16 before the wgmma) takes 128 x 256 x 64; run in
    # the interpreter at that tile, two K steps and masked M and N edges match the reference
    from inferbook.device import building_for

    with building_for("sm_90"):
        cfg = mx.mx_gemm_config(False)
        (la,) = mx.mx_gemm_launches(256, 512, 256)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == (128, 256, 64, 8)
    assert la.kwargs["BLOCK_N"] == 256 and la.grid[0] * la.grid[1] == 2 * 2
    g = torch.Generator().manual_seed(4)
    a = mx.quantize(torch.randn(130, 128, generator=g), "e4m3")
    b = mx.quantize(torch.randn(260, 128, generator=g), "e4m3")
    c = mx.mx_gemm(a, b, block=dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64))
    assert c.shape == (130, 260) and ((c - mx.mx_gemm_reference(a, b)).abs() <= _bound(a, b)).all()
