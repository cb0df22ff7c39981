# Transfers and counters: TransferHandle, TransferSet (kx_transfer), CounterHandle (kx_counter),
# and the message-rule helpers check_groups and count_messages.

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

    @property
    def done_ns(self):
        """CLOCK_MONOTONIC ns at which the expectation was met (its last arrival credited, or
        expect() for banked ones); 0 until then, and for one that ended otherwise (discarded,
        engine closed)."""
        return self._state().done_ns

    def wait(self, timeout=None):
        """True once all arrivals were credited; False if `timeout` seconds pass first."""
        return _wait(self.rail.r, WAIT_COUNTER, self.c, timeout)

    def set_callback(self):
        """Made without a callback: queue it for the dispatcher once met. True if it was met
        already (nothing queued)."""
        return bool(kx_counter_set_callback(self.rail.r, self.c))


@cython.no_gc_clear  # __dealloc__ needs its Rail
cdef class ArmHandle:
    """The native side of a decoder leg's arm (src/announce.c): its ANNOUNCE, checked and met
    by the thread that reads it when every write it counts has landed."""

    cdef readonly Rail rail
    cdef kx_arm *a

    def __dealloc__(self):
        if self.a != NULL:
            with nogil:
                kx_arm_free(self.rail.r, self.a)
            self.a = NULL

    @property
    def state(self):
        """0 open, 1 armed (its counter not yet taken), 2 closed."""
        return kx_arm_state(self.a)

    @property
    def waiters(self):
        """Callers inside wait() now, and holds."""
        return kx_arm_waiters(self.a)

    def hold(self, int delta):
        """A caller that will wait next counts as waiting (+1), until it no longer will (-1)."""
        kx_arm_hold(self.a, delta)

    def wait(self, timeout=None):
        """True once armed or closed; False if `timeout` seconds pass first."""
        return _wait(self.rail.r, WAIT_ARM, self.a, timeout)

    def close(self, uint64_t max_seq=0xFFFFFFFFFFFFFFFF):
        """Nothing arms it any more. ``(count, seq, CounterHandle)`` if an ANNOUNCE of seq <=
        `max_seq` had armed it (once: the expectation is the caller's now), else None (a later
        one's arming is reverted: its arrivals banked again)."""
        cdef uint64_t count = 0, seq = 0
        cdef kx_counter *c = NULL
        cdef int armed
        with nogil:
            armed = kx_arm_close(self.rail.r, self.a, max_seq, &count, &seq, &c)
        if not armed:
            return None
        cdef CounterHandle h = CounterHandle.__new__(CounterHandle)
        h.rail = self.rail
        h.c = c
        return count, seq, h


def announce_count(data, key, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least,
                   uint64_t most):
    """The arm's check of one message alone (kx_announce_count): the count it would arm, or -1."""
    cdef const uint8_t[::1] d = data
    cdef const uint8_t[::1] k = key
    return kx_announce_count(<const char *>&d[0] if len(data) else NULL, len(data),
                             &k[0] if len(key) else NULL, len(key), imm, src, dst, floor, least, most)


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


_np = None


def prepare_pairs(src_off, dst_off, length, counts):
    """Engine.write_pairs' fast path, one pass: for 1-D contiguous uint64 triples (each below
    2**62, of one length) and int64 counts (each >= 0, adding up to the triples), ``(so, do,
    ln, starts, which, nbytes)``: private copies of the triples, the posting groups' starts
    and pair indices (the pairs with a nonzero count) and the bytes in all; None for anything
    else (the caller's own checks then take it and name the defect)."""
    global _np
    cdef const uint64_t[::1] s, d, n
    cdef const int64_t[::1] c
    try:
        s, d, n, c = src_off, dst_off, length, counts
    except (TypeError, ValueError, BufferError):
        return None
    cdef Py_ssize_t m = n.shape[0], ng = c.shape[0], g, k = 0, i
    cdef uint64_t lim = 1ULL << 62, total = 0
    cdef int64_t acc = 0
    if s.shape[0] != m or d.shape[0] != m:
        return None
    if _np is None:
        import numpy
        _np = numpy
    so = _np.empty(m, _np.uint64)
    do = _np.empty(m, _np.uint64)
    ln = _np.empty(m, _np.uint64)
    cdef uint64_t[::1] so_, do_, ln_
    cdef int64_t[::1] st_, wh_
    so_, do_, ln_ = so, do, ln
    # checked as copied (each value read once): no other thread can change what was checked
    for i in range(m):
        so_[i], do_[i], ln_[i] = s[i], d[i], n[i]
        if so_[i] >= lim or do_[i] >= lim or ln_[i] >= lim or total + ln_[i] < total:
            return None
        total += ln_[i]
    cdef int64_t *c_ = <int64_t *>malloc(max(ng, 1) * sizeof(int64_t))
    if c_ == NULL:
        raise MemoryError()
    try:
        for g in range(ng):
            c_[g] = c[g]
            if c_[g] < 0 or c_[g] > m:
                return None
            acc += c_[g]
            if c_[g]:
                k += 1
        if acc != m:
            return None
        starts = _np.empty(k + 1, _np.int64)
        which = _np.empty(k, _np.int64)
        st_, wh_ = starts, which
        st_[0] = 0
        k = 0
        for g in range(ng):
            if c_[g]:
                wh_[k] = g
                st_[k + 1] = st_[k] + c_[g]
                k += 1
    finally:
        free(c_)
    return so, do, ln, starts, which, total


