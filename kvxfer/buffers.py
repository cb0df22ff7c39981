"""KV memory that one process allocates and another maps: the tensor-parallel layout.

Each TP rank is its own process with its own KV shard, but a node runs one transfer engine
(one messenger, one set of NIC endpoints). So every rank allocates its shard as a
``KVBuffer``, ``export()``s a ``SharedHandle`` (an fd, or a CUDA fabric handle), sends it to
the engine process (``kvxfer.share``), and the engine ``import_()``s it: the same physical
pages, mapped a second time, registered once.

Two kinds, one life cycle:

- ``host``: a memfd (sealed against shrinking, so an importer can never hit SIGBUS), mapped
  ``MAP_SHARED`` through libc directly. Huge pages on request (``MFD_HUGETLB``).
- ``cuda``: cuMem (VMM): ``cuMemCreate`` (gpuDirectRDMACapable where the device allows),
  exported as a POSIX fd (and a FABRIC handle where the device and IMEX allow), reserved,
  mapped and made read-write; sizes rounded to the allocation granularity.

Lifetime rules (see docs/architecture.md, "KV buffers"):

- The mapping is owned by a small mapping object, not by the ``KVBuffer``. Views (numpy,
  torch, memoryview, ``__cuda_array_interface__``) and ``lease()`` hold that object, so
  ``close()`` never pulls memory from under a live view: it closes the fd at once and *defers*
  the unmap until the last view or lease is gone. Closing in any order is safe.
- Imported memory stays valid after the exporter exits: the importer's mapping (host) or its
  imported allocation handle (CUDA) keeps the pages alive.
- Everything holding an fd or a mapping closes idempotently and warns with ``ResourceWarning``
  when garbage-collected open.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import mmap as _mmap
import os
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvxfer.errors import (
    BufferError,
    ClosedError,
    InvalidArgumentError,
    OutOfBoundsError,
    UnsupportedError,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["KVBuffer", "SharedHandle", "cuda_available"]

Kind = Literal["host", "cuda"]

PAGE_SIZE = _mmap.PAGESIZE

# --------------------------------------------------------------------------------------------
# libc: mmap/munmap directly, so no Python mmap object pins the mapping with exported buffers
# (mmap.mmap.close() raises BufferError while a numpy view exists; we want deferral instead).

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _huge_page_size() -> int:
    """Default hugetlb page size, from /proc/meminfo (what MFD_HUGETLB without a size uses)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Hugepagesize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 20


def _huge_pages_free() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return line.split()[1]
    except OSError:
        pass
    return "?"


def _parse_device(device: str | int) -> tuple[Kind, int | None]:
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise InvalidArgumentError(f"CUDA device ordinal must be >= 0, got {device}")
        return "cuda", device
    if not isinstance(device, str):
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    if device == "cpu":
        return "host", None
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    return "cuda", int(m.group(1) or 0)


def _fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


# --------------------------------------------------------------------------------------------
# Mappings: the one object that owns a mapping. Views and leases hold it; the KVBuffer drops
# its reference on close(), and the last holder's release unmaps.


