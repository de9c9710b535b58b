"""The host tier: a slab of rows (pinned on CUDA), an LRU over published rows that never evicts a
pinned one. A row is visible only after its copy completed (`reserve` -> copy -> `publish`)."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ...errors import UserError
from .tiers import TierStats


class HostTier:
    name = "host"

    def __init__(self, capacity_blocks: int, row_bytes: int, pin: bool = False):
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise UserError(f"host capacity_blocks={capacity_blocks!r} must be a positive int")
        self.capacity, self.row_bytes = capacity_blocks, row_bytes
        self.pinned_memory = bool(pin)
        self.slab = torch.empty((capacity_blocks, row_bytes), dtype=torch.uint8, pin_memory=self.pinned_memory)
        self.free_slots = list(range(capacity_blocks))[::-1]
        self.index: OrderedDict[str, int] = OrderedDict()   # published key -> slot, LRU order (oldest first)
        self.pending: set[str] = set()                       # keys being copied in: not visible yet
        self.pins = [0] * capacity_blocks                    # readers/writers holding a slot
        self.lock = threading.RLock()
        self.stats = TierStats("host")

    def row(self, slot: int) -> torch.Tensor:
        return self.slab[slot]

    def reserve(self, key: str) -> int | None:
        """A slot for `key`, not yet visible; evicts the least recently used unpinned row if needed.
        None when `key` is already stored or being stored, or every row is pinned."""
        with self.lock:
            if key in self.index or key in self.pending:
                return None
            if not self.free_slots:
                victim = next((k for k, s in self.index.items() if self.pins[s] == 0), None)
                if victim is None:
                    return None
                self.free_slots.append(self.index.pop(victim))
                self.stats.evictions += 1
            slot = self.free_slots.pop()
            self.pending.add(key)
            self.pins[slot] += 1
            return slot

    def publish(self, key: str, slot: int) -> None:
        """Make a fully copied row visible (and keep it pinned for the caller until `unpin`)."""
        with self.lock:
            self.pending.discard(key)
            self.index[key] = slot
            self.index.move_to_end(key)

    def abandon(self, key: str, slot: int) -> None:
        with self.lock:
            self.pending.discard(key)
            self.pins[slot] -= 1
            self.free_slots.append(slot)

    def get(self, key: str) -> int | None:
        """The slot of a published `key`, pinned for the caller (unpin when done), or None."""
        with self.lock:
            slot = self.index.get(key)
            if slot is None:
                return None
            self.index.move_to_end(key)
            self.pins[slot] += 1
            return slot

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self.index

    def touch(self, key: str) -> bool:
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
                return True
            return False

    def unpin(self, slot: int) -> None:
        with self.lock:
            self.pins[slot] -= 1

    def __len__(self) -> int:
        return len(self.index)
