# RegionHandle: one registered memory region (fid_mr) on a Rail.

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
    cdef public object permit   # the region's permit slot (engine._PermitSlot), released when the registration goes
    cdef readonly list watches # weak references to the watch entries (or batches) armed from it
    cdef Py_ssize_t watches_kept # how many the last prune of watches kept (_track_watches)


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
        self.watches_kept = 0
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
