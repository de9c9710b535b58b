"""Fused VAE ops vs eager vs float64: the matrix (FlashAttention rule), a broken kernel caught, the linear
interface, RMSNorm + RoPE, the fp16-accumulation conv, fallbacks, gates, bytes model."""

import pytest
import torch

import inferbook  # noqa: F401  (turns the Triton interpreter on where there is no GPU)
from inferbook.diffusion import fused as F_
from inferbook.chapters.h3_vae_fusion import MATRIX, _cell_id, check_fp16_gate, check_op

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cell", MATRIX, ids=[_cell_id(c) for c in MATRIX])
def test_norm_silu_pad_matrix(cell):
    res = check_op(cell, seed=MATRIX.index(cell) + 17, device=DEV)
    assert res["passed"], res
    assert res["error"] == res["error"] and res["ndhwc_out"]


def test_eps_break_fails_a_bf16_cell():
    # the kernel with eps 1e-2 instead of the model's 1e-6: a bf16 cell of the matrix must fail. The
    # small-input cell (|x| ~ 0.05, where eps is a quarter of the variance) fails by max and by RMS error.
    cell = [c for c in MATRIX if c[2] == torch.bfloat16 and c[5] == 0.05][0]
    seed = 5 + MATRIX.index(cell)                                      # as eps_break seeds it
    small = check_op(cell, seed, DEV, eps_override=1e-2)
    assert not small["passed"] and small["error"] > small["tolerance"] and small["rms_error"] > small["rms_tolerance"]
    # the same cell with the right eps passes: the failure is the break, not the cell
    assert check_op(cell, seed, DEV)["passed"]


def test_rule_rejects_nan_shift_and_shape():
    ref = torch.randn(64, 50, dtype=torch.float64)
    eager = ref.bfloat16()
    assert F_.fa_rule_check(eager, eager, ref)["passed"]
    bad = eager.clone()
    bad[0, 0] = float("nan")
    assert not F_.fa_rule_check(bad, eager, ref)["passed"]
    shifted = (ref * 1.004).bfloat16()  # half a bf16 ulp, systematic: hidden in max error, not in RMS
    chk = F_.fa_rule_check(shifted, eager, ref)
    assert not chk["passed"] and chk["rms_error"] > chk["rms_tolerance"]
    assert not F_.fa_rule_check(eager[:-1], eager, ref)["passed"]


def test_per_frame_statistics_reflect_padding_and_layout():
    # per-frame: one frame scaled by 100 must not change any other frame's normalized output
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, 3, 4, 5, generator=g)
    n = F_.Norm("group", torch.ones(32), torch.zeros(32))
    a = F_.norm_silu_pad_triton(x, n, (1, 1, 1, 1, 2))
    x2 = x.clone()
    x2[:, :, 2] = 100 * x2[:, :, 2] + 7
    b = F_.norm_silu_pad_triton(x2, n, (1, 1, 1, 1, 2))
    assert torch.allclose(a[:, :, :4], b[:, :, :4], atol=1e-5)           # zeros + frames 0, 1 unchanged
    assert torch.allclose(a[:, :, 4], b[:, :, 4], atol=1e-3)             # frame 2: its own statistics
    whole_clip = torch.nn.functional.group_norm(x2, 32)                   # the old, clip-wide statistics
    assert not torch.allclose(b[:, :, 3, 1:-1, 1:-1], torch.nn.functional.silu(whole_clip[:, :, 1]), atol=1e-2)
    # reflect in space (no edge repeat), zeros only in front, NDHWC out
    assert a.is_contiguous(memory_format=torch.channels_last_3d)
    assert a[:, :, :2].abs().max() == 0
    assert torch.equal(a[:, :, 2:, 0], a[:, :, 2:, 2]) and torch.equal(a[..., 0], a[..., 2])
    assert torch.equal(a[..., -1], a[..., -3])
    # Downsample3D's one-sided pad: nothing on the left / top
    d = F_.norm_silu_pad_triton(x, n, (0, 1, 0, 1, 2))
    assert d.shape == (1, 32, 5, 5, 6) and torch.equal(d[..., -1], d[..., -3])


