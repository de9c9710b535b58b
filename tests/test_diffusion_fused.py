"""Fused VAE ops vs eager vs float64: the matrix, the linear interface, fallbacks, gates, bytes model."""

import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on where there is no GPU)
from inferbook.diffusion import fused as F_
from inferbook.chapters.h3_vae_fusion import check_fp16_gate, check_op, relative_check

DEV = "cuda" if torch.cuda.is_available() else "cpu"

MATRIX = [
    # op, norm, shape [B, C, T, H, W], dtype, non-contiguous, input scale
    ("norm_silu_pad", "rms", (1, 40, 1, 5, 7), torch.float32, False, 1.0),        # T=1, C % 32 != 0, odd H/W
    ("norm_silu_pad", "rms", (2, 33, 4, 3, 9), torch.bfloat16, False, 1.0),       # T > kernel, odd C
    ("norm_silu_pad", "rms", (1, 24, 3, 6, 5), torch.float32, True, 1.0),         # strided input
    ("norm_silu_pad", "group", (1, 64, 4, 3, 5), torch.float32, False, 1.0),
    ("norm_silu_pad", "group", (2, 32, 1, 5, 3), torch.bfloat16, False, 1.0),
    ("norm_silu_pad", "rms", (1, 16, 2, 3, 3), torch.float32, False, 1e4),        # extreme magnitude
    ("add_norm_silu_pad", "rms", (1, 40, 4, 5, 3), torch.float32, False, 1.0),
    ("add_norm_silu_pad", "rms", (1, 72, 1, 3, 7), torch.bfloat16, True, 1.0),
    ("add_norm_silu_pad", "group", (1, 64, 4, 3, 5), torch.float32, False, 1e3),  # large mean: Welford stats
    ("add_norm_silu_pad", "group", (1, 32, 3, 5, 5), torch.bfloat16, False, 1.0),
]


@pytest.mark.parametrize("op,norm,shape,dtype,noncontig,scale", MATRIX,
                         ids=[f"{m[0]}-{m[1]}-{'x'.join(map(str, m[2]))}-{str(m[3])[6:]}{'-strided' if m[4] else ''}"
                              f"-s{m[5]:g}" for m in MATRIX])
def test_fused_op_matrix(op, norm, shape, dtype, noncontig, scale):
    res = check_op(op, norm, shape, dtype, seed=hash((op, norm, shape)) % 1000, noncontig=noncontig, scale=scale,
                   device=DEV)
    assert res["passed"], res
    assert res["error"] == res["error"]  # not NaN


def test_relative_check_rejects_nan_and_large_error():
    ref = torch.randn(4, 5, dtype=torch.float64)
    eager = ref.float()
    bad = eager.clone()
    bad[0, 0] = float("nan")
    assert not relative_check(bad, eager, ref)["passed"]
    assert not relative_check(eager + 1e-2, eager, ref)["passed"]
    assert relative_check(eager, eager, ref)["passed"]


def test_padding_is_causal_and_zero():
    x = torch.randn(1, 8, 3, 4, 5, device=DEV)
    n = F_.Norm("rms", torch.ones(8, device=DEV), None)
    out = F_.norm_silu_pad_triton(x, n, (2, 1, 1))
    assert out.shape == (1, 8, 5, 6, 7)
    assert out[:, :, :2].abs().max() == 0  # two past frames, no future frame
    assert out[:, :, :, 0].abs().max() == 0 and out[:, :, :, -1].abs().max() == 0
    assert out[..., 0].abs().max() == 0 and out[..., -1].abs().max() == 0


LINEAR = [  # M rows, K, N, dtype, rmsnorm, swiglu, residual, bias
    (37, 48, 40, torch.float32, False, False, False, True),
    (37, 48, 40, torch.float32, True, False, False, False),
    (5, 33, 17, torch.float32, True, True, True, False),
    (64, 96, 72, torch.bfloat16, True, True, True, True),
    (1, 40, 24, torch.bfloat16, False, False, True, False),
]


@pytest.mark.parametrize("M,K,N,dtype,norm,swiglu,res,bias", LINEAR)
def test_fused_linear(M, K, N, dtype, norm, swiglu, res, bias):
    g = torch.Generator().manual_seed(M * K + N)
    x64 = torch.randn(M, K, generator=g, dtype=torch.float64)
    w64 = torch.randn(2 * N if swiglu else N, K, generator=g, dtype=torch.float64) / K ** 0.5
    b64 = 0.1 * torch.randn(w64.shape[0], generator=g, dtype=torch.float64) if bias else None
    g64 = 1 + 0.1 * torch.randn(K, generator=g, dtype=torch.float64) if norm else None
    r64 = torch.randn(M, N, generator=g, dtype=torch.float64) if res else None
    cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
    x, w, b, gn, r = map(cast, (x64, w64, b64, g64, r64))
    x64, w64, b64, g64, r64 = (None if t is None else t.double().cpu() for t in (x, w, b, gn, r))
    kw = dict(swiglu=swiglu)
    ref = F_.fused_linear_eager(x64, w64, b64, norm_weight=g64, residual=r64, **kw)
    eager = F_.fused_linear_eager(x, w, b, norm_weight=gn, residual=r, **kw)
    out = F_.fused_linear_triton(x, w, b, norm_weight=gn, residual=r, **kw)
    chk = relative_check(out.cpu(), eager.cpu(), ref)
    assert out.shape == (M, N) and chk["passed"], chk


