"""The engine's reads (the pull road): each call checked whole, then posted natively with ``fi_readmsg``.

``_Reads`` is a base of ``Engine`` holding its read calls, the mirrors of its writes:
``read`` (one range), ``read_pages`` (``write_pages``), ``read_batch`` (``write_batch``) and
``read_groups`` (``write_groups``). A read copies bytes of a peer's region into a local
region; it carries no immediate, the peer's CQ sees nothing, and it completes on this
engine's own CQ (``ReadTransfer``, done when every message's completion came back, with the
first error kept). The message rule's rules 1 and 2 cut the triples into messages (at most
``iov`` pieces and ``max_write`` bytes each); rails stripe them as they stripe writes.

The engine's own rule, whatever a provider enforces (docs/architecture.md, "Security"): it
reads a peer's region only where the peer offered it for reading, i.e. only with the read keys
of a version 4 descriptor (``Engine.register(..., readable=True)``), never with a write key;
a region without read keys is refused with ``DescriptorError`` and nothing is posted. Every
triple is checked against both regions first (``OutOfBoundsError``, nothing posted).
"""

from __future__ import annotations

import errno as _errno
from typing import Any, Iterable, Optional

import numpy as np
import numpy.typing as npt

from kvxfer import wire
from kvxfer._check import as_int
from kvxfer.engine._args import _as_offsets, _concat_index, _nonneg, _page_triples
from kvxfer.engine.rails import Peer, _fabric
from kvxfer.engine.regions import MemoryRegion, RemoteRegion
from kvxfer.engine.transfer import Transfer
from kvxfer.engine.writes import _check_remote
from kvxfer.errors import ClosedError, DescriptorError, InvalidArgumentError, KvxferError, OutOfBoundsError, PeerError


def _check_reads(lo: np.ndarray, ro: np.ndarray, ln: np.ndarray, local_size: int, remote_size: int) -> None:
    """``check_triples`` in a read's words: every local range ends within ``local_size`` and
    every remote range within ``remote_size`` (``OutOfBoundsError`` naming the read that ends
    furthest); arrays of equal count (``InvalidArgumentError``)."""
    if not (len(lo) == len(ro) == len(ln)):
        raise InvalidArgumentError(f"triples differ in length: {len(lo)}, {len(ro)}, {len(ln)}")
    if len(ln):
        le, re_ = lo + ln, ro + ln
        i, j = int(le.argmax()), int(re_.argmax())
        if int(le[i]) > local_size:
            raise OutOfBoundsError(f"local read {i} ends at byte {int(le[i])}, beyond the {local_size}-byte region")
        if int(re_[j]) > remote_size:
            raise OutOfBoundsError(f"remote read {j} ends at byte {int(re_[j])}, beyond the {remote_size}-byte "
                                   "remote region")


class ReadTransfer(Transfer):
    """A batch of posted reads: ``num_reads`` messages, ``nbytes`` bytes, complete (``done``,
    ``wait``) when every message's completion came back to this engine; the bytes are in the
    local region once ``wait`` returns without raising. A read the target refuses (a wrong key,
    a closed region, a dead peer) fails its transfer: ``error``, raised by ``wait``."""

    __slots__ = ()

    @property
    def num_reads(self) -> int:
        return self.num_writes

    @property
    def error(self) -> Optional[KvxferError]:
        err = next((x.errno for x in self._handles if x.errno), 0)
        return _fabric.error_from("fi_readmsg", err) if err else None

    def __repr__(self) -> str:
        return f"<ReadTransfer {self.num_writes} reads, {self.nbytes} bytes, {'done' if self.done else 'pending'}>"


