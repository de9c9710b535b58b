"""One block's host row, and the keys that name blocks.

`BlockLayout` packs the named tensors of one block (K and V of every layer, plus a hybrid model's
recurrent state) into one contiguous uint8 row, the unified host representation. `prefix_keys`
chains SHA-256 over the token ids of each full block, with model, block size, dtype and layout in
the namespace, so a key names exactly one block content.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from ...errors import UserError

@dataclass(frozen=True)
class BlockLayout:
    """Named tensors of one block, packed in order into one uint8 row (each field 64-byte aligned).

    fields: ((name, dtype, shape), ...). For the engine: k and v of shape [layers, block_size,
    kv_heads, head_dim]; a hybrid model adds its recurrent state at the block's last token."""

    fields: tuple

    def __post_init__(self):
        if not self.fields:
            raise UserError("a block layout needs at least one field")
        for f in self.fields:
            if len(f) != 3 or not isinstance(f[0], str) or not isinstance(f[1], torch.dtype):
                raise UserError(f"layout field {f!r} must be (name, torch dtype, shape)")

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        out, pos = {}, 0
        for name, dtype, shape in self.fields:
            n = dtype.itemsize * int(torch.Size(shape).numel())
            out[name] = (pos, n)
            pos += -(-n // 64) * 64
        return out

    @property
    def nbytes(self) -> int:
        last = self.fields[-1][0]
        start, n = self.offsets[last]
        return -(-(start + n) // 64) * 64

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into a uint8 row of `nbytes` (no copy)."""
        out = {}
        for name, dtype, shape in self.fields:
            start, n = self.offsets[name]
            out[name] = row[start:start + n].view(dtype).view(shape)
        return out

    def describe(self) -> str:
        return ";".join(f"{n}:{str(d).replace('torch.', '')}{list(s)}" for n, d, s in self.fields)


def namespace(model_id: str, block_size: int, dtype, layout: BlockLayout) -> str:
    """Everything besides the tokens that decides a block's bytes: model, block size, dtype, layout."""
    return f"model={model_id}|block_size={block_size}|dtype={str(dtype).replace('torch.', '')}|layout={layout.describe()}"


def prefix_keys(tokens, block_size: int, ns: str) -> list[str]:
    """SHA-256 hex key of every *full* block of `tokens`: key_i = H(key_{i-1}, namespace, block i's ids).

    A key therefore names the whole prefix up to the end of its block, in this namespace only."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UserError(f"block_size={block_size!r} must be a positive int")
    prev = hashlib.sha256(ns.encode()).digest()
    keys = []
    toks = [int(t) for t in tokens]
    for i in range(len(toks) // block_size):
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{block_size}q", *toks[i * block_size:(i + 1) * block_size]))
        prev = h.digest()
        keys.append(prev.hex())
    return keys



def row_memoryview(row: torch.Tensor) -> memoryview:
    return memoryview(row.numpy()).cast("B")
