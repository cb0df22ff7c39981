"""The CUDA kind of ``KVBuffer``: cuMem (VMM) memory allocated on a device, or imported from a POSIX fd or FABRIC handle.

``cuMemCreate`` asks for ``gpuDirectRDMACapable`` where the device allows it and for a FABRIC
handle where the device and IMEX allow it (falling back to an fd alone when ``cuMemCreate``
refuses); the range is reserved, mapped and made read-write, its size rounded to the
allocation granularity. An import finds the exporter's device by UUID, since ordinals differ
under ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer._cuda import driver as cuda
from kvxfer.buffers.handles import SharedHandle, parse_device
from kvxfer.buffers.mappings import CudaMapping, round_up
from kvxfer.errors import UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.buffers.kvbuffer import KVBuffer

__all__ = ["allocate", "import_"]


def allocate(buf: KVBuffer, nbytes: int, ordinal: int, fabric: bool | None, rdma: bool | None) -> None:
    """Give ``buf`` a new cuMem allocation of ``nbytes`` on device ``ordinal``, reserved and mapped here."""
    drv = cuda.load()
    cuda.make_current(ordinal)
    if not cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
        raise UnsupportedError(f"cuda:{ordinal} does not support virtual memory management (cuMem)")
    if not cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
        raise UnsupportedError(f"cuda:{ordinal} cannot export POSIX fd handles")
    fabric_ok = bool(cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
    if fabric and not fabric_ok:
        raise UnsupportedError(f"cuda:{ordinal} does not support FABRIC handles")
    rdma_ok = bool(cuda.attr(ordinal, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
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
        prop = cuda.prop(ordinal, types, rdma)
        gran = cuda.check(
            drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        size = round_up(nbytes, int(gran))
        try:
            handle = cuda.check(drv.cuMemCreate(size, prop, 0), "cuMemCreate")
        except UnsupportedError:
            # FABRIC needs IMEX channels (/dev/nvidia-caps-imex-channels); without them
            # cuMemCreate refuses. In auto mode fall back to a plain fd handle.
            if i + 1 < len(attempts):
                continue
            raise
        buf._fabric = bool(types & int(T.CU_MEM_HANDLE_TYPE_FABRIC))
        break
    assert handle is not None
    try:
        ptr = cuda.map(handle, size, int(gran), ordinal)
    except BaseException:
        drv.cuMemRelease(handle)
        raise
    buf.kind = "cuda"
    buf._mapping = CudaMapping(ptr, size, handle, ordinal)
    buf.nbytes = nbytes
    buf.alloc_nbytes = size
    buf.granularity = int(gran)
    buf.device_ordinal = ordinal
    buf._device_uuid = cuda.uuid(ordinal)


def import_(buf: KVBuffer, h: SharedHandle) -> None:
    """Give ``buf`` the allocation behind ``h`` (fd or FABRIC handle), mapped on the exporter's device."""
    drv = cuda.load()
    _, fallback = parse_device(h.device)
    ordinal = cuda.ordinal_of(h.device_uuid, fallback or 0)
    cuda.make_current(ordinal)
    T = drv.CUmemAllocationHandleType
    if h.fd >= 0:
        handle = cuda.check(
            drv.cuMemImportFromShareableHandle(h.fd, T.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
        )
    else:
        assert h.fabric is not None
        handle = cuda.check(
            drv.cuMemImportFromShareableHandle(h.fabric, T.CU_MEM_HANDLE_TYPE_FABRIC),
            "cuMemImportFromShareableHandle(FABRIC)",
        )
    try:
        ptr = cuda.map(handle, h.alloc_nbytes, h.granularity, ordinal)
    except BaseException:
        drv.cuMemRelease(handle)
        raise
    buf.kind = "cuda"
    buf._mapping = CudaMapping(ptr, h.alloc_nbytes, handle, ordinal)
    buf.nbytes = h.nbytes
    buf.alloc_nbytes = h.alloc_nbytes
    buf.granularity = h.granularity
    buf.device_ordinal = ordinal
    buf._device_uuid = h.device_uuid
    buf._fabric = h.fabric is not None

# ---- what the engine reads ---------------------------------------------------------
