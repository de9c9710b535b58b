"""KV blocks in tiers, with host memory in the middle: device -> host -> filesystem -> remote peer.

The seed (section 五, vLLM's Tiered KV Offloading write-up) describes a host-centred data path:
device KV is first copied to host DRAM and from there to slower storage; restore runs the other
way. The device blocks are freed as soon as the device-to-host copy completes; slower tiers are
written from the host copy in the background; on restore, device blocks are allocated only once
the data is in host memory. The host tier is a cache in its own right, not only a relay.

One file per question, as vLLM's `v1/kv_offload/` is laid out:

- `layout.py`: one block's host row (`BlockLayout`) and the keys that name blocks (`prefix_keys`).
- `tiers.py`: what each tier counts (`TierStats`).
- `host_cache.py`: the host tier (`HostTier`), an LRU slab of rows that never evicts a pinned row.
- `file_tier.py`: one authenticated file per block (`FileTier`), written atomically.
- `peer_protocol.py` / `peer.py`: the wire format and handshake; the peer process and its client.
- `reuse.py`: which blocks are worth storing (the reuse gate, after `FilterReusedOffloadingManager`).
- `store.py`: the tiers together (`TieredKVStore`): offload into host, write below, lookup, fetch.
- `copy_stream.py`: copies off the engine thread (`CopyStream`).
- `block_copy.py`: the engine's paged pool <-> host rows, one batched copy per transfer.
- `engine_tiers.py`: binds a store to the serving engine (`EngineKVTiers`).

Reliability rules: a host row is visible only after its copy completed; a file is visible only
after `os.replace` of a fully written, fsync'ed temporary file, and it is authenticated on every
read (a mismatch or a malformed header -> counted, removed, a miss); the peer stores a value only
after receiving all of it with a matching digest, and a client read that times out or ends early
is a miss. A failing tier is counted and skipped; it never raises into the engine.
"""
from .block_copy import (CROSS_LAYER, KV_LAYOUTS, LAYER_MAJOR, block_pieces, copy_blocks_to_rows,  # noqa: F401
                         copy_rows_to_blocks, engine_layout, model_fingerprint, row_pieces, runner_kv_layout,
                         use_cross_layer_blocks)
from .copy_stream import CopyJob, CopyStream  # noqa: F401
from .engine_tiers import EngineKVTiers, EngineTierStats  # noqa: F401
from .file_tier import MAGIC, FileTier  # noqa: F401
from .host_cache import HostTier  # noqa: F401
from .layout import BlockLayout, namespace, prefix_keys, row_memoryview  # noqa: F401
from .peer import PeerProcess, PeerTier, serve_peer  # noqa: F401
from .peer_protocol import (HANDSHAKE_TIMEOUT_S, LOOPBACK, MAX_PEER_CONNECTIONS, OP_PUT, OP_STOP, PEER_SECRET_ENV,  # noqa: F401
                            handshake_answer, recv_exact)
from .store import Fetched, TieredKVStore  # noqa: F401
from .tiers import TIER_NAMES, TierStats  # noqa: F401
