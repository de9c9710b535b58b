"""Tiled VAE decode, batched by free memory (the seed's `tiled_decode`: up to four tiles per batch).

    video, info = decode_tiled(decoder, latent, tile=16, overlap=4, max_batch=4, memory_budget=None)

The latent is cut into spatial tiles of `tile` x `tile` latent pixels overlapping by `overlap`; each tile
is decoded on its own and the outputs are blended with feathered (linear-ramp) weights over the
overlaps. Tiles are decoded in batches: the batch size is the number of tiles whose *estimated* peak
memory fits in the free memory (`torch.cuda.mem_get_info` on a GPU, the `memory_budget` argument on a
CPU), at most `max_batch`, at least one; on a GPU an out-of-memory error halves the batch and retries.
Every chosen batch size is returned in `info`, so "four tiles never ran together" is visible, and is
not a failure.

Temporal tiles (`temporal_tile` latent frames each) are optional. The decoder is causal, so a temporal tile
needs no blending: it is decoded together with `temporal_context` past latent frames, whose outputs are
dropped. With context reaching back to frame 0 the result equals the full decode exactly (for a causal
decoder: RMSNorm, not GroupNorm, whose statistics span all frames); shorter context approximates it.
"""
from __future__ import annotations

import math

import torch

from .fused import Ops
from .vae import VideoVAEDecoder

LIVE_TENSORS = 4  # largest stage: padded conv input, conv output, residual input, shortcut, at once


def _positive_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def tile_starts(n: int, tile: int, overlap: int) -> list[int]:
    """Start offsets of tiles of length `tile` covering [0, n) with at least `overlap` shared; the last
    tile is aligned to the end, so every tile has the same size (one batchable shape)."""
    if tile >= n:
        return [0]
    stride = tile - overlap
    starts = list(range(0, n - tile, stride))
    if not starts or starts[-1] != n - tile:
        starts.append(n - tile)
    return starts


def feather(length: int, ramp_lo: int, ramp_hi: int, device=None) -> torch.Tensor:
    """1-D blend weights: linear ramps of `ramp_lo` / `ramp_hi` samples at the ends that meet a
    neighbouring tile (0 at an image border: nothing to blend with there). Strictly positive."""
    w = torch.ones(length, device=device)
    if ramp_lo > 0:
        w[:ramp_lo] = (torch.arange(ramp_lo, device=device) + 0.5) / ramp_lo
    if ramp_hi > 0:
        w[length - ramp_hi:] = torch.minimum(w[length - ramp_hi:],
                                             (torch.arange(ramp_hi, device=device).flip(0) + 0.5) / ramp_hi)
    return w


def estimate_tile_peak_bytes(decoder: VideoVAEDecoder, tile_latent: tuple[int, int, int], itemsize: int) -> int:
    """Peak memory of decoding one tile, estimated from the largest stage: LIVE_TENSORS padded activations
    of that stage, plus the decoded tile. `tile_latent` = (T, h, w) in latent pixels."""
    cfg = decoder.cfg
    T, h, w = tile_latent
    largest = cfg.channels[0] * (T + 2) * (h + 2) * (w + 2)
    for i, c in enumerate(cfg.channels):
        largest = max(largest, c * (T + 2) * (h + 2) * (w + 2))
        if i < len(cfg.channels) - 1:
            # upsampling: nearest copy at 2x plus the temporal conv's 2C output
            if cfg.temporal_up[i]:
                largest = max(largest, 2 * c * (T + 2) * (h + 2) * (w + 2))
                T = 2 * T - 1
            h, w = 2 * h, 2 * w
            largest = max(largest, c * (T + 2) * (h + 2) * (w + 2))
    out = 3 * T * h * w
    return int((LIVE_TENSORS * largest + out) * itemsize)


def choose_batch(n_tiles: int, per_tile: int, free: int | None, max_batch: int) -> tuple[int, str]:
    """Tiles per batch: as many as fit in `free` bytes (None: no limit known), within [1, max_batch]."""
    cap = min(max_batch, n_tiles)
    if free is None:
        return cap, f"no memory limit given: max_batch={max_batch}"
    fit = free // max(per_tile, 1)
    if fit >= cap:
        return cap, f"{cap} tile(s) fit: {fit} by estimate, capped at min(max_batch, tiles)"
    if fit >= 1:
        return int(fit), f"memory short: {fit} tile(s) of ~{per_tile / 2**20:.1f} MiB fit in {free / 2**20:.1f} MiB"
    return 1, f"memory short even for one tile (~{per_tile / 2**20:.1f} MiB > {free / 2**20:.1f} MiB): one at a time"


