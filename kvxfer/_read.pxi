# _read.pxi: one-sided reads (src/read.c, kx_read), included at the end of _fabric.pyx.
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
