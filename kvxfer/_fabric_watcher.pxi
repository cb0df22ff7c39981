# The watcher: WatcherHandle (kx_watcher, a thread posting armed entries at thresholds),
# WatchHandle (one armed entry) and WatchBatchHandle (the entries of one arm_groups call).

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
            uint64_t pack_min, uint64_t src_size, uint64_t dst_size):
        """Arm the triples' writes (copied, and checked on the copy as ``arm_groups`` checks
        them) for when the counter reaches ``threshold``."""
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
        cdef kx_watch_bounds b
        b.base, b.src_size, b.dst_size, b.n = 0, src_size, dst_size, n
        if src_off.shape[0] != <Py_ssize_t>n or dst_off.shape[0] != <Py_ssize_t>n:
            raise InvalidArgumentError(f"triples differ in length: {src_off.shape[0]}, {dst_off.shape[0]}, {n}")
        if n:
            so = &src_off[0]
            do_ = &dst_off[0]
            ln = &length[0]
        if region.rail is not rail or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        with nogil:
            ret = kx_watch_arm(w, threshold, tag, r, peer, gen, <char *>src_base, region.desc, dst_base, key, d,
                               so, do_, ln, n, &b, has_imm, imm_value, iov, max_write, pack_min, &e)
        if ret == -ERANGE:
            raise InvalidArgumentError("a triple or the threshold is outside its bounds (changed while being armed?)")
        check(ret, "kx_watch_arm")
        cdef WatchHandle h = WatchHandle.__new__(WatchHandle)
        h.watcher = self
        h.e = e
        h.rail = rail
        h.region = region
        _track_watches(region, h)
        return h

    def arm_groups(self, const uint64_t[::1] thresholds, uint64_t base, uint64_t tag, Rail rail, fi_addr_t peer,
                   uint32_t gen, uintptr_t src_base, RegionHandle region, uint64_t dst_base, uint64_t key,
                   DirectMap direct, const uint64_t[::1] src_off, const uint64_t[::1] dst_off,
                   const uint64_t[::1] length, const int64_t[::1] starts, imm, size_t iov, uint64_t max_write,
                   uint64_t pack_min, uint64_t src_size, uint64_t dst_size):
        """Arm group g (triples ``[starts[g], starts[g+1])``) at ``base + thresholds[g]``, in one
        native call without the GIL, all or nothing. The arguments are checked there, on the
        entries' own copies (``kx_watch_bounds``: thresholds, offsets and lengths below 2**62,
        ranges within ``src_size`` / ``dst_size``, ``starts`` from 0 to the triples, not
        decreasing): a WatchBatchHandle, or None where a check failed (nothing armed; the
        caller's own checks then name the defect)."""
        cdef kx_watcher *w = self._w()
        cdef kx_rail *r = rail._rail()
        cdef Py_ssize_t g, ng = thresholds.shape[0], m = length.shape[0]
        cdef int has_imm = imm is not None
        cdef uint32_t imm_value = imm if has_imm else 0
        cdef int ret = 0
        cdef uint64_t zero = 0
        cdef kx_direct *d = _direct(direct)
        cdef kx_watch_bounds bounds
        bounds.base, bounds.src_size, bounds.dst_size, bounds.n = base, src_size, dst_size, <size_t>m
        if starts.shape[0] != ng + 1 or src_off.shape[0] != m or dst_off.shape[0] != m:
            return None
        if region.rail is not rail or region.mr == NULL:
            raise ClosedError("source registration is closed or belongs to another rail")
        cdef kx_watch **pv = <kx_watch **>malloc(max(ng, 1) * sizeof(kx_watch *))
        if pv == NULL:
            raise MemoryError()
        cdef const uint64_t *th = &thresholds[0] if ng else &zero
        cdef WatchHandle h
        cdef WatchBatchHandle b
        cdef int64_t planned = 0
        cdef uint64_t nbytes = 0
        cdef Py_ssize_t wrapped = 0          # entries pv[:wrapped] belong to a WatchHandle
        cdef bint armed = False
        try:
            with nogil:
                ret = kx_watch_arm_groups(w, <size_t>ng, th, &starts[0], tag, r, peer, gen, <char *>src_base,
                                          region.desc, dst_base, key, d, &src_off[0] if m else &zero,
                                          &dst_off[0] if m else &zero, &length[0] if m else &zero, &bounds,
                                          has_imm, imm_value, iov, max_write, pack_min, pv)
            if ret == -ERANGE:
                return None
            check(ret, "kx_watch_arm_groups")      # all or nothing: no entry armed on an error
            armed = True
            out = []
            for g in range(ng):
                h = WatchHandle.__new__(WatchHandle)
                h.watcher = self
                h.e = pv[g]
                wrapped = g + 1
                h.rail = rail
                h.region = region
                planned += kx_watch_planned(h.e)
                nbytes += kx_watch_bytes(h.e)
                out.append(h)
        finally:
            if armed:
                # an exception (MemoryError) before every entry had its handle: the rest would
                # stay armed with nobody to disarm them, and post after their region closed.
                # kx_watch_free disarms (waiting out a post in progress) and frees; the handles
                # made so far do the same for theirs when they go.
                for g in range(wrapped, ng):
                    with nogil:
                        kx_watch_free(w, pv[g])
            free(pv)
        b = WatchBatchHandle.__new__(WatchBatchHandle)
        b.entries = tuple(out)
        b.num_writes = planned
        b.nbytes = nbytes
        _track_watches(region, b)      # one reference for the batch, not one per entry
        return b

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


