# cython: language_level=3, boundscheck=False, wraparound=False
"""Native handles over the native engine (include/kvxfer/kvxfer.h): one class per object.

This module is deliberately thin. Validation, keep-alive of Python objects and the public
names live in kvxfer.engine; here each class owns exactly one native handle and a
reference to its parent: ``Rail`` (``kx_rail``), ``RegionHandle`` (a ``fid_mr``),
``TransferHandle`` (``kx_transfer``), ``CounterHandle`` (``kx_counter``).

One way to call native code: every call that returns a status goes through ``check()``,
which turns a negative errno into an exception in one place (``error_from``); the failure
path alone takes the GIL. The GIL: every native call that takes the engine's lock, enters
libfabric or may block runs without it. Calls that only read a snapshot of native fields
(``kx_*_get_state``, ``kx_rail_get_info``/``get_stats``, the versions) hold it: they are
a few atomic loads. Waits block in GIL-free slices of at most 50 ms and check for signals
between slices, so Ctrl-C is answered.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.string cimport strcpy
from kvxfer._core cimport *

import errno as _errno
import os as _os
import time as _time

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
    if call == "fi_writemsg":                    # a transfer's completion error
        if err == _errno.ECANCELED:
            return PeerError(err, "transfer failed: the peer connection was lost or the engine closed "
                                  "(operation canceled)")
        if err in PEER_ERRNOS:
            return PeerError(err, f"transfer failed: {_os.strerror(err)}")
    elif call == "kx_expect" and err == _errno.EBUSY:
        return InvalidArgumentError("this imm already has an unfinished expectation")
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


cdef bint _wait(kx_rail *r, WaitKind kind, void *obj, timeout) except -1:
    """Block in GIL-free slices until a transfer or counter is done, or `timeout` passes."""
    cdef int done = 0
    cdef int64_t slice_ns
    deadline = None if timeout is None else _time.monotonic() + timeout
    while True:
        slice_ns = _slice_ns(deadline)
        with nogil:
            if kind == WAIT_TRANSFER:
                done = kx_transfer_wait(r, <kx_transfer *>obj, slice_ns)
            else:
                done = kx_counter_wait(r, <kx_counter *>obj, slice_ns)
        if done:
            return True
        if _deadline_passed(deadline):
            return False


cdef class Rail:
    """One rail: a libfabric RDM endpoint with its fabric, domain, CQ, AV and progress thread.
    The rails of one engine share a hub (the counter table, queues and lock): pass the first
    rail as `join` to open the others."""

    cdef kx_rail *r
    cdef readonly bint closed           # the endpoint is closed
    cdef readonly bint domain_closed    # ... and the domain (registrations are gone)
    cdef readonly bint started
    cdef readonly object join
    cdef list pending       # TransferHandles not yet done: each keeps its source region (and buffer) alive
    cdef Py_ssize_t pruned  # len(pending) after the last prune (amortises pruning)
    cdef readonly str provider, fabric_name, domain_name
    cdef readonly uint64_t mr_mode, caps
    cdef readonly size_t iov_limit, max_msg_size, inject_size, cq_data_size
    cdef readonly bint has_wait, need_ctx
    cdef readonly bint addr_is_str     # endpoint names are NUL-terminated strings (FI_ADDR_STR)

    def __cinit__(self, provider, node, bint hmem=False, bint spin=False, domain=None, Rail join=None):
        cdef char errcall[64]
        cdef bytes p = provider.encode() if provider else None
        cdef bytes n = node.encode() if node else None
        cdef bytes d = domain.encode() if domain else None
        cdef const char *prov = NULL
        cdef const char *bind = NULL
        cdef const char *dom = NULL
        cdef kx_rail *first = NULL
        cdef kx_rail_info info
        cdef int ret
        if p is not None:
            prov = p
        if n is not None:
            bind = n
        if d is not None:
            dom = d
        if join is not None:
            first = join._rail()
            self.join = join      # the hub is shared: keep the first rail alive as long as this one
        self.r = NULL
        self.closed = True
        self.pending = []
        strcpy(errcall, "kx_rail_open")        # the open names the failing call instead
        with nogil:
            ret = kx_rail_open(prov, bind, dom, hmem, spin, first, &self.r, errcall, sizeof(errcall))
            check(ret, errcall)
        self.closed = False
        kx_rail_get_info(self.r, &info)
        self.provider = info.provider.decode()
        self.fabric_name = info.fabric.decode()
        self.domain_name = info.domain.decode()
        self.mr_mode = info.mr_mode
        self.caps = info.caps
        self.iov_limit = info.iov_limit
        self.max_msg_size = info.max_msg_size
        self.inject_size = info.inject_size
        self.cq_data_size = info.cq_data_size
        self.has_wait = info.has_wait
        self.need_ctx = info.need_ctx
        self.addr_is_str = info.addr_is_str

    def __dealloc__(self):
        if self.r != NULL:
            with nogil:
                kx_rail_free(self.r)
            self.r = NULL

    cdef inline kx_rail *_rail(self) except NULL:
        if self.closed:
            raise ClosedError("engine is closed")
        return self.r

    def start(self, cpus=()):
        """Start the progress thread, pinned to `cpus` when given."""
        cdef int buf[1024]
        cdef int n = 0
        cdef kx_rail *r = self._rail()
        for c in cpus:
            if n >= 1024:
                break
            buf[n] = int(c)
            n += 1
        with nogil:
            check(kx_rail_start(r, buf, n), "pthread_create")
        self.started = True

    # -- closing, in this order (see kvxfer.h) ----------------------------------------------
    def drain(self, double timeout=1.0):
        """Cancel queued writes and wait up to `timeout` s for posted ones to complete."""
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        if self.r != NULL and not self.closed:
            with nogil:
                kx_rail_drain(self.r, ns)

    def quiesce(self):
        """Refuse new native calls, wait for those inside, join the progress thread."""
        if self.r != NULL and not self.closed:
            with nogil:
                kx_rail_quiesce(self.r)

    def close_endpoint(self):
        """Quiesce, then close the endpoint, AV and CQ; pending work fails with ECANCELED.
        The domain stays open so registrations can still be closed."""
        if self.closed:
            return
        self.closed = True
        with nogil:
            kx_rail_close_endpoint(self.r)
        if kx_rail_leaked(self.r):
            # a thread is stuck inside libfabric: touch nothing of the domain any more
            self.domain_closed = True
        self.prune()

    def close(self):
        """Close everything; registrations still open on the domain are closed by libfabric."""
        self.close_endpoint()
        if not self.domain_closed:
            self.domain_closed = True
            with nogil:
                kx_rail_close_domain(self.r)

    # -- facts -----------------------------------------------------------------------------
    @property
    def thread_id(self):
        """The progress thread's kernel thread id (0 until it has started running)."""
        return kx_rail_thread_id(self._rail())

    def stats(self):
        cdef kx_rail_stats s
        kx_rail_get_stats(self._rail(), &s)
        return {"writes_posted": s.writes_posted, "errors": s.errors, "outstanding": s.outstanding}

    # -- addresses -------------------------------------------------------------------------
    def getname(self):
        cdef char buf[256]
        cdef size_t n = sizeof(buf)
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_getname(r, buf, &n), "fi_getname")
        return PyBytes_FromStringAndSize(buf, n)

    def av_insert(self, const uint8_t[::1] addr):
        cdef fi_addr_t a = 0
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_av_insert(r, &addr[0], &a), "fi_av_insert")
        return a

    def av_remove(self, fi_addr_t addr):
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_av_remove(r, addr), "fi_av_remove")

    def map_raw(self, uint64_t base, const uint8_t[::1] raw):
        cdef uint64_t key = 0
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_map_raw(r, base, <uint8_t *>&raw[0], raw.shape[0], &key), "fi_mr_map_raw")
        return key

    def unmap_key(self, uint64_t key):
        """Unmap a peer's raw key (closing: between close_endpoint and close_domain)."""
        if not self.domain_closed:
            with nogil:
                check(kx_unmap_key(self.r, key), "fi_mr_unmap_key")

    # -- peers -----------------------------------------------------------------------------
    def cancel_peer(self, fi_addr_t addr):
        """Cancel every unfinished transfer to `addr` on this rail; returns how many."""
        cdef kx_rail *r = self._rail()
        cdef int n
        with nogil:
            n = kx_peer_cancel(r, addr)
        return n

    def wait_peer_idle(self, fi_addr_t addr, timeout):
        """Wait (at most `timeout` s) until no transfer to `addr` is in flight on this rail.
        Returns (transfers still in flight, of which still posting)."""
        cdef kx_rail *r = self._rail()
        cdef int n = 0, posting = 0
        cdef int64_t slice_ns
        deadline = _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                n = kx_peer_wait(r, addr, slice_ns, &posting)
            if n == 0 or _deadline_passed(deadline):
                return n, posting

    # -- registration ----------------------------------------------------------------------
    def mr_reg(self, uintptr_t ptr, size_t nbytes, int iface=FI_HMEM_SYSTEM, int device=0, int dmabuf_fd=-1,
               bint remote=True):
        return RegionHandle(self, ptr, nbytes, iface, device, dmabuf_fd, remote)

    # -- writes ----------------------------------------------------------------------------
    def write(self, fi_addr_t peer, uintptr_t src_base, RegionHandle region, uint64_t dst_base, uint64_t key,
              const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
              imm, size_t iov, uint64_t max_write, uint64_t pack_min):
        """Post every message of the triples (the message rule: src/post.c) without the GIL."""
        cdef size_t n = length.shape[0]
        if n == 0:
            return self._post(peer, src_base, region, dst_base, key, NULL, NULL, NULL, 0,
                              imm, iov, max_write, pack_min)
        return self._post(peer, src_base, region, dst_base, key, &src_off[0], &dst_off[0], &length[0], n,
                          imm, iov, max_write, pack_min)

    def write_one(self, fi_addr_t peer, uintptr_t src_base, RegionHandle region, uint64_t dst_base, uint64_t key,
                  uint64_t src_off, uint64_t dst_off, uint64_t length, imm, size_t iov, uint64_t max_write,
                  uint64_t pack_min):
        """`write` of one triple, without arrays: the small-write path (a control write, a
        layer's last write) pays no numpy."""
        return self._post(peer, src_base, region, dst_base, key, &src_off, &dst_off, &length, 1,
                          imm, iov, max_write, pack_min)

    cdef object _post(self, fi_addr_t peer, uintptr_t src_base, RegionHandle region, uint64_t dst_base,
                              uint64_t key, const uint64_t *so, const uint64_t *do_, const uint64_t *ln, size_t n,
                              imm, size_t iov, uint64_t max_write, uint64_t pack_min):
        cdef kx_rail *r = self._rail()
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef kx_transfer *x = NULL
        cdef int ret
        if region.rail is not self or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        region.busy += 1          # RegionHandle.close refuses while a post is under way
        with nogil:
            ret = kx_write(r, peer, <char *>src_base, region.desc, dst_base, key, so, do_, ln, n,
                           has_imm, imm_value, iov, max_write, pack_min, &x)
        if ret:
            region.busy -= 1
            check(ret, "kx_write")
        # recorded before any Python code can run (a signal handler raising right after the
        # native call must not free what the progress thread still reads)
        cdef TransferHandle t = TransferHandle.__new__(TransferHandle)
        t.rail = self
        t.x = x
        t.region = region
        if not t.done:
            self.pending.append(t)
        region.busy -= 1
        if len(self.pending) > max(64, 2 * self.pruned):
            self.prune()
        return t

    def prune(self):
        """Forget finished transfers (and so release their registrations' buffers)."""
        self.pending = [t for t in self.pending if not (<TransferHandle>t).done]
        self.pruned = len(self.pending)

    def close_if_idle(self, list regions):
        """Close these registrations (one per rail) unless a transfer from any of them is
        being posted or in flight; all checks and closes without Python code in between, so
        no other thread can start a post from them meanwhile. Returns whether it closed."""
        cdef RegionHandle m
        for m in regions:
            if m.rail.busy_with(m):
                return False
        for m in regions:            # the fids first: releasing buffers may run Python code
            m.close_fid()
        for m in regions:
            m.keep = None
        return True

    def busy_with(self, RegionHandle region):
        """Whether a transfer from `region` is being posted or still in flight on this rail."""
        if region.busy:
            return True
        for t in self.pending:
            if (<TransferHandle>t).region is region and not (<TransferHandle>t).done:
                return True
        return False

    # -- counters --------------------------------------------------------------------------
    def expect(self, uint32_t imm, uint64_t count, bint callback=False):
        cdef kx_counter *c = NULL
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_expect(r, imm, count, callback, &c), "kx_expect")
        cdef CounterHandle h = CounterHandle.__new__(CounterHandle)
        h.rail = self
        h.c = c
        return h

    def banked(self, uint32_t imm):
        cdef kx_rail *r = self._rail()
        cdef uint64_t n
        with nogil:
            n = kx_banked(r, imm)
        return n

    def discard(self, uint32_t imm):
        """Retire `imm` (src/counters.c): returns (arrivals dropped, address of the withdrawn
        expectation or 0)."""
        cdef kx_counter *c = NULL
        cdef kx_rail *r = self._rail()
        cdef uint64_t n
        with nogil:
            n = kx_discard(r, imm, &c)
        return n, <uintptr_t>c

    def next_done(self, timeout):
        """For the callback dispatcher: the address of the next finished counter that wants a
        callback, None after `timeout` seconds, or -1 once the engine is closing."""
        cdef kx_counter *c = NULL
        cdef int ret
        cdef int64_t slice_ns = <int64_t>(timeout * 1e9)
        if self.r == NULL:
            return -1
        with nogil:
            ret = kx_next_done(self.r, slice_ns, &c)
            if ret == 1:
                kx_counter_release(self.r, c)   # the owner still holds its reference
        if ret == 1:
            return <uintptr_t>c
        return -1 if ret < 0 else None

    def dispatch_stop(self):
        if self.r != NULL:
            with nogil:
                kx_dispatch_stop(self.r)

    # -- control messages ------------------------------------------------------------------
    def send(self, fi_addr_t peer, const uint8_t[::1] data, timeout=None):
        """Post one message; while the provider's queue stays full, retry in 50 ms native
        slices until `timeout` (seconds, None: forever), answering signals in between."""
        cdef kx_rail *r = self._rail()
        cdef size_t n = data.shape[0]
        cdef const char *p = <const char *>"\0"
        if n:
            p = <const char *>&data[0]
        cdef int ret
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            with nogil:
                ret = kx_send(r, peer, p, n)
            if ret != -FI_EAGAIN:
                break
            if _deadline_passed(deadline):
                return False
            r = self._rail()
        check(ret, "fi_send")
        return True

    def recv(self, timeout):
        """The next control message, or None when `timeout` (seconds, None: forever) passes."""
        cdef kx_rail *r = self._rail()
        cdef kx_msg *m = NULL
        cdef int64_t slice_ns
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                kx_recv_wait(r, slice_ns, &m)
            if m != NULL:
                try:
                    return PyBytes_FromStringAndSize(kx_msg_data(m), kx_msg_len(m))
                finally:
                    kx_msg_free(m)
            if self.closed:
                raise ClosedError("engine is closed")
            if _deadline_passed(deadline):
                return None