def test_block_configs_are_the_gpu_ones():
    # the interpreter runs the GPU's constexprs (no interpreter-only shrink)
    assert F_.norm_pad_config(96, 832, 2) == dict(BLOCK_C=32, EVEN_C=True, VEC=8, BLOCK_P=64)
    assert F_.norm_pad_config(192, 832, 2) == dict(BLOCK_C=64, EVEN_C=True, VEC=8, BLOCK_P=32)
    assert F_.norm_pad_config(33, 9, 2)["EVEN_C"] is False
    cfg = F_.stats_config(1, 17, 96, 480 * 832, 2)
    assert cfg["grid"][0] * cfg["grid"][1] * cfg["grid"][2] >= 1024 // 2
    assert cfg["CHUNK"] >= 8 * cfg["BLOCK_P"]  # every program loops over many tiles


LINEAR = [  # M rows, K, N, dtype, rmsnorm, swiglu, residual, bias, scaled residual, GPU tiles
    (37, 48, 40, torch.float32, False, False, False, True, False, False),
    (37, 48, 40, torch.float32, True, False, False, False, False, False),
    (5, 33, 17, torch.float32, True, True, True, False, True, False),
    (64, 96, 72, torch.bfloat16, True, True, True, True, True, False),
    (1, 40, 24, torch.bfloat16, False, False, True, False, False, False),
    (70, 64, 80, torch.bfloat16, True, False, True, True, True, True),   # 128x64x32: the GPU's default tiles
    (40, 96, 72, torch.bfloat16, True, True, True, True, True, True),    # 32x64x64: the GPU's few-token tiles
]


def test_fused_linear_config_per_shape():
    cuda = torch.device("cuda")
    assert F_.linear_config(cuda, 16, 6144)["BLOCK_M"] == 32
    assert F_.linear_config(cuda, 8192, 6144) == F_.LINEAR_GPU_CONFIGS["wide"]
    assert F_.linear_config(cuda, 8192, 8192, swiglu=True)["BLOCK_N"] == 64     # two accumulators
    assert F_.linear_config(cuda, 1000, 512) == F_.LINEAR_GPU_CONFIG
    assert F_.linear_config("cpu", 8192, 8192) == F_.LINEAR_INTERPRETER_CONFIG


@pytest.mark.parametrize("M,K,N,dtype,norm,swiglu,res,bias,rscale,gpu", LINEAR)
def test_fused_linear(M, K, N, dtype, norm, swiglu, res, bias, rscale, gpu):
    g = torch.Generator().manual_seed(M * K + N)
    x64 = torch.randn(M, K, generator=g, dtype=torch.float64)
    w64 = torch.randn(2 * N if swiglu else N, K, generator=g, dtype=torch.float64) / K ** 0.5
    b64 = 0.1 * torch.randn(w64.shape[0], generator=g, dtype=torch.float64) if bias else None
    g64 = 1 + 0.1 * torch.randn(K, generator=g, dtype=torch.float64) if norm else None
    r64 = torch.randn(M, N, generator=g, dtype=torch.float64) if res else None
    s64 = 0.5 + 0.1 * torch.randn(N, generator=g, dtype=torch.float64) if rscale else None
    cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
    x, w, b, gn, r, sc = map(cast, (x64, w64, b64, g64, r64, s64))
    x64, w64, b64, g64, r64, s64 = (None if t is None else t.double().cpu() for t in (x, w, b, gn, r, sc))
    kw = dict(swiglu=swiglu)
    ref = F_.fused_linear_eager(x64, w64, b64, norm_weight=g64, residual=r64, residual_scale=s64, **kw)
    eager = F_.fused_linear_eager(x, w, b, norm_weight=gn, residual=r, residual_scale=sc, **kw)
    out = F_.fused_linear_triton(x, w, b, norm_weight=gn, residual=r, residual_scale=sc, gpu_config=gpu, **kw)
    chk = F_.fa_rule_check(out, eager, ref)
    assert out.shape == (M, N) and chk["passed"], chk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_rope(dtype):
    g = torch.Generator().manual_seed(3)
    B, S, H, D, pairs = 2, 7, 3, 24, 9
    qkv = torch.randn(B, S, H, 3 * D, generator=g).to(DEV, dtype)
    q, k, _ = torch.chunk(qkv, 3, dim=-1)           # strided views, as the decoder passes them
    ang = 3 * torch.randn(S, pairs, generator=g).to(DEV)
    ref = F_.rms_rope_eager(q.double().cpu(), k.double().cpu(), ang.double().cpu(), 1e-5)
    eager = F_.rms_rope_eager(q, k, ang, 1e-5)
    out = F_.rms_rope_triton(q, k, ang, 1e-5)
    for o, e, r in zip(out, eager, ref):
        chk = F_.fa_rule_check(o, e, r)
        assert chk["passed"], chk
    # the rotation preserves each pair's norm: a check that does not use the reference
    qn = out[0].float()
    assert torch.allclose(qn.pow(2).mean(-1), torch.ones(B, S, H, device=DEV), atol=2e-2 if dtype != torch.float32 else 1e-4)


