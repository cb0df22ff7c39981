# cython: language_level=3, boundscheck=False, wraparound=False
"""Native handles over libfabric: one class per native object, every call checked.

This module is deliberately thin. Validation, keep-alive and the public names live in
kvxfer.engine; here each class owns exactly one native handle and a reference to its
parent, native calls run without the GIL, and only failure paths take it to raise.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport free
from kvxfer._core cimport *

import time as _time

cimport cython

from kvxfer.errors import ClosedError, FabricError, UnsupportedError

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


def _ver(uint32_t v):
    return (v >> 16, v & 0xFFFF)


RUNTIME_VERSION = _ver(kx_runtime_version())
BUILD_VERSION = _ver(kx_build_version())


cdef object _error(str call, int ret):
    cdef int err = -ret if ret < 0 else ret
    return FabricError(call, err, fi_strerror(err).decode("utf-8", "replace"))


cdef inline bint _sliced_wait_done(deadline) except -1:
    """Between slices: answer signals, and tell whether the deadline has passed."""
    PyErr_CheckSignals()
    return deadline is not None and _time.monotonic() >= deadline


cdef inline int64_t _slice_ns(deadline):
    """The next native wait: a full slice, or what is left before the deadline."""
    if deadline is None:
        return SLICE_NS
    return min(SLICE_NS, max(0, <int64_t>((deadline - _time.monotonic()) * 1e9)))


cdef bint _wait_done(kx_engine *e, const int *done, timeout) except -1:
    """Block on a native `done` flag in GIL-free slices until it is set or `timeout` passes."""
    cdef int d = 0
    cdef int64_t slice_ns
    deadline = None if timeout is None else _time.monotonic() + timeout
    while True:
        slice_ns = _slice_ns(deadline)
        with nogil:
            d = kx_wait_done(e, done, slice_ns)
        if d:
            return True
        if _sliced_wait_done(deadline):
            return False


cdef class Fabric:
    """One libfabric endpoint with its fabric, domain, CQ, AV and progress thread."""

    cdef kx_engine *e
    cdef readonly bint closed           # the endpoint is closed
    cdef readonly bint domain_closed    # ... and the domain (registrations are gone)
    cdef readonly bint started
    cdef readonly object join
    cdef list pending      # Xfers not yet done: each keeps its source MR (and buffer) alive
    cdef Py_ssize_t pruned  # len(pending) after the last prune (amortises pruning)

    def __cinit__(self, provider, node, bint hmem=False, bint spin=False, domain=None, Fabric join=None):
        cdef char errcall[64]
        cdef bytes p = provider.encode() if provider else None
        cdef bytes n = node.encode() if node else None
        cdef bytes d = domain.encode() if domain else None
        cdef const char *pp = NULL
        cdef const char *np = NULL
        cdef const char *dp = NULL
        cdef kx_engine *j = NULL
        if p is not None:
            pp = p
        if n is not None:
            np = n
        if d is not None:
            dp = d
        if join is not None:
            j = join._e()
            self.join = join      # the hub is shared: keep the first rail alive as long as this one
        cdef int ret
        errcall[0] = 0
        self.e = NULL
        self.closed = True
        self.pending = []
        with nogil:
            ret = kx_engine_open(pp, np, dp, hmem, spin, j, &self.e, errcall, sizeof(errcall))
        if ret:
            raise _error(errcall.decode() or "kx_engine_open", ret)
        self.closed = False

    def __dealloc__(self):
        if self.e != NULL:
            with nogil:
                kx_engine_free(self.e)
            self.e = NULL

    cdef inline kx_engine *_e(self) except NULL:
        if self.closed:
            raise ClosedError("engine is closed")
        return self.e

    def start(self, cpus=()):
        cdef int buf[1024]
        cdef int n = 0, ret
        cdef kx_engine *e = self._e()
        for c in cpus:
            if n >= 1024:
                break
            buf[n] = int(c)
            n += 1
        ret = kx_engine_start(e, buf, n)
        if ret:
            raise _error("pthread_create", ret)
        self.started = True

    def drain(self, double timeout=1.0, double quiet=0.02):
        """Cancel queued writes and wait up to `timeout` s for posted ones to complete and
        incoming traffic to stop for `quiet` s. Returns whether it did."""
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        cdef int64_t qns = <int64_t>(quiet * 1e9)
        cdef int ok = 1
        if self.e != NULL and not self.closed:
            with nogil:
                ok = kx_engine_drain(self.e, ns, qns)
        return bool(ok)

    def quiesce(self):
        """First half of close: refuse new native calls, wait for those inside, join the
        progress thread. Registrations can then be closed safely, before ``close``."""
        if self.e != NULL and not self.closed:
            with nogil:
                kx_engine_quiesce(self.e)

    def park(self):
        """Leave the endpoint open, unprogressed, for good at close (see kx_engine_park)."""
        if self.e != NULL and not self.closed:
            kx_engine_park(self.e)

    @property
    def took_traffic(self):
        """Peers wrote or sent to this endpoint (it has accepted connections)."""
        return bool(kx_engine_took_traffic(self._e()))

    def close_endpoint(self):
        """Stop the progress thread and close the endpoint, AV and CQ; pending work fails
        with ECANCELED. The domain stays open so registrations can still be closed."""
        if self.closed:
            return
        self.closed = True
        with nogil:
            kx_engine_teardown(self.e)
        if kx_leaked(self.e) or self.e.parked:
            # a thread is stuck inside libfabric: touch nothing of the domain any more
            self.domain_closed = True
        self.pending = [p for p in self.pending if not (<Xfer>p).x.done or (<Xfer>p).x.linked]

    def close(self):
        """Close everything; registrations still open on the domain are closed by libfabric."""
        self.close_endpoint()
        if not self.domain_closed:
            self.domain_closed = True
            with nogil:
                kx_engine_close_domain(self.e)

    # -- properties the face validates against ------------------------------------------
    @property
    def provider(self):
        return kx_prov_name(self._e()).decode()

    @property
    def addr_is_str(self):
        """Endpoint names are NUL-terminated strings (FI_ADDR_STR), not fixed-size structs."""
        return bool(kx_addr_is_str(self._e()))

    @property
    def fabric_name(self):
        return kx_fabric_name(self._e()).decode()

    @property
    def domain_name(self):
        return kx_domain_name(self._e()).decode()

    @property
    def mr_mode(self):
        return self._e().mr_mode

    @property
    def caps(self):
        return self._e().caps

    @property
    def iov_limit(self):
        return self._e().iov_limit

    @property
    def max_msg_size(self):
        return self._e().max_msg_size

    @property
    def inject_size(self):
        return self._e().inject_size

    @property
    def cq_data_size(self):
        return self._e().cq_data_size

    @property
    def has_wait(self):
        return bool(self._e().has_wait)

    @property
    def need_ctx(self):
        return bool(self._e().need_ctx)

    @property
    def thread_id(self):
        """The progress thread's kernel thread id (0 until it has started running)."""
        return kx_thread_tid(self._e())

    def stats(self):
        cdef kx_engine *e = self._e()
        return {
            "writes_posted": e.stat_writes,
            "errors": e.stat_rx_err,
            "outstanding": e.outstanding,
        }

    # -- addresses -------------------------------------------------------------------------
    def getname(self):
        cdef char buf[256]
        cdef size_t n = sizeof(buf)
        cdef int ret = kx_getname(self._e(), buf, &n)
        if ret:
            raise _error("fi_getname", ret)
        return PyBytes_FromStringAndSize(buf, n)

    def av_insert(self, const uint8_t[::1] addr):
        """Insert a peer's endpoint name (checked natively first); its fi_addr."""
        cdef fi_addr_t a = 0
        if addr.shape[0] == 0:
            raise _error("fi_av_insert", -FI_EINVAL)
        cdef int ret = kx_av_insert(self._e(), &addr[0], addr.shape[0], &a)
        if ret:
            raise _error("fi_av_insert", ret)
        return a

    def set_peer_timeout(self, double seconds):
        """Operations outstanding to a peer with none completing for this long: it is dead
        (its transfers fail with ETIMEDOUT, later posts at once). 0: never."""
        kx_set_peer_timeout(self._e(), <int64_t>(seconds * 1e9))

    def set_delivery_complete(self, bint on):
        """Writes complete only once placed at the target (FI_DELIVERY_COMPLETE)."""
        kx_set_delivery_complete(self._e(), on)

    def peer_state(self, fi_addr_t addr):
        """0 while `addr` may be posted to, else the errno posts to it fail with."""
        return kx_peer_state(self._e(), addr)

    def av_remove(self, fi_addr_t addr):
        cdef int ret = kx_av_remove(self._e(), addr)
        if ret:
            raise _error("fi_av_remove", ret)

    def cancel_peer(self, fi_addr_t addr):
        """Cancel every unfinished transfer to `addr` on this rail; returns how many."""
        return kx_peer_cancel(self._e(), addr)

    def wait_peer_idle(self, fi_addr_t addr, timeout):
        """Wait (GIL-free slices, at most `timeout` s) until no transfer to `addr` is in
        flight on this rail. Returns (in flight, of which still posting)."""
        cdef kx_engine *e = self._e()
        cdef int n = 0, posting = 0
        cdef int64_t slice_ns
        deadline = _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                n = kx_peer_wait(e, addr, slice_ns, &posting)
            if n == 0 or _sliced_wait_done(deadline):
                return n, posting

    def map_raw(self, uint64_t base, const uint8_t[::1] raw):
        cdef uint64_t key = 0
        cdef int ret = kx_map_raw(self._e(), base, <uint8_t *>&raw[0], raw.shape[0], &key)
        if ret:
            raise _error("fi_mr_map_raw", ret)
        return key

    def unmap_key(self, uint64_t key):
        if not self.domain_closed:
            kx_unmap_key(self.e, key)

    # -- registration ----------------------------------------------------------------------
    def mr_reg(self, uintptr_t ptr, size_t nbytes, int iface=FI_HMEM_SYSTEM, int device=0, int dmabuf_fd=-1,
               bint remote=True):
        return MR(self, ptr, nbytes, iface, device, dmabuf_fd, remote)

    # -- writes ----------------------------------------------------------------------------
    def write(self, fi_addr_t peer, uintptr_t src_base, MR mr, uint64_t dst_base, uint64_t key,
              const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
              imm, size_t iov, uint64_t max_write, uint64_t pack_min):
        """Post every message of the triples (see include/kvxfer/post.h) with the GIL released."""
        cdef kx_engine *e = self._e()
        cdef size_t n = length.shape[0]
        cdef int has_imm = imm is not None
        cdef uint32_t immv = imm if has_imm else 0
        cdef kx_xfer *x
        cdef const uint64_t *so = NULL
        cdef const uint64_t *do_ = NULL
        cdef const uint64_t *ln = NULL
        if n:
            so = &src_off[0]
            do_ = &dst_off[0]
            ln = &length[0]
        if mr.fab is not self or mr.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        mr.busy += 1          # MR.close refuses while a post is under way
        with nogil:
            x = kx_write(e, peer, <char *>src_base, mr.desc, dst_base, key, so, do_, ln, n,
                         has_imm, immv, iov, max_write, pack_min)
        if x == NULL:
            mr.busy -= 1
            raise MemoryError()
        # recorded before any Python code can run (a signal handler raising right after the
        # native call must not free what the progress thread still reads)
        cdef Xfer t = Xfer.__new__(Xfer)
        t.fab = self
        t.x = x
        t.mr = mr
        if not x.done or x.linked:
            self.pending.append(t)
        mr.busy -= 1
        if len(self.pending) > max(64, 2 * self.pruned):
            self.prune()
        return t

    def prune(self):
        """Forget finished transfers (and so release their registrations' buffers)."""
        self.pending = [p for p in self.pending if not (<Xfer>p).x.done or (<Xfer>p).x.linked]
        self.pruned = len(self.pending)

    def close_if_idle(self, list mrs):
        """Close these registrations (one per rail) unless a transfer from any of them is
        being posted or in flight; all checks and closes without Python code in between, so
        no other thread can start a post from them meanwhile. Returns whether it closed."""
        cdef MR m
        for m in mrs:
            if m.fab.busy_with(m):
                return False
        for m in mrs:            # the fids first: releasing buffers may run Python code
            m.close_fid()
        for m in mrs:
            m.keep = None
        return True

    def busy_with(self, MR mr):
        """Whether a transfer from `mr` is being posted or still in flight on this rail."""
        if mr.busy:
            return True
        for p in self.pending:
            if (<Xfer>p).mr is mr and ((<Xfer>p).x.linked or not (<Xfer>p).x.done):
                return True      # linked: failed early, but the provider may still own its ops
        return False

    # -- counters --------------------------------------------------------------------------
    def expect(self, uint32_t imm, uint64_t count, bint callback=False):
        cdef kx_counter *c = NULL
        cdef int ret = kx_expect(self._e(), imm, count, callback, &c)
        if ret:
            raise _error("kx_expect", ret)
        cdef CounterHandle h = CounterHandle.__new__(CounterHandle)
        h.fab = self
        h.c = c
        return h

    def banked(self, uint32_t imm):
        return kx_banked(self._e(), imm)

    def discard(self, uint32_t imm):
        """Retire `imm` (see kx_discard): returns (arrivals dropped, address of the withdrawn
        expectation or 0)."""
        cdef kx_counter *c = NULL
        cdef uint64_t n = kx_discard(self._e(), imm, &c)
        return n, <uintptr_t>c

    def next_done(self, timeout):
        """For the callback dispatcher: the address of the next finished counter that wants a
        callback, None after `timeout` seconds, or -1 once the engine is closing."""
        cdef kx_counter *c = NULL
        cdef int ret
        cdef int64_t slice_ns = <int64_t>(timeout * 1e9)
        if self.e == NULL:
            return -1
        with nogil:
            ret = kx_next_done(self.e, slice_ns, &c)
        if ret == 1:
            addr = <uintptr_t>c
            kx_counter_unref(self.e, c)   # the Python owner still holds its reference
            return addr
        return -1 if ret < 0 else None

    def dispatch_stop(self):
        if self.e != NULL:
            kx_dispatch_stop(self.e)

    # -- control messages ------------------------------------------------------------------
    def send(self, fi_addr_t peer, const uint8_t[::1] data, timeout=None):
        """Post one message; while the provider's queue stays full, retry in 50 ms native
        slices until `timeout` (seconds, None: forever), answering signals in between."""
        cdef kx_engine *e = self._e()
        cdef size_t n = data.shape[0]
        cdef const char *p = <const char *>"\0"
        if n:
            p = <const char *>&data[0]
        cdef int ret
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            with nogil:
                ret = kx_send(e, peer, p, n)
            if ret != -FI_EAGAIN:
                break
            if _sliced_wait_done(deadline):
                return False
            e = self._e()
        if ret:
            raise _error("fi_send", ret)
        return True

    def recv(self, timeout):
        """The next control message, or None when `timeout` (seconds, None: forever) passes."""
        cdef kx_engine *e = self._e()
        cdef kx_msg *m = NULL
        cdef int64_t slice_ns
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                kx_recv_wait(e, slice_ns, &m)
            if m != NULL:
                out = PyBytes_FromStringAndSize(m.data, m.len)
                free(m)
                return out
            if self.closed:
                raise ClosedError("engine is closed")
            if _sliced_wait_done(deadline):
                return None


