"""The engine: endpoints, registered regions, paged writes with immediate data, counters.

This is the validating face over kvxfer._fabric. Everything a caller can get wrong is
checked here, before anything is posted; the native layer then posts whole batches with
the GIL released. What the progress thread reads stays alive natively: a transfer owns a
copy of its offsets, each rail holds its pending transfers' source registrations, and a
registration holds its buffer, until the last completion has been read.

On shm, a region that is a shared memfd mapping (a host ``KVBuffer``, or any view of one)
travels with a host share in its descriptor, and a peer engine maps it and writes into it
directly: a memcpy per message, then a 0-byte write carrying the imm (src/direct.c). The
target counts exactly what it counts over RMA. The share names the region's word in this
engine's fence table, which ``MemoryRegion.close()`` revokes (and waits out) before it
returns, so no peer's copy lands after the close (``_FenceSlot``). ``Engine(direct=False)`` or
``KVXFER_SHM_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import collections
import dataclasses
import errno as _errno
import operator
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer import _environ, _maps, wire
from kvxfer.errors import (
    ArgumentTypeError,
    ClosedError,
    DescriptorError,
    FabricError,
    InvalidArgumentError,
    KvxferError,
    OutOfBoundsError,
    PeerError,
    TimeoutError,
    UnsupportedError,
)

_fabric: Any
try:
    from kvxfer import _fabric
except ImportError as _exc:  # pragma: no cover - exercised only on broken installs
    _fabric = None
    _IMPORT_ERROR = _exc

__all__ = ["Engine", "Peer", "MemoryRegion", "RemoteRegion", "RegionPairs", "Transfer", "Counter", "Watcher",
           "WatchEntry", "providers"]

#: Tried in this order when no provider is named: RDMA hardware first, then sockets.
PREFERENCE = ("efa", "verbs;ofi_rxm", "psm3", "cxi", "tcp;ofi_rxm", "shm")

_U32 = 2**32


def _need_native():
    if _fabric is None:
        raise UnsupportedError(f"kvxfer's native module is not built or libfabric is missing: {_IMPORT_ERROR}")


def providers() -> list[str]:
    """The providers of PREFERENCE that open an RDM endpoint with FI_RMA on this machine."""
    _need_native()
    found = []
    for p in PREFERENCE:
        try:
            f = _fabric.Rail(p, None)
        except FabricError:
            continue
        f.close()
        found.append(p)
    return found


def _as_index(a, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be a 1-D array of page indices, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise OutOfBoundsError(f"{name} has a negative entry ({int(arr.min())})")
    return arr


def _as_offsets(a, name: str) -> np.ndarray:
    arr = _as_index(a, name)
    if arr.size and int(arr.max()) >= 2**62:
        raise OutOfBoundsError(f"{name} has an entry beyond any region ({int(arr.max())})")
    # always a private copy: the progress thread reads it after the call returns, so the
    # caller must not be able to change what was validated
    return np.array(arr, dtype=np.uint64, copy=True)


def _concat_index(parts: list) -> np.ndarray:
    """Concatenate groups' index arrays; signed and unsigned groups mixed would promote to
    float, so integer groups are joined as int64 (values that large are refused anyway).
    Each group's dtype is checked on its own: a bool or float group joined to an int one
    would otherwise be promoted and pass as offsets."""
    for p in parts:
        a = np.asarray(p)
        if a.size and a.dtype.kind not in "iu":
            raise InvalidArgumentError(f"a group's offsets and lengths must be integer arrays, got dtype {a.dtype}")
    out = np.concatenate(parts)
    if out.dtype.kind == "f" and all(np.asarray(p).dtype.kind in "iu" for p in parts):
        out = np.concatenate([np.asarray(p).astype(np.int64) for p in parts])
    return out


def _nonneg(v, name: str, positive: bool = False) -> int:
    """A plain Python int from an int or numpy integer scalar (numpy scalars wrap around in
    arithmetic, which would defeat the bounds checks)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, got {v!r}")
    v = operator.index(v)
    if v < (1 if positive else 0):
        raise InvalidArgumentError(f"{name} must be {'positive' if positive else 'non-negative'}, got {v}")
    return v


#: Longest finite wait accepted (about 31 years); beyond it the native deadline would overflow.
_MAX_TIMEOUT = 1e9


def _timeout(t, name: str = "timeout") -> Optional[float]:
    """None (wait forever) or a finite, non-negative number of seconds as a float."""
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name} must be a number of seconds or None, got {type(t).__name__}")
    v = float(t) if not isinstance(t, (int, np.integer)) or abs(int(t)) < 2**63 else float("inf")
    if v != v:
        raise InvalidArgumentError(f"{name} must be a number of seconds, got NaN")
    if v < 0:
        raise InvalidArgumentError(f"{name} must be non-negative, got {t!r}")
    if v > _MAX_TIMEOUT:
        raise InvalidArgumentError(f"{name} {t!r} is too long; pass None to wait without a deadline")
    return v


def _check_timeout(timeout) -> float:
    """A finite, non-negative timeout (None refused): for calls that must end."""
    if timeout is None:
        raise ArgumentTypeError("timeout must be a number of seconds, got None")
    return _timeout(timeout)


def _check_imm(imm) -> Optional[int]:
    if imm is None:
        return None
    if isinstance(imm, (bool, np.bool_)) or not isinstance(imm, (int, np.integer)):
        raise ArgumentTypeError(f"imm must be an int in [0, 2**32), got {type(imm).__name__}")
    imm = int(imm)
    if not 0 <= imm < _U32:
        raise InvalidArgumentError(f"imm must be in [0, 2**32), got {imm}")
    return imm


def _check_options(progress, iov, max_write, pack_min, rails) -> None:
    """Engine options that need no provider: refused before anything is opened."""
    if progress not in ("block", "spin"):
        raise InvalidArgumentError(f"progress must be 'block' or 'spin', not {progress!r}")
    for name, v in (("iov", iov), ("max_write", max_write)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if pack_min is not None and (isinstance(pack_min, bool) or not isinstance(pack_min, (int, np.integer))
                                 or pack_min < 0):
        raise InvalidArgumentError(f"pack_min must be a non-negative int, got {pack_min!r}")
    if rails is not None and (isinstance(rails, bool) or not isinstance(rails, (int, np.integer)) or rails < 1):
        raise InvalidArgumentError(f"rails must be a positive int, got {rails!r}")


#: The longest watcher poll interval (µs) ``Engine.watcher`` takes: its nanoseconds fit an int64.
MAX_POLL_US = 1e9


def _check_watch(poll_us, rt_priority, prefix: str = "") -> None:
    """A watcher's poll interval (µs, positive, at most ``MAX_POLL_US``) and SCHED_FIFO
    priority (0..99); ``prefix`` names them as the caller's options do (the messenger's
    ``watch_``)."""
    if isinstance(poll_us, bool) or not isinstance(poll_us, (int, float)) or not 0 < poll_us <= MAX_POLL_US:
        raise InvalidArgumentError(f"{prefix}poll_us must be a positive number up to {MAX_POLL_US:g}, "
                                   f"got {poll_us!r}")
    if isinstance(rt_priority, bool) or not isinstance(rt_priority, int) or not 0 <= rt_priority <= 99:
        raise InvalidArgumentError(f"{prefix}rt_priority must be an int in 0..99, got {rt_priority!r}")


def _u64(v, name: str) -> int:
    """An int in [0, 2**64) (a tag or threshold the native side keeps as uint64_t)."""
    v = _nonneg(v, name)
    if v >= 2**64:
        raise InvalidArgumentError(f"{name} must be below 2**64, got {v}")
    return v


def _check_rail(rail, n: int) -> int:
    """A local rail index in [0, n)."""
    rail = _nonneg(rail, "rail")
    if rail >= n:
        raise InvalidArgumentError(f"rail {rail} is not one of this engine's {n}")
    return rail


def _check_word(word) -> int:
    """A watcher's counter address: 0 (it allocates one) or an 8-byte-aligned u64 that is
    mapped writable in this process (the thread reads it natively; a wild one would crash)."""
    word = _nonneg(word, "word")
    if word:
        if word % 8 or word >= 2**64 - 8:
            raise InvalidArgumentError(f"word {word:#x} is not the address of an aligned 64-bit counter")
        _maps.check_writable(word, 8)
    return word


def _check_cpus(cpus) -> tuple:
    """The progress threads' CPUs (from the caller or a placement): ones this process may use."""
    if cpus is None:
        return ()
    try:
        cpus = tuple(cpus)
    except TypeError:
        raise InvalidArgumentError(f"cpus must list CPU numbers, got {cpus!r}") from None
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c not in allowed]
    if bad:
        raise InvalidArgumentError(f"cpus {bad} are not CPUs this process may run on {sorted(allowed)}")
    return tuple(int(c) for c in cpus)