def decode_tiled(decoder: VideoVAEDecoder, latent: torch.Tensor, tile: int, overlap: int, max_batch: int = 4,
                 memory_budget: int | None = None, ops: Ops | None = None, temporal_tile: int | None = None,
                 temporal_context: int = 2):
    """Decode `latent` [B, z, T, h, w] tile by tile. Returns (video [B, 3, T', 8h, 8w], info).

    `tile`, `overlap`: latent pixels (tile > overlap >= 0). `memory_budget`: bytes available for the
    decode (required to limit batching on a CPU; on a GPU the smaller of it and the free memory).
    `info`: tiles, tile shape, per-tile estimate, free bytes used, and each batch's size and reason."""
    if not isinstance(latent, torch.Tensor) or latent.dim() != 5:
        raise ValueError(f"latent must be a 5-D tensor [B, z, T, h, w], got "
                         f"{tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__}")
    if latent.shape[1] != decoder.cfg.z_dim:
        raise ValueError(f"latent has {latent.shape[1]} channels, this decoder takes z_dim={decoder.cfg.z_dim}")
    _positive_int("tile", tile)
    _positive_int("overlap", overlap, minimum=0)
    _positive_int("max_batch", max_batch)
    if tile <= overlap:
        raise ValueError(f"tile ({tile}) must be larger than overlap ({overlap}): tiles would not advance")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")
    if temporal_tile is not None:
        _positive_int("temporal_tile", temporal_tile)
        _positive_int("temporal_context", temporal_context)
        if temporal_tile < latent.shape[2]:
            return _decode_temporal_tiles(decoder, latent, tile, overlap, max_batch, memory_budget, ops,
                                          temporal_tile, temporal_context)
    ops = ops if ops is not None else Ops("eager")
    B, _, T, h, w = latent.shape
    f = decoder.cfg.spatial_factor
    th, tw = min(tile, h), min(tile, w)
    hs, ws = tile_starts(h, th, overlap), tile_starts(w, tw, overlap)
    tiles = [(y, x) for y in hs for x in ws]
    per_tile = estimate_tile_peak_bytes(decoder, (T, th, tw), latent.element_size()) * B
    free = int(memory_budget) if memory_budget is not None else None
    if latent.is_cuda:
        gpu_free = torch.cuda.mem_get_info(latent.device)[0]
        free = gpu_free if free is None else min(free, gpu_free)
    batch, reason = choose_batch(len(tiles), per_tile, free, max_batch)

    out_shape = decoder.cfg.output_shape((B, decoder.cfg.z_dim, T, th, tw))
    Tout, oh, ow = out_shape[2], out_shape[3], out_shape[4]
    acc = torch.zeros(B, 3, Tout, h * f, w * f, device=latent.device, dtype=torch.float32)
    wsum = torch.zeros(1, 1, 1, h * f, w * f, device=latent.device, dtype=torch.float32)
    ramp = overlap * f
    batches = []
    i = 0
    while i < len(tiles):
        group = tiles[i:i + batch]
        z = torch.cat([latent[:, :, :, y:y + th, x:x + tw] for y, x in group], dim=0)
        try:
            with torch.no_grad():
                dec = decoder(z, ops)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch = max(1, batch // 2)
            reason = f"shrunk to {batch} after an out-of-memory error"
            torch.cuda.empty_cache()
            continue
        batches.append({"tiles": len(group), "reason": reason})
        for j, (y, x) in enumerate(group):
            wy = feather(oh, ramp if y > 0 else 0, ramp if y + th < h else 0, latent.device)
            wx = feather(ow, ramp if x > 0 else 0, ramp if x + tw < w else 0, latent.device)
            wt = wy[:, None] * wx[None, :]
            acc[:, :, :, y * f:y * f + oh, x * f:x * f + ow] += dec[j * B:(j + 1) * B].float() * wt
            wsum[..., y * f:y * f + oh, x * f:x * f + ow] += wt
        i += len(group)
    video = (acc / wsum).to(latent.dtype)
    info = {"tiles": len(tiles), "tile_latent": [T, th, tw], "overlap": overlap,
            "per_tile_estimate_bytes": per_tile, "free_bytes": free, "max_batch": max_batch,
            "batch_sizes": [b["tiles"] for b in batches], "batch_reasons": [b["reason"] for b in batches]}
    return video, info


def output_frames(decoder: VideoVAEDecoder, t: int) -> tuple[int, int]:
    """[first, last + 1) output frames that latent frame `t` produces (frame 0 makes one frame, every later
    one 2**u frames, u = number of temporal upsamplings)."""
    k = 2 ** sum(decoder.cfg.temporal_up)
    return (0, 1) if t == 0 else (k * (t - 1) + 1, k * t + 1)


def _decode_temporal_tiles(decoder, latent, tile, overlap, max_batch, memory_budget, ops, temporal_tile, context):
    """Temporal tiles of `temporal_tile` latent frames, each decoded (spatially tiled) with `context` past
    frames in front; the context's outputs are dropped, the rest concatenated."""
    T = latent.shape[2]
    parts, infos = [], []
    for t0 in range(0, T, temporal_tile):
        t1 = min(T, t0 + temporal_tile)
        c0 = max(0, t0 - context)
        video, info = decode_tiled(decoder, latent[:, :, c0:t1], tile, overlap, max_batch, memory_budget, ops)
        keep = output_frames(decoder, t0 - c0)[0]  # local index of t0 in this decode
        parts.append(video[:, :, keep:])
        infos.append(info)
    info = {**infos[0], "temporal_tiles": len(parts), "temporal_tile": temporal_tile, "temporal_context": context,
            "batch_sizes": [b for i in infos for b in i["batch_sizes"]],
            "batch_reasons": [r for i in infos for r in i["batch_reasons"]]}
    return torch.cat(parts, dim=2), info


def seam_mask(h: int, w: int, tile: int, overlap: int, factor: int) -> torch.Tensor:
    """Output pixels [H, W] (bool) inside any overlap band between tiles: where seams would show."""
    th, tw = min(tile, h), min(tile, w)
    m = torch.zeros(h * factor, w * factor, dtype=torch.bool)
    for starts, n, t, dim in ((tile_starts(h, th, overlap), h, th, 0), (tile_starts(w, tw, overlap), w, tw, 1)):
        for a, b in zip(starts[:-1], starts[1:]):
            lo, hi = b * factor, (a + t) * factor  # the region both tiles cover
            if dim == 0:
                m[lo:hi, :] = True
            else:
                m[:, lo:hi] = True
    return m


# ---------------------------------------------------------------------------------------------------
# CPU peak memory: a CPU has no caching allocator with counters, so we count tensors ourselves.

class _LiveTensorBytes:
    """A dispatcher hook that tracks every tensor storage created by an ATen op while it is active, and frees
    it from the count when the last tensor object referencing it dies. `peak` is the most bytes alive at once."""

    def __init__(self):
        self.cur = self.peak = 0
        self.live: dict[int, list[int]] = {}

    def release(self, key: int) -> None:
        e = self.live.get(key)
        if e is not None:
            e[1] -= 1
            if e[1] == 0:
                self.cur -= e[0]
                del self.live[key]

    def track(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key == 0:
                    continue
                if key in self.live:
                    self.live[key][1] += 1
                else:
                    self.live[key] = [st.nbytes(), 1]
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                weakref.finalize(t, self.release, key)


def peak_live_tensor_bytes(fn) -> tuple[object, int, str]:
    """Run `fn()` and return (result, peak bytes of tensors it created that were alive at once, how).

    Counted at the ATen dispatcher: every op's output storage from creation until the last tensor object
    using it is freed. Library scratch memory (oneDNN's convolution buffers) and tensors that existed before
    the call are not counted: it is the CPU's counterpart of `torch.cuda.max_memory_allocated` minus the
    memory allocated before, not of the process's resident size."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counter = _LiveTensorBytes()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counter.track(out)
            return out

    with _Mode():
        result = fn()
    return result, counter.peak, "peak bytes of live tensors created during the call (tracked at the ATen dispatcher)"


def tiles_for_budget_sweep(decoder: VideoVAEDecoder, latent: torch.Tensor, tile: int, overlap: int) -> dict:
    """Budgets that make the chooser pick 1, 2, 3 and 4 tiles per batch (for the chapter's sweep)."""
    B, _, T, h, w = latent.shape
    th, tw = min(tile, h), min(tile, w)
    per_tile = estimate_tile_peak_bytes(decoder, (T, th, tw), latent.element_size()) * B
    n = len(tile_starts(h, th, overlap)) * len(tile_starts(w, tw, overlap))
    return {k: int(math.floor((k + 0.5) * per_tile)) for k in range(1, min(4, n) + 1)} | {"per_tile": per_tile, "tiles": n}