@cython.no_gc_clear  # __dealloc__ needs its Fabric (GC clears Fabric.pending first, so it outlives them)
cdef class MR:
    """One registered memory region (fid_mr) on a Fabric."""

    cdef readonly Fabric fab
    cdef fid_mr *mr
    cdef void *desc
    cdef readonly uint64_t key
    cdef readonly bytes raw_key
    cdef readonly uint64_t raw_base
    cdef readonly uintptr_t ptr
    cdef readonly size_t nbytes
    cdef public int busy       # posts under way from this region
    cdef public object keep    # the memory's owner, alive as long as the registration

    def __cinit__(self, Fabric fab, uintptr_t ptr, size_t nbytes, int iface, int device, int dmabuf_fd, bint remote):
        cdef uint8_t raw[64]
        cdef size_t rawlen = 0
        cdef uint64_t raw_base = 0
        cdef const char *call = "fi_mr_regattr"
        cdef kx_engine *e = fab._e()
        cdef int ret
        self.fab = fab
        self.mr = NULL
        with nogil:
            ret = kx_mr_reg_user(e, <void *>ptr, nbytes, iface, device, dmabuf_fd, remote,
                                 &self.mr, &self.key, &self.desc, raw, &rawlen, &raw_base, &call)
        if ret:
            raise _error(call.decode(), ret)
        self.raw_key = PyBytes_FromStringAndSize(<char *>raw, rawlen)
        self.raw_base = raw_base
        self.ptr = ptr
        self.nbytes = nbytes

    cdef close_fid(self):
        if self.mr != NULL:
            if not self.fab.domain_closed:
                kx_mr_close(self.mr)
            self.mr = NULL
            self.desc = NULL

    def close(self):
        self.close_fid()
        self.keep = None

    def revoke(self):
        """Close the registration but keep its memory alive (`keep`): a peer's later write
        to it is refused while the provider may still be copying an earlier one in."""
        self.close_fid()

    @property
    def closed(self):
        return self.mr == NULL

    def __dealloc__(self):
        if self.mr != NULL and self.fab is not None and not self.fab.domain_closed:
            kx_mr_close(self.mr)
        self.mr = NULL


