"""The causal video-VAE decoder: backends agree with float64, causality, shapes, the INT8 gate."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.diffusion import vae
from inferbook.chapters.h3_vae_fusion import check_decoder, check_int8_gate, config_from

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def tiny(norm="rms", attention=True, channels=(32, 32, 32)):
    return vae.VAEConfig(z_dim=4, channels=channels, temporal_up=(True, False), norm=norm, attention=attention)


@pytest.mark.parametrize("norm,dtype,T", [("rms", torch.float32, 2), ("group", torch.float32, 1),
                                          ("rms", torch.bfloat16, 1)])
def test_fused_decoder_matches_eager_vs_fp64(norm, dtype, T):
    cfg = tiny(norm)
    dec = vae.init_decoder(cfg, 1, device=DEV, dtype=dtype)
    z = vae.make_latent(cfg, (1, T, 3, 5), 2, device=DEV, dtype=dtype)
    res = check_decoder(dec, z)
    assert res["passed"], {k: v for k, v in res.items() if k != "log"}
    log = res["log"]
    assert log.backend(f"norm_silu_pad[{norm}]") == "triton fused"
    assert log.backend("attn.qkv[rmsnorm]") == "triton fused linear"
    assert log.backend("attention") == "torch sdpa"


def test_output_shape_and_config():
    cfg = vae.VAEConfig(z_dim=4, channels=(32, 16, 16, 8), temporal_up=(True, True, False))
    assert cfg.output_shape((1, 4, 3, 5, 7)) == (1, 3, 9, 40, 56)
    dec = vae.init_decoder(vae.VAEConfig(z_dim=4, channels=(16, 8), temporal_up=(True,), attention=False), 0)
    out = dec(torch.randn(2, 4, 2, 3, 5))
    assert out.shape == (2, 3, 3, 6, 10) and torch.isfinite(out).all()
    c = config_from({"channels": "96,96,64,32", "z_dim": 16}, "rms")
    assert c.temporal_up == (True, True, False) and c.spatial_factor == 8


def test_rms_decoder_is_causal():
    cfg = tiny("rms")
    dec = vae.init_decoder(cfg, 3)
    z = vae.make_latent(cfg, (1, 3, 3, 4), 4)
    z2 = z.clone()
    z2[:, :, 2] = torch.randn_like(z2[:, :, 2])  # change only the last latent frame
    a, b = dec(z), dec(z2)
    # latent frame t first reaches output frame 2t - 1: frames 0..2 must not move
    assert torch.equal(a[:, :, :3], b[:, :, :3])
    assert not torch.equal(a[:, :, 3:], b[:, :, 3:])


def test_int8_gate():
    cfg = tiny("rms")
    dec = vae.init_decoder(cfg, 5)
    z = vae.make_latent(cfg, (1, 1, 3, 4), 6)
    res = check_int8_gate(dec, z)
    assert res["float_backend"] == "torch sdpa" and res["float_quantization"] == "none"
    assert res["int8_backend"].startswith("int8") and res["int8_quantization"].startswith("int8")
    assert res["original_unchanged"]
    assert 0 < res["int8_relative_l2"] < 0.05
    q = vae.quantize_decoder_int8(dec)
    with pytest.raises(ValueError, match="already INT8"):
        vae.quantize_decoder_int8(q)
    with pytest.raises(ValueError, match="no attention"):
        vae.quantize_decoder_int8(vae.init_decoder(tiny(attention=False), 0))


def test_int8_attention_close_to_float():
    q, k, v = (torch.randn(2, 10, 24) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = vae.int8_attention(q, k, v)
    assert (out - ref).abs().max() < 0.05


@pytest.mark.parametrize("kw,match", [(dict(norm="batch"), "norm must be"), (dict(temporal_up=(True,)), "temporal_up"),
                                      (dict(norm="group", channels=(48, 32, 32)), "divisible by 32"),
                                      (dict(channels=(32, 0, 32)), "positive")])
def test_config_bad_input(kw, match):
    base = dict(z_dim=4, channels=(32, 32, 32), temporal_up=(True, False))
    with pytest.raises(ValueError, match=match):
        vae.VAEConfig(**{**base, **kw})


def test_decoder_rejects_wrong_latent():
    dec = vae.init_decoder(tiny(), 0)
    with pytest.raises(ValueError, match="latent must be"):
        dec(torch.randn(1, 4, 3, 4))
    with pytest.raises(ValueError, match="latent must be"):
        dec(torch.randn(1, 5, 1, 3, 4))


@pytest.mark.parametrize("params,match", [(dict(latent_h=5), "even"), (dict(channels="32"), "at least two"),
                                          (dict(norms="group", channels="40,32,32"), "divisible by 32"),
                                          (dict(check_latent="2,3"), "check_latent")])
def test_chapter_measure_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):  # setup's check_params refuses most before any work
        ctx = inferbook.setup("h3-vae-fusion", device="cpu", preset="smoke", **params)
        ctx.module.measure(ctx, **ctx.params)