@pytest.mark.parametrize("stride,res,Ci,Co", [(1, True, 16, 24), ((1, 2, 2), False, 32, 16), (1, True, 40, 40)])
def test_implicit_gemm_conv(stride, res, Ci, Co):
    g = torch.Generator().manual_seed(Ci + Co)
    x = torch.randn(1, Ci, 4, 7, 9, generator=g).half().to(DEV)
    w = (torch.randn(Co, Ci, 3, 3, 3, generator=g) / (27 * Ci) ** 0.5).half().to(DEV)
    b = (0.1 * torch.randn(Co, generator=g)).half().to(DEV)
    ref_shape = torch.nn.functional.conv3d(x.float().cpu(), w.float().cpu(), stride=stride).shape
    r = torch.randn(ref_shape, generator=g).half().to(DEV) if res else None
    ref = torch.nn.functional.conv3d(x.double().cpu(), w.double().cpu(), b.double().cpu(), stride)
    if res:
        ref = ref + r.double().cpu()
    eager = F_.conv3d_eager(x, w, b, stride, r)
    fp32acc = F_.conv3d_triton(x, w, b, stride, r, fp16_accumulation=False)
    chk = F_.fa_rule_check(fp32acc, eager, ref)
    assert chk["passed"] and fp32acc.is_contiguous(memory_format=torch.channels_last_3d), chk
    fp16acc = F_.conv3d_triton(x, w, b, stride, r, fp16_accumulation=True)
    e16 = float((fp16acc.double().cpu() - ref).abs().max())
    assert torch.isfinite(fp16acc).all() and e16 > chk["error"]  # fp16 sums cost accuracy ...
    assert e16 < 0.05 * float(ref.abs().max())                    # ... but stay an approximation of the conv


def test_fallbacks_are_recorded():
    x = torch.randn(1, 32, 2, 3, 3, dtype=torch.float64, device=DEV)
    n = F_.Norm("group", torch.ones(32, dtype=torch.float64, device=DEV), None)
    ops = F_.Ops("fused")
    out = ops.norm_silu_pad(x, n, (1, 1, 1, 1, 2))
    assert torch.equal(out, F_.norm_silu_pad_eager(x, n, (1, 1, 1, 1, 2)))
    e = ops.log.ops["norm_silu_pad[group]"]
    assert e["backend"] == "eager" and "float64" in e["reason"]


def test_fallback_when_interpreter_off(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the CPU-tensor case is covered by device='cpu' runs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 32, 2, 3, 3)
    n = F_.Norm("group", torch.ones(32), None)
    ops = F_.Ops("fused", fp16_accumulation=True)
    p = ops.norm_silu_pad(x, n, (1, 1, 1, 1, 2))
    assert torch.equal(p, F_.norm_silu_pad_eager(x, n, (1, 1, 1, 1, 2)))
    assert ops.log.backend("norm_silu_pad[group]") == "eager"
    assert "TRITON_INTERPRET" in ops.log.ops["norm_silu_pad[group]"]["reason"]
    xh, wh = torch.randn(1, 8, 3, 3, 3).half(), torch.randn(8, 8, 3, 3, 3).half()
    y = ops.conv3d(xh, wh)
    assert torch.equal(y, torch.nn.functional.conv3d(xh, wh))
    assert ops.log.backend("conv3d").startswith("F.conv3d") and "unavailable" in ops.log.ops["conv3d"]["reason"]
    rec = inferbook.RunRecord(chapter="h3-vae-fusion", name="t")
    ops.log.to_record(rec)
    assert rec.backends["norm_silu_pad[group]"]["backend"] == "eager"