@cython.no_gc_clear  # __dealloc__ needs its Rail (GC clears Rail.pending first, so it outlives them)
cdef class RegionHandle:
    """One registered memory region (fid_mr) on a Rail."""

    cdef readonly Rail rail
    cdef fid_mr *mr
    cdef void *desc
    cdef readonly uint64_t key
    cdef readonly bytes raw_key
    cdef readonly uint64_t raw_base
    cdef readonly uintptr_t ptr
    cdef readonly size_t nbytes
    cdef public int busy       # posts under way from this region
    cdef public object keep    # the memory's owner, alive as long as the registration

    def __cinit__(self, Rail rail, uintptr_t ptr, size_t nbytes, int iface, int device, int dmabuf_fd,
                  bint remote):
        cdef uint8_t raw[64]
        cdef size_t rawlen = 0
        cdef uint64_t raw_base = 0
        cdef const char *call = "fi_mr_regattr"
        cdef kx_rail *r = rail._rail()
        cdef int ret
        self.rail = rail
        self.mr = NULL
        with nogil:
            ret = kx_mr_reg(r, <void *>ptr, nbytes, iface, device, dmabuf_fd, remote,
                            &self.mr, &self.key, &self.desc, raw, &rawlen, &raw_base, &call)
            check(ret, call)
        self.raw_key = PyBytes_FromStringAndSize(<char *>raw, rawlen)
        self.raw_base = raw_base
        self.ptr = ptr
        self.nbytes = nbytes

    cdef close_fid(self):
        cdef fid_mr *mr = self.mr
        self.mr = NULL
        self.desc = NULL
        if mr != NULL and not self.rail.domain_closed:
            with nogil:
                check(kx_mr_close(mr), "fi_close(mr)")

    def close(self):
        try:
            self.close_fid()
        finally:
            self.keep = None

    @property
    def closed(self):
        return self.mr == NULL

    def __dealloc__(self):
        # a destructor cannot raise: a failing fi_close here has nobody to tell
        if self.mr != NULL and self.rail is not None and not self.rail.domain_closed:
            kx_mr_close(self.mr)
        self.mr = NULL


