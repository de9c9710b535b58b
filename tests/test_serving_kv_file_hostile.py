"""The file tier against a folder someone else can write to: whatever sits under a block's name,
a read is a counted miss or the block this store wrote — never an exception, a hang or wrong KV."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import pytest
import torch

from inferbook.serving import kv_offload as kt
from inferbook.record import json_depth
from inferbook.serving.kv_offload.file_tier import MAX_HEADER_BYTES

ROW = 256
KEY = "3c" * 32


def _row(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _read_within(ft, key, seconds: float = 5.0):
    """read_into on a thread: (returned value, seconds taken); fails the test on a hang."""
    out = {}

    def run():
        t0 = time.monotonic()
        out["ok"] = ft.read_into(key, torch.empty(ROW, dtype=torch.uint8))
        out["s"] = time.monotonic() - t0
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"read_into did not return within {seconds} s"
    return out["ok"], out["s"]


def _file(ft, header: bytes, payload: bytes) -> None:
    p = ft.path(KEY)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(kt.MAGIC + struct.pack("<I", len(header)) + header + payload)


def test_own_file_reads_back(tmp_path):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    row = _row(1)
    assert ft.put(KEY, row)
    back = torch.empty(ROW, dtype=torch.uint8)
    assert ft.read_into(KEY, back) and torch.equal(back, row)


@pytest.mark.parametrize("mac", [None, "00" * 32, "forged"], ids=["no-mac", "zero-mac", "text-mac"])
def test_forged_header_with_consistent_sha256_is_a_miss(tmp_path, mac):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    payload = bytes(_row(2).numpy())
    fields = {"key": KEY, "nbytes": ROW, "sha256": hashlib.sha256(payload).hexdigest(), "namespace": "ns"}
    if mac is not None:
        fields["mac"] = mac
    _file(ft, json.dumps(fields).encode(), payload)
    ok, _ = _read_within(ft, KEY)
    assert ok is False and ft.stats.corrupt == 1 and not ft.path(KEY).exists()


def test_another_stores_file_is_a_miss_and_a_shared_key_reads_it(tmp_path):
    writer = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    assert writer.put(KEY, _row(3))
    stranger = kt.FileTier(tmp_path, "ns", ROW, durable=False)     # same folder, its own key
    assert _read_within(stranger, KEY)[0] is False and "authenticated" in stranger.stats.last_error
    assert writer.put(KEY, _row(3))
    friend = kt.FileTier(tmp_path, "ns", ROW, durable=False, secret=writer.secret)
    assert _read_within(friend, KEY)[0] is True


def test_deeply_nested_header_is_a_miss_not_a_recursion_error(tmp_path):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    _file(ft, b"[" * 60_000, bytes(ROW))
    ok, _ = _read_within(ft, KEY)
    assert ok is False and ft.stats.corrupt == 1 and "nests" in ft.stats.last_error


@pytest.mark.parametrize("text, ok", [('{"a": "[[[{"}', True), ('{"a": [1]}', False), ('[1, 2]', True),
                                      ('{"a": "\\"[["}', True), ("[" * 3, False)])
def test_header_nesting_scan(text, ok):
    assert (json_depth(text) <= 1) is ok   # the file tier's rule for a block header


def test_fifo_in_place_of_a_block_file_is_a_miss_not_a_hang(tmp_path):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    p = ft.path(KEY)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(p)
    assert not ft.contains(KEY)
    ok, seconds = _read_within(ft, KEY)
    assert ok is False and seconds < 1.0 and "regular" in ft.stats.last_error


def test_symlink_and_oversized_file_are_misses(tmp_path):
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    p = ft.path(KEY)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/zero", p)
    assert _read_within(ft, KEY)[0] is False and not os.path.lexists(p)
    p.write_bytes(kt.MAGIC + struct.pack("<I", 2) + b"{}" + bytes(ROW + MAX_HEADER_BYTES))
    assert _read_within(ft, KEY)[0] is False and "larger" in ft.stats.last_error


def test_a_check_that_can_fail(tmp_path, monkeypatch):
    """Break the authentication (accept any mac): the forged block is then served — so the test above
    can tell a working check from a missing one."""
    from inferbook.serving.kv_offload import file_tier

    monkeypatch.setattr(file_tier.hmac, "compare_digest", lambda a, b: True)
    ft = kt.FileTier(tmp_path, "ns", ROW, durable=False)
    payload = bytes(_row(4).numpy())
    fields = {"key": KEY, "nbytes": ROW, "sha256": hashlib.sha256(payload).hexdigest(), "namespace": "ns",
              "mac": "00" * 32}
    _file(ft, json.dumps(fields).encode(), payload)
    assert _read_within(ft, KEY)[0] is True
