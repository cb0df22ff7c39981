# cython: language_level=3, boundscheck=False, wraparound=False
"""Native handles over the native engine (include/kvxfer/kvxfer.h): one class per object.

This module is deliberately thin. Validation, keep-alive of Python objects and the public
names live in kvxfer.engine; here each class owns exactly one native handle and a
reference to its parent: ``Rail`` (``kx_rail``), ``RegionHandle`` (a ``fid_mr``),
``TransferHandle`` (``kx_transfer``), ``CounterHandle`` (``kx_counter``), ``DirectMap``
(``kx_direct``: the mapping behind a direct write).

One way to call native code: every call that returns a status goes through ``check()``,
which turns a negative errno into an exception in one place (``error_from``); the failure
path alone takes the GIL. The GIL: every native call that takes the engine's lock, enters
libfabric or may block runs without it. Calls that only read a snapshot of native fields
(``kx_*_get_state``, ``kx_rail_get_info``/``get_stats``, the versions) hold it: they are
a few atomic loads. Waits block in GIL-free slices of at most 50 ms and check for signals
between slices, so Ctrl-C is answered.

This file holds what every handle shares (constants, ``error_from``/``check``, the sliced
wait); each family of handles is one include: ``_fabric_rail.pxi``, ``_fabric_direct.pxi``
(``DirectMap``, ``PermitTable``), ``_fabric_region.pxi``, ``_fabric_transfer.pxi`` (transfers,
counters, the message-rule helpers) and ``_fabric_watcher.pxi``.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.string cimport memset, strcpy
from libc.stdlib cimport malloc, calloc, free
from libc.errno cimport ERANGE
from kvxfer._core cimport *

import errno as _errno
import os as _os
import time as _time
import weakref as _weakref

cimport cython

from kvxfer.errors import ClosedError, FabricError, InvalidArgumentError, PeerError

cdef int64_t SLICE_NS = 50_000_000   # waits block in 50 ms slices so Ctrl-C is answered

HMEM_SYSTEM = FI_HMEM_SYSTEM
HMEM_CUDA = FI_HMEM_CUDA
MR_LOCAL = FI_MR_LOCAL
MR_VIRT_ADDR = FI_MR_VIRT_ADDR
MR_ALLOCATED = FI_MR_ALLOCATED
MR_PROV_KEY = FI_MR_PROV_KEY
MR_ENDPOINT = FI_MR_ENDPOINT
MR_RAW = FI_MR_RAW
CAP_RMA_EVENT = FI_RMA_EVENT
CAP_HMEM = FI_HMEM
MSG_MAX = KX_MSG_MAX
CTL_HELLO = KX_CTL_HELLO
CTL_REVOKE = KX_CTL_REVOKE
CTL_BYE = KX_CTL_BYE
MAX_IOV = KX_MAX_IOV
HAVE_DMABUF = bool(kx_have_dmabuf())


def _version(uint32_t v):
    return (v >> 16, v & 0xFFFF)


RUNTIME_VERSION = _version(kx_runtime_version())
BUILD_VERSION = _version(kx_build_version())

#: errnos that mean the peer is gone or unreachable (a transfer's error becomes PeerError)
PEER_ERRNOS = frozenset({
    _errno.ECONNREFUSED, _errno.ECONNRESET, _errno.ECONNABORTED, _errno.EPIPE, _errno.ENOTCONN,
    _errno.EHOSTUNREACH, _errno.EHOSTDOWN, _errno.ENETUNREACH, _errno.ETIMEDOUT, _errno.EIO,
})


def error_from(str call, int err):
    """The exception for native call `call` failing with errno `err` (either sign): the one
    place where errno values become kvxfer exception classes."""
    err = -err if err < 0 else err
    text = fi_strerror(err).decode("utf-8", "replace")
    if call in ("fi_writemsg", "fi_readmsg"):    # a transfer's completion error
        if err == _errno.ECANCELED:
            return PeerError(err, "transfer failed: the peer connection was lost or the engine closed "
                                  "(operation canceled)")
        if err in PEER_ERRNOS:
            return PeerError(err, f"transfer failed: {_os.strerror(err)}")
    elif call == "fi_send" and err in PEER_ERRNOS:   # the peer is known dead (src/peers.c)
        return PeerError(err, f"control message not sent: the peer is gone ({_os.strerror(err)})")
    elif call == "fi_av_insert" and err == _errno.ECONNREFUSED:    # src/rail.c: kx_av_insert
        return PeerError(err, "peer not connected: that engine of this process has closed")
    elif call == "kx_expect" and err == _errno.EBUSY:
        return InvalidArgumentError("this imm already has an unfinished expectation")
    elif call == "kx_arm_open" and err in (_errno.EBUSY, _errno.EINVAL):
        return InvalidArgumentError("this imm already has an open arm" if err == _errno.EBUSY else
                                    "an arm's least count is above its most")
    elif err == _errno.ECANCELED:
        return ClosedError(f"{call}: the engine is closing")
    return FabricError(call, err, text)


cdef int check(int ret, const char *call) except -1 nogil:
    """Every native status passes here: 0 (or a count) goes on; a negative errno raises
    ``error_from(call, ret)``, taking the GIL only on that path."""
    if ret >= 0:
        return ret
    with gil:
        raise error_from(call.decode(), ret)


cdef inline bint _deadline_passed(deadline) except -1:
    """Between wait slices: answer signals, and tell whether the deadline has passed."""
    PyErr_CheckSignals()
    return deadline is not None and _time.monotonic() >= deadline


cdef inline int64_t _slice_ns(deadline):
    """The next native wait: a full slice, or what is left before the deadline."""
    if deadline is None:
        return SLICE_NS
    return min(SLICE_NS, max(0, <int64_t>((deadline - _time.monotonic()) * 1e9)))


cdef enum WaitKind:
    WAIT_TRANSFER
    WAIT_COUNTER
    WAIT_ARM


cdef bint _wait(kx_rail *r, WaitKind kind, void *obj, timeout) except -1:
    """Block in GIL-free slices until a transfer or counter is done (an arm settled), or
    `timeout` passes."""
    cdef int done = 0
    cdef int64_t slice_ns
    deadline = None if timeout is None else _time.monotonic() + timeout
    while True:
        slice_ns = _slice_ns(deadline)
        with nogil:
            if kind == WAIT_TRANSFER:
                done = kx_transfer_wait(r, <kx_transfer *>obj, slice_ns)
            elif kind == WAIT_ARM:
                done = kx_arm_wait(r, <kx_arm *>obj, slice_ns)
            else:
                done = kx_counter_wait(r, <kx_counter *>obj, slice_ns)
        if done:
            return True
        if _deadline_passed(deadline):
            return False


# One include per family of handles, in dependency order.
include "_fabric_rail.pxi"
include "_fabric_direct.pxi"
include "_fabric_region.pxi"
include "_fabric_transfer.pxi"
include "_fabric_watcher.pxi"
include "_fabric_read.pxi"
