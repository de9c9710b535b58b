"""A toy end-to-end video generation, each stage timed apart (the seed's advice for judging a VAE change).

    denoise (a tiny DiT, N flow-matching Euler steps) -> VAE decode -> audio synthesis (32 kHz stereo)
    -> save (H.264 + AAC in MP4, `media.write_mp4`)

Nothing here is a real model: the DiT and the VAE have random weights and the audio is a few sines
driven by the latent. What is real is the *shape* of the work and the timing of each stage, which is
what Amdahl's law needs: a VAE-only speedup s changes the whole run by 1 / ((1 - f) + f / s), where f
is the VAE's share of the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..measure import PhaseTimer
from . import media

STAGES = ("denoise", "vae_decode", "audio", "save")


@dataclass(frozen=True)
class DiTConfig:
    z_dim: int = 16
    patch: int = 2
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4


class TinyDiT(nn.Module):
    """Patchify 1x2x2 -> transformer blocks conditioned on the time step -> unpatchify: a velocity."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        p, d = cfg.patch, cfg.d_model
        self.embed = nn.Linear(cfg.z_dim * p * p, d)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, cfg.n_heads, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(cfg.n_layers))
        self.out = nn.Linear(d, cfg.z_dim * p * p)

    def forward(self, x: torch.Tensor, t: float) -> torch.Tensor:
        B, C, T, H, W = x.shape
        p, d = self.cfg.patch, self.cfg.d_model
        tok = x.view(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 1, 4, 6).reshape(B, -1, C * p * p)
        freqs = torch.exp(-math.log(1e4) * torch.arange(d // 2, device=x.device) / (d // 2))
        temb = torch.cat([torch.sin(t * 1000 * freqs), torch.cos(t * 1000 * freqs)]).to(x.dtype)
        h = self.embed(tok) + self.t_mlp(temb)
        for blk in self.blocks:
            h = blk(h)
        v = self.out(h).view(B, T, H // p, W // p, C, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return v.reshape(B, C, T, H, W)


def init_dit(cfg: DiTConfig, seed: int, *, device="cpu", dtype=torch.float32) -> TinyDiT:
    torch.manual_seed(seed)  # nn defaults draw from the global generator; seed it for reproducibility
    return TinyDiT(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)


def flow_times(steps: int, shift: float = 1.0) -> list[float]:
    """steps + 1 times from 1 to 0, shifted as flow-matching video models shift them (SD3 / Wan / H3's
    `flow_shift`): t' = shift t / (1 + (shift - 1) t), so a shift > 1 spends more steps at high noise."""
    if steps < 1 or not shift > 0:
        raise ValueError(f"steps must be >= 1 and shift > 0, got {steps}, {shift}")
    ts = [1.0 - i / steps for i in range(steps + 1)]
    return [shift * t / (1.0 + (shift - 1.0) * t) for t in ts]


@torch.no_grad()
def denoise(dit: TinyDiT, shape, steps: int, seed: int, *, device, dtype, shift: float = 1.0) -> torch.Tensor:
    """Flow-matching Euler from noise (t=1) to a latent (t=0) over the shifted times of `flow_times`.
    shape = (B, T, h, w); h, w even."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    B, T, h, w = shape
    if h % dit.cfg.patch or w % dit.cfg.patch:
        raise ValueError(f"latent h, w must be multiples of the patch size {dit.cfg.patch}, got {h}x{w}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, dit.cfg.z_dim, T, h, w, generator=g).to(device=device, dtype=dtype)
    ts = flow_times(steps, shift)
    for i in range(steps):
        x = x - dit(x, ts[i]) * (ts[i] - ts[i + 1])
    return x


def synth_audio(latent: torch.Tensor, n_frames: int, fps: float, sample_rate: int = 32000) -> np.ndarray:
    """Stereo float32 [2, N] lasting n_frames / fps seconds: four sines whose pitches and pans come
    from the latent's channel means (a stand-in for an audio decoder's work, not a model)."""
    n = int(round(n_frames / fps * sample_rate))
    m = latent.float().mean(dim=(0, 2, 3, 4)).cpu().numpy()
    t = np.arange(n, dtype=np.float64) / sample_rate
    out = np.zeros((2, n))
    for i in range(4):
        f0 = 220.0 * 2 ** (np.tanh(m[i % len(m)]) + i / 4)
        pan = 0.5 + 0.4 * np.tanh(m[(i + 4) % len(m)])
        tone = np.sin(2 * np.pi * f0 * t) * np.exp(-3 * (t % 0.5))
        out[0] += (1 - pan) * tone
        out[1] += pan * tone
    return (0.2 * out).astype(np.float32)


def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """[1, 3, T, H, W] in about [-1, 1] -> uint8 [T, H, W, 3]."""
    v = ((video[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return v.permute(1, 2, 3, 0).contiguous().cpu().numpy()


def run(dit: TinyDiT, decode, latent_shape, *, steps: int, fps: float, out_path, device, dtype, seed: int,
        sample_rate: int = 32000) -> dict:
    """One generation, stages timed apart (device synchronized at each boundary).

    `decode(latent) -> video` is the VAE backend under study. Returns {"seconds": {stage: s},
    "total": s, "probe": probe_media(...), "path": str}."""
    phases = PhaseTimer(torch.device(device))
    with phases("denoise"):
        latent = denoise(dit, latent_shape, steps, seed, device=device, dtype=dtype)
    with phases("vae_decode"):
        with torch.no_grad():
            video = decode(latent)
    frames = video_to_uint8(video)
    with phases("audio"):
        audio = synth_audio(latent, frames.shape[0], fps, sample_rate)
    with phases("save"):
        path = media.write_mp4(Path(out_path), frames, fps, audio, sample_rate)
    secs = phases.as_dict()
    return {"seconds": {s: secs[s] for s in STAGES}, "total": sum(secs[s] for s in STAGES),
            "probe": media.require_media(path, frames=frames.shape[0], fps=fps, width=frames.shape[2],
                                         height=frames.shape[1], sample_rate=sample_rate, channels=2),
            "path": str(path), "frames": frames}


def amdahl(share: float, speedup: float) -> float:
    """Whole-run speedup when a stage taking `share` of the time gets `speedup` faster."""
    if not 0 <= share <= 1 or speedup <= 0:
        raise ValueError(f"share must be in [0, 1] and speedup > 0, got {share!r}, {speedup!r}")
    return 1.0 / ((1.0 - share) + share / speedup)
