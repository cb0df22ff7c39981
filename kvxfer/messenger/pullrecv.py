"""The decode room's pull road: a leg's EXPOSE checked, planned and read, its reads drained,
and the DONE that releases the prefiller's pages.

A mixin of ``decode.Decoder`` (it owns the Receive's transitions; these are the pull road's).
On each leg's EXPOSE the decoder checks it against the request (its id, ``num_tokens``, the
count of the prefiller's other writes, the source pages' count and range; anything else fails
the Receive with ``DescriptorError`` and nothing is read), plans it with the push road's
planner (``prefix.request_plan``: the same plan, the same replica owners for
``Request.replica_seed``) and reads every (source rank of the leg, destination rank held)
pair with one ``Engine.read_groups`` each (``pull.pull_plan``) from the peer's reads-only
region table. The prefill room's reaper thread waits on the reads (GIL-free native waits)
and calls ``reads_drained``. A leg is complete once its reads all completed and its context
(if any) was credited; it is fenced only once no read of it is in flight (an abort cancels
them and waits), and then, being exposed, its peer is sent DONE (flagged aborted unless
complete): the only message that releases the prefiller's pages, but its death.
"""

from __future__ import annotations

import time
from typing import Any

from kvxfer.errors import DescriptorError, KvxferError
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P
from kvxfer.messenger import prefix
from kvxfer.messenger._node import FINAL
from kvxfer.messenger.paged import RemoteRegionTable
from kvxfer.messenger.pull import pull_plan
from kvxfer.planner import request_seed

__all__ = ["PullReader"]


class _Reads:
    """A leg's reads as the prefill room's reaper settles things: ``transfers``, ``finalize``."""

    __slots__ = ("dec", "r", "leg", "transfers")
    done = False

    def __init__(self, dec: Any, r: Any, leg: Any, transfers: list) -> None:
        self.dec, self.r, self.leg, self.transfers = dec, r, leg, transfers

    def finalize(self) -> bool:
        self.dec.reads_drained(self.r, self.leg)
        return True