def _check_nics(nics) -> Optional[list[str]]:
    if nics is None:
        return None
    # one string is one NIC's name, not a list of one-letter names
    if isinstance(nics, (str, bytes)):
        raise ArgumentTypeError(f"nics must be a list of NIC (libfabric domain) names, got the string {nics!r}")
    try:
        nics = list(nics)
    except TypeError:
        raise ArgumentTypeError(f"nics must be a list of NIC names, got {type(nics).__name__}") from None
    if not all(isinstance(n, str) and n for n in nics):
        raise ArgumentTypeError(f"each NIC must be a non-empty string, got {nics!r}")
    if not nics:
        raise InvalidArgumentError("nics must name at least one NIC (libfabric domain)")
    return nics


def _open_rails(provider: Optional[str], node: Optional[str], hmem: bool, spin: bool,
                nics: Optional[list[str]], rails: Optional[int]) -> list:
    """Open the rails on the named provider, else on the first of PREFERENCE that opens:
    one per NIC in ``nics``, else ``rails`` on the default domain; the first rail's hub is
    shared by the others. Raises the provider's error, or UnsupportedError."""
    domains: list[Optional[str]] = list(nics) if nics else [None]
    errors: list[str] = []
    first_error: Optional[FabricError] = None
    for p in [provider] if provider else list(PREFERENCE):
        # shm names its endpoint after `node`: two processes naming 127.0.0.1 would
        # collide (EBUSY), so shm always takes its own, per-process default name
        bind = None if p.split(";")[0] == "shm" else node
        try:
            first = _fabric.Rail(p, bind, hmem, spin, domains[0])
        except FabricError as exc:
            first_error = first_error or exc
            errors.append(f"{p}: {exc}")
            continue
        opened = [first]
        if nics is None and rails is not None and int(rails) > 1:
            domains = [first.domain_name] * int(rails)
        try:
            for d in domains[1:]:
                opened.append(_fabric.Rail(p, bind, hmem, spin, d, first))
        except BaseException:
            for r in reversed(opened):
                r.close()
            raise
        return opened
    if provider and hmem:
        try:
            _fabric.Rail(provider, None if provider.split(";")[0] == "shm" else node).close()
        except FabricError:
            pass
        else:
            raise UnsupportedError(f"provider {provider!r} offers no FI_HMEM (device memory); "
                                   "use shm, efa or verbs;ofi_rxm for GPU buffers")
    if provider and first_error is not None:
        raise first_error
    raise UnsupportedError("no libfabric provider with RMA is available: " + "; ".join(errors))


def _message_limits(rail, iov, max_write, pack_min) -> tuple[int, int, int]:
    """(iov, max_write, pack_min) of the message rule: the caller's, capped by the provider's."""
    limit = int(rail.iov_limit)
    iov = limit if iov is None else max(1, min(int(iov), limit))
    mm = int(rail.max_msg_size)
    max_write = min(mm, 1 << 30) if max_write is None else max(1, min(int(max_write), mm))
    pm = int(rail.inject_size) + 1 if pack_min is None else max(0, int(pack_min))
    return iov, max_write, min(pm, max_write)


class Peer:
    """A remote engine this engine can write to: one address-vector entry per local rail.

    Local rail i talks to the peer's rail ``i % remote_rails``. ``connect`` returns the same
    live Peer for the same address, so it is shared: ``close()`` disconnects it for every user.
    """

    __slots__ = ("engine", "address", "fi_addrs", "gens", "remote_rails", "owner", "closed", "__weakref__")

    def __init__(self, engine: "Engine", address: bytes, fi_addrs: tuple, gens: tuple, remote_rails: int) -> None:
        self.engine = engine
        self.address = address
        self.fi_addrs = fi_addrs
        # each AV slot's generation at insert: posts name it, so one racing disconnect never
        # reaches the peer libfabric puts in the slot next (src/liveness.c, kx_peer_enter)
        self.gens = gens
        self.remote_rails = remote_rails
        self.owner = wire.owner_digest(address)
        self.closed = False

    def close(self, timeout: float = 1.0) -> None:
        """``Engine.disconnect(self)``: cancel its transfers, forget its address. Idempotent."""
        self.engine.disconnect(self, timeout)

    def __repr__(self) -> str:
        return f"<Peer {self.remote_rails} rail(s) of {self.engine.provider}{' closed' if self.closed else ''}>"


#: words in an engine's fence table (64 KiB): regions offering a host share at once
FENCE_SLOTS = 8192
#: how long closing a region waits for peers' direct copies in progress (a writer killed
#: mid-copy never leaves; the slot is then retired, never reused)
FENCE_WAIT = 1.0


class _FenceSlot:
    """A region's word in its engine's fence table (src/direct.c, ``_fabric.FenceTable``):
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

    def wire(self) -> wire.Fence:
        return wire.Fence(self._table.fd, self.dev, self.inode, self.slot, self.generation)

    def revoke(self, wait: bool = True) -> None:
        """Refuse every copy from now on; with ``wait``, wait up to ``FENCE_WAIT`` s (once)
        for the copies in progress."""
        with self._lock:
            table = self._table
            if table is None or self._left is not None:
                return
            if wait:
                self._left = table.revoke(self.slot, FENCE_WAIT)
            else:
                table.revoke(self.slot, 0.0)

    def release(self) -> None:
        """Once deregistered: bump the generation and give the slot back (idempotent)."""
        self.revoke()
        with self._lock:
            table, self._table = self._table, None
        if table is not None:
            self._engine._fence_give(self.slot, self._left == 0 and table.retire(self.slot))

    def __del__(self) -> None:
        try:
            self.release()     # the last reference, its registration's, went: deregistered
        except Exception:
            pass


class MemoryRegion:
    """Local memory registered with the engine. Keeps its buffer alive until closed."""

    def __init__(self, engine: "Engine", handles: list, obj: Any, ptr: int, nbytes: int, device: str,
                 remote: bool = True, host_share: Optional[wire.HostShare] = None,
                 fence: Optional["_FenceSlot"] = None) -> None:
        self.engine = engine
        self.remote = remote
        self._handles = handles      # one RegionHandle (registration) per rail
        self._obj = obj
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._host_share = host_share    # a shared memfd mapping: shm peers may write directly
        self._fence = fence              # its slot in the engine's fence table (with a share)

    def descriptor(self) -> bytes:
        """Compact, versioned bytes a peer passes to ``Engine.remote`` to write here."""
        handles = self._live()
        if not self.remote:
            raise InvalidArgumentError("region was registered with remote=False: it has no descriptor")
        virt = bool(self.engine._rails[0].mr_mode & _fabric.MR_VIRT_ADDR)
        raw = bool(handles[0].raw_key)
        keys = tuple(h.raw_key if raw else int(h.key).to_bytes(8, "little") for h in handles)
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
            if not self.engine._rails[0].close_if_idle(self._handles):
                raise InvalidArgumentError("memory region has transfers in flight or watch entries armed from it; "
                                           "wait for them (or disarm them) before closing it")
        self._close()

    def _revoke(self, wait: bool = True) -> None:
        """Stop peers' direct copies into this region (its fence); with ``wait``, until the
        copies in progress have ended (bounded, ``_FenceSlot.revoke``)."""
        if self._fence is not None:
            self._fence.revoke(wait)

    def _close(self) -> None:
        """Deregister on every rail, even if one fails; then raise the first failure. Peers'
        direct copies are stopped here too (the fence: revoked, copies in progress waited
        out), as their RMA writes stop at deregistration; the slot is released after."""
        self._revoke()
        handles, self._handles, self._obj = self._handles, [], None
        fence, self._fence = self._fence, None
        first: Optional[BaseException] = None
        for h in handles:
            try:
                h.close()
            except FabricError as exc:
                first = first or exc
        if fence is not None:
            fence.release()
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
    carries its fence (descriptor version 3): a copy is skipped once the target closed the
    region (src/direct.c; ``Engine.stats()["direct_revoked"]``). ``host_share``: the
    descriptor's; with one, rule 3 of the message rule does not apply to writes into the
    region (``pack_min`` 0), on every path (direct or RMA)."""

    def __init__(self, engine: "Engine", desc: wire.Descriptor, keys: tuple, direct: Any = None) -> None:
        self.engine = engine
        self.descriptor = desc
        self.nbytes = desc.nbytes
        self.base = desc.base
        self.keys = keys          # per local rail: the key of the remote rail it talks to
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


