"""How ComfyUI decodes with H3's own (ViT) decoder and budgets its memory (`comfy/sd.py`, the MiniMax-H3 branch).

sd.py, for H3's video VAE:

- `memory_used_decode(shape, dtype)` = (9.5 x frames x H x W + fixed) x dtype size x 1.03, where `frames` is
  capped at one decoded temporal chunk (plus two frames): "one decoded temporal chunk (with overlap) is all that
  ever sits in VRAM". `load_models_gpu(memory_required=...)` keeps that much free beside the weights.
- The output is preallocated on the *intermediate* (output) device in `vae_output_dtype()` (fp32) and each
  decoded chunk is written into it (`output_buffer=`), so the whole clip never exists on the GPU.
- When that does not fit, the model tiles internally (`handles_tiling`): spatial tiles of 256 pixels with a
  quarter overlap, each tile's estimate within the per-tile budget (128 MiB).

Ours, for the ViT3D decoder of `vae.py`:

- `decode_estimate` counts the elements a block holds at its peak per token (x, the qkv projection, q and k
  after RMSNorm + RoPE, the attention output, the FFN's gate|up and its SwiGLU, the block output) plus the
  decoded pixels of the resident chunk: the same form as sd.py's (elements per pixel x resident frames x H x W),
  derived from the model instead of fitted to it.
- `decode_streamed` decodes temporal chunks of `chunk` latent frames with `context` frames of context on each
  side (the decoder's attention is global in time, so a chunk is an approximation, as upstream's token overlap
  is), each chunk in spatial tiles sized by `choose_tile` to the per-tile budget, tiles at their true positions
  in the grid (token ids with the full grid's offset) and blended with linear ramps; every finished chunk goes
  to the fp32 output buffer on `output_device`.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from .fused import Ops
from .tiled import split_tiles
from .vae import ViT3DDecoder

TILE_BUDGET_BYTES = 128 * 2 ** 20    # ComfyUI's per-tile budget for the H3 decoder
SAFETY = 1.03                        # sd.py's margin on every estimate


def elements_per_token(decoder: ViT3DDecoder) -> int:
    """Elements one token holds at a block's peak: x and the residual stream (2d), qkv (3d), q and k after
    RMSNorm + RoPE (2d), the attention output (d), gate|up (2F) and SwiGLU (F), the block output (d)."""
    d, F_ = decoder.cfg.dim, decoder.cfg.ffn_mult * decoder.cfg.dim
    return 9 * d + 3 * F_


def fixed_workspace_bytes(decoder: ViT3DDecoder, measure_peak, device, dtype) -> int:
    """The estimate's `fixed` term, as sd.py's 110M / 270M elements are: measured once, the peak of decoding the
    smallest latent (1 frame, 2 x 2) minus what the per-token term counts for it (library workspace, weight
    copies a backend makes per call). `measure_peak(fn) -> bytes`."""
    z = torch.zeros(1, decoder.cfg.z_dim, 1, 2, 2, device=device, dtype=dtype)
    with torch.no_grad():
        peak = measure_peak(lambda: decoder(z))
    return max(0, int(peak - decode_estimate(decoder, (1, 2, 2), z.element_size())["bytes"] / SAFETY))


def decode_estimate(decoder: ViT3DDecoder, latent_thw, itemsize: int, *, resident_frames: int | None = None,
                    fixed_bytes: int = 0) -> dict:
    """sd.py's `memory_used_decode` form for our decoder: bytes beyond the weights that decoding a latent of
    (T, h, w) holds at once, with at most `resident_frames` latent frames resident (one chunk plus its
    context). Returns {"bytes", "elements_per_pixel", "resident_frames"}."""
    cfg = decoder.cfg
    T, h, w = latent_thw
    Tr = T if resident_frames is None else min(T, resident_frames)
    tokens = Tr * h * w + cfg.register_tokens + 1
    pixels = cfg.patch_t * Tr * (cfg.patch * h) * (cfg.patch * w)
    elements = tokens * elements_per_token(decoder) + 2 * 3 * pixels   # the block's peak + the decoded chunk (twice:
    # the projection's output and its pixel-order copy)
    return {"bytes": int((elements * itemsize + fixed_bytes) * SAFETY), "elements_per_pixel": elements / pixels,
            "resident_frames": Tr}


def choose_tile(decoder: ViT3DDecoder, resident_frames: int, h: int, w: int, itemsize: int,
                budget: int = TILE_BUDGET_BYTES, fixed_bytes: int = 0) -> tuple[int, int, str]:
    """The largest tile (th, tw) in latent pixels, halving the longer side from the whole grid, whose
    estimate fits `budget`; (th, tw, why). At least 2 x 2."""
    th, tw = h, w
    est = lambda: decode_estimate(decoder, (resident_frames, th, tw), itemsize, fixed_bytes=fixed_bytes)["bytes"]  # noqa
    while est() > budget and max(th, tw) > 2:
        if th >= tw:
            th = max(2, -(-th // 2))
        else:
            tw = max(2, -(-tw // 2))
    est = est()
    why = (f"tile {th}x{tw} latent px: estimate {est} B within the per-tile budget {budget} B" if est <= budget else
           f"tile {th}x{tw} latent px is the smallest; its estimate {est} B exceeds the budget {budget} B")
    return th, tw, why


def _ramp(n: int, lo_edge: bool, hi_edge: bool, ov: int) -> torch.Tensor:
    """Blend weights along one axis of a tile: linear over `ov` pixels at an inner edge, 1 elsewhere."""
    r = torch.ones(n)
    if ov > 0:
        ramp = (torch.arange(ov, dtype=torch.float32) + 1) / (ov + 1)
        if lo_edge:
            r[:ov] = torch.minimum(r[:ov], ramp)
        if hi_edge:
            r[n - ov:] = torch.minimum(r[n - ov:], ramp.flip(0))
    return r


def decode_streamed(decoder: ViT3DDecoder, z: torch.Tensor, *, chunk: int, context: int = 1, overlap: int = 1,
                    tile_budget: int = TILE_BUDGET_BYTES, output_device="cpu", ops: Ops | None = None,
                    fixed_bytes: int = 0):
    """z [B, z_dim, T, h, w] -> (video fp32 [B, 3, patch_t T, p h, p w] on `output_device`, info). See the
    module docstring."""
    cfg = decoder.cfg
    if z.dim() != 5:
        raise UserError(f"latent must be [B, z, T, h, w], got {tuple(z.shape)}")
    if chunk < 1 or context < 0 or overlap < 0:
        raise UserError(f"chunk must be >= 1 and context, overlap >= 0, got {chunk}, {context}, {overlap}")
    ops = ops if ops is not None else Ops("eager")
    B, _, T, h, w = z.shape
    p, pt = cfg.patch, cfg.patch_t
    out = torch.zeros(B, 3, pt * T, p * h, p * w, device=output_device, dtype=torch.float32)
    wsum = torch.zeros(1, 1, 1, p * h, p * w, device=output_device, dtype=torch.float32)
    resident = min(T, chunk + 2 * context)
    th, tw, why = choose_tile(decoder, resident, h, w, z.element_size(), tile_budget, fixed_bytes)
    ys, _ = split_tiles(h, th, overlap) if th < h else ([0], [])
    xs, _ = split_tiles(w, tw, overlap) if tw < w else ([0], [])
    ov = overlap * p
    chunks = 0
    with torch.no_grad():
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            lo, hi = max(0, t0 - context), min(T, t1 + context)
            for y in ys:
                for x in xs:
                    piece = decoder(z[:, :, lo:hi, y:y + th, x:x + tw], ops, full=(T, h, w), offset=(lo, y, x))
                    piece = piece[:, :, pt * (t0 - lo):pt * (t1 - lo)].to(output_device, torch.float32)
                    wy = _ramp(p * min(th, h), y > 0, y + th < h, ov).to(output_device)
                    wx = _ramp(p * min(tw, w), x > 0, x + tw < w, ov).to(output_device)
                    m = (wy[:, None] * wx[None, :])[None, None, None]
                    # each tile goes straight to the fp32 buffer on the intermediate device: the compute device
                    # holds one tile of one chunk at a time
                    out[:, :, pt * t0:pt * t1, p * y:p * (y + th), p * x:p * (x + tw)].addcmul_(piece, m)
                    if t0 == 0:
                        wsum[..., p * y:p * (y + th), p * x:p * (x + tw)] += m
                    del piece
            chunks += 1
        out /= wsum
    info = {"chunks": chunks, "chunk": chunk, "context": context, "tile": (th, tw), "tiles_per_chunk": len(ys) * len(xs),
            "tile_reason": why, "resident_frames": resident, "output_bytes": out.numel() * out.element_size() + wsum.numel() * 4,
            "estimate_bytes": decode_estimate(decoder, (resident, th, tw), z.element_size(), fixed_bytes=fixed_bytes)["bytes"]}
    return out, info
