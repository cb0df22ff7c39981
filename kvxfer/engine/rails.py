"""An engine's rails and its peers on them: opening rails (provider preference, one per NIC), ``Peer``.

A rail is one endpoint with its progress thread (``_fabric.Rail``); an engine stripes over
its rails. Here: which providers open, opening the rails of one engine, the message
rule's limits taken from the first rail, and ``Peer``: one address-vector entry per rail.
"""

from __future__ import annotations

import errno
import warnings
from typing import TYPE_CHECKING, Any, Optional

from kvxfer import wire
from kvxfer.errors import FabricError, SchedulingWarning, UnsupportedError

_fabric: Any
try:
    from kvxfer import _fabric
except ImportError as _exc:  # pragma: no cover - exercised only on broken installs
    _fabric = None
    _IMPORT_ERROR = _exc

if TYPE_CHECKING:
    from kvxfer.engine.engine import Engine

#: Tried in this order when no provider is named: RDMA hardware first, then sockets.
PREFERENCE = ("efa", "verbs;ofi_rxm", "psm3", "cxi", "tcp;ofi_rxm", "shm")


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
        # reaches the peer libfabric puts in the slot next (src/peers.c, kx_peer_enter)
        self.gens = gens
        self.remote_rails = remote_rails
        self.owner = wire.owner_digest(address)
        self.closed = False

    def close(self, timeout: float = 1.0) -> None:
        """``Engine.disconnect(self)``: cancel its transfers, forget its address. Idempotent."""
        self.engine.disconnect(self, timeout)

    def __repr__(self) -> str:
        return f"<Peer {self.remote_rails} rail(s) of {self.engine.provider}{' closed' if self.closed else ''}>"


def _progress_rt(rails: list) -> tuple[int, int]:
    """``progress_rt_priority``'s outcome over an engine's rails: the SCHED_FIFO priority
    every progress thread runs at (0 if any runs at normal scheduling), and the errno the
    first refusal gave (0: none)."""
    got = [r.progress_rt() for r in rails]
    prio = min(p for p, _ in got) if got else 0
    return prio, next((e for _, e in got if e), 0)


def _warn_progress_rt(rails: list, asked: int) -> None:
    """A SchedulingWarning when ``asked`` (> 0) was not granted to every progress thread:
    the engine runs, at normal scheduling; ``stats()`` says so too."""
    if not asked:
        return
    prio, err = _progress_rt(rails)
    if prio != asked:
        why = errno.errorcode.get(err, str(err)) if err else "not applied"
        warnings.warn(f"progress_rt_priority={asked}: SCHED_FIFO refused ({why}; it needs CAP_SYS_NICE or "
                      f"RLIMIT_RTPRIO >= {asked}): the progress threads run at normal scheduling "
                      f"(stats()['progress_rt'] == 0, stats()['progress_rt_errno'] == {err})",
                      SchedulingWarning, stacklevel=3)
