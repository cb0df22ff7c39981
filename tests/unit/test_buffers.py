"""KVBuffer (host memfd path), SharedHandle and kvxfer.share: no GPU, no libfabric needed.

Several tests spawn processes ('spawn' context, as a TP worker would be) and forward the
child's traceback to the test on failure.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import struct
import threading
import uuid
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import KVBuffer, SharedHandle
from kvxfer.buffers import cuda_available
from kvxfer.errors import (
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    OutOfBoundsError,
    PeerError,
    UnsupportedError,
)
from kvxfer.share import MAX_FDS_PER_MESSAGE, pack_handles, recv_handles, send_handles, unpack_handles
from _data import open_fds, pattern
from _procs import DEADLINE, spawn

def mapped(name: str) -> bool:
    """Is a memfd of this name mapped in this process?"""
    with open("/proc/self/maps") as f:
        return f"/memfd:{name}" in f.read()


def uniq() -> str:
    return f"kvt-{uuid.uuid4().hex[:10]}"


# ---- allocation and views ------------------------------------------------------------------


def test_allocate_host(no_leaks):
    with KVBuffer.allocate(10_000, "cpu", name="kvt-basic") as buf:
        assert buf.kind == "host" and buf.device == "cpu" and buf.device_ordinal is None
        assert buf.nbytes == 10_000
        assert buf.alloc_nbytes % os.sysconf("SC_PAGESIZE") == 0 and buf.alloc_nbytes >= 10_000
        assert buf.ptr % os.sysconf("SC_PAGESIZE") == 0
        assert not buf.imported
        assert buf.read(16) == bytes(16)  # memfd memory starts zeroed
        assert "kvt-basic" in os.readlink(f"/proc/self/fd/{buf.fileno()}")
        with pytest.raises(UnsupportedError):
            buf.dmabuf_fd()
    assert buf.closed
    with pytest.raises(ClosedError):
        _ = buf.ptr


@pytest.mark.parametrize(
    "nbytes, device, exc",
    [
        (0, "cpu", InvalidArgumentError),
        (-5, "cpu", InvalidArgumentError),
        (1.5, "cpu", InvalidArgumentError),
        (True, "cpu", InvalidArgumentError),
        (64, "tpu", InvalidArgumentError),
        (64, "cuda:x", InvalidArgumentError),
        (64, -1, InvalidArgumentError),
    ],
)
def test_allocate_rejects_bad_arguments(nbytes, device, exc):
    with pytest.raises(exc):
        KVBuffer.allocate(nbytes, device)


def test_views_and_copies_refuse_what_is_not_an_offset(no_leaks):
    """numpy/read/write take plain ints only: a numpy uint64 near 2**64 must not wrap the
    bounds check into an address before the mapping, a float is not truncated, and every
    refusal is a kvxfer error."""
    with KVBuffer.allocate(8192, name=uniq()) as buf:
        huge = np.uint64(2**64 - 8)
        for call in (lambda: buf.numpy(np.uint8, 4096, huge), lambda: buf.read(16, huge),
                     lambda: buf.read(np.uint64(2**64 - 1), 8), lambda: buf.write(b"x" * 16, huge),
                     lambda: buf.numpy(np.uint8, (16 * (2**20 + 1), 2**40 - 2**20 + 1))):
            with pytest.raises(OutOfBoundsError):
                call()
        for call in (lambda: buf.numpy(np.uint8, 16, 0.5), lambda: buf.write(b"x", 0.5),
                     lambda: buf.read(1.0), lambda: buf.numpy(np.uint8, "ab"), lambda: buf.numpy(np.uint8, 2.5),
                     lambda: buf.numpy(object, 8), lambda: buf.numpy("not a dtype"), lambda: buf.write(5)):
            with pytest.raises(InvalidArgumentError):
                call()
        assert buf.read(4, np.uint64(8)) == bytes(4)     # numpy ints in range are fine


def test_constructor_is_private():
    with pytest.raises(TypeError):
        KVBuffer()


def test_numpy_views_share_memory(no_leaks):
    with KVBuffer.allocate(4096 * 3, name=uniq()) as buf:
        kv = buf.numpy(np.float16, (2, 4, 8, 16))  # (k/v, pages, heads, head_dim)
        kv[1, 3] = 2.5
        again = buf.numpy(np.float16, (2, 4, 8, 16))
        assert np.all(again[1, 3] == 2.5) and np.all(again[0] == 0)
        tail = buf.numpy(np.uint8, offset=buf.nbytes - 8)
        assert tail.shape == (8,)
        tail[:] = 7
        assert buf.read(8, buf.nbytes - 8) == bytes([7] * 8)
        buf.write(b"\x01\x02\x03\x04", offset=4)
        assert buf.numpy(np.uint32, (2,))[1] == 0x04030201
        with pytest.raises(OutOfBoundsError):
            buf.numpy(np.float32, (buf.nbytes,))
        with pytest.raises(OutOfBoundsError):
            buf.numpy(np.uint8, (1,), offset=-1)
        with pytest.raises(InvalidArgumentError):
            buf.numpy(np.float64, offset=3)  # 12285 bytes are not whole float64s
        with pytest.raises(OutOfBoundsError):
            buf.write(b"xx", offset=buf.nbytes - 1)
        with pytest.raises(OutOfBoundsError):
            buf.read(2, offset=buf.nbytes - 1)
        del kv, again, tail


def test_dlpack_and_buffer_protocol(no_leaks):
    with KVBuffer.allocate(1024, name=uniq()) as buf:
        via_buf = np.from_dlpack(buf)  # the buffer itself speaks DLPack (kDLCPU)
        via_view = np.from_dlpack(buf.numpy(np.int32))
        assert buf.__dlpack_device__() == (1, 0)
        via_buf[:4] = [1, 2, 3, 4]
        assert via_view[0] == 0x04030201
        mv = memoryview(buf)
        assert mv.nbytes == 1024 and not mv.readonly
        mv[4] = 9
        assert buf.read(1, 4) == b"\x09"
        assert np.asarray(buf).nbytes == 1024
        mv.release()
        del via_buf, via_view


def test_torch_view_host(no_leaks):
    torch = pytest.importorskip("torch")
    with KVBuffer.allocate(4096, name=uniq()) as buf:
        t = buf.torch(torch.bfloat16, (16, 128))
        t.fill_(1.0)
        assert buf.read(2) == b"\x80\x3f"  # bf16 1.0, little-endian
        t2 = torch.from_dlpack(buf)
        assert t2.dtype == torch.uint8 and t2.numel() == 4096
        del t, t2


def test_cuda_unavailable_is_a_clear_error():
    if cuda_available():
        pytest.skip("a GPU is present: tests/gpu covers this")
    with pytest.raises(UnsupportedError, match="(?i)cuda"):
        KVBuffer.allocate(1 << 20, "cuda:0")


def test_huge_pages_or_clear_error(no_leaks):
    try:
        buf = KVBuffer.allocate(3 << 20, huge_pages=True, name=uniq())
    except UnsupportedError as e:
        assert "huge" in str(e).lower()
        return
    with buf:
        assert buf.huge_pages and buf.alloc_nbytes % buf.granularity == 0 and buf.granularity >= 2 << 20
        buf.write(b"hp", (3 << 20) - 2)
        with buf.export() as h, KVBuffer.import_(h) as other:
            assert other.read(2, (3 << 20) - 2) == b"hp"


# ---- export / import / life cycle ----------------------------------------------------------


def test_export_import_same_process(no_leaks):
    name = uniq()
    with KVBuffer.allocate(50_000, name=name) as a:
        with a.export() as h:
            assert h.kind == "host" and h.nbytes == 50_000 and h.alloc_nbytes == a.alloc_nbytes
            b = KVBuffer.import_(h)
        with b:
            assert b.imported and b.ptr != a.ptr and b.nbytes == a.nbytes
            a.write(b"prefill", 100)
            assert b.read(7, 100) == b"prefill"
            b.numpy()[-1] = 0xAB
            assert a.read(1, a.nbytes - 1) == b"\xab"
            with b.export() as h2, KVBuffer.import_(h2) as c:  # an importer can re-export
                assert c.read(7, 100) == b"prefill"
    assert not mapped(name)


def test_closed_handle_and_buffer_refuse():
    buf = KVBuffer.allocate(100)
    h = buf.export()
    h.close()
    h.close()  # idempotent
    with pytest.raises(ClosedError):
        KVBuffer.import_(h)
    buf.close()
    buf.close()
    with pytest.raises(ClosedError):
        buf.export()
    with pytest.raises(ClosedError):
        buf.numpy()
    with pytest.raises(InvalidArgumentError):
        KVBuffer.import_("not a handle")  # type: ignore[arg-type]


def test_import_rejects_short_fd(no_leaks):
    import fcntl

    fd = os.memfd_create("kvt-short", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with SharedHandle(kind="host", nbytes=8192, alloc_nbytes=8192, device="cpu", fd=fd) as h:
        with pytest.raises(Exception, match="smaller than alloc_nbytes"):
            KVBuffer.import_(h)  # mapping past EOF would SIGBUS later; refuse now


def test_import_rejects_an_fd_that_can_shrink(no_leaks):
    """Unsealed, the memfd's owner could ftruncate it under the importer's mapping, and the
    next touch (a read here, a peer's write into a registered region) would SIGBUS."""
    from kvxfer.errors import BufferError

    for flags in (os.MFD_CLOEXEC, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING):   # unsealable, or not sealed
        fd = os.memfd_create("kvt-unsealed", flags)
        os.ftruncate(fd, 8192)
        with SharedHandle(kind="host", nbytes=8192, alloc_nbytes=8192, device="cpu", fd=fd) as h:
            with pytest.raises(BufferError, match="not sealed against shrinking"):
                KVBuffer.import_(h)


def test_shared_handle_validation():
    with pytest.raises(InvalidArgumentError):
        SharedHandle(kind="tpu", nbytes=1, alloc_nbytes=4096, device="cpu", fd=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        SharedHandle(kind="host", nbytes=8192, alloc_nbytes=4096, device="cpu", fd=0)
    with pytest.raises(InvalidArgumentError):
        SharedHandle(kind="host", nbytes=1, alloc_nbytes=4096, device="cpu")


def test_views_outlive_close(no_leaks):
    """close() releases the fd at once but defers the unmap to the last view or lease."""
    name = uniq()
    buf = KVBuffer.allocate(8192, name=name)
    view = buf.numpy(np.uint64)
    lease = buf.lease()
    mv = memoryview(buf)
    buf.close()
    assert mapped(name)
    view[:] = 5  # still valid memory: no segfault
    assert mv[0] == 5
    del view
    mv.release()
    del mv
    gc.collect()
    assert mapped(name)  # the lease still holds it
    del lease
    gc.collect()
    assert not mapped(name)


@settings(max_examples=30, deadline=None)
@given(order=st.permutations(["buffer", "handle", "imported", "view", "imported_view", "lease"]))
def test_close_in_any_order_is_safe(order):
    name = uniq()
    gc.collect()
    before = open_fds()
    buf = KVBuffer.allocate(4096 * 2, name=name)
    objs = {"buffer": buf, "handle": buf.export(), "view": buf.numpy(np.uint32), "lease": buf.lease()}
    objs["imported"] = imp = KVBuffer.import_(objs["handle"])
    objs["imported_view"] = imp.numpy(np.uint32)
    del buf, imp
    alive = set(objs)
    for what in order:
        # everything not yet dropped still reads and writes the same memory
        for v in ("view", "imported_view"):
            if v in alive:
                objs[v][0] += 1
        obj = objs.pop(what)
        alive.discard(what)
        if hasattr(obj, "close"):
            obj.close()
        del obj
        gc.collect()
    assert not objs
    assert open_fds() == before
    assert not mapped(name)


def test_unclosed_objects_warn():
    buf = KVBuffer.allocate(100)
    h = buf.export()
    with pytest.warns(ResourceWarning, match="unclosed <KVBuffer"):
        del buf
        gc.collect()
    with pytest.warns(ResourceWarning, match="unclosed SharedHandle"):
        del h
        gc.collect()


def test_not_picklable():
    with KVBuffer.allocate(100) as buf, buf.export() as h:
        with pytest.raises(TypeError, match="send_handles"):
            pickle.dumps(h)
        with pytest.raises(TypeError, match="export"):
            pickle.dumps(buf)


# ---- handle passing in one process --------------------------------------------------------


def _send_in_thread(sock, handles):
    t = threading.Thread(target=send_handles, args=(sock, handles), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_SEQPACKET])
@pytest.mark.parametrize("count", [0, 1, MAX_FDS_PER_MESSAGE + 7])
def test_send_recv_handles(no_leaks, kind, count):
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    with a, b:
        b.settimeout(DEADLINE)
        bufs = [KVBuffer.allocate(4096 * (1 + i % 3), name=uniq()) for i in range(count)]
        for i, x in enumerate(bufs):
            x.write(struct.pack("<I", i))
        handles = [x.export() for x in bufs]
        t = _send_in_thread(a, handles)
        got = recv_handles(b)
        t.join(DEADLINE)
        assert len(got) == count
        for i, (h, x) in enumerate(zip(got, bufs, strict=True)):
            assert (h.kind, h.nbytes, h.alloc_nbytes, h.name) == ("host", x.nbytes, x.alloc_nbytes, x.name)
            assert h.fd != handles[i].fd
            assert os.get_inheritable(h.fd) is False  # MSG_CMSG_CLOEXEC
            with KVBuffer.import_(h) as m:
                assert struct.unpack("<I", m.read(4))[0] == i
        for h in handles + got:
            h.close()
        for x in bufs:
            x.close()


def test_recv_rejects_garbage_without_leaking(no_leaks):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(DEADLINE)
        r, w = os.pipe()
        try:
            socket.send_fds(a, [struct.pack("<4sHHII", b"NOPE", 1, 0, 2, 0)], [r, w])
            with pytest.raises(DescriptorError, match="magic"):
                recv_handles(b)
            socket.send_fds(a, [struct.pack("<4sHHII", b"KVXH", 99, 0, 1, 0)], [r])
            with pytest.raises(DescriptorError, match="version"):
                recv_handles(b)
            body = b'{"handles": [{"kind": "host"}]}'
            socket.send_fds(a, [struct.pack("<4sHHII", b"KVXH", 1, 0, 1, len(body)) + body], [r])
            with pytest.raises(DescriptorError, match="malformed"):
                recv_handles(b)
            socket.send_fds(a, [struct.pack("<4sHHII", b"KVXH", 1, 0, 3, 2) + b"{}"], [r])
            with pytest.raises(DescriptorError, match="announced 3 fds"):
                recv_handles(b)
        finally:
            os.close(r)
            os.close(w)
        a.close()
        with pytest.raises(PeerError):
            recv_handles(b)


def test_send_rejects_non_unix_and_closed():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(InvalidArgumentError):
            send_handles(s, [])
    a, b = socket.socketpair()
    with a, b, KVBuffer.allocate(10) as buf:
        h = buf.export()
        h.close()
        with pytest.raises(ClosedError):
            send_handles(a, [h])
        with pytest.raises(InvalidArgumentError):
            send_handles(a, [object()])  # type: ignore[list-item]


def test_pidfd_getfd_road(no_leaks):
    with KVBuffer.allocate(4096, name=uniq()) as buf, buf.export() as h:
        buf.write(b"pidfd")
        try:
            got = unpack_handles(pack_handles([h]))
        except UnsupportedError as e:
            pytest.skip(f"pidfd_getfd not permitted here: {e}")
        with got[0] as g, KVBuffer.import_(g) as m:
            assert m.read(5) == b"pidfd"
    with pytest.raises(DescriptorError):
        unpack_handles(b"garbage")


@pytest.mark.parametrize("body", [
    {"pid": 1, "handles": [5]},                              # an item that is no description
    {"pid": 1, "handles": [{"fd_number": "x"}]},
    {"pid": 1, "handles": [{"fd_number": None}]},
    {"pid": 1, "handles": [{"fd_number": True}]},
    {"pid": "1", "handles": []},
    {"pid": 0, "handles": []},
    {"pid": 1, "handles": [{"fd_number": -7}]},
])
def test_unpack_handles_refuses_malformed_bodies(body):
    """JSON gives any type: each of these is a DescriptorError before any fd is fetched."""
    import json
    import struct

    raw = json.dumps(body).encode()
    with pytest.raises(DescriptorError):
        unpack_handles(struct.pack("<4sHHII", b"KVXP", 1, 0, 0, len(raw)) + raw)


# ---- several processes ----------------------------------------------------------------------


def tp_worker(conn, sock, rank: int, nbytes: int):
    """A TP worker: allocate its shard, fill it, hand it to the engine process, then check
    what the engine writes back through its own mapping."""
    with sock, KVBuffer.allocate(nbytes, name=f"kvt-rank{rank}") as shard:
        shard.write(pattern(rank, nbytes))
        with shard.export() as h:
            send_handles(sock, [h])
        conn.send(("sent", rank))
        assert conn.recv() == "engine wrote"
        assert shard.read(7) == b"ENGINE%d" % rank
        return shard.read(4, nbytes - 4)


def exporter_then_exit(conn, sock, nbytes: int):
    """Allocate, fill, send, close everything and exit before the parent imports."""
    with sock, KVBuffer.allocate(nbytes, name="kvt-gone") as buf:
        buf.write(pattern(99, nbytes))
        with buf.export() as h:
            send_handles(sock, [h])
    return os.getpid()


def importer_writes(conn, sock):
    """Receive a handle, map it, write through the mapping, close, exit."""
    with sock:
        (h,) = recv_handles(sock)
    with h, KVBuffer.import_(h) as buf:
        buf.numpy(np.uint8)[:] = 0x5A
    return "wrote"


def test_tp_workers_share_shards_with_engine_process(no_leaks):
    nbytes = 3 * 4096 + 123
    procs, socks = [], []
    for rank in range(2):
        mine, theirs = socket.socketpair()
        procs.append(spawn(tp_worker, theirs, rank, nbytes, with_conn=True))
        theirs.close()
        socks.append(mine)
    shards = []
    for rank, (mine, child) in enumerate(zip(socks, procs, strict=True)):
        mine.settimeout(DEADLINE)
        (h,) = recv_handles(mine)
        mine.close()
        with h:
            shard = KVBuffer.import_(h)
        assert child.result() == rank  # the worker's ("sent", rank)
        shards.append(shard)
    for rank, shard in enumerate(shards):
        assert shard.read() == pattern(rank, nbytes)
        shard.write(b"ENGINE%d" % rank)
        procs[rank].send("engine wrote")
    for rank, child in enumerate(procs):
        assert child.finish() == pattern(rank, nbytes)[-4:]
    # workers are gone; the engine's mappings still hold their shards
    for rank, shard in enumerate(shards):
        assert shard.read(8)[:7] == b"ENGINE%d" % rank
        assert shard.read(nbytes - 8, 8) == pattern(rank, nbytes)[8:]
        shard.close()


def test_exporter_exits_first(no_leaks):
    nbytes = 2 * 4096
    mine, theirs = socket.socketpair()
    child = spawn(exporter_then_exit, theirs, nbytes, with_conn=True)
    theirs.close()
    with mine:
        mine.settimeout(DEADLINE)
        (h,) = recv_handles(mine)
    pid = child.finish()
    assert not os.path.exists(f"/proc/{pid}/fd")  # the exporter is really gone
    with h:
        first = KVBuffer.import_(h)
    with first:
        assert first.read() == pattern(99, nbytes)
        first.write(b"still here")
        assert first.read(10) == b"still here"


def test_importer_writes_are_seen_by_exporter(no_leaks):
    mine, theirs = socket.socketpair()
    child = spawn(importer_writes, theirs, with_conn=True)
    theirs.close()
    with mine, KVBuffer.allocate(4096 + 1, name=uniq()) as buf:
        with buf.export() as h:
            send_handles(mine, [h])
        assert child.finish() == "wrote"
        assert buf.read() == b"\x5a" * (4096 + 1)


def test_no_warnings_on_clean_life_cycle(recwarn):
    warnings.simplefilter("always")
    with KVBuffer.allocate(100) as buf, buf.export() as h, KVBuffer.import_(h) as m:
        m.write(b"x")
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
