"""The KV peer as a well-behaved local service: only its parent may talk to it (per-run secret,
challenge-response), it exits when its parent dies, connections are capped, and client faults
are counted, never raised. Also: a file-tier header that is JSON but not an object is a miss."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from inferbook.serving import kv_offload as kt

ROW = 256


def _row(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _raw(address) -> socket.socket:
    s = socket.create_connection(address, timeout=5)
    s.settimeout(5)
    return s


def _closed(s: socket.socket) -> bool:
    """True if the peer closed the connection (EOF or reset) rather than answering."""
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


@pytest.fixture
def peer():
    with kt.PeerProcess(max_connections=3) as p:
        yield p


def test_wrong_or_missing_secret_is_refused(peer):
    key = "ab" * 32
    good = kt.PeerTier(peer.address, ROW)
    assert good.put(key, _row(1))
    # a client that knows the address but not the secret: the handshake fails, nothing is served
    for secret in ("", "0" * 64):
        bad = kt.PeerTier(peer.address, ROW, secret=secret, max_failures=100)
        assert not bad.contains(key)
        back = torch.zeros(ROW, dtype=torch.uint8)
        assert not bad.read_into(key, back) and not bool(back.any())
        assert "handshake" in bad.stats.last_error or "closed" in bad.stats.last_error
    # a raw client answering the nonce wrongly is disconnected
    s = _raw(peer.address)
    nonce = kt.recv_exact(s, 32)
    s.sendall(hashlib.sha256(nonce).digest())
    assert _closed(s)
    s.close()


def test_forged_put_and_stop_without_handshake_are_refused(peer):
    key = "cd" * 32
    forged = _row(2)
    payload = bytes(forged.numpy())
    s = _raw(peer.address)
    kt.recv_exact(s, 32)                         # the challenge, ignored
    s.sendall(kt.OP_PUT + key.encode() + struct.pack("<Q", ROW) + hashlib.sha256(payload).digest() + payload)
    assert _closed(s)
    s.close()
    s = _raw(peer.address)
    kt.recv_exact(s, 32)
    s.sendall(kt.OP_STOP + b"\0" * 31)           # STOP in place of the answer
    assert _closed(s)
    s.close()
    time.sleep(0.2)
    assert peer.alive
    good = kt.PeerTier(peer.address, ROW)
    assert not good.contains(key)                 # the forged block was never stored


def test_connections_are_capped(peer):
    tiers = [kt.PeerTier(peer.address, ROW) for _ in range(3)]
    for t in tiers:
        assert not t.contains("ef" * 32)          # connected and authenticated, cap reached
    extra = kt.PeerTier(peer.address, ROW, max_failures=100)
    assert not extra.contains("ef" * 32)          # the 4th authenticates, is told "busy" and closed
    assert "busy" in extra.stats.last_error
    tiers[0].close()
    deadline = time.monotonic() + 5
    while True:                                    # the slot frees once the peer sees the close
        t = kt.PeerTier(peer.address, ROW)
        if t.contains("ef" * 32) is False and t.sock is not None:
            break
        assert time.monotonic() < deadline, "a closed connection never gave its slot back"
        time.sleep(0.05)


def test_unauthenticated_connections_neither_count_nor_linger(peer):
    """Clients that connect and never answer (or drip their answer a byte at a time) do not take the
    cap's seats, and each is dropped once the handshake deadline has passed."""
    idle = [_raw(peer.address) for _ in range(6)]          # twice the cap of 3, none answering
    drip = _raw(peer.address)
    kt.recv_exact(drip, 32)
    t0 = time.monotonic()
    good = kt.PeerTier(peer.address, ROW)
    assert good.put("ab" * 32, _row(9))                    # the parent still gets in at once
    for _ in range(20):                                    # one byte per 0.1 s: within a per-recv timeout
        try:
            drip.sendall(b"\0")
        except OSError:
            break
        time.sleep(0.1)
    for s in idle + [drip]:
        kt.recv_exact(s, 32) if s is not drip else None
        assert _closed(s)                                  # EOF: the peer dropped it
        s.close()
    assert time.monotonic() - t0 < kt.HANDSHAKE_TIMEOUT_S + 3.0


def _vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _authenticated(peer) -> socket.socket:
    s = _raw(peer.address)
    nonce = kt.recv_exact(s, 32)
    s.sendall(kt.handshake_answer(peer.secret, nonce))
    assert kt.recv_exact(s, 1) == b"K"
    return s


