"""Tiled decode: tiling geometry, blending, batch choice by memory, bad input."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.diffusion import tiled, vae


def small(attention=True):
    cfg = vae.VAEConfig(z_dim=4, channels=(16, 16, 8), temporal_up=(True, False), attention=attention)
    return vae.init_decoder(cfg, 0), cfg


@pytest.mark.parametrize("n,tile,overlap", [(10, 4, 1), (7, 7, 2), (5, 8, 2), (13, 6, 5), (9, 3, 0), (24, 12, 4)])
def test_split_tiles_cover_with_overlap(n, tile, overlap):
    t = min(tile, n)
    starts, ovs = tiled.split_tiles(n, t, overlap)
    assert starts[0] == 0 and starts[-1] + t == n and len(ovs) == len(starts) - 1
    for a, b, o in zip(starts, starts[1:], ovs):
        assert a < b and b == a + t - o and o >= overlap  # advance, and share at least `overlap`


def test_overlap_work_prediction():
    # the cpu preset: 6 tiles of 12x12 over a 16x24 latent decode 2.25x its pixels
    assert tiled.split_tiles(16, 12, 4) == ([0, 4], [8]) and tiled.split_tiles(24, 12, 4) == ([0, 6, 12], [6, 6])
    assert tiled.overlap_work_ratio(16, 24, 12, 4) == pytest.approx(2.25)
    assert tiled.overlap_work_ratio(8, 8, 8, 2) == 1.0


def test_blend_is_comfyui_crossfade():
    a, b = torch.zeros(1, 8), torch.ones(1, 8)
    out = tiled.blend(a, b, 4, dim=-1)
    assert torch.allclose(out[0, :4], torch.tensor([0.0, 0.25, 0.5, 0.75])) and torch.equal(out[0, 4:], torch.ones(4))
    assert torch.equal(tiled.blend(a, b, 0, dim=-1), b)


def test_single_tile_is_exact():
    dec, cfg = small()
    z = vae.make_latent(cfg, (1, 2, 5, 6), 1)
    video, info = tiled.decode_tiled(dec, z, tile=8, overlap=2)
    assert info["tiles"] == 1 and info["batch_sizes"] == [1]
    assert torch.equal(video, dec(z))


def test_tiled_close_to_full_and_batches_by_budget():
    dec, cfg = small(attention=False)
    z = vae.make_latent(cfg, (1, 1, 6, 10), 2)
    full = dec(z)
    sweep = tiled.tiles_for_budget_sweep(dec, z, 4, 2)
    assert sweep["per_row"] == 4 and sweep["tiles"] == 2 * 4  # rows start at 0, 2; columns at 0, 2, 4, 6
    for k in (1, 2, 3, 4):
        video, info = tiled.decode_tiled(dec, z, 4, 2, memory_budget=sweep[k])
        assert max(info["batch_sizes"]) == k and sum(info["batch_sizes"]) == 8
        assert all(b <= 4 for b in info["batch_sizes"]) and len(info["batch_sizes"]) == 2 * -(-4 // k)  # per row
        assert video.shape == full.shape and torch.isfinite(video).all()
    # the budget counts the weights and the canvas: without them, 2 tiles' room would look like more
    assert sweep[2] - sweep["fixed"] < 3 * sweep["per_tile"] <= sweep[2]
    # batching does not change the result beyond the precision's own error
    chk = tiled.batching_check(dec, z, 4, 2)
    assert chk["passed"] and chk["batches_1"] == [1] * 8 and max(chk["batches_4"]) == 4, chk
    # short of memory even for one tile: one at a time, said so
    _, info = tiled.decode_tiled(dec, z, 4, 2, memory_budget=1)
    assert info["batch_sizes"] == [1] * 8 and "even for one tile" in info["batch_reasons"][0]


class PointwiseDecoder(torch.nn.Module):
    """Each output pixel depends on its own latent pixel only: tiling cannot change its output, so any
    difference from the full decode is the blend's or the canvas bookkeeping's."""

    def __init__(self):
        super().__init__()
        self.cfg = vae.VAEConfig(z_dim=4, channels=(16, 8), temporal_up=(False,), attention=False)
        self.proj = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, z, ops=None):
        y = torch.einsum("bcthw,oc->bothw", z, self.proj)
        return torch.nn.functional.interpolate(y, scale_factor=(1, 2, 2), mode="nearest")


@pytest.mark.parametrize("shape,tile,overlap", [((1, 2, 7, 11), 4, 2), ((2, 1, 9, 6), 5, 1), ((1, 1, 8, 8), 4, 0)])
def test_canvas_blend_is_exact_for_a_pointwise_decoder(shape, tile, overlap):
    dec = PointwiseDecoder()
    z = torch.randn(shape[0], 4, *shape[1:])
    with torch.no_grad():
        full = dec(z)
        video, info = tiled.decode_tiled(dec, z, tile, overlap)
    assert info["canvas_bytes"] == video.numel() * video.element_size() and info["weight_bytes"] == 12 * 4
    assert info["tiles"] > 2 and torch.allclose(video, full, atol=1e-6), (video - full).abs().max()


def test_free_memory_counts_like_comfyui():
    free, how = tiled.free_memory("cpu")
    assert free > 0 and ("psutil" in how or "meminfo" in how)


def test_choose_batch():
    assert tiled.choose_batch(9, 100, None, 4)[0] == 4
    assert tiled.choose_batch(2, 100, 10_000, 4)[0] == 2
    assert tiled.choose_batch(9, 100, 250, 4)[0] == 2
    assert tiled.choose_batch(9, 100, 50, 4)[0] == 1


def test_seam_mask():
    m = tiled.seam_mask(6, 6, 4, 2, 2)
    assert m.shape == (12, 12) and m[4:8].all() and not m[0, 0]


@pytest.mark.parametrize("kw,match", [
    (dict(tile=2, overlap=2), r"tile \(2\) must be larger than overlap \(2\)"),
    (dict(tile=4, overlap=2, memory_budget=0), "memory_budget must be a positive"),
    (dict(tile=4, overlap=2, memory_budget=-5.0), "memory_budget must be a positive"),
    (dict(tile=0, overlap=0), "tile must be an int >= 1"),
    (dict(tile=4, overlap=-1), "overlap must be an int >= 0"),
    (dict(tile=4, overlap=1, max_batch=0), "max_batch must be an int >= 1"),
])
def test_bad_input(kw, match):
    dec, cfg = small()
    z = vae.make_latent(cfg, (1, 1, 4, 4), 0)
    with pytest.raises(inferbook.UserError, match=match):
        tiled.decode_tiled(dec, z, **kw)


def test_bad_latent_rank_and_channels():
    dec, cfg = small()
    with pytest.raises(ValueError, match="5-D"):
        tiled.decode_tiled(dec, torch.randn(4, 1, 4, 4), 4, 1)
    with pytest.raises(ValueError, match="z_dim"):
        tiled.decode_tiled(dec, torch.randn(1, 3, 1, 4, 4), 4, 1)


def test_peak_live_tensor_bytes():
    def work():
        a = torch.ones(1 << 20)         # 4 MiB
        b = a * 2                        # 8 MiB live
        del a
        c = b + 1                        # 8 MiB live again
        return c.sum()

    _, peak, _ = tiled.peak_live_tensor_bytes(work)
    assert 8 * 2 ** 20 <= peak < 9 * 2 ** 20
    dec, cfg = small(attention=False)
    z = vae.make_latent(cfg, (1, 1, 8, 8), 3)
    sw = tiled.tiles_for_budget_sweep(dec, z, 4, 1)
    p1 = tiled.peak_live_tensor_bytes(lambda: tiled.decode_tiled(dec, z, 4, 1, memory_budget=sw[1]))[1]
    p4 = tiled.peak_live_tensor_bytes(lambda: tiled.decode_tiled(dec, z, 4, 1, memory_budget=sw[sw["per_row"]]))[1]
    assert sw["per_row"] >= 3 and p4 > 2 * p1  # several tiles at once hold several tiles' activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temporal_tiles_exact_with_full_context_for_causal_decoder(dtype):
    """Within the FlashAttention rule of the full decode against float64 (never bitwise: other batch shapes,
    other conv algorithms), and far outside it with one frame of context."""
    from inferbook.diffusion.fused import fa_rule_check
    cfg = vae.VAEConfig(z_dim=4, channels=(32, 32, 32), temporal_up=(True, True), attention=True)
    z = vae.make_latent(cfg, (1, 5, 3, 4), 1, dtype=dtype)
    for norm in ("rms", "group"):   # per-frame GroupNorm is causal too
        dec = vae.init_decoder(vae.VAEConfig(**{**cfg.__dict__, "norm": norm}), 0, dtype=dtype)
        ref = vae.fp64_reference(dec, z)
        full = dec(z)
        video, info = tiled.decode_tiled(dec, z, 8, 2, temporal_tile=2, temporal_context=4)
        assert info["temporal_tiles"] == 3 and video.shape == full.shape
        assert fa_rule_check(video, full, ref)["passed"]
        short, _ = tiled.decode_tiled(dec, z, 8, 2, temporal_tile=2, temporal_context=1)
        rule = fa_rule_check(short, full, ref)
        assert not rule["passed"] and rule["error"] > 10 * rule["tolerance"]  # the check can tell


def test_output_frames_mapping():
    cfg = vae.VAEConfig(z_dim=4, channels=(16, 16, 8), temporal_up=(True, True))
    dec = vae.init_decoder(cfg, 0)
    assert tiled.output_frames(dec, 0) == (0, 1) and tiled.output_frames(dec, 2) == (5, 9)


@pytest.mark.parametrize("kw,match", [(dict(temporal_tile=0), "temporal_tile"),
                                      (dict(temporal_tile=1, temporal_context=0), "temporal_context")])
def test_temporal_bad_input(kw, match):
    dec, cfg = small()
    z = vae.make_latent(cfg, (1, 3, 4, 4), 0)
    with pytest.raises(inferbook.UserError, match=match):
        tiled.decode_tiled(dec, z, 4, 1, **kw)


@pytest.mark.parametrize("params,match", [(dict(overlap=6), "overlap must be in"), (dict(tile=0), "'tile' must be >= 1"),
                                          (dict(overlaps="0,9"), "overlaps must each"), (dict(channels="32,x"), "channels"),
                                          (dict(reps=1), "reps")])
def test_chapter_measure_bad_parameters(params, match):
    with pytest.raises(inferbook.UserError, match=match):  # setup's bounds and check_params refuse most before any work
        ctx = inferbook.setup("h3-tiled-decode", device="cpu", preset="smoke", **params)
        ctx.module.measure(ctx, **ctx.params)
