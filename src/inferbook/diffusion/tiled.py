"""Tiled VAE decode as ComfyUI's H3 VAE does it: tiles of a row batched by free memory (up to four),
blended into a preallocated canvas.

    video, info = decode_tiled(decoder, latent, tile=16, overlap=4, max_batch=4, memory_budget=None)

Geometry (`split_tiles`, ComfyUI's): N tiles of `tile` latent pixels per axis, the fewest whose overlaps are
all at least `overlap`; the spare length is spread over the overlaps one latent pixel at a time.

Blending (`tiled_decode`, ComfyUI's): tiles are visited row by row; each is cross-faded linearly with its
already-blended upper neighbour (the previous row's bottom strip) and its left neighbour (the previous tile's
right tail), and its part that no later tile overlaps is copied into a canvas allocated once.

Batching (`_decode_tile_row`, ComfyUI's): for each tile row, as many of its tiles as the free memory allows,
at most `max_batch` (four), at least one, are decoded in one call. Free memory is counted as ComfyUI's
`model_management.get_free_memory`: the device's free memory plus the caching allocator's reserved-but-
inactive bytes. ComfyUI divides it by a fixed 128 MiB per tile; we divide by an estimate from the decoder's
shape (`estimate_tile_peak_bytes`). With `memory_budget` (bytes the decode may hold on the device in all),
the decoder's weights and the output canvas are taken out of it first.

Temporal tiles (`temporal_tile` latent frames each) are optional. The decoder is causal (its GroupNorm is per
frame), so a temporal tile needs no blending: it is decoded together with `temporal_context` past latent
frames, whose outputs are dropped. With context reaching back to frame 0 the result equals the full decode;
shorter context approximates it.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from .fused import Ops
from .vae import VideoVAEDecoder
from ..words import count

LIVE_TENSORS = 4  # largest stage: padded conv input, conv output, residual input, shortcut, at once


def _positive_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UserError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def split_tiles(n: int, tile: int, overlap: int) -> tuple[list[int], list[int]]:
    """ComfyUI's split_tiles in latent pixels: (starts, overlaps). The fewest tiles of `tile` whose overlaps
    are all >= `overlap`, the spare length added to the overlaps one pixel at a time, first ones first."""
    if tile >= n:
        return [0], []
    N = math.ceil(n / tile)
    while tile * N - overlap * (N - 1) < n:
        N += 1
    overlaps = [overlap] * (N - 1)
    for i in range(tile * N - overlap * (N - 1) - n):
        overlaps[i % (N - 1)] += 1
    starts = [0]
    for o in overlaps:
        starts.append(starts[-1] + tile - o)
    return starts, overlaps


def tile_starts(n: int, tile: int, overlap: int) -> list[int]:
    return split_tiles(n, tile, overlap)[0]


def overlap_work_ratio(h: int, w: int, tile: int, overlap: int) -> float:
    """Predicted work of the tiled decode over the untiled one, for a decoder whose cost is proportional to
    the pixels it decodes: tiles x tile area / latent area (the overlaps are decoded twice or more)."""
    th, tw = min(tile, h), min(tile, w)
    n = len(tile_starts(h, th, overlap)) * len(tile_starts(w, tw, overlap))
    return n * th * tw / (h * w)


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """ComfyUI's blend: the first `extent` samples of b along `dim` cross-faded with the last `extent` of a
    (weights 1 - p/extent and p/extent, p = 0 .. extent-1); the rest of b unchanged."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent == 0:
        return b
    p = torch.arange(extent, device=b.device, dtype=torch.float32) / extent
    shape = [1] * a.ndim
    shape[dim] = extent
    wa, wb = (1 - p).view(shape), p.view(shape)
    blended = (a.narrow(dim, a.shape[dim] - extent, extent).float() * wa
               + b.narrow(dim, 0, extent).float() * wb).to(b.dtype)
    return torch.cat([blended, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def free_memory(device) -> tuple[int | None, str]:
    """Bytes free for new tensors, as ComfyUI's get_free_memory counts them: on CUDA the device's free memory
    plus what the caching allocator holds reserved but not active (it reuses that before asking the driver);
    on a CPU the available system memory (psutil as ComfyUI, else /proc/meminfo). Returns (bytes or None, how)."""
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        inactive = stats.get("reserved_bytes.all.current", 0) - stats.get("active_bytes.all.current", 0)
        free_cuda, _ = torch.cuda.mem_get_info(device)
        return int(free_cuda + inactive), "cuda mem_get_info free + allocator reserved-but-inactive"
    try:
        import psutil  # what ComfyUI uses; not a dependency of this project
        return int(psutil.virtual_memory().available), "psutil available system memory"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024, "/proc/meminfo MemAvailable"
    except (OSError, StopIteration, ValueError):
        return None, "no free-memory count on this system: no limit"


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def canvas_bytes(decoder: VideoVAEDecoder, latent_shape, itemsize: int) -> int:
    return math.prod(decoder.cfg.output_shape(tuple(latent_shape))) * itemsize


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
    fit = max(free, 0) // max(per_tile, 1)
    if fit >= cap:
        return cap, f"{count(cap, 'tile')} fit: {fit} by estimate, capped at min(max_batch, tiles in the row)"
    if fit >= 1:
        return int(fit), f"memory short: {count(int(fit), 'tile')} of ~{per_tile / 2**20:.3g} MiB fit in {free / 2**20:.3g} MiB"
    return 1, (f"memory short even for one tile (~{per_tile / 2**20:.3g} MiB > {max(free, 0) / 2**20:.3g} MiB): "
               "one at a time")


def _check_args(decoder, latent, tile, overlap, max_batch, memory_budget):
    if not isinstance(latent, torch.Tensor) or latent.dim() != 5:
        raise UserError(f"latent must be a 5-D tensor [B, z, T, h, w], got "
                        f"{tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__}")
    if latent.shape[1] != decoder.cfg.z_dim:
        raise UserError(f"latent has {latent.shape[1]} channels, this decoder takes z_dim={decoder.cfg.z_dim}")
    _positive_int("tile", tile)
    _positive_int("overlap", overlap, minimum=0)
    _positive_int("max_batch", max_batch)
    if tile <= overlap:
        raise UserError(f"tile ({tile}) must be larger than overlap ({overlap}): tiles would not advance")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise UserError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")


def decode_tiled(decoder: VideoVAEDecoder, latent: torch.Tensor, tile: int, overlap: int, max_batch: int = 4,
                 memory_budget: int | None = None, ops: Ops | None = None, temporal_tile: int | None = None,
                 temporal_context: int = 2):
    """Decode `latent` [B, z, T, h, w] tile by tile. Returns (video [B, 3, T', 8h, 8w], info).

    `tile`, `overlap`: latent pixels (tile > overlap >= 0). `memory_budget`: bytes the decode may hold on the
    device in all (weights, canvas, tiles); None: the free memory as ComfyUI counts it (`free_memory`).
    `info`: tiles, geometry, per-tile estimate, the budget's parts, each batch's size and reason."""
    _check_args(decoder, latent, tile, overlap, max_batch, memory_budget)
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
    ys, yov = split_tiles(h, th, overlap)
    xs, xov = split_tiles(w, tw, overlap)
    per_tile = estimate_tile_peak_bytes(decoder, (T, th, tw), latent.element_size()) * B
    out_shape = decoder.cfg.output_shape(tuple(latent.shape))
    canvas = torch.empty(out_shape, device=latent.device, dtype=latent.dtype)  # allocated once, before any tile
    w_bytes, c_bytes = weight_bytes(decoder), canvas.numel() * canvas.element_size()
    strip_bytes = B * 3 * out_shape[2] * (max(yov, default=0) * f) * out_shape[4] * latent.element_size()
    batches, frees = [], []
    out_y = 0
    strip = None
    for i, y in enumerate(ys):
        # free memory per row, as ComfyUI's _decode_tile_row asks for it
        if memory_budget is not None:
            free, how = int(memory_budget) - w_bytes - c_bytes - strip_bytes, \
                "memory_budget - weights - canvas - strip"
        else:
            free, how = free_memory(latent.device)
        frees.append(free)
        batch, reason = choose_batch(len(xs), per_tile, free, max_batch)
        row = latent[:, :, :, y:y + th]
        tiles = _decode_row(decoder, row, xs, tw, batch, reason, ops, batches)
        new_strip, left_tail, out_x, tile_h = None, None, 0, 0
        for j, x in enumerate(xs):
            t = next(tiles)
            if i > 0 and yov[i - 1]:
                t = blend(strip[..., x * f:(x + tw) * f], t, yov[i - 1] * f, dim=-2)
            if j > 0 and xov[j - 1]:
                t = blend(left_tail, t, xov[j - 1] * f, dim=-1)
            if j < len(xs) - 1 and xov[j]:
                left_tail = t[..., -xov[j] * f:].clone()
                t = t[..., :-xov[j] * f]
            if i < len(ys) - 1 and yov[i]:
                if new_strip is None:
                    new_strip = torch.empty(*t.shape[:-2], yov[i] * f, w * f, device=t.device, dtype=t.dtype)
                new_strip[..., out_x:out_x + t.shape[-1]] = t[..., -yov[i] * f:, :]
                t = t[..., :-yov[i] * f, :]
            canvas[..., out_y:out_y + t.shape[-2], out_x:out_x + t.shape[-1]].copy_(t)
            out_x += t.shape[-1]
            tile_h = t.shape[-2]
            del t
        strip = new_strip
        out_y += tile_h
    info = {"tiles": len(ys) * len(xs), "tile_latent": [T, th, tw], "overlap": overlap,
            "overlaps_h": yov, "overlaps_w": xov, "per_tile_estimate_bytes": per_tile,
            "free_bytes": frees, "free_how": how, "weight_bytes": w_bytes, "canvas_bytes": c_bytes,
            "max_batch": max_batch, "batch_sizes": [b["tiles"] for b in batches],
            "batch_reasons": [b["reason"] for b in batches],
            "predicted_work_ratio": overlap_work_ratio(h, w, tile, overlap)}
    return canvas, info


def _decode_row(decoder, row, xs, tw, batch, reason, ops, batches):
    """Yield the decoded tiles of one row, `batch` at a time (one decoder call per group); on a CUDA
    out-of-memory error the group is halved and retried."""
    k = 0
    while k < len(xs):
        group = xs[k:k + batch]
        z = torch.cat([row[..., x:x + tw] for x in group], dim=0)
        try:
            with torch.no_grad():
                dec = decoder(z, ops)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch, reason = max(1, batch // 2), f"shrunk to {max(1, batch // 2)} after an out-of-memory error"
            del z
            torch.cuda.empty_cache()
            continue
        batches.append({"tiles": len(group), "reason": reason})
        del z
        yield from dec.chunk(len(group))
        del dec
        k += len(group)


def batching_check(decoder: VideoVAEDecoder, latent: torch.Tensor, tile: int, overlap: int) -> dict:
    """Batching must not change the result beyond what the working precision itself costs: |batch 1 - batch 4|
    <= 2 x |decode(dtype) - decode(float64)| of the same tiling, max over the video (cuDNN, oneDNN may pick
    other algorithms for other batch sizes, and in bf16 those round differently)."""
    import copy

    one, i1 = decode_tiled(decoder, latent, tile, overlap, max_batch=1)
    four, i4 = decode_tiled(decoder, latent, tile, overlap, max_batch=4)
    d64 = copy.deepcopy(decoder).to(dtype=torch.float64)  # on the latent's device: a GPU's fp64 is fast enough
    ref, _ = decode_tiled(d64, latent.detach().double(), tile, overlap, max_batch=1)
    own = float((four.double() - ref).abs().max())
    diff = float((one.double() - four.double()).abs().max())
    tol = 2 * own + 4 * 2.0 ** -24 * float(ref.abs().max())
    return {"difference": diff, "precision_error": own, "tolerance": tol, "batches_1": i1["batch_sizes"],
            "batches_4": i4["batch_sizes"], "passed": diff <= tol and bool(torch.isfinite(four).all())}


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
    """Budgets that make the chooser pick 1 .. 4 tiles per batch (as far as a tile row has that many): the
    decoder's weights, the canvas and the blend strip, plus (k + 0.5) tiles' estimate."""
    B, _, T, h, w = latent.shape
    th, tw = min(tile, h), min(tile, w)
    per_tile = estimate_tile_peak_bytes(decoder, (T, th, tw), latent.element_size()) * B
    ys, yov = split_tiles(h, th, overlap)
    xs, _ = split_tiles(w, tw, overlap)
    f = decoder.cfg.spatial_factor
    out = decoder.cfg.output_shape(tuple(latent.shape))
    strip = B * 3 * out[2] * max(yov, default=0) * f * out[4] * latent.element_size()
    fixed = weight_bytes(decoder) + canvas_bytes(decoder, latent.shape, latent.element_size()) + strip
    budgets = {k: int(fixed + math.floor((k + 0.5) * per_tile)) for k in range(1, min(4, len(xs)) + 1)}
    return budgets | {"per_tile": per_tile, "tiles": len(ys) * len(xs), "per_row": len(xs), "fixed": fixed}