@cython.no_gc_clear  # __dealloc__ needs its Rail (GC clears Rail.pending first, so it outlives them)
cdef class TransferHandle:
    """The native side of a Transfer on one rail: planned, posted and completed messages."""

    cdef readonly Rail rail
    cdef kx_transfer *x
    cdef readonly RegionHandle region   # the source registration, alive while the transfer is

    def __dealloc__(self):
        if self.x != NULL:
            with nogil:
                kx_transfer_release(self.rail.r, self.x)
            self.x = NULL

    cdef kx_transfer_state _state(self):
        cdef kx_transfer_state s
        kx_transfer_get_state(self.x, &s)
        return s

    @property
    def planned(self):
        return self._state().planned

    @property
    def posted(self):
        return self._state().posted

    @property
    def completed(self):
        return self._state().completed

    @property
    def posting_done(self):
        return bool(self._state().posting_done)

    @property
    def done(self):
        return bool(self._state().done)

    @property
    def errno(self):
        return self._state().error

    def cancel(self):
        """Post nothing more of this transfer; what was posted still completes."""
        with nogil:
            kx_transfer_cancel(self.rail.r, self.x)

    def wait(self, timeout=None):
        """True once every posted message completed; False if `timeout` seconds pass first."""
        return _wait(self.rail.r, WAIT_TRANSFER, self.x, timeout)


