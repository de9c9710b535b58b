"""KV blocks in tiers, with host memory in the middle: device -> host -> filesystem -> remote peer.

The seed (section 五, vLLM's Tiered KV Offloading write-up) describes a host-centred data path:
device KV is first copied to host DRAM and from there to slower storage; restore runs the other
way. The device blocks are freed as soon as the device-to-host copy completes; slower tiers are
written from the host copy in the background; on restore, device blocks are allocated only once
the data is in host memory. The host tier is a cache in its own right, not only a relay.

This file answers one question: *where does a KV block live, and how does it get back exactly?*

- `BlockLayout`: the fields of one block's host row (e.g. K and V of every layer, plus a
  recurrent state), packed into one contiguous uint8 row — the unified host representation.
- `prefix_keys`: a SHA-256 chain over the token ids of each full block, with model, block size,
  dtype and layout in the namespace, so a key names exactly one block content.
- `HostTier` (a slab of rows, pinned where the device is CUDA; an LRU cache that never evicts a
  pinned row), `FileTier` (one checksummed file per block, written atomically), `PeerTier` (a
  second process on loopback that serves only its parent: per-run secret, HMAC challenge,
  connection cap, exit on parent death), each with its own `TierStats`.
- `TieredKVStore`: offload (publish into host, queue background writes of the blocks admitted
  below the host: all, or only those reused `admit_after` times), lookup, fetch (into host rows,
  verified), per-tier metrics.
- `CopyStream`: block copies off the engine thread — a CUDA stream and its events on a GPU, a
  worker thread on a CPU.
- `use_cross_layer_blocks`: the engine's paged pool re-laid so one block of every layer is one
  contiguous piece (one copy per block instead of 2 x layers).
- `EngineKVTiers`: binds a store to the serving engine. Offload launches the device->host copy
  and the block manager holds the blocks until the copy completed; a request whose prefix is in
  a slow tier waits for a fetch thread while the engine steps the others; device blocks are
  taken only once the rows are in host memory.

Reliability rules kept here: a host row is visible only after its copy completed; a file is
visible only after `os.replace` of a fully written, fsync'ed temporary file, and its SHA-256 is
verified on every read (mismatch or a header that is not a JSON object -> counted, removed, a
miss); the peer stores a value only after receiving all of it with a matching digest, and a
client read that times out or ends early is a miss. A failing tier is counted and skipped; it
never raises into the engine.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

TIER_NAMES = ("host", "file", "peer")
LOOPBACK = "127.0.0.1"


# ---------------------------------------------------------------------------
# One block's host row, and the keys that name blocks

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


# ---------------------------------------------------------------------------
# Metrics

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


def _row_bytes(row: torch.Tensor) -> memoryview:
    return memoryview(row.numpy()).cast("B")


# ---------------------------------------------------------------------------
# Host tier: a slab of rows; LRU over published rows; pinned rows are never evicted

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


# ---------------------------------------------------------------------------
# Filesystem tier: one file per block, written atomically, verified on read

MAGIC = b"IBKVBLK1"


class FileTier:
    """Files `<dir>/<key[:2]>/<key>.kvb`: MAGIC, header length (u32), JSON header {key, nbytes,
    sha256, namespace}, payload. Written to a temporary file in the same folder, fsync'ed, then
    `os.replace`d (atomic on POSIX): a reader sees no file or a whole one."""

    name = "file"

    def __init__(self, directory: str | os.PathLike, ns: str, row_bytes: int, *,
                 capacity_bytes: int | None = None, durable: bool = True, max_failures: int = 3):
        self.dir, self.ns, self.row_bytes = Path(directory), ns, row_bytes
        self.capacity_bytes, self.durable, self.max_failures = capacity_bytes, durable, max_failures
        self.disabled = False
        self._consecutive_failures = 0
        self.written: OrderedDict[str, int] = OrderedDict()   # files this store wrote, oldest first
        self.lock = threading.Lock()
        self.stats = TierStats("file")

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.kvb"

    # the one place bytes reach the disk (tests replace it to simulate a full disk or a slow writer)
    def _write_file(self, f, header: bytes, payload: memoryview) -> None:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(payload)

    def put(self, key: str, row: torch.Tensor) -> bool:
        """Write one row; False (counted) on any OS error. Never raises."""
        if self.disabled:
            self.stats.skipped += 1
            return False
        t0 = time.perf_counter()
        payload = _row_bytes(row)
        header = json.dumps({"key": key, "nbytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                             "namespace": self.ns}).encode()
        tmp = None
        try:
            target = self.path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "wb") as f:
                self._write_file(f, header, payload)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self.stats.failures += 1
            self.stats.last_error = f"{type(e).__name__}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
            self._consecutive_failures += 1
            if self._consecutive_failures >= self.max_failures:
                self.disabled = True
            return False
        self._consecutive_failures = 0
        n = len(MAGIC) + 4 + len(header) + len(payload)
        self.stats.writes += 1
        self.stats.bytes_written += len(payload)
        self.stats.write_s += time.perf_counter() - t0
        with self.lock:
            self.written[key] = n
            self.written.move_to_end(key)
            if self.capacity_bytes is not None:
                while sum(self.written.values()) > self.capacity_bytes and len(self.written) > 1:
                    old, _ = self.written.popitem(last=False)
                    try:
                        os.unlink(self.path(old))
                        self.stats.evictions += 1
                    except OSError:
                        pass
        return True

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def read_into(self, key: str, row: torch.Tensor) -> bool:
        """Read and verify one block into `row`; False (a miss) if absent, short, or corrupt.
        A corrupt file is counted and removed: wrong KV is never returned."""
        t0 = time.perf_counter()
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if len(head) != len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
                    return self._corrupt(p, "bad magic")
                (hlen,) = struct.unpack("<I", head[len(MAGIC):])
                if hlen > 1 << 16:
                    return self._corrupt(p, "header too long")
                header = json.loads(f.read(hlen).decode())
                if not isinstance(header, dict):     # valid JSON, but a list, number or string
                    return self._corrupt(p, f"header is a JSON {type(header).__name__}, not an object")
                if header.get("key") != key or header.get("namespace") != self.ns \
                        or header.get("nbytes") != self.row_bytes:
                    return self._corrupt(p, "header does not match")
                view = _row_bytes(row)
                got = f.readinto(view)
                if got != self.row_bytes or f.read(1):
                    return self._corrupt(p, "length differs")
                if hashlib.sha256(view).hexdigest() != header.get("sha256"):
                    return self._corrupt(p, "checksum differs")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return self._corrupt(p, f"{type(e).__name__}: {e}")
        self.stats.reads += 1
        self.stats.bytes_read += self.row_bytes
        self.stats.read_s += time.perf_counter() - t0
        return True

    def _corrupt(self, p: Path, why: str) -> bool:
        self.stats.corrupt += 1
        self.stats.last_error = f"{p.name}: {why}"
        try:
            os.unlink(p)
        except OSError:
            pass
        return False


# ---------------------------------------------------------------------------
# Remote peer: a second process on loopback holding blocks in its memory
#
# Who may talk to it. The parent draws a per-run secret (`secrets.token_hex`) and hands it to the
# child in the child's environment (`PEER_SECRET_ENV`), never on the command line (which any
# local user can read in /proc). Every connection starts with a challenge: the peer sends a
# 32-byte nonce, the client answers HMAC-SHA256(secret, nonce), and the peer answers b"K" or
# closes. The secret itself never crosses the socket. A connection that does not answer within
# `HANDSHAKE_TIMEOUT_S` is closed; at most `max_connections` are open at once (a further one is
# answered b"B" and closed). The peer watches its parent: when the parent is gone (its parent
# pid changes), it exits within `PARENT_POLL_S`.
#
# Wire format, after the handshake. Request: op (1 byte) + key (64 ascii hex). PUT adds length
# (u64) + sha256 (32 bytes) + payload; GET/HAS add nothing; FAULT adds a mode byte; CLEAR and
# STOP are one byte. Reply: PUT -> b"K" (stored) or b"E"; HAS -> b"1"/b"0"; GET -> b"0", or
# b"1" + length (u64) + sha256 (32) + payload.

_OP_PUT, _OP_GET, _OP_HAS, _OP_FAULT, _OP_STOP, _OP_CLEAR = b"P", b"G", b"H", b"F", b"S", b"C"
FAULTS = {b"n": "none", b"d": "die mid-transfer", b"s": "stall mid-transfer"}
PEER_SECRET_ENV = "INFERBOOK_KV_PEER_SECRET"
HANDSHAKE_TIMEOUT_S = 2.0
PARENT_POLL_S = 0.2
MAX_PEER_CONNECTIONS = 8
_NONCE_BYTES = 32
_KEY_CHARS = frozenset(b"0123456789abcdef")
_PEER_SECRETS: dict[tuple[str, int], str] = {}    # address -> secret of the peers this process started


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf if into is not None else bytes(buf)


def handshake_answer(secret: str, nonce: bytes) -> bytes:
    """The client's answer to the peer's challenge: HMAC-SHA256(secret, nonce), 32 bytes."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def _watch_parent(parent_pid: int) -> None:
    """Exit the peer as soon as the process that started it is gone (reparented: ppid changes)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def serve_peer(port: int = 0, capacity_bytes: int = 1 << 34, port_file: str | None = None, *,
               secret: str | None = None, parent_pid: int | None = None,
               max_connections: int = MAX_PEER_CONNECTIONS) -> None:
    """The peer process: hold blocks in memory (LRU within `capacity_bytes`), answer on 127.0.0.1,
    one thread per authenticated connection, at most `max_connections` at once.

    `secret` (default: the `PEER_SECRET_ENV` environment variable) is required: without one the
    peer refuses to start. `parent_pid`: exit when that process is no longer the parent.
    Reports its port on stdout (and in `port_file`) once listening. A FAULT request arms the
    next GET to send half its payload and then exit ('d') or stall ('s') — the tests' way to
    make a peer disappear mid-transfer."""
    secret = secret if secret is not None else os.environ.get(PEER_SECRET_ENV, "")
    if len(secret) < 16:
        raise UserError(f"the KV peer needs a per-run secret of at least 16 characters in ${PEER_SECRET_ENV}")
    if parent_pid is not None:
        if os.getppid() != parent_pid:
            os._exit(0)
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="kv-peer-parent-watch", daemon=True).start()
    store: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
    state = {"size": 0, "fault": b"n", "open": 0, "refused": 0, "denied": 0}
    lock, stop = threading.Lock(), threading.Event()

    def authenticate(conn: socket.socket) -> bool:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.sendall(nonce)
        answer = _recv_exact(conn, 32)
        if not hmac.compare_digest(answer, handshake_answer(secret, nonce)):
            return False
        conn.sendall(b"K")
        conn.settimeout(None)
        return True

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                if not authenticate(conn):
                    with lock:
                        state["denied"] += 1
                    return
                while True:
                    op = conn.recv(1)
                    if not op:
                        return
                    if op == _OP_STOP:
                        conn.sendall(b"K")
                        stop.set()
                        os._exit(0)
                    if op == _OP_CLEAR:
                        with lock:
                            store.clear()
                            state["size"] = 0
                        conn.sendall(b"K")
                        continue
                    if op == _OP_FAULT:
                        state["fault"] = _recv_exact(conn, 1)
                        conn.sendall(b"K")
                        continue
                    raw = _recv_exact(conn, 64)
                    if not set(raw) <= _KEY_CHARS:
                        return          # not a key this store ever makes: drop the connection
                    key = raw.decode()
                    if op == _OP_PUT:
                        (n,) = struct.unpack("<Q", _recv_exact(conn, 8))
                        if n > capacity_bytes:
                            return
                        digest = _recv_exact(conn, 32)
                        payload = _recv_exact(conn, n)
                        if hashlib.sha256(payload).digest() != digest:
                            conn.sendall(b"E")
                            continue
                        with lock:   # stored only now: all bytes arrived and match their digest
                            if key in store:
                                state["size"] -= len(store.pop(key)[0])
                            store[key] = (payload, digest)
                            state["size"] += n
                            while state["size"] > capacity_bytes and len(store) > 1:
                                state["size"] -= len(store.popitem(last=False)[1][0])
                        conn.sendall(b"K")
                    elif op == _OP_HAS:
                        with lock:
                            found = key in store
                        conn.sendall(b"1" if found else b"0")
                    elif op == _OP_GET:
                        with lock:
                            item = store.get(key)
                            if item is not None:
                                store.move_to_end(key)
                        if item is None:
                            conn.sendall(b"0")
                            continue
                        payload, digest = item
                        head = b"1" + struct.pack("<Q", len(payload)) + digest
                        if state["fault"] != b"n":
                            conn.sendall(head + payload[:len(payload) // 2])
                            if state["fault"] == b"d":
                                os._exit(3)
                            time.sleep(3600)
                        conn.sendall(head + payload)
                    else:
                        return
            except (ConnectionError, OSError, struct.error):
                return
            finally:
                with lock:
                    state["open"] -= 1

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((LOOPBACK, port))
    srv.listen(max_connections)
    port = srv.getsockname()[1]
    if port_file:
        Path(port_file).write_text(str(port))
    print(port, flush=True)
    while not stop.is_set():
        conn, _ = srv.accept()
        with lock:
            full = state["open"] >= max_connections
            if not full:
                state["open"] += 1
            else:
                state["refused"] += 1
        if full:            # over the cap: say so and close, before any thread or handshake
            try:
                conn.sendall(b"B")
            except OSError:
                pass
            conn.close()
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class PeerProcess:
    """A peer started as `python -m inferbook.serving.kv_tiers peer` on 127.0.0.1 (a free port),
    with a fresh secret in its environment and this process as the parent it watches.

    `secret` is this run's secret (a `PeerTier` to this address finds it by itself)."""

    def __init__(self, capacity_bytes: int = 1 << 34, start_timeout_s: float = 60.0,
                 max_connections: int = MAX_PEER_CONNECTIONS):
        self.secret = secrets.token_hex(32)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env[PEER_SECRET_ENV] = self.secret
        self.proc = subprocess.Popen([sys.executable, "-m", "inferbook.serving.kv_tiers", "peer",
                                      "--capacity-bytes", str(int(capacity_bytes)), "--parent-pid", str(os.getpid()),
                                      "--max-connections", str(int(max_connections))],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        deadline = time.monotonic() + start_timeout_s
        port = None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=max(0.0, deadline - time.monotonic()))
        if result and result[0].strip().isdigit():
            port = int(result[0])
        if port is None:
            self.stop()
            raise RuntimeError(f"KV peer did not start within {start_timeout_s:.0f} s")
        self.address = (LOOPBACK, port)
        _PEER_SECRETS[self.address] = self.secret

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdout:
            self.proc.stdout.close()
        _PEER_SECRETS.pop(getattr(self, "address", None), None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class PeerTier:
    """Client of a peer on 127.0.0.1. Every socket operation has `timeout_s`; a timeout, a reset,
    an early end or a digest mismatch is counted and becomes a miss (or a failed write)."""

    name = "peer"

    def __init__(self, address: tuple[str, int], row_bytes: int, *, timeout_s: float = 2.0, max_failures: int = 3,
                 secret: str | None = None):
        host, port = address
        if host != LOOPBACK:
            raise UserError(f"peer address {host!r} is not allowed: the remote-peer tier runs on loopback ({LOOPBACK}) only")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise UserError(f"peer timeout_s={timeout_s!r} must be a positive number of seconds")
        self.address, self.row_bytes, self.timeout_s = (host, int(port)), row_bytes, float(timeout_s)
        # the run's secret: given, or the one of the peer this process started at that address
        self.secret = secret if secret is not None else _PEER_SECRETS.get(self.address, "")
        self.max_failures, self.disabled, self._consecutive_failures = max_failures, False, 0
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.stats = TierStats("peer")
        # keys this client stored: a lookup hint that needs no round trip (the peer is this run's own
        # and `clear`ed at start; a key it evicted since is a miss when read, counted there)
        self.stored: OrderedDict[str, None] = OrderedDict()
        self.max_stored_hints = 1 << 20

    def maybe_contains(self, key: str) -> bool:
        """Whether this client stored `key` (no round trip); False means not worth asking."""
        return not self.disabled and key in self.stored

    def _conn(self) -> socket.socket:
        if self.sock is None:
            s = socket.create_connection(self.address, timeout=self.timeout_s)
            try:
                s.settimeout(self.timeout_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = _recv_exact(s, _NONCE_BYTES)     # a peer at its cap sends b"B" and closes: ConnectionError
                s.sendall(handshake_answer(self.secret, nonce))
                if _recv_exact(s, 1) != b"K":
                    raise ConnectionError("peer refused the handshake")
            except BaseException:
                s.close()
                raise
            self.sock = s
        return self.sock

    def _drop(self, e: BaseException, timed_out: bool) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        if timed_out:
            self.stats.timeouts += 1
        self.stats.last_error = f"{type(e).__name__}: {e}"
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_failures:
            self.disabled = True

    def put(self, key: str, row: torch.Tensor) -> bool:
        if self.disabled:
            self.stats.skipped += 1
            return False
        t0 = time.perf_counter()
        payload = _row_bytes(row)
        with self.lock:
            try:
                s = self._conn()
                s.sendall(_OP_PUT + key.encode() + struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest())
                s.sendall(payload)
                ok = _recv_exact(s, 1) == b"K"
            except (OSError, ConnectionError) as e:
                self.stats.failures += 1
                self._drop(e, isinstance(e, TimeoutError | socket.timeout))
                return False
        if not ok:
            self.stats.failures += 1
            return False
        self._consecutive_failures = 0
        with self.lock:
            self.stored[key] = None
            while len(self.stored) > self.max_stored_hints:
                self.stored.popitem(last=False)
        self.stats.writes += 1
        self.stats.bytes_written += len(payload)
        self.stats.write_s += time.perf_counter() - t0
        return True

    def contains(self, key: str) -> bool:
        if self.disabled:
            return False
        with self.lock:
            try:
                s = self._conn()
                s.sendall(_OP_HAS + key.encode())
                return _recv_exact(s, 1) == b"1"
            except (OSError, ConnectionError) as e:
                self._drop(e, isinstance(e, TimeoutError | socket.timeout))
                return False

    def read_into(self, key: str, row: torch.Tensor) -> bool:
        if self.disabled:
            return False
        t0 = time.perf_counter()
        view = _row_bytes(row)
        with self.lock:
            try:
                s = self._conn()
                s.sendall(_OP_GET + key.encode())
                if _recv_exact(s, 1) != b"1":
                    return False
                (n,) = struct.unpack("<Q", _recv_exact(s, 8))
                digest = _recv_exact(s, 32)
                if n != self.row_bytes:
                    self._drop(ValueError(f"peer sent {n} bytes for a {self.row_bytes}-byte row"), False)
                    self.stats.corrupt += 1
                    return False
                _recv_exact(s, n, into=view)
            except (OSError, ConnectionError) as e:
                self._drop(e, True)   # a peer gone or stalled mid-transfer: a miss
                return False
        if hashlib.sha256(view).digest() != digest:
            self.stats.corrupt += 1
            return False
        self._consecutive_failures = 0
        self.stats.reads += 1
        self.stats.bytes_read += n
        self.stats.read_s += time.perf_counter() - t0
        return True

    def clear(self) -> bool:
        """Empty the peer's store (a fresh run on a long-lived peer). False, counted as a failure,
        when the peer is gone or refuses: never raises."""
        with self.lock:
            try:
                s = self._conn()
                s.sendall(_OP_CLEAR)
                ok = _recv_exact(s, 1) == b"K"
            except (OSError, ConnectionError) as e:
                self.stats.failures += 1
                self._drop(e, isinstance(e, TimeoutError | socket.timeout))
                return False
            if ok:
                self.stored.clear()
        if not ok:
            self.stats.failures += 1
        return ok

    def arm_fault(self, mode: str) -> None:
        """Tests only: make the peer's next GET send half and then die ('die') or stall ('stall')."""
        code = {"none": b"n", "die": b"d", "stall": b"s"}[mode]
        with self.lock:
            s = self._conn()
            s.sendall(_OP_FAULT + code)
            _recv_exact(s, 1)

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None


# ---------------------------------------------------------------------------
# The store: host in the middle

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
    table of `max_tracked` keys."""

    def __init__(self, layout: BlockLayout, ns: str, *, host_capacity_blocks: int, pin: bool = False,
                 file_dir: str | os.PathLike | None = None, file_capacity_bytes: int | None = None,
                 durable: bool = True, peer_address: tuple[str, int] | None = None, peer_timeout_s: float = 2.0,
                 peer_secret: str | None = None, background: bool = True, admit_after: int = 1,
                 max_tracked: int = 1 << 16):
        if isinstance(admit_after, bool) or not isinstance(admit_after, int) or admit_after < 1:
            raise UserError(f"admit_after={admit_after!r} must be a positive int (uses before a block goes below host)")
        self.admit_after, self.max_tracked = admit_after, max_tracked
        self.uses: OrderedDict[str, int] = OrderedDict()     # key -> uses seen (bounded, LRU)
        self.admitted: set[str] = set()                      # keys queued for (or written to) the slow tiers
        self.not_admitted = 0                                # commits kept in host only: not reused (yet)
        self.layout, self.ns = layout, ns
        self.row_bytes = layout.nbytes
        self.host = HostTier(host_capacity_blocks, self.row_bytes, pin=pin)
        self.lower: list = []
        if file_dir is not None:
            self.lower.append(FileTier(file_dir, ns, self.row_bytes, capacity_bytes=file_capacity_bytes, durable=durable))
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
        with self.host.lock:
            n = self.uses.pop(key, 0) + 1
            self.uses[key] = n
            while len(self.uses) > self.max_tracked:
                self.uses.popitem(last=False)
            return n

    def _admit(self, key: str) -> bool:
        with self.host.lock:
            if not self.lower or key in self.admitted:
                return False
            if self.admit_after > 1 and self.uses.get(key, 0) < self.admit_after:
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


# ---------------------------------------------------------------------------
# Copies off the engine thread

@dataclass(eq=False)
class CopyJob:
    """One batch of block copies. `t_submit`/`t_done`: perf_counter at submission and at completion
    (the event completed on CUDA; the worker's copy returned on CPU)."""

    on_done: object
    copy_fn: object = None
    event: object = None
    t_submit: float = 0.0
    t_done: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CopyStream:
    """Block copies that never run on (or wait on) the engine thread.

    CUDA: one dedicated stream. `submit` makes the stream wait for the compute stream (the KV to
    copy was written there), launches the copies non_blocking (pinned host rows), records an
    event and returns at once; a completion thread waits on the events in submission order and
    runs each job's `on_done(job)` — as vLLM's CPU offload worker queries its transfer events.
    CPU: the same jobs run on a worker thread that performs the copies itself (threads stand in
    for streams). Jobs complete in submission order in both cases."""

    def __init__(self, device: torch.device, name: str = "kv-copy"):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._jobs: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._inflight = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, copy_fn, on_done, *, after_compute: bool = True) -> CopyJob:
        job = CopyJob(on_done=on_done, t_submit=time.perf_counter())
        with self._cv:
            self._inflight += 1
        if self.cuda:
            if after_compute:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_fn()
                job.event = torch.cuda.Event()
                job.event.record(self.stream)
        else:
            job.copy_fn = copy_fn
        self._jobs.put(job)
        return job

    def submit_from_worker(self, copy_fn, on_done) -> CopyJob:
        """A follow-up job submitted from an `on_done` callback (on the copy stream after the jobs
        before it, so it needs no new wait on the compute stream)."""
        return self.submit(copy_fn, on_done, after_compute=False)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self.cuda:
                    job.event.synchronize()
                else:
                    job.copy_fn()
            except BaseException as e:      # a failed copy is reported to its callback, never raised here
                job.error = e
            job.t_done = time.perf_counter()
            try:
                job.on_done(job)
            finally:
                job.done.set()
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._inflight > 0

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    def close(self) -> None:
        self.wait_idle(30.0)
        self._jobs.put(None)
        self._thread.join(timeout=10)


# ---------------------------------------------------------------------------
# The engine's side: the paged KV pool <-> host rows

@dataclass
class EngineTierStats:
    """Per-request timings the seed says to watch: time to free device blocks (offload), time to
    re-allocate and fill them (restore), and how many prompt blocks came from where.

    free_s: per offloaded request, submission of its device->host copy until the copy completed
    and its blocks were handed back (off the engine thread). offload_call_s: what the engine
    thread spent in `offload` (keys, host rows, launching the copy). fetch_wait_s: per request
    with a slow-tier fetch, from starting the fetch until its rows were in host memory (the
    request waits; the engine steps). realloc_s: taking device blocks once the data is in host
    memory and copying it in (on CUDA: launching the copy; the forward waits on its event)."""

    offloads: int = 0
    offloaded_blocks: int = 0
    free_s: list = field(default_factory=list)
    offload_call_s: list = field(default_factory=list)
    restores: int = 0
    restored_blocks: dict = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})
    fetch_s: list = field(default_factory=list)
    fetch_wait_s: list = field(default_factory=list)
    realloc_s: list = field(default_factory=list)
    device_hit_blocks: int = 0
    prompt_blocks: int = 0
    fetches_started: int = 0
    steps_with_fetch_in_flight: int = 0
    copy_failures: int = 0
    mirror_share: list = field(default_factory=list)   # at each admission: host blocks also in the device cache


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