class _HostMapping:
    """A MAP_SHARED mapping of a memfd; unmapped when the last reference goes."""

    __slots__ = ("ptr", "size", "__weakref__")

    def __init__(self, fd: int, size: int) -> None:
        self.ptr = 0
        self.size = size
        addr = _libc.mmap(None, size, _mmap.PROT_READ | _mmap.PROT_WRITE, _mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.ptr = int(addr)

    def release(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            _libc.munmap(ptr, self.size)

    def __del__(self) -> None:
        self.release()


class _CudaMapping:
    """A reserved, mapped cuMem range plus the allocation handle that backs it.

    Released in the order CUDA asks for: unmap, free the address range, release the handle.
    """

    __slots__ = ("ptr", "size", "handle", "ordinal", "__weakref__")

    def __init__(self, ptr: int, size: int, handle: Any, ordinal: int) -> None:
        self.ptr = ptr
        self.size = size
        self.handle = handle
        self.ordinal = ordinal

    def release(self) -> None:
        ptr, self.ptr = self.ptr, 0
        handle, self.handle = self.handle, None
        try:
            drv = _cuda.drv
            if drv is None:
                return
            _cuda.make_current(self.ordinal)
            if ptr:
                drv.cuMemUnmap(ptr, self.size)
                drv.cuMemAddressFree(ptr, self.size)
            if handle is not None:
                drv.cuMemRelease(handle)
        except Exception:  # interpreter teardown: the driver is going away with the process
            pass

    def __del__(self) -> None:
        self.release()


class _View:
    """What a zero-copy view rests on: the bytes ``[ptr, ptr+nbytes)`` plus the mapping holder.

    numpy keeps this (through a ctypes array) as its ``base``; torch keeps it as the owner of a
    ``__cuda_array_interface__`` tensor. Either way the mapping outlives the view.
    """

    __slots__ = ("mapping", "ptr", "nbytes", "__weakref__")

    def __init__(self, mapping: Any, ptr: int, nbytes: int) -> None:
        self.mapping = mapping
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


def _host_bytes(mapping: _HostMapping, offset: int, nbytes: int) -> ctypes.Array:
    """A ctypes byte array over the mapping that holds the mapping alive (used for numpy views)."""
    arr = (ctypes.c_char * nbytes).from_address(mapping.ptr + offset)
    arr._kvxfer_mapping = mapping  # type: ignore[attr-defined]  # the view keeps the pages mapped
    return arr


# --------------------------------------------------------------------------------------------
# CUDA driver access (cuda-python), loaded once, lazily; no GPU means UnsupportedError.


class _Cuda:
    def __init__(self) -> None:
        self.drv: Any = None
        self._err: str | None = None
        self._lock = threading.RLock()
        self._ctx: dict[int, Any] = {}
        self._loaded = False

    def load(self) -> Any:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                self._load()
        if self.drv is None:
            raise UnsupportedError(self._err or "CUDA is not available")
        return self.drv

    def _load(self) -> None:
        try:
            from cuda.bindings import driver as drv  # cuda-python >= 12.6
        except ImportError:
            try:
                from cuda import cuda as drv  # type: ignore[no-redef]  # older cuda-python
            except ImportError:
                self._err = "CUDA buffers need cuda-python: pip install 'kvxfer[cuda]'"
                return
        try:
            (err,) = drv.cuInit(0)
        except Exception as e:  # the driver library itself is missing (no GPU on this machine)
            self._err = f"cuInit failed: no CUDA driver ({type(e).__name__}: {e})"
            return
        if err != drv.CUresult.CUDA_SUCCESS:
            self._err = f"cuInit failed: {self.errname(drv, err)}"
            return
        self.drv = drv

    @staticmethod
    def errname(drv: Any, err: Any) -> str:
        try:
            r, name = drv.cuGetErrorName(err)
            r2, text = drv.cuGetErrorString(err)
            name = name.decode() if isinstance(name, bytes) else str(name)
            text = text.decode() if isinstance(text, bytes) else str(text)
            return f"{name} ({int(err)}): {text}"
        except Exception:
            return f"CUresult {int(err)}"

    def check(self, result: tuple[Any, ...], call: str) -> Any:
        """Unpack a cuda-python result tuple; raise a precise kvxfer error on failure."""
        drv = self.drv
        err, *rest = result
        if err != drv.CUresult.CUDA_SUCCESS:
            msg = f"{call}: {self.errname(drv, err)}"
            if err in (drv.CUresult.CUDA_ERROR_NOT_SUPPORTED, drv.CUresult.CUDA_ERROR_NOT_PERMITTED):
                raise UnsupportedError(msg)
            raise BufferError(msg)
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else tuple(rest)

    def device(self, ordinal: int) -> Any:
        drv = self.load()
        count = self.check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise UnsupportedError(f"cuda:{ordinal} does not exist: this process sees {count} CUDA device(s)")
        return self.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")

    def attr(self, ordinal: int, name: str) -> int:
        drv = self.load()
        a = getattr(drv.CUdevice_attribute, name, None)
        if a is None:  # attribute unknown to this cuda-python: treat as unsupported
            return 0
        r = drv.cuDeviceGetAttribute(a, self.device(ordinal))
        return int(r[1]) if r[0] == drv.CUresult.CUDA_SUCCESS else 0

    def uuid(self, ordinal: int) -> str:
        drv = self.load()
        u = self.check(drv.cuDeviceGetUuid(self.device(ordinal)), "cuDeviceGetUuid")
        return bytes(u.bytes).hex()

    def ordinal_of(self, uuid: str | None, fallback: int) -> int:
        """The local ordinal of the device with this UUID (CUDA_VISIBLE_DEVICES may differ)."""
        drv = self.load()
        if uuid:
            count = self.check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
            for i in range(count):
                if self.uuid(i) == uuid:
                    return i
            raise UnsupportedError(f"the exporting GPU (uuid {uuid}) is not visible to this process")
        return fallback

    def make_current(self, ordinal: int) -> None:
        """Make the device's primary context current on this thread (retained for the process)."""
        drv = self.load()
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            with self._lock:
                ctx = self._ctx.get(ordinal)
                if ctx is None:
                    ctx = self.check(drv.cuDevicePrimaryCtxRetain(self.device(ordinal)), "cuDevicePrimaryCtxRetain")
                    self._ctx[ordinal] = ctx
        self.check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def access_desc(self, ordinal: int) -> Any:
        drv = self.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def prop(self, ordinal: int, handle_types: int, rdma: bool) -> Any:
        drv = self.drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if handle_types != int(prop.requestedHandleTypes):
            # cuda-python types the field as one enum member, but CUDA takes a bit mask
            # (POSIX_FD | FABRIC); write the mask into the C struct, field 2 (offset 4).
            ctypes.c_int.from_address(int(prop.getPtr()) + 4).value = handle_types
        prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        return prop

    def map(self, handle: Any, size: int, granularity: int, ordinal: int) -> int:
        """Reserve a VA range, map the allocation into it and make it read-write on the device."""
        drv = self.drv
        ptr = int(self.check(drv.cuMemAddressReserve(size, granularity, 0, 0), "cuMemAddressReserve"))
        try:
            self.check(drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            try:
                self.check(drv.cuMemSetAccess(ptr, size, [self.access_desc(ordinal)], 1), "cuMemSetAccess")
            except BaseException:
                drv.cuMemUnmap(ptr, size)
                raise
        except BaseException:
            drv.cuMemAddressFree(ptr, size)
            raise
        return ptr


_cuda = _Cuda()


def cuda_available(device: str | int = "cuda:0") -> bool:
    """True when cuda-python loads, cuInit succeeds and the device exists (tests skip on False)."""
    try:
        kind, ordinal = _parse_device(device)
        if kind != "cuda":
            return False
        _cuda.device(ordinal or 0)
        return True
    except (UnsupportedError, BufferError, InvalidArgumentError):
        return False


# --------------------------------------------------------------------------------------------
# SharedHandle


@dataclasses.dataclass(eq=False)
class SharedHandle:
    """What crosses a process boundary to map a ``KVBuffer`` again: a description plus an fd.

    Owns ``fd`` (closes it on ``close()`` or at GC with a ``ResourceWarning``). Send it with
    ``kvxfer.share.send_handles`` (SCM_RIGHTS); it does not pickle, since an fd number means
    nothing in another process.
    """

    kind: Kind
    nbytes: int  # bytes the user asked for
    alloc_nbytes: int  # bytes mapped: rounded to the page, huge page or CUDA granularity
    device: str  # 'cpu' or 'cuda:N' as the exporter saw it
    fd: int = -1  # memfd (host) or cuMem POSIX fd (cuda); -1 when only a fabric handle travels
    fabric: bytes | None = None  # CU_MEM_HANDLE_TYPE_FABRIC handle, 64 bytes
    granularity: int = PAGE_SIZE  # mapping alignment
    huge_pages: bool = False
    device_uuid: str | None = None  # CUDA device UUID, hex: ordinals differ under CUDA_VISIBLE_DEVICES
    name: str = "kvxfer"

    def __post_init__(self) -> None:
        if self.kind not in ("host", "cuda"):
            raise InvalidArgumentError(f"SharedHandle kind must be 'host' or 'cuda', got {self.kind!r}")
        if self.nbytes <= 0 or self.alloc_nbytes < self.nbytes:
            raise InvalidArgumentError(
                f"SharedHandle sizes are inconsistent: nbytes={self.nbytes}, alloc_nbytes={self.alloc_nbytes}"
            )
        if self.fd < 0 and self.fabric is None:
            raise InvalidArgumentError("SharedHandle needs an fd or a fabric handle")
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The owned fd (still owned by this handle)."""
        if self._closed:
            raise ClosedError("SharedHandle is closed")
        return self.fd

    def detach(self) -> int:
        """Give up ownership of the fd and return it; the caller closes it."""
        if self._closed:
            raise ClosedError("SharedHandle is closed")
        fd, self.fd = self.fd, -1
        self._closed = True
        return fd

    def close(self) -> None:
        """Close the fd. Idempotent; the memory lives on in every mapping made from it."""
        if self._closed:
            return
        self._closed = True
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        """The handle without its fd, as plain JSON-able data (the wire header of kvxfer.share)."""
        return {
            "kind": self.kind,
            "nbytes": self.nbytes,
            "alloc_nbytes": self.alloc_nbytes,
            "device": self.device,
            "has_fd": self.fd >= 0,
            "fabric": self.fabric.hex() if self.fabric is not None else None,
            "granularity": self.granularity,
            "huge_pages": self.huge_pages,
            "device_uuid": self.device_uuid,
            "name": self.name,
        }

    @classmethod
    def from_description(cls, d: dict[str, Any], fd: int = -1) -> SharedHandle:
        """Rebuild a handle from ``describe()`` plus an fd it now owns."""
        fabric = d.get("fabric")
        return cls(
            kind=d["kind"],
            nbytes=int(d["nbytes"]),
            alloc_nbytes=int(d["alloc_nbytes"]),
            device=str(d["device"]),
            fd=fd,
            fabric=bytes.fromhex(fabric) if fabric else None,
            granularity=int(d.get("granularity", PAGE_SIZE)),
            huge_pages=bool(d.get("huge_pages", False)),
            device_uuid=d.get("device_uuid"),
            name=str(d.get("name", "kvxfer")),
        )

    def __enter__(self) -> SharedHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a SharedHandle holds an fd and cannot be pickled; send it with kvxfer.share.send_handles")

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()


# --------------------------------------------------------------------------------------------
# KVBuffer


class KVBuffer:
    """KV-cache memory that can be mapped into another process: host memfd or CUDA cuMem.

    Make one with ``KVBuffer.allocate`` or ``KVBuffer.import_``; hand it to
    ``Engine.register``. ``ptr``/``nbytes``/``device``/``kind`` are what the engine registers;
    ``device_ordinal`` and ``dmabuf_fd()`` are for CUDA registration (FI_HMEM_CUDA, FI_MR_DMABUF).
    """

    def __init__(self, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("use KVBuffer.allocate(...) or KVBuffer.import_(handle)")
        self._lock = threading.Lock()
        self._closed = True  # until fully built
        self._mapping: _HostMapping | _CudaMapping | None = None
        self._fd = -1
        self.kind: Kind = "host"
        self.nbytes = 0
        self.alloc_nbytes = 0
        self.granularity = PAGE_SIZE
        self.device_ordinal: int | None = None
        self.huge_pages = False
        self.imported = False
        self.name = "kvxfer"
        self._fabric = False
        self._device_uuid: str | None = None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        nbytes: int,
        device: str | int = "cpu",
        *,
        huge_pages: bool = False,
        name: str = "kvxfer-kv",
        fabric: bool | None = None,
        gpu_direct_rdma: bool | None = None,
    ) -> KVBuffer:
        """Allocate ``nbytes`` of shareable memory on ``device`` ('cpu' or 'cuda:N').

        Host: a sealed memfd mapped MAP_SHARED; ``huge_pages=True`` uses MFD_HUGETLB and raises
        ``UnsupportedError`` when the hugetlb pool is short. CUDA: cuMemCreate with a POSIX fd
        handle; ``fabric`` asks for a FABRIC handle too (None: where the device supports it,
        falling back to fd only if creation with it is refused); ``gpu_direct_rdma`` sets
        gpuDirectRDMACapable (None: where the device supports it with VMM).
        The size is rounded up to the page / granularity (``alloc_nbytes``); ``nbytes`` stays as
        asked. Host memory starts zeroed; CUDA memory is not initialised.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be a positive int, got {nbytes!r}")
        nbytes = int(nbytes)
        kind, ordinal = _parse_device(device)
        self = cls(_token=_PRIVATE)
        self.name = name
        if kind == "host":
            if fabric or gpu_direct_rdma:
                raise InvalidArgumentError("fabric / gpu_direct_rdma apply to CUDA buffers only")
            self._allocate_host(nbytes, huge_pages)
        else:
            if huge_pages:
                raise InvalidArgumentError("huge_pages applies to host buffers; CUDA uses its own granularity")
            assert ordinal is not None
            self._allocate_cuda(nbytes, ordinal, fabric, gpu_direct_rdma)
        self._closed = False
        return self

    def _allocate_host(self, nbytes: int, huge_pages: bool) -> None:
        page = _huge_page_size() if huge_pages else PAGE_SIZE
        size = _round_up(nbytes, page)
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge_pages else 0)
        try:
            fd = os.memfd_create(self.name, flags)
        except OSError as e:
            if huge_pages and e.errno in (errno.EINVAL, errno.ENOENT, errno.EOPNOTSUPP):
                raise UnsupportedError(f"huge pages requested but this kernel has no hugetlb memfd: {e}") from e
            raise BufferError(f"memfd_create({self.name!r}) failed: {e}") from e
        try:
            os.ftruncate(fd, size)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # importers can trust the size
            except OSError:
                pass  # older kernels without hugetlb sealing: still correct, just unsealed
            try:
                mapping = _HostMapping(fd, size)
            except OSError as e:
                if huge_pages and e.errno == errno.ENOMEM:
                    raise UnsupportedError(
                        f"huge pages requested but the hugetlb pool is short: {size // page} page(s) of "
                        f"{page >> 10} kB needed, HugePages_Free={_huge_pages_free()}; raise vm.nr_hugepages "
                        "or allocate with huge_pages=False"
                    ) from e
                raise BufferError(f"mmap of {size} bytes failed: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        self.kind = "host"
        self._fd = fd
        self._mapping = mapping
        self.nbytes = nbytes
        self.alloc_nbytes = size
        self.granularity = page
        self.huge_pages = huge_pages

    def _allocate_cuda(self, nbytes: int, ordinal: int, fabric: bool | None, rdma: bool | None) -> None:
        drv = _cuda.load()
        _cuda.make_current(ordinal)
        if not _cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
            raise UnsupportedError(f"cuda:{ordinal} does not support virtual memory management (cuMem)")
        if not _cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
            raise UnsupportedError(f"cuda:{ordinal} cannot export POSIX fd handles")
        fabric_ok = bool(_cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
        if fabric and not fabric_ok:
            raise UnsupportedError(f"cuda:{ordinal} does not support FABRIC handles")
        rdma_ok = bool(_cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
        if rdma and not rdma_ok:
            raise UnsupportedError(f"cuda:{ordinal} does not support GPUDirect RDMA with cuMem allocations")
        rdma = rdma_ok if rdma is None else rdma
        T = drv.CUmemAllocationHandleType
        posix = int(T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        attempts = []
        if fabric or (fabric is None and fabric_ok):
            attempts.append(posix | int(T.CU_MEM_HANDLE_TYPE_FABRIC))
        if not fabric:
            attempts.append(posix)
        handle = None
        for i, types in enumerate(attempts):
            prop = _cuda.prop(ordinal, types, rdma)
            gran = _cuda.check(
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
            size = _round_up(nbytes, int(gran))
            try:
                handle = _cuda.check(drv.cuMemCreate(size, prop, 0), "cuMemCreate")
            except UnsupportedError:
                # FABRIC needs IMEX channels (/dev/nvidia-caps-imex-channels); without them
                # cuMemCreate refuses. In auto mode fall back to a plain fd handle.
                if i + 1 < len(attempts):
                    continue
                raise
            self._fabric = bool(types & int(T.CU_MEM_HANDLE_TYPE_FABRIC))
            break
        assert handle is not None
        try:
            ptr = _cuda.map(handle, size, int(gran), ordinal)
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        self.kind = "cuda"
        self._mapping = _CudaMapping(ptr, size, handle, ordinal)
        self.nbytes = nbytes
        self.alloc_nbytes = size
        self.granularity = int(gran)
        self.device_ordinal = ordinal
        self._device_uuid = _cuda.uuid(ordinal)

    @classmethod
    def import_(cls, handle: SharedHandle) -> KVBuffer:
        """Map the memory behind ``handle`` into this process.

        Does not consume ``handle``: close it afterwards (the mapping keeps the memory alive).
        A host import keeps a dup of the memfd so it can be exported again; a CUDA import keeps
        the imported allocation handle, which holds the memory even after the exporter exits.
        """
        if not isinstance(handle, SharedHandle):
            raise InvalidArgumentError(f"import_ takes a SharedHandle, got {type(handle).__name__}")
        if handle.closed:
            raise ClosedError("SharedHandle is closed")
        self = cls(_token=_PRIVATE)
        self.name = handle.name
        if handle.kind == "host":
            self._import_host(handle)
        else:
            self._import_cuda(handle)
        self.imported = True
        self._closed = False
        return self

    def _import_host(self, h: SharedHandle) -> None:
        if h.fd < 0:
            raise InvalidArgumentError("a host SharedHandle must carry an fd")
        if h.alloc_nbytes % PAGE_SIZE:
            raise InvalidArgumentError(f"alloc_nbytes {h.alloc_nbytes} is not a multiple of the page size")
        fd = os.dup(h.fd)
        try:
            os.set_inheritable(fd, False)
            st = os.fstat(fd)
            if st.st_size < h.alloc_nbytes:  # mapping past EOF would SIGBUS on first touch
                raise BufferError(
                    f"handle fd {_fd_name(fd)} is {st.st_size} bytes, smaller than alloc_nbytes={h.alloc_nbytes}"
                )
            try:
                mapping = _HostMapping(fd, h.alloc_nbytes)
            except OSError as e:
                if h.huge_pages and e.errno == errno.ENOMEM:
                    raise UnsupportedError(f"mapping a huge-page buffer failed: {e}") from e
                raise BufferError(f"mmap of imported fd failed: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        self.kind = "host"
        self._fd = fd
        self._mapping = mapping
        self.nbytes = h.nbytes
        self.alloc_nbytes = h.alloc_nbytes
        self.granularity = h.granularity
        self.huge_pages = h.huge_pages

    def _import_cuda(self, h: SharedHandle) -> None:
        drv = _cuda.load()
        _, fallback = _parse_device(h.device)
        ordinal = _cuda.ordinal_of(h.device_uuid, fallback or 0)
        _cuda.make_current(ordinal)
        T = drv.CUmemAllocationHandleType
        if h.fd >= 0:
            handle = _cuda.check(
                drv.cuMemImportFromShareableHandle(h.fd, T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
            )
        else:
            assert h.fabric is not None
            handle = _cuda.check(
                drv.cuMemImportFromShareableHandle(h.fabric, T.CU_MEM_HANDLE_TYPE_FABRIC),
                "cuMemImportFromShareableHandle(FABRIC)",
            )
        try:
            ptr = _cuda.map(handle, h.alloc_nbytes, h.granularity, ordinal)
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        self.kind = "cuda"
        self._mapping = _CudaMapping(ptr, h.alloc_nbytes, handle, ordinal)
        self.nbytes = h.nbytes
        self.alloc_nbytes = h.alloc_nbytes
        self.granularity = h.granularity
        self.device_ordinal = ordinal
        self._device_uuid = h.device_uuid
        self._fabric = h.fabric is not None

    # ---- what the engine reads ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ptr(self) -> int:
        """Address of the first byte in this process (a device address for CUDA)."""
        return self._live().ptr

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N' (N is this process's ordinal)."""
        return "cpu" if self.kind == "host" else f"cuda:{self.device_ordinal}"

    @property
    def ordinal(self) -> int:
        """The CUDA device ordinal in this process (0 for host buffers); alias for the engine."""
        return self.device_ordinal or 0

    @property
    def has_fabric_handle(self) -> bool:
        """The allocation carries CU_MEM_HANDLE_TYPE_FABRIC (exportable across nodes via IMEX)."""
        return self._fabric

    def lease(self) -> object:
        """An opaque token that keeps the mapping (and so ``ptr``) valid while it lives.

        ``Engine.register`` holds one in its memory region, so closing the buffer before
        deregistering never leaves a registered range unmapped.
        """
        return self._live()

    def fileno(self) -> int:
        """The host memfd (owned by this buffer)."""
        self._live()
        if self.kind != "host":
            raise UnsupportedError("a CUDA buffer has no fd of its own; use export() or dmabuf_fd()")
        return self._fd

    def dmabuf_fd(self) -> int:
        """A new dma-buf fd for ``[ptr, ptr + alloc_nbytes)`` (offset 0), for FI_MR_DMABUF.

        CUDA only (cuMemGetHandleForAddressRange); the caller owns and closes the fd.
        Raises ``UnsupportedError`` where the device or driver lacks dma-buf export.
        """
        m = self._live()
        if self.kind != "cuda":
            raise UnsupportedError("dma-buf export is for CUDA buffers; register host buffers by address")
        drv = _cuda.load()
        if not _cuda.attr(self.device_ordinal or 0, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"):
            raise UnsupportedError(f"{self.device} does not support dma-buf export (needs the open kernel module)")
        _cuda.make_current(self.device_ordinal or 0)
        fd = _cuda.check(
            drv.cuMemGetHandleForAddressRange(
                m.ptr, self.alloc_nbytes, drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0
            ),
            "cuMemGetHandleForAddressRange(DMA_BUF_FD)",
        )
        return int(fd)

    # ---- sharing -----------------------------------------------------------------------

    def export(self, *, fabric: bool = False) -> SharedHandle:
        """A new ``SharedHandle`` for this memory; the caller closes it (after sending it).

        Host: a dup of the memfd. CUDA: a POSIX fd from cuMemExportToShareableHandle, plus
        the FABRIC handle when the allocation has one; ``fabric=True`` sends the fabric handle
        alone (no fd: for importers that use IMEX instead of SCM_RIGHTS).
        """
        m = self._live()
        common = dict(
            kind=self.kind,
            nbytes=self.nbytes,
            alloc_nbytes=self.alloc_nbytes,
            device=self.device,
            granularity=self.granularity,
            huge_pages=self.huge_pages,
            name=self.name,
        )
        if self.kind == "host":
            if fabric:
                raise InvalidArgumentError("fabric handles exist for CUDA buffers only")
            fd = os.dup(self._fd)
            os.set_inheritable(fd, False)
            return SharedHandle(fd=fd, **common)  # type: ignore[arg-type]
        assert isinstance(m, _CudaMapping)
        drv = _cuda.load()
        _cuda.make_current(m.ordinal)
        T = drv.CUmemAllocationHandleType
        fab: bytes | None = None
        if self._fabric:
            fh = _cuda.check(
                drv.cuMemExportToShareableHandle(m.handle, T.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                "cuMemExportToShareableHandle(FABRIC)",
            )
            fab = bytes(fh.data)
        elif fabric:
            raise UnsupportedError("this allocation has no FABRIC handle (device or IMEX lacks support)")
        fd = -1
        if not fabric:
            fd = int(
                _cuda.check(
                    drv.cuMemExportToShareableHandle(m.handle, T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                )
            )
            os.set_inheritable(fd, False)
        return SharedHandle(fd=fd, fabric=fab, device_uuid=self._device_uuid, **common)  # type: ignore[arg-type]

    # ---- views -------------------------------------------------------------------------

    def _span(
        self, dtype: Any, shape: int | tuple[int, ...] | None, offset: int
    ) -> tuple[np.dtype, tuple[int, ...], int]:
        dt = np.dtype(dtype)
        if offset < 0:
            raise OutOfBoundsError(f"offset {offset} is negative")
        avail = self.nbytes - offset
        if shape is None:
            if avail < 0 or avail % dt.itemsize:
                raise InvalidArgumentError(
                    f"{avail} bytes from offset {offset} are not a whole number of {dt} items; pass a shape"
                )
            shape = (avail // dt.itemsize,)
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise InvalidArgumentError(f"negative dimension in shape {shape}")
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset + n > self.nbytes:
            raise OutOfBoundsError(f"view of {n} bytes at offset {offset} exceeds the buffer's {self.nbytes} bytes")
        return dt, shape, n

    def numpy(self, dtype: Any = np.uint8, shape: int | tuple[int, ...] | None = None, offset: int = 0) -> np.ndarray:
        """A zero-copy numpy view of host memory; it keeps the mapping alive after ``close()``."""
        m = self._live()
        if self.kind != "host":
            raise BufferError("a CUDA buffer has no numpy view; use torch() or __cuda_array_interface__")
        dt, shape, n = self._span(dtype, shape, offset)
        assert isinstance(m, _HostMapping)
        if n == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(_host_bytes(m, offset, n), dtype=dt).reshape(shape)

    def torch(self, dtype: Any = None, shape: int | tuple[int, ...] | None = None, offset: int = 0) -> torch.Tensor:
        """A zero-copy torch tensor on this buffer's device; it keeps the mapping alive."""
        m = self._live()
        try:
            import torch
        except ImportError as e:
            raise UnsupportedError("torch views need torch: pip install 'kvxfer[torch]'") from e
        tdt = torch.uint8 if dtype is None else dtype
        if not isinstance(tdt, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
        itemsize = torch.empty((), dtype=tdt).element_size()
        # compute the byte span with a same-size numpy stand-in (bfloat16 has no numpy dtype)
        _, shp, n = self._span(np.dtype(f"V{itemsize}"), shape, offset)
        if self.kind == "host":
            raw = torch.from_numpy(self.numpy(np.uint8, (n,), offset))
        else:
            raw = torch.as_tensor(_View(m, m.ptr + offset, n), device=self.device)
        return raw.view(tdt).reshape(shp)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA buffers as a 1-D uint8 device array (cupy, numba, torch.as_tensor).

        The consumer must keep this buffer (or a ``lease()``) alive for as long as it uses the
        pointer; ``torch()`` does that for you.
        """
        if self.kind != "cuda":
            raise AttributeError("__cuda_array_interface__ is for CUDA buffers")
        m = self._live()
        return _View(m, m.ptr, self.nbytes).__cuda_array_interface__

    def __dlpack__(self, **kwargs: Any) -> Any:
        """Host buffers as a 1-D uint8 DLPack tensor (np.from_dlpack, torch.from_dlpack)."""
        if self.kind != "host":
            raise BufferError("DLPack export of CUDA buffers is not provided; use torch() or __cuda_array_interface__")
        return self.numpy().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.kind != "host":
            return (2, self.device_ordinal or 0)  # kDLCUDA
        return (1, 0)  # kDLCPU

    def __buffer__(self, flags: int) -> memoryview:
        """Host buffers speak the buffer protocol (writable bytes); the view holds the mapping."""
        m = self._live()
        if self.kind != "host":
            raise BufferError("a CUDA buffer has no host buffer protocol")
        assert isinstance(m, _HostMapping)
        return memoryview(_host_bytes(m, 0, self.nbytes)).cast("B")

    # ---- copies (for tests and checks: goes through the mapping) ---------------------------

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (any bytes-like) into the buffer at ``offset``."""
        m = self._live()
        src = memoryview(data).cast("B")
        n = src.nbytes
        if offset < 0 or offset + n > self.nbytes:
            raise OutOfBoundsError(f"{n} bytes at offset {offset} exceed the buffer's {self.nbytes} bytes")
        if n == 0:
            return
        arr = np.frombuffer(src, dtype=np.uint8)  # keeps src alive; .ctypes.data is its address
        if self.kind == "host":
            ctypes.memmove(m.ptr + offset, arr.ctypes.data, n)
            return
        drv = _cuda.load()
        _cuda.make_current(self.device_ordinal or 0)
        _cuda.check(drv.cuMemcpyHtoD(m.ptr + offset, arr.ctypes.data, n), "cuMemcpyHtoD")
        # from pageable memory the copy may still be in flight on return; another process
        # reading through its own mapping must see it
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        """Copy ``nbytes`` (default: to the end) from ``offset`` out of the buffer."""
        m = self._live()
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise OutOfBoundsError(f"{nbytes} bytes at offset {offset} exceed the buffer's {self.nbytes} bytes")
        if self.kind == "host":
            return ctypes.string_at(m.ptr + offset, nbytes)
        drv = _cuda.load()
        _cuda.make_current(self.device_ordinal or 0)
        out = (ctypes.c_char * max(nbytes, 1))()
        if nbytes:
            _cuda.check(drv.cuMemcpyDtoH(ctypes.addressof(out), m.ptr + offset, nbytes), "cuMemcpyDtoH")
        return bytes(out)[:nbytes]

    # ---- life cycle --------------------------------------------------------------------

    def _live(self) -> _HostMapping | _CudaMapping:
        m = self._mapping
        if self._closed or m is None:
            raise ClosedError(f"KVBuffer {self.name!r} is closed")
        return m

    def close(self) -> None:
        """Close the fd now; unmap once the last view and lease are gone. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fd, self._fd = self._fd, -1
            mapping, self._mapping = self._mapping, None
        if fd >= 0:
            os.close(fd)
        del mapping  # the last reference unmaps (views and leases keep theirs)

    def __enter__(self) -> KVBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a KVBuffer cannot be pickled; export() it and send the handle with kvxfer.share")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr=0x{self._mapping.ptr:x}" if self._mapping else "?"
        origin = "imported" if self.imported else "allocated"
        return f"<KVBuffer {self.kind} {self.device} nbytes={self.nbytes} {origin} {state}>"

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()


_PRIVATE = object()
