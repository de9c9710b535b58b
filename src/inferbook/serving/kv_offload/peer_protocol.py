"""The remote peer's wire protocol: who may talk to it, and the bytes of each request."""
from __future__ import annotations

import hashlib
import hmac
import socket
import time

LOOPBACK = "127.0.0.1"

#
# Who may talk to it. The parent draws a per-run secret (`secrets.token_hex`) and hands it to the
# child in the child's environment (`PEER_SECRET_ENV`), never on the command line (which any
# local user can read in /proc). Every connection starts with a challenge: the peer sends a
# 32-byte nonce, the client answers HMAC-SHA256(secret, nonce), and the peer answers b"K"
# (admitted), b"B" (authenticated, but `max_connections` clients are already admitted) or closes
# (a wrong answer). The secret itself never crosses the socket.
#
# A client that lies. A connection still in its handshake does not count against
# `max_connections`: it has `HANDSHAKE_TIMEOUT_S` in all (a deadline, not a per-byte timeout, so
# dripping one byte at a time does not extend it), and at most `MAX_PENDING_HANDSHAKES` wait at
# once (a further one is closed at once, before any thread starts). So unauthenticated clients can
# neither lock out the parent nor pin threads for long. A PUT's announced length is only a bound:
# the peer refuses one above its capacity and otherwise receives the payload in `RECV_CHUNK_BYTES`
# pieces, so its memory grows with the bytes that actually arrived, and all payloads in flight
# together stay within the capacity. The peer watches its parent: when the parent is gone (its
# parent pid changes), it exits within `PARENT_POLL_S`.
#
# Wire format, after the handshake. Request: op (1 byte) + key (64 ascii hex). PUT adds length
# (u64) + sha256 (32 bytes) + payload; GET/HAS add nothing; FAULT adds a mode byte; CLEAR and
# STOP are one byte. Reply: PUT -> b"K" (stored) or b"E"; HAS -> b"1"/b"0"; GET -> b"0", or
# b"1" + length (u64) + sha256 (32) + payload.

OP_PUT, OP_GET, OP_HAS, OP_FAULT, OP_STOP, OP_CLEAR = b"P", b"G", b"H", b"F", b"S", b"C"
FAULTS = {b"n": "none", b"d": "die mid-transfer", b"s": "stall mid-transfer"}
PEER_SECRET_ENV = "INFERBOOK_KV_PEER_SECRET"
HANDSHAKE_TIMEOUT_S = 1.0
MAX_PENDING_HANDSHAKES = 64
RECV_CHUNK_BYTES = 1 << 20
PARENT_POLL_S = 0.2
MAX_PEER_CONNECTIONS = 8
NONCE_BYTES = 32
KEY_CHARS = frozenset(b"0123456789abcdef")


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf if into is not None else bytes(buf)


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes before `deadline` (time.monotonic), however slowly they arrive; TimeoutError
    once the deadline passed, ConnectionError on an early end."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"handshake deadline passed after {len(buf)} of {n} bytes")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def handshake_answer(secret: str, nonce: bytes) -> bytes:
    """The client's answer to the peer's challenge: HMAC-SHA256(secret, nonce), 32 bytes."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()