class Transfer:
    """A batch of posted writes. ``num_writes`` is the number of immediates the target sees."""

    __slots__ = ("_handles", "num_writes", "nbytes", "imm", "__weakref__")

    def __init__(self, handles: list, nbytes: int, imm: Optional[int]) -> None:
        self._handles = handles        # one TransferHandle per rail used; they keep what they read
        self.num_writes: int = handles[0].planned if len(handles) == 1 else sum(h.planned for h in handles)
        self.nbytes = nbytes
        self.imm = imm

    @property
    def done(self) -> bool:
        """True once every posted write has completed at the sender (successfully or not).
        After ``cancel()`` it also means posting has stopped for good: ``posted`` is final."""
        return all(x.done for x in self._handles)

    @property
    def posted(self) -> int:
        """Writes (messages, in the ``num_writes`` sense) handed to the provider so far.

        Final once ``done`` is True (after ``cancel()`` too): then at most this many writes of
        the transfer can arrive at the target (exactly this many unless some failed), so a
        target that has seen this many arrivals of ``imm`` may retire it (``Engine.discard``).
        While posting is under way it may briefly count one write per rail that the provider
        then refuses and kvxfer retries."""
        return sum(x.posted for x in self._handles)

    @property
    def error(self) -> Optional[KvxferError]:
        """The failure, once known; None while pending or on success."""
        err = next((x.errno for x in self._handles if x.errno), 0)
        return _fabric.error_from("fi_writemsg", err) if err else None

    def cancel(self) -> None:
        """Post nothing more of this transfer (for a peer that stopped answering): writes
        already posted still complete or fail; ``wait`` then raises ``PeerError``."""
        for x in self._handles:
            x.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every write completed at the sender; raise its error, or TimeoutError."""
        timeout = _timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for x in self._handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not x.wait(left):
                done = sum(x.completed for x in self._handles)
                raise TimeoutError(f"transfer not complete after {timeout} s ({done}/{self.num_writes} writes done)")
        err = self.error
        if err is not None:
            raise err

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Transfer {self.num_writes} writes, {self.nbytes} bytes, {state}>"


class Counter:
    """An expectation: ``count`` writes carrying ``imm``. Arrivals before it was made count."""

    __slots__ = ("_handle", "imm", "count", "callback", "__weakref__")

    def __init__(self, handle: Any, imm: int, count: int, callback: Optional[Callable[["Counter"], Any]]) -> None:
        self._handle = handle
        self.imm = imm
        self.count = count
        self.callback = callback

    @property
    def done(self) -> bool:
        return self._handle.done

    @property
    def arrived(self) -> int:
        return self._handle.arrived

    @property
    def state(self) -> str:
        """``"pending"``, ``"done"`` (all arrived), ``"discarded"`` (withdrawn by
        ``Engine.discard``) or ``"closed"`` (the engine closed first)."""
        h = self._handle
        if not h.done:
            return "pending"
        if h.errno == _errno.EIDRM:
            return "discarded"
        return "closed" if h.errno else "done"

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until all ``count`` writes have landed; TimeoutError otherwise."""
        timeout = _timeout(timeout)
        if not self._handle.wait(timeout):
            raise TimeoutError(f"imm {self.imm}: {self._handle.arrived}/{self.count} writes arrived after {timeout} s")
        if self._handle.errno == _errno.EIDRM:
            raise ClosedError(f"imm {self.imm}: the expectation was discarded ({self.arrived}/{self.count} arrived)")
        if self._handle.errno:
            raise ClosedError(f"imm {self.imm}: engine closed before the writes arrived")

    def __repr__(self) -> str:
        return f"<Counter imm={self.imm} {self.arrived}/{self.count}>"


