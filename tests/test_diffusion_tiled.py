"""Tiled decode: tiling geometry, blending, batch choice by memory, bad input."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.diffusion import tiled, vae


def small(attention=True):
    cfg = vae.VAEConfig(z_dim=4, channels=(16, 16, 8), temporal_up=(True, False), attention=attention)
    return vae.init_decoder(cfg, 0), cfg


@pytest.mark.parametrize("n,tile,overlap", [(10, 4, 1), (7, 7, 2), (5, 8, 2), (13, 6, 5), (9, 3, 0)])
def test_tile_starts_cover_with_overlap(n, tile, overlap):
    starts = tiled.tile_starts(n, min(tile, n), overlap)
    t = min(tile, n)
    assert starts[0] == 0 and starts[-1] + t == n
    for a, b in zip(starts, starts[1:]):
        assert a < b and b <= a + t - overlap  # advance, and share at least `overlap`


def test_feather_positive_and_flat_at_borders():
    w = tiled.feather(16, 4, 0)
    assert (w > 0).all() and w[-1] == 1 and w[0] < w[3] < 1
    assert torch.equal(tiled.feather(8, 0, 0), torch.ones(8))


def test_single_tile_is_exact():
    dec, cfg = small()
    z = vae.make_latent(cfg, (1, 2, 5, 6), 1)
    video, info = tiled.decode_tiled(dec, z, tile=8, overlap=2)
    assert info["tiles"] == 1 and info["batch_sizes"] == [1]
    assert torch.equal(video, dec(z))


def test_tiled_close_to_full_and_batches_by_budget():
    dec, cfg = small(attention=False)
    z = vae.make_latent(cfg, (1, 1, 6, 9), 2)
    full = dec(z)
    sweep = tiled.tiles_for_budget_sweep(dec, z, 4, 2)
    assert sweep["tiles"] == 2 * 4  # rows start at 0, 2; columns at 0, 2, 4, 5
    for k in (1, 2, 3, 4):
        video, info = tiled.decode_tiled(dec, z, 4, 2, memory_budget=sweep[k])
        assert max(info["batch_sizes"]) == k and sum(info["batch_sizes"]) == 8
        assert video.shape == full.shape and torch.isfinite(video).all()
    # batching does not change the result: same tiles, same blend
    a, _ = tiled.decode_tiled(dec, z, 4, 2, memory_budget=sweep[1])
    b, _ = tiled.decode_tiled(dec, z, 4, 2, memory_budget=None)
    assert torch.allclose(a, b, atol=1e-5)
    # short of memory even for one tile: one at a time, said so
    _, info = tiled.decode_tiled(dec, z, 4, 2, memory_budget=1)
    assert info["batch_sizes"] == [1] * 8 and "even for one tile" in info["batch_reasons"][0]


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
    with pytest.raises(ValueError, match=match):
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
    p4 = tiled.peak_live_tensor_bytes(lambda: tiled.decode_tiled(dec, z, 4, 1, memory_budget=sw[4]))[1]
    assert p4 > 2 * p1  # four tiles at once hold about four tiles' activations


def test_temporal_tiles_exact_with_full_context_for_causal_decoder():
    cfg = vae.VAEConfig(z_dim=4, channels=(32, 32, 32), temporal_up=(True, True), attention=True)
    dec = vae.init_decoder(cfg, 0)
    z = vae.make_latent(cfg, (1, 5, 3, 4), 1)
    full = dec(z)
    video, info = tiled.decode_tiled(dec, z, 8, 2, temporal_tile=2, temporal_context=4)
    assert info["temporal_tiles"] == 3 and video.shape == full.shape
    assert (video - full).abs().max() <= 1e-5 * full.abs().max()
    short, _ = tiled.decode_tiled(dec, z, 8, 2, temporal_tile=2, temporal_context=1)
    assert (short - full).abs().max() > 1e-3 * full.abs().max()  # the test can tell the difference
    g = vae.init_decoder(vae.VAEConfig(**{**cfg.__dict__, "norm": "group"}), 0)
    gv, _ = tiled.decode_tiled(g, z, 8, 2, temporal_tile=2, temporal_context=4)
    assert (gv - g(z)).abs().max() > 1e-3 * g(z).abs().max()  # GroupNorm spans all frames: not causal


def test_output_frames_mapping():
    cfg = vae.VAEConfig(z_dim=4, channels=(16, 16, 8), temporal_up=(True, True))
    dec = vae.init_decoder(cfg, 0)
    assert tiled.output_frames(dec, 0) == (0, 1) and tiled.output_frames(dec, 2) == (5, 9)


@pytest.mark.parametrize("kw,match", [(dict(temporal_tile=0), "temporal_tile"),
                                      (dict(temporal_tile=1, temporal_context=0), "temporal_context")])
def test_temporal_bad_input(kw, match):
    dec, cfg = small()
    z = vae.make_latent(cfg, (1, 3, 4, 4), 0)
    with pytest.raises(ValueError, match=match):
        tiled.decode_tiled(dec, z, 4, 1, **kw)


@pytest.mark.parametrize("params,match", [(dict(overlap=6), "overlap must be in"), (dict(tile=0), "'tile' must be >= 1"),
                                          (dict(overlaps="0,9"), "overlaps must each"), (dict(channels="32,x"), "channels")])
def test_chapter_measure_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):  # setup's bounds and check_params refuse them before any work
        ctx = inferbook.setup("h3-tiled-decode", device="cpu", preset="smoke", **params)
        ctx.module.measure(ctx, **ctx.params)
