"""Toy generation: stages timed apart, saved file checked; Amdahl's bound."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.diffusion import toy_pipeline as tp
from inferbook.diffusion import vae


def test_amdahl():
    assert tp.amdahl(0.5, 1) == 1
    assert tp.amdahl(0.5, 1e12) == pytest.approx(2)
    assert tp.amdahl(0.25, 2) == pytest.approx(1 / 0.875)
    with pytest.raises(ValueError, match="share must be"):
        tp.amdahl(1.5, 2)


def test_toy_run(tmp_path):
    cfg = vae.VAEConfig(z_dim=4, channels=(16, 8), temporal_up=(True,), attention=False)
    dec = vae.init_decoder(cfg, 0)
    dit = tp.init_dit(tp.DiTConfig(z_dim=4, d_model=32, n_layers=1, n_heads=2), 0)
    res = tp.run(dit, lambda z: dec(z), (1, 2, 4, 6), steps=2, fps=8, out_path=tmp_path / "t.mp4",
                 device="cpu", dtype=torch.float32, seed=0)
    assert set(res["seconds"]) == set(tp.STAGES) and all(s >= 0 for s in res["seconds"].values())
    p = res["probe"]
    assert p["frames"] == 3 and (p["width"], p["height"]) == (12, 8)
    assert p["audio_codec"] == "aac" and p["sample_rate"] == 32000 and p["channels"] == 2
    with pytest.raises(ValueError, match="steps must be"):
        tp.denoise(dit, (1, 1, 4, 4), 0, 0, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="multiples of the patch"):
        tp.denoise(dit, (1, 1, 3, 4), 1, 0, device="cpu", dtype=torch.float32)
