"""The engine: endpoints, registered regions, paged writes with immediate data, counters.

This is the validating face over kvxfer._fabric. Everything a caller can get wrong is
checked here, before anything is posted; the native layer then posts whole batches with
the GIL released. What the progress thread reads stays alive natively: a transfer owns a
copy of its offsets, each rail holds its pending transfers' source registrations, and a
registration holds its buffer, until the last completion has been read.
"""

from __future__ import annotations

import errno as _errno
import operator
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from kvxfer import wire
from kvxfer.errors import (
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

__all__ = ["Engine", "Peer", "MemoryRegion", "RemoteRegion", "Transfer", "Counter", "providers"]

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


def _nonneg(v, name: str, positive: bool = False) -> int:
    """A plain Python int from an int or numpy integer scalar (numpy scalars wrap around in
    arithmetic, which would defeat the bounds checks)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {v!r}")
    v = operator.index(v)
    if v < (1 if positive else 0):
        raise InvalidArgumentError(f"{name} must be {'positive' if positive else 'non-negative'}, got {v}")
    return v


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"timeout must be a number of seconds, got {timeout!r}")
    t = float(timeout)
    if not t >= 0 or t == float("inf"):
        raise InvalidArgumentError(f"timeout must be finite and non-negative, got {timeout!r}")
    return t


def _check_imm(imm) -> Optional[int]:
    if imm is None:
        return None
    if isinstance(imm, bool) or not isinstance(imm, (int, np.integer)):
        raise InvalidArgumentError(f"imm must be an int in [0, 2**32), got {type(imm).__name__}")
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
    if rails is not None and (isinstance(rails, bool) or int(rails) < 1):
        raise InvalidArgumentError(f"rails must be a positive int, got {rails!r}")


def _check_cpus(cpus) -> tuple:
    """The progress threads' CPUs (from the caller or a placement): ones this process may use."""
    if cpus is None:
        return ()
    cpus = tuple(cpus)
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c not in allowed]
    if bad:
        raise InvalidArgumentError(f"cpus {bad} are not CPUs this process may run on {sorted(allowed)}")
    return tuple(int(c) for c in cpus)


def _check_nics(nics) -> Optional[list[str]]:
    if nics is None:
        return None
    nics = [str(n) for n in nics]
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

    __slots__ = ("engine", "address", "fi_addrs", "remote_rails", "owner", "closed", "__weakref__")

    def __init__(self, engine: "Engine", address: bytes, fi_addrs: tuple, remote_rails: int) -> None:
        self.engine = engine
        self.address = address
        self.fi_addrs = fi_addrs
        self.remote_rails = remote_rails
        self.owner = wire.owner_digest(address)
        self.closed = False

    def close(self, timeout: float = 1.0) -> None:
        """``Engine.disconnect(self)``: cancel its transfers, forget its address. Idempotent."""
        self.engine.disconnect(self, timeout)

    def __repr__(self) -> str:
        return f"<Peer {self.remote_rails} rail(s) of {self.engine.provider}{' closed' if self.closed else ''}>"


class MemoryRegion:
    """Local memory registered with the engine. Keeps its buffer alive until closed."""

    def __init__(self, engine: "Engine", handles: list, obj: Any, ptr: int, nbytes: int, device: str,
                 remote: bool = True) -> None:
        self.engine = engine
        self.remote = remote
        self._handles = handles      # one RegionHandle (registration) per rail
        self._obj = obj
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device

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
        return wire.Descriptor(
            owner=wire.owner_digest(self.engine.address),
            provider=self.engine.provider,
            base=base,
            nbytes=self.nbytes,
            keys=keys,
            virt_addr=virt,
            raw=raw,
            device=self.device != "cpu",
        ).encode()

    def _live(self) -> list:
        if self.closed:
            raise ClosedError("memory region is closed")
        return self._handles

    @property
    def closed(self) -> bool:
        return not self._handles or self._handles[0].closed

    def close(self) -> None:
        """Deregister (on every rail). Refused while a transfer from this region is still
        posting or in flight: wait for it (or cancel it) first."""
        if self._handles and not self.engine.closed:
            if not self.engine._rails[0].close_if_idle(self._handles):
                raise InvalidArgumentError("memory region has transfers in flight; wait for them before closing it")
        self._close()

    def _close(self) -> None:
        """Deregister on every rail, even if one fails; then raise the first failure."""
        handles, self._handles, self._obj = self._handles, [], None
        first: Optional[BaseException] = None
        for h in handles:
            try:
                h.close()
            except FabricError as exc:
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "MemoryRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MemoryRegion {self.nbytes} bytes on {self.device}{' closed' if self.closed else ''}>"