def copy_blocks_to_rows(runner, layout: BlockLayout, pairs: list[tuple[int, torch.Tensor]], *,
                        non_blocking: bool | None = None) -> int:
    """Device blocks -> host rows, one `copy_` per contiguous piece (see `block_pieces`); returns
    the number of copies launched. Asynchronous into pinned rows on CUDA (the caller records
    an event); complete on return on CPU."""
    nb = runner.k_cache.device.type == "cuda" if non_blocking is None else non_blocking
    n = 0
    for block, row in pairs:
        for dst, src in zip(row_pieces(layout, row), block_pieces(runner, block)):
            dst.copy_(src, non_blocking=nb)
            n += 1
    return n


def copy_rows_to_blocks(runner, layout: BlockLayout, pairs: list[tuple[int, torch.Tensor]]) -> int:
    """Host rows -> device blocks, one `copy_` per piece; asynchronous from pinned rows on CUDA."""
    nb = runner.k_cache.device.type == "cuda"
    n = 0
    for block, row in pairs:
        for dst, src in zip(block_pieces(runner, block), row_pieces(layout, row)):
            dst.copy_(src, non_blocking=nb)
            n += 1
    return n


def model_fingerprint(model) -> str:
    """SHA-256 (first 16 hex) over the model's config and weights: part of every key's namespace."""
    h = hashlib.sha256(repr(getattr(model, "cfg", type(model).__name__)).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_row_bytes(p.detach().cpu().contiguous().view(-1).view(torch.uint8)))
    return h.hexdigest()[:16]


