"""MXFP4 experts in the decode tail: packing of numerics.mx's e2m1 object (4.25 bits per weight),
the kernel's in-register decode bit for bit against numerics.mx.dequantize, and the folded combine
equal to the separate pass (fp32 intermediate) bit for bit, both within FlashAttention-style
tolerance of the fp32 reference on the dequantized weights."""
import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on first)
import triton
import triton.language as tl
from inferbook.moe import fused_moe as FM, mxfp4 as MXF
from inferbook.numerics import mx as MX


def _routing(T, E, k, seed, dead=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(dead)] = -1e4          # experts that receive no tokens
    w, ids = logits.softmax(-1).topk(k)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


def test_packing_is_numerics_mx_and_4_25_bits():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * 0.05
    w[1, 2, 32:64] = 0.0              # an all-zero block: E8M0 byte 0
    w[2, 5, 7] = 3.0                  # an outlier: its block saturates under the floor rule
    p = MXF.quantize(w)
    m = MX.quantize(w, "e2m1", axis=-1, block=32, scale_rounding="floor")
    assert p.qweight.dtype == torch.uint8 and p.qweight.shape == (3, 40, 48) and p.scales.shape == (3, 40, 3)
    back = MXF.unpack(p)
    assert torch.equal(back.elements, m.elements) and torch.equal(back.scales, m.scales)
    assert int(p.scales[1, 2, 1]) == 0
    assert torch.equal(MXF.dequantize(p), MX.dequantize(m))
    assert MXF.dequantize(p, torch.bfloat16).float().equal(MX.dequantize(m))   # exact in BF16 too
    assert p.nbytes == 3 * MXF.weight_bytes(40, 96) and p.nbytes * 8 / w.numel() == pytest.approx(4.25)
    with pytest.raises(ValueError, match="multiple of 32"):
        MXF.quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="e2m1"):
        MXF.pack(MX.quantize(torch.randn(4, 64), "e4m3"))


@triton.jit
def _tile_kernel(qw_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    t = MXF.mxfp4_tile(qw_ptr, s_ptr, 0, offs_n, N, K, BLOCK_K, True)
    tl.store(out_ptr + offs_k[:, None] * BLOCK_N + offs_n[None, :], t)


def test_tile_decoder_fp32_every_code_and_scale_byte():
    """The decoder alone, in fp32: all 16 codes under every E8M0 byte quantize can make, 0..252
    (byte 0 is the fp32 subnormal 2**-127), and 255 (NaN), bit for bit (NaN where numerics.mx has
    NaN; N = 254 leaves a partial column block). Through the full tail
    the interpreter's fp32 -> BF16 cast loses fp32 subnormals; quantize only makes byte 0 for
    all-zero blocks, whose values are 0 either way."""
    N, K = 254, 32
    codes = (torch.arange(K, dtype=torch.uint8) % 16).repeat(N, 1)
    scales = torch.tensor(list(range(253)) + [255], dtype=torch.uint8)[:, None]
    p = MXF.pack(MX.MXTensor(codes, scales, "e2m1", 1, 32, "floor"))
    out = torch.empty(K, 256)
    _tile_kernel[(1,)](p.qweight, p.scales, out, N, K, BLOCK_N=256, BLOCK_K=K)
    assert (out[:, N:] == 0).all()
    out = out[:, :N]
    want = MX.dequantize(MXF.unpack(p)).T
    assert torch.equal(out.isnan(), want.isnan()) and int(want.isnan().sum()) == K
    keep = ~want.isnan()
    assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32))   # -0.0 included


def test_in_kernel_decode_is_bitwise_numerics_mx():
    """Every e2m1 code under a range of E8M0 scales (and an all-zero block, byte 0): with one-hot
    activations, k = 1 and weight 1, the tail's output row t is column t of the weight, exactly."""
    E, H, I = 3, 37, 64                 # odd H: a partial column block
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (E, H, I), generator=g, dtype=torch.uint8)
    codes[0, 0, :16] = torch.arange(16, dtype=torch.uint8)
    scales = torch.randint(100, 150, (E, H, I // 32), generator=g, dtype=torch.uint8)
    codes[2, 3, 32:] = 0                # an all-zero block, as quantize stores it: byte 0
    scales[2, 3, 1] = 0
    p = MXF.pack(MX.MXTensor(codes, scales, "e2m1", 2, 32, "floor"))
    W2 = MX.dequantize(MXF.unpack(p))
    T = I
    ids = (torch.arange(T) % E).to(torch.int32)[:, None]
    tw = torch.ones(T, 1)
    act = torch.eye(I).bfloat16()
    want = W2[ids[:, 0].long(), :, torch.arange(T)]          # [T, H]
    for fused in (True, False):
        out, _, _ = FM.moe_tail(act, p, tw, ids, fused=fused, inter_dtype=torch.float32)
        assert torch.equal(out.float(), want), float((out.float() - want).abs().max())


@pytest.mark.parametrize("H, T, dead", [(64, 1, ()), (64, 7, ()), (37, 5, (0, 3, 9))],
                         ids=["H64-T1", "H64-T7", "oddH37-T5-dead-experts"])
def test_mxfp4_tail_fusion_equals_separate_combine(H, T, dead):
    E, k, I = 16, 8 if not dead else 4, 32
    g = torch.Generator().manual_seed(T + H)
    w2 = MXF.quantize(torch.randn(E, H, I, generator=g) * 0.1)
    tw, ids = _routing(T, E, k, 9 + T, dead)
    assert not any(int((ids == d).sum()) for d in dead)
    act = torch.randn(T * k, I, generator=g).bfloat16()
    fused, launches_f, buf_f = FM.moe_tail(act, w2, tw, ids, fused=True)
    sep32, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32)
    sep16, launches_s, buf_s = FM.moe_tail(act, w2, tw, ids, fused=False)
    assert fused.shape == (T, H) and fused.dtype == torch.bfloat16
    ok, worst = FM.reorder_bound(fused, sep32, act, w2, tw, ids)  # same terms, summed in another order
    assert ok, worst
    assert buf_f == {"rows": 0, "accumulator": T * H * 4} and buf_s == {"rows": T * k * H * 2, "accumulator": 0}
    tm_f, _, _ = FM.moe_tail(act, w2, tw, ids, fused=True, kernel="token-major")
    tm_s, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32, kernel="token-major")
    assert torch.equal(tm_f, tm_s)       # token-major: same products, same order, one rounding
    ref = FM.moe_tail_reference(act, w2, tw, ids)          # fp32 on numerics.mx.dequantize's weights
    pt = FM.moe_tail_torch(act, w2, tw, ids)
    for out in (fused, sep16):
        err, tol, ok = FM.within_tolerance(out, ref, pt)
        assert ok, (err, tol)
    _, _, ok = FM.within_tolerance(FM.moe_tail(act, w2, tw, ids.flip(1), fused=True)[0], ref, pt)
    assert not ok                        # the check can fail: weights paired with the wrong experts