def test_fp16_gate():
    res = check_fp16_gate(3, torch.device(DEV))
    for d in ("float16", "bfloat16"):
        assert res[d]["default_bitwise_equal_conv3d"]
    f16 = res["float16"]
    assert f16["gated_backend"] == "triton fp16-accumulation conv" and f16["gated_differs_from_default"]
    assert f16["gated_rel_l2_vs_fp32"] > f16["default_rel_l2_vs_fp32"]
    assert res["bfloat16"]["gated_backend"].startswith("F.conv3d") and "bfloat16" in res["bfloat16"]["gated_reason"]


def test_implicit_gemm_conv_at_cdna_tiles():
    # CDNA's 128x128x64 tile (`fused.CONV_CDNA_CONFIG`) in the interpreter: 160 output rows and 136 channels span
    # two ragged tiles each way, C_in 72 leaves a ragged last K step; fp32 accumulation within the rule
    from inferbook.device import building_for

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 72, 4, 10, 12, generator=g).half().to(DEV)
    w = (torch.randn(136, 72, 3, 3, 3, generator=g) / (27 * 72) ** 0.5).half().to(DEV)
    b = (0.1 * torch.randn(136, generator=g)).half().to(DEV)
    ref = torch.nn.functional.conv3d(x.double().cpu(), w.double().cpu(), b.double().cpu())
    with building_for("gfx942"):
        assert F_.conv_config(72, 136, DEV) == {**F_.CONV_CDNA_CONFIG, "BLOCK_K": 64, "BLOCK_N": 128}
        out = F_.conv3d_triton(x, w, b, fp16_accumulation=False)
    chk = F_.fa_rule_check(out, F_.conv3d_eager(x, w, b, 1, None), ref)
    assert chk["passed"], chk
    assert F_.conv_config(72, 136, DEV) == {**F_.CONV_GPU_CONFIG, "BLOCK_K": 32, "BLOCK_N": 64}


def test_residual_in_conv_epilogue():
    ops = F_.Ops("eager")
    x = torch.randn(1, 4, 3, 4, 4)
    w = torch.randn(2, 4, 1, 1, 1)
    r = torch.randn(1, 2, 3, 4, 4)
    assert torch.equal(ops.conv3d(x, w, residual=r), torch.nn.functional.conv3d(x, w) + r)
    assert ops.log.ops["conv3d"]["reason"].startswith("default")


def test_bytes_models():
    shape = (1, 32, 3, 6, 8)
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last_3d)
    n = F_.Norm("group", torch.ones(32), torch.zeros(32))
    pad = (1, 1, 1, 1, 2)
    total, per_op = F_.eager_bytes_moved(F_.norm_silu_pad_eager, x, n, pad)
    n_el, n_pad = x.numel(), 32 * 5 * 8 * 10
    assert F_.fused_bytes_moved(shape, 4, pad, norm="group") == 4 * (2 * n_el + n_pad)
    assert F_.fused_bytes_moved(shape, 4, pad, norm="rms") == 4 * (n_el + n_pad)
    assert total > 2 * F_.fused_bytes_moved(shape, 4, pad, norm="group")


@pytest.mark.parametrize("bad", [dict(backend="triton"), dict(backend="eager", fp16_accumulation="yes")])
def test_ops_bad_input(bad):
    with pytest.raises(inferbook.UserError, match="backend|fp16_accumulation"):
        F_.Ops(**bad)


def test_norm_and_pad_bad_input():
    with pytest.raises(inferbook.UserError, match="norm must be one of"):
        F_.Norm("layer", torch.ones(4), None)
    with pytest.raises(inferbook.UserError, match="divisible by 32"):
        F_.Norm("group", torch.ones(40), None)
    with pytest.raises(inferbook.UserError, match="pad must be 5"):
        F_.norm_silu_pad_eager(torch.randn(1, 4, 1, 3, 3), None, (1, 1, 1), silu=False)
    with pytest.raises(inferbook.UserError, match="smaller than the frame"):
        F_.norm_silu_pad_triton(torch.randn(1, 4, 1, 1, 3), None, (1, 1, 1, 1, 0), silu=False)
