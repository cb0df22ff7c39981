"""Registered memory: local regions, peers' regions, region pairs, the buffer door, permit slots.

A ``MemoryRegion`` is local memory registered on every rail (it keeps its buffer alive); a
``RemoteRegion`` a peer's, decoded from its descriptor; ``RegionPairs`` a checked table of
both for ``Engine.write_pairs``. ``_resolve_buffer`` is the one door memory comes in by. A
region offering a host share holds a ``_PermitSlot``: its word in the engine's permit table,
revoked before ``close()`` returns, so no peer's direct copy lands after it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kvxfer import _maps, wire
from kvxfer._check import is_int
from kvxfer.engine.rails import _fabric
from kvxfer.errors import (
    ArgumentTypeError,
    ClosedError,
    FabricError,
    InvalidArgumentError,
    KvxferError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from kvxfer.engine.engine import Engine
    from kvxfer.engine.rails import Peer

#: words in an engine's permit table (64 KiB): regions offering a host share at once
PERMIT_SLOTS = 8192
#: how long closing a region waits for peers' direct copies in progress (a writer killed
#: mid-copy never leaves; the slot is then retired, never reused)
PERMIT_WAIT = 1.0


class _PermitSlot:
    """A region's word in its engine's permit table (src/direct.c, ``_fabric.PermitTable``):
    peers copy into the region directly only while the word carries ``generation`` and is not
    revoked. Revoked when the region closes (or is dropped), released after deregistration:
    the generation is bumped and the slot serves the next region."""

    def __init__(self, engine: "Engine", table: Any, slot: int, generation: int, dev: int, inode: int) -> None:
        self._engine = engine
        self._table = table
        self._lock = threading.Lock()
        self._left: Optional[int] = None     # writers still inside after the wait
        self.slot = slot
        self.generation = generation
        self.dev = dev
        self.inode = inode

    def wire(self) -> wire.Permit:
        return wire.Permit(self._table.fd, self.dev, self.inode, self.slot, self.generation)

    def revoke(self, wait: bool = True) -> None:
        """Refuse every copy from now on; with ``wait``, wait up to ``PERMIT_WAIT`` s (once)
        for the copies in progress."""
        with self._lock:
            table = self._table
            if table is None or self._left is not None:
                return
            if wait:
                self._left = table.revoke(self.slot, PERMIT_WAIT)
            else:
                table.revoke(self.slot, 0.0)

    def release(self) -> None:
        """Once deregistered: bump the generation and give the slot back (idempotent)."""
        self.revoke()
        with self._lock:
            table, self._table = self._table, None
        if table is not None:
            self._engine._permit_give(self.slot, self._left == 0 and table.retire(self.slot))

    def __del__(self) -> None:
        try:
            self.release()     # the last reference, its registration's, went: deregistered
        except Exception:
            pass


class MemoryRegion:
    """Local memory registered with the engine. Keeps its buffer alive until closed."""

    def __init__(self, engine: "Engine", handles: list, obj: Any, ptr: int, nbytes: int, device: str,
                 remote: bool = True, host_share: Optional[wire.HostShare] = None,
                 permit: Optional["_PermitSlot"] = None, read_handles: Optional[list] = None) -> None:
        self.engine = engine
        self.remote = remote
        self._handles = handles      # one RegionHandle (registration) per rail
        #: the separate read registration (FI_REMOTE_READ only) of a region registered
        #: ``readable=True``, one per rail; its keys travel only as the descriptor's read keys
        self._read_handles = read_handles or []
        self.readable = bool(read_handles)
        self._obj = obj
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._host_share = host_share    # a shared memfd mapping: shm peers may write directly
        self._permit = permit              # its slot in the engine's permit table (with a share)

    def descriptor(self, *, reads_only: bool = False) -> bytes:
        """Compact, versioned bytes a peer passes to ``Engine.remote`` to write here (and read,
        where the region was registered ``readable``: its read keys, descriptor version 4).
        ``reads_only``: the read keys alone, no write key (a readable region only)."""
        handles = self._live()
        if not self.remote:
            raise InvalidArgumentError("region was registered with remote=False: it has no descriptor")
        if reads_only and not self.readable:
            raise InvalidArgumentError("region was not registered readable=True: it has no read keys")
        virt = bool(self.engine._rails[0].mr_mode & _fabric.MR_VIRT_ADDR)
        raw = bool(handles[0].raw_key)
        keys = tuple(h.raw_key if raw else int(h.key).to_bytes(8, "little") for h in handles)
        read_keys = tuple(h.raw_key if raw else int(h.key).to_bytes(8, "little") for h in self._read_handles)
        if reads_only:
            keys = ()
        base = self.ptr if virt else 0
        if raw and handles[0].raw_base:      # what fi_mr_map_raw at the peer expects
            base = int(handles[0].raw_base)
        # a share whose memfd this process no longer holds open stays in the descriptor (the
        # peer's checks refuse to map it, so it writes over RMA): whether a descriptor carries
        # a host share is a fact of the region, fixed at registration, and so is its count
        share = self._host_share
        if share is not None:
            share = _maps.refresh(share) or share
        return wire.Descriptor(
            owner=wire.owner_digest(self.engine.address),
            provider=self.engine.provider,
            base=base,
            nbytes=self.nbytes,
            keys=keys,
            virt_addr=virt,
            raw=raw,
            device=self.device != "cpu",
            host_share=share,
            read_keys=read_keys,
        ).encode()

    @property
    def host_share(self) -> Optional[wire.HostShare]:
        """The host share every descriptor of it carries (found at registration; each
        ``descriptor()`` names an fd of the memfd open at that moment, if any is), or None.
        Writes into a region with one are counted without rule 3 (``pack_min`` 0):
        ``Engine.count_writes(..., region=self)``."""
        return self._host_share

    def _live(self) -> list:
        if self.closed:
            raise ClosedError("memory region is closed")
        return self._handles

    @property
    def closed(self) -> bool:
        return not self._handles or self._handles[0].closed

    def close(self) -> None:
        """Deregister (on every rail). Refused while a transfer from this region is still
        posting or in flight, or a watch entry armed from it may still post: wait for it
        (or cancel or disarm it) first."""
        if self._handles and not self.engine.closed:
            busy = ("memory region has transfers in flight or watch entries armed from it; "
                    "wait for them (or disarm them) before closing it")
            if any(h.rail.busy_with(h) for h in self._handles):
                raise InvalidArgumentError(busy)
            # its writers stop first: a write the target refuses is never posted (revoke.py)
            self.engine._revokes.revoke(self)
            if not self.engine._rails[0].close_if_idle(self._handles):
                raise InvalidArgumentError(busy)
        self._close()

    def _revoke(self, wait: bool = True) -> None:
        """Stop peers' direct copies into this region (its permit); with ``wait``, until the
        copies in progress have ended (bounded, ``_PermitSlot.revoke``)."""
        if self._permit is not None:
            self._permit.revoke(wait)

    def _close(self) -> None:
        """Deregister on every rail, even if one fails; then raise the first failure. Peers'
        direct copies are stopped here too (the permit: revoked, copies in progress waited
        out), as their RMA writes stop at deregistration; the slot is released after."""
        self._revoke()
        # the read registration goes first: no peer reads from here on
        handles, self._handles, self._obj = self._read_handles + self._handles, [], None
        self._read_handles = []
        permit, self._permit = self._permit, None
        first: Optional[BaseException] = None
        for h in handles:
            try:
                h.close()
            except FabricError as exc:
                first = first or exc
        if permit is not None:
            permit.release()
        if first is not None:
            raise first

    def __enter__(self) -> "MemoryRegion":
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            self.close()
            return
        # an error (or Ctrl-C) is unwinding, maybe out of a wait for a transfer from this
        # region: a refused close must not replace it; Engine.close() deregisters the region
        # after its drain
        try:
            self.close()
        except InvalidArgumentError:
            pass

    def __repr__(self) -> str:
        return f"<MemoryRegion {self.nbytes} bytes on {self.device}{' closed' if self.closed else ''}>"


class RemoteRegion:
    """A peer's region, decoded from its descriptor: where this engine may write.

    ``direct``: writes from host memory go as direct writes, through this process's own
    mapping of the peer's memfd (a ``_fabric.DirectMap``, held here and by every native
    transfer still posting through it; unmapped once none does), only where the share
    carries its permit (descriptor version 3): a copy is skipped once the target closed the
    region (src/direct.c; ``Engine.stats()["direct_revoked"]``). ``host_share``: the
    descriptor's; with one, rule 3 of the message rule does not apply to writes into the
    region (``pack_min`` 0), on every path (direct or RMA)."""

    def __init__(self, engine: "Engine", desc: wire.Descriptor, keys: tuple, direct: Any = None,
                 read_keys: tuple = ()) -> None:
        self.engine = engine
        self.descriptor = desc
        self.nbytes = desc.nbytes
        self.base = desc.base
        self.keys = keys          # per local rail: the key of the remote rail it talks to
        #: per local rail: the read key of the remote rail it talks to (empty: not readable)
        self.read_keys = read_keys
        self._direct = direct
        #: rule 3's bound for writes into this region (Engine._pack_min)
        self._pack_min = engine._pack_min(desc.host_share)

    @property
    def host_share(self) -> Optional[wire.HostShare]:
        """The host share its descriptor carries, or None (whether or not this engine maps it)."""
        return self.descriptor.host_share

    @property
    def key(self) -> int:
        return self.keys[0]

    @property
    def readable(self) -> bool:
        """Its owner offered it for reading (descriptor version 4): ``Engine.read_pages`` reads
        it with its read keys, and refuses every other remote region."""
        return bool(self.read_keys)

    @property
    def direct(self) -> bool:
        """Writes from host memory into this region are direct writes (shm, memfd-backed)."""
        return self._direct is not None

    def _direct_from(self, src: "MemoryRegion") -> Any:
        """The mapping a write from ``src`` uses: none from device memory (memcpy reads
        host memory only), so such a write goes over RMA."""
        return self._direct if src.device == "cpu" else None

    def __repr__(self) -> str:
        return f"<RemoteRegion {self.nbytes} bytes, {len(self.descriptor.keys)} rail(s)>"


class RegionPairs:
    """(source region, destination region) pairs to one peer, checked once by
    ``Engine.region_pairs``; ``Engine.write_pairs`` posts groups over them. Holds its regions
    (and so their buffers) alive; a region closed since is refused when posting."""

    __slots__ = ("engine", "peer", "pairs", "src_sizes", "dst_sizes", "handles", "dst_base", "keys", "directs",
                 "pack_mins")

    def __init__(self, engine: "Engine", peer: Peer, pairs: list) -> None:
        self.engine = engine
        self.peer = peer
        self.pairs = pairs
        n = len(pairs)
        self.src_sizes = np.fromiter([s.nbytes for s, _ in pairs], np.uint64, n)
        self.dst_sizes = np.fromiter([d.nbytes for _, d in pairs], np.uint64, n)
        self.dst_base = np.fromiter([d.base for _, d in pairs], np.uint64, n)
        rails = len(engine._rails)
        #: per local rail: the source registrations and the destination keys of every pair
        self.handles = [[s._live()[k] for s, _ in pairs] for k in range(rails)]
        self.keys = [np.fromiter([d.keys[k] for _, d in pairs], np.uint64, n) for k in range(rails)]
        #: per pair: the destination's direct mapping for this source, or None (RMA)
        self.directs = [d._direct_from(s) for s, d in pairs]
        #: per pair: rule 3's bound for writes into its destination (0 with a host share)
        self.pack_mins = np.fromiter([d._pack_min for _, d in pairs], np.uint64, n)

    def __len__(self) -> int:
        return len(self.pairs)

    def __repr__(self) -> str:
        return f"<RegionPairs {len(self.pairs)} pair(s)>"


def _resolve_buffer(obj: Any):
    """One door for memory: (ptr, nbytes, device, iface, ordinal, dmabuf_fd, keep-alive)."""
    sys_iface = _fabric.HMEM_SYSTEM
    # kvxfer KVBuffer (host memfd or CUDA cuMem)
    kind = getattr(obj, "kind", None)
    if kind in ("host", "cuda") and hasattr(obj, "ptr") and hasattr(obj, "nbytes"):
        # a lease keeps the mapping alive even if the buffer is closed under the region
        keep = obj.lease() if hasattr(obj, "lease") else obj
        if kind == "host":
            ptr, nbytes = int(obj.ptr), int(obj.nbytes)
            if nbytes:           # a duck-typed host buffer: its memory must be ours to be written
                _maps.check_writable(ptr, nbytes)
            return ptr, nbytes, "cpu", sys_iface, 0, -1, keep
        ordinal = int(getattr(obj, "ordinal", 0))
        fd = -1
        if _fabric.HAVE_DMABUF and hasattr(obj, "dmabuf_fd"):
            try:
                fd = int(obj.dmabuf_fd())
            except KvxferError:
                fd = -1
        return int(obj.ptr), int(obj.nbytes), f"cuda:{ordinal}", _fabric.HMEM_CUDA, ordinal, fd, keep
    if isinstance(obj, tuple) and len(obj) == 2:
        if not all(is_int(v) for v in obj):
            raise ArgumentTypeError(f"(ptr, nbytes) must be two ints, got ({', '.join(type(v).__name__ for v in obj)})")
        ptr, nbytes = int(obj[0]), int(obj[1])
        if not 0 < nbytes < 2**63:
            raise InvalidArgumentError(f"nbytes must be positive and below 2**63, got {nbytes}")
        if not 0 < ptr < 2**64 or ptr + nbytes > 2**64:
            raise InvalidArgumentError(f"pointer {ptr:#x} (+{nbytes} bytes) is not an address")
        _maps.check_writable(ptr, nbytes)
        return ptr, nbytes, "cpu", sys_iface, 0, -1, None
    # torch tensors
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous")
        nbytes = obj.numel() * obj.element_size()
        if obj.device.type == "cpu":
            # torch.frombuffer over read-only memory makes a tensor that reports nothing:
            # ask the mappings, as for (ptr, nbytes), before a peer's write faults this process
            if nbytes:
                _maps.check_writable(int(obj.data_ptr()), nbytes)
            return int(obj.data_ptr()), nbytes, "cpu", sys_iface, 0, -1, obj
        if obj.device.type == "cuda":
            o = obj.device.index or 0
            return int(obj.data_ptr()), nbytes, f"cuda:{o}", _fabric.HMEM_CUDA, o, -1, obj
        raise UnsupportedError(f"tensors on {obj.device} cannot be registered")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, readonly = cai["data"]
        if readonly:
            raise InvalidArgumentError("device array is read-only")
        shape = cai["shape"]
        itemsize = np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") not in (None, ()):
            expect = []
            acc = itemsize
            for d in reversed(shape):
                expect.append(acc)
                acc *= d
            if tuple(cai["strides"]) != tuple(reversed(expect)):
                raise InvalidArgumentError("device array must be C-contiguous")
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        return int(ptr), nbytes, "cuda:0", _fabric.HMEM_CUDA, 0, -1, obj
    try:
        mv = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack__"):
            arr = np.from_dlpack(obj)
            mv = memoryview(arr)
            obj = arr
            if mv.nbytes:        # a DLPack capsule need not say its memory is read-only
                _maps.check_writable(int(arr.__array_interface__["data"][0]), mv.nbytes)
        else:
            raise InvalidArgumentError(f"cannot register {type(obj).__name__}: not a buffer, tensor or (ptr, nbytes)") from None
    if mv.readonly:
        raise InvalidArgumentError("buffer is read-only: RMA needs writable memory")
    if "O" in mv.format or getattr(getattr(obj, "dtype", None), "hasobject", False):
        # its bytes are PyObject pointers: a peer writing there forges objects in this process
        raise InvalidArgumentError("buffer holds Python objects (object dtype); only plain data can be registered")
    if not mv.c_contiguous:
        raise InvalidArgumentError("buffer must be C-contiguous")
    arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    ptr = arr.__array_interface__["data"][0] if mv.nbytes else 0
    return int(ptr), mv.nbytes, "cpu", sys_iface, 0, -1, (obj, mv)