def test_a_put_announcing_2_gib_allocates_only_what_arrived():
    with kt.PeerProcess(capacity_bytes=4 << 30) as p:
        before = _vm_rss_kib(p.proc.pid)
        s = _authenticated(p)
        s.sendall(kt.OP_PUT + ("ab" * 32).encode() + struct.pack("<Q", 2 << 30) + bytes(32) + bytes(1 << 20))
        time.sleep(0.5)
        grew_mib = (_vm_rss_kib(p.proc.pid) - before) / 1024
        assert grew_mib < 64, f"the peer grew by {grew_mib:.0f} MiB for 1 MiB received"
        s.close()
        assert kt.PeerTier(p.address, ROW).put("cd" * 32, _row(5))   # still serving


def test_a_put_above_capacity_is_dropped_before_any_payload():
    with kt.PeerProcess(capacity_bytes=1 << 16) as p:
        s = _authenticated(p)
        s.sendall(kt.OP_PUT + ("ab" * 32).encode() + struct.pack("<Q", 1 << 20))
        assert _closed(s)
        s.close()
        t = kt.PeerTier(p.address, ROW)
        assert t.put("cd" * 32, _row(6)) and not t.contains("ab" * 32)


@pytest.mark.parametrize("args, named", [
    (["--port", "99999"], "--port 99999"), (["--port", "0"], "--port 0"), (["--port", "x"], "--port"),
    (["--max-connections", "0"], "--max-connections 0"), (["--capacity-bytes", "-1"], "--capacity-bytes -1"),
    (["--parent-pid", "-5"], "--parent-pid -5"), (["--port-file", "/nonexistent-dir/p"], "--port-file"),
], ids=["port-high", "port-zero", "port-text", "connections-0", "capacity-neg", "ppid-neg", "portfile-dir"])
def test_peer_cli_bounds_one_line_exit_2(args, named):
    env = dict(os.environ, **{kt.PEER_SECRET_ENV: "0123456789abcdef" * 2})
    r = subprocess.run([sys.executable, "-m", "inferbook.serving.kv_offload", "peer", *args], env=env,
                       capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and named in lines[0] and r.stdout == "", (r.returncode, r.stderr)


def test_clear_on_a_dead_peer_is_a_counted_failure():
    p = kt.PeerProcess()
    t = kt.PeerTier(p.address, ROW, timeout_s=0.5)
    assert t.clear() is True
    p.stop()
    assert t.clear() is False
    assert t.stats.failures == 1 and t.stats.last_error


def test_peer_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != kt.PEER_SECRET_ENV}
    r = subprocess.run([sys.executable, "-m", "inferbook.serving.kv_offload", "peer"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "secret" in r.stderr and "Traceback" not in r.stderr


PARENT_DEATH_TIMEOUT_S = 5.0   # stated: the peer polls its parent every PARENT_POLL_S (0.2 s)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)   # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_peer_exits_when_its_parent_is_killed():
    script = textwrap.dedent("""
        import sys, time
        from inferbook.serving.kv_offload import PeerProcess
        p = PeerProcess()
        print(p.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        peer_pid = int(parent.stdout.readline())
        assert not _gone(peer_pid)
        parent.kill()                              # SIGKILL: no cleanup code of the parent runs
        parent.wait(timeout=10)
        deadline = time.monotonic() + PARENT_DEATH_TIMEOUT_S
        while not _gone(peer_pid):
            assert time.monotonic() < deadline, f"peer {peer_pid} outlived its parent by {PARENT_DEATH_TIMEOUT_S} s"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_file_header_that_is_json_but_not_an_object_is_a_counted_miss(tmp_path):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    key = "12" * 32
    assert ft.put(key, _row(3))
    for header in (b"[1, 2, 3]", b"42", b'"key"', b"null"):
        json.loads(header)                         # valid JSON each time
        path = ft.path(key)
        path.write_bytes(kt.MAGIC + struct.pack("<I", len(header)) + header + bytes(ROW))
        before = ft.stats.corrupt
        assert ft.read_into(key, torch.empty(ROW, dtype=torch.uint8)) is False
        assert ft.stats.corrupt == before + 1 and "not an object" in ft.stats.last_error
        assert not path.exists()


def test_lookup_hint_knows_only_what_this_client_stored(peer):
    """The engine's no-round-trip check: a key is 'maybe there' only after this client stored it,
    and `clear` forgets every hint with the peer's contents."""
    t = kt.PeerTier(peer.address, ROW)
    key = "9a" * 32
    assert not t.maybe_contains(key)
    assert t.put(key, _row(4)) and t.maybe_contains(key) and t.contains(key)
    assert t.clear() and not t.maybe_contains(key) and not t.contains(key)
