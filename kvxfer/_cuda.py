"""The CUDA driver API through cuda-python: one import fallback (driver and NVRTC), one checked-call wrapper, one device probe.

Nothing here needs a GPU to import; without cuda-python or a driver every entry point says so
(``UnsupportedError`` from :class:`CudaDriver`, an empty map from :func:`cuda_ordinals`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from kvxfer.errors import BufferError, UnsupportedError

__all__ = ["CudaDriver", "driver", "driver_module", "nvrtc_module", "device_bus_ids"]


def driver_module() -> Any | None:
    """cuda-python's driver module (``cuda.bindings.driver`` from 12.6, ``cuda.cuda`` before), or None."""
    try:
        from cuda.bindings import driver as drv  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as drv  # type: ignore[no-redef]  # older cuda-python
        except ImportError:
            return None
    return drv


def nvrtc_module() -> Any | None:
    """cuda-python's NVRTC module (``cuda.bindings.nvrtc`` from 12.6, ``cuda.nvrtc`` before), or
    None: the same fallback as ``driver_module``, for code that compiles kernels."""
    try:
        from cuda.bindings import nvrtc  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[no-redef]  # older cuda-python
        except ImportError:
            return None
    return nvrtc


class CudaDriver:
    """cuda-python's driver module, loaded on first use, with checked calls and per-device helpers."""

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
        drv = driver_module()
        if drv is None:
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


#: the process's one driver handle (contexts are retained per device for the process)
driver = CudaDriver()


def device_bus_ids() -> dict[str, int]:
    """The driver's PCI bus id (as it spells it, e.g. ``00000000:DB:00.0``) -> CUDA ordinal in this
    process; {} without cuda-python or a GPU, since every failure here means "no ordinals"."""
    cu = driver_module()
    if cu is None:
        return {}
    try:
        (err,) = cu.cuInit(0)
        if int(err) != 0:
            return {}
        err, count = cu.cuDeviceGetCount()
        if int(err) != 0:
            return {}
        out: dict[str, int] = {}
        for i in range(count):
            err, dev = cu.cuDeviceGet(i)
            if int(err) != 0:
                continue
            err, raw = cu.cuDeviceGetPCIBusId(32, dev)
            if int(err) != 0:
                continue
            text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
            out[text.split("\x00", 1)[0]] = i
        return out
    except Exception:  # a driver without a device raises from every call; ordinals stay None
        return {}
