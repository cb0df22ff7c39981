"""Passing ``SharedHandle``s between processes on one node.

The default road is SCM_RIGHTS over a Unix domain socket: no privileges, works in any
container, and the kernel installs a fresh fd in the receiver. The alternative,
``pidfd_getfd`` (``pack_handles`` / ``unpack_handles``), needs only the bytes of a header on
any channel (a pipe, a pickle, a key-value store) but needs ptrace rights over the exporter:
same uid and Yama ``ptrace_scope`` <= 1 with ancestry, or CAP_SYS_PTRACE; Docker's default
seccomp profile blocks ``pidfd_getfd`` unless the container has ``--cap-add SYS_PTRACE``.

Wire format (one message per batch of up to ``MAX_FDS_PER_MESSAGE`` handles)::

    prefix  <4s H H I I>  magic b"KVXH", version, flags (bit 0: more batches follow),
                          number of fds attached, length of the body
    body    UTF-8 JSON    {"handles": [SharedHandle.describe() + {"fd_index": i | -1}, ...]}

The fds ride as SCM_RIGHTS on the prefix; ``recv_handles`` takes them with
MSG_CMSG_CLOEXEC so a later fork+exec never inherits them.

Container capabilities
----------------------

| road | needs |
|---|---|
| SCM_RIGHTS (`send_handles`, default) | nothing privileged: a Unix socket both sides can reach (a path on a shared volume, e.g. a pod `emptyDir`; the abstract namespace needs a shared network namespace). |
| `pidfd_getfd` (`pack_handles` / `unpack_handles`: plain bytes over any channel) | kernel ≥ 5.6; the exporter's pid visible (shared PID namespace: `docker --pid=container:…`, k8s `shareProcessNamespace: true`); `PTRACE_MODE_ATTACH_REALCREDS` over the exporter: `CAP_SYS_PTRACE`, or same uid with Yama `ptrace_scope` 0 (1 only for an ancestor or after `PR_SET_PTRACER`); a seccomp profile allowing `pidfd_open`/`pidfd_getfd` (Docker's default allows `pidfd_getfd` only with `--cap-add SYS_PTRACE`). Failures raise `UnsupportedError` naming this. |
| CUDA FABRIC handle (`export(fabric=True)`) | no fd at all, 64 bytes travel anywhere; needs the IMEX daemon and `/dev/nvidia-caps-imex-channels/channelN` in the container, a driver with fabric support, and an importer in the same IMEX domain. |
| CUDA POSIX fd | both containers see the same GPU (`/dev/nvidia*` device nodes); the importer finds it by UUID. |
| huge pages | `vm.nr_hugepages` on the host (k8s: a `hugepages-2Mi` request); otherwise `UnsupportedError` with `HugePages_Free`. |
| registration (engine) | verbs/EFA pin pages: `RLIMIT_MEMLOCK` unlimited or `CAP_IPC_LOCK`; tcp and shm do not pin. |

Memory accounting: memfd pages are shmem, charged to the memory cgroup of the process that
first touches them (usually the TP worker), not limited by `/dev/shm`'s size.
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import os
import socket
import struct
from collections.abc import Iterable
from typing import Any, Optional

from kvxfer._check import as_int, is_int
from kvxfer._libc import libc
from kvxfer.buffers.handles import SharedHandle
from kvxfer.errors import ClosedError, DescriptorError, InvalidArgumentError, PeerError, UnsupportedError

__all__ = ["send_handles", "recv_handles", "pack_handles", "unpack_handles", "pidfd_getfd", "recv_exact",
           "MAX_FDS_PER_MESSAGE"]

MAGIC = b"KVXH"
VERSION = 1
_PREFIX = struct.Struct("<4sHHII")
_MORE = 1
MAX_FDS_PER_MESSAGE = 64  # well under the kernel's SCM_MAX_FD (253)
_MAX_BODY = 1 << 20
_PACK_MAGIC = b"KVXP"


def _open_handles(handles, verb: str):
    """Each handle, checked to be an open SharedHandle before anything is sent."""
    for h in handles:
        if not isinstance(h, SharedHandle):
            raise InvalidArgumentError(f"{verb}_handles takes SharedHandles, got {type(h).__name__}")
        if h.closed:
            raise ClosedError(f"cannot {verb} a closed SharedHandle")
        yield h


def _body(handles: list[SharedHandle]) -> tuple[bytes, list[int]]:
    fds: list[int] = []
    items = []
    for h in _open_handles(handles, "send"):
        d = h.describe()
        if h.fd >= 0:
            d["fd_index"] = len(fds)
            fds.append(h.fd)
        else:
            d["fd_index"] = -1
        items.append(d)
    return json.dumps({"handles": items}, separators=(",", ":")).encode(), fds


def send_handles(sock: socket.socket, handles: Iterable[SharedHandle]) -> None:
    """Send handles (descriptions plus fds via SCM_RIGHTS) over a connected Unix socket.

    The sender keeps ownership of its handles: the kernel gives the receiver new fds, so close
    yours once this returns. Any number of handles; they go in batches of MAX_FDS_PER_MESSAGE.
    """
    _check_unix(sock)
    handles = list(handles)
    batches = [handles[i : i + MAX_FDS_PER_MESSAGE] for i in range(0, len(handles), MAX_FDS_PER_MESSAGE)] or [[]]
    # every batch is checked and built before the first goes out: a bad handle in a later
    # batch must not leave the receiver holding a part, waiting for the rest
    messages = []
    for i, batch in enumerate(batches):
        body, fds = _body(batch)
        if len(body) > _MAX_BODY:
            raise InvalidArgumentError(f"handle batch header is {len(body)} bytes, over {_MAX_BODY}")
        flags = _MORE if i + 1 < len(batches) else 0
        messages.append((_PREFIX.pack(MAGIC, VERSION, flags, len(fds), len(body)) + body, fds))
    for msg, fds in messages:
        if fds:
            sent = socket.send_fds(sock, [msg], fds)
        else:
            sent = sock.send(msg)
        if sent < len(msg):
            sock.sendall(msg[sent:])


def _check_unix(sock: Any) -> None:
    if not isinstance(sock, socket.socket):
        raise InvalidArgumentError(f"handles travel over a Unix socket, got {type(sock).__name__}")
    if sock.family != socket.AF_UNIX:
        raise InvalidArgumentError("handles travel over AF_UNIX sockets only (SCM_RIGHTS)")


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv_exact(sock: socket.socket, n: int, into: Optional[bytearray] = None,
               what: str = "a handle message") -> bytearray:
    """Read stream socket ``sock`` until ``into`` (a new buffer if None) holds ``n`` bytes and
    return it; ``PeerError`` naming ``what`` if the peer closes first. The one exact read of
    kvxfer's Unix-socket protocols (handle messages here, the TP workers' publications)."""
    buf = bytearray() if into is None else into
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerError(f"socket closed in the middle of {what}")
        buf += chunk
    return buf


def _recv_message(sock: socket.socket) -> tuple[bytes, int, list[int]]:
    """One message: (body, flags, fds). Stream sockets read exactly; packet sockets whole."""
    stream = sock.type == socket.SOCK_STREAM
    bufsize = _PREFIX.size if stream else _PREFIX.size + _MAX_BODY
    anc = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4)
    data, ancdata, msg_flags, _ = sock.recvmsg(bufsize, anc, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    fds: list[int] = []
    for level, typ, cdata in ancdata:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - len(cdata) % a.itemsize])
            fds.extend(a)
    try:
        if not data:
            raise PeerError("socket closed before any handle arrived")
        if msg_flags & socket.MSG_CTRUNC:
            raise DescriptorError("fds were truncated in transit (MSG_CTRUNC): too many fds in one message")
        buf = bytearray(data)
        if stream:
            recv_exact(sock, _PREFIX.size, buf)
        elif len(buf) < _PREFIX.size:
            raise DescriptorError(f"handle message of {len(buf)} bytes is shorter than its prefix")
        magic, version, flags, nfds, blen = _PREFIX.unpack_from(buf)
        if magic != MAGIC:
            raise DescriptorError(f"not a kvxfer handle message (magic {bytes(magic)!r})")
        if version != VERSION:
            raise DescriptorError(f"handle message version {version}, this kvxfer speaks {VERSION}")
        if blen > _MAX_BODY:
            raise DescriptorError(f"handle message body of {blen} bytes is over the {_MAX_BODY} limit")
        if nfds != len(fds):
            raise DescriptorError(f"handle message announced {nfds} fds, {len(fds)} arrived")
        if stream:
            recv_exact(sock, _PREFIX.size + blen, buf)
        elif len(buf) != _PREFIX.size + blen:
            raise DescriptorError(f"handle message is {len(buf)} bytes, its prefix says {_PREFIX.size + blen}")
        return bytes(buf[_PREFIX.size :]), flags, fds
    except BaseException:
        _close_all(fds)
        raise


def _rebuild(body: bytes, fds: list[int]) -> list[SharedHandle]:
    """Handles from a body; takes ownership of fds (closes all of them on failure)."""
    out: list[SharedHandle] = []
    used: set[int] = set()
    try:
        doc = json.loads(body)
        items = doc["handles"]
        if not isinstance(items, list):
            raise TypeError("'handles' is not a list")
        for d in items:
            i = int(d.get("fd_index", -1))
            if i >= len(fds) or i in used:
                raise DescriptorError(f"handle refers to fd #{i} of {len(fds)}")
            fd = -1
            if i >= 0:
                used.add(i)
                fd = fds[i]
            try:
                out.append(SharedHandle.from_description(d, fd))
            except BaseException:
                used.discard(i)
                raise
        if len(used) != len(fds):
            raise DescriptorError(f"{len(fds) - len(used)} fd(s) arrived that no handle claims")
        return out
    except BaseException as e:
        for h in out:
            h.close()
        _close_all(fd for j, fd in enumerate(fds) if j not in used)
        if isinstance(e, DescriptorError):
            raise
        # RecursionError: JSON nested past the parser's depth; OverflowError: int(Infinity)
        if isinstance(e, (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError)):
            raise DescriptorError(f"malformed handle message: {type(e).__name__}: {e}") from e
        raise


def recv_handles(sock: socket.socket) -> list[SharedHandle]:
    """Receive what one ``send_handles`` call sent; the caller owns (and closes) the handles.

    Blocks per the socket's own timeout (``sock.settimeout``: the built-in TimeoutError).
    A malformed message raises ``DescriptorError`` and leaks no fd.
    """
    _check_unix(sock)
    out: list[SharedHandle] = []
    try:
        while True:
            body, flags, fds = _recv_message(sock)
            out.extend(_rebuild(body, fds))
            if not flags & _MORE:
                return out
    except BaseException:
        for h in out:
            h.close()
        raise


# --------------------------------------------------------------------------------------------
# The pidfd_getfd road: handles as plain bytes, fds fetched from the exporter by pid.

_SYS_pidfd_getfd = 438  # the same number on every Linux architecture (added in 5.6)
_MAX_C_INT = 2**31


def pidfd_getfd(pid: int, fd: int) -> int:
    """Duplicate fd ``fd`` of process ``pid`` into this process (O_CLOEXEC); caller owns it.

    Needs ptrace rights over ``pid`` (same uid and Yama ptrace_scope permitting, or
    CAP_SYS_PTRACE) and a seccomp profile that allows pidfd_open/pidfd_getfd; raises
    ``UnsupportedError`` naming what is missing.
    """
    # ctypes hands syscall() a Python int as a C int, masked: fd 2**32 + 3 would fetch fd 3
    pid = as_int(pid, "pid", minimum=1)
    fd = as_int(fd, "fd", minimum=0)
    if pid >= _MAX_C_INT or fd >= _MAX_C_INT:
        raise InvalidArgumentError(f"pid {pid} / fd {fd}: each must be below 2**31")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise PeerError(f"process {pid} is gone; its handles died with it unless imported") from e
        raise UnsupportedError(f"pidfd_open({pid}) failed: {e} (kernel >= 5.3, seccomp must allow it)") from e
    try:
        r = libc.syscall(_SYS_pidfd_getfd, pidfd, fd, 0)
        if r < 0:
            err = ctypes.get_errno()
            text = os.strerror(err)
            if err in (errno.EPERM, errno.ENOSYS):
                raise UnsupportedError(
                    f"pidfd_getfd(pid={pid}, fd={fd}): {text}; needs ptrace access to the exporter "
                    "(same uid and kernel.yama.ptrace_scope <= 1, or CAP_SYS_PTRACE; in Docker "
                    "--cap-add SYS_PTRACE) and kernel >= 5.6; use send_handles (SCM_RIGHTS) instead"
                )
            if err == errno.EBADF:  # the exporter closed that fd
                raise PeerError(f"pidfd_getfd(pid={pid}, fd={fd}): the exporter no longer has that fd open")
            raise PeerError(f"pidfd_getfd(pid={pid}, fd={fd}): {text} (errno {err})")
        return int(r)
    finally:
        os.close(pidfd)


def pack_handles(handles: Iterable[SharedHandle]) -> bytes:
    """Handles as bytes naming this pid and its fd numbers, for ``unpack_handles`` elsewhere.

    Nothing is duplicated here: keep the handles open until the importer has unpacked them.
    """
    items = []
    for h in _open_handles(handles, "pack"):
        d = h.describe()
        d["fd_number"] = h.fileno() if h.fd >= 0 else -1
        items.append(d)
    body = json.dumps({"pid": os.getpid(), "handles": items}, separators=(",", ":")).encode()
    return _PREFIX.pack(_PACK_MAGIC, VERSION, 0, 0, len(body)) + body


def unpack_handles(data: bytes) -> list[SharedHandle]:
    """Rebuild handles from ``pack_handles`` bytes, fetching each fd with ``pidfd_getfd``."""
    try:
        magic, version, _, _, blen = _PREFIX.unpack_from(data)
        doc: dict[str, Any] = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + blen]))
        pid = doc["pid"]
        items = list(doc["handles"])
        fds = [d.get("fd_number", -1) for d in items]
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        raise DescriptorError(f"malformed packed handles: {type(e).__name__}: {e}") from e
    if magic != _PACK_MAGIC or version != VERSION:
        raise DescriptorError(f"not packed kvxfer handles (magic {magic!r}, version {version})")
    # JSON gives any type: only plain ints (C ints: syscall() masks larger ones) name a
    # process and its fds
    if not is_int(pid) or not 0 < pid < _MAX_C_INT:
        raise DescriptorError(f"malformed packed handles: pid {pid!r}")
    if any(not is_int(n) or not -1 <= n < _MAX_C_INT for n in fds):
        raise DescriptorError(f"malformed packed handles: fd numbers {fds!r}")
    # every description is checked before any fd is fetched: built around the bare number,
    # which the probe never owns (detach, not close)
    for d, n in zip(items, fds):
        try:
            SharedHandle.from_description(d, n).detach()
        except InvalidArgumentError as e:
            raise DescriptorError(f"malformed packed handles: {e}") from e
    out: list[SharedHandle] = []
    try:
        for d, n in zip(items, fds):
            fd = pidfd_getfd(pid, n) if n >= 0 else -1
            try:
                out.append(SharedHandle.from_description(d, fd))
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        return out
    except BaseException:
        for h in out:
            h.close()
        raise
