"""The store: the host tier in the middle, slower tiers below it, fed from the host copy."""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ...errors import UserError
from .file_tier import FileTier
from .host_cache import HostTier
from .layout import BlockLayout
from .peer import PeerTier
from .reuse import ReuseTracker


@dataclass
class Fetched:
    """Rows of a restored prefix, in host memory and pinned until `release()`."""

    store: "TieredKVStore"
    keys: list[str]
    rows: list[torch.Tensor]
    sources: list[str]                         # tier each block came from
    _slots: list[int | None] = field(default_factory=list)

    def release(self) -> None:
        for s in self._slots:
            if s is not None:
                self.store.host.unpin(s)
        self._slots = []


class TieredKVStore:
    """Host tier plus optional filesystem and peer tiers for rows of one `BlockLayout`.

    offload: `reserve` host rows, copy into them (the caller's copy: device -> host), `commit`
    (publish; queue background writes of each admitted row to every slower tier). lookup: longest
    prefix of keys present in any tier. fetch: bring that prefix into host rows, verified.

    Eviction: the host tier is an LRU cache over published rows (a fetch or a repeated offload
    refreshes a row); rows pinned by a copy, a reader or a pending slow-tier write are never
    evicted. The file tier (with `file_capacity_bytes`) and the peer are LRU too.

    Admission into the slow tiers is gated on reuse, as vLLM's `FilterReusedOffloadingManager`
    gates its stores: a block is written below the host only once it has been used
    `admit_after` times (each offload of a request that held it counts one use: its first
    computation, and every later request that reused it from the device or a tier). With
    `admit_after=1` every offloaded block is written below. Uses are counted in a bounded LRU
    table of `max_tracked` keys.

    `file_secret`: the file tier's HMAC key (default: drawn by the tier, so only this store can read its
    files); a store given the same key reads the files another wrote, e.g. an engine at another TP size."""

    def __init__(self, layout: BlockLayout, ns: str, *, host_capacity_blocks: int, pin: bool = False,
                 file_dir: str | os.PathLike | None = None, file_capacity_bytes: int | None = None,
                 durable: bool = True, peer_address: tuple[str, int] | None = None, peer_timeout_s: float = 2.0,
                 peer_secret: str | None = None, background: bool = True, admit_after: int = 1,
                 max_tracked: int = 1 << 16, file_secret: bytes | None = None):
        if isinstance(admit_after, bool) or not isinstance(admit_after, int) or admit_after < 1:
            raise UserError(f"admit_after={admit_after!r} must be a positive int (uses before a block goes below host)")
        self.admit_after = admit_after
        self.reuse = ReuseTracker(admit_after, max_tracked)  # key -> uses seen (bounded, LRU)
        self.admitted: set[str] = set()                      # keys queued for (or written to) the slow tiers
        self.not_admitted = 0                                # commits kept in host only: not reused (yet)
        self.layout, self.ns = layout, ns
        self.row_bytes = layout.nbytes
        self.host = HostTier(host_capacity_blocks, self.row_bytes, pin=pin)
        self.lower: list = []
        if file_dir is not None:
            self.lower.append(FileTier(file_dir, ns, self.row_bytes, capacity_bytes=file_capacity_bytes, durable=durable,
                                        secret=file_secret))
        if peer_address is not None:
            self.lower.append(PeerTier(peer_address, self.row_bytes, timeout_s=peer_timeout_s, secret=peer_secret))
        self.background = background
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._writer = None
        if self.lower and background:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    @property
    def tiers(self) -> list:
        return [self.host] + self.lower

    def tier(self, name: str):
        for t in self.tiers:
            if t.name == name:
                return t
        raise UserError(f"no tier {name!r} in this store; it has {[t.name for t in self.tiers]}")

    # -- offload -----------------------------------------------------------------
    def reserve(self, key: str, count: bool = True) -> int | None:
        """A host row for `key` (see `HostTier.reserve`); a refusal is counted as skipped unless
        `count` is False (a caller that retries counts its own give-ups)."""
        slot = self.host.reserve(key)
        if slot is None and count and not self.host.contains(key):
            self.host.stats.skipped += 1
        return slot

    def note_use(self, key: str) -> int:
        """Count one use of `key` (see the class docstring); returns its count."""
        return self.reuse.note(key)

    def _admit(self, key: str) -> bool:
        with self.host.lock:
            if not self.lower or key in self.admitted:
                return False
            if not self.reuse.eligible(key):
                return False
            self.admitted.add(key)
            return True

    def _queue_lower(self, key: str, slot: int) -> None:
        with self._idle:
            self._outstanding += 1
        if self._writer is not None:
            self._jobs.put((key, slot))     # the row stays pinned until written everywhere
        else:
            self._write_lower(key, slot)

    def admit_if_reused(self, key: str) -> bool:
        """A block already in the host tier that has now been used often enough: write it below,
        from its host row. True if a write was queued."""
        if not self._admit(key):
            return False
        slot = self.host.get(key)          # pinned until written
        if slot is None:                   # evicted meanwhile: nothing to write from
            with self.host.lock:
                self.admitted.discard(key)
            return False
        self._queue_lower(key, slot)
        return True

    def commit(self, items: list[tuple[str, int]]) -> None:
        """Publish rows whose copy has completed, then write the admitted ones to slower tiers
        from host memory."""
        for key, slot in items:
            if not isinstance(slot, int):
                raise TypeError(f"commit needs the int slot `reserve` returned for {key[:12]}, got {slot!r}")
            self.host.publish(key, slot)
            self.host.stats.writes += 1
            self.host.stats.bytes_written += self.row_bytes
            if self._admit(key):
                self._queue_lower(key, slot)
            else:
                if self.lower:
                    self.not_admitted += 1
                self.host.unpin(slot)

    def _write_lower(self, key: str, slot: int) -> None:
        try:
            row = self.host.row(slot)
            for t in self.lower:
                if not getattr(t, "disabled", False) and t.contains(key):
                    continue         # already there (same key, same bytes): written once
                t.put(key, row)      # never raises; failures are counted in t.stats
        finally:
            self.host.unpin(slot)
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._write_lower(*job)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued background write is done (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(timeout=left)
        return True

    def close(self) -> None:
        self.flush(timeout_s=30.0)
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(timeout=10)
            self._writer = None
        for t in self.lower:
            if isinstance(t, PeerTier):
                t.close()

    # -- lookup and fetch -----------------------------------------------------------
    def lookup(self, keys: list[str]) -> list[str]:
        """Tier name of each block of the longest prefix of `keys` found anywhere (host first).
        A query only: it moves nothing and counts nothing (`fetch` counts lookups and hits)."""
        found = []
        for key in keys:
            where = None
            for t in self.tiers:
                if getattr(t, "disabled", False):
                    continue
                if t.contains(key):
                    where = t.name
                    break
            if where is None:
                break
            found.append(where)
        return found

    def fetch(self, keys: list[str]) -> Fetched:
        """Bring the longest available prefix of `keys` into host rows (promoting lower-tier blocks
        into the host tier). Stops at the first block that is missing, corrupt or timed out."""
        out = Fetched(self, [], [], [])
        for key in keys:
            self.host.stats.lookups += 1
            slot = self.host.get(key)
            if slot is not None:
                self.host.stats.hits += 1
                self.host.stats.reads += 1
                self.host.stats.bytes_read += self.row_bytes
                out.keys.append(key), out.rows.append(self.host.row(slot)), out.sources.append("host")
                out._slots.append(slot)
                continue
            got = False
            for t in self.lower:
                if getattr(t, "disabled", False):
                    continue
                t.stats.lookups += 1
                if not t.contains(key):
                    continue
                slot = self.host.reserve(key)
                row = self.host.row(slot) if slot is not None else torch.empty(self.row_bytes, dtype=torch.uint8)
                if t.read_into(key, row):
                    t.stats.hits += 1
                    if slot is not None:
                        self.host.publish(key, slot)    # promoted: the host tier caches it from now on
                    out.keys.append(key), out.rows.append(row), out.sources.append(t.name)
                    out._slots.append(slot)
                    got = True
                    break
                if slot is not None:
                    self.host.abandon(key, slot)
            if not got:
                break
        return out

    def stats(self) -> dict[str, dict]:
        return {t.name: t.stats.as_dict() for t in self.tiers}
