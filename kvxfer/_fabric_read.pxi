# _fabric_read.pxi: one-sided reads (src/read.c, kx_read), included at the end of _fabric.pyx.
#
# A rail reads a peer's registered region into one of its own registrations: the pull road,
# where the decoder reads the prefiller's finished pages. Module-level functions over the
# handles of _fabric.pyx (Rail, RegionHandle, TransferHandle), kept in one file so the read
# family reads as one idea; a read's TransferHandle is the write's (planned, posted,
# completed, done, errno, wait, cancel), its completion errors named "fi_readmsg".

from kvxfer.errors import OutOfBoundsError

REMOTE_WRITE = KX_REMOTE_WRITE   #: a peer may write the region (mr_reg's remote mask)
REMOTE_READ = KX_REMOTE_READ     #: a peer may read it


def read(Rail rail, fi_addr_t peer, uint32_t gen, RegionHandle region, uint64_t remote_base, uint64_t key,
         uint64_t remote_len, const uint64_t[::1] local_off, const uint64_t[::1] remote_off,
         const uint64_t[::1] length, size_t iov, uint64_t max_read):
    """Read ``length[i]`` bytes from ``remote_off[i]`` of the peer's region (at ``remote_base``
    with ``key``, ``remote_len`` bytes) to ``local_off[i]`` of ``region`` (a RegionHandle of
    ``rail``), posting every message (the message rule's rules 1 and 2, at most ``iov`` pieces
    and ``max_read`` bytes each) without the GIL; completion on this rail's CQ. Raises
    OutOfBoundsError, with nothing posted, where a triple leaves either region;
    InvalidArgumentError for arrays of different lengths or limits the provider refuses.
    ``gen``: the peer's slot generation from ``av_insert``."""
    cdef kx_rail *r = rail._rail()
    cdef size_t n = length.shape[0], i
    cdef const uint64_t *lo = NULL
    cdef const uint64_t *ro = NULL
    cdef const uint64_t *ln = NULL
    cdef kx_transfer *x = NULL
    cdef int ret
    cdef uint64_t local_len
    if local_off.shape[0] != <Py_ssize_t>n or remote_off.shape[0] != <Py_ssize_t>n:
        raise InvalidArgumentError("read: offset and length arrays differ in length")
    if region.rail is not rail or region.mr == NULL:
        raise ClosedError("local registration is closed or belongs to another rail")
    local_len = region.nbytes
    for i in range(n):        # the native layer refuses these too; here they get their own class
        if (length[i] > local_len or local_off[i] > local_len - length[i]
                or length[i] > remote_len or remote_off[i] > remote_len - length[i]):
            raise OutOfBoundsError(f"read {i}: {length[i]} bytes at local {local_off[i]} / remote "
                                   f"{remote_off[i]} leave the regions ({local_len} / {remote_len} bytes)")
    if n:
        lo, ro, ln = &local_off[0], &remote_off[0], &length[0]
    region.busy += 1          # RegionHandle.close refuses while a post is under way
    with nogil:
        ret = kx_read(r, peer, gen, <char *>region.ptr, region.desc, local_len, remote_base, key, remote_len,
                      lo, ro, ln, n, iov, max_read, &x)
    if ret:
        region.busy -= 1
        if ret == -FI_EINVAL:
            raise InvalidArgumentError(f"read: iov={iov} / max_read={max_read} are not this provider's limits")
        check(ret, "kx_read")
    # recorded before any Python code can run (as Rail._post)
    cdef TransferHandle t = TransferHandle.__new__(TransferHandle)
    t.rail = rail
    t.x = x
    t.region = region
    if not t.done or t.linked:
        rail.pending.append(t)
    region.busy -= 1
    if len(rail.pending) > max(64, 2 * rail.pruned):
        rail.prune()
    return t