class WatchEntry:
    """Writes armed on a ``Watcher``: posted natively once its counter reaches ``threshold``.

    Quacks like a ``Transfer``: ``num_writes`` (exact, known at arming), ``posted``,
    ``done`` (posted and complete, or disarmed), ``error``, ``cancel()`` (disarm, or stop
    posting what was posted), ``wait()``. ``state``: "armed", "posting", "posted",
    "disarmed" or "failed". It keeps its source region alive."""

    __slots__ = ("_h", "_src", "nbytes", "imm", "tag", "__weakref__")

    def __init__(self, h: Any, src: "MemoryRegion", nbytes: int, imm: Optional[int], tag: int) -> None:
        self._h = h
        self._src = src
        self.nbytes = nbytes
        self.imm = imm
        self.tag = tag

    num_writes = property(lambda self: self._h.num_writes, doc="Messages it posts (the message rule).")
    posted = property(lambda self: self._h.posted, doc="Messages handed to the provider so far.")
    done = property(lambda self: self._h.done, doc="Disarmed, failed, or posted and complete.")
    state = property(lambda self: self._h.state, doc="armed, posting, posted, disarmed or failed.")
    threshold = property(lambda self: self._h.threshold, doc="The counter value that fires it.")
    fired_ns = property(lambda self: self._h.fired_ns, doc="CLOCK_MONOTONIC ns of its post call (0 before).")

    @property
    def fired(self) -> bool:
        """Posted (or failed to post)."""
        return self._h.state in ("posted", "failed")

    @property
    def error(self) -> Optional[KvxferError]:
        return self._h.error

    def disarm(self) -> bool:
        """True if it was still armed and now never posts; False if it was already posted."""
        return self._h.disarm()

    def cancel(self) -> None:
        """Disarm it, or if it was posted post nothing more (what was posted completes)."""
        self._h.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until ``done``; raise its error, or TimeoutError."""
        if not self._h.wait(_timeout(timeout)):
            raise TimeoutError(f"watch entry still {self.state} after {timeout} s")
        err = self.error
        if err is not None:
            raise err

    def __repr__(self) -> str:
        return f"<WatchEntry at {self.threshold}: {self.num_writes} writes, {self.state}>"


class Watcher:
    """A native thread (``kvxfer-watch``) that watches a monotonic 64-bit counter and posts
    armed writes when it reaches their threshold (``Engine.watcher``). No Python runs per
    layer: the thread compares, then posts through the engine's native path.

    ``word``: the counter's address; 0 lets the watcher allocate it (``ptr``). ``keep``: the
    owner of external memory, kept alive. The thread blocks when nothing is armed, polls every
    ``poll_us`` while something is, and ``bump()`` wakes it at once. ``rt_priority`` > 0 asks
    for SCHED_FIFO (it sleeps between polls; ``stats()["rt"]`` says whether it was granted)."""

    def __init__(self, engine: "Engine", word: int = 0, poll_us: float = 10.0, cpus: Iterable[int] = (),
                 keep: Any = None, rt_priority: int = 0) -> None:
        self.engine = engine
        self._h = _fabric.WatcherHandle(int(word), int(poll_us * 1000), tuple(cpus), keep, int(rt_priority))

    @property
    def ptr(self) -> int:
        """The counter's address (host memory)."""
        return self._h.word

    @property
    def value(self) -> int:
        return self._h.value

    def bump(self, n: int = 1) -> int:
        """Add ``n`` (CPU) and wake the thread; returns the new value. Refused
        (``InvalidArgumentError``, nothing added) when it would take the counter past
        2**64 - 1: a wrapped counter would never reach the thresholds armed above it."""
        return self._h.bump(_u64(n, "n"))

    def advance(self, to: int) -> int:
        """Raise the counter to at least ``to``; returns its value after."""
        return self._h.advance(_u64(to, "to"))

    def arm(self, threshold: int, src: "MemoryRegion", peer: "Peer", dst: "RemoteRegion", src_offsets, dst_offsets,
            lengths, *, imm: Optional[int] = None, tag: int = 0, rail: int = 0) -> WatchEntry:
        """Arm ``write_batch``'s triples for when the counter reaches ``threshold`` (checked
        like ``write_batch`` now; posted on local rail ``rail`` to the peer's rail
        ``rail % peer rails``). ``tag`` groups entries for ``disarm_tag``."""
        eng = self.engine
        eng._endpoints(src, peer, dst)
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        if not (len(so) == len(do) == len(ln)):
            raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
        if len(ln):
            se, de = so + ln, do + ln
            i, j = int(se.argmax()), int(de.argmax())
            if int(se[i]) > src.nbytes:
                raise OutOfBoundsError(f"source write {i} ends at byte {int(se[i])}, beyond the {src.nbytes}-byte region")
            if int(de[j]) > dst.nbytes:
                raise OutOfBoundsError(f"destination write {j} ends at byte {int(de[j])}, beyond the {dst.nbytes}-byte remote region")
        imm = _check_imm(imm)
        threshold = _u64(threshold, "threshold")
        tag = _u64(tag, "tag")
        rail = _check_rail(rail, len(eng._rails))
        handles = src._live()
        r = eng._rails[rail]
        h = self._h.arm(threshold, tag, r, peer.fi_addrs[rail], peer.gens[rail], src.ptr, handles[rail], dst.base, dst.keys[rail],
                        dst._direct_from(src), np.ascontiguousarray(so, np.uint64),
                        np.ascontiguousarray(do, np.uint64), np.ascontiguousarray(ln, np.uint64), imm, eng.iov,
                        eng.max_write, dst._pack_min)
        return WatchEntry(h, src, int(ln.sum()) if len(ln) else 0, imm, int(tag))

    def arm_groups(self, thresholds, src: "MemoryRegion", peer: "Peer", dst: "RemoteRegion", src_offsets,
                   dst_offsets, lengths, starts, *, imm: Optional[int] = None, tag: int = 0,
                   rail: int = 0) -> list[WatchEntry]:
        """``arm`` for many groups of one region pair at once (e.g. every layer of a rank
        pair): group g is triples ``[starts[g], starts[g + 1])`` armed at ``thresholds[g]``.
        Checked once, armed in one native loop."""
        eng = self.engine
        eng._endpoints(src, peer, dst)
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        th = _as_offsets(thresholds, "thresholds")
        st = _as_offsets(starts, "starts").astype(np.int64)
        tag = _u64(tag, "tag")
        if not (len(so) == len(do) == len(ln)):
            raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
        if (st.ndim != 1 or len(st) != len(th) + 1 or st[0] != 0 or st[-1] != len(ln)
                or (np.diff(st) < 0).any()):
            raise InvalidArgumentError("starts must run from 0 to the number of triples, one more than thresholds")
        if len(ln):
            se, de = so + ln, do + ln
            i, j = int(se.argmax()), int(de.argmax())
            if int(se[i]) > src.nbytes:
                raise OutOfBoundsError(f"source write {i} ends at byte {int(se[i])}, beyond the {src.nbytes}-byte region")
            if int(de[j]) > dst.nbytes:
                raise OutOfBoundsError(f"destination write {j} ends at byte {int(de[j])}, beyond the {dst.nbytes}-byte remote region")
        imm = _check_imm(imm)
        rail = _check_rail(rail, len(eng._rails))
        handles = src._live()
        hs = self._h.arm_groups(np.ascontiguousarray(th, np.uint64), tag, eng._rails[rail], peer.fi_addrs[rail],
                                peer.gens[rail],
                                src.ptr, handles[rail], dst.base, dst.keys[rail], dst._direct_from(src),
                                np.ascontiguousarray(so, np.uint64),
                                np.ascontiguousarray(do, np.uint64), np.ascontiguousarray(ln, np.uint64), st, imm,
                                eng.iov, eng.max_write, dst._pack_min)
        cs = np.concatenate([[0], np.cumsum(ln, dtype=np.uint64)]).astype(np.uint64)
        sums = (cs[st[1:]] - cs[st[:-1]]).tolist()
        return [WatchEntry(h, src, int(sums[g]), imm, int(tag)) for g, h in enumerate(hs)]

    def disarm_tag(self, tag: int) -> int:
        """Disarm every still-armed entry of ``tag``; returns how many."""
        return self._h.disarm_tag(_u64(tag, "tag"))

    def latencies(self) -> tuple[list[int], list[int]]:
        """CPU ``bump()`` -> first post of what it fired, in ns, since the last call: to the
        native post call, and to its return."""
        return self._h.latencies()

    def stats(self) -> dict:
        return self._h.stats()

    def close(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (idempotent); armed entries never post."""
        self._h.close(_check_timeout(timeout))

    @property
    def closed(self) -> bool:
        return bool(self._h.closed)


class Engine:
    """One libfabric RDM endpoint with a native progress thread.

    ``provider``: a libfabric provider string ("tcp;ofi_rxm", "shm", "efa", "verbs;ofi_rxm");
    None takes FI_PROVIDER, else the first of PREFERENCE that opens. ``node``: the local
    address to bind (tests pass "127.0.0.1"). Options: ``progress`` ("block" or "spin"),
    ``cpus`` (CPU ids to pin the progress thread to), ``hmem`` (ask for FI_HMEM, needed to
    register GPU memory), ``iov`` (pieces per RMA message, at most the provider's limit),
    ``max_write`` (bytes per RMA message; larger writes are split), ``pack_min`` (pieces
    shorter than this travel one per message; default: what the provider can inject, since
    an injected small write beats a packed copy on shm; never for a region whose descriptor
    carries a host share, see ``direct``). ``nics``: libfabric domain names,
    one rail (endpoint, progress thread) each, over which paged writes are striped;
    ``placement``: a ``kvxfer.Placement`` from ``Topology.assign``, giving NICs and CPUs;
    ``rails``: without ``nics``, open this many endpoints on the provider's default domain
    (on shm, two rails copy in parallel). ``peer_timeout``: seconds a peer may leave writes
    or sends outstanding without completing any (or refuse every post) before it is declared
    dead (its transfers and later posts fail with ``PeerError``; the only dead-peer signal shm
    has); None: never. ``delivery_complete``: a transfer completes only once the target placed
    it, so a write the target refuses fails at the sender (default: on for rxm providers, where
    tcp otherwise reports a refused write as done; only each transfer's last message carries
    FI_DELIVERY_COMPLETE, src/post.c says why). ``direct`` (shm only; default: on unless the
    environment says ``KVXFER_SHM_DIRECT=0``): regions that are shared memfd mappings are
    offered to peers as host shares, and writes from host memory into a peer's such region
    go as direct writes: this process maps the peer's memfd range itself and copies with
    memcpy, then posts a 0-byte write carrying the imm per message (src/direct.c), instead of
    the kernel's cross-process copy. Rule 3 (``pack_min``) does not apply to writes into a
    region whose descriptor carries a host share, on either path (direct, or RMA where this
    engine does not map it), so the target counts them the same way whatever the sender
    does: ``count_writes(..., region=)``. shm peers are the same user on the same host and
    already trusted with each other's memory (docs/architecture.md, "Known provider
    limits"); a peer that cannot be mapped (another namespace, no permission, an unsealed or
    stale memfd) is written over RMA, silently.
    """

    def __init__(
        self,
        provider: Optional[str] = None,
        node: Optional[str] = None,
        *,
        progress: str = "block",
        cpus: Optional[Iterable[int]] = None,
        hmem: bool = False,
        iov: Optional[int] = None,
        max_write: Optional[int] = None,
        pack_min: Optional[int] = None,
        nics: Optional[Sequence[str]] = None,
        placement: Any = None,
        rails: Optional[int] = None,
        peer_timeout: Optional[float] = 10.0,
        delivery_complete: Optional[bool] = None,
        direct: Optional[bool] = None,
    ) -> None:
        _need_native()
        pt = _timeout(peer_timeout, "peer_timeout")
        if pt == 0:
            raise InvalidArgumentError("peer_timeout must be positive (None: never declare a silent peer dead)")
        self._closed = True          # until the rails are open and started
        self._parked = False         # close() left an endpoint open (kx_rail_park)
        self._lock = threading.Lock()
        self._regions: "weakref.WeakSet[MemoryRegion]" = weakref.WeakSet()
        # the fence of direct writes into our regions (src/direct.c): made at the first
        # registration that offers a host share; one slot per such region
        self._fence: Any = None
        self._fence_file = (0, 0)        # its (dev, inode)
        self._fence_free: "collections.deque[int]" = collections.deque()    # given back without the lock
        self._fence_next = 0
        self._fence_stuck: "collections.deque[int]" = collections.deque()   # slots a writer never left (never reused)
        self._callbacks: dict[int, Counter] = {}
        self._dispatcher: Optional[threading.Thread] = None
        self._raw_keys: list[tuple[Any, int]] = []
        self._peers: dict[bytes, Peer] = {}
        self._watchers: "weakref.WeakSet[Watcher]" = weakref.WeakSet()
        self._rails: list = []
        _check_options(progress, iov, max_write, pack_min, rails)
        for name, v in (("direct", direct), ("delivery_complete", delivery_complete), ("hmem", hmem)):
            if v is not None and not isinstance(v, (bool, np.bool_)):
                raise ArgumentTypeError(f"{name} must be True, False{'' if name == 'hmem' else ' or None'}, got {v!r}")
        for name, v in (("provider", provider), ("node", node)):
            if v is not None and not isinstance(v, str):
                raise ArgumentTypeError(f"{name} must be a string or None, got {type(v).__name__}")
        if provider is None:
            provider = _environ.user_provider()   # kvxfer's own include list is not a name
        if placement is not None:
            if nics is None and getattr(placement, "nics", None):
                nics = list(placement.domains)
            if cpus is None:
                cpus = tuple(placement.cpus)
        cpus = _check_cpus(cpus)
        nics = _check_nics(nics)
        self._rails = _open_rails(provider, node, hmem, progress == "spin", nics, rails)
        first = self._rails[0]
        self.provider: str = first.provider
        self.progress = progress
        self.cpus = cpus
        self.iov, self.max_write, self.pack_min = _message_limits(first, iov, max_write, pack_min)
        self.peer_timeout = pt
        if delivery_complete is None:      # tcp;ofi_rxm: otherwise a refused write "succeeds"
            delivery_complete = "ofi_rxm" in self.provider
        self.delivery_complete = bool(delivery_complete)
        if direct is None:
            direct = os.environ.get("KVXFER_SHM_DIRECT", "1") != "0"
        #: direct writes (and host shares in this engine's descriptors): shm only
        self.direct = direct and self.provider.split(";")[0] == "shm"
        try:
            for r in self._rails:
                r.set_peer_timeout(pt or 0.0)
                r.set_delivery_complete(self.delivery_complete)
                r.start(self.cpus)
            self._address = wire.Address(self.provider, tuple(r.getname() for r in self._rails)).encode()
        except BaseException:
            for r in reversed(self._rails):
                r.close()
            raise
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the engine; idempotent. In this order: stop the callback dispatcher; drain
        each rail (queued writes are cancelled, posted ones get 0.5 s to complete, rxm waits for
        200 ms of incoming quiet and parks a rail that got none); quiesce each
        rail (no caller inside native code, progress thread joined); close each rail's
        endpoint, AV and CQ (pending transfers and counters fail); deregister the regions;
        unmap peers' raw keys; close each rail's domain and fabric, last rail first; join the
        dispatcher.

        A KeyboardInterrupt (Ctrl-C) arriving meanwhile does not leave the engine half
        closed (marked closed, so never closed again, with its progress threads, endpoints and
        registrations alive): the steps, each idempotent, are run again to the end, and the
        interrupt is raised after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._rails:
            return
        interrupted: Optional[BaseException] = None
        while True:
            try:
                self._close_steps()
                break
            except KeyboardInterrupt as exc:
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def _close_steps(self) -> None:
        """``close()``'s steps; each may run again after an interrupt (``close()``)."""
        for w in list(self._watchers):  # armed writes never post into a closing rail
            w.close()
        self._rails[0].dispatch_stop()
        rxm = "ofi_rxm" in self.provider
        # posted writes finish, queued ones go, incoming traffic stops (all bounded)
        quiet = [r.drain(0.5, 0.2 if rxm else 0.02) for r in self._rails]
        # libfabric 1.17's rxm crashes inside fi_close of an endpoint that peers wrote to until
        # shortly before (docs/reliability.md). Such an endpoint (no 200 ms of quiet) is left
        # open and unprogressed instead, reclaimed at process exit (tens of MiB and a dozen
        # fds each). KVXFER_PARK_RXM=0 closes it anyway.
        if rxm and os.environ.get("KVXFER_PARK_RXM", "1") != "0":
            for r, q in zip(self._rails, quiet):
                if not q and r.took_traffic:
                    r.park()
                    self._parked = True
        for r in self._rails:           # nobody posts from here on
            r.quiesce()
        for r in self._rails:           # endpoints go before the registrations they used
            r.close_endpoint()
        regions = list(self._regions)
        for r in regions:                   # no peer's direct copy starts into any of them
            r._revoke(wait=False)
        for r in regions:                   # a failure is reported, never stops the close
            try:
                r._close()
            except FabricError as exc:
                warnings.warn(f"closing {r!r}: {exc}", ResourceWarning, stacklevel=3)
        while self._raw_keys:           # each unmapped once, even if the steps run again
            rail, k = self._raw_keys.pop()
            try:
                rail.unmap_key(k)
            except FabricError as exc:
                warnings.warn(f"unmapping a peer's raw key: {exc}", ResourceWarning, stacklevel=3)
        for r in reversed(self._rails):
            r.close()
        self._fence = None                  # its regions' slots hold it until they are done
        d = self._dispatcher
        if d is not None and d is not threading.current_thread():
            d.join(timeout=5)
        self._callbacks.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<Engine {getattr(self, 'provider', '?')}{' closed' if self._closed else ''}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine is closed")

    # -- facts ---------------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """What a peer passes to ``connect`` (send it out of band)."""
        return self._address

    @property
    def info(self) -> dict:
        """Provider facts kvxfer obeys: mr_mode, iovecs, sizes, remote counters, HMEM."""
        f = self._rails[0]
        return {
            "provider": self.provider,
            "fabric": f.fabric_name,
            "domain": f.domain_name,
            "rails": [r.domain_name for r in self._rails],
            "mr_mode": f.mr_mode,
            "virt_addr": bool(f.mr_mode & _fabric.MR_VIRT_ADDR),
            "prov_key": bool(f.mr_mode & _fabric.MR_PROV_KEY),
            "mr_local": bool(f.mr_mode & _fabric.MR_LOCAL),
            "mr_endpoint": bool(f.mr_mode & _fabric.MR_ENDPOINT),
            "rma_event": bool(f.caps & _fabric.CAP_RMA_EVENT),
            "hmem": bool(f.caps & _fabric.CAP_HMEM),
            "iov_limit": int(f.iov_limit),
            "iov": self.iov,
            "max_msg_size": int(f.max_msg_size),
            "max_write": self.max_write,
            "pack_min": self.pack_min,
            "inject_size": int(f.inject_size),
            "cq_data_size": int(f.cq_data_size),
            "wait_object": f.has_wait,
            "per_op_context": f.need_ctx,
            "libfabric_runtime": "%d.%d" % _fabric.RUNTIME_VERSION,
            "libfabric_build": "%d.%d" % _fabric.BUILD_VERSION,
            "dmabuf": _fabric.HAVE_DMABUF,
            "direct": self.direct,
        }

    def stats(self) -> dict:
        self._check_open()
        out: dict = {}
        for r in self._rails:
            for k, v in r.stats().items():
                out[k] = out.get(k, 0) + v
        # closed regions whose fence a peer's copy never left (a writer killed mid-copy)
        out["direct_fence_stuck"] = len(self._fence_stuck)
        return out

    @property
    def rails(self) -> int:
        """Endpoints (NICs) this engine stripes over."""
        return len(self._rails)

    def progress_threads(self) -> list[int]:
        """Kernel thread ids of the progress threads, one per rail (for pinning checks)."""
        return [r.thread_id for r in self._rails]

    # -- peers and regions ---------------------------------------------------------------
    def connect(self, address: bytes) -> Peer:
        """Insert a peer's address (from its ``Engine.address``) into the address vector."""
        self._check_open()
        a = wire.Address.decode(address)
        if a.provider != self.provider:
            raise DescriptorError(f"address is for provider {a.provider!r}, this engine runs {self.provider!r}")
        local = self._rails[0].getname()
        for n in a.names:
            # libfabric reads as many bytes as its address format implies: a name of another
            # size (or an unterminated string name) would be read out of bounds
            if self._rails[0].addr_is_str:
                if not n.endswith(b"\0") or b"\0" in n[:-1] or len(n) > 256:
                    raise DescriptorError("address has a malformed endpoint name for this provider")
            elif len(n) != len(local):
                raise DescriptorError(f"address has a {len(n)}-byte endpoint name; this provider's are {len(local)} bytes")
        address = bytes(address)
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None and not peer.closed:
                return peer
            slots = [r.av_insert(np.frombuffer(a.names[i % len(a.names)], dtype=np.uint8))
                     for i, r in enumerate(self._rails)]
            peer = Peer(self, address, tuple(s[0] for s in slots), tuple(s[1] for s in slots), len(a.names))
            self._peers[address] = peer
        return peer

    def disconnect(self, peer: Peer, timeout: float = 1.0) -> None:
        """Remove a peer: cancel its transfers (writes already posted still complete or fail),
        wait up to ``timeout`` s for them to end, then remove its address from every rail.
        Later writes and sends to it raise ``PeerError``. Idempotent.

        An address is removed only from a rail with nothing still posting to it (libfabric
        reuses the slot for the next peer connected); one still posting at the deadline keeps
        its slot, unused, until the engine closes."""
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        timeout = _check_timeout(timeout)
        with self._lock:
            if peer.closed:
                return
            peer.closed = True        # from here on _endpoints and send refuse it
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        if self._closed:
            return
        for r, addr, gen in zip(self._rails, peer.fi_addrs, peer.gens):
            r.cancel_peer(addr, gen)
        deadline = time.monotonic() + timeout
        for r, addr, gen in zip(self._rails, peer.fi_addrs, peer.gens):
            _, posting = r.wait_peer_idle(addr, max(0.0, deadline - time.monotonic()), gen)
            if posting == 0 and not r.closed:
                # refuses later posts at once; removes the address once no post is inside
                # a provider call to it (else the slot stays, unused, until close)
                r.av_remove(addr, max(0.0, deadline - time.monotonic()) + 0.1)

    def register(self, obj: Any, *, remote: bool = True) -> MemoryRegion:
        """Register memory for RMA: a writable buffer, a DLPack/CPU-torch tensor, a KVBuffer,
        an object with ``__cuda_array_interface__``, or ``(ptr, nbytes)``. ``remote=False``
        registers a source only: no peer can write into it, and it has no descriptor."""
        self._check_open()
        ptr, nbytes, device, iface, ordinal, dmabuf, keep = _resolve_buffer(obj)
        if nbytes <= 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        if iface != _fabric.HMEM_SYSTEM and not (self._rails[0].caps & _fabric.CAP_HMEM):
            raise UnsupportedError(
                f"provider {self.provider!r} engine has no FI_HMEM: device memory ({device}) needs "
                "Engine(..., hmem=True) on a provider that offers it (shm, efa, verbs)"
            )
        mrs = []
        try:
            for r in self._rails:
                mrs.append(r.mr_reg(ptr, nbytes, iface, ordinal, dmabuf, bool(remote)))
                mrs[-1].keep = keep      # a registration keeps its memory alive
        except FabricError as exc:
            for mr in mrs:
                mr.close()
            # a libfabric built without this device's HMEM support (Debian's 1.17 and CUDA)
            # answers ENOSYS/EOPNOTSUPP from fi_mr_regattr: say which feature is missing
            if iface != _fabric.HMEM_SYSTEM and exc.errno in (_errno.ENOSYS, _errno.EOPNOTSUPP):
                raise UnsupportedError(f"this libfabric cannot register {device} memory ({exc}): it was built "
                                       "without that device's HMEM support") from exc
            raise
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        finally:
            if dmabuf >= 0:       # each registration holds its own reference to the dma-buf
                os.close(dmabuf)
        # a shared memfd mapping: shm peers may map it and write directly (src/direct.c)
        share = _maps.host_share(ptr, nbytes) if self.direct and remote and device == "cpu" else None
        fence = self._fence_take(share, nbytes) if share is not None else None
        if fence is not None:         # the share names it: peers copy only while it allows
            share = dataclasses.replace(share, fence=fence.wire())
        region = MemoryRegion(self, mrs, keep, ptr, nbytes, device, bool(remote), share, fence)
        if fence is not None:
            # the slot lives as long as the registration, not the MemoryRegion object: a region
            # dropped while a transfer from it still holds its registration keeps taking its
            # peers' copies (as RMA writes to its key still land), and revoking then would let
            # their imms count without their data
            mrs[0].fence = fence
        with self._lock:
            if self._closed:       # close() ran while we registered: undo, not leak
                region._close()
                raise ClosedError("engine is closed")
            self._regions.add(region)
        return region

    def remote(self, descriptor: bytes) -> RemoteRegion:
        """Decode a peer's ``MemoryRegion.descriptor()``; writes are bounded by its size. On a
        shm engine with ``direct``, a descriptor's host share is mapped here (checked first;
        see ``Engine``), and ``RemoteRegion.direct`` says whether that worked."""
        self._check_open()
        d = wire.Descriptor.decode(descriptor)
        if d.provider != self.provider:
            raise DescriptorError(f"descriptor is for provider {d.provider!r}, this engine runs {self.provider!r}")
        virt = bool(self._rails[0].mr_mode & _fabric.MR_VIRT_ADDR)
        if d.virt_addr != virt:
            raise DescriptorError("descriptor's addressing mode does not match this provider's mr_mode")
        keys = []
        for i, r in enumerate(self._rails):
            k = d.keys[i % len(d.keys)]
            if d.raw:
                mapped = r.map_raw(d.base, np.frombuffer(k, dtype=np.uint8))
                self._raw_keys.append((r, mapped))
                keys.append(mapped)
            else:
                keys.append(int.from_bytes(k, "little"))
        direct = None
        share = d.host_share
        # only a fenced share (descriptor version 3) is written directly: the target revokes
        # its fence when it closes the region, and the copies stop (src/direct.c); an older
        # share has no such stop, so it is written over RMA (counted the same: pack_min 0)
        if self.direct and share is not None and share.fence is not None and not d.device:
            f = share.fence
            try:
                direct = _fabric.DirectMap(f"/proc/{share.pid}/fd/{share.fd}", share.dev, share.inode, share.offset,
                                           d.nbytes, (f"/proc/{share.pid}/fd/{f.fd}", f.dev, f.inode, f.slot,
                                                      f.generation, d.owner))
            except KvxferError:
                direct = None   # another host or namespace, no permission, a stale share: RMA
        return RemoteRegion(self, d, tuple(keys), direct)

    # -- writes --------------------------------------------------------------------------
    def _endpoints(self, src, peer, dst):
        self._check_open()
        if not isinstance(src, MemoryRegion) or src.engine is not self:
            raise InvalidArgumentError("src must be a MemoryRegion registered with this engine")
        src._live()
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if not isinstance(dst, RemoteRegion) or dst.engine is not self:
            raise InvalidArgumentError("dst must come from this engine's remote()")
        if dst.descriptor.owner != peer.owner:
            raise DescriptorError("the remote region belongs to another engine than this peer")
        if len(dst.descriptor.keys) != peer.remote_rails:
            raise DescriptorError(
                f"descriptor has {len(dst.descriptor.keys)} rail key(s) but the peer has {peer.remote_rails} rail(s)"
            )

    def _post(self, src, peer, dst, so, do, ln, imm) -> Transfer:
        imm = _check_imm(imm)
        if imm is not None and self._rails[0].cq_data_size < 4:
            raise UnsupportedError(f"provider {self.provider!r} carries no 32-bit immediate data")
        handles = src._live()
        per_rail = []
        bounds = wire.stripe_bounds(len(ln), len(self._rails))
        for i, r in enumerate(self._rails):
            a, b = bounds[i], bounds[i + 1]
            if b > a or (i == 0 and len(ln) == 0):
                per_rail.append(r.write(peer.fi_addrs[i], peer.gens[i], src.ptr, handles[i], dst.base, dst.keys[i],
                                        dst._direct_from(src), so[a:b], do[a:b], ln[a:b], imm, self.iov,
                                        self.max_write, dst._pack_min))
        # what stays alive for the progress thread is owned natively: the triples are copied,
        # and each rail keeps its pending transfers' source registration (with the buffer)
        return Transfer(per_rail, int(ln.sum()) if len(ln) else 0, imm)

    def write(self, src: MemoryRegion, src_offset: int, peer: Peer, dst: RemoteRegion, dst_offset: int,
              nbytes: int, imm: Optional[int] = None) -> Transfer:
        """One contiguous write (split above ``max_write``)."""
        self._endpoints(src, peer, dst)
        src_offset = _nonneg(src_offset, "src_offset")
        dst_offset = _nonneg(dst_offset, "dst_offset")
        nbytes = _nonneg(nbytes, "nbytes")
        if src_offset + nbytes > src.nbytes:
            raise OutOfBoundsError(f"source range [{src_offset}, {src_offset + nbytes}) is outside the {src.nbytes}-byte region")
        if dst_offset + nbytes > dst.nbytes:
            raise OutOfBoundsError(f"destination range [{dst_offset}, {dst_offset + nbytes}) is outside the {dst.nbytes}-byte remote region")
        if len(self._rails) == 1 or nbytes < len(self._rails):
            # one triple on the first rail (what split_write gives here), without numpy: a
            # small write's Python cost is most of its latency
            imm = _check_imm(imm)
            if imm is not None and self._rails[0].cq_data_size < 4:
                raise UnsupportedError(f"provider {self.provider!r} carries no 32-bit immediate data")
            h = self._rails[0].write_one(peer.fi_addrs[0], peer.gens[0], src.ptr, src._live()[0], dst.base, dst.keys[0],
                                         dst._direct_from(src), src_offset, dst_offset, nbytes, imm, self.iov,
                                         self.max_write, dst._pack_min)
            return Transfer([h], nbytes, imm)
        # with several rails the range is cut into one equal part per rail (wire.split_write)
        so, do, ln = wire.split_write(src_offset, dst_offset, nbytes, len(self._rails))
        return self._post(src, peer, dst, so, do, ln, imm)

    def write_pages(self, src: MemoryRegion, src_pages: npt.ArrayLike, peer: Peer, dst: RemoteRegion,
                    dst_pages: npt.ArrayLike, page_bytes: int,
                    *, src_stride: Optional[int] = None, dst_stride: Optional[int] = None,
                    src_offset: int = 0, dst_offset: int = 0, imm: Optional[int] = None) -> Transfer:
        """Page i copies ``page_bytes`` from ``src_offset + src_pages[i]*src_stride`` to
        ``dst_offset + dst_pages[i]*dst_stride``; runs contiguous on both sides become one write."""
        self._endpoints(src, peer, dst)
        sp = _as_index(src_pages, "src_pages")
        dp = _as_index(dst_pages, "dst_pages")
        if len(sp) != len(dp):
            raise InvalidArgumentError(f"src_pages has {len(sp)} pages, dst_pages {len(dp)}")
        page_bytes = _nonneg(page_bytes, "page_bytes", positive=True)
        src_offset = _nonneg(src_offset, "src_offset")
        dst_offset = _nonneg(dst_offset, "dst_offset")
        ss = page_bytes if src_stride is None else _nonneg(src_stride, "src_stride", positive=True)
        ds = page_bytes if dst_stride is None else _nonneg(dst_stride, "dst_stride", positive=True)
        if len(sp):
            for side, pages, off, stride, size in (("source", sp, src_offset, ss, src.nbytes),
                                                   ("destination", dp, dst_offset, ds, dst.nbytes)):
                top = int(pages.max())
                if off + top * stride + page_bytes > size:
                    raise OutOfBoundsError(
                        f"{side} page {top} ends at byte {off + top * stride + page_bytes}, "
                        f"beyond the {size}-byte {'remote ' if side == 'destination' else ''}region"
                    )
        so = sp.astype(np.uint64) * np.uint64(ss) + np.uint64(src_offset)
        do = dp.astype(np.uint64) * np.uint64(ds) + np.uint64(dst_offset)
        ln = np.full(len(sp), page_bytes, dtype=np.uint64)
        return self._post(src, peer, dst, so, do, ln, imm)

    def write_batch(self, src: MemoryRegion, peer: Peer, dst: RemoteRegion, src_offsets: npt.ArrayLike,
                    dst_offsets: npt.ArrayLike, lengths: npt.ArrayLike,
                    imm: Optional[int] = None) -> Transfer:
        """Arbitrary (src offset, dst offset, length) triples, in order: what a planner emits."""
        self._endpoints(src, peer, dst)
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        if not (len(so) == len(do) == len(ln)):
            raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
        if len(ln):
            se = so + ln
            de = do + ln
            i, j = int(se.argmax()), int(de.argmax())
            if int(se[i]) > src.nbytes:
                raise OutOfBoundsError(f"source write {i} ends at byte {int(se[i])}, beyond the {src.nbytes}-byte region")
            if int(de[j]) > dst.nbytes:
                raise OutOfBoundsError(f"destination write {j} ends at byte {int(de[j])}, beyond the {dst.nbytes}-byte remote region")
        return self._post(src, peer, dst, so, do, ln, imm)

    def hold_awake(self, hold: bool = True) -> None:
        """Take (``hold=True``) or release a hold that keeps every rail's progress thread
        polling instead of sleeping in its back-off: arrivals are expected soon (a streamed
        request's layers). Costs CPU while held; holds nest."""
        self._check_open()
        for r in self._rails:
            r.hold_awake(1 if hold else -1)

    def watcher(self, *, word: int = 0, poll_us: float = 10.0, cpus: Optional[Iterable[int]] = None,
                keep: Any = None, rt_priority: int = 0) -> Watcher:
        """A native counter watcher that posts armed writes when a counter reaches their
        threshold (see ``Watcher``); pinned to ``cpus`` (default: the engine's)."""
        self._check_open()
        _check_watch(poll_us, rt_priority)
        word = _check_word(word)
        cpus = self.cpus if cpus is None else _check_cpus(cpus)
        w = Watcher(self, word, poll_us, cpus or (), keep, rt_priority)
        self._watchers.add(w)
        return w

    def region_pairs(self, peer: Peer, pairs: Iterable[tuple]) -> "RegionPairs":
        """Check ``(src MemoryRegion, dst RemoteRegion of peer)`` pairs once, for
        ``write_pairs``: a request's region table (one pair per layer, say) is checked when a
        peer connects, not on every post."""
        self._check_open()
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        try:
            pairs = [(s, d) for s, d in pairs]
        except (TypeError, ValueError):
            raise InvalidArgumentError("pairs must be (src, dst) region pairs") from None
        try:
            usrc, udst = set(p[0] for p in pairs), set(p[1] for p in pairs)
        except TypeError:
            raise InvalidArgumentError("a pair's src or dst is not a region") from None
        for src in usrc:
            if not isinstance(src, MemoryRegion) or src.engine is not self:
                raise InvalidArgumentError("src must be a MemoryRegion registered with this engine")
            src._live()
        for dst in udst:
            if not isinstance(dst, RemoteRegion) or dst.engine is not self:
                raise InvalidArgumentError("dst must come from this engine's remote()")
            if dst.descriptor.owner != peer.owner:
                raise DescriptorError("the remote region belongs to another engine than this peer")
            if len(dst.descriptor.keys) != peer.remote_rails:
                raise DescriptorError(f"descriptor has {len(dst.descriptor.keys)} rail key(s) but the peer has "
                                      f"{peer.remote_rails} rail(s)")
        return RegionPairs(self, peer, pairs)

    def write_groups(self, peer: Peer, groups: Iterable[tuple], *, imm: Optional[int] = None,
                     rail: Optional[int] = None) -> Transfer:
        """Many ``(src, dst, src_offsets, dst_offsets, lengths)`` groups to one peer with one
        imm, as ONE ``Transfer``: a request's rank pair over many regions (one per layer,
        say). Each group is what ``write_batch(src, peer, dst, ...)`` would post; all groups
        are validated at once (on any bad one nothing is posted, and the error names the
        group) and posted by one native loop with the GIL released.

        The message rule applies to each group on its own: writes of different groups never
        merge, so ``num_writes`` is the sum of ``count_writes`` over the groups. ``rail``
        pins every group to that local rail (``nearest_rail(placement)`` of the source GPU;
        count with one rail); None cuts each group over all rails as ``write_batch`` does.
        Posting the same region pairs often? Check them once with ``region_pairs`` and use
        ``write_pairs``."""
        groups = groups if isinstance(groups, (list, tuple)) else list(groups)
        try:
            if set(map(len, groups)) - {5}:
                raise ValueError
            srcs, dsts, sos, dos, lns = zip(*groups) if groups else ((),) * 5
        except (TypeError, ValueError):
            raise InvalidArgumentError("each group is (src, dst, src_offsets, dst_offsets, lengths)") from None
        pairs = self.region_pairs(peer, zip(srcs, dsts))
        try:
            counts = np.fromiter(map(len, lns), np.int64, len(lns))
            for g in np.flatnonzero((np.fromiter(map(len, sos), np.int64, len(sos)) != counts)
                                    | (np.fromiter(map(len, dos), np.int64, len(dos)) != counts))[:1]:
                raise InvalidArgumentError(f"group {g}: triples differ in length: {len(sos[g])}, {len(dos[g])}, "
                                           f"{counts[g]}")
        except TypeError:
            raise InvalidArgumentError("a group's offsets and lengths must be 1-D arrays") from None
        keep = np.flatnonzero(counts).tolist()      # empty groups post nothing (and spoil dtypes)
        if keep:
            try:
                so, do, ln = (_concat_index([x[i] for i in keep]) for x in (sos, dos, lns))
            except ValueError:
                raise InvalidArgumentError("a group's offsets and lengths must be 1-D arrays") from None
        else:
            so = do = ln = np.empty(0, np.uint64)
        return self.write_pairs(pairs, so, do, ln, counts, imm=imm, rail=rail)

    def write_pairs(self, pairs: "RegionPairs", src_offsets: npt.ArrayLike, dst_offsets: npt.ArrayLike,
                    lengths: npt.ArrayLike, counts: npt.ArrayLike, *,
                    imm: Optional[int] = None, rail: Optional[int] = None) -> Transfer:
        """``write_groups`` over a checked ``RegionPairs`` table: group g is pair g with the
        next ``counts[g]`` triples of the concatenated ``src_offsets``, ``dst_offsets``,
        ``lengths`` (a pair with count 0 posts nothing). One vectorised validation, one
        native loop (GIL released), one ``Transfer``; nothing posted on bad input."""
        self._check_open()
        if not isinstance(pairs, RegionPairs) or pairs.engine is not self:
            raise InvalidArgumentError("pairs must come from this engine's region_pairs()")
        peer = pairs.peer
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if rail is not None:
            if isinstance(rail, bool) or not isinstance(rail, (int, np.integer)) or not 0 <= rail < len(self._rails):
                raise InvalidArgumentError(f"rail must be an int in [0, {len(self._rails)}), got {rail!r}")
            rail = int(rail)
        imm = _check_imm(imm)
        if imm is not None and self._rails[0].cq_data_size < 4:
            raise UnsupportedError(f"provider {self.provider!r} carries no 32-bit immediate data")
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        if not (len(so) == len(do) == len(ln)):
            raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
        c = _as_index(counts, "counts")
        if len(c) != len(pairs):
            raise InvalidArgumentError(f"counts has {len(c)} entries for {len(pairs)} region pairs")
        # no count beyond the triples: the int64 sum (and the group starts) cannot wrap then
        # (a wrapped sum equal to len(ln) sent check_groups far past the arrays)
        if len(c) and int(c.max()) > len(ln):
            raise InvalidArgumentError(f"counts has an entry ({int(c.max())}) beyond the {len(ln)} triples")
        c = c.astype(np.int64)
        if int(c.sum()) != len(ln):
            raise InvalidArgumentError(f"counts add up to {int(c.sum())}, but there are {len(ln)} triples")
        if c.all():                         # the pairs that post
            which = np.arange(len(c), dtype=np.int64)
        else:
            which = np.flatnonzero(c)
            c = c[which]
        starts = np.zeros(len(c) + 1, np.int64)
        np.cumsum(c, out=starts[1:])
        bad = _fabric.check_groups(so, do, ln, starts, which, pairs.src_sizes, pairs.dst_sizes)
        if bad is not None:
            g, side, i, end = bad
            p = int(which[g])
            size = int((pairs.dst_sizes if side else pairs.src_sizes)[p])
            raise OutOfBoundsError(f"group {p}: {'destination' if side else 'source'} write {i} ends at byte {end}, "
                                   f"beyond the {size}-byte {'remote ' if side else ''}region")
        nr = len(self._rails)
        if rail is not None or nr == 1:
            k = 0 if rail is None else rail
            sets = [self._rails[k].write_groups(peer.fi_addrs[k], peer.gens[k], pairs.handles[k], pairs.dst_base, pairs.keys[k],
                                                pairs.directs, which, so, do, ln, starts, imm, self.iov, self.max_write,
                                                pairs.pack_mins)]
        else:
            sets = []
            for k in range(nr):
                # each group cut over the rails as write_batch cuts it (wire.stripe_bounds)
                lo, hi = c * k // nr, c * (k + 1) // nr
                sel = np.flatnonzero(hi > lo)
                if not len(sel):
                    continue
                lens = (hi - lo)[sel]
                st = np.zeros(len(sel) + 1, np.int64)
                np.cumsum(lens, out=st[1:])
                # rail k's triples: [starts[g] + lo[g], starts[g] + hi[g]) of each selected group g
                idx = np.repeat(starts[sel] + lo[sel] - st[:-1], lens) + np.arange(int(st[-1]))
                sets.append(self._rails[k].write_groups(peer.fi_addrs[k], peer.gens[k], pairs.handles[k], pairs.dst_base,
                                                        pairs.keys[k], pairs.directs, which[sel], so[idx], do[idx],
                                                        ln[idx], st, imm, self.iov, self.max_write, pairs.pack_mins))
        return Transfer(sets, int(ln.sum()) if len(ln) else 0, imm)

    def nearest_rail(self, placement: Any) -> Optional[int]:
        """The local rail nearest to a ``Placement`` (from ``Topology.assign``): the first of
        its NICs (nearest first) that one of this engine's rails was opened on; None when
        none is (then let ``write_groups`` stripe). For ``write_groups(..., rail=)``."""
        doms = [r.domain_name for r in self._rails]
        for d in getattr(placement, "domains", ()):
            if d in doms:
                return doms.index(d)
        return None

    def count_writes(self, src_offsets: npt.ArrayLike, dst_offsets: npt.ArrayLike, lengths: npt.ArrayLike, *,
                     region: MemoryRegion | RemoteRegion) -> int:
        """How many messages (= immediates at the target) ``write_batch`` of these triples into
        ``region`` posts: ``wire.count_writes`` with this engine's ``iov``, ``max_write`` and
        rails, and its ``pack_min``, or 0 where the region's descriptor carries a host share
        (rule 3 does not apply to such a region, whichever path, direct or RMA, the sender
        takes). ``region``: a ``RemoteRegion`` of this engine (the sender's side), or a
        ``MemoryRegion`` of it that peers write into (the receiver's side: what a peer with
        this engine's settings posts there). For ``write_pages`` pass its triples (see
        ``wire.count_writes``); for ``write_groups``, add the counts of the groups."""
        if isinstance(region, MemoryRegion):
            if region.engine is not self:
                raise InvalidArgumentError("region must be registered with this engine")
            if not region.remote:
                raise InvalidArgumentError("region was registered with remote=False: no peer writes into it")
            pack_min = self._pack_min(region.host_share)
        elif isinstance(region, RemoteRegion):
            if region.engine is not self:
                raise InvalidArgumentError("region must come from this engine's remote()")
            pack_min = region._pack_min
        else:
            raise ArgumentTypeError(f"region must be a MemoryRegion or RemoteRegion, not {type(region).__name__}")
        return wire.count_writes(src_offsets, dst_offsets, lengths, self.iov, self.max_write, pack_min,
                                 rails=len(self._rails))

    def _fence_take(self, share: wire.HostShare, nbytes: int) -> Optional[_FenceSlot]:
        """A slot of this engine's fence table for a region that offers ``share`` (the table
        is made at the first; the slot records the share's memfd and range, which peers check
        before they map it), or None: no memfd, or every slot taken (the region's share then
        goes without a fence, and peers write into it over RMA)."""
        with self._lock:
            if self._closed:
                return None
            if self._fence is None:
                try:
                    table = _fabric.FenceTable(FENCE_SLOTS, wire.owner_digest(self.address))
                    st = os.fstat(table.fd)
                except (KvxferError, OSError):
                    return None
                self._fence, self._fence_file = table, (st.st_dev, st.st_ino)
            try:
                slot = self._fence_free.pop()
            except IndexError:
                if self._fence_next >= self._fence.slots:
                    return None
                slot, self._fence_next = self._fence_next, self._fence_next + 1
            table = self._fence
            gen = table.issue(slot, share.dev, share.inode, share.offset, nbytes)
        return _FenceSlot(self, table, slot, gen, *self._fence_file)

    def _fence_give(self, slot: int, reusable: bool) -> None:
        # without self._lock: a region's release runs under it (register's undo after a
        # racing close()) and from finalizers, which a collection may start in any thread
        # while it holds the lock (connect, register and disconnect allocate under it); a
        # deque's append and pop are atomic
        if reusable:
            self._fence_free.append(slot)
        else:
            self._fence_stuck.append(slot)

    def _pack_min(self, host_share: Optional[wire.HostShare]) -> int:
        """Rule 3's bound for writes into a region whose descriptor carries ``host_share``:
        none (0) with one, since a direct write's memcpy gains nothing from sending small
        pieces alone (the RMA fallback packs them too, so the count never depends on the
        path); ``pack_min`` otherwise."""
        return 0 if host_share is not None else self.pack_min

    # -- counters ------------------------------------------------------------------------
    def expect(self, imm: int, count: int, callback: Optional[Callable[[Counter], Any]] = None) -> Counter:
        """Expect ``count`` writes carrying ``imm``. Arrivals already banked are credited.

        ``callback(counter)`` runs once, on the engine's dispatcher thread, when all arrived.
        """
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("expect needs an imm")
        imm = checked
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count <= 0:
            raise InvalidArgumentError(f"count must be a positive int, got {count!r}")
        if callback is not None and not callable(callback):
            raise InvalidArgumentError("callback must be callable")
        if count >= 2**63:
            raise InvalidArgumentError(f"count {count} is beyond any transfer")
        # the lock orders registration before the dispatcher can pop a counter that
        # completes at once from banked arrivals
        with self._lock:
            try:
                handle = self._rails[0].expect(imm, int(count), callback is not None)
            except InvalidArgumentError:
                raise InvalidArgumentError(f"imm {imm} already has an unfinished expectation") from None
            c = Counter(handle, imm, int(count), callback)
            if callback is not None:
                self._callbacks[handle.address] = c
                if self._dispatcher is None:
                    self._dispatcher = threading.Thread(target=self._dispatch, name="kvxfer-dispatch", daemon=True)
                    self._dispatcher.start()
        return c

    def banked(self, imm: int) -> int:
        """Arrivals of ``imm`` received and not yet consumed by an expectation."""
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("banked needs an imm")
        return self._rails[0].banked(checked)

    def discard(self, imm: int) -> int:
        """Retire ``imm``: withdraw its unfinished expectation (its ``Counter`` ends with
        ``state == "discarded"``, ``wait`` raises ``ClosedError``, no callback runs), drop
        its banked arrivals, and return how many arrivals were dropped (banked ones plus
        those credited to the withdrawn expectation).

        Only arrivals received before the call are retired: a write of ``imm`` arriving
        later is banked as new and credits the next ``expect(imm, ...)``. So retire an imm
        only once every write that can carry it has arrived, or never use it again. The
        fence, knowing the sender's final ``Transfer.posted`` = P: ``d = discard(imm)``; if
        ``d < P``: ``expect(imm, P - d).wait(...)``, then ``discard(imm)`` again."""
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("discard needs an imm")
        with self._lock:
            dropped, addr = self._rails[0].discard(checked)
            if addr:
                self._callbacks.pop(addr, None)
        return int(dropped)

    def _dispatch(self) -> None:
        first = self._rails[0]
        while True:
            addr = first.next_done(0.2)
            if addr == -1:
                return
            if addr is None:
                continue
            with self._lock:
                c = self._callbacks.pop(addr, None)
            if c is not None and c.callback is not None:
                try:
                    c.callback(c)
                except BaseException:  # a user callback must not kill the dispatcher: a
                    # SystemExit (sys.exit() in a callback) ended the thread, and no later
                    # counter's callback ever ran
                    import traceback

                    traceback.print_exc()

    # -- control messages ----------------------------------------------------------------
    def send(self, peer: Peer, data: bytes, timeout: Optional[float] = 30.0) -> None:
        """A small control message (at most 64 KiB) over FI_MSG, for protocol coordination.
        Raises TimeoutError if the provider's queue stays full for ``timeout`` seconds."""
        self._check_open()
        timeout = _timeout(timeout)
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"a control message is bytes, not {type(data).__name__}")
        buf = np.frombuffer(bytes(data), dtype=np.uint8)
        if len(buf) > _fabric.MSG_MAX:
            raise InvalidArgumentError(f"control message of {len(buf)} bytes exceeds {_fabric.MSG_MAX}")
        if not self._rails[0].send(peer.fi_addrs[0], peer.gens[0], buf, timeout):
            raise TimeoutError(f"control message not accepted by the provider within {timeout} s")

    def recv(self, timeout: Optional[float] = None) -> bytes:
        """The next control message received; TimeoutError if none within ``timeout`` s."""
        self._check_open()
        m = self._rails[0].recv(_timeout(timeout))
        if m is None:
            raise TimeoutError(f"no control message within {timeout} s")
        return m


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
        if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in obj):
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