def test_fused_linear_bf16_dot_path_not_garbage():
    # the interpreter's bf16 tl.dot pitfall: dot_needs_fp32 must upcast; compare with fp32 math
    x = torch.randn(16, 32, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(16, 32, device=DEV, dtype=torch.bfloat16) / 6
    out = F_.fused_linear_triton(x, w).float()
    ref = x.float() @ w.float().T
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_fallback_unsupported_dtype_recorded_and_equal():
    x = torch.randn(1, 8, 2, 3, 3, dtype=torch.float64, device=DEV)
    n = F_.Norm("rms", torch.ones(8, dtype=torch.float64, device=DEV), None)
    ops = F_.Ops("fused")
    out = ops.norm_silu_pad(x, n, (2, 1, 1))
    assert torch.equal(out, F_.norm_silu_pad_eager(x, n, (2, 1, 1)))
    e = ops.log.ops["norm_silu_pad[rms]"]
    assert e["backend"] == "eager" and "float64" in e["reason"]


def test_fallback_when_interpreter_off(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the CPU-tensor case is covered by device='cpu' runs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r = torch.randn(1, 8, 2, 3, 3), torch.randn(1, 8, 2, 3, 3)
    n = F_.Norm("rms", torch.ones(8), None)
    ops = F_.Ops("fused")
    y, p = ops.add_norm_silu_pad(x, r, n, (2, 1, 1))
    y0, p0 = F_.add_norm_silu_pad_eager(x, r, n, (2, 1, 1))
    assert torch.equal(y, y0) and torch.equal(p, p0)
    assert ops.log.backend("add_norm_silu_pad[rms]") == "eager"
    assert "TRITON_INTERPRET" in ops.log.ops["add_norm_silu_pad[rms]"]["reason"]
    rec = inferbook.RunRecord(chapter="h3-vae-fusion", name="t")
    ops.log.to_record(rec)
    assert rec.backends["add_norm_silu_pad[rms]"]["backend"] == "eager"


def test_fp16_gate():
    res = check_fp16_gate(3, torch.device(DEV))
    for d in ("float16", "bfloat16"):
        assert res[d]["default_bitwise_equal_conv3d"]
    f16 = res["float16"]
    assert f16["gated_backend"] == "fp16-accumulation conv" and f16["gated_differs_from_default"]
    assert f16["gated_error"] <= f16["gated_bound"]
    assert res["bfloat16"]["gated_backend"].startswith("F.conv3d") and "bfloat16" in res["bfloat16"]["gated_reason"]


def test_default_conv_ignores_nothing_silently():
    ops = F_.Ops("eager")
    x = torch.randn(1, 4, 3, 4, 4, dtype=torch.float16)
    w = torch.randn(2, 4, 3, 3, 3, dtype=torch.float16)
    ops.conv3d(x, w)
    assert ops.log.ops["conv3d"]["reason"].startswith("default")


def test_bytes_models():
    shape = (1, 16, 3, 6, 8)
    x, r = torch.randn(shape), torch.randn(shape)
    n = F_.Norm("rms", torch.ones(16), torch.zeros(16))
    total, per_op = F_.eager_bytes_moved(F_.add_norm_silu_pad_eager, x, r, n, (2, 1, 1))
    n_el = x.numel()
    n_pad = 16 * 5 * 8 * 10
    fused = F_.fused_bytes_moved(shape, 4, (2, 1, 1), norm="rms", residual=True)
    assert fused == 4 * (2 * n_el + n_el + n_pad)
    assert dict(per_op)["constant_pad_nd.default"] == 4 * (n_el + n_pad)
    assert total > 2 * fused
    assert F_.fused_bytes_moved(shape, 4, (2, 1, 1), norm="group", residual=False) == 4 * (2 * n_el + n_pad)


@pytest.mark.parametrize("bad", [dict(backend="triton"), dict(backend="eager", fp16_accumulation="yes")])
def test_ops_bad_input(bad):
    with pytest.raises(ValueError, match="backend|fp16_accumulation"):
        F_.Ops(**bad)


def test_norm_bad_input():
    with pytest.raises(ValueError, match="norm must be one of"):
        F_.Norm("layer", torch.ones(4), None)
    with pytest.raises(ValueError, match="divisible by 32"):
        F_.Norm("group", torch.ones(40), None)
