"""What ``/proc/self/maps`` says about a range of this process's memory, for ``Engine.register``.

One parse, two questions:

- ``check_writable``: is a raw ``(ptr, nbytes)`` mapped writable here? The provider does not
  check (tcp registers any number), and a peer's write into unmapped or read-only memory
  would crash this process.
- ``host_share``: is a region one shared, writable mapping of one memfd, and which fd of this
  process is open on that memfd? Then its descriptor carries a ``wire.HostShare`` and a shm
  peer maps the range itself and writes with memcpy (the direct write, src/direct.c and
  docs/architecture.md). Only shared mappings qualify: a peer's writes to the file never
  reach a private (copy-on-write) mapping's copied pages.

A maps line: ``lo-hi perms offset major:minor inode [path]``, numbers in hex but the inode;
a memfd's path is ``/memfd:NAME (deleted)`` (hugetlb memfds too).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional

from kvxfer import wire
from kvxfer.errors import InvalidArgumentError

__all__ = ["Span", "spans", "check_writable", "host_share", "refresh"]

MEMFD_PREFIX = "/memfd:"


class Span(NamedTuple):
    """One line of /proc/self/maps."""

    lo: int
    hi: int
    perms: str
    offset: int        # file offset of ``lo``
    dev: int           # the file's st_dev (0 for anonymous memory)
    inode: int
    path: str


def spans(ptr: int, nbytes: int) -> Optional[list[Span]]:
    """The mappings overlapping ``[ptr, ptr + nbytes)``, by address; None without procfs."""
    end = ptr + nbytes
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if hi > ptr and lo < end:
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    out.append(Span(lo, hi, parts[1], int(parts[2], 16), os.makedev(major, minor), int(parts[4]),
                                    parts[5].rstrip("\n") if len(parts) > 5 else ""))
    except OSError:
        return None
    return sorted(out)


def _covered(sp: list[Span], ptr: int, nbytes: int) -> int:
    """How far from ``ptr`` the spans cover the range without a hole (``ptr + nbytes`` if whole)."""
    at = ptr
    for s in sp:
        if s.lo > at:
            break
        at = max(at, s.hi)
        if at >= ptr + nbytes:
            break
    return at


def check_writable(ptr: int, nbytes: int) -> None:
    """Raise InvalidArgumentError unless ``[ptr, ptr + nbytes)`` is mapped writable here
    (nothing is checked where procfs cannot be read)."""
    sp = spans(ptr, nbytes)
    if sp is None:
        return
    at = _covered(sp, ptr, nbytes)
    for s in sp:
        if s.lo >= at:
            break
        if "w" not in s.perms[:2]:
            raise InvalidArgumentError(f"memory at {max(s.lo, ptr):#x} is not writable ({s.perms})")
    if at < ptr + nbytes:
        raise InvalidArgumentError(f"memory [{ptr:#x}, {ptr + nbytes:#x}) is not mapped in this process "
                                   f"(unmapped at {at:#x})")


def _open_fd(dev: int, inode: int) -> Optional[int]:
    """An fd of this process open on the file (dev, inode), or None."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in sorted(names, key=int):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:        # closed meanwhile, or the listing's own fd
            continue
        if st.st_dev == dev and st.st_ino == inode:
            return int(name)
    return None


def host_share(ptr: int, nbytes: int) -> Optional[wire.HostShare]:
    """The host share of ``[ptr, ptr + nbytes)``: one shared, writable mapping of one memfd
    (several maps lines of it are fine where its file offsets run on with the addresses),
    with an fd of this process open on it. None otherwise."""
    sp = spans(ptr, nbytes)
    if not sp or _covered(sp, ptr, nbytes) < ptr + nbytes:
        return None
    first = sp[0]
    for s in sp:
        if (not s.path.startswith(MEMFD_PREFIX) or s.perms[1] != "w" or s.perms[3] != "s"
                or (s.dev, s.inode) != (first.dev, first.inode) or s.offset - s.lo != first.offset - first.lo):
            return None
    fd = _open_fd(first.dev, first.inode)
    if fd is None:
        return None
    return wire.HostShare(os.getpid(), fd, first.dev, first.inode, first.offset + (ptr - first.lo))


def refresh(share: wire.HostShare) -> Optional[wire.HostShare]:
    """``share`` as it stands now: its fd may have been closed (a KVBuffer closed under its
    region keeps its mapping, not its fd) or reused; then another fd on the same memfd, or
    None. The peer checks the file again before it maps anything. Its ``permit`` is kept:
    the engine's permit table stays open as long as the engine."""
    fd = share.fd
    try:
        st = os.fstat(fd)
        same = (st.st_dev, st.st_ino) == (share.dev, share.inode)
    except OSError:
        same = False
    if not same:
        fd = _open_fd(share.dev, share.inode)
        if fd is None:
            return None
    return dataclasses.replace(share, pid=os.getpid(), fd=fd)      # the permit (engine's) stays
