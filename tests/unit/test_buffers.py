"""KVBuffer (host memfd path), SharedHandle and kvxfer.share: no GPU, no libfabric needed.

Several tests spawn processes ('spawn' context, as a TP worker would be) and forward the
child's traceback to the test on failure.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.resource_tracker
import os
import pickle
import socket
import struct
import threading
import traceback
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

CTX = mp.get_context("spawn")
DEADLINE = 60.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped(name: str) -> bool:
    """Is a memfd of this name mapped in this process?"""
    with open("/proc/self/maps") as f:
        return f"/memfd:{name}" in f.read()


def uniq() -> str:
    return f"kvt-{uuid.uuid4().hex[:10]}"


def pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves fds open or memfds mapped."""
    multiprocessing.resource_tracker.ensure_running()  # spawn keeps this fd for the process life
    gc.collect()
    before = open_fds()
    yield
    gc.collect()
    assert open_fds() == before, f"fd leak: {before} -> {open_fds()}: {os.listdir('/proc/self/fd')}"


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
    fd = os.memfd_create("kvt-short", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with SharedHandle(kind="host", nbytes=8192, alloc_nbytes=8192, device="cpu", fd=fd) as h:
        with pytest.raises(Exception, match="smaller than alloc_nbytes"):
            KVBuffer.import_(h)  # mapping past EOF would SIGBUS later; refuse now


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


# ---- several processes ----------------------------------------------------------------------


def _child(fn, conn, *args):
    """Run fn in a spawned child; send ('ok', value) or ('err', traceback) back."""
    try:
        conn.send(("ok", fn(conn, *args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


def _spawn(fn, *args):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_child, args=(fn, child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


def _result(p, conn):
    """The child's next message (a progress note or its return value); raise its traceback."""
    if not conn.poll(DEADLINE):
        p.terminate()
        raise AssertionError("child did not answer in time")
    status, value = conn.recv()
    if status == "err":
        raise AssertionError(f"child failed:\n{value}")
    return value


def _join(p, conn):
    p.join(DEADLINE)
    conn.close()
    if p.exitcode is None:
        p.terminate()
        raise AssertionError("child did not exit")
    assert p.exitcode == 0


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
        procs.append(_spawn(tp_worker, theirs, rank, nbytes))
        theirs.close()
        socks.append(mine)
    shards = []
    for rank, (mine, (p, conn)) in enumerate(zip(socks, procs, strict=True)):
        mine.settimeout(DEADLINE)
        (h,) = recv_handles(mine)
        mine.close()
        with h:
            shard = KVBuffer.import_(h)
        assert _result(p, conn) == rank  # the worker's ("sent", rank)
        shards.append(shard)
    for rank, shard in enumerate(shards):
        assert shard.read() == pattern(rank, nbytes)
        shard.write(b"ENGINE%d" % rank)
        procs[rank][1].send("engine wrote")
    for rank, (p, conn) in enumerate(procs):
        assert _result(p, conn) == pattern(rank, nbytes)[-4:]
        _join(p, conn)
    # workers are gone; the engine's mappings still hold their shards
    for rank, shard in enumerate(shards):
        assert shard.read(8)[:7] == b"ENGINE%d" % rank
        assert shard.read(nbytes - 8, 8) == pattern(rank, nbytes)[8:]
        shard.close()


def test_exporter_exits_first(no_leaks):
    nbytes = 2 * 4096
    mine, theirs = socket.socketpair()
    p, conn = _spawn(exporter_then_exit, theirs, nbytes)
    theirs.close()
    with mine:
        mine.settimeout(DEADLINE)
        (h,) = recv_handles(mine)
    pid = _result(p, conn)
    _join(p, conn)
    assert not os.path.exists(f"/proc/{pid}/fd")  # the exporter is really gone
    with h:
        first = KVBuffer.import_(h)
    with first:
        assert first.read() == pattern(99, nbytes)
        first.write(b"still here")
        assert first.read(10) == b"still here"


def test_importer_writes_are_seen_by_exporter(no_leaks):
    mine, theirs = socket.socketpair()
    p, conn = _spawn(importer_writes, theirs)
    theirs.close()
    with mine, KVBuffer.allocate(4096 + 1, name=uniq()) as buf:
        with buf.export() as h:
            send_handles(mine, [h])
        assert _result(p, conn) == "wrote"
        _join(p, conn)
        assert buf.read() == b"\x5a" * (4096 + 1)


def test_no_warnings_on_clean_life_cycle(recwarn):
    warnings.simplefilter("always")
    with KVBuffer.allocate(100) as buf, buf.export() as h, KVBuffer.import_(h) as m:
        m.write(b"x")
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]


# ---- the CUDA path, driven without a GPU ---------------------------------------------------
# As mpi4py drives its GPU-buffer path with host arrays: a stand-in for cuda-python's driver
# whose "device memory" is a memfd mapped into the VA range kvxfer reserves. The structs and
# enums are cuda-python's own (they work without a GPU), so the flow, the bit mask written
# into CUmemAllocationProp, the release order and fd hygiene are checked for real; what the
# real driver does is checked by tests/gpu and bench/gpu_check.sh on a GPU machine.

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import mmap as _mmap  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED, _MAP_ANON, _PROT_NONE = 0x10, 0x20, 0
GRAN = 2 << 20


class FakeDriver:
    """cuda-python's calling convention ((CUresult, value...) tuples) over host memory."""

    def __init__(self, real, *, fabric: bool = False, imex: bool = False, dmabuf: bool = True, devices: int = 2):
        self.real = real
        self.R = real.CUresult
        self.fabric, self.imex, self.dmabuf, self.devices = fabric, imex, dmabuf, devices
        self.handles: dict[int, tuple[int, int, int]] = {}  # id -> (memfd, size, requested types)
        self.reserved: dict[int, int] = {}  # va -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # va -> (size, handle id)
        self.fabric_table: dict[bytes, int] = {}
        self.next_id = 1
        self.calls: list[str] = []

    def __getattr__(self, name):  # types and enums come from the real bindings
        return getattr(self.real, name)

    def _ok(self, *v):
        return (self.R.CUDA_SUCCESS, *v)

    def cuGetErrorName(self, err):
        return self._ok(err.name.encode())

    def cuGetErrorString(self, err):
        return self._ok(b"fake driver says no")

    def cuDeviceGetCount(self):
        return self._ok(self.devices)

    def cuDeviceGet(self, ordinal):
        return self._ok(ordinal) if ordinal < self.devices else (self.R.CUDA_ERROR_INVALID_DEVICE, None)

    def cuDeviceGetAttribute(self, attr, dev):
        A = self.real.CUdevice_attribute
        table = {
            A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: int(self.fabric),
            A.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: int(self.dmabuf),
        }
        return self._ok(table.get(attr, 0))

    def cuDeviceGetUuid(self, dev):
        return self._ok(type("U", (), {"bytes": bytes([dev]) * 16})())

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._ok(f"ctx{dev}")

    def cuCtxSetCurrent(self, ctx):
        return (self.R.CUDA_SUCCESS,)

    def cuCtxSynchronize(self):
        return (self.R.CUDA_SUCCESS,)

    def cuMemGetAllocationGranularity(self, prop, option):
        return self._ok(GRAN)

    def cuMemCreate(self, size, prop, flags):
        self.calls.append("cuMemCreate")
        types = ctypes.c_int.from_address(int(prop.getPtr()) + 4).value  # the bit mask, as C sees it
        assert prop.type == self.real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == self.real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert prop.allocFlags.gpuDirectRDMACapable == 1
        if size % GRAN:
            return (self.R.CUDA_ERROR_INVALID_VALUE, None)
        if types & int(self.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC) and not self.imex:
            return (self.R.CUDA_ERROR_NOT_PERMITTED, None)  # what a driver without IMEX channels says
        fd = os.memfd_create("fake-cumem", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return self._ok(self._new(fd, size, types))

    def _new(self, fd, size, types):
        h = self.next_id
        self.next_id += 1
        self.handles[h] = (fd, size, types)
        return h

    def cuMemAddressReserve(self, size, align, addr, flags):
        va = _libc.mmap(None, size, _PROT_NONE, _mmap.MAP_PRIVATE | _MAP_ANON, -1, 0)
        self.reserved[va] = size
        return self._ok(va)

    def cuMemMap(self, va, size, offset, handle, flags):
        self.calls.append("cuMemMap")
        fd, hsize, _ = self.handles[int(handle)]
        assert va in self.reserved and size == hsize == self.reserved[va]
        got = _libc.mmap(va, size, _PROT_NONE, _mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        assert got == va
        self.mapped[va] = (size, int(handle))
        return (self.R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va, size, descs, count):
        assert count == 1 and descs[0].flags == self.real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert va in self.mapped
        _libc.mprotect(va, size, _mmap.PROT_READ | _mmap.PROT_WRITE)
        return (self.R.CUDA_SUCCESS,)

    def cuMemUnmap(self, va, size):
        self.calls.append("cuMemUnmap")
        del self.mapped[va]
        _libc.mmap(va, size, _PROT_NONE, _mmap.MAP_PRIVATE | _MAP_ANON | _MAP_FIXED, -1, 0)
        return (self.R.CUDA_SUCCESS,)

    def cuMemAddressFree(self, va, size):
        self.calls.append("cuMemAddressFree")
        assert va not in self.mapped, "address range freed while still mapped"
        assert self.reserved.pop(va) == size
        _libc.munmap(va, size)
        return (self.R.CUDA_SUCCESS,)

    def cuMemRelease(self, handle):
        self.calls.append("cuMemRelease")
        fd, _, _ = self.handles.pop(int(handle))
        os.close(fd)
        return (self.R.CUDA_SUCCESS,)

    def cuMemExportToShareableHandle(self, handle, htype, flags):
        fd, size, types = self.handles[int(handle)]
        T = self.real.CUmemAllocationHandleType
        if not types & int(htype):
            return (self.R.CUDA_ERROR_INVALID_VALUE, None)
        if htype == T.CU_MEM_HANDLE_TYPE_FABRIC:
            fh = self.real.CUmemFabricHandle()
            key = os.urandom(64)
            fh.data = key
            self.fabric_table[key] = int(handle)
            return self._ok(fh)
        return self._ok(os.dup(fd))

    def cuMemImportFromShareableHandle(self, os_handle, htype):
        T = self.real.CUmemAllocationHandleType
        if htype == T.CU_MEM_HANDLE_TYPE_FABRIC:
            fd, size, types = self.handles[self.fabric_table[bytes(os_handle)]]
            return self._ok(self._new(os.dup(fd), size, types))
        assert isinstance(os_handle, int)
        return self._ok(self._new(os.dup(os_handle), os.fstat(os_handle).st_size, 1))

    def cuMemGetHandleForAddressRange(self, va, size, htype, flags):
        if not self.dmabuf:
            return (self.R.CUDA_ERROR_NOT_SUPPORTED, None)
        msize, h = self.mapped[int(va)]
        assert size == msize
        return self._ok(os.dup(self.handles[h][0]))

    def cuMemcpyHtoD(self, dst, src, n):
        ctypes.memmove(dst, src, n)
        return (self.R.CUDA_SUCCESS,)

    def cuMemcpyDtoH(self, dst, src, n):
        ctypes.memmove(dst, src, n)
        return (self.R.CUDA_SUCCESS,)


@contextlib.contextmanager
def fake_cuda(**kw):
    real = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python's types")
    from kvxfer._cuda import driver as _cuda

    saved = (_cuda.drv, _cuda._loaded, _cuda._ctx, _cuda._err)
    fake = FakeDriver(real, **kw)
    _cuda.drv, _cuda._loaded, _cuda._ctx = fake, True, {}
    try:
        yield fake
    finally:
        _cuda.drv, _cuda._loaded, _cuda._ctx, _cuda._err = saved


def test_cuda_path_with_stand_in_driver(no_leaks):
    with fake_cuda() as drv:
        buf = KVBuffer.allocate(3 * GRAN + 5, "cuda:1")
        assert (buf.kind, buf.device, buf.device_ordinal, buf.ordinal) == ("cuda", "cuda:1", 1, 1)
        assert buf.alloc_nbytes == 4 * GRAN and buf.granularity == GRAN and not buf.has_fabric_handle
        data = pattern(7, buf.nbytes)
        buf.write(data)
        assert buf.read() == data
        cai = buf.__cuda_array_interface__
        assert cai["data"] == (buf.ptr, False) and cai["shape"] == (buf.nbytes,)
        with pytest.raises(BufferError):
            buf.numpy()
        with buf.export() as h:
            assert h.kind == "cuda" and h.fd >= 0 and h.fabric is None and h.device_uuid == "01" * 16
            assert not os.get_inheritable(h.fd)
            imp = KVBuffer.import_(h)
        assert imp.device == "cuda:1" and imp.ptr != buf.ptr and imp.read() == data
        fd = imp.dmabuf_fd()
        os.close(fd)
        lease = buf.lease()
        buf.close()  # deferred: the lease holds the mapping
        assert "cuMemUnmap" not in drv.calls
        imp.write(b"after exporter closed")
        del lease
        gc.collect()
        assert drv.calls[-3:] == ["cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
        assert imp.read(21) == b"after exporter closed"
        imp.close()
        assert not drv.handles and not drv.reserved and not drv.mapped


def test_cuda_fabric_falls_back_without_imex(no_leaks):
    with fake_cuda(fabric=True, imex=False) as drv:
        with KVBuffer.allocate(GRAN, "cuda:0") as buf:
            assert not buf.has_fabric_handle
            assert drv.calls.count("cuMemCreate") == 2  # POSIX|FABRIC refused, then POSIX alone
            with pytest.raises(UnsupportedError):
                buf.export(fabric=True)
        with pytest.raises(UnsupportedError, match="NOT_PERMITTED"):
            KVBuffer.allocate(GRAN, "cuda:0", fabric=True)
    with fake_cuda(fabric=True, imex=True):
        with KVBuffer.allocate(GRAN, "cuda:0") as buf, buf.export(fabric=True) as h:
            assert h.fd == -1 and len(h.fabric) == 64
            buf.write(b"fabric")
            with KVBuffer.import_(h) as imp:
                assert imp.read(6) == b"fabric"


def test_cuda_refusals_with_stand_in_driver():
    with fake_cuda(dmabuf=False, devices=1):
        with pytest.raises(UnsupportedError, match="cuda:3 does not exist"):
            KVBuffer.allocate(GRAN, "cuda:3")
        with KVBuffer.allocate(GRAN, "cuda:0") as buf:
            with pytest.raises(UnsupportedError, match="dma-buf"):
                buf.dmabuf_fd()
        with pytest.raises(InvalidArgumentError):
            KVBuffer.allocate(GRAN, "cuda:0", huge_pages=True)


def fake_cuda_importer(conn, sock):
    with fake_cuda(), sock:
        (h,) = recv_handles(sock)
        with h, KVBuffer.import_(h) as buf:
            assert (h.kind, h.granularity, h.alloc_nbytes) == ("cuda", GRAN, 2 * GRAN)
            assert buf.device == "cuda:1" and buf.read() == pattern(8, buf.nbytes)
            buf.write(b"child was here")
    return "ok"


def test_cuda_handles_cross_processes_with_stand_in_driver(no_leaks):
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python's types")
    mine, theirs = socket.socketpair()
    p, conn = _spawn(fake_cuda_importer, theirs)
    theirs.close()
    with fake_cuda(), mine, KVBuffer.allocate(GRAN + 1, "cuda:1") as buf:
        buf.write(pattern(8, buf.nbytes))
        with buf.export() as h:
            send_handles(mine, [h])
        assert _result(p, conn) == "ok"
        _join(p, conn)
        assert buf.read(14) == b"child was here"
