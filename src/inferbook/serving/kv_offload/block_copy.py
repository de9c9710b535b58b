"""The engine's paged KV pool <-> host rows: which pieces of device memory one block is, and the
copies that move them."""
from __future__ import annotations

import hashlib

import torch

from .layout import BlockLayout, row_memoryview

CROSS_LAYER = "cross_layer"
LAYER_MAJOR = "layer_major"
KV_LAYOUTS = (CROSS_LAYER, LAYER_MAJOR)


def use_cross_layer_blocks(runner) -> None:
    """Re-lay the runner's paged KV pool so that one block of every layer, K and V, is one contiguous
    piece of memory: `runner.kv_blocks` [blocks, layers, 2, block_size, kv_heads, head_dim], with
    `k_cache`/`v_cache` per-layer strided views [layers, blocks, block_size, kv_heads, head_dim]
    (vLLM's cross-layer KV layout). Offloading a block is then one copy, not 2 x layers. Only
    before any request has run (the pool's contents are not carried over)."""
    L, slots, Hkv, D = runner.k_cache.shape
    bs = runner.block_size
    kv = torch.zeros((slots // bs, L, 2, bs, Hkv, D), dtype=runner.k_cache.dtype, device=runner.k_cache.device)
    runner.kv_blocks = kv
    runner.k_cache = kv[:, :, 0].transpose(0, 1)      # [L, blocks, bs, Hkv, D], a view
    runner.v_cache = kv[:, :, 1].transpose(0, 1)
    runner.kv_layout = CROSS_LAYER


def staged_source(staged: torch.Tensor):
    """A stand-in runner whose 'device blocks' are the rows of a staging tensor [n, layers, 2,
    block_size, kv_heads, head_dim] (a TP engine's merged blocks, `TPModelRunner.gather_blocks`):
    `copy_blocks_to_rows` then moves staged block i into a host row as it moves a device block."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_blocks=staged, k_cache=staged, kv_layout=CROSS_LAYER, block_size=staged.shape[3])


def runner_kv_layout(runner) -> str:
    return getattr(runner, "kv_layout", LAYER_MAJOR)


def engine_layout(runner) -> BlockLayout:
    """One block's host row. Cross-layer pool: one field `kv` [layers, 2, block_size, kv_heads, head_dim]
    (the device block's own bytes). Layer-major pool: `k` and `v`, each [layers, block_size, kv_heads, head_dim]."""
    state = getattr(runner, "state_blocks", None)     # a hybrid model's recurrent state slot per block
    extra = (("state", state.dtype, tuple(state.shape[1:])),) if state is not None else ()
    if runner_kv_layout(runner) == CROSS_LAYER:
        _, L, two, bs, Hkv, D = runner.kv_blocks.shape
        return BlockLayout((("kv", runner.dtype, (L, two, bs, Hkv, D)),) + extra)
    L, _, Hkv, D = runner.k_cache.shape
    shape = (L, runner.block_size, Hkv, D)
    return BlockLayout((("k", runner.dtype, shape), ("v", runner.dtype, shape)) + extra)


def block_pieces(runner, block: int) -> list[torch.Tensor]:
    """The device memory of one block, as the contiguous pieces a copy moves: 1 for a cross-layer
    pool, 2 x layers for a layer-major one (K and V of each layer); a hybrid runner's recurrent
    state slot of the block is one more."""
    state = getattr(runner, "state_blocks", None)
    extra = [state[block]] if state is not None else []
    if runner_kv_layout(runner) == CROSS_LAYER:
        return [runner.kv_blocks[block]] + extra
    bs = runner.block_size
    sl = slice(block * bs, (block + 1) * bs)
    return [c[i, sl] for c in (runner.k_cache, runner.v_cache) for i in range(c.shape[0])] + extra


def row_pieces(layout: BlockLayout, row: torch.Tensor) -> list[torch.Tensor]:
    """The host row cut into the same pieces as `block_pieces` (same order)."""
    v = layout.views(row)
    extra = [v["state"]] if "state" in v else []
    if "kv" in v:
        return [v["kv"]] + extra
    return [t[i] for t in (v["k"], v["v"]) for i in range(t.shape[0])] + extra


def swap_blocks_batch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """Every piece of one transfer in one call, as vLLM's `ops.swap_blocks_batch` moves a transfer's
    blocks with one batched memcpy from arrays of (src, dst, size). Here the one call is
    `torch._foreach_copy_`; across devices PyTorch still issues one memcpy per piece inside it
    (vLLM's `cudaMemcpyBatchAsync` is one driver call), so the batching saves Python and dispatch
    per block, not driver calls."""
    if dsts:
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def copy_blocks_to_rows(runner, layout: BlockLayout, pairs: list[tuple[int, torch.Tensor]], *,
                        non_blocking: bool | None = None) -> int:
    """Device blocks -> host rows in one batched copy (`swap_blocks_batch`) of every contiguous piece
    (see `block_pieces`); returns the number of pieces. Asynchronous into pinned rows on CUDA (the
    caller records an event); complete on return on CPU."""
    nb = runner.k_cache.device.type == "cuda" if non_blocking is None else non_blocking
    dsts, srcs = [], []
    for block, row in pairs:
        dsts += row_pieces(layout, row)
        srcs += block_pieces(runner, block)
    swap_blocks_batch(dsts, srcs, nb)
    return len(dsts)


def copy_rows_to_blocks(runner, layout: BlockLayout, pairs: list[tuple[int, torch.Tensor]]) -> int:
    """Host rows -> device blocks in one batched copy; asynchronous from pinned rows on CUDA."""
    nb = runner.k_cache.device.type == "cuda"
    dsts, srcs = [], []
    for block, row in pairs:
        dsts += block_pieces(runner, block)
        srcs += row_pieces(layout, row)
    swap_blocks_batch(dsts, srcs, nb)
    return len(dsts)


def model_fingerprint(model) -> str:
    """SHA-256 (first 16 hex) over the model's config and weights: part of every key's namespace."""
    h = hashlib.sha256(repr(getattr(model, "cfg", type(model).__name__)).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(row_memoryview(p.detach().cpu().contiguous().view(-1).view(torch.uint8)))
    return h.hexdigest()[:16]
