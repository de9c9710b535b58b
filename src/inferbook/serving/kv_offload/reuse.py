"""Which blocks are worth storing: a block's uses counted in a bounded LRU table.

vLLM's `FilterReusedOffloadingManager` (`v1/kv_offload/reuse_manager.py`) wraps the CPU offload
manager: `lookup` counts every block hash it is asked about, and `prepare_store` drops the blocks
seen fewer than `store_threshold` times (default 2) *before* the backing manager reserves CPU
space, so a block no second request has asked for never crosses PCIe. The counts live in an
`OrderedDict` of at most `max_tracker_size` entries, least recently seen evicted first.

`ReuseTracker` is that counter; the store and the engine decide where it gates (see
`TieredKVStore` and `EngineKVTiers.offload`).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ...errors import UserError


class ReuseTracker:
    """Uses per key, at most `max_tracked` keys (LRU). `threshold`: uses before a key is eligible."""

    def __init__(self, threshold: int = 2, max_tracked: int = 1 << 16):
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise UserError(f"reuse threshold={threshold!r} must be a positive int")
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise UserError(f"max_tracked={max_tracked!r} must be a positive int")
        self.threshold, self.max_tracked = threshold, max_tracked
        self.counts: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def note(self, key: str) -> int:
        """Count one use of `key`; returns its count."""
        with self.lock:
            n = self.counts.pop(key, 0) + 1
            self.counts[key] = n
            while len(self.counts) > self.max_tracked:
                self.counts.popitem(last=False)
            return n

    def count(self, key: str) -> int:
        with self.lock:
            return self.counts.get(key, 0)

    def eligible(self, key: str) -> bool:
        """Used at least `threshold` times (always, for threshold 1)."""
        return self.threshold <= 1 or self.count(key) >= self.threshold

    def __len__(self) -> int:
        return len(self.counts)
