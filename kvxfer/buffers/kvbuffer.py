"""``KVBuffer``: KV-cache memory, host memfd or CUDA cuMem, that one process allocates and another maps.

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

Lifetime rules:

- The mapping is owned by a small mapping object, not by the ``KVBuffer``. Views (numpy,
  torch, memoryview, ``__cuda_array_interface__``) and ``lease()`` hold that object, so
  ``close()`` never pulls memory from under a live view: it closes the fd at once and *defers*
  the unmap until the last view or lease is gone. Closing in any order is safe.
- Imported memory stays valid after the exporter exits: the importer's mapping (host) or its
  imported allocation handle (CUDA) keeps the pages alive.
- Everything holding an fd or a mapping closes idempotently and warns with ``ResourceWarning``
  when garbage-collected open.

The two kinds
-------------

| | host | cuda |
|---|---|---|
| memory | `memfd_create(MFD_CLOEXEC\\|MFD_ALLOW_SEALING[\\|MFD_HUGETLB])`, `ftruncate`, sealed `SHRINK\\|GROW\\|SEAL` | `cuMemCreate` (PINNED, device N, `gpuDirectRDMACapable` where `GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`) |
| mapping | `mmap(MAP_SHARED)` through libc (no Python `mmap` object, which would pin itself with exported buffers) | `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess(READWRITE)` |
| size | `nbytes` as asked; `alloc_nbytes` rounded to the page (or huge page) | `alloc_nbytes` rounded to `cuMemGetAllocationGranularity(MINIMUM)` |
| shareable handle | a dup of the memfd | POSIX fd from `cuMemExportToShareableHandle`; plus a 64-byte FABRIC handle when the device has `HANDLE_TYPE_FABRIC_SUPPORTED` and `cuMemCreate` accepts it (needs IMEX channels; otherwise it falls back to fd only) |
| import | `fstat` size check, then `mmap` the fd | `cuMemImportFromShareableHandle` on the device with the exporter's **UUID** (ordinals differ under `CUDA_VISIBLE_DEVICES`), then reserve/map/set access |
| views | `numpy(dtype, shape, offset)`, `torch(...)`, buffer protocol, `__dlpack__` | `torch(...)` (via `__cuda_array_interface__`), `__cuda_array_interface__` |
| for the engine | `ptr`, `nbytes`, `kind="host"` | `ptr`, `nbytes`, `kind="cuda"`, `device_ordinal` (alias `ordinal`), `dmabuf_fd()` |

`dmabuf_fd()` calls `cuMemGetHandleForAddressRange(DMA_BUF_FD)` over `[ptr, ptr+alloc_nbytes)`
(offset 0); the caller owns the fd and may close it right after `fi_mr_regattr`. Devices
without `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (proprietary kernel module, kernel < 5.12) raise
`UnsupportedError`; the engine then registers with `FI_HMEM_CUDA` + device ordinal instead.

Who owns what
-------------

| object | owns | released by |
|---|---|---|
| `KVBuffer` | host: its memfd; a reference to the mapping object | `close()` (idempotent; `ResourceWarning` if GC'd open) |
| mapping object (`HostMapping` / `CudaMapping`, kvxfer.buffers.mappings) | the virtual mapping; CUDA: also the allocation handle | the last reference: `munmap`, or `cuMemUnmap` → `cuMemAddressFree` → `cuMemRelease` |
| views, `lease()` | a reference to the mapping object | garbage collection |
| `SharedHandle` | one fd (memfd or cuMem POSIX fd), or none for fabric-only | `close()` (idempotent; `ResourceWarning` if GC'd open) |
| `send_handles` | nothing: the kernel gives the receiver new fds; the sender still closes its handles | — |
| `recv_handles` | returns handles that own the received fds (`MSG_CMSG_CLOEXEC`); a malformed message closes every fd it brought | — |

Rules that follow:

- **Closing in any order is safe.** `KVBuffer.close()` closes the fd at once and drops its
  reference to the mapping; the unmap happens when the last view or lease is gone, so a numpy
  array, a torch tensor or a registered region never points at unmapped memory. (We chose
  *defer* over *refuse*: a refusing `close()` cannot be used from `__exit__` or teardown
  paths.) `Engine.register` should hold `buf.lease()` for the region's lifetime.
- **Imported memory outlives its exporter.** The importer's mapping (host: a shmem mapping;
  CUDA: the imported allocation handle) keeps the pages. CUDA frees physical memory only when
  every handle is released and every mapping unmapped — in every process.
- **Handles keep memory alive too.** An unclosed `SharedHandle` (or a cuMem POSIX fd sitting
  in a socket buffer) pins the memory; close handles right after `import_` / `send_handles`.
- **No SIGBUS.** Host memfds are sealed against shrinking before export, and `import_` checks
  the fd's size against `alloc_nbytes`, so no mapping can reach past the end of the file.
- **Fork.** Use the `spawn` start method for workers (CUDA does not survive `fork`); all fds
  are close-on-exec.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer._check import as_int
from kvxfer._cuda import driver as cuda
from kvxfer.buffers import cuda as cuda_kind
from kvxfer.buffers import host
from kvxfer.buffers.handles import PAGE_SIZE, Kind, SharedHandle, parse_device
from kvxfer.buffers.mappings import CudaMapping, HostMapping, View, host_bytes
from kvxfer.errors import (
    BufferError,
    ClosedError,
    InvalidArgumentError,
    OutOfBoundsError,
    UnsupportedError,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["KVBuffer", "cuda_available"]

def cuda_available(device: str | int = "cuda:0") -> bool:
    """True when cuda-python loads, cuInit succeeds and the device exists (tests skip on False)."""
    try:
        kind, ordinal = parse_device(device)
        if kind != "cuda":
            return False
        cuda.device(ordinal or 0)
        return True
    except (UnsupportedError, BufferError, InvalidArgumentError):
        return False


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
        self._mapping: HostMapping | CudaMapping | None = None
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
        nbytes = as_int(nbytes, "nbytes", minimum=1)
        if nbytes > _MAX_NBYTES:     # rounded up, it must still be a file size (off_t)
            raise InvalidArgumentError(f"nbytes must be at most {_MAX_NBYTES}, got {nbytes}")
        _check_name(name)
        kind, ordinal = parse_device(device)
        self = cls(_token=_PRIVATE)
        self.name = name
        if kind == "host":
            if fabric or gpu_direct_rdma:
                raise InvalidArgumentError("fabric / gpu_direct_rdma apply to CUDA buffers only")
            host.allocate(self, nbytes, huge_pages)
        else:
            if huge_pages:
                raise InvalidArgumentError("huge_pages applies to host buffers; CUDA uses its own granularity")
            assert ordinal is not None
            cuda_kind.allocate(self, nbytes, ordinal, fabric, gpu_direct_rdma)
        self._closed = False
        return self

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
            host.import_(self, handle)
        else:
            cuda_kind.import_(self, handle)
        self.imported = True
        self._closed = False
        return self

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
        drv = cuda.load()
        if not cuda.attr(self.device_ordinal or 0, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"):
            raise UnsupportedError(f"{self.device} does not support dma-buf export (needs the open kernel module)")
        cuda.make_current(self.device_ordinal or 0)
        fd = cuda.check(
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
            # under the lock: a close() in between would close the fd, and its number, reused
            # by any other open, would be exported as this buffer
            with self._lock:
                if self._closed:
                    raise ClosedError(f"KVBuffer {self.name!r} is closed")
                fd = os.dup(self._fd)      # F_DUPFD_CLOEXEC: never inheritable
            return SharedHandle(fd=fd, **common)  # type: ignore[arg-type]
        assert isinstance(m, CudaMapping)
        drv = cuda.load()
        cuda.make_current(m.ordinal)
        T = drv.CUmemAllocationHandleType
        fab: bytes | None = None
        if self._fabric:
            fh = cuda.check(
                drv.cuMemExportToShareableHandle(m.handle, T.CU_MEM_HANDLE_TYPE_FABRIC, 0),
                "cuMemExportToShareableHandle(FABRIC)",
            )
            fab = bytes(fh.data)
        elif fabric:
            raise UnsupportedError("this allocation has no FABRIC handle (device or IMEX lacks support)")
        fd = -1
        if not fabric:
            fd = int(
                cuda.check(
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
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise InvalidArgumentError(f"{dtype!r} is not a numpy dtype") from None
        if dt.hasobject:
            raise InvalidArgumentError("a view of raw memory cannot hold Python objects (object dtype)")
        offset = as_int(offset, "offset")
        if offset < 0:
            raise OutOfBoundsError(f"offset {offset} is negative")
        if offset > self.nbytes:
            raise OutOfBoundsError(f"offset {offset} is past the buffer's {self.nbytes} bytes")
        avail = self.nbytes - offset
        if shape is None:
            if avail < 0 or avail % dt.itemsize:
                raise InvalidArgumentError(
                    f"{avail} bytes from offset {offset} are not a whole number of {dt} items; pass a shape"
                )
            shape = (avail // dt.itemsize,)
        elif not isinstance(shape, (tuple, list)):
            shape = (shape,)
        shape = tuple(as_int(s, "a shape dimension") for s in shape)
        if any(s < 0 for s in shape):
            raise InvalidArgumentError(f"negative dimension in shape {shape}")
        n = dt.itemsize
        for s in shape:            # Python ints: a product past 2**63 cannot wrap
            n *= s
        if offset + n > self.nbytes:
            raise OutOfBoundsError(f"view of {n} bytes at offset {offset} exceeds the buffer's {self.nbytes} bytes")
        return dt, shape, n

    def numpy(self, dtype: Any = np.uint8, shape: int | tuple[int, ...] | None = None, offset: int = 0) -> np.ndarray:
        """A zero-copy numpy view of host memory; it keeps the mapping alive after ``close()``."""
        m = self._live()
        if self.kind != "host":
            raise BufferError("a CUDA buffer has no numpy view; use torch() or __cuda_array_interface__")
        dt, shape, n = self._span(dtype, shape, offset)
        assert isinstance(m, HostMapping)
        if n == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(host_bytes(m, offset, n), dtype=dt).reshape(shape)

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
            raw = torch.as_tensor(View(m, m.ptr + offset, n), device=self.device)
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
        return View(m, m.ptr, self.nbytes).__cuda_array_interface__

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
        assert isinstance(m, HostMapping)
        return memoryview(host_bytes(m, 0, self.nbytes)).cast("B")

    # ---- copies (for tests and checks: goes through the mapping) ---------------------------

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (any bytes-like) into the buffer at ``offset``."""
        m = self._live()
        offset = as_int(offset, "offset")
        try:
            src = memoryview(data).cast("B")
        except TypeError:
            raise InvalidArgumentError(f"data must be bytes-like, got {type(data).__name__}") from None
        n = src.nbytes
        if offset < 0 or offset + n > self.nbytes:
            raise OutOfBoundsError(f"{n} bytes at offset {offset} exceed the buffer's {self.nbytes} bytes")
        if n == 0:
            return
        arr = np.frombuffer(src, dtype=np.uint8)  # keeps src alive; .ctypes.data is its address
        if self.kind == "host":
            ctypes.memmove(m.ptr + offset, arr.ctypes.data, n)
            return
        drv = cuda.load()
        cuda.make_current(self.device_ordinal or 0)
        cuda.check(drv.cuMemcpyHtoD(m.ptr + offset, arr.ctypes.data, n), "cuMemcpyHtoD")
        # from pageable memory the copy may still be in flight on return; another process
        # reading through its own mapping must see it
        cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        """Copy ``nbytes`` (default: to the end) from ``offset`` out of the buffer."""
        m = self._live()
        offset = as_int(offset, "offset")
        nbytes = self.nbytes - offset if nbytes is None else as_int(nbytes, "nbytes")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise OutOfBoundsError(f"{nbytes} bytes at offset {offset} exceed the buffer's {self.nbytes} bytes")
        if self.kind == "host":
            return ctypes.string_at(m.ptr + offset, nbytes)
        drv = cuda.load()
        cuda.make_current(self.device_ordinal or 0)
        out = (ctypes.c_char * max(nbytes, 1))()
        if nbytes:
            cuda.check(drv.cuMemcpyDtoH(ctypes.addressof(out), m.ptr + offset, nbytes), "cuMemcpyDtoH")
        return bytes(out)[:nbytes]

    # ---- life cycle --------------------------------------------------------------------

    def _live(self) -> HostMapping | CudaMapping:
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

#: the largest ``nbytes`` whose rounding up (to a huge page at most) is still an off_t
_MAX_NBYTES = 2**63 - (1 << 30)


def _check_name(name: object) -> None:
    """A memfd name: a str the file system encoding takes, no NUL, at most 249 bytes
    (memfd_create's limit; its EINVAL would read like a missing hugetlb memfd)."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"name must be a str, got {type(name).__name__}")
    try:
        raw = os.fsencode(name)
    except UnicodeError:
        raise InvalidArgumentError(f"name {name!r} cannot be encoded as a file name") from None
    if b"\0" in raw or len(raw) > 249:
        raise InvalidArgumentError(f"name must be at most 249 bytes without NUL, got {len(raw)} bytes")
