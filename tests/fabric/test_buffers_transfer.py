"""TP shards across processes, end to end over ``tcp;ofi_rxm`` (and ``shm``).

Per side, two "TP worker" processes allocate their KV shards (host KVBuffers) and hand them
to their side's engine process over a Unix socket. The prefill engine writes every shard to
the decode engine, which maps the decode workers' shards; each decode worker then checks the
bytes in its own mapping. The prefill workers have exited before the prefill engine writes,
so it writes from memory whose exporters are gone.
"""

from __future__ import annotations

import gc
import multiprocessing.resource_tracker
import os
import socket

import numpy as np
import pytest

pytest.importorskip("kvxfer._fabric", reason="kvxfer's native module (libfabric) is not built")

import kvxfer  # noqa: E402
from kvxfer import KVBuffer  # noqa: E402
from kvxfer.share import recv_handles, send_handles  # noqa: E402
from _data import open_fds  # noqa: E402
from _procs import CTX, DEADLINE, Children  # noqa: E402

TP = 2
SHARD = (1 << 20) + 4096 + 13  # not a page multiple: nbytes, not alloc_nbytes, is what travels
IMM = 7


def pattern(rank: int, n: int) -> bytes:
    return np.random.default_rng(1000 + rank).integers(0, 256, n, dtype=np.uint8).tobytes()


def memfds_mapped() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "/memfd:kvt-tp" in line]


def memfds_open() -> list[str]:
    """This test's memfds still open here (the engine's own sockets come and go with peers)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:kvt-tp"):
            out.append(target)
    return out


# ---- child processes ------------------------------------------------------------------------


def prefill_worker(conn, sock, rank: int) -> str:
    """Allocate, fill, hand over, exit: the engine keeps the shard alive."""
    with sock, KVBuffer.allocate(SHARD, name=f"kvt-tp-p{rank}") as shard:
        shard.write(pattern(rank, SHARD))
        with shard.export() as h:
            send_handles(sock, [h])
    return "handed over"


def decode_worker(conn, sock, rank: int) -> str:
    """Allocate an empty shard, hand it over, then check what arrived in its own mapping."""
    with sock, KVBuffer.allocate(SHARD, name=f"kvt-tp-d{rank}") as shard:
        with shard.export() as h:
            send_handles(sock, [h])
        conn.send(("handed over", rank))
        if not conn.poll(DEADLINE):
            raise TimeoutError("no go-ahead from the test")
        assert conn.recv() == "check"
        got = shard.read()
        if got != pattern(rank, SHARD):
            bad = int(np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(pattern(rank, SHARD), np.uint8))[0])
            raise AssertionError(f"decode rank {rank}: first wrong byte at offset {bad}")
    return "verified"


def _take_shards(socks) -> list[KVBuffer]:
    shards = []
    for s in socks:
        with s:
            s.settimeout(DEADLINE)
            (h,) = recv_handles(s)
        with h:
            shards.append(KVBuffer.import_(h))
    return shards


def _close_and_check(mrs: list, shards: list[KVBuffer]) -> None:
    """Deregister and close every shard; then no memfd may be left open or mapped."""
    for mr in mrs:
        mr.close()
    for s in shards:
        s.close()
    mrs.clear()
    shards.clear()
    gc.collect()
    assert not memfds_open(), f"memfds left open: {memfds_open()}"
    assert not memfds_mapped(), f"memfds left mapped: {memfds_mapped()}"


def decode_engine(conn, provider: str, socks, peer_conn) -> str:
    shards = _take_shards(socks)
    eng = kvxfer.Engine(provider, node="127.0.0.1")
    try:
        mrs = [eng.register(s) for s in shards]
        done = eng.expect(IMM, TP)
        peer_conn.send((eng.address, [mr.descriptor() for mr in mrs]))
        done.wait(DEADLINE)
        peer_conn.send("received")
        _close_and_check(mrs, shards)
        del mrs, shards
    finally:
        eng.close()
        peer_conn.close()
    return "received"


def prefill_engine(conn, provider: str, socks, peer_conn) -> str:
    shards = _take_shards(socks)
    conn.send(("imported", len(shards)))
    if not conn.poll(DEADLINE):  # the test lets us write once the prefill workers are gone
        raise TimeoutError("no go-ahead from the test")
    assert conn.recv() == "go"
    eng = kvxfer.Engine(provider, node="127.0.0.1")
    try:
        mrs = [eng.register(s) for s in shards]
        if not peer_conn.poll(DEADLINE):
            raise TimeoutError("no address from the decode engine")
        address, descs = peer_conn.recv()
        peer = eng.connect(address)
        transfers = [
            eng.write(mr, 0, peer, eng.remote(desc), 0, shard.nbytes, imm=IMM)
            for mr, desc, shard in zip(mrs, descs, shards, strict=True)
        ]
        for t in transfers:
            t.wait(DEADLINE)
        if not peer_conn.poll(DEADLINE):  # keep the endpoint up until decode has it all
            raise TimeoutError("decode engine never confirmed")
        assert peer_conn.recv() == "received"
        _close_and_check(mrs, shards)
        del mrs, shards, transfers
    finally:
        eng.close()
        peer_conn.close()
    return "written"


# ---- the test -------------------------------------------------------------------------------


def test_tp_shards_prefill_to_decode(provider):
    """``provider`` (tests/fabric/conftest.py): tcp;ofi_rxm, and shm where it opens."""
    multiprocessing.resource_tracker.ensure_running()
    gc.collect()
    before = open_fds()
    procs = Children()
    grace = 1.0  # on failure, do not wait out the children's deadlines
    try:
        side_socks = {}
        workers = {}
        for side, fn in (("prefill", prefill_worker), ("decode", decode_worker)):
            engine_ends = []
            for rank in range(TP):
                eng_end, worker_end = socket.socketpair()
                workers[side, rank] = procs.spawn(f"{side} worker {rank}", fn, worker_end, rank, with_conn=True)
                worker_end.close()
                engine_ends.append(eng_end)
            side_socks[side] = engine_ends
        p_end, d_end = CTX.Pipe()
        decode_eng = procs.spawn("decode engine", decode_engine, provider, side_socks["decode"], d_end, with_conn=True)
        prefill_eng = procs.spawn("prefill engine", prefill_engine, provider, side_socks["prefill"], p_end,
                             with_conn=True)
        for s in side_socks["prefill"] + side_socks["decode"]:
            s.close()
        p_end.close()
        d_end.close()

        for rank in range(TP):
            assert workers["prefill", rank].result() == "handed over"
            assert workers["decode", rank].result() == rank
        assert prefill_eng.result() == TP  # ("imported", TP)
        for child in procs.items:  # the exporters exit before their memory is written from
            if child.name.startswith("prefill worker"):
                child.join(DEADLINE)
        prefill_eng.send("go")
        assert prefill_eng.result() == "written"
        assert decode_eng.result() == "received"
        for rank in range(TP):
            workers["decode", rank].send("check")
        for rank in range(TP):
            assert workers["decode", rank].result() == "verified"
        grace = DEADLINE
    finally:
        procs.close(grace)
    assert not procs.crashes, procs.crashes
    for name, code in procs.exitcodes.items():
        assert code == 0, f"{name} exited with {code}"
    gc.collect()
    assert open_fds() == before
