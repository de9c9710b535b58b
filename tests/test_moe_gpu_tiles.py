"""The GPU's tile configurations, checked for correctness in the interpreter.

Interpreted runs choose small blocks (the interpreter's cost is per program and per op), so the
block constexprs a GPU runs would otherwise never be checked. Here every W4A16 kernel runs with
`block="gpu"`: the exact BLOCK_M/N/K (and warps, stages) of `linear_config`, `moe_config`,
`tail_config` and `combine_config` on CUDA, on small problems whose sizes are *not* multiples of
those tiles (masked tails in M, N and K). Results of different block shapes are not bitwise
comparable, so each case is held to the FlashAttention rule against the fp32 reference."""
import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on first)
from inferbook.moe import fused_moe as FM, mxfp4 as MXF, w4a16 as W

H, I = 160, 96  # K = 160 or 96: a partial last K tile at BLOCK_K 64 and 128


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


# M = 1 and 16 take the decode tile (16 x 32 x 256), 64 and 128 the larger ones.
LINEAR = [(layout, M) for layout in W.LAYOUTS for M in (1, 64)] + [("indexed", 16), ("grouped_contiguous", 128)]


@pytest.mark.parametrize("layout, M", LINEAR, ids=[f"{lay}-M{M}" for lay, M in LINEAR])
def test_linear_at_gpu_tiles(layout, M):
    g = torch.Generator().manual_seed(M)
    q = W.quantize(torch.randn(200, 544, generator=g) * 0.05, layout=layout)   # N 200, K 544 = 2 x 256 + 32
    x = torch.randn(M, 544, generator=g).bfloat16()
    cfg = W.linear_config(M, False)
    assert "num_warps" in cfg  # the CUDA config, not the interpreter's
    err, tol, ok = FM.within_tolerance(W.linear(x, q, block="gpu"), W.linear_reference(x, q), W.linear_torch(x, q))
    assert ok, (cfg, err, tol)


# rows per expert T*k/E = 5 (16x32x128), 50 (64x64x64), 100 (128x64x64, 8 warps, 3 stages)
MOE = [(layout, 20) for layout in W.LAYOUTS] + [("indexed", 200), ("grouped_contiguous", 400), ("grouped_masked", 200)]


@pytest.mark.parametrize("layout, T", MOE, ids=[f"{lay}-T{T}" for lay, T in MOE])
def test_fused_moe_at_gpu_tiles(layout, T):
    E, k = 8, 2
    g = torch.Generator().manual_seed(T)
    w13 = W.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.05, layout=layout)
    w2 = W.quantize(torch.randn(E, H, I, generator=g) * 0.05, layout=layout)
    x = torch.randn(T, H, generator=g).bfloat16()
    tw, ids = _routing(T, E, k, T + 1)
    cfg = FM.moe_config(T * k / E, False)
    out = FM.fused_moe(x, w13, w2, tw, ids, block="gpu")
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (cfg, err, tol)


@pytest.mark.parametrize("fmt", ["bf16", "w4a16", "mxfp4"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_tail_at_gpu_tiles(fmt, fused):
    T, k, E, Hd, Id = 5, 3, 6, 200, 288
    g = torch.Generator().manual_seed(7)
    w = torch.randn(E, Hd, Id, generator=g) * 0.05
    w2 = {"bf16": w.bfloat16(), "w4a16": W.quantize(w), "mxfp4": MXF.quantize(w)}[fmt]
    act = torch.randn(T * k, Id, generator=g).bfloat16()
    tw, ids = _routing(T, E, k, 3)
    out, _, _ = FM.moe_tail(act, w2, tw, ids, fused=fused, block="gpu")
    ref = FM.moe_tail_reference(act, w2, tw, ids)
    err, tol, ok = FM.within_tolerance(out, ref, FM.moe_tail_torch(act, w2, tw, ids, fused=False))
    assert ok, (err, tol)