class RemoteRegion:
    """A peer's region, decoded from its descriptor: where this engine may write."""

    def __init__(self, engine: "Engine", desc: wire.Descriptor, keys: tuple) -> None:
        self.engine = engine
        self.descriptor = desc
        self.nbytes = desc.nbytes
        self.base = desc.base
        self.keys = keys          # per local rail: the key of the remote rail it talks to

    @property
    def key(self) -> int:
        return self.keys[0]

    def __repr__(self) -> str:
        return f"<RemoteRegion {self.nbytes} bytes, {len(self.descriptor.keys)} rail(s)>"


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

    def __init__(self, handle, imm: int, count: int, callback) -> None:
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
        if not self._handle.wait(timeout):
            raise TimeoutError(f"imm {self.imm}: {self._handle.arrived}/{self.count} writes arrived after {timeout} s")
        if self._handle.errno == _errno.EIDRM:
            raise ClosedError(f"imm {self.imm}: the expectation was discarded ({self.arrived}/{self.count} arrived)")
        if self._handle.errno:
            raise ClosedError(f"imm {self.imm}: engine closed before the writes arrived")

    def __repr__(self) -> str:
        return f"<Counter imm={self.imm} {self.arrived}/{self.count}>"


class Engine:
    """One libfabric RDM endpoint with a native progress thread.

    ``provider``: a libfabric provider string ("tcp;ofi_rxm", "shm", "efa", "verbs;ofi_rxm");
    None takes FI_PROVIDER, else the first of PREFERENCE that opens. ``node``: the local
    address to bind (tests pass "127.0.0.1"). Options: ``progress`` ("block" or "spin"),
    ``cpus`` (CPU ids to pin the progress thread to), ``hmem`` (ask for FI_HMEM, needed to
    register GPU memory), ``iov`` (pieces per RMA message, at most the provider's limit),
    ``max_write`` (bytes per RMA message; larger writes are split), ``pack_min`` (pieces
    shorter than this travel one per message; default: what the provider can inject, since
    an injected small write beats a packed copy on shm). ``nics``: libfabric domain names,
    one rail (endpoint, progress thread) each, over which paged writes are striped;
    ``placement``: a ``kvxfer.Placement`` from ``Topology.assign``, giving NICs and CPUs;
    ``rails``: without ``nics``, open this many endpoints on the provider's default domain
    (on shm, two rails copy in parallel).
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
    ) -> None:
        _need_native()
        self._closed = True          # until the rails are open and started
        self._lock = threading.Lock()
        self._regions: "weakref.WeakSet[MemoryRegion]" = weakref.WeakSet()
        self._callbacks: dict[int, Counter] = {}
        self._dispatcher: Optional[threading.Thread] = None
        self._raw_keys: list[tuple[Any, int]] = []
        self._peers: dict[bytes, Peer] = {}
        self._rails: list = []
        _check_options(progress, iov, max_write, pack_min, rails)
        if provider is None:
            provider = os.environ.get("FI_PROVIDER") or None
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
        try:
            for r in self._rails:
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
        each rail (queued writes are cancelled, posted ones get 1 s to complete); quiesce each
        rail (no caller inside native code, progress thread joined); close each rail's
        endpoint, AV and CQ (pending transfers and counters fail); deregister the regions;
        unmap peers' raw keys; close each rail's domain and fabric, last rail first; join the
        dispatcher."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._rails:
            return
        self._rails[0].dispatch_stop()
        for r in self._rails:           # let posted writes finish (bounded), queued ones go
            r.drain(1.0)
        for r in self._rails:           # nobody posts from here on
            r.quiesce()
        for r in self._rails:           # endpoints go before the registrations they used
            r.close_endpoint()
        for r in list(self._regions):       # a failure is reported, never stops the close
            try:
                r._close()
            except FabricError as exc:
                warnings.warn(f"closing {r!r}: {exc}", ResourceWarning, stacklevel=2)
        for rail, k in self._raw_keys:
            try:
                rail.unmap_key(k)
            except FabricError as exc:
                warnings.warn(f"unmapping a peer's raw key: {exc}", ResourceWarning, stacklevel=2)
        for r in reversed(self._rails):
            r.close()
        d = self._dispatcher
        if d is not None and d is not threading.current_thread():
            d.join(timeout=5)
        self._callbacks.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
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
        }

    def stats(self) -> dict:
        self._check_open()
        out: dict = {}
        for r in self._rails:
            for k, v in r.stats().items():
                out[k] = out.get(k, 0) + v
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
            fi_addrs = tuple(
                r.av_insert(np.frombuffer(a.names[i % len(a.names)], dtype=np.uint8)) for i, r in enumerate(self._rails)
            )
            peer = Peer(self, address, fi_addrs, len(a.names))
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
        for r, addr in zip(self._rails, peer.fi_addrs):
            r.cancel_peer(addr)
        deadline = time.monotonic() + timeout
        for r, addr in zip(self._rails, peer.fi_addrs):
            _, posting = r.wait_peer_idle(addr, max(0.0, deadline - time.monotonic()))
            if posting == 0 and not r.closed:
                r.av_remove(addr)

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
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        finally:
            if dmabuf >= 0:       # each registration holds its own reference to the dma-buf
                os.close(dmabuf)
        region = MemoryRegion(self, mrs, keep, ptr, nbytes, device, bool(remote))
        with self._lock:
            if self._closed:       # close() ran while we registered: undo, not leak
                region._close()
                raise ClosedError("engine is closed")
            self._regions.add(region)
        return region

    def remote(self, descriptor: bytes) -> RemoteRegion:
        """Decode a peer's ``MemoryRegion.descriptor()``; writes are bounded by its size."""
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
        return RemoteRegion(self, d, tuple(keys))

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
                per_rail.append(r.write(peer.fi_addrs[i], src.ptr, handles[i], dst.base, dst.keys[i], so[a:b], do[a:b], ln[a:b],
                                  imm, self.iov, self.max_write, self.pack_min))
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
            h = self._rails[0].write_one(peer.fi_addrs[0], src.ptr, src._handles[0], dst.base, dst.keys[0],
                                         src_offset, dst_offset, nbytes, imm, self.iov, self.max_write,
                                         self.pack_min)
            return Transfer([h], nbytes, imm)
        # with several rails the range is cut into one equal part per rail (wire.split_write)
        so, do, ln = wire.split_write(src_offset, dst_offset, nbytes, len(self._rails))
        return self._post(src, peer, dst, so, do, ln, imm)

    def write_pages(self, src: MemoryRegion, src_pages, peer: Peer, dst: RemoteRegion, dst_pages, page_bytes: int,
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

    def write_batch(self, src: MemoryRegion, peer: Peer, dst: RemoteRegion, src_offsets, dst_offsets, lengths,
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

    def count_writes(self, src_offsets, dst_offsets, lengths) -> int:
        """``wire.count_writes`` with this engine's ``iov``, ``max_write``, ``pack_min`` and rails."""
        return wire.count_writes(src_offsets, dst_offsets, lengths, self.iov, self.max_write, self.pack_min,
                                 rails=len(self._rails))

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
                except Exception:  # a user callback must not kill the dispatcher
                    import traceback

                    traceback.print_exc()

    # -- control messages ----------------------------------------------------------------
    def send(self, peer: Peer, data: bytes, timeout: Optional[float] = 30.0) -> None:
        """A small control message (at most 64 KiB) over FI_MSG, for protocol coordination.
        Raises TimeoutError if the provider's queue stays full for ``timeout`` seconds."""
        self._check_open()
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"a control message is bytes, not {type(data).__name__}")
        buf = np.frombuffer(bytes(data), dtype=np.uint8)
        if len(buf) > _fabric.MSG_MAX:
            raise InvalidArgumentError(f"control message of {len(buf)} bytes exceeds {_fabric.MSG_MAX}")
        if not self._rails[0].send(peer.fi_addrs[0], buf, timeout):
            raise TimeoutError(f"control message not accepted by the provider within {timeout} s")

    def recv(self, timeout: Optional[float] = None) -> bytes:
        """The next control message received; TimeoutError if none within ``timeout`` s."""
        self._check_open()
        m = self._rails[0].recv(timeout)
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
            return int(obj.ptr), int(obj.nbytes), "cpu", sys_iface, 0, -1, keep
        ordinal = int(getattr(obj, "ordinal", 0))
        fd = -1
        if _fabric.HAVE_DMABUF and hasattr(obj, "dmabuf_fd"):
            try:
                fd = int(obj.dmabuf_fd())
            except KvxferError:
                fd = -1
        return int(obj.ptr), int(obj.nbytes), f"cuda:{ordinal}", _fabric.HMEM_CUDA, ordinal, fd, keep
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, (int, np.integer)) for v in obj):
        ptr, nbytes = int(obj[0]), int(obj[1])
        if ptr <= 0:
            raise InvalidArgumentError("a raw pointer must be non-zero")
        return ptr, nbytes, "cpu", sys_iface, 0, -1, None
    # torch tensors
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous")
        nbytes = obj.numel() * obj.element_size()
        if obj.device.type == "cpu":
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
        else:
            raise InvalidArgumentError(f"cannot register {type(obj).__name__}: not a buffer, tensor or (ptr, nbytes)") from None
    if mv.readonly:
        raise InvalidArgumentError("buffer is read-only: RMA needs writable memory")
    if not mv.c_contiguous:
        raise InvalidArgumentError("buffer must be C-contiguous")
    arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    ptr = arr.__array_interface__["data"][0] if mv.nbytes else 0
    return int(ptr), mv.nbytes, "cpu", sys_iface, 0, -1, (obj, mv)
