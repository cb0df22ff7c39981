"""The Engine: its rails, peers (connect/disconnect), register/remote.

Its writes, reads, counters, control messages and permit table come from its bases
(writes.py, reads.py, counters.py, messages.py, permits.py).

This is the validating face over kvxfer._fabric. Everything a caller can get wrong is
checked here, before anything is posted; the native layer then posts whole batches with
the GIL released. What the progress thread reads stays alive natively: a transfer owns a
copy of its offsets, each rail holds its pending transfers' source registrations, and a
registration holds its buffer, until the last completion has been read.

On shm, a region that is a shared memfd mapping (a host ``KVBuffer``, or any view of one)
travels with a host share in its descriptor, and a peer engine maps it and writes into it
directly: a memcpy per message, then a 0-byte write carrying the imm (src/direct.c). The
target counts exactly what it counts over RMA. The share names the region's word in this
engine's permit table, which ``MemoryRegion.close()`` revokes (and waits out) before it
returns, so no peer's copy lands after the close (``_PermitSlot``). ``Engine(direct=False)`` or
``KVXFER_SHM_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import errno as _errno
import os
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from kvxfer import _environ, _maps, _shm, wire
from kvxfer.engine._args import _check_cpus, _check_nics, _check_options, _check_progress_rt, _check_timeout, _timeout
from kvxfer.engine.rails import (Peer, _fabric, _message_limits, _need_native, _open_rails, _progress_rt,
                                 _warn_progress_rt)
from kvxfer.engine.regions import MemoryRegion, RemoteRegion, _resolve_buffer
from kvxfer.engine.revoke import Revocations
from kvxfer.engine.transfer import Counter
from kvxfer.engine.counters import _Counters
from kvxfer.engine.messages import _Messages
from kvxfer.engine.permits import _Permits
from kvxfer.engine.reads import _Reads
from kvxfer.engine.writes import _Writes
from kvxfer.engine.watcher import Watcher, _check_word, check_watch
from kvxfer.errors import (
    ArgumentTypeError,
    ClosedError,
    DescriptorError,
    FabricError,
    InvalidArgumentError,
    KvxferError,
    UnsupportedError,
)


def _close_at_exit(ref: "weakref.ref[Engine]", pid: int) -> None:
    """An engine still open when the interpreter exits is closed, as a messenger is: a shm
    engine's region and doorbell in /dev/shm go with it (issue 26.4). Not in a forked child
    (``pid`` is the opener's): its copy of the engine has no threads and is not its to close."""
    e = ref()
    if e is not None and not e.closed and os.getpid() == pid:
        try:
            e.close()
        except Exception:
            pass


# >>> issue 22: deprecated name
class _Stats(dict):
    """``Engine.stats()``: a dict whose renamed keys still answer ``[]``, with a warning (issue 22)."""

    _RENAMED = {"direct_fence_stuck": "direct_permit_stuck"}

    def __missing__(self, key: str) -> Any:
        new = self._RENAMED.get(key)
        if new is None:
            raise KeyError(key)
        import warnings
        warnings.warn(f"stats()[{key!r}] is deprecated, use {new!r}", DeprecationWarning, stacklevel=2)
        return self[new]
# <<< issue 22


class Engine(_Writes, _Reads, _Counters, _Messages, _Permits):
    """A process's transfer endpoint over one or more rails: each rail one libfabric RDM
    endpoint with its native progress thread (one per NIC in ``nics``, or ``rails`` on one).

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
    stale memfd) is written over RMA, silently. ``progress_rt_priority`` (0: off, the default;
    else 1..99): each progress thread puts itself at SCHED_FIFO at that priority when it starts,
    so on a loaded machine it runs at each wake-up instead of waiting in the run queue (issue 28);
    ``progress="block"`` only (``InvalidArgumentError`` with "spin"). A caller posting in this
    process then returns later (the thread preempts it to post the queued rest itself) and its
    transfer completes sooner (docs/benchmarks.md, issue 28). Refused by the kernel
    (EPERM: no CAP_SYS_NICE, or RLIMIT_RTPRIO below it), the engine still opens, at normal
    scheduling, with a ``kvxfer.errors.SchedulingWarning``; ``stats()["progress_rt"]`` is the
    priority granted (0: none) and ``stats()["progress_rt_errno"]`` the refusal's errno.
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
        progress_rt_priority: int = 0,
    ) -> None:
        _need_native()
        pt = _timeout(peer_timeout, "peer_timeout")
        if pt == 0:
            raise InvalidArgumentError("peer_timeout must be positive (None: never declare a silent peer dead)")
        self._closed = True          # until the rails are open and started
        self._parked = False         # close() left an endpoint open (kx_rail_park)
        self._lock = threading.Lock()
        self._regions: "weakref.WeakSet[MemoryRegion]" = weakref.WeakSet()
        # the permit table of direct writes into our regions (src/direct.c): made at the first
        # registration that offers a host share; one slot per such region
        self._permit: Any = None
        self._permit_file = (0, 0)        # its (dev, inode)
        self._permit_free: "collections.deque[int]" = collections.deque()    # given back without the lock
        self._permit_next = 0
        self._permit_stuck: "collections.deque[int]" = collections.deque()   # slots a writer never left (never reused)
        self._callbacks: dict[int, Counter] = {}
        self._dispatcher: Optional[threading.Thread] = None
        self._raw_keys: list[tuple[Any, int]] = []
        self._peers: dict[bytes, Peer] = {}
        self._revokes = Revocations(self)   # a region's close, announced to its writers
        self._watchers: "weakref.WeakSet[Watcher]" = weakref.WeakSet()
        self._rails: list = []
        _check_options(progress, iov, max_write, pack_min, rails)
        rt_prio = _check_progress_rt(progress, progress_rt_priority)
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
                r.set_progress_rt(rt_prio)
                r.start(self.cpus)
            self._address = wire.Address(self.provider, tuple(r.getname() for r in self._rails)).encode()
        except BaseException:
            for r in reversed(self._rails):
                r.close()
            raise
        #: the SCHED_FIFO priority asked for the progress threads (0: normal scheduling)
        self.progress_rt_priority = rt_prio
        _warn_progress_rt(self._rails, rt_prio)
        self._closed = False
        #: closes this engine at interpreter exit unless it was closed before (unregistered then)
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), os.getpid())
        atexit.register(self._at_exit)
        if self.provider.split(";")[0] == "shm" and os.environ.get("KVXFER_SHM_REAP", "1") != "0":
            # files of this user's shm processes that died unclosed (SIGKILL): never reused,
            # 16 MiB each; the pid in a name is checked against its process's start time
            _shm.reap_stale()

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
        at_exit = getattr(self, "_at_exit", None)
        if at_exit is not None:
            atexit.unregister(at_exit)
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
        if not self._rails[0].closed:
            self._revokes.bye()           # peers stop announcing their closes here (revoke.py)
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
        self._permit = None                  # its regions' slots hold it until they are done
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
        out: dict = _Stats()
        for r in self._rails:
            for k, v in r.stats().items():
                out[k] = out.get(k, 0) + v
        # closed regions whose permit a peer's copy never left (a writer killed mid-copy)
        out["direct_permit_stuck"] = len(self._permit_stuck)
        # progress_rt_priority's outcome: the SCHED_FIFO priority the progress threads run at
        # (0: normal scheduling) and, where it was refused, the errno (EPERM: no CAP_SYS_NICE)
        out["progress_rt"], out["progress_rt_errno"] = _progress_rt(self._rails)
        # keys of peers' regions their owners closed: writes to them fail, posting nothing (revoke.py)
        out["revoked_keys"] = self._rails[0].revoked_keys
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
        """Insert a peer's address (from its ``Engine.address``) into the address vector, and
        tell the peer ours (a HELLO, waited for up to 1 s), so that it announces the close of
        its regions here before deregistering them (kvxfer/engine/revoke.py)."""
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
                self._revokes.claimed(address)   # the caller's now (revoke.py)
                return peer
            slots = [r.av_insert(np.frombuffer(a.names[i % len(a.names)], dtype=np.uint8))
                     for i, r in enumerate(self._rails)]
            peer = Peer(self, address, tuple(s[0] for s in slots), tuple(s[1] for s in slots), len(a.names))
            self._peers[address] = peer
        self._revokes.hello(peer)        # so that a region it closes is announced here
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
        if not peer.closed and not self._closed:
            self._revokes.bye([peer])     # its closes announce nothing more here (revoke.py)
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
                r.av_remove(addr, max(0.0, deadline - time.monotonic()) + 0.1, gen)

    def register(self, obj: Any, *, remote: bool = True, readable: bool = False) -> MemoryRegion:
        """Register memory for RMA: a writable buffer, a DLPack/CPU-torch tensor, a KVBuffer,
        an object with ``__cuda_array_interface__``, or ``(ptr, nbytes)``. ``remote=False``
        registers a source only: no peer can write into it or read it, and it has no
        descriptor. ``readable=True`` (with ``remote``) also offers it for peers' reads: a
        second registration, ``FI_REMOTE_READ`` only, with its own keys, which travel only as
        the descriptor's read keys (``descriptor(reads_only=True)``: those alone); the write
        registration asks ``FI_REMOTE_WRITE`` only. An engine reads only regions offered so
        (``read_pages``); what each provider itself enforces: docs/architecture.md, "Security"."""
        self._check_open()
        for name, v in (("remote", remote), ("readable", readable)):
            if not isinstance(v, (bool, np.bool_)):
                raise ArgumentTypeError(f"{name} must be True or False, got {v!r}")
        if readable and not remote:
            raise InvalidArgumentError("a remote=False region is never readable by peers: register it with "
                                       "readable=True (and remote=True), and hand out descriptor(reads_only=True)")
        ptr, nbytes, device, iface, ordinal, dmabuf, keep = _resolve_buffer(obj)
        if nbytes <= 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        if iface != _fabric.HMEM_SYSTEM and not (self._rails[0].caps & _fabric.CAP_HMEM):
            raise UnsupportedError(
                f"provider {self.provider!r} engine has no FI_HMEM: device memory ({device}) needs "
                "Engine(..., hmem=True) on a provider that offers it (shm, efa, verbs)"
            )
        mrs, rds = [], []
        try:
            for r in self._rails:
                mrs.append(r.mr_reg(ptr, nbytes, iface, ordinal, dmabuf,
                                    _fabric.REMOTE_WRITE if remote else 0))
                mrs[-1].keep = keep      # a registration keeps its memory alive
            for r in self._rails if readable else ():
                rds.append(r.mr_reg(ptr, nbytes, iface, ordinal, dmabuf, _fabric.REMOTE_READ))
                rds[-1].keep = keep
        except FabricError as exc:
            for mr in rds + mrs:
                mr.close()
            # a libfabric built without this device's HMEM support (Debian's 1.17 and CUDA)
            # answers ENOSYS/EOPNOTSUPP from fi_mr_regattr: say which feature is missing
            if iface != _fabric.HMEM_SYSTEM and exc.errno in (_errno.ENOSYS, _errno.EOPNOTSUPP):
                raise UnsupportedError(f"this libfabric cannot register {device} memory ({exc}): it was built "
                                       "without that device's HMEM support") from exc
            raise
        except BaseException:
            for mr in rds + mrs:
                mr.close()
            raise
        finally:
            if dmabuf >= 0:       # each registration holds its own reference to the dma-buf
                os.close(dmabuf)
        # a shared memfd mapping: shm peers may map it and write directly (src/direct.c)
        share = _maps.host_share(ptr, nbytes) if self.direct and remote and device == "cpu" else None
        permit = self._permit_take(share, nbytes) if share is not None else None
        if permit is not None:         # the share names it: peers copy only while it allows
            share = dataclasses.replace(share, permit=permit.wire())
        region = MemoryRegion(self, mrs, keep, ptr, nbytes, device, bool(remote), share, permit, rds)
        if permit is not None:
            # the slot lives as long as the registration, not the MemoryRegion object: a region
            # dropped while a transfer from it still holds its registration keeps taking its
            # peers' copies (as RMA writes to its key still land), and revoking then would let
            # their imms count without their data
            mrs[0].permit = permit
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
        keys, read_keys = [], []
        for kind, out in ((d.keys, keys), (d.read_keys, read_keys)):
            for i, r in enumerate(self._rails if kind else ()):
                k = kind[i % len(kind)]
                if d.raw:
                    mapped = r.map_raw(d.base, np.frombuffer(k, dtype=np.uint8))
                    self._raw_keys.append((r, mapped))
                    out.append(mapped)
                else:
                    out.append(int.from_bytes(k, "little"))
        direct = None
        share = d.host_share
        # only a permitted share (descriptor version 3) is written directly: the target revokes
        # its permit when it closes the region, and the copies stop (src/direct.c); an older
        # share has no such stop, so it is written over RMA (counted the same: pack_min 0)
        if self.direct and share is not None and share.permit is not None and not d.device and d.keys:
            f = share.permit
            try:
                direct = _fabric.DirectMap(f"/proc/{share.pid}/fd/{share.fd}", share.dev, share.inode, share.offset,
                                           d.nbytes, (f"/proc/{share.pid}/fd/{f.fd}", f.dev, f.inode, f.slot,
                                                      f.generation, d.owner))
            except KvxferError:
                direct = None   # another host or namespace, no permission, a stale share: RMA
        return RemoteRegion(self, d, tuple(keys), direct, tuple(read_keys))

    # -- progress and the watcher (writes, reads, counters: writes.py, reads.py, counters.py)
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
        check_watch(poll_us, rt_priority, polled=bool(word))
        word = _check_word(word)
        cpus = self.cpus if cpus is None else _check_cpus(cpus)
        w = Watcher(self, word, poll_us, cpus or (), keep, rt_priority)
        self._watchers.add(w)
        return w

