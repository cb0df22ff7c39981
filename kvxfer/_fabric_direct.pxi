# The direct-copy path's handles: DirectMap (this process's mapping of a shm peer's memfd,
# kx_direct) and PermitTable (this engine's table of permit words its peers' copies check).

cdef class DirectMap:
    """This process's own MAP_SHARED mapping of a shm peer's memfd region, opened from its
    descriptor's host share (``path`` = ``/proc/<pid>/fd/<fd>``, checked to be the file
    ``dev``/``ino``, sealed against shrinking, holding ``[offset, offset + nbytes)``;
    src/direct.c). Writes through it are direct: a memcpy per message, plus a 0-byte write
    carrying the imm. Native transfers (until their posting ends) and armed watch entries
    take their own references, so the mapping outlives this handle as long as they copy. Raises FabricError
    (``kx_direct_open``) when it cannot map; the engine then writes over RMA.

    ``permit``: ``(path, dev, ino, slot, generation, owner)`` of the target's permit table
    (``/proc/<pid>/fd/<fd>`` of its memfd, checked like the data), whose header must name
    ``owner`` (the descriptor's 8-byte owner digest) and whose record for ``slot`` must cover
    the data's file and range: every copy then takes a writer on word ``slot`` only while it
    carries ``generation`` and is not revoked, and fails its transfer once the target closed
    the region (src/direct.c). The engine maps no host share without one (``permitted``)."""

    cdef kx_direct *d
    cdef readonly size_t nbytes
    cdef readonly bint permitted

    def __cinit__(self, str path, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t nbytes, permit=None):
        cdef bytes p = path.encode()
        cdef const char *cp = p
        cdef bytes fp
        cdef const char *fcp
        cdef uint64_t fdev, fino
        cdef uint32_t slot, gen
        cdef const uint8_t[:] owner
        cdef int ret
        self.d = NULL
        self.permitted = False
        if permit is not None:
            fpath, fdev, fino, slot, gen, fowner = permit
            fp = str(fpath).encode()
            owner = bytes(fowner)
            if owner.shape[0] != KX_OWNER_BYTES:
                raise InvalidArgumentError(f"a permit's owner is {KX_OWNER_BYTES} bytes")
        with nogil:
            ret = kx_direct_open(cp, dev, ino, offset, nbytes, &self.d)
        check(ret, "kx_direct_open")
        self.nbytes = nbytes
        if permit is not None:
            fcp = fp
            with nogil:
                ret = kx_direct_permit(self.d, fcp, fdev, fino, slot, gen, &owner[0])
            check(ret, "kx_direct_permit")       # __dealloc__ unmaps the data
            self.permitted = True

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


cdef class PermitTable:
    """The target's side of the direct-write permit (src/direct.c): ``slots`` 64-bit words
    [generation: 32 | revoked: 1 | writers: 31] in a sealed memfd, mapped here and held open
    as ``fd`` (peers open it through ``/proc/<pid>/fd/<fd>``), with each slot's record of its
    region and a header naming ``owner`` (the engine's 8-byte owner digest). The engine hands
    one slot to each region that offers a host share. Unmapped and closed when collected (a
    region that still revokes holds a reference)."""

    cdef int _fd
    cdef uint64_t *words
    cdef readonly size_t slots

    def __cinit__(self, size_t slots, bytes owner):
        cdef int ret
        cdef const uint8_t *o = owner
        self._fd = -1
        self.words = NULL
        self.slots = slots
        if len(owner) != KX_OWNER_BYTES:
            raise InvalidArgumentError(f"a permit table's owner is {KX_OWNER_BYTES} bytes")
        with nogil:
            ret = kx_permit_table_open(slots, o, &self._fd, &self.words)
        check(ret, "kx_permit_table_open")

    def __dealloc__(self):
        kx_permit_table_close(self._fd, self.words, self.slots)
        self._fd = -1
        self.words = NULL

    @property
    def fd(self):
        return self._fd

    cdef uint64_t *_word(self, size_t slot) except NULL:
        if slot >= self.slots:
            raise InvalidArgumentError(f"permit slot {slot} out of range")
        return &self.words[slot]

    def word(self, size_t slot):
        """The slot's word as it stands (for tests)."""
        return _load_word(self._word(slot))

    def issue(self, size_t slot, uint64_t dev, uint64_t ino, uint64_t offset, uint64_t nbytes):
        """Open a free slot for a new region, bytes ``[offset, offset + nbytes)`` of the memfd
        (dev, ino), recorded for its peers to check; returns the generation its descriptor
        names."""
        self._word(slot)
        return kx_permit_issue(self.words, self.slots, slot, dev, ino, offset, nbytes)

    def revoke(self, size_t slot, double timeout):
        """Refuse every later copy into the slot's region and wait up to ``timeout`` s for the
        copies in progress; returns the writers still inside (0: none)."""
        cdef uint64_t *w = self._word(slot)
        cdef int64_t ns = <int64_t>(timeout * 1e9)
        cdef uint32_t left
        with nogil:
            left = kx_permit_revoke(w, ns)
        return left

    def retire(self, size_t slot):
        """After deregistration: bump the slot's generation. False where a writer never left
        (the slot must not serve another region)."""
        return kx_permit_retire(self._word(slot)) == 0


cdef inline kx_direct *_direct(object direct) except? NULL:
    """The native mapping of a DirectMap, NULL for None (an RMA write)."""
    if direct is None:
        return NULL
    return (<DirectMap?>direct).d
