"""The engine's writes: each call checked whole (regions, peer, offsets, bounds), then posted natively.

``_Writes`` is a base of ``Engine`` holding its write calls: ``write``, ``write_pages``,
``write_batch``, ``region_pairs``, ``write_groups``, ``write_pairs`` and ``count_writes``
(what the message rule makes of a batch, with rule 3's bound per region, ``_pack_min``). Nothing is posted on bad input; what the progress
thread reads is copied and owned natively (a ``Transfer``'s handles).
"""

from __future__ import annotations

import errno as _errno
from typing import Any, Iterable, Optional

import numpy as np
import numpy.typing as npt

from kvxfer import wire
from kvxfer._check import as_int, check_triples
from kvxfer.engine._args import _as_index, _as_offsets, _check_imm, _concat_index, _nonneg, _page_triples
from kvxfer.engine.rails import Peer, _fabric
from kvxfer.engine.regions import MemoryRegion, RegionPairs, RemoteRegion
from kvxfer.engine.transfer import Transfer
from kvxfer.errors import ArgumentTypeError, DescriptorError, InvalidArgumentError, OutOfBoundsError, PeerError, \
    UnsupportedError


def _check_remote(region: RemoteRegion, peer: Peer, keys: tuple, op: str) -> None:
    """A peer's region as the other end of a write (``keys``: its descriptor's write keys) or a
    read (its read keys): its descriptor names this peer as owner and has one key per peer
    rail; a region without keys for ``op`` was not offered for it (DescriptorError)."""
    if region.descriptor.owner != peer.owner:
        raise DescriptorError("the remote region belongs to another engine than this peer")
    if not keys:
        raise DescriptorError(f"the remote region was not offered for {op}s: its descriptor has no {op} keys"
                              + (" (register it readable=True and send its descriptor)" if op == "read" else
                                 " (a reads-only descriptor)"))
    if len(keys) != peer.remote_rails:
        raise DescriptorError(f"descriptor has {len(keys)} rail {op} key(s) but the peer has {peer.remote_rails} rail(s)")


class _Writes:
    """``Engine``'s write calls (a base class: they use its rails, iov, max_write and lock)."""

    def _pack_min(self, host_share: Optional[wire.HostShare]) -> int:
        """Rule 3's bound for writes into a region whose descriptor carries ``host_share``:
        none (0) with one, since a direct write's memcpy gains nothing from sending small
        pieces alone (the RMA fallback packs them too, so the count never depends on the
        path); ``pack_min`` otherwise."""
        return 0 if host_share is not None else self.pack_min

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
        _check_remote(dst, peer, dst.descriptor.keys, "write")

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
        so, do, ln = _page_triples(page_bytes,
                                   ("src", "source", "region", src_pages, src_offset, src_stride, src.nbytes),
                                   ("dst", "destination", "remote region", dst_pages, dst_offset, dst_stride,
                                    dst.nbytes))
        return self._post(src, peer, dst, so, do, ln, imm)

    def write_batch(self, src: MemoryRegion, peer: Peer, dst: RemoteRegion, src_offsets: npt.ArrayLike,
                    dst_offsets: npt.ArrayLike, lengths: npt.ArrayLike,
                    imm: Optional[int] = None) -> Transfer:
        """Arbitrary (src offset, dst offset, length) triples, in order: what a planner emits."""
        self._endpoints(src, peer, dst)
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        check_triples(so, do, ln, src.nbytes, dst.nbytes)
        return self._post(src, peer, dst, so, do, ln, imm)

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
            _check_remote(dst, peer, dst.descriptor.keys, "write")
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
        ``lengths`` (a pair with count 0 posts nothing). One validation (a native pass,
        ``_fabric.prepare_pairs``, for uint64 triples and int64 counts; numpy's checks for
        any other input), one native loop (GIL released), one ``Transfer``; nothing posted
        on bad input."""
        self._check_open()
        if not isinstance(pairs, RegionPairs) or pairs.engine is not self:
            raise InvalidArgumentError("pairs must come from this engine's region_pairs()")
        peer = pairs.peer
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if rail is not None:
            rail = as_int(rail, "rail", minimum=0, maximum=len(self._rails) - 1)
        imm = _check_imm(imm)
        if imm is not None and self._rails[0].cq_data_size < 4:
            raise UnsupportedError(f"provider {self.provider!r} carries no 32-bit immediate data")
        # uint64 triples and int64 counts (what the messenger's templates give): one native
        # pass checks and copies them; anything else takes the checks below, which name it
        fast = _fabric.prepare_pairs(src_offsets, dst_offsets, lengths, counts)
        if fast is not None and len(counts) == len(pairs):
            so, do, ln, starts, which, nbytes = fast
            c = None                          # the posting groups' counts: np.diff(starts)
        else:
            so, do, ln, starts, which, c = self._pair_args(pairs, src_offsets, dst_offsets, lengths, counts)
            nbytes = int(ln.sum()) if len(ln) else 0
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
            if c is None:
                c = np.diff(starts)
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
        return Transfer(sets, nbytes, imm)

    @staticmethod
    def _pair_args(pairs: "RegionPairs", src_offsets: Any, dst_offsets: Any, lengths: Any, counts: Any) -> tuple:
        """``write_pairs``' checks of anything ``prepare_pairs`` does not take: ``(so, do,
        ln, starts, which, c)`` (c: the posting groups' counts), or the precise error."""
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
        return so, do, ln, starts, which, c

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