@dataclass(eq=False)
class _Fetch:
    """A request's prefix on its way from the slow tiers into host rows (fetch thread)."""

    keys: list[str]
    start_block: int
    t_start: float
    got: Fetched | None = None
    t_ready: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class EngineKVTiers:
    """Offload a finishing request's full prompt blocks; restore a new request's prefix — both
    without holding up the engine thread.

    Installed on an engine's block manager (`attach` in `__init__`). Offload: `BlockManager.free`
    calls `offload(seq)`, which launches the device->host copy (`CopyStream`) and returns the
    blocks under copy; the block manager holds them (a reference each) until `completed_blocks`
    hands them back, after the copy completed, and only then can they be reused. Restore: the
    scheduler asks `loading(seq)` before admitting a request; if a slow tier holds part of its
    prefix, a fetch thread brings it into host rows while the engine keeps stepping other
    requests, and the request waits. Once the rows are in host memory, `BlockManager.allocate`
    calls `restore`, which takes device blocks only then and copies the rows in.

    kv_layout: "cross_layer" (default; one copy per block, see `use_cross_layer_blocks`) or
    "layer_major" (the runner's own pool; 2 x layers copies per block)."""

    def __init__(self, engine, store_kwargs: dict, model_id: str | None = None, kv_layout: str = CROSS_LAYER):
        if kv_layout not in KV_LAYOUTS:
            raise UserError(f"kv_layout={kv_layout!r} unknown; choose one of {', '.join(KV_LAYOUTS)}")
        self.engine, self.runner, self.bm = engine, engine.runner, engine.block_manager
        if kv_layout == CROSS_LAYER and runner_kv_layout(self.runner) != CROSS_LAYER:
            if engine.finished or engine.has_unfinished():
                raise UserError("the cross-layer KV layout is set before the engine serves any request")
            use_cross_layer_blocks(self.runner)
        self.layout = engine_layout(self.runner)
        self.ns = namespace(model_id or model_fingerprint(engine.model), self.runner.block_size, self.runner.dtype,
                            self.layout)
        pin = self.runner.device.type == "cuda"
        self.store = TieredKVStore(self.layout, self.ns, pin=pin, **store_kwargs)
        self.stats = EngineTierStats()
        self._device_hash: dict[str, int | None] = {}
        self._released: queue.SimpleQueue = queue.SimpleQueue()   # blocks whose copy completed
        self._held = 0                                             # blocks handed to the copier, not yet back
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self.copier = CopyStream(self.runner.device, "kv-offload-copy")
        self._fetches: dict[int, _Fetch] = {}                      # seq_id -> its fetch
        self._fetch_jobs: queue.Queue = queue.Queue()
        self._fetcher = threading.Thread(target=self._fetch_loop, name="kv-tier-fetch", daemon=True)
        self._fetcher.start()
        self.bm.tiers = self

    # -- what the block manager and the scheduler ask ---------------------------------
    def mirrored_share(self) -> float:
        """Share of the host tier's blocks that the device prefix cache also holds right now: a host
        tier that only mirrors the device can never serve a hit (the device is asked first)."""
        with self.store.host.lock:
            keys = list(self.store.host.index)
        if not keys:
            return 0.0
        h2b = self.bm.hash_to_block
        return sum(1 for k in keys if self._device_hash.get(k) is not None and self._device_hash[k] in h2b) / len(keys)

    def completed_blocks(self) -> list[int]:
        """Device blocks whose device->host copy has completed since the last call (engine thread;
        never waits)."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._held -= len(out)
        return out

    def busy(self) -> bool:
        """A copy or a fetch is in flight: the engine may have nothing to run until it completes."""
        with self._lock:
            held = self._held
        return held > 0 or any(not f.done.is_set() for f in self._fetches.values())

    def wait_for_progress(self, timeout_s: float = 0.05) -> None:
        """Sleep until a copy or fetch completes (or `timeout_s`): for an engine with nothing to run."""
        with self._progress:
            self._progress.wait(timeout=timeout_s)

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    # -- offload -----------------------------------------------------------------------
    def offload(self, seq) -> list[int]:
        """Called by `BlockManager.free` while the request still owns its blocks: count a use of
        each full prompt block, launch the device->host copy of those not yet in the host tier,
        and return the device blocks under copy (the block manager holds them until
        `completed_blocks` returns them)."""
        t0 = time.perf_counter()
        bs = self.runner.block_size
        n = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        keys = prefix_keys(seq.prompt[:n * bs], bs, self.ns)
        want = []
        for i, key in enumerate(keys):   # which device-cache entry holds the same block (for `mirror_share`)
            self._device_hash[key] = self.bm.block_hash[seq.block_table[i]]
            self.store.note_use(key)
            if self.store.host.touch(key):
                self.store.admit_if_reused(key)      # reused often enough now: write it below, from host
            else:
                want.append((key, seq.block_table[i]))
        self.stats.offloads += 1
        if not want:
            self.stats.offload_call_s.append(time.perf_counter() - t0)
            return []
        blocks = [b for _, b in want]
        with self._lock:
            self._held += len(blocks)
        if not self._offload_round({"want": want, "t0": t0, "done": 0}, first=True):
            with self._lock:            # nothing launched: the caller frees these blocks at once
                self._held -= len(blocks)
            blocks = []
        self.stats.offload_call_s.append(time.perf_counter() - t0)
        return blocks

    def _offload_round(self, state: dict, first: bool) -> bool:
        """Reserve host rows for as many wanted blocks as the host can give now and launch their
        copy; blocks that get no row are skipped (counted) and handed back. A host tier smaller
        than the request takes it in rounds: each round starts when the one before completed."""
        want = state["want"]
        todo = []
        while want:
            slot = self.store.reserve(want[0][0], count=False)
            if slot is None:
                break
            key, block = want.pop(0)
            todo.append((key, slot, block))
        if not todo:
            if want:
                self.store.host.stats.skipped += len(want)   # host full of rows still being written or read
                if not first:                                # (the first round's blocks were never held)
                    for _, block in want:
                        self._released.put(block)
                want.clear()
            self.stats.free_s.append(time.perf_counter() - state["t0"])
            self.stats.offloaded_blocks += state["done"]
            self._notify()
            return False
        pairs = [(b, self.store.host.row(s)) for _, s, b in todo]

        def copy():
            copy_blocks_to_rows(self.runner, self.layout, pairs)

        def done(job: CopyJob):
            if job.error is not None:
                self.stats.copy_failures += 1
                for key, slot, _ in todo:
                    self.store.host.abandon(key, slot)
            else:
                self.store.commit([(k, s) for k, s, _ in todo])   # visible only now: the copy completed
                state["done"] += len(todo)
            for _, _, block in todo:
                self._released.put(block)
            self._offload_round(state, first=False)

        if first:
            self.copier.submit(copy, done)
        else:
            self.copier.submit_from_worker(copy, done)
        return True

    # -- restore -----------------------------------------------------------------------
    def _device_prefix_blocks(self, seq) -> int:
        """Prompt blocks the device prefix cache holds for `seq` now (the block manager's own lookup)."""
        bm, bs = self.bm, self.runner.block_size
        if not bm.enable_prefix_caching:
            return 0
        prev, n = None, 0
        for i in range((seq.num_prompt_tokens - 1) // bs):
            prev = bm._chain_hash(prev, seq.prompt[i * bs:(i + 1) * bs])
            if prev not in bm.hash_to_block:
                break
            n += 1
        return n

    def _restorable_keys(self, seq, start_block: int) -> list[str]:
        bs = self.runner.block_size
        limit = (seq.num_prompt_tokens - 1) // bs      # never the block holding the last prompt token
        if start_block >= limit:
            return []
        return prefix_keys(seq.prompt[:limit * bs], bs, self.ns)[start_block:]

    def _needs_slow_tier(self, keys: list[str]) -> bool:
        """Does the prefix continue, past what the host tier holds, in a slower tier? Checked on the
        engine thread without I/O waits: host membership (a dict), the file tier's (a stat), the
        peer's from the keys this client stored there (`PeerTier.maybe_contains`, no round trip).
        The fetch thread then asks the tiers themselves."""
        for key in keys:
            if self.store.host.contains(key):
                continue
            for t in self.store.lower:
                if getattr(t, "disabled", False):
                    continue
                if (t.maybe_contains(key) if hasattr(t, "maybe_contains") else t.contains(key)):
                    return True
            return False
        return False

    def loading(self, seq) -> bool:
        """Scheduler, before admitting `seq`: True while part of its prefix is still on its way from a
        slow tier into host rows (it waits; others run). Starts that fetch on first sight."""
        f = self._fetches.get(seq.seq_id)
        if f is not None:
            return not f.done.is_set()
        start = self._device_prefix_blocks(seq)
        keys = self._restorable_keys(seq, start)
        if not keys or not self._needs_slow_tier(keys):
            return False
        f = _Fetch(keys=keys, start_block=start, t_start=time.perf_counter())
        self._fetches[seq.seq_id] = f
        self.stats.fetches_started += 1
        self._fetch_jobs.put(f)
        return True

    def note_step(self) -> None:
        if any(not f.done.is_set() for f in self._fetches.values()):
            self.stats.steps_with_fetch_in_flight += 1

    def _fetch_loop(self) -> None:
        while True:
            f = self._fetch_jobs.get()
            if f is None:
                return
            try:
                f.got = self.store.fetch(f.keys)
            except BaseException as e:      # a tier must never take the engine down: a miss
                f.got = Fetched(self.store, [], [], [])
                self.store.host.stats.last_error = f"fetch: {type(e).__name__}: {e}"
            f.t_ready = time.perf_counter()
            f.done.set()
            self._notify()

    def restore(self, seq, start_block: int, take_block) -> list[int]:
        """Blocks `start_block..` of `seq`'s prompt from the tiers: rows already in host memory (a
        completed fetch, or host-tier hits fetched now), then device blocks (`take_block()`) taken
        and filled. Returns the device blocks filled, in order."""
        bs = self.runner.block_size
        limit = (seq.num_prompt_tokens - 1) // bs
        self.stats.prompt_blocks += max(limit, 0)
        self.stats.device_hit_blocks += start_block
        self.stats.mirror_share.append(self.mirrored_share())
        f = self._fetches.pop(getattr(seq, "seq_id", None), None)
        t0 = time.perf_counter()
        if f is not None:
            if not f.done.wait(timeout=60):      # not reached: the scheduler admits only finished fetches
                raise RuntimeError("restore called while the request's fetch is in flight")
            got = f.got
            self.stats.fetch_wait_s.append(f.t_ready - f.t_start)
            skip = start_block - f.start_block   # the device cache may have gained (or lost) blocks meanwhile
            if skip < 0:
                got.release()
                return []
            got = Fetched(self.store, got.keys[skip:], got.rows[skip:], got.sources[skip:], got._slots[skip:]) \
                if skip else got
            if skip:
                for s in f.got._slots[:skip]:
                    if s is not None:
                        self.store.host.unpin(s)
        else:
            keys = self._restorable_keys(seq, start_block)
            if not keys:
                return []
            got = self.store.fetch(keys)     # host hits only, unless the scheduler skipped `loading`
        t1 = time.perf_counter()
        if not got.rows:
            got.release()
            return []
        blocks = [take_block() for _ in got.rows]   # allocated only now that the data is in host memory
        pairs = list(zip(blocks, got.rows))
        if self.runner.device.type == "cuda":
            # on the copy stream; the compute stream waits on its event (no host synchronisation),
            # and the pinned rows are released once the copy completed
            job = self.copier.submit(lambda: copy_rows_to_blocks(self.runner, self.layout, pairs),
                                     lambda job: got.release(), after_compute=True)
            torch.cuda.current_stream(self.runner.device).wait_event(job.event)
        else:
            try:
                copy_rows_to_blocks(self.runner, self.layout, pairs)
            finally:
                got.release()
        self.stats.restores += 1
        for s in got.sources:
            self.stats.restored_blocks[s] += 1
        self.stats.fetch_s.append(t1 - t0)
        self.stats.realloc_s.append(time.perf_counter() - t1)
        return blocks

    def forget(self, seq) -> None:
        """A request leaves before admission: release its fetched rows."""
        f = self._fetches.pop(seq.seq_id, None)
        if f is not None and f.done.wait(timeout=60) and f.got is not None:
            f.got.release()

    def block_bytes(self, block: int) -> torch.Tensor:
        """One device block's KV as bytes, in the host row's order (tests and checks)."""
        return torch.cat([p.contiguous().view(-1).view(torch.uint8).cpu() for p in block_pieces(self.runner, block)])

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for every copy in flight, hand its blocks back to the block manager, then wait for the
        slow-tier writes."""
        ok = self.copier.wait_idle(timeout_s)
        self.bm.reclaim()
        return self.store.flush(timeout_s) and ok

    def close(self) -> None:
        self.flush(30.0)
        self.copier.close()
        self._fetch_jobs.put(None)
        self._fetcher.join(timeout=10)
        for f in list(self._fetches.values()):
            if f.done.is_set() and f.got is not None:
                f.got.release()
        self._fetches.clear()
        self.store.close()


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m inferbook.serving.kv_tiers")
    sub = p.add_subparsers(dest="cmd", required=True)
    peer = sub.add_parser("peer", help="run a KV peer on 127.0.0.1")
    peer.add_argument("--port", type=int, default=0)
    peer.add_argument("--capacity-bytes", type=int, default=1 << 34)
    peer.add_argument("--port-file", default=None)
    peer.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    peer.add_argument("--max-connections", type=int, default=MAX_PEER_CONNECTIONS)
    a = p.parse_args(argv)
    try:
        serve_peer(a.port, a.capacity_bytes, a.port_file, parent_pid=a.parent_pid, max_connections=a.max_connections)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
