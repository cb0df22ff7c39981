"""KVBuffer's CUDA path driven without a GPU, through a stand-in for cuda-python's driver.

As mpi4py drives its GPU-buffer path with host arrays: a stand-in for cuda-python's driver
whose "device memory" is a memfd mapped into the VA range kvxfer reserves. The structs and
enums are cuda-python's own (they work without a GPU), so the flow, the bit mask written
into CUmemAllocationProp, the release order and fd hygiene are checked for real; what the
real driver does is checked by tests/gpu and bench/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap as _mmap
import os
import socket

import pytest

from kvxfer import KVBuffer
from kvxfer._libc import libc as _libc
from kvxfer.errors import BufferError, InvalidArgumentError, UnsupportedError
from kvxfer.share import recv_handles, send_handles
from _data import pattern
from _procs import spawn

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
    child = spawn(fake_cuda_importer, theirs, with_conn=True)
    theirs.close()
    with fake_cuda(), mine, KVBuffer.allocate(GRAN + 1, "cuda:1") as buf:
        buf.write(pattern(8, buf.nbytes))
        with buf.export() as h:
            send_handles(mine, [h])
        assert child.finish() == "ok"
        assert buf.read(14) == b"child was here"
