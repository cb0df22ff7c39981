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
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.string cimport memset, strcpy
from libc.stdlib cimport malloc, calloc, free
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
    elif call == "fi_send" and err in PEER_ERRNOS:   # the peer is known dead (liveness.c)
        return PeerError(err, f"control message not sent: the peer is gone ({_os.strerror(err)})")
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
    cdef list pending_sets  # TransferSets not yet done: each keeps its source regions alive
    cdef Py_ssize_t pruned_sets
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
        self.pending_sets = []
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
    def drain(self, double timeout=1.0, double quiet=0.02):
        """Cancel queued writes and wait up to `timeout` s for posted ones to complete and
        incoming traffic to stop for `quiet` s. Returns whether it did."""
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        cdef int64_t qns = <int64_t>(quiet * 1e9)
        cdef int ok = 1
        if self.r != NULL and not self.closed:
            with nogil:
                ok = kx_rail_drain(self.r, ns, qns)
        return bool(ok)

    def park(self):
        """Leave the endpoint open, unprogressed, for good at close (src/rail.c, kx_rail_park)."""
        if self.r != NULL and not self.closed:
            kx_rail_park(self.r)

    @property
    def took_traffic(self):
        """Peers wrote or sent to this endpoint."""
        return bool(kx_rail_took_traffic(self._rail()))

    def set_peer_timeout(self, double seconds):
        """Operations outstanding to a peer with none completing (or every post refused) for
        this long: it is dead, its transfers and later posts fail. 0: never."""
        kx_set_peer_timeout(self._rail(), <int64_t>(seconds * 1e9))

    def set_delivery_complete(self, bint on):
        """Writes complete only once placed at the target (FI_DELIVERY_COMPLETE)."""
        kx_set_delivery_complete(self._rail(), on)

    def peer_state(self, fi_addr_t addr):
        """0 while `addr` may be posted to, else the errno posts to it fail with."""
        return kx_peer_state(self._rail(), addr)

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
        if kx_rail_leaked(self.r) or kx_rail_parked(self.r):
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
        return {"writes_posted": s.writes_posted, "direct_writes": s.direct_writes,
                "direct_revoked": s.direct_revoked, "errors": s.errors,
                "outstanding": s.outstanding, "bell_rings": s.bell_rings, "bell_wakes": s.bell_wakes}

    # -- addresses -------------------------------------------------------------------------
    def getname(self):
        cdef char buf[256]
        cdef size_t n = sizeof(buf)
        cdef kx_rail *r = self._rail()
        with nogil:
            check(kx_getname(r, buf, &n), "fi_getname")
        return PyBytes_FromStringAndSize(buf, n)

    def av_insert(self, const uint8_t[::1] addr):
        """Insert a peer's endpoint name (checked natively first); (its fi_addr, the slot's
        generation), both named by every post to it."""
        cdef fi_addr_t a = 0
        cdef uint32_t gen = 0
        cdef kx_rail *r = self._rail()
        cdef size_t n = addr.shape[0]
        if n == 0:
            check(-22, "fi_av_insert")
        with nogil:
            check(kx_av_insert(r, &addr[0], n, &a, &gen), "fi_av_insert")
        return a, gen

    def av_remove(self, fi_addr_t addr, double wait=1.0):
        """Remove `addr` once no post is inside a provider call to it (later ones fail with
        ENOTCONN at once); False if one still was after `wait` s (the slot stays, unused)."""
        cdef kx_rail *r = self._rail()
        cdef int ret
        cdef int64_t ns = <int64_t>(wait * 1e9)
        with nogil:
            ret = kx_av_remove(r, addr, ns)
        if ret == -FI_EBUSY or ret == -FI_ECANCELED:     # still posted to, or the rail closing
            return False
        check(ret, "fi_av_remove")
        return True

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
    def cancel_peer(self, fi_addr_t addr, uint32_t gen=0):
        """Cancel every unfinished transfer to `addr` (of slot generation `gen`; 0: any) on
        this rail; returns how many."""
        cdef kx_rail *r = self._rail()
        cdef int n
        with nogil:
            n = kx_peer_cancel(r, addr, gen)
        return n

    def wait_peer_idle(self, fi_addr_t addr, timeout, uint32_t gen=0):
        """Wait (at most `timeout` s) until no transfer to `addr` (of generation `gen`; 0:
        any) is in flight on this rail. Returns (transfers still in flight, of which still
        posting)."""
        cdef kx_rail *r = self._rail()
        cdef int n = 0, posting = 0
        cdef int64_t slice_ns
        deadline = _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                n = kx_peer_wait(r, addr, gen, slice_ns, &posting)
            if n == 0 or _deadline_passed(deadline):
                return n, posting

    # -- registration ----------------------------------------------------------------------
    def mr_reg(self, uintptr_t ptr, size_t nbytes, int iface=FI_HMEM_SYSTEM, int device=0, int dmabuf_fd=-1,
               int remote=KX_REMOTE_WRITE):
        """``remote``: what peers may do, ``REMOTE_WRITE`` | ``REMOTE_READ`` (0: nothing; True
        is ``REMOTE_WRITE``)."""
        return RegionHandle(self, ptr, nbytes, iface, device, dmabuf_fd, remote)

    # -- writes ----------------------------------------------------------------------------
    def write(self, fi_addr_t peer, uint32_t gen, uintptr_t src_base, RegionHandle region, uint64_t dst_base,
              uint64_t key, DirectMap direct, const uint64_t[::1] src_off, const uint64_t[::1] dst_off,
              const uint64_t[::1] length, imm, size_t iov, uint64_t max_write, uint64_t pack_min):
        """Post every message of the triples (the message rule: src/post.c) without the GIL;
        with ``direct`` (the peer region's DirectMap, or None) as direct writes. ``gen``: the
        peer's slot generation from ``av_insert``."""
        cdef size_t n = length.shape[0]
        if n == 0:
            return self._post(peer, gen, src_base, region, dst_base, key, direct, NULL, NULL, NULL, 0,
                              imm, iov, max_write, pack_min)
        return self._post(peer, gen, src_base, region, dst_base, key, direct, &src_off[0], &dst_off[0], &length[0],
                          n, imm, iov, max_write, pack_min)

    def write_one(self, fi_addr_t peer, uint32_t gen, uintptr_t src_base, RegionHandle region, uint64_t dst_base,
                  uint64_t key, DirectMap direct, uint64_t src_off, uint64_t dst_off, uint64_t length, imm, size_t iov,
                  uint64_t max_write, uint64_t pack_min):
        """`write` of one triple, without arrays: the small-write path (a control write, a
        layer's last write) pays no numpy."""
        return self._post(peer, gen, src_base, region, dst_base, key, direct, &src_off, &dst_off, &length, 1,
                          imm, iov, max_write, pack_min)

    cdef object _post(self, fi_addr_t peer, uint32_t gen, uintptr_t src_base, RegionHandle region, uint64_t dst_base,
                              uint64_t key, DirectMap direct, const uint64_t *so, const uint64_t *do_,
                              const uint64_t *ln, size_t n, imm, size_t iov, uint64_t max_write, uint64_t pack_min):
        cdef kx_rail *r = self._rail()
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef kx_transfer *x = NULL
        cdef kx_direct *d = _direct(direct)
        cdef int ret
        if region.rail is not self or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        region.busy += 1          # RegionHandle.close refuses while a post is under way
        with nogil:
            ret = kx_write(r, peer, gen, <char *>src_base, region.desc, dst_base, key, d, so, do_, ln, n,
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
        if not t.done or t.linked:
            self.pending.append(t)
        region.busy -= 1
        if len(self.pending) > max(64, 2 * self.pruned):
            self.prune()
        return t

    def hold_awake(self, int delta):
        """Keep the progress thread polling while holds are taken (data expected soon)."""
        cdef kx_rail *r = self._rail()
        with nogil:
            kx_rail_hold_awake(r, delta)

    def write_groups(self, fi_addr_t peer, uint32_t gen, list regions, const uint64_t[::1] dst_base, const uint64_t[::1] key,
                     list directs, const int64_t[::1] pair, const uint64_t[::1] src_off,
                     const uint64_t[::1] dst_off, const uint64_t[::1] length, const int64_t[::1] starts, imm,
                     size_t iov, uint64_t max_write, const uint64_t[::1] pack_min):
        """Post many groups to one peer in one GIL-free loop. Group g writes triples
        ``[starts[g], starts[g+1])`` from ``regions[pair[g]]`` (a RegionHandle of this rail,
        whose ``ptr`` is the source base) to the peer's region at ``dst_base[pair[g]]`` with
        ``key[pair[g]]``, directly where ``directs[pair[g]]`` is a DirectMap: one ``kx_write``
        (one native transfer, the message rule on its own, with rule 3's bound
        ``pack_min[pair[g]]``: 0 into a region with a host share) per group. The caller
        validated every offset (kvxfer.engine.Engine.write_pairs)."""
        cdef kx_rail *r = self._rail()
        cdef Py_ssize_t ng = pair.shape[0], npairs = len(regions), g, p
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef int ret = 0
        cdef Py_ssize_t posted = 0
        cdef RegionHandle m
        if (starts.shape[0] != ng + 1 or dst_base.shape[0] < npairs or key.shape[0] < npairs or len(directs) < npairs
                or pack_min.shape[0] < npairs):
            raise InvalidArgumentError("write_groups: group tables differ in length")
        if ng and (starts[0] < 0 or starts[ng] > length.shape[0] or src_off.shape[0] < starts[ng]
                   or dst_off.shape[0] < starts[ng]):
            raise InvalidArgumentError("write_groups: group bounds exceed the triples")
        for g in range(ng):
            if starts[g + 1] < starts[g] or not 0 <= pair[g] < npairs:
                raise InvalidArgumentError("write_groups: bad group bounds or pair index")
        cdef TransferSet t = TransferSet.__new__(TransferSet)
        t.rail = self
        t.regions = tuple([regions[pair[g]] for g in range(ng)])
        if ng == 0:
            return t
        t.xs = <kx_transfer **>calloc(ng, sizeof(kx_transfer *))
        cdef void **descs = <void **>malloc(ng * sizeof(void *))
        cdef char **bases = <char **>malloc(ng * sizeof(char *))
        cdef kx_direct **dmaps = <kx_direct **>malloc(npairs * sizeof(kx_direct *))
        if t.xs == NULL or descs == NULL or bases == NULL or dmaps == NULL:
            free(descs)
            free(bases)
            free(dmaps)
            raise MemoryError()
        try:
            for p in range(npairs):        # the transfers take their own references
                dmaps[p] = _direct(directs[p])
            for g in range(ng):
                m = <RegionHandle?>t.regions[g]
                if m.rail is not self or m.mr == NULL:
                    raise ClosedError("source registration is closed or belongs to another rail")
                descs[g] = m.desc
                bases[g] = <char *>m.ptr
            for g in range(ng):          # RegionHandle.close refuses while a post is under way
                (<RegionHandle>t.regions[g]).busy += 1
            with nogil:
                kx_posting_begin(r)          # one burst: the progress thread waits it out once
                for g in range(ng):
                    p = pair[g]
                    ret = kx_write(r, peer, gen, bases[g], descs[g], dst_base[p], key[p], dmaps[p],
                                   &src_off[0] + starts[g], &dst_off[0] + starts[g], &length[0] + starts[g],
                                   <size_t>(starts[g + 1] - starts[g]), has_imm, imm_value, iov, max_write,
                                   pack_min[p], &t.xs[g])
                    if ret:
                        break
                    posted += 1
                kx_posting_end(r)
            # recorded before any Python code can run (see write)
            t.n = posted
            if not t.done or t.linked:
                self.pending_sets.append(t)
            for g in range(ng):
                (<RegionHandle>t.regions[g]).busy -= 1
        finally:
            free(descs)
            free(bases)
            free(dmaps)
        if ret:
            t.cancel()                   # what was posted completes; nothing more goes out
            check(ret, "kx_write")
        if len(self.pending_sets) > max(64, 2 * self.pruned_sets):
            self.prune()
        return t

    def prune(self):
        """Forget finished transfers (and so release their registrations' buffers)."""
        self.pending = [t for t in self.pending if not (<TransferHandle>t).done or (<TransferHandle>t).linked]
        self.pruned = len(self.pending)
        self.pending_sets = [t for t in self.pending_sets if not (<TransferSet>t).done or (<TransferSet>t).linked]
        self.pruned_sets = len(self.pending_sets)

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
            if (<TransferHandle>t).region is region and (not (<TransferHandle>t).done or (<TransferHandle>t).linked):
                return True      # linked: failed early, but the provider may still own its ops
        for t in self.pending_sets:
            if region in (<TransferSet>t).regions and (not (<TransferSet>t).done or (<TransferSet>t).linked):
                return True
        for ref in region.watches:       # armed from it: the watcher posts from it later
            h = ref()
            if h is not None and (<WatchHandle>h).busy:
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
    def send(self, fi_addr_t peer, uint32_t gen, const uint8_t[::1] data, timeout=None):
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
                ret = kx_send(r, peer, gen, p, n)
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


cdef class DirectMap:
    """This process's own MAP_SHARED mapping of a shm peer's memfd region, opened from its
    descriptor's host share (``path`` = ``/proc/<pid>/fd/<fd>``, checked to be the file
    ``dev``/``ino``, sealed against shrinking, holding ``[offset, offset + nbytes)``;
    src/direct.c). Writes through it are direct: a memcpy per message, plus a 0-byte write
    carrying the imm. Native transfers (until their posting ends) and armed watch entries
    take their own references, so the mapping outlives this handle as long as they copy. Raises FabricError
    (``kx_direct_open``) when it cannot map; the engine then writes over RMA.

    ``fence``: ``(path, dev, ino, slot, generation)`` of the target's fence table
    (``/proc/<pid>/fd/<fd>`` of its memfd, checked like the data): every copy then takes a
    writer on word ``slot`` only while it carries ``generation`` and is not revoked, and is
    skipped once the target closed the region (src/direct.c). The engine maps no host share
    without one (``fenced``)."""

    cdef kx_direct *d
    cdef readonly size_t nbytes
    cdef readonly bint fenced

    def __cinit__(self, str path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t nbytes, fence=None):
        cdef bytes p = path.encode()
        cdef const char *cp = p
        cdef bytes fp
        cdef const char *fcp
        cdef uint64_t fdev, fino
        cdef uint32_t slot, gen
        cdef int ret
        self.d = NULL
        self.fenced = False
        if fence is not None:
            fpath, fdev, fino, slot, gen = fence
            fp = str(fpath).encode()
        with nogil:
            ret = kx_direct_open(cp, dev, ino, offset, nbytes, &self.d)
        check(ret, "kx_direct_open")
        self.nbytes = nbytes
        if fence is not None:
            fcp = fp
            with nogil:
                ret = kx_direct_fence(self.d, fcp, fdev, fino, slot, gen)
            check(ret, "kx_direct_fence")       # __dealloc__ unmaps the data
            self.fenced = True

    def __dealloc__(self):
        if self.d != NULL:
            with nogil:
                kx_direct_unref(self.d)      # the last reference unmaps
            self.d = NULL

    @property
    def base(self):
        """Where the region's first byte is mapped in this process."""
        return <uintptr_t>kx_direct_base(self.d)


cdef inline uint64_t _load_word(uint64_t *w) noexcept nogil:
    return (<volatile uint64_t *>w)[0]


cdef class FenceTable:
    """The target's side of the direct-write fence (src/direct.c): ``slots`` 64-bit words
    [generation: 32 | revoked: 1 | writers: 31] in a sealed memfd, mapped here and held open
    as ``fd`` (peers open it through ``/proc/<pid>/fd/<fd>``). The engine hands one slot to
    each region that offers a host share. Unmapped and closed when collected (a region that
    still revokes holds a reference)."""

    cdef int _fd
    cdef uint64_t *words
    cdef readonly size_t slots

    def __cinit__(self, size_t slots):
        cdef int ret
        self._fd = -1
        self.words = NULL
        self.slots = slots
        with nogil:
            ret = kx_fence_table_open(slots, &self._fd, &self.words)
        check(ret, "kx_fence_table_open")

    def __dealloc__(self):
        kx_fence_table_close(self._fd, self.words, self.slots)
        self._fd = -1
        self.words = NULL

    @property
    def fd(self):
        return self._fd

    cdef uint64_t *_word(self, size_t slot) except NULL:
        if slot >= self.slots:
            raise InvalidArgumentError(f"fence slot {slot} out of range")
        return &self.words[slot]

    def word(self, size_t slot):
        """The slot's word as it stands (for tests)."""
        return _load_word(self._word(slot))

    def issue(self, size_t slot):
        """Open a free slot for a new region; returns the generation its descriptor names."""
        return kx_fence_issue(self._word(slot))

    def revoke(self, size_t slot, double timeout):
        """Refuse every later copy into the slot's region and wait up to ``timeout`` s for the
        copies in progress; returns the writers still inside (0: none)."""
        cdef uint64_t *w = self._word(slot)
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        cdef uint32_t left
        with nogil:
            left = kx_fence_revoke(w, ns)
        return left

    def retire(self, size_t slot):
        """After deregistration: bump the slot's generation. False where a writer never left
        (the slot must not serve another region)."""
        return kx_fence_retire(self._word(slot)) == 0


cdef inline kx_direct *_direct(object direct) except? NULL:
    """The native mapping of a DirectMap, NULL for None (an RMA write)."""
    if direct is None:
        return NULL
    return (<DirectMap?>direct).d


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
    cdef public object fence   # the region's fence slot (engine._FenceSlot), released when the registration goes
    cdef readonly list watches # weak references to the watch entries armed from it


    def __cinit__(self, Rail rail, uintptr_t ptr, size_t nbytes, int iface, int device, int dmabuf_fd,
                  int remote):
        cdef uint8_t raw[64]
        cdef size_t rawlen = 0
        cdef uint64_t raw_base = 0
        cdef const char *call = "fi_mr_regattr"
        cdef kx_rail *r = rail._rail()
        cdef int ret
        self.rail = rail
        self.mr = NULL
        self.watches = []
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


cdef class _TransferState:
    """What a transfer's native side reports, read from one ``kx_transfer_state``:
    ``TransferHandle`` reads its one transfer, ``TransferSet`` sums its groups'."""

    cdef kx_transfer_state _state(self):
        cdef kx_transfer_state s
        memset(&s, 0, sizeof(s))
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
    def linked(self):
        """Still on the rail's in-flight list (for a set: some group is): the provider may still own its contexts."""
        return bool(self._state().linked)

    @property
    def errno(self):
        return self._state().error


@cython.no_gc_clear  # __dealloc__ needs its Rail (GC clears Rail.pending first, so it outlives them)
cdef class TransferHandle(_TransferState):
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

    def cancel(self):
        """Post nothing more of this transfer; what was posted still completes."""
        with nogil:
            kx_transfer_cancel(self.rail.r, self.x)

    def wait(self, timeout=None):
        """True once every posted message completed; False if `timeout` seconds pass first."""
        return _wait(self.rail.r, WAIT_TRANSFER, self.x, timeout)


@cython.no_gc_clear  # __dealloc__ needs its Rail (GC clears Rail.pending_sets first, so it outlives them)
cdef class TransferSet(_TransferState):
    """The native side of one ``Engine.write_groups`` call on one rail: one ``kx_transfer``
    per group, seen as one (planned, posted and completed are sums; done when all are)."""

    cdef readonly Rail rail
    cdef kx_transfer **xs
    cdef Py_ssize_t n
    cdef readonly tuple regions          # the groups' source registrations, alive while in flight

    def __dealloc__(self):
        cdef Py_ssize_t g
        if self.xs != NULL:
            with nogil:
                for g in range(self.n):
                    kx_transfer_release(self.rail.r, self.xs[g])
            free(self.xs)
            self.xs = NULL

    cdef kx_transfer_state _state(self):
        cdef kx_transfer_state s, one
        cdef Py_ssize_t g
        s.planned = s.posted = s.completed = 0
        s.posting_done = s.done = 1
        s.linked = 0
        s.error = 0
        for g in range(self.n):
            kx_transfer_get_state(self.xs[g], &one)
            s.planned += one.planned
            s.posted += one.posted
            s.completed += one.completed
            s.posting_done &= one.posting_done
            s.done &= one.done
            s.linked |= one.linked
            if s.error == 0:
                s.error = one.error
        return s

    @property
    def groups(self):
        return self.n

    def cancel(self):
        """Post nothing more of any group; what was posted still completes."""
        cdef Py_ssize_t g
        with nogil:
            for g in range(self.n):
                kx_transfer_cancel(self.rail.r, self.xs[g])

    def wait(self, timeout=None):
        """True once every group's posted messages completed; False if `timeout` s pass first."""
        cdef Py_ssize_t g
        deadline = None if timeout is None else _time.monotonic() + timeout
        for g in range(self.n):
            left = None if deadline is None else max(0.0, deadline - _time.monotonic())
            if not _wait(self.rail.r, WAIT_TRANSFER, self.xs[g], left):
                return False
        return True


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


def check_groups(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
                 const int64_t[::1] starts, const int64_t[::1] pair, const uint64_t[::1] src_size,
                 const uint64_t[::1] dst_size):
    """For Engine.write_pairs, one pass over the triples: None when every write of group g
    (triples ``[starts[g], starts[g+1])``) stays inside ``src_size[pair[g]]`` and
    ``dst_size[pair[g]]``; else ``(g, side, i, end)`` of the first that does not (side 0:
    source, 1: destination; i counted within the group). Offsets are below 2**62."""
    cdef Py_ssize_t ng = pair.shape[0], g, i, p
    cdef uint64_t e
    if starts.shape[0] != ng + 1 or (ng and (starts[ng] > length.shape[0] or starts[ng] > src_off.shape[0]
                                             or starts[ng] > dst_off.shape[0])):
        raise InvalidArgumentError("check_groups: group bounds exceed the triples")
    for g in range(ng):      # every group's bounds before any triple is read (no bounds checks here)
        p = pair[g]
        if not 0 <= p < src_size.shape[0] or p >= dst_size.shape[0] or starts[g] < 0 or starts[g + 1] < starts[g]:
            raise InvalidArgumentError("check_groups: bad group bounds or pair index")
    for g in range(ng):
        p = pair[g]
        for i in range(starts[g], starts[g + 1]):
            e = src_off[i] + length[i]
            if e > src_size[p]:
                return (g, 0, i - starts[g], e)
            e = dst_off[i] + length[i]
            if e > dst_size[p]:
                return (g, 1, i - starts[g], e)
    return None


def count_messages(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
                   size_t iov, uint64_t max_write, uint64_t pack_min=0):
    """The native message rule, for checking kvxfer.wire.count_writes against it."""
    cdef size_t n = length.shape[0]
    if n == 0:
        return 0
    return kx_count_messages(&src_off[0], &dst_off[0], &length[0], n, iov, max_write, pack_min)


# -- the layer watcher -------------------------------------------------------------------

cdef class WatcherHandle:
    """The native layer watcher (``kx_watcher``): a thread that polls a 64-bit counter word
    and posts armed entries whose threshold the word reached. ``word``: the address of the
    counter (0: the watcher allocates one)."""

    cdef kx_watcher *w
    cdef readonly object keep          # the memory behind an external word
    cdef readonly bint closed

    def __cinit__(self, uintptr_t word=0, int64_t poll_ns=10000, cpus=(), object keep=None, int rt_priority=0):
        cdef int cpu_arr[256]
        cdef int ncpus = 0
        cdef int ret
        for c in cpus:
            if ncpus >= 256:
                break
            cpu_arr[ncpus] = c
            ncpus += 1
        self.w = NULL
        self.keep = keep
        with nogil:
            ret = kx_watcher_open(<uint64_t *>word, poll_ns, cpu_arr, ncpus, rt_priority, &self.w)
        check(ret, "kx_watcher_open")

    def __dealloc__(self):
        if self.w != NULL:
            with nogil:
                kx_watcher_free(self.w)
            self.w = NULL

    cdef inline kx_watcher *_w(self) except NULL:
        if self.w == NULL or self.closed:
            raise ClosedError("the watcher is closed")
        return self.w

    @property
    def word(self):
        """The counter's address."""
        return <uintptr_t>kx_watcher_word(self._w())

    @property
    def value(self):
        return kx_watcher_value(self._w())

    def bump(self, uint64_t n=1):
        """Add n to the counter and wake the thread; returns the new value."""
        cdef kx_watcher *w = self._w()
        cdef uint64_t v
        if n > <uint64_t>0xFFFFFFFFFFFFFFFF - kx_watcher_value(w):
            # the word would wrap, and entries armed above its new, small value never post
            raise InvalidArgumentError(f"bump({n}) would take the counter past 2**64 - 1 "
                                       f"(it is {kx_watcher_value(w)})")
        with nogil:
            v = kx_watcher_bump(w, n)
        return v

    def advance(self, uint64_t to):
        cdef kx_watcher *w = self._w()
        cdef uint64_t v
        with nogil:
            v = kx_watcher_advance(w, to)
        return v

    def arm(self, uint64_t threshold, uint64_t tag, Rail rail, fi_addr_t peer, uint32_t gen, uintptr_t src_base,
            RegionHandle region, uint64_t dst_base, uint64_t key, DirectMap direct, const uint64_t[::1] src_off,
            const uint64_t[::1] dst_off, const uint64_t[::1] length, imm, size_t iov, uint64_t max_write,
            uint64_t pack_min):
        """Arm the triples' writes (copied) for when the counter reaches ``threshold``."""
        cdef kx_watcher *w = self._w()
        cdef kx_rail *r = rail._rail()
        cdef size_t n = length.shape[0]
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef const uint64_t *so = NULL
        cdef const uint64_t *do_ = NULL
        cdef const uint64_t *ln = NULL
        cdef kx_watch *e = NULL
        cdef kx_direct *d = _direct(direct)
        cdef int ret
        if n:
            so = &src_off[0]
            do_ = &dst_off[0]
            ln = &length[0]
        if region.rail is not rail or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        with nogil:
            ret = kx_watch_arm(w, threshold, tag, r, peer, gen, <char *>src_base, region.desc, dst_base, key, d,
                               so, do_, ln, n, has_imm, imm_value, iov, max_write, pack_min, &e)
        check(ret, "kx_watch_arm")
        cdef WatchHandle h = WatchHandle.__new__(WatchHandle)
        h.watcher = self
        h.e = e
        h.rail = rail
        h.region = region
        _track_watches(region, [h])
        return h

    def arm_groups(self, const uint64_t[::1] thresholds, uint64_t tag, Rail rail, fi_addr_t peer, uint32_t gen,
                   uintptr_t src_base,
                   RegionHandle region, uint64_t dst_base, uint64_t key, DirectMap direct, const uint64_t[::1] src_off,
                   const uint64_t[::1] dst_off, const uint64_t[::1] length, const int64_t[::1] starts, imm,
                   size_t iov, uint64_t max_write, uint64_t pack_min):
        """Arm group g (triples ``[starts[g], starts[g+1])``) at ``thresholds[g]``, all in one
        GIL-free loop (the caller checked the triples and the bounds of ``starts``)."""
        cdef kx_watcher *w = self._w()
        cdef kx_rail *r = rail._rail()
        cdef Py_ssize_t g, ng = thresholds.shape[0]
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef int ret = 0
        cdef Py_ssize_t done_n = 0
        cdef int64_t a, b
        cdef uint64_t zero = 0
        cdef kx_direct *d = _direct(direct)
        if starts.shape[0] != ng + 1:
            raise InvalidArgumentError("starts must have one more entry than thresholds")
        if region.rail is not rail or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        import numpy
        ptrs = numpy.zeros(max(ng, 1), dtype=numpy.uintp)
        cdef size_t[::1] pv = ptrs
        cdef kx_watch *e = NULL
        with nogil:
            for g in range(ng):
                a = starts[g]
                b = starts[g + 1]
                ret = kx_watch_arm(w, thresholds[g], tag, r, peer, gen, <char *>src_base, region.desc, dst_base, key, d,
                                   &src_off[a] if b > a else &zero, &dst_off[a] if b > a else &zero,
                                   &length[a] if b > a else &zero, <size_t>(b - a), has_imm, imm_value, iov,
                                   max_write, pack_min, &e)
                if ret:
                    break
                pv[g] = <size_t>e
                done_n += 1
        out = []
        cdef WatchHandle h
        for g in range(done_n):
            h = WatchHandle.__new__(WatchHandle)
            h.watcher = self
            h.e = <kx_watch *>pv[g]
            h.rail = rail
            h.region = region
            out.append(h)
        _track_watches(region, out)
        if ret:
            for x in out:
                x.disarm()
            check(ret, "kx_watch_arm")
        return out

    def disarm_tag(self, uint64_t tag):
        cdef kx_watcher *w = self._w()
        cdef size_t n
        with nogil:
            n = kx_watcher_disarm_tag(w, tag)
        return n

    def latencies(self):
        """(call_ns, post_ns) lists: CPU bump -> first kx_write call / return, since the last call."""
        cdef int64_t[::1] a = _array_i64(8192)
        cdef int64_t[::1] b = _array_i64(8192)
        cdef kx_watcher *w = self._w()
        cdef size_t n
        with nogil:
            n = kx_watcher_latencies(w, &a[0], &b[0], 8192)
        return list(a[:n]), list(b[:n])

    def stats(self):
        cdef kx_watcher_stats s
        kx_watcher_get_stats(self._w(), &s)
        return {"armed": s.armed, "fired": s.fired, "wakeups": s.wakeups, "tid": s.tid, "rt": s.rt}

    def close(self, double timeout=5.0):
        """Stop and join the thread (armed entries never post). False if it could not be joined."""
        cdef int ret
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        if self.w == NULL or self.closed:
            return True
        self.closed = True
        with nogil:
            ret = kx_watcher_close(self.w, ns)
        return ret == 0


def _track_watches(RegionHandle region, list handles):
    """Remember entries armed from ``region`` (weakly: a dropped entry disarms itself), so
    that closing the region is refused while one may still post from it; forget finished ones."""
    if len(region.watches) >= 64:
        region.watches = [r for r in region.watches if r() is not None and (<WatchHandle>r()).busy]
    region.watches.extend(_weakref.ref(h) for h in handles)


def _array_i64(n):
    import numpy
    return numpy.zeros(n, dtype=numpy.int64)


@cython.no_gc_clear  # __dealloc__ needs its watcher and rail
cdef class WatchHandle:
    """One armed entry of a watcher: the writes it posts once the counter reaches its
    threshold. Duck-types a TransferHandle-backed Transfer for the messenger (``done``,
    ``posted``, ``num_writes``, ``error``, ``cancel``, ``wait``)."""

    cdef readonly WatcherHandle watcher
    cdef readonly Rail rail
    cdef readonly RegionHandle region   # the source registration, alive while the entry is
    cdef kx_watch *e
    cdef object __weakref__             # RegionHandle.watches

    def __dealloc__(self):
        if self.e != NULL:
            with nogil:
                kx_watch_free(self.watcher.w, self.e)
            self.e = NULL

    cdef kx_watch_state _state(self):
        cdef kx_watch_state s
        with nogil:
            kx_watch_get_state(self.watcher.w, self.e, &s)
        return s

    @property
    def state(self):
        """One of: armed, posting, posted, disarmed, failed."""
        return ("armed", "posting", "posted", "disarmed", "failed")[self._state().state]

    @property
    def threshold(self):
        return self._state().threshold

    @property
    def fired_ns(self):
        return self._state().fired_ns

    @property
    def busy(self):
        """Whether it may still post from, or have writes in flight from, its source
        registration: armed, posting, or posted and not yet complete (or still linked)."""
        cdef kx_watch_state s = self._state()
        cdef kx_transfer_state t
        if s.transfer != NULL:
            kx_transfer_get_state(s.transfer, &t)
            return bool(not t.done or t.linked)
        return s.state == KX_WATCH_ARMED or s.state == KX_WATCH_POSTING

    @property
    def num_writes(self):
        """Messages this entry posts once it fires (the message rule)."""
        return kx_watch_planned(self.e)

    @property
    def posted(self):
        cdef kx_watch_state s = self._state()
        cdef kx_transfer_state t
        if s.transfer == NULL:
            return 0
        kx_transfer_get_state(s.transfer, &t)
        return t.posted

    @property
    def done(self):
        """Disarmed or failed, or posted and every posted message completed."""
        cdef kx_watch_state s = self._state()
        cdef kx_transfer_state t
        if s.state == KX_WATCH_DISARMED or s.state == KX_WATCH_FAILED:
            return True
        if s.transfer == NULL:
            return False
        kx_transfer_get_state(s.transfer, &t)
        return bool(t.done)

    @property
    def error(self):
        cdef kx_watch_state s = self._state()
        cdef kx_transfer_state t
        if s.state == KX_WATCH_FAILED:
            return error_from("kx_write", s.error)
        if s.transfer == NULL:
            return None
        kx_transfer_get_state(s.transfer, &t)
        return error_from("fi_writemsg", t.error) if t.error else None

    def disarm(self):
        """True if it was still armed (it will never post); False if it was posted."""
        cdef int r
        with nogil:
            r = kx_watch_disarm(self.watcher.w, self.e)
        return bool(r)

    def cancel(self):
        """Disarm, or if already posted post nothing more of its transfer."""
        cdef kx_watch_state s
        if self.disarm():
            return
        s = self._state()
        if s.transfer != NULL:
            with nogil:
                kx_transfer_cancel(self.rail.r, s.transfer)

    def wait(self, timeout=None):
        """True once final (see ``done``); False if ``timeout`` seconds pass first."""
        cdef int fired = 0
        cdef int64_t slice_ns
        cdef kx_watch_state s
        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            slice_ns = _slice_ns(deadline)
            with nogil:
                fired = kx_watch_wait(self.watcher.w, self.e, slice_ns)
            if fired < 0:
                raise ClosedError("the watcher stopped with this entry armed: it never posts")
            if fired:
                break
            if _deadline_passed(deadline):
                return False
        s = self._state()
        if s.transfer == NULL:
            return True
        left = None if deadline is None else max(0.0, deadline - _time.monotonic())
        return _wait(self.rail.r, WAIT_TRANSFER, s.transfer, left)


include "_read.pxi"
