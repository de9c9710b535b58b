"""The filesystem tier: one file per block, written atomically, authenticated on read.

A block file is read as something a stranger may have put there: opened without following a
symlink and without blocking (a FIFO or a device in its place is a miss, never a hang), checked
to be a regular file of plausible size, read within a deadline, its JSON header scanned for
nesting before it is parsed (a header of 60,000 '[' is a miss, not a RecursionError), and its
header authenticated with a key only this store holds (HMAC-SHA256 over key, namespace, length
and the payload's SHA-256): a forged header with a payload whose SHA-256 matches is still a miss.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from ...record import json_depth
from .layout import row_memoryview
from .tiers import TierStats

MAGIC = b"IBKVBLK2"
MAX_HEADER_BYTES = 1 << 16
READ_CHUNK_BYTES = 4 << 20


class FileTier:
    """Files `<dir>/<key[:2]>/<key>.kvb`: MAGIC, header length (u32), JSON header {key, nbytes,
    sha256, namespace, mac}, payload. Written to a temporary file in the same folder, fsync'ed, then
    `os.replace`d (atomic on POSIX): a reader sees no file or a whole one.

    `secret`: the store's key for `mac` (default: 32 random bytes drawn now, so only this store
    reads its files back; processes sharing a folder pass the same key). `read_timeout_s`: a
    read that takes longer is a miss."""

    name = "file"

    def __init__(self, directory: str | os.PathLike, ns: str, row_bytes: int, *,
                 capacity_bytes: int | None = None, durable: bool = True, max_failures: int = 3,
                 secret: bytes | None = None, read_timeout_s: float = 10.0):
        self.dir, self.ns, self.row_bytes = Path(directory), ns, row_bytes
        self.secret = secrets.token_bytes(32) if secret is None else bytes(secret)
        if len(self.secret) < 16:
            raise ValueError("a file tier's secret needs at least 16 bytes")
        self.read_timeout_s = float(read_timeout_s)
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
        payload = row_memoryview(row)
        fields = {"key": key, "nbytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                  "namespace": self.ns}
        header = json.dumps(dict(fields, mac=self._mac(fields))).encode()
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

    def _mac(self, fields: dict) -> str:
        msg = json.dumps([fields["key"], fields["namespace"], fields["nbytes"], fields["sha256"]]).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def read_into(self, key: str, row: torch.Tensor) -> bool:
        """Read and verify one block into `row`; False (a miss) if absent, not a regular file, short,
        malformed, not authenticated or slower than `read_timeout_s`. A bad file is counted and
        removed: wrong KV is never returned."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.read_timeout_s
        p = self.path(key)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return False
        except OSError as e:            # a symlink (ELOOP), no permission, ...
            return self._corrupt(p, f"cannot open: {type(e).__name__}: {e.strerror or e}")
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):    # a FIFO or a device: reading it could block or never end
                    return self._corrupt(p, "not a regular file")
                if st.st_size > len(MAGIC) + 4 + MAX_HEADER_BYTES + self.row_bytes:
                    return self._corrupt(p, f"{st.st_size} bytes: larger than any block file of this store")
                head = f.read(len(MAGIC) + 4)
                if len(head) != len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
                    return self._corrupt(p, "bad magic")
                (hlen,) = struct.unpack("<I", head[len(MAGIC):])
                if hlen > MAX_HEADER_BYTES:
                    return self._corrupt(p, "header too long")
                text = f.read(hlen).decode()
                if json_depth(text) > 1:          # a flat object: nothing nested to recurse on
                    return self._corrupt(p, "header nests deeper than one level")
                header = json.loads(text)
                if not isinstance(header, dict):     # valid JSON, but a list, number or string
                    return self._corrupt(p, f"header is a JSON {type(header).__name__}, not an object")
                if header.get("key") != key or header.get("namespace") != self.ns \
                        or header.get("nbytes") != self.row_bytes or not isinstance(header.get("sha256"), str) \
                        or not isinstance(header.get("mac"), str):
                    return self._corrupt(p, "header does not match")
                if not hmac.compare_digest(header["mac"], self._mac(header)):
                    return self._corrupt(p, "header not authenticated by this store's key")
                view = row_memoryview(row)
                got = 0
                while got < self.row_bytes:
                    if time.monotonic() > deadline:
                        self.stats.timeouts += 1
                        return self._corrupt(p, f"read slower than {self.read_timeout_s:g} s")
                    k = f.readinto(view[got:min(self.row_bytes, got + READ_CHUNK_BYTES)])
                    if not k:
                        break
                    got += k
                if got != self.row_bytes or f.read(1):
                    return self._corrupt(p, "length differs")
                if not hmac.compare_digest(hashlib.sha256(view).hexdigest(), header["sha256"]):
                    return self._corrupt(p, "checksum differs")
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
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