class _Reads:
    """``Engine``'s read calls (a base class: they use its rails, iov and max_write)."""

    def _read_ends(self, local: Any, peer: Any, remote: Any) -> None:
        """``local`` a live region of this engine, ``peer`` connected, ``remote`` a readable
        region of that peer (its read keys, one per peer rail)."""
        self._check_open()
        if not isinstance(local, MemoryRegion) or local.engine is not self:
            raise InvalidArgumentError("local must be a MemoryRegion registered with this engine")
        local._live()
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if not isinstance(remote, RemoteRegion) or remote.engine is not self:
            raise InvalidArgumentError("remote must come from this engine's remote()")
        _check_remote(remote, peer, remote.descriptor.read_keys, "read")

    def _post_read(self, local: MemoryRegion, peer: Peer, remote: RemoteRegion, lo: np.ndarray, ro: np.ndarray,
                   ln: np.ndarray) -> ReadTransfer:
        handles = local._live()
        per_rail = []
        bounds = wire.stripe_bounds(len(ln), len(self._rails))
        for i, r in enumerate(self._rails):
            a, b = bounds[i], bounds[i + 1]
            if b > a or (i == 0 and len(ln) == 0):
                per_rail.append(_fabric.read(r, peer.fi_addrs[i], peer.gens[i], handles[i], remote.base,
                                             remote.read_keys[i], remote.nbytes, lo[a:b], ro[a:b], ln[a:b], self.iov,
                                             self.max_write))
        return ReadTransfer(per_rail, int(ln.sum()) if len(ln) else 0, None)

    def read(self, local: MemoryRegion, local_offset: int, peer: Peer, remote: RemoteRegion, remote_offset: int,
             nbytes: int) -> ReadTransfer:
        """One contiguous read of ``nbytes`` from ``remote_offset`` of the peer's region to
        ``local_offset`` of ``local`` (split above ``max_write``, cut over the rails)."""
        self._read_ends(local, peer, remote)
        local_offset = _nonneg(local_offset, "local_offset")
        remote_offset = _nonneg(remote_offset, "remote_offset")
        nbytes = _nonneg(nbytes, "nbytes")
        lo, ro, ln = wire.split_write(local_offset, remote_offset, nbytes, len(self._rails))
        _check_reads(lo, ro, ln, local.nbytes, remote.nbytes)
        return self._post_read(local, peer, remote, lo, ro, ln)

    def read_pages(self, local: MemoryRegion, local_pages: npt.ArrayLike, peer: Peer, remote: RemoteRegion,
                   remote_pages: npt.ArrayLike, page_bytes: int, *, local_stride: Optional[int] = None,
                   remote_stride: Optional[int] = None, local_offset: int = 0, remote_offset: int = 0) -> ReadTransfer:
        """``write_pages``'s mirror: page i reads ``page_bytes`` from ``remote_offset +
        remote_pages[i]*remote_stride`` of the peer's region to ``local_offset +
        local_pages[i]*local_stride`` of ``local``; runs contiguous on both sides become one
        read. Refused before anything is posted: a remote region not offered for reading
        (``DescriptorError``), a page outside either region (``OutOfBoundsError``), malformed
        pages (``InvalidArgumentError``)."""
        self._read_ends(local, peer, remote)
        lo, ro, ln = _page_triples(page_bytes,
                                   ("local", "local", "local region", local_pages, local_offset, local_stride,
                                    local.nbytes),
                                   ("remote", "remote", "remote region", remote_pages, remote_offset, remote_stride,
                                    remote.nbytes))
        return self._post_read(local, peer, remote, lo, ro, ln)

    def read_batch(self, local: MemoryRegion, peer: Peer, remote: RemoteRegion, local_offsets: npt.ArrayLike,
                   remote_offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> ReadTransfer:
        """Arbitrary (local offset, remote offset, length) triples, in order (``write_batch``'s
        mirror): what a planner emits, its source side read from the peer."""
        self._read_ends(local, peer, remote)
        lo = _as_offsets(local_offsets, "local_offsets")
        ro = _as_offsets(remote_offsets, "remote_offsets")
        ln = _as_offsets(lengths, "lengths")
        _check_reads(lo, ro, ln, local.nbytes, remote.nbytes)
        return self._post_read(local, peer, remote, lo, ro, ln)

    def read_groups(self, peer: Peer, groups: Iterable[tuple], *, rail: Optional[int] = None) -> ReadTransfer:
        """Many ``(local, remote, local_offsets, remote_offsets, lengths)`` groups from one
        peer as ONE ``ReadTransfer`` (``write_groups``'s mirror): group g is what
        ``read_batch(local, peer, remote, ...)`` would post; every group is checked at once
        (on a bad one nothing is posted, and the error names the group), then one native loop
        per rail posts them with the GIL released. Reads of different groups never merge.
        ``rail`` pins every group to that local rail; None cuts each group over all rails."""
        self._check_open()
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if rail is not None:
            rail = as_int(rail, "rail", minimum=0, maximum=len(self._rails) - 1)
        groups = groups if isinstance(groups, (list, tuple)) else list(groups)
        try:
            if set(map(len, groups)) - {5}:
                raise ValueError
            locs, rems, los, ros, lns = zip(*groups) if groups else ((),) * 5
        except (TypeError, ValueError):
            raise InvalidArgumentError("each group is (local, remote, local_offsets, remote_offsets, lengths)") from None
        for g, (local, remote) in enumerate(zip(locs, rems)):
            try:
                self._read_ends(local, peer, remote)
            except (DescriptorError, InvalidArgumentError, ClosedError) as exc:
                raise type(exc)(f"group {g}: {exc}") from None
        tri = []
        for g in range(len(groups)):
            arrs = [_as_offsets(x[g], name) for x, name in ((los, "local_offsets"), (ros, "remote_offsets"),
                                                            (lns, "lengths"))]
            try:
                _check_reads(*arrs, locs[g].nbytes, rems[g].nbytes)
            except (InvalidArgumentError, OutOfBoundsError) as exc:
                raise type(exc)(f"group {g}: {exc}") from None
            tri.append(arrs)
        counts = np.array([len(t[2]) for t in tri], np.int64)
        which = np.flatnonzero(counts)          # groups that post
        if not len(which):
            return ReadTransfer([_EmptySet()], 0, None)
        lo, ro, ln = (_concat_index([tri[g][k] for g in which]) for k in range(3))
        c = counts[which]
        starts = np.zeros(len(c) + 1, np.int64)
        np.cumsum(c, out=starts[1:])
        sel_locs = [locs[g] for g in which]
        sel_rems = [rems[g] for g in which]
        nr = len(self._rails)
        rails = [0 if rail is None else rail] if (rail is not None or nr == 1) else list(range(nr))
        sets = []
        for k in rails:
            if len(rails) == 1:
                lo_k, hi_k = np.zeros(len(c), np.int64), c
            else:       # each group cut over the rails as read_batch cuts it (wire.stripe_bounds)
                lo_k, hi_k = c * k // nr, c * (k + 1) // nr
            sel = np.flatnonzero(hi_k > lo_k)
            if not len(sel):
                continue
            lens = (hi_k - lo_k)[sel]
            st = np.zeros(len(sel) + 1, np.int64)
            np.cumsum(lens, out=st[1:])
            idx = np.repeat(starts[sel] + lo_k[sel] - st[:-1], lens) + np.arange(int(st[-1]))
            r = self._rails[k]
            sets.append(_fabric.read_groups(
                r, peer.fi_addrs[k], peer.gens[k], [sel_locs[g]._live()[k] for g in sel],
                np.array([sel_rems[g].base for g in sel], np.uint64),
                np.array([sel_rems[g].read_keys[k] for g in sel], np.uint64),
                np.array([sel_rems[g].nbytes for g in sel], np.uint64), np.arange(len(sel), dtype=np.int64),
                lo[idx], ro[idx], ln[idx], st, self.iov, self.max_write))
        return ReadTransfer(sets, int(ln.sum()), None)


class _EmptySet:
    """What ``read_groups([])`` waits on: nothing, done at once."""

    planned = posted = completed = errno = 0
    done = True

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def cancel(self) -> None:
        pass
