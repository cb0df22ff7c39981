# Rail: one libfabric RDM endpoint with its CQ, AV and progress thread (kx_rail), and every
# native call made on it: posting, peers, counters, control messages, draining and closing.

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

    def set_progress_rt(self, int priority):
        """Before start(): the progress thread puts itself at SCHED_FIFO `priority` (0: normal)."""
        check(kx_rail_set_progress_rt(self._rail(), priority), "set_progress_rt")

    def progress_rt(self):
        """(priority the progress thread runs at, 0: normal; errno SCHED_FIFO was refused with, 0: none)."""
        cdef int err = 0
        cdef int prio = kx_rail_progress_rt(self._rail(), &err)
        return prio, err

    def stats(self):
        cdef kx_rail_stats s
        kx_rail_get_stats(self._rail(), &s)
        return {"writes_posted": s.writes_posted, "direct_writes": s.direct_writes,
                "direct_revoked": s.direct_revoked, "errors": s.errors,
                "outstanding": s.outstanding, "bell_rings": s.bell_rings, "bell_wakes": s.bell_wakes,
                "dead_answered": s.dead_answered, "drives": s.drives, "drives_got": s.drives_got,
                "naps": s.naps, "armed": s.armed}

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

    def av_remove(self, fi_addr_t addr, double wait=1.0, uint32_t gen=0):
        """Remove `addr` once no post is inside a provider call to it (later ones fail with
        ENOTCONN at once); False if one still was after `wait` s (the slot stays, unused).
        `gen` (from ``av_insert``; 0: unchecked): a slot already removed (a same-process shm
        peer that closed is dropped natively, src/forget.c) or reused since is left alone."""
        cdef kx_rail *r = self._rail()
        cdef int ret
        cdef int64_t ns = <int64_t>(wait * 1e9)
        with nogil:
            ret = kx_av_remove(r, addr, gen, ns)
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
            if _tracked_busy(ref):
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

    def arm_key(self, key):
        """The messenger's secret (bytes, at most 256; empty: ANNOUNCEs carry no tag)."""
        cdef const uint8_t[::1] k = key
        check(kx_arm_key(self._rail(), &k[0] if len(key) else NULL, len(key)), "kx_arm_key")

    def arm_open(self, uint32_t imm, uint64_t src, uint64_t dst, uint64_t floor, uint64_t least, uint64_t most):
        """A decoder leg's arm (src/announce.c): its ANNOUNCE met natively when it arrives."""
        cdef kx_arm *a = NULL
        check(kx_arm_open(self._rail(), imm, src, dst, floor, least, most, &a), "kx_arm_open")
        cdef ArmHandle h = ArmHandle.__new__(ArmHandle)
        h.rail = self
        h.a = a
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
        slices until `timeout` (seconds, None: forever), answering signals in between.
        `timeout` 0: one try, False at once if the queue is full."""
        cdef kx_rail *r = self._rail()
        cdef size_t n = data.shape[0]
        cdef const char *p = <const char *>"\0"
        if n:
            p = <const char *>&data[0]
        cdef int ret
        if timeout is not None and timeout == 0:
            with nogil:
                ret = kx_send_try(r, peer, gen, p, n)
            if ret == -FI_EAGAIN:
                return False
            check(ret, "fi_send")
            return True
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

    # -- the revoke exchange (src/revoke.c, kvxfer/engine/revoke.py) ------------------------
    def ctl_send(self, fi_addr_t peer, uint32_t gen, int kind, uint64_t token, const uint8_t[::1] data, timeout=1.0):
        """Post a HELLO, BYE or REVOKE (``kind``: ``CTL_HELLO``, ``CTL_BYE``, ``CTL_REVOKE``) carrying ``token``;
        False if the provider's queue stayed full for ``timeout`` s."""
        cdef kx_rail *r = self._rail()
        cdef size_t n = data.shape[0]
        cdef const char *p = <const char *>"\0"
        if n:
            p = <const char *>&data[0]
        cdef int ret
        deadline = _time.monotonic() + timeout
        while True:
            with nogil:
                ret = kx_ctl_send(r, peer, gen, kind, token, p, n)
            if ret != -FI_EAGAIN:
                break
            if _deadline_passed(deadline):
                return False
            r = self._rail()
        check(ret, "fi_sendmsg")
        return True

    def ctl_take(self, double timeout):
        """The tokens answered since the last call (ACKs; our sends' completions with bit 63,
        failed ones with bit 62 too), waiting up to ``timeout`` s for the first."""
        cdef kx_rail *r = self._rail()
        cdef uint64_t buf[64]
        cdef size_t n = 0
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        with nogil:
            kx_ctl_take(r, ns, buf, 64, &n)
        return [buf[i] for i in range(n)]

    def ctl_hellos(self):
        """(kind, address) of each HELLO or BYE received since the last call, in order."""
        cdef kx_rail *r = self._rail()
        cdef kx_msg *m = NULL
        out = []
        while kx_ctl_hello(r, &m):
            try:
                out.append((<uint8_t>kx_msg_data(m)[0],
                            PyBytes_FromStringAndSize(kx_msg_data(m) + 1, kx_msg_len(m) - 1)))
            finally:
                kx_msg_free(m)
        return out

    def flush(self, double wait=0.1):
        """Handle what the CQ holds now (a HELLO delivered before this call is seen after)."""
        cdef kx_rail *r = self._rail()
        cdef int64_t ns = <int64_t>(wait * 1e9)
        with nogil:
            kx_rail_flush(r, ns)

    @property
    def revoked_keys(self):
        """Keys of peers' regions revoked so far."""
        return kx_revoked_count(self._rail())

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
