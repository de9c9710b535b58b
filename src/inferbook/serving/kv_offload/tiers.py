"""What every tier reports: lookups, hits, bytes and latency each way, failures.

The tiers, fastest first: `host_cache.HostTier` (a slab of host rows), `file_tier.FileTier` (one
authenticated file per block), `peer.PeerTier` (a second process on loopback). Each has
`name`, `stats: TierStats`, `contains(key)`, `put(key, row)` and `read_into(key, row)`; a failing
tier counts and returns a miss, it never raises into the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

TIER_NAMES = ("host", "file", "peer")


@dataclass
class TierStats:
    """What one tier did: lookups and hits (per block), bytes and latency each way, failures."""

    name: str
    lookups: int = 0
    hits: int = 0
    writes: int = 0
    reads: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    evictions: int = 0
    failures: int = 0        # writes that raised (unwritable, full, peer gone)
    skipped: int = 0         # writes not attempted: tier disabled after failures, or host full of pinned rows
    corrupt: int = 0         # reads whose checksum or length did not match (treated as misses)
    timeouts: int = 0        # peer reads or writes that timed out or ended early (treated as misses)
    last_error: str = ""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["hit_rate"] = self.hit_rate
        d["write_gbps"] = self.bytes_written / self.write_s / 1e9 if self.write_s > 0 else 0.0
        d["read_gbps"] = self.bytes_read / self.read_s / 1e9 if self.read_s > 0 else 0.0
        return d
