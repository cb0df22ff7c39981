"""Review of KV buffers and handle passing (2026-12-01): each test failed before its fix.

No libfabric needed; the unit conftest hides the engine.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading

import pytest

import kvxfer.buffers.kvbuffer as kvbuffer_module
from kvxfer import KVBuffer, SharedHandle
from kvxfer.errors import (
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    KvxferError,
    OutOfBoundsError,
    UnsupportedError,
)
from kvxfer.share import MAX_FDS_PER_MESSAGE, pack_handles, pidfd_getfd, send_handles, unpack_handles


def _packed(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHII", b"KVXP", 1, 0, 0, len(raw)) + raw


def _target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


# ---- the pidfd_getfd road: numbers are C ints ----------------------------------------------


def test_unpack_handles_never_fetches_a_truncated_fd_number(no_leaks):
    """ctypes passes a Python int to syscall() as a C int, masked: fd number 2**32 + 3
    fetched the exporter's fd 3, another file than the one the handle described."""
    with KVBuffer.allocate(4096, name="kvt-victim") as victim, KVBuffer.allocate(8192, name="kvt-mine") as mine, \
            mine.export() as h:
        body = json.loads(pack_handles([h])[16:])
        body["handles"][0]["fd_number"] = 2**32 + victim.fileno()
        try:
            got = unpack_handles(_packed(body))
        except DescriptorError:
            got = []
        except UnsupportedError as e:
            pytest.skip(f"pidfd_getfd not permitted here: {e}")
        names = [_target(g.fd) for g in got]
        for g in got:
            g.close()
        assert not got, f"fetched {names} for a handle of /memfd:kvt-mine"
        with pytest.raises(InvalidArgumentError):
            pidfd_getfd(os.getpid(), 2**32 + victim.fileno())


@pytest.mark.parametrize("body", [
    {"pid": 2**40, "handles": [{"fd_number": 3}]},                   # OverflowError in pidfd_open
    {"pid": 2**31, "handles": [{"fd_number": 3}]},
    {"pid": "self", "handles": [{"fd_number": 2**31}]},              # an fd past any C int
])
def test_unpack_handles_refuses_numbers_past_c_ints(no_leaks, body):
    if body["pid"] == "self":
        body = {**body, "pid": os.getpid()}
    with pytest.raises(DescriptorError):
        unpack_handles(_packed(body))


def test_unpack_handles_refuses_incomplete_descriptions_without_leaking(no_leaks):
    """A description missing its fields was found out only after its fd was fetched, and
    let KeyError (not a kvxfer error) out."""
    with KVBuffer.allocate(4096) as buf, buf.export() as h:
        body = {"pid": os.getpid(), "handles": [{"fd_number": h.fd, "kind": "host"}]}
        with pytest.raises(DescriptorError):
            unpack_handles(_packed(body))
    for d in ({}, {"kind": "host"}, {"kind": "host", "nbytes": "x", "alloc_nbytes": 1, "device": "cpu"}, []):
        with pytest.raises(KvxferError):
            SharedHandle.from_description(d, -1)       # type: ignore[arg-type]


# ---- send_handles: all or nothing ---------------------------------------------------------


def test_send_handles_sends_nothing_when_a_later_batch_is_bad(no_leaks):
    """Handles were checked batch by batch: a closed handle (or a non-handle) past the first
    64 raised only after the first batch had gone, flagged 'more follow', so the receiver
    got a partial set and then read the next message as the rest of it."""
    a, b = socket.socketpair()
    with a, b, KVBuffer.allocate(4096) as buf:
        handles = [buf.export() for _ in range(MAX_FDS_PER_MESSAGE + 2)]
        try:
            handles[-1].close()
            with pytest.raises(ClosedError):
                send_handles(a, handles)
            with pytest.raises(InvalidArgumentError):
                send_handles(a, handles[:-1] + [object()])     # type: ignore[list-item]
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)                                       # nothing went out
        finally:
            for h in handles:
                h.close()
    for bad in (None, 5, "sock"):
        with pytest.raises(InvalidArgumentError):
            send_handles(bad, [])                               # type: ignore[arg-type]


