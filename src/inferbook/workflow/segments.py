"""A toy segment generator for long videos built from a loop, and the continuity it does not keep.

The seed's point about Generic Loops: the loop carries one value from iteration to iteration
(the last frame, a prompt), but *it does not by itself keep identity, motion or audio-visual
continuity across segments*. This toy generator makes that concrete. It sees the previous
segment only through what the workflow wires into it:

- `context` [k, H, W, 3], the frames the workflow hands over; the last one is encoded to a 4x-downsampled latent (`encode`), as an image-to-video
  model sees its conditioning frame through its latent space; fine detail does not survive.
- the segment's content: the decoded latent plus a fine texture synthesised from noise drawn
  from (prompt, seed + index) by `steps` passes of a small fixed conv net (the toy's "denoiser",
  where its time goes), so each segment re-invents the detail. Inside a segment the texture drifts
  between two such fields (`EVOLVE` radians per frame), so consecutive frames are not pure pixel
  shifts: the motion-compensated residual inside a segment is small but not zero.
- motion: a whole-frame pan of `velocity` pixels per frame, drawn from the segment's seed unless
  the context holds at least two frames: then the pan is estimated from the last two and continued.
- audio: a tone at a pitch set by the prompt; its phase starts at 0 unless `audio_offset`
  (samples already generated) is given.

None of this is MiniMax-H3. The generator was written to have the information bottleneck a real
segment-conditioned generator has, so that the measurements in `continuity` show which
discontinuities come from what the loop does not carry — not how large they are for a real model.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F

from ..errors import UserError

LATENT_DOWN = 4          # the "VAE" downsampling factor of the toy's latent
DETAIL_CHANNELS = 8
DETAIL_AMPLITUDE = 0.06
MAX_SPEED = 2            # pan speed range (pixels per frame), per axis
EVOLVE = 0.15            # radians per frame: how fast a segment's fine texture drifts between its two fields
DRIFT_SEED = 7_777_777   # seed offset of the second texture field


def prompt_seed(prompt: str) -> int:
    """A stable 31-bit integer from a prompt (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _net(prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy denoiser's fixed weights, drawn from the prompt: (3x3 conv C->C, 1x1 conv C->3)."""
    g = torch.Generator().manual_seed(prompt_seed(prompt))
    w = torch.randn(DETAIL_CHANNELS, DETAIL_CHANNELS, 3, 3, generator=g) / math.sqrt(DETAIL_CHANNELS * 9)
    out = torch.randn(3, DETAIL_CHANNELS, 1, 1, generator=g) / math.sqrt(DETAIL_CHANNELS)
    return w, out


def scene(width: int, height: int, prompt: str, seed: int, device="cpu") -> torch.Tensor:
    """A first frame [1, H, W, 3] in [0, 1]: smooth colour fields and three soft discs, all from
    (prompt, seed), plus the prompt's fine texture."""
    check_size(width, height)
    g = torch.Generator().manual_seed(prompt_seed(prompt) ^ seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    base = torch.rand(3, generator=g) * 0.5 + 0.25
    tilt = (torch.rand(3, 2, generator=g) - 0.5) * 0.4
    img = base[:, None, None] + tilt[:, 0, None, None] * yy + tilt[:, 1, None, None] * xx
    for _ in range(3):
        cy, cx, r = torch.rand(3, generator=g).tolist()
        colour = torch.rand(3, generator=g)
        d2 = (yy - cy) ** 2 + (xx - cx) ** 2
        mask = torch.exp(-d2 / (2 * (0.08 + 0.12 * r) ** 2))
        img = img * (1 - mask) + colour[:, None, None] * mask
    img = img.to(device) + detail(height, width, prompt, seed, steps=4, device=device)
    return img.clamp(0, 1).permute(1, 2, 0)[None].contiguous()


def check_size(width: int, height: int) -> None:
    if width % LATENT_DOWN or height % LATENT_DOWN or width < 2 * LATENT_DOWN or height < 2 * LATENT_DOWN:
        raise UserError(f"width and height must be multiples of {LATENT_DOWN} and >= {2 * LATENT_DOWN}, "
                         f"got {width}x{height}")


def detail(height: int, width: int, prompt: str, seed: int, steps: int, device="cpu") -> torch.Tensor:
    """Fine texture [3, H, W], zero-mean over each 4x4 block, from noise (drawn on the CPU, so every
    device gets the same noise) refined by `steps` passes of the prompt's net on `device`."""
    w, out = (t.to(device) for t in _net(prompt))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, DETAIL_CHANNELS, height, width, generator=g).to(device)
    for _ in range(steps):
        x = x + 0.5 * (torch.tanh(F.conv2d(x, w, padding=1)) - x)
    d = F.conv2d(x, out)[0]
    d = d - F.avg_pool2d(d[None], LATENT_DOWN).repeat_interleave(LATENT_DOWN, -1).repeat_interleave(LATENT_DOWN, -2)[0]
    return DETAIL_AMPLITUDE * d / d.std().clamp_min(1e-6)


def encode(frame: torch.Tensor) -> torch.Tensor:
    """[1, H, W, 3] -> latent [1, 3, H/4, W/4]: what the generator keeps of a conditioning frame."""
    return F.avg_pool2d(frame.permute(0, 3, 1, 2), LATENT_DOWN)


def decode(latent: torch.Tensor) -> torch.Tensor:
    """latent [1, 3, h, w] -> [3, H, W] (bilinear: the coarse picture, no fine detail)."""
    return F.interpolate(latent, scale_factor=LATENT_DOWN, mode="bilinear", align_corners=False)[0]


def estimate_shift(prev: torch.Tensor, cur: torch.Tensor, radius: int = MAX_SPEED + 1) -> tuple[int, int]:
    """The whole-pixel pan (dy, dx) that best maps frame `prev` onto `cur` ([H, W, 3] or [1, H, W, 3]),
    by exhaustive search over |dy|, |dx| <= radius (mean absolute error)."""
    prev, cur = prev.reshape(prev.shape[-3:]), cur.reshape(cur.shape[-3:])
    best, arg = math.inf, (0, 0)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            err = float((torch.roll(prev, (dy, dx), dims=(0, 1)) - cur).abs().mean())
            if err < best - 1e-9:
                best, arg = err, (dy, dx)
    return arg


def generate_segment(context: torch.Tensor, prompt: str, frames: int, seed: int, index: int, *,
                     steps: int = 8, fps: int = 24, sample_rate: int = 32000, audio_offset: int | None = None):
    """One segment of `frames` frames continuing from the last frame of `context` [k, H, W, 3]
    (which is not repeated); with k >= 2 the pan of the last two frames is continued.

    Returns (frames [T, H, W, 3] float32 in [0, 1], audio {"waveform": [2, N], "sample_rate"}),
    with N = round(T / fps * sample_rate). `seed + index` seeds the segment's own randomness."""
    if context.ndim != 4 or context.shape[0] < 1 or context.shape[-1] != 3:
        raise ValueError(f"context must be frames [k, H, W, 3] with k >= 1, got {tuple(context.shape)}")
    if frames < 1:
        raise UserError(f"frames must be >= 1, got {frames}")
    if steps < 1:
        raise UserError(f"steps must be >= 1, got {steps}")
    first = context[-1:].float()
    H, W = first.shape[1:3]
    check_size(W, H)
    seg_seed = seed + index
    g = torch.Generator().manual_seed(seg_seed * 7919 + 1)
    if context.shape[0] >= 2:
        velocity = estimate_shift(context[-2].float(), first)
    else:
        velocity = (0, 0)
        while velocity == (0, 0):
            velocity = tuple(int(v) for v in torch.randint(-MAX_SPEED, MAX_SPEED + 1, (2,), generator=g))
    coarse = decode(encode(first))                                                    # [3, H, W]
    # Two texture fields the segment drifts between, so that frames inside a segment are not pure
    # pixel shifts of each other (the texture evolves by EVOLVE radians per frame).
    d1 = detail(H, W, prompt, seg_seed, steps, device=first.device)
    d2 = detail(H, W, prompt, seg_seed + DRIFT_SEED, steps, device=first.device)
    out = torch.stack([torch.roll(coarse + math.cos(EVOLVE * t) * d1 + math.sin(EVOLVE * t) * d2,
                                  (velocity[0] * t, velocity[1] * t), dims=(1, 2))
                       for t in range(1, frames + 1)])
    video = out.clamp(0, 1).permute(0, 2, 3, 1).contiguous()
    n = int(round(frames / fps * sample_rate))
    start = 0 if audio_offset is None else int(audio_offset)
    f0 = 200.0 + (prompt_seed(prompt) % 2000) / 10   # 200-400 Hz, set by the prompt
    t = (torch.arange(n, dtype=torch.float64) + start) / sample_rate
    tone = 0.3 * torch.sin(2 * math.pi * f0 * t)
    audio = torch.stack([tone, 0.8 * tone]).float()
    return video, {"waveform": audio, "sample_rate": sample_rate, "velocity": velocity}


# ---------------------------------------------------------------------------
# What a loop-built clip keeps and loses at its segment boundaries


def continuity(video: torch.Tensor, audio: torch.Tensor, *, first_segment_start: int, segment_frames: int,
               segment_samples: int) -> dict:
    """Frame-to-frame change, pan and audio smoothness, inside segments vs at their boundaries.

    `video` [T, H, W, 3]: frame `first_segment_start + k * segment_frames` is the first frame of
    segment k, so the pair (b - 1, b) at each such b >= 1 is a boundary. `audio` [C, N] starts with
    segment 0 and has `segment_samples` samples per segment. Audio smoothness is the second
    difference |x[s] - 2 x[s-1] + x[s-2]| (small for a continuous tone, large where its value or
    slope jumps), taken at the first sample of each segment k >= 1 vs everywhere else.
    The motion-compensated *residual* (frame i panned by its estimated pan, minus frame i + 1) is the
    change that motion does not explain: appearance and identity. Returns the means (frame change,
    residual, pan change) and maxima (audio) of both groups, and `series`: one row per frame pair."""
    T = video.shape[0]
    bounds = [first_segment_start + k * segment_frames for k in range(T)]
    bounds = [b for b in bounds if 1 <= b < T]
    v = video.float()
    # Pans are estimated on blurred frames (a circular box blur commutes with the circular pan), so
    # that a change of fine texture does not pass for a change of motion.
    blurred = _box_blur(v)
    shifts = [estimate_shift(blurred[i], blurred[i + 1]) for i in range(T - 1)]
    raw = (v[1:] - v[:-1]).abs().mean(dim=(1, 2, 3))                                # pair (i, i+1) at i
    resid = torch.stack([(torch.roll(v[i], shifts[i], dims=(0, 1)) - v[i + 1]).abs().mean() for i in range(T - 1)])
    is_b = torch.zeros(T - 1, dtype=torch.bool)
    for b in bounds:
        is_b[b - 1] = True

    def dv(i):  # change of pan between pair i-1 and pair i, in pixels (L1)
        return abs(shifts[i][0] - shifts[i - 1][0]) + abs(shifts[i][1] - shifts[i - 1][1])
    pan_at = [dv(b - 1) for b in bounds if b - 2 >= 0]
    pan_in = [dv(i) for i in range(1, T - 1) if not is_b[i] and not is_b[i - 1]]
    wav = audio.double()
    d2 = (wav[:, 2:] - 2 * wav[:, 1:-1] + wav[:, :-2]).abs().amax(dim=0)   # index j: sample s = j + 2
    starts = [k * segment_samples for k in range(1, wav.shape[1] // max(segment_samples, 1) + 1)]
    starts = [s for s in starts if 2 <= s < wav.shape[1] - 1]
    mask = torch.zeros(d2.shape[0], dtype=torch.bool)
    for s in starts:            # a jump at s shows in the second differences at s and s + 1
        mask[s - 2:s] = True
    a_at, a_in = d2[mask], d2[~mask]

    def mean(x):
        return float(x.mean()) if len(x) else math.nan
    out = {
        "boundaries": len(bounds),
        "frame_change_inside": mean(raw[~is_b]), "frame_change_boundary": mean(raw[is_b]),
        "residual_inside": mean(resid[~is_b]), "residual_boundary": mean(resid[is_b]),
        "pan_change_inside_px": float(sum(pan_in) / len(pan_in)) if pan_in else math.nan,
        "pan_change_boundary_px": float(sum(pan_at) / len(pan_at)) if pan_at else math.nan,
        "audio_jump_inside_max": float(a_in.max()) if len(a_in) else math.nan,
        "audio_jump_boundary_max": float(a_at.max()) if len(a_at) else math.nan,
        "series": [{"pair": i + 1, "frame_change": float(raw[i]), "residual": float(resid[i]),
                    "pan": list(shifts[i]), "boundary": bool(is_b[i])} for i in range(T - 1)],
    }
    return out


def _box_blur(frames: torch.Tensor, k: int = 5) -> torch.Tensor:
    """[T, H, W, 3] -> the same, each pixel the mean of its k x k neighbourhood (wrapping at edges)."""
    x = frames.permute(0, 3, 1, 2)
    x = F.pad(x, (k // 2,) * 4, mode="circular")
    return F.avg_pool2d(x, k, stride=1).permute(0, 2, 3, 1)
