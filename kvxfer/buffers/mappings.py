"""The one object that owns a mapping of KV memory; views and leases hold it, and its last release unmaps.

A ``KVBuffer`` drops its reference on ``close()``, so a numpy array, a torch tensor or a
registered region never points at unmapped memory: closing in any order is safe.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
from typing import Any

from kvxfer._cuda import driver as cuda
from kvxfer._libc import MAP_FAILED, libc

__all__ = ["HostMapping", "CudaMapping", "View", "host_bytes", "round_up"]


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (a page, huge page or CUDA granularity)."""
    return (n + to - 1) // to * to


class HostMapping:
    """A MAP_SHARED mapping of a memfd; unmapped when the last reference goes."""

    __slots__ = ("ptr", "size", "__weakref__")

    def __init__(self, fd: int, size: int) -> None:
        self.ptr = 0
        self.size = size
        addr = libc.mmap(None, size, _mmap.PROT_READ | _mmap.PROT_WRITE, _mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.ptr = int(addr)

    def release(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            libc.munmap(ptr, self.size)

    def __del__(self) -> None:
        self.release()


class CudaMapping:
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
            drv = cuda.drv
            if drv is None:
                return
            cuda.make_current(self.ordinal)
            if ptr:
                drv.cuMemUnmap(ptr, self.size)
                drv.cuMemAddressFree(ptr, self.size)
            if handle is not None:
                drv.cuMemRelease(handle)
        except Exception:  # interpreter teardown: the driver is going away with the process
            pass

    def __del__(self) -> None:
        self.release()


class View:
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


def host_bytes(mapping: HostMapping, offset: int, nbytes: int) -> ctypes.Array:
    """A ctypes byte array over the mapping that holds the mapping alive (used for numpy views)."""
    arr = (ctypes.c_char * nbytes).from_address(mapping.ptr + offset)
    arr._kvxfer_mapping = mapping  # type: ignore[attr-defined]  # the view keeps the pages mapped
    return arr