# ---- KVBuffer arguments -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(nbytes=2**63),
    dict(nbytes=2**64),
    dict(nbytes=2**63 - 1),
    dict(nbytes=4096, name="a\0b"),
    dict(nbytes=4096, name=5),
    dict(nbytes=4096, name="x" * 300),
    dict(nbytes=4096, name="\ud800"),
])
def test_allocate_refuses_bad_sizes_and_names(no_leaks, kwargs):
    """OverflowError, ValueError, TypeError and UnicodeEncodeError came out of os calls."""
    with pytest.raises(InvalidArgumentError):
        KVBuffer.allocate(**kwargs)


def test_a_bad_name_is_not_reported_as_missing_huge_pages(no_leaks):
    """memfd_create's EINVAL for a name over 249 bytes read as 'this kernel has no hugetlb memfd'."""
    with pytest.raises(InvalidArgumentError, match="name"):
        KVBuffer.allocate(4096, huge_pages=True, name="x" * 300)


def test_import_of_a_handle_whose_fd_is_not_open(no_leaks):
    """os.dup's EBADF came out as a plain OSError."""
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    h = SharedHandle(kind="host", nbytes=4096, alloc_nbytes=4096, device="cpu", fd=r)
    try:
        with pytest.raises(KvxferError):
            KVBuffer.import_(h)
    finally:
        h.detach()


def test_a_view_past_the_end_is_out_of_bounds(no_leaks):
    """numpy(offset=past the end) said '-904 bytes ... are not a whole number of uint8 items'."""
    with KVBuffer.allocate(4096) as buf:
        with pytest.raises(OutOfBoundsError):
            buf.numpy(offset=5000)


# ---- close while in use -------------------------------------------------------------------


def test_export_racing_close_never_hands_out_another_file(no_leaks, monkeypatch):
    """export() read the fd, then dup'ed it outside the buffer's lock: a close() in between
    closed it, and the number (reused by the next open of any thread) was exported as the
    buffer. export() now either hands out the memfd or raises ClosedError."""
    real_dup = os.dup
    buf = KVBuffer.allocate(4096, name="kvt-race")
    taken: list[int] = []
    closers: list[threading.Thread] = []

    def racing_dup(fd: int) -> int:
        monkeypatch.setattr(kvbuffer_module.os, "dup", real_dup)
        closer = threading.Thread(target=buf.close)
        closers.append(closer)
        closer.start()
        closer.join(0.5)                   # before the fix close() ran to its end here
        taken.extend(os.pipe())            # another thread opens files meanwhile
        return real_dup(fd)

    monkeypatch.setattr(kvbuffer_module.os, "dup", racing_dup)
    h = None
    try:
        try:
            h = buf.export()
        except ClosedError:
            pass
        except OSError as e:
            assert e.errno != errno.EBADF, "export() let EBADF out instead of ClosedError"
            raise
        finally:
            for c in closers:
                c.join(5)
        if h is not None:
            assert _target(h.fd).startswith("/memfd:kvt-race"), _target(h.fd)
        assert buf.closed
    finally:
        if h is not None:
            h.close()
        for fd in taken:
            os.close(fd)
        buf.close()


@pytest.mark.parametrize("fields", [
    dict(granularity=0),                 # reached cuMemAddressReserve as the alignment
    dict(granularity=-4096),             # OverflowError in the driver binding
    dict(granularity=3 * 4096),
    dict(granularity=1 << 21),           # alloc_nbytes 8192 is no multiple of it
    dict(nbytes="8192"),                 # TypeError comparing a str
    dict(fd=1.5),
])
def test_a_handle_with_an_impossible_layout_is_refused(fields):
    """A description from another process fixed alloc_nbytes, nbytes and granularity with no
    check beyond nbytes <= alloc_nbytes; a CUDA import maps with that granularity."""
    d = dict(kind="host", nbytes=8192, alloc_nbytes=8192, device="cpu", fd=-1, fabric=b"x")
    d.update(fields)
    with pytest.raises(InvalidArgumentError):
        SharedHandle(**d)                                      # type: ignore[arg-type]
