"""kvxfer.messenger.workers: TP workers publish their KV buffers to the messenger process.

A connection that is not a proper publication (a probe, a worker killed mid-publish, a bad
header, a rank sent twice) is refused on its own: it used to abort the whole ``collect``, so
every legitimate worker then failed with "no messenger collecting".
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvxfer.buffers import KVBuffer
from kvxfer.errors import PeerError, TimeoutError
from kvxfer.messenger.workers import collect, publish


def _collect_in_thread(path, ranks, timeout):
    res: dict = {}

    def run():
        try:
            res["out"] = collect(path, ranks, timeout=timeout)
        except Exception as exc:        # handed to the test thread
            res["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(path)
            return t, res, probe
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.02)
    raise AssertionError("collect never listened")


def test_stray_connections_do_not_stop_the_collection(tmp_path):
    path = str(tmp_path / "collect.sock")
    t, res, probe = _collect_in_thread(path, [0, 1], timeout=10)
    probe.close()                                       # hangs up before its header
    bad = socket.socket(socket.AF_UNIX)
    bad.connect(path)
    bad.sendall(struct.pack("<4sHHII", b"NOPE", 1, 0, 0, 0))   # not a publication
    bad.close()
    bufs = [KVBuffer.allocate(4096), KVBuffer.allocate(8192)]
    try:
        bufs[0].write(b"rank0")
        publish(path, 0, [bufs[0]], timeout=5)
        with pytest.raises(PeerError):                  # rank 0 again: refused, alone
            publish(path, 0, [bufs[1]], timeout=5)
        publish(path, 1, [bufs[1]], timeout=5)
        t.join(10)
        assert "err" not in res, res.get("err")
        out = res["out"]
        assert sorted(out) == [0, 1] and [len(v) for v in out.values()] == [1, 1]
        assert out[0][0].read(5) == b"rank0"
        for v in out.values():
            for b in v:
                b.close()
    finally:
        for b in bufs:
            b.close()


def test_a_missing_rank_times_out_and_names_what_was_refused(tmp_path):
    path = str(tmp_path / "collect.sock")
    t, res, probe = _collect_in_thread(path, [3], timeout=1.0)
    probe.sendall(struct.pack("<4sHHII", b"NOPE", 1, 0, 3, 0))
    probe.close()
    t.join(10)
    err = res.get("err")
    assert isinstance(err, TimeoutError) and "[3]" in str(err) and "refused meanwhile" in str(err)


def test_check_ends_the_collection_at_once(tmp_path):
    """``check`` runs while collect waits: what it raises (a TP launcher's "rank 1 exited")
    ends the collection long before its timeout, with what was imported closed."""
    path = str(tmp_path / "collect.sock")
    gone = threading.Event()
    calls = []

    def check():
        calls.append(time.monotonic())
        if gone.is_set():
            raise PeerError("TP rank 1 exited (code 7) before handing over its KV buffers")

    res: dict = {}

    def run():
        try:
            res["out"] = collect(path, [0, 1], timeout=60, check=check)
        except Exception as exc:
            res["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    buf = KVBuffer.allocate(4096)
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                publish(path, 0, [buf], timeout=5)
                break
            except TimeoutError:
                assert time.monotonic() < deadline
        gone.set()
        t.join(30)                          # its timeout is 60 s: ended by check, not by it
        assert not t.is_alive()
        assert isinstance(res.get("err"), PeerError) and "rank 1 exited" in str(res["err"])
        assert calls
    finally:
        buf.close()
