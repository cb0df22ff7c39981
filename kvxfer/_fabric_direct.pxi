# The direct-copy path's handles: DirectMap (this process's mapping of a shm peer's memfd,
# kx_direct) and FenceTable (this engine's table of fence words its peers' copies check).

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
