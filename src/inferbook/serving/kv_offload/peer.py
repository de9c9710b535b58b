"""The remote-peer tier: a second process on loopback holding blocks in memory (`serve_peer`,
started by `PeerProcess`), and its client (`PeerTier`). The protocol is in `peer_protocol`."""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from ...errors import UserError
from .layout import row_memoryview
from .peer_protocol import (HANDSHAKE_TIMEOUT_S, KEY_CHARS, LOOPBACK, MAX_PEER_CONNECTIONS, MAX_PENDING_HANDSHAKES,
                            NONCE_BYTES, OP_CLEAR, OP_FAULT, OP_GET, OP_HAS, OP_PUT, OP_STOP, PARENT_POLL_S,
                            PEER_SECRET_ENV, RECV_CHUNK_BYTES, handshake_answer, recv_by, recv_exact)
from .tiers import TierStats

_PEER_SECRETS: dict[tuple[str, int], str] = {}    # address -> secret of the peers this process started


def _watch_parent(parent_pid: int) -> None:
    """Exit the peer as soon as the process that started it is gone (reparented: ppid changes)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def check_peer_args(port: int, capacity_bytes: int, max_connections: int) -> None:
    """The peer's bounds, checked before it binds anything."""
    for name, value, lo, hi in (("port", port, 0, 65535), ("capacity_bytes", capacity_bytes, 0, None),
                                ("max_connections", max_connections, 1, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            allowed = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"
            raise UserError(f"{name}={value!r} must be {allowed}")


def serve_peer(port: int = 0, capacity_bytes: int = 1 << 34, port_file: str | None = None, *,
               secret: str | None = None, parent_pid: int | None = None,
               max_connections: int = MAX_PEER_CONNECTIONS) -> None:
    """The peer process: hold blocks in memory (LRU within `capacity_bytes`), answer on 127.0.0.1,
    one thread per connection, at most `max_connections` authenticated ones at once (port 0: any
    free port). See `peer_protocol` for what a lying client can and cannot do.

    `secret` (default: the `PEER_SECRET_ENV` environment variable) is required: without one the
    peer refuses to start. `parent_pid`: exit when that process is no longer the parent.
    Reports its port on stdout (and in `port_file`) once listening. A FAULT request arms the
    next GET to send half its payload and then exit ('d') or stall ('s') — the tests' way to
    make a peer disappear mid-transfer."""
    check_peer_args(port, capacity_bytes, max_connections)
    secret = secret if secret is not None else os.environ.get(PEER_SECRET_ENV, "")
    if len(secret) < 16:
        raise UserError(f"the KV peer needs a per-run secret of at least 16 characters in ${PEER_SECRET_ENV}")
    if parent_pid is not None:
        if os.getppid() != parent_pid:
            os._exit(0)
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="kv-peer-parent-watch", daemon=True).start()
    store: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
    # size: bytes stored; receiving: PUT payload bytes arrived but not yet stored (all connections)
    state = {"size": 0, "receiving": 0, "fault": b"n", "open": 0, "pending": 0, "refused": 0, "denied": 0}
    lock, stop = threading.Lock(), threading.Event()

    def authenticate(conn: socket.socket) -> str:
        """'ok' (admitted, counted in `open`), 'busy' (authenticated, at the cap) or 'denied'."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.sendall(nonce)
        answer = recv_by(conn, 32, deadline)
        if not hmac.compare_digest(answer, handshake_answer(secret, nonce)):
            return "denied"
        with lock:
            if state["open"] >= max_connections:
                state["refused"] += 1
                verdict = "busy"
            else:
                state["open"] += 1
                verdict = "ok"
        conn.sendall(b"K" if verdict == "ok" else b"B")
        conn.settimeout(None)
        return verdict

    def receive_payload(conn: socket.socket, n: int) -> tuple[bytes, bytes] | None:
        """The PUT payload, in pieces: memory grows with what arrived. None (drop the connection) when
        the payloads in flight would exceed the capacity."""
        buf, h = bytearray(), hashlib.sha256()
        try:
            while len(buf) < n:
                want = min(RECV_CHUNK_BYTES, n - len(buf))
                with lock:
                    if state["receiving"] + want > capacity_bytes:
                        return None
                    state["receiving"] += want          # reserved for this piece while it arrives
                try:
                    chunk = conn.recv(want)
                finally:
                    with lock:
                        state["receiving"] -= want
                if not chunk:
                    raise ConnectionError(f"client closed the connection after {len(buf)} of {n} bytes")
                buf += chunk
                h.update(chunk)
                with lock:
                    state["receiving"] += len(chunk)
            return bytes(buf), h.digest()
        finally:
            with lock:
                state["receiving"] -= len(buf)

    def handle(conn: socket.socket) -> None:
        admitted = False
        with conn:
            try:
                try:
                    verdict = authenticate(conn)
                finally:
                    with lock:
                        state["pending"] -= 1
                if verdict != "ok":
                    if verdict == "denied":
                        with lock:
                            state["denied"] += 1
                    return
                admitted = True
                while True:
                    op = conn.recv(1)
                    if not op:
                        return
                    if op == OP_STOP:
                        conn.sendall(b"K")
                        stop.set()
                        os._exit(0)
                    if op == OP_CLEAR:
                        with lock:
                            store.clear()
                            state["size"] = 0
                        conn.sendall(b"K")
                        continue
                    if op == OP_FAULT:
                        state["fault"] = recv_exact(conn, 1)
                        conn.sendall(b"K")
                        continue
                    raw = recv_exact(conn, 64)
                    if not set(raw) <= KEY_CHARS:
                        return          # not a key this store ever makes: drop the connection
                    key = raw.decode()
                    if op == OP_PUT:
                        (n,) = struct.unpack("<Q", recv_exact(conn, 8))
                        if n > capacity_bytes:
                            return      # could never be stored: nothing is allocated for it
                        digest = recv_exact(conn, 32)
                        got = receive_payload(conn, n)
                        if got is None:
                            return
                        payload, actual = got
                        if actual != digest:
                            conn.sendall(b"E")
                            continue
                        with lock:   # stored only now: all bytes arrived and match their digest
                            if key in store:
                                state["size"] -= len(store.pop(key)[0])
                            store[key] = (payload, digest)
                            state["size"] += n
                            while state["size"] > capacity_bytes and store:
                                state["size"] -= len(store.popitem(last=False)[1][0])
                        conn.sendall(b"K")
                    elif op == OP_HAS:
                        with lock:
                            found = key in store
                        conn.sendall(b"1" if found else b"0")
                    elif op == OP_GET:
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
                if admitted:
                    with lock:
                        state["open"] -= 1

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((LOOPBACK, port))
    srv.listen(max(max_connections, 16))
    port = srv.getsockname()[1]
    if port_file:
        Path(port_file).write_text(str(port))
    print(port, flush=True)
    while not stop.is_set():
        conn, _ = srv.accept()
        with lock:
            full = state["pending"] >= MAX_PENDING_HANDSHAKES
            if not full:
                state["pending"] += 1
        if full:            # too many handshakes waiting: close before any thread starts
            conn.close()
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class PeerProcess:
    """A peer started as `python -m inferbook.serving.kv_offload peer` on 127.0.0.1 (a free port),
    with a fresh secret in its environment and this process as the parent it watches.

    `secret` is this run's secret (a `PeerTier` to this address finds it by itself)."""

    def __init__(self, capacity_bytes: int = 1 << 34, start_timeout_s: float = 60.0,
                 max_connections: int = MAX_PEER_CONNECTIONS):
        self.secret = secrets.token_hex(32)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env[PEER_SECRET_ENV] = self.secret
        self.proc = subprocess.Popen([sys.executable, "-m", "inferbook.serving.kv_offload", "peer",
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
                nonce = recv_exact(s, NONCE_BYTES)     # a wrong answer: the peer closes (ConnectionError)
                s.sendall(handshake_answer(self.secret, nonce))
                verdict = recv_exact(s, 1)
                if verdict == b"B":
                    raise ConnectionError("peer busy: at its connection cap")
                if verdict != b"K":
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
        payload = row_memoryview(row)
        with self.lock:
            try:
                s = self._conn()
                s.sendall(OP_PUT + key.encode() + struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest())
                s.sendall(payload)
                ok = recv_exact(s, 1) == b"K"
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
                s.sendall(OP_HAS + key.encode())
                return recv_exact(s, 1) == b"1"
            except (OSError, ConnectionError) as e:
                self._drop(e, isinstance(e, TimeoutError | socket.timeout))
                return False

    def read_into(self, key: str, row: torch.Tensor) -> bool:
        if self.disabled:
            return False
        t0 = time.perf_counter()
        view = row_memoryview(row)
        with self.lock:
            try:
                s = self._conn()
                s.sendall(OP_GET + key.encode())
                if recv_exact(s, 1) != b"1":
                    return False
                (n,) = struct.unpack("<Q", recv_exact(s, 8))
                digest = recv_exact(s, 32)
                if n != self.row_bytes:
                    self._drop(ValueError(f"peer sent {n} bytes for a {self.row_bytes}-byte row"), False)
                    self.stats.corrupt += 1
                    return False
                recv_exact(s, n, into=view)
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
                s.sendall(OP_CLEAR)
                ok = recv_exact(s, 1) == b"K"
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
            s.sendall(OP_FAULT + code)
            recv_exact(s, 1)

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None



class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def main(argv: list[str] | None = None) -> None:
    p = _OneLineParser(prog="python -m inferbook.serving.kv_offload")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_OneLineParser)
    peer = sub.add_parser("peer", help="run a KV peer on 127.0.0.1")
    peer.add_argument("--port", type=int, default=None, help="1..65535 (default: any free port)")
    peer.add_argument("--capacity-bytes", type=int, default=1 << 34, help=">= 0")
    peer.add_argument("--port-file", default=None)
    peer.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    peer.add_argument("--max-connections", type=int, default=MAX_PEER_CONNECTIONS, help=">= 1")
    a = p.parse_args(argv)
    try:
        if a.port is not None and not 1 <= a.port <= 65535:
            raise UserError(f"--port {a.port} must be in 1..65535 (omit it for any free port)")
        if a.max_connections < 1:
            raise UserError(f"--max-connections {a.max_connections} must be at least 1")
        if a.capacity_bytes < 0:
            raise UserError(f"--capacity-bytes {a.capacity_bytes} must be at least 0")
        if a.parent_pid is not None and a.parent_pid < 1:
            raise UserError(f"--parent-pid {a.parent_pid} must be a positive process id")
        if a.port_file is not None and not Path(a.port_file).parent.is_dir():
            raise UserError(f"--port-file {a.port_file!r}: its folder does not exist")
        serve_peer(a.port or 0, a.capacity_bytes, a.port_file, parent_pid=a.parent_pid,
                   max_connections=a.max_connections)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