def _track_watches(RegionHandle region, armed):
    """Remember an entry (WatchHandle) or the entries of one arm_groups call
    (WatchBatchHandle) armed from ``region``, weakly: a dropped entry disarms itself, and a
    batch's entries live only as long as the batch. Closing the region is refused while one
    may still post from it; finished ones are forgotten."""
    # pruned once the list doubled since the last prune: each check takes the watcher's lock
    if len(region.watches) >= max(64, 2 * region.watches_kept):
        region.watches = [r for r in region.watches if _tracked_busy(r)]
        region.watches_kept = len(region.watches)
    region.watches.append(_weakref.ref(armed))


cdef bint _tracked_busy(ref):
    """A region's weak reference (its .watches) to an entry or a batch that is still alive and busy."""
    h = ref()
    if h is None:
        return False
    if type(h) is WatchBatchHandle:
        return (<WatchBatchHandle>h).busy
    return (<WatchHandle>h).busy


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
    def nbytes(self):
        """The bytes it writes (its lengths' sum, fixed at arming)."""
        return kx_watch_bytes(self.e)

    @property
    def fired_ns(self):
        return self._state().fired_ns

    @property
    def busy(self):
        """Whether it may still post from, or have writes in flight from, its source
        registration: armed, posting, or posted and not yet complete (or still linked)."""
        return _watch_busy(self)

    @property
    def num_writes(self):
        """Messages this entry posts once it fires (the message rule)."""
        return kx_watch_planned(self.e)

    @property
    def posted(self):
        return _watch_posted(self)

    @property
    def done(self):
        """Disarmed or failed, or posted and every posted message completed."""
        return _watch_done(self)

    @property
    def error(self):
        return _watch_error(self)

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


cdef int64_t _watch_posted(WatchHandle h):
    cdef kx_watch_state s = h._state()
    cdef kx_transfer_state t
    if s.transfer == NULL:
        return 0
    kx_transfer_get_state(s.transfer, &t)
    return t.posted


cdef bint _watch_done(WatchHandle h):
    cdef kx_watch_state s = h._state()
    cdef kx_transfer_state t
    if s.state == KX_WATCH_DISARMED or s.state == KX_WATCH_FAILED:
        return True
    if s.transfer == NULL:
        return False
    kx_transfer_get_state(s.transfer, &t)
    return bool(t.done)


cdef object _watch_error(WatchHandle h):
    cdef kx_watch_state s = h._state()
    cdef kx_transfer_state t
    if s.state == KX_WATCH_FAILED:
        return error_from("kx_write", s.error)
    if s.transfer == NULL:
        return None
    kx_transfer_get_state(s.transfer, &t)
    return error_from("fi_writemsg", t.error) if t.error else None