def read_groups(Rail rail, fi_addr_t peer, uint32_t gen, list regions, const uint64_t[::1] remote_base,
                const uint64_t[::1] key, const uint64_t[::1] remote_len, const int64_t[::1] pair,
                const uint64_t[::1] local_off, const uint64_t[::1] remote_off, const uint64_t[::1] length,
                const int64_t[::1] starts, size_t iov, uint64_t max_read):
    """Many reads from one peer in one GIL-free loop, ``Rail.write_groups``'s mirror: group g
    reads triples ``[starts[g], starts[g+1])`` into ``regions[pair[g]]`` (RegionHandles of
    ``rail``) from the peer's region at ``remote_base[pair[g]]`` with ``key[pair[g]]``, of
    ``remote_len[pair[g]]`` bytes: one ``kx_read`` (one native transfer) per group, seen as one
    TransferSet. Every triple of every group is checked against both its regions before the
    first is posted: OutOfBoundsError, nothing posted."""
    cdef kx_rail *r = rail._rail()
    cdef Py_ssize_t ng = pair.shape[0], npairs = len(regions), g, p, i
    cdef int ret = 0
    cdef Py_ssize_t posted = 0
    cdef RegionHandle m
    if starts.shape[0] != ng + 1 or remote_base.shape[0] < npairs or key.shape[0] < npairs \
            or remote_len.shape[0] < npairs:
        raise InvalidArgumentError("read_groups: group tables differ in length")
    if ng and (starts[0] < 0 or starts[ng] > length.shape[0] or local_off.shape[0] < starts[ng]
               or remote_off.shape[0] < starts[ng]):
        raise InvalidArgumentError("read_groups: group bounds exceed the triples")
    for g in range(ng):
        if starts[g + 1] < starts[g] or not 0 <= pair[g] < npairs:
            raise InvalidArgumentError("read_groups: bad group bounds or pair index")
    cdef TransferSet t = TransferSet.__new__(TransferSet)
    t.rail = rail
    t.regions = tuple([regions[pair[g]] for g in range(ng)])
    for g in range(ng):
        m = <RegionHandle?>t.regions[g]
        if m.rail is not rail or m.mr == NULL:
            raise ClosedError("local registration is closed or belongs to another rail")
        p = pair[g]
        for i in range(starts[g], starts[g + 1]):
            if (length[i] > m.nbytes or local_off[i] > m.nbytes - length[i]
                    or length[i] > remote_len[p] or remote_off[i] > remote_len[p] - length[i]):
                raise OutOfBoundsError(f"read_groups: group {g}, read {i - starts[g]}: {length[i]} bytes at local "
                                       f"{local_off[i]} / remote {remote_off[i]} leave the regions "
                                       f"({m.nbytes} / {remote_len[p]} bytes)")
    if ng == 0:
        return t
    t.xs = <kx_transfer **>calloc(ng, sizeof(kx_transfer *))
    cdef void **descs = <void **>malloc(ng * sizeof(void *))
    cdef char **bases = <char **>malloc(ng * sizeof(char *))
    cdef uint64_t *lens = <uint64_t *>malloc(ng * sizeof(uint64_t))
    if t.xs == NULL or descs == NULL or bases == NULL or lens == NULL:
        free(descs)
        free(bases)
        free(lens)
        raise MemoryError()
    try:
        for g in range(ng):
            m = <RegionHandle>t.regions[g]
            descs[g] = m.desc
            bases[g] = <char *>m.ptr
            lens[g] = m.nbytes
        for g in range(ng):          # RegionHandle.close refuses while a post is under way
            (<RegionHandle>t.regions[g]).busy += 1
        with nogil:
            kx_posting_begin(r)          # one burst: the progress thread waits it out once
            for g in range(ng):
                p = pair[g]
                ret = kx_read(r, peer, gen, bases[g], descs[g], lens[g], remote_base[p], key[p], remote_len[p],
                              &local_off[0] + starts[g], &remote_off[0] + starts[g], &length[0] + starts[g],
                              <size_t>(starts[g + 1] - starts[g]), iov, max_read, &t.xs[g])
                if ret:
                    break
                posted += 1
            kx_posting_end(r)
        # recorded before any Python code can run (as Rail.write_groups)
        t.n = posted
        if not t.done or t.linked:
            rail.pending_sets.append(t)
        for g in range(ng):
            (<RegionHandle>t.regions[g]).busy -= 1
    finally:
        free(descs)
        free(bases)
        free(lens)
    if ret:
        t.cancel()                   # what was posted completes; nothing more goes out
        if ret == -FI_EINVAL:
            raise InvalidArgumentError(f"read_groups: iov={iov} / max_read={max_read} are not this provider's limits")
        check(ret, "kx_read")
    if len(rail.pending_sets) > max(64, 2 * rail.pruned_sets):
        rail.prune()
    return t
