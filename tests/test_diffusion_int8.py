"""The H3 decoder's INT8 kernels against fp32: each within FlashAttention's rule of the PyTorch INT8 reference's
own error (the quantization error is the reference's; the kernel may add rounding, not more), and a kernel
broken on purpose fails the same check."""
import math

import pytest
import torch

import inferbook.device  # noqa: F401  (interpreter on a CPU)
from inferbook.diffusion import int8 as I
from inferbook.diffusion.fused import fa_rule_check

LINEAR = [  # M, K, N, act, residual, dtype
    (1, 64, 48, "none", False, torch.float32),          # one token: a GEMV
    (37, 96, 80, "rms_norm", True, torch.float32),      # odd M and N: masked tiles; qkv / w1 form
    (37, 96, 80, "rms_norm", True, torch.bfloat16),
    (20, 72, 56, "swiglu", True, torch.float32),        # w2 form: SwiGLU in, addcmul out
    (33, 40, 24, "swiglu", False, torch.bfloat16),
    (70, 64, 130, "none", True, torch.float32),         # to_out form
]
ATTENTION = [(1, 5, 2, 24, torch.float32), (2, 21, 2, 32, torch.float32), (1, 37, 1, 64, torch.bfloat16),
             (1, 70, 1, 48, torch.float32)]


def linear_case(M, K, N, act, residual, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    Kx = 2 * K if act == "swiglu" else K
    x = torch.randn(M, Kx, generator=g)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    b = 0.02 * torch.randn(N, generator=g)
    gain = 1 + 0.1 * torch.randn(K, generator=g)
    r = torch.randn(M, N, generator=g) if residual else None
    rs = 0.5 + 0.1 * torch.randn(N, generator=g) if residual else None
    ref = torch.nn.functional.linear(I.input_act_eager(x, act, gain, 1e-6), w, b)
    if residual:
        ref = torch.addcmul(r, ref, rs)
    wq, ws = I.quantize_rows(w)
    kw = dict(act=act, norm_weight=gain.to(dtype), eps=1e-6, residual=None if r is None else r.to(dtype),
              residual_scale=None if rs is None else rs.to(dtype))
    return x.to(dtype), wq, ws.view(-1), b.to(dtype), kw, ref


@pytest.mark.parametrize("case", LINEAR, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{c[3]}-{'res' if c[4] else 'plain'}-"
                                                      f"{str(c[5])[6:]}")
def test_int8_linear_kernel_vs_fp32(case):
    x, wq, ws, b, kw, ref = linear_case(*case, seed=sum(case[:3]))
    eager, how_e = I.int8_linear_eager(x, wq, ws, b, **kw)
    out, how = I.int8_linear_triton(x, wq, ws, b, **kw)
    assert how == I.TRITON_INT8_GEMM and how_e == I.INT8_GEMM
    rule = fa_rule_check(out, eager, ref)
    assert rule["passed"], rule
    broken, _ = I.int8_linear_triton(x, wq, ws * 1.1, b, **kw)       # a 10 % wrong weight scale
    assert not fa_rule_check(broken, eager, ref)["passed"]


@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: f"B{c[0]}-S{c[1]}-H{c[2]}-D{c[3]}-{str(c[4])[6:]}")
def test_int8_attention_kernel_vs_fp32(case):
    B, S, H, D, dtype = case
    g = torch.Generator().manual_seed(S + D)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    eager, _ = I.int8_attention_eager(q, k, v)
    out, how = I.int8_attention_triton(q, k, v)
    assert how == I.TRITON_INT8_ATTENTION and out.shape == (B, S, H, D) and out.is_contiguous()
    rule = fa_rule_check(out, eager, ref)
    assert rule["passed"], rule
    broken, _ = I.int8_attention_triton(q, k, v, sm_scale=1.2 / math.sqrt(D))   # a wrong softmax scale
    assert not fa_rule_check(broken, eager, ref)["passed"]


def test_quantized_rows_match_the_reference():
    g = torch.Generator().manual_seed(3)
    for act, width in (("none", 90), ("rms_norm", 90), ("swiglu", 180)):
        x = torch.randn(29, width, generator=g) * torch.logspace(-3, 2, 29)[:, None]   # rows of every scale
        gain = 1 + 0.1 * torch.randn(90, generator=g)
        q, s = I.quantize_act_triton(x, act, gain, 1e-6)
        qr, sr = I.quantize_rows(I.input_act_eager(x, act, gain, 1e-6))
        assert (q.int() - qr.int()).abs().max() <= 1                  # ties may round the other way
        assert torch.allclose(s, sr.view(-1), rtol=1e-5)


def test_int8_config_per_shape():
    assert I.gemm_config(16, 4096, "cuda")["BLOCK_M"] == 32               # decode-sized M: short tiles
    assert I.gemm_config(8192, 6144, "cuda")["BLOCK_N"] == 128            # large: 128 x 128
    assert I.gemm_config(1000, 2048, "cuda") == I.INT8_GEMM_CONFIGS["default"]