@cython.no_gc_clear  # __dealloc__ needs its Rail (GC clears Rail.pending first, so it outlives them)
cdef class CounterHandle:
    """The native side of a Counter: an expectation of `count` arrivals of one imm."""

    cdef readonly Rail rail
    cdef kx_counter *c

    def __dealloc__(self):
        if self.c != NULL:
            with nogil:
                kx_counter_drop(self.rail.r, self.c)
            self.c = NULL

    cdef kx_counter_state _state(self):
        cdef kx_counter_state s
        kx_counter_get_state(self.c, &s)
        return s

    @property
    def address(self):
        return <uintptr_t>self.c

    @property
    def imm(self):
        return self._state().imm

    @property
    def count(self):
        return self._state().count

    @property
    def arrived(self):
        return self._state().arrived

    @property
    def done(self):
        return bool(self._state().done)

    @property
    def errno(self):
        return self._state().error

    def wait(self, timeout=None):
        """True once all arrivals were credited; False if `timeout` seconds pass first."""
        return _wait(self.rail.r, WAIT_COUNTER, self.c, timeout)


def count_messages(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
                   size_t iov, uint64_t max_write, uint64_t pack_min=0):
    """The native message rule, for checking kvxfer.wire.count_writes against it."""
    cdef size_t n = length.shape[0]
    if n == 0:
        return 0
    return kx_count_messages(&src_off[0], &dst_off[0], &length[0], n, iov, max_write, pack_min)