class PullReader:
    """``Decoder``'s pull-road transitions (a mixin: it uses the decoder's tables and lock)."""

    #: set by the messenger: hand something with ``transfers`` and ``finalize()`` to the reaper
    reap: Any = None
    #: set by the messenger: rank -> this messenger's RegionTable (the reads' destinations)
    local: Any = None

    def _bad_expose(self, r: Any, leg: Any, m: C.Control) -> str:
        """Why this EXPOSE cannot be read ("" if it can)."""
        lay = leg.peer.layout
        if not leg.pull:
            return "it exposed a request it was asked to write (push)"
        if C.encode_request_id(m.request_id) != C.encode_request_id(r.request_id):
            return f"it names request {m.request_id!r} on the leg of {r.request_id!r}"
        if m.num_tokens != r.num_tokens:
            return f"it exposes {m.num_tokens} tokens of a {r.num_tokens}-token request"
        want = 1 if leg.slot >= 0 else 0
        if m.count != want:
            return f"it announces {m.count} context write(s); this leg takes {want}"
        n = prefix.src_page_count(r.num_tokens, lay.page_size)
        if len(m.pages) != n:
            return f"it names {len(m.pages)} source pages; {r.num_tokens} tokens fill exactly {n} of {lay.page_size}"
        if n and int(m.pages.max()) >= lay.num_pages:
            return f"source page {int(m.pages.max())} is outside its {lay.num_pages} pages"
        return ""

    def on_expose(self, pg: Any, m: C.Control) -> None:
        r, leg = self._leg_of(pg, m.imm)
        if leg is None:            # late or hostile: nothing is read; its pages go free
            self.peers.post(pg, C.DONE, imm=m.imm, flags=P.DONE_ABORTED | P.DONE_UNKNOWN)
            return
        node = self.node
        with node.lock:
            if leg.exposed:
                node.count("drop_duplicate_expose")
                return
            leg.exposed = True                       # a DONE is owed from now on
            why = self._bad_expose(r, leg, m)
            stopped = r._aborting or r._state in FINAL
            if not why:
                leg.announced = int(m.count)
                if r._state == "pending":
                    r._state = "transferring"
        if why:
            self.fail(r, DescriptorError(f"peer {pg.uid:016x}'s EXPOSE of request {r.request_id!r} is refused "
                                         f"(nothing read): {why}"))
            return
        if stopped:
            return                                   # fenced by the ABORTED; then DONE(aborted)
        try:
            p = prefix.request_plan(pg.layout, pg.sharding, self.layout, self.sharding, m.pages, r.dst_pages,
                                    r.first_token, r.num_tokens, request_seed(C.encode_request_id(r.request_id)))
            pairs = [(s, d) for s, d in p.pairs if s in pg.readable and d in self.local]
            tables = {s: RemoteRegionTable(pg.readable[s]) for s, _ in pairs}
        except KvxferError as exc:
            self.fail(r, exc)
            return
        err = None
        with node.lock:
            if r._aborting or r._state in FINAL:
                return
            try:
                for s, d in pairs:
                    leg.reads += pull_plan(node.engine, p, s, d, self.local[d], pg.peer, tables[s]).transfers
            except KvxferError as exc:
                err = exc
            leg.drained = not leg.reads
            if leg.reads:
                node.count("pull_reads", sum(t.num_reads for t in leg.reads))
                node.count("pull_read_bytes", sum(t.nbytes for t in leg.reads))
        if err is not None:
            self._stop_reads(r)
            self.fail(r, err)
        if leg.reads:
            self.reap(_Reads(self, r, leg, list(leg.reads)))
        elif err is None:
            self.reads_drained(r, leg)
        if m.count:
            self.arm_count(r, leg, int(m.count))

    def _stop_reads(self, r: Any) -> None:
        """Cancel every read of ``r`` still in flight (they drain; the reaper says when)."""
        for leg in r.legs:
            if not leg.drained:
                for t in leg.reads:
                    t.cancel()

    def reads_drained(self, r: Any, leg: Any) -> None:
        """Every read of ``leg`` is final (the reaper): complete, or fenced if it waited."""
        err = None
        with self.node.lock:
            if leg.fenced:
                return
            leg.drained = True
            # a read cancelled by an abort or a failure may end in error: that one is expected
            stopping = r._aborting or r._state in FINAL
            err = None if stopping else next((t.error for t in leg.reads if t.error is not None), None)
            if err is None and not stopping:
                leg.reads_ok = True
                if leg.ctx_done or not leg.announced:
                    leg.complete = True
                    self._fence_leg(leg)
            elif leg.fence_pending:
                self._fence_leg(leg)
            cbs = self._progress(r)
        self._finished(r, cbs)
        if err is not None:
            self.fail(r, err)

    def stop_pulls(self, err: BaseException, timeout: float) -> None:
        """The messenger closes: every pull in flight fails (its reads cancelled) and its reads
        drain (bounded) before the peers are told BYE, which frees their pages."""
        with self.node.lock:
            rs = [r for r in dict.fromkeys(self.receives.values()) if r.pull and r._state not in FINAL]
        for r in rs:
            self.fail(r, err)
        self.drain_reads(timeout)

    def drain_reads(self, timeout: float) -> None:
        """The messenger closes: wait (bounded) for the cancelled reads still in flight, so
        their Receives fence and no read lands in pages after ``close`` returned."""
        deadline = time.monotonic() + timeout
        with self.node.lock:
            legs = [(r, leg) for r in dict.fromkeys(self.receives.values()) for leg in r.legs if not leg.drained]
        for r, leg in legs:
            for t in leg.reads:
                try:
                    t.wait(max(0.0, deadline - time.monotonic()))
                except KvxferError:
                    pass
            if all(t.done for t in leg.reads):
                self.reads_drained(r, leg)

    def owe_done(self, leg: Any) -> None:
        """Under the lock, ``leg`` just fenced: tell an exposing peer its pages are free."""
        if leg.exposed and not leg.done_sent:
            leg.done_sent = True
            self.peers.post(leg.peer, C.DONE, imm=leg.imm, flags=0 if leg.complete else P.DONE_ABORTED)

    def reads_pending(self, leg: Any) -> bool:
        """Under the lock, before ``leg`` fences: True (and its reads cancelled) while a read
        of it may still be in flight; ``reads_drained`` fences it later."""
        if leg.drained:
            return False
        leg.fence_pending = True
        for t in leg.reads:
            t.cancel()
        return True

