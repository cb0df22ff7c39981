"""The host kind of ``KVBuffer``: a sealed memfd mapped ``MAP_SHARED``, allocated or imported from an fd.

The memfd is sealed against shrinking and growing before anyone can import it, and an import
checks the fd's size against ``alloc_nbytes``, so no mapping ever reaches past the end of the
file (no SIGBUS). Huge pages on request (``MFD_HUGETLB``), with a clear error when the pool
is short.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import TYPE_CHECKING

from kvxfer.buffers.handles import PAGE_SIZE, SharedHandle
from kvxfer.buffers.mappings import HostMapping, round_up
from kvxfer.errors import BufferError, InvalidArgumentError, UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.buffers.kvbuffer import KVBuffer

__all__ = ["allocate", "import_"]

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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


def _fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def allocate(buf: KVBuffer, nbytes: int, huge_pages: bool) -> None:
    """Give ``buf`` a new sealed memfd of ``nbytes`` (rounded to the page or huge page), mapped here."""
    page = _huge_page_size() if huge_pages else PAGE_SIZE
    size = round_up(nbytes, page)
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge_pages else 0)
    try:
        fd = os.memfd_create(buf.name, flags)
    except OSError as e:
        if huge_pages and e.errno in (errno.EINVAL, errno.ENOENT, errno.EOPNOTSUPP):
            raise UnsupportedError(f"huge pages requested but this kernel has no hugetlb memfd: {e}") from e
        raise BufferError(f"memfd_create({buf.name!r}) failed: {e}") from e
    try:
        os.ftruncate(fd, size)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # importers can trust the size
        except OSError as e:      # every kernel since 4.16 seals hugetlb memfds too
            raise BufferError(f"sealing the memfd failed ({e}): importers could not trust its size") from e
        try:
            mapping = HostMapping(fd, size)
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
    buf.kind = "host"
    buf._fd = fd
    buf._mapping = mapping
    buf.nbytes = nbytes
    buf.alloc_nbytes = size
    buf.granularity = page
    buf.huge_pages = huge_pages


def import_(buf: KVBuffer, h: SharedHandle) -> None:
    """Give ``buf`` a mapping of the memfd behind ``h`` (a dup of its fd, kept so ``buf`` can export again)."""
    if h.fd < 0:
        raise InvalidArgumentError("a host SharedHandle must carry an fd")
    if h.alloc_nbytes % PAGE_SIZE:
        raise InvalidArgumentError(f"alloc_nbytes {h.alloc_nbytes} is not a multiple of the page size")
    try:
        fd = os.dup(h.fd)
    except OSError as e:         # closed behind the handle's back, or never an fd
        raise BufferError(f"handle fd {h.fd} cannot be duplicated: {e}") from e
    try:
        # unsealed, its owner (or anyone holding the fd) could shrink it under our mapping,
        # and the next touch, ours or a peer's write, would SIGBUS
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise BufferError(f"handle fd {_fd_name(fd)} is not a memfd that can be sealed: {e}") from e
        if not seals & fcntl.F_SEAL_SHRINK:
            raise BufferError(f"handle fd {_fd_name(fd)} is not sealed against shrinking (F_SEAL_SHRINK): "
                              "its size could change under the mapping")
        st = os.fstat(fd)
        if st.st_size < h.alloc_nbytes:  # mapping past EOF would SIGBUS on first touch
            raise BufferError(
                f"handle fd {_fd_name(fd)} is {st.st_size} bytes, smaller than alloc_nbytes={h.alloc_nbytes}"
            )
        try:
            mapping = HostMapping(fd, h.alloc_nbytes)
        except OSError as e:
            if h.huge_pages and e.errno == errno.ENOMEM:
                raise UnsupportedError(f"mapping a huge-page buffer failed: {e}") from e
            raise BufferError(f"mmap of imported fd failed: {e}") from e
    except BaseException:
        os.close(fd)
        raise
    buf.kind = "host"
    buf._fd = fd
    buf._mapping = mapping
    buf.nbytes = h.nbytes
    buf.alloc_nbytes = h.alloc_nbytes
    buf.granularity = h.granularity
    buf.huge_pages = h.huge_pages