@cython.no_gc_clear  # __dealloc__ needs its Fabric (GC clears Fabric.pending first, so it outlives them)
cdef class Xfer:
    """The native side of a Transfer: counts of planned, posted and completed messages."""

    cdef readonly Fabric fab
    cdef kx_xfer *x
    cdef readonly MR mr        # the source registration, alive while the transfer is

    def __dealloc__(self):
        if self.x != NULL:
            kx_xfer_drop(self.fab.e, self.x)
            self.x = NULL

    @property
    def planned(self):
        return self.x.planned

    @property
    def posted(self):
        return self.x.posted

    @property
    def completed(self):
        return self.x.completed

    @property
    def posting_done(self):
        return bool(self.x.posting_done)

    @property
    def done(self):
        return bool(self.x.done)

    @property
    def errno(self):
        return self.x.error

    def cancel(self):
        """Post nothing more of this transfer; what was posted still completes."""
        kx_xfer_cancel(self.fab.e, self.x)

    def wait(self, timeout=None):
        """True once every posted message completed; False if `timeout` seconds pass first."""
        return _wait_done(self.fab.e, &self.x.done, timeout)


@cython.no_gc_clear  # __dealloc__ needs its Fabric (GC clears Fabric.pending first, so it outlives them)
cdef class CounterHandle:
    """The native side of a Counter: an expectation of `count` arrivals of one imm."""

    cdef readonly Fabric fab
    cdef kx_counter *c

    def __dealloc__(self):
        if self.c != NULL:
            kx_counter_drop(self.fab.e, self.c)
            self.c = NULL

    @property
    def address(self):
        return <uintptr_t>self.c

    @property
    def imm(self):
        return self.c.imm

    @property
    def count(self):
        return self.c.count

    @property
    def arrived(self):
        return self.c.arrived

    @property
    def done(self):
        return bool(self.c.done)

    @property
    def errno(self):
        return self.c.error

    def wait(self, timeout=None):
        """True once all arrivals were credited; False if `timeout` seconds pass first."""
        return _wait_done(self.fab.e, &self.c.done, timeout)


def count_messages(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
                   size_t iov, uint64_t max_write, uint64_t pack_min=0):
    """The native message rule, for checking kvxfer.wire.count_writes against it."""
    cdef size_t n = length.shape[0]
    if n == 0:
        return 0
    return kx_walk(&src_off[0], &dst_off[0], &length[0], n, iov, max_write, pack_min)