@cython.final
@cython.no_gc_clear  # __dealloc__ needs its entries
cdef class WatchBatchHandle:
    """The entries (WatchHandle) of one WatcherHandle.arm_groups call, in group order, with
    what the messenger asks of them all (done, posted, error, cancel, wait, how many are in a
    state) answered in one native loop instead of a Python call per entry. Its entries live
    as long as it does: dropping it disarms every one still armed."""

    cdef readonly tuple entries
    cdef readonly int64_t num_writes    # the messages they post once fired (fixed at arming)
    cdef readonly uint64_t nbytes       # the bytes they write
    cdef object __weakref__             # RegionHandle.watches

    @property
    def busy(self):
        """Whether one of its entries may still post from, or have writes in flight from,
        the source registration (WatchHandle.busy)."""
        cdef WatchHandle h
        for h in self.entries:
            if _watch_busy(h):
                return True
        return False

    def __dealloc__(self):
        # the region's weak reference to this batch is already gone: disarm what is still
        # armed now, with the GIL held (the watcher thread never takes it), so no close of the
        # region can run before the entries are safe; their handles free them after
        if self.entries:
            _disarm_all(self.entries, NULL)

    def __len__(self):
        return len(self.entries)

    @property
    def posted(self):
        cdef int64_t n = 0
        cdef WatchHandle h
        for h in self.entries:
            n += _watch_posted(h)
        return n

    @property
    def done(self):
        cdef WatchHandle h
        for h in self.entries:
            if not _watch_done(h):
                return False
        return True

    @property
    def error(self):
        cdef WatchHandle h
        for h in self.entries:
            err = _watch_error(h)
            if err is not None:
                return err
        return None

    def count(self, str state, uint64_t above=0, uint64_t upto=0xFFFFFFFFFFFFFFFF):
        """Entries in ``state`` (armed, posting, posted, disarmed, failed) whose threshold is
        in ``(above, upto]``."""
        cdef int code = ("armed", "posting", "posted", "disarmed", "failed").index(state)
        cdef Py_ssize_t n = 0
        cdef WatchHandle h
        cdef kx_watch_state s
        for h in self.entries:
            s = h._state()
            if <int>s.state == code and above < s.threshold <= upto:
                n += 1
        return n

    def cancel(self):
        """WatchHandle.cancel of every entry: the armed ones disarmed in one native call (one
        walk of the armed list, not one per entry), then what the posted ones still post
        stopped."""
        cdef Py_ssize_t n = len(self.entries), i
        if n == 0:
            return
        cdef int *gone = <int *>malloc(n * sizeof(int))
        if gone == NULL:
            raise MemoryError()
        try:
            _disarm_all(self.entries, gone)
            for i in range(n):
                if not gone[i]:
                    (<WatchHandle>self.entries[i]).cancel()     # posted: stop what it still posts
        finally:
            free(gone)

    def wait(self, timeout=None):
        """True once every entry is final; False if ``timeout`` seconds pass first."""
        cdef WatchHandle h
        deadline = None if timeout is None else _time.monotonic() + timeout
        for h in self.entries:
            if not h.wait(None if deadline is None else max(0.0, deadline - _time.monotonic())):
                return False
        return True


cdef bint _watch_busy(WatchHandle h):
    cdef kx_watch_state s = h._state()
    cdef kx_transfer_state t
    if s.transfer != NULL:
        kx_transfer_get_state(s.transfer, &t)
        return bool(not t.done or t.linked)
    return s.state == KX_WATCH_ARMED or s.state == KX_WATCH_POSTING


cdef int _disarm_all(tuple entries, int *gone) except -1:
    """kx_watch_disarm_many over a batch's entries (one watcher's); ``gone`` (n ints, or NULL)
    gets each answer. Holds the GIL when ``gone`` is NULL (the batch's __dealloc__)."""
    cdef Py_ssize_t n = len(entries), i
    cdef kx_watch **es = <kx_watch **>malloc(n * sizeof(kx_watch *))
    cdef int *own = gone if gone != NULL else <int *>malloc(n * sizeof(int))
    if es == NULL or own == NULL:
        free(es)
        if gone == NULL:
            free(own)
        raise MemoryError()
    cdef kx_watcher *w = (<WatchHandle>entries[0]).watcher.w
    for i in range(n):
        es[i] = (<WatchHandle>entries[i]).e
    if gone == NULL:
        kx_watch_disarm_many(w, es, <size_t>n, own)
    else:
        with nogil:
            kx_watch_disarm_many(w, es, <size_t>n, own)
    free(es)
    if gone == NULL:
        free(own)
    return 0
