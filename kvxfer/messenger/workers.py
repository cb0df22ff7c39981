"""TP worker processes hand their KV buffers to the node's messenger process.

A node's TP ranks are separate processes, but it runs one messenger. Each worker calls
``publish(path, rank, buffers)``; the messenger process calls ``collect(path, ranks)`` and
gets every rank's buffers as imported ``KVBuffer``s (same physical memory), ready to pass
as ``Messenger(..., kv=collect(...))``. Handles travel over ``kvxfer.share`` (SCM_RIGHTS on
a Unix socket at ``path``); a worker may close its own buffer afterwards, the memory lives on.

Per worker connection::

    worker -> messenger   b"KXWP" | u16 version (1) | u16 0 | u32 rank | u32 buffers
                          then share.send_handles(buffers' handles)
    messenger -> worker   b"\\x01" once imported (publish returns then)
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, PeerError, TimeoutError

__all__ = ["publish", "collect"]

_HEAD = struct.Struct("<4sHHII")
_MAGIC = b"KXWP"
_VERSION = 1


def publish(path: str, rank: int, buffers: Sequence[Any], *, timeout: float = 60.0) -> None:
    """From TP worker ``rank``: send ``buffers`` (``KVBuffer``s, in the layout's region
    order) to the messenger process collecting at ``path``; returns once it imported them.
    Waits up to ``timeout`` s for the collector to appear."""
    from kvxfer.buffers import KVBuffer
    from kvxfer.share import send_handles

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidArgumentError(f"rank must be a non-negative int, got {rank!r}")
    buffers = list(buffers)
    if not buffers or not all(isinstance(b, KVBuffer) for b in buffers):
        raise InvalidArgumentError("publish takes a non-empty list of KVBuffers")
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no messenger collecting at {path} within {timeout} s") from None
                time.sleep(0.02)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        handles = [b.export() for b in buffers]
        try:
            sock.sendall(_HEAD.pack(_MAGIC, _VERSION, 0, rank, len(handles)))
            send_handles(sock, handles)
        finally:
            for h in handles:
                h.close()
        try:
            ack = sock.recv(1)
        except socket.timeout:
            raise TimeoutError(f"the messenger at {path} did not confirm within {timeout} s") from None
        if ack != b"\x01":
            raise PeerError(f"the messenger at {path} refused rank {rank}'s buffers")
    finally:
        sock.close()


def collect(path: str, ranks: Iterable[int], *, timeout: float = 60.0,
            check: Optional[Callable[[], None]] = None) -> dict[int, list[Any]]:
    """In the messenger process: accept one ``publish`` per rank in ``ranks`` at ``path``
    and return ``{rank: [KVBuffer, ...]}`` (imported; the caller closes them after the
    messenger). Raises ``TimeoutError`` if a rank does not publish within ``timeout`` s.
    ``check``: called about every 50 ms while waiting (e.g. "is every worker still alive?");
    whatever it raises ends the collection at once, the buffers imported so far closed."""
    from kvxfer.buffers import KVBuffer
    from kvxfer.share import recv_exact, recv_handles

    want = sorted(set(int(r) for r in ranks))
    if not want:
        raise InvalidArgumentError("collect needs at least one rank")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out: dict[int, list[Any]] = {}
    refused: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        srv.bind(path)
        srv.listen(len(want))
        while len(out) < len(want):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in want if r not in out]
                why = f" (refused meanwhile: {'; '.join(refused[-3:])})" if refused else ""
                raise TimeoutError(f"ranks {missing} did not publish at {path} within {timeout} s{why}")
            srv.settimeout(min(left, 0.05) if check is not None else left)
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                if check is not None:
                    check()
                continue
            # one bad connection (a probe, a worker killed mid-publish, a rank sent twice) is
            # refused on its own; the ranks that publish properly are still collected
            with conn:
                try:
                    rank, bufs = _take(conn, want, out, deadline, KVBuffer, recv_handles, recv_exact)
                except (KvxferError, OSError) as exc:
                    refused.append(str(exc))
                    try:
                        conn.sendall(b"\x00")
                    except OSError:
                        pass
                    continue
                out[rank] = bufs
                try:
                    conn.sendall(b"\x01")
                except OSError:       # it hung up after sending: its buffers are here all the same
                    pass
    except BaseException:
        for bufs in out.values():
            for b in bufs:
                b.close()
        raise
    finally:
        srv.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return out


def _take(conn: socket.socket, want: list, out: dict, deadline: float, KVBuffer: Any, recv_handles: Any,
          recv_exact: Any):
    """One publication: (rank, imported buffers), or a kvxfer error (nothing kept)."""
    conn.settimeout(max(0.1, deadline - time.monotonic()))
    magic, ver, _flags, rank, n = _HEAD.unpack(bytes(recv_exact(conn, _HEAD.size, what="a worker's publication")))
    if magic != _MAGIC or ver != _VERSION:
        raise DescriptorError("not a kvxfer worker publication")
    handles = recv_handles(conn)
    try:
        if rank not in want or rank in out:
            raise InvalidArgumentError(f"rank {rank} is not expected here or published twice")
        if len(handles) != n:
            raise DescriptorError(f"rank {rank} announced {n} buffers and sent {len(handles)}")
        bufs: list = []
        try:
            for h in handles:
                bufs.append(KVBuffer.import_(h))
        except BaseException:
            for b in bufs:
                b.close()
            raise
        return rank, bufs
    finally:
        for h in handles:
            h.close()