def pages_ascending(pages):
    """Whether 1-D contiguous int64 ``pages`` never go down (True, False), None for anything
    else: ``PageTemplate.by_source``'s question, in one call instead of three of numpy's."""
    cdef const int64_t[::1] p
    try:
        p = pages
    except (TypeError, ValueError, BufferError):
        return None
    cdef Py_ssize_t i
    for i in range(1, p.shape[0]):
        if p[i] < p[i - 1]:
            return False
    return True


def shift_pages(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, src_pages, dst_pages,
                uint64_t src_stride, uint64_t dst_stride, const int64_t[::1] order):
    """A page template's writes for some pages, in one pass: with ``m`` template triples and
    ``order`` indexing the ``n * m`` (page, entry) pairs as ``page * m + entry``, ``(a, b)``
    where ``a[k] = src_off[e] + src_pages[p] * src_stride`` (and ``b`` the same of the
    destination) for ``order[k] = p * m + e``; None where the pages are not 1-D contiguous
    int64 of the same count, or ``order`` is not a permutation's size (the caller's numpy then).
    Offsets wrap as numpy's uint64 do; the arming or posting checks bound them."""
    global _np
    cdef const int64_t[::1] sp, dp
    try:
        sp, dp = src_pages, dst_pages
    except (TypeError, ValueError, BufferError):
        return None
    cdef Py_ssize_t m = src_off.shape[0], n = sp.shape[0], k
    cdef Py_ssize_t total = order.shape[0]
    if dst_off.shape[0] != m or dp.shape[0] != n or total != n * m:
        return None
    for k in range(total):
        if order[k] < 0 or order[k] >= total:
            return None
    if _np is None:
        import numpy
        _np = numpy
    a = _np.empty(total, _np.uint64)
    b = _np.empty(total, _np.uint64)
    cdef uint64_t[::1] av = a, bv = b
    if total > 65536:           # a short one keeps the GIL: no hand-off to another thread
        with nogil:
            _shift(&src_off[0], &dst_off[0], &sp[0], &dp[0], src_stride, dst_stride, &order[0], total, m,
                   &av[0], &bv[0])
    elif total:
        _shift(&src_off[0], &dst_off[0], &sp[0], &dp[0], src_stride, dst_stride, &order[0], total, m, &av[0], &bv[0])
    return a, b


cdef void _shift(const uint64_t *so, const uint64_t *do_, const int64_t *sp, const int64_t *dp, uint64_t ss,
                 uint64_t ds, const int64_t *order, Py_ssize_t total, Py_ssize_t m, uint64_t *a,
                 uint64_t *b) noexcept nogil:
    cdef Py_ssize_t k, q, e
    for k in range(total):
        q = order[k] // m
        e = order[k] - q * m
        a[k] = so[e] + <uint64_t>sp[q] * ss
        b[k] = do_[e] + <uint64_t>dp[q] * ds


def count_messages(const uint64_t[::1] src_off, const uint64_t[::1] dst_off, const uint64_t[::1] length,
                   size_t iov, uint64_t max_write, uint64_t pack_min=0):
    """The native message rule, for checking kvxfer.wire.count_writes against it."""
    cdef size_t n = length.shape[0]
    if n == 0:
        return 0
    return kx_count_messages(&src_off[0], &dst_off[0], &length[0], n, iov, max_write, pack_min)
