"""sd.py's H3 decode accounting on our ViT decoder: streaming changes nothing when one chunk and one tile hold
the whole clip, tiles keep their global token positions, the output is the fp32 buffer on the intermediate
device, and the estimate bounds the measured peak it was built for."""
import pytest
import torch

import inferbook
from inferbook.diffusion import h3_decode as HD
from inferbook.diffusion import vae
from inferbook.diffusion.tiled import peak_live_tensor_bytes


@pytest.fixture(scope="module")
def model():
    cfg = vae.H3Config(heads=2, dim_head=24, layers=1, z_dim=8)
    _, dec = vae.init_h3(cfg, 0)
    return dec, vae.make_latent(cfg, (1, 4, 4, 6), 1)


def test_one_chunk_one_tile_is_the_untiled_decode(model):
    dec, z = model
    with torch.no_grad():
        full = dec(z)
    video, info = HD.decode_streamed(dec, z, chunk=4, tile_budget=10 ** 12)
    assert info["chunks"] == 1 and info["tiles_per_chunk"] == 1 and video.dtype == torch.float32
    assert torch.allclose(video, full.float(), rtol=0, atol=1e-6)


def test_tiles_keep_their_global_positions():
    full = vae.token_ids(2, 6, 8, "cpu").view(2, 6, 8, 3)
    tile = vae.token_ids(1, 3, 4, "cpu", full=(2, 6, 8), offset=(1, 2, 4)).view(1, 3, 4, 3)
    assert torch.equal(tile, full[1:2, 2:5, 4:8])


def test_budget_picks_smaller_tiles_and_the_estimate_bounds_the_peak(model):
    dec, z = model
    fixed = HD.fixed_workspace_bytes(dec, lambda f: peak_live_tensor_bytes(f)[1], "cpu", torch.float32)
    big = HD.decode_estimate(dec, (4, 4, 6), 4, fixed_bytes=fixed)["bytes"]
    (video, info), peak, _ = peak_live_tensor_bytes(
        lambda: HD.decode_streamed(dec, z, chunk=2, tile_budget=big // 2, fixed_bytes=fixed))
    assert info["tiles_per_chunk"] > 1 and info["estimate_bytes"] <= big // 2
    assert peak - info["output_bytes"] <= info["estimate_bytes"]
    assert torch.isfinite(video).all() and video.shape == (1, 3, 16, 64, 96)


@pytest.mark.parametrize("kw", [dict(chunk=0), dict(chunk=2, context=-1), dict(chunk=2, overlap=-1)])
def test_bad_arguments(model, kw):
    dec, z = model
    with pytest.raises(inferbook.UserError):
        HD.decode_streamed(dec, z, **kw)
