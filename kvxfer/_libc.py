"""The process's C library through ctypes, loaded once, with the prototypes kvxfer calls.

``mmap``/``munmap`` map memfds without a Python ``mmap`` object (which pins itself while a
view is exported); ``syscall`` reaches ``pidfd_open``/``pidfd_getfd``, which the ``os`` module
lacks on some Pythons.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["libc", "MAP_FAILED"]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.syscall.restype = ctypes.c_long

#: what ``mmap`` returns on failure
MAP_FAILED = ctypes.c_void_p(-1).value
