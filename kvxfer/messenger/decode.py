"""The decode side of the protocol: the room that owns every ``Receive``'s transitions
(receive.py holds the object and its legs): REQUEST out, ANNOUNCE / ABORTED / REJECT in, and
the fence.

A ``Receive`` asks one prefill instance for a request's KV. The instance is one peer (a node
holding every source rank) or several (one per prefill rank process): the REQUEST goes to
every peer that has to write (``kvxfer.planner.writing_ranks``), each on its own **leg** with
its own imm, so every peer's writes are counted apart. Each leg's peer announces its own exact
count; the Receive is done once every leg's count was credited (the context is one of the
writes of exactly one leg: the peer holding the lowest writing source rank). Each push leg
also has an **arm** (``Engine.arm_announce``, src/announce.c): when its ANNOUNCE arrives
after every write it counts has landed, or while a caller waits in ``Receive.wait``, the
engine's reading thread checks it and arms the count itself, and that caller wakes from the
engine at the last write, not from the messenger thread; the arm is closed (``_adopt``)
before any other transition of its leg, and what it armed is taken as if the messenger
thread had handled the ANNOUNCE then. Abort, timeout and failure span the legs: every leg not yet fenced is sent ABORT and fences on its own ABORTED
count; a leg whose peer died is fenced once the peer is torn down. The pages are reused only
when every leg is fenced. The pull road (``receive(..., pull=True)``: each leg's peer exposes
its pages, this decoder reads them) is the mixin ``pullrecv.PullReader``.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from kvxfer.errors import (
    ClosedError,
    InvalidArgumentError,
    KvxferError,
    LayoutError,
    PeerError,
    RejectedError,
    TimeoutError,
    UnsupportedError,
)
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _args
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P
from kvxfer.messenger import prefix
from kvxfer.messenger._node import FINAL, Node
from kvxfer.messenger.peers import PeerGroup, Peers, context_stride
from kvxfer.messenger.pullrecv import PullReader
from kvxfer.messenger.receive import Leg, Receive
from kvxfer.planner import chooses_replicas, request_seed, writing_ranks

__all__ = ["Receive", "Leg", "Decoder", "IMM_LIMIT"]     # Receive and Leg live in receive.py

#: imm values the messenger allocates: [1, 2**31); the upper half stays free for the caller.
IMM_LIMIT = 2**31


class Decoder(PullReader):
    """The decode room of one messenger: its receives, imms, context slots and busy pages."""

    def __init__(self, node: Node, peers: Peers, layout: KVLayout, sharding: Sharding, ranks: tuple,
                 context_slots: int, context_bytes: int) -> None:
        self.node = node
        self.peers = peers
        self.layout = layout
        self.sharding = sharding
        self.ranks = ranks
        self.context_slots = context_slots
        self.context_bytes = context_bytes
        self.ctx_stride = context_stride(context_bytes)
        self.ctx_array = np.zeros(max(1, context_slots) * self.ctx_stride, np.uint8)
        self.geometry = layout.resolve(sharding)
        self.free_slots = deque(range(context_slots))
        self.busy_pages = np.zeros(layout.num_pages, bool)     # pages of unfenced receives
        self.receives: dict[int, Receive] = {}                  # any leg's imm -> Receive (not retired)
        self.rids: dict[Any, Receive] = {}                      # request id -> Receive in flight
        self.fencing: set[Receive] = set()
        self.queued: dict[Receive, None] = {}                   # waiting for a connecting peer (in order)
        self._next_imm = 1 + int.from_bytes(os.urandom(3), "little")
        # the legs' arms (src/announce.c); KVXFER_NATIVE_ANNOUNCE=0 leaves every ANNOUNCE to
        # the messenger thread (the A/B of docs/benchmarks.md)
        self.native = os.environ.get("KVXFER_NATIVE_ANNOUNCE", "1") != "0"
        self.armed_seqs: set[tuple[int, int]] = set()          # (peer uid, seq) adopted, not yet read

    # -- asking ---------------------------------------------------------------------------
    def receive(self, peers: Any, request_id: Any, dst_pages: Any, num_tokens: Any, timeout: Any,
                hot: bool, first_token: Any = 0, meta: Any = b"", pull: bool = False) -> Receive:
        groups = self.peers.instance(peers)
        if not isinstance(pull, bool):
            raise InvalidArgumentError(f"pull must be a bool, got {pull!r}")
        timeout = _args.timeout(timeout)
        pages = _args.dst_pages(dst_pages, self.layout.num_pages, C.MAX_PAGES)
        for name, v in (("num_tokens", num_tokens), ("first_token", first_token)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidArgumentError(f"{name} must be an int, got {v!r}")
        num_tokens, first_token = int(num_tokens), int(first_token)
        ps = self.layout.page_size
        if not 0 <= first_token < num_tokens < 2**63:
            raise InvalidArgumentError(f"tokens [{first_token}, {num_tokens}) are not a request: 0 <= first_token "
                                       "< num_tokens")
        need = prefix.dst_page_count(num_tokens, first_token, ps)
        if len(pages) != need:          # the prefiller checks again (against this handshake)
            raise InvalidArgumentError(f"num_tokens {num_tokens} from first_token {first_token} fill exactly {need} "
                                       f"page(s) of {ps} tokens, got {len(pages)} dst_pages")
        try:
            meta = bytes(memoryview(meta))
        except TypeError:
            raise InvalidArgumentError(f"meta must be bytes, got {type(meta).__name__}") from None
        if len(meta) > C.MAX_META:
            raise InvalidArgumentError(f"meta is at most {C.MAX_META} bytes, got {len(meta)}")
        rid_bytes = C.encode_request_id(request_id)
        if isinstance(request_id, bytearray):
            request_id = bytes(request_id)        # a key of the in-flight table; the prefiller sees bytes
        first = groups[0]
        # replicas are dealt chunks of the source's page list: where the page sizes differ it
        # is ceil(num_tokens / the source's page size) long (planner: "Page sizes that differ")
        src_n = len(pages) if first.layout.page_size == self.layout.page_size and not first_token else \
            prefix.source_pages(num_tokens, first_token, first.layout.page_size, ps)
        writers = self._writers(first, src_n, rid_bytes)
        by_rank = {r: pg for pg in groups for r in pg.ranks}
        missing = [s for s in writers if s not in by_rank]
        if missing:
            raise LayoutError(f"source rank(s) {missing} of TP{first.sharding.tp_size} must write this request "
                              "but none of the peers holds them")
        lowest: dict[int, tuple[int, PeerGroup]] = {}     # peer uid -> (its lowest writing rank, peer)
        for s in sorted(writers):
            lowest.setdefault(by_rank[s].uid, (s, by_rank[s]))
        legs_of = [pg for _, pg in sorted(lowest.values(), key=lambda x: x[0])]
        no_reads = [pg for pg in legs_of if pull and pg.readable is None]
        if no_reads:
            raise UnsupportedError(f"peer {no_reads[0].uid:016x} offers no pull (its messenger was made without "
                                   "offer_pull=True): receive(..., pull=False) to have it write")
        pages.flags.writeable = False
        node = self.node
        with node.lock:
            if node.closed:
                raise ClosedError("messenger is closed")
            # again under the lock: a teardown marks the peer dead and collects its receives
            # under it, so a Receive is either refused here or failed by the teardown
            for pg in legs_of:
                if not pg.alive:
                    raise PeerError(f"peer {pg.uid:016x} is dead") from pg.error
            if request_id in self.rids:
                raise InvalidArgumentError(f"request id {request_id!r} is already in flight")
            busy = self.busy_pages[pages]
            if busy.any():
                raise InvalidArgumentError(f"page {int(pages[busy][0])} still belongs to an unfinished or "
                                           "quarantined request")
            if self.context_slots and not self.free_slots:
                raise InvalidArgumentError(f"all {self.context_slots} context slots are in use: release() "
                                           "finished receives")
            slot = self.free_slots.popleft() if self.context_slots else -1
            legs = []
            for i, pg in enumerate(legs_of):       # the first leg holds the lowest writing rank: the context
                legs.append(Leg(pg, self._alloc_imm(legs), slot if i == 0 else -1, pull))
            deadline = None if timeout is None else time.monotonic() + timeout
            r = Receive(self, legs, request_id, pages, int(num_tokens), slot, deadline)
            r.first_token, r.meta, r.pull = first_token, meta, pull
            if self.native and not pull:
                self._open_arms(r)
            if hot:
                node.engine.hold_awake(True)
                r._hot = True
            self.busy_pages[pages] = True
            for leg in legs:
                self.receives[leg.imm] = r
            self.rids[request_id] = r
            node.count("receives")
            if pull:
                node.count("receives_pull")
            queued = any(pg.state == "connecting" for pg in legs_of)
            if queued:                   # sent by peer_up once every leg's peer is up
                self.queued[r] = None
                node.count("receives_queued")
            else:
                # posted under the lock: a teardown (which takes it) finds the Receive and
                # fails it, and an abort can only post its ABORTs after these
                self._post_requests(r, wake=False)
        if slot >= 0:
            weakref.finalize(r, self.free_cell, r._slot_cell)
        if not queued:
            for leg in legs:              # sent from here, no hand-off (or by the sender thread)
                self.peers.flush(leg.peer)
        return r

    def _open_arms(self, r: Receive) -> None:
        """Under the lock, before the REQUESTs go: each leg's arm, which takes only an
        ANNOUNCE from its peer to this messenger, newer than every message of that peer
        accepted so far (an older one of the same imm is a replay), with the count
        ``on_announce`` would accept. An arm the engine refuses leaves the leg to the
        messenger thread."""
        eng, node = self.node.engine, self.node
        most = self.most_writes(r)
        for leg in r.legs:
            try:
                leg.arm = eng.arm_announce(leg.imm, leg.peer.uid, node.uid, leg.peer.recv_seq,
                                           2 if leg.slot >= 0 else 1, most)
            except KvxferError:
                leg.arm = None

    def adopt(self, r: Receive, leg: Leg) -> None:
        """``Receive.wait``: ``leg``'s arm settled (armed, or closed by a transition)."""
        with self.node.lock:
            self._adopt(r, leg)

    def drop_arms(self, pg: PeerGroup) -> None:
        """Under the lock (``Peers.mark_dead``): ``pg`` is dead, its messages are dropped from
        now on, so nothing its ANNOUNCEs armed counts: each of its legs' arms is closed and
        what it armed undone (its arrivals banked again, for the teardown's fence)."""
        for r in dict.fromkeys(self.receives.values()):
            for leg in r.legs:
                if leg.peer is pg and leg.arm is not None:
                    arm, leg.arm = leg.arm, None
                    arm.close(before=0)

    def _adopt(self, r: Receive, leg: Leg, before: Optional[int] = None) -> None:
        """Under the lock, first in every transition of ``leg``: close its arm. A transition
        that handles a message of seq ``before`` takes only an ANNOUNCE that came before it
        (a later one's arming is undone: the messenger reads that ANNOUNCE itself
        afterwards). If an ANNOUNCE had armed it, take it now as ``on_announce`` would have
        then: the count, the counter (its callback asked for if not yet met), the Receive
        transferring, the leg complete if its writes have all landed. The ANNOUNCE itself
        still reaches the messenger thread, which then only accepts its seq."""
        arm = leg.arm
        if arm is None:
            return
        leg.arm = None
        got = arm.close(before)
        if got is None:
            return
        count, seq, c = got
        node = self.node
        leg.announced, leg.arm_seq, leg.counter = count, seq, c
        self.armed_seqs.add((leg.peer.uid, seq))
        node.count("announces_armed")
        if r._state == "pending":
            r._state = "transferring"
            node.hist.observe("receive_announce", time.monotonic() - r.t_start)
        if not c.done:
            try:
                if node.engine.set_callback(c, lambda _c, r=r, leg=leg: self.on_counter(r, leg)):
                    c = None               # completed by the callback (or by a caller's wait)
            except KvxferError:            # the engine is closing: the messenger's close fails it
                c = None
        if c is not None and c.state == "done":
            self.on_counter(r, leg)        # met already: complete (final: wakes a caller once)
        if all(x.counter is not None for x in r.legs):
            r._armed.set()

    def _adopt_all(self, r: Receive) -> None:
        for leg in r.legs:
            if leg.arm is not None:
                self._adopt(r, leg)

    def _writers(self, first: PeerGroup, src_n: int, rid_bytes: bytes) -> tuple[int, ...]:
        """The source ranks that write a request of ``src_n`` source pages from ``first``'s
        instance (``writing_ranks``). Where the source draws no replicas they depend on the
        page count alone: kept per peer (its ``cache``, at most 64 counts), no seed hashed."""
        if chooses_replicas(first.layout, first.sharding):
            return writing_ranks(first.layout, first.sharding, self.layout, self.sharding, self.ranks, src_n,
                                 seed=request_seed(rid_bytes))
        memo = first.cache.setdefault("writers", {})
        w = memo.get(src_n)
        if w is None:
            if len(memo) >= 64:
                memo.clear()
            w = memo[src_n] = writing_ranks(first.layout, first.sharding, self.layout, self.sharding, self.ranks,
                                            src_n)
        return w

    def _post_requests(self, r: Receive, wake: bool = True) -> None:
        """Under the lock: every leg's REQUEST to its outbox (no wait on the engine); the sender
        thread sends them, or with ``wake=False`` ``receive`` flushes them once out of the lock."""
        for leg in r.legs:
            self.peers.post(leg.peer, C.REQUEST, wake=wake, imm=leg.imm, num_tokens=r.num_tokens, slot=leg.slot,
                            request_id=r.request_id, pages=r.dst_pages, first_token=r.first_token, meta=r.meta,
                            flags=P.REQUEST_PULL if r.pull else 0)

    # -- queued for a connecting peer (connect(wait=False)) -----------------------------------
    def _dequeue(self, r: Receive) -> bool:
        """Under the lock: ``r`` waited for a peer (nothing sent): every leg fenced now."""
        if r not in self.queued:
            return False
        del self.queued[r]
        for leg in r.legs:
            leg.abort_sent = leg.fence_ok = True
            self._fence_leg(leg)
        return True

    def peer_up(self, pg: PeerGroup) -> None:
        """``pg`` answered its HELLO: post the REQUESTs of the queued receives whose peers
        are all up now (under the lock, so an abort's ABORTs come after them)."""
        with self.node.lock:
            ready = [r for r in self.queued if any(leg.peer is pg for leg in r.legs)
                     and all(leg.peer.state == "up" for leg in r.legs)]
            for r in ready:
                del self.queued[r]
                self._post_requests(r)

    def connect_failed(self, pg: PeerGroup, err: KvxferError) -> None:
        """``pg``'s connect failed: the receives queued for it fail with its error, fenced."""
        with self.node.lock:
            victims = [r for r in self.queued if any(leg.peer is pg for leg in r.legs)]
        for r in victims:
            self.fail(r, err, fence=lambda leg: True)
            self.release(r)

    def _alloc_imm(self, taken: list) -> int:
        while True:
            imm = self._next_imm
            self._next_imm = imm + 1 if imm + 1 < IMM_LIMIT else 1
            if imm not in self.receives and all(leg.imm != imm for leg in taken):
                return imm

    def free_cell(self, cell: list) -> None:
        """Give a context slot back, once (``cell`` is shared with the Receive's finalizer)."""
        with self.node.lock:
            if cell[0] >= 0:
                self.free_slots.append(cell[0])
                cell[0] = -1

    def release(self, r: Receive) -> None:
        with self.node.lock:
            if r._released or r._state not in FINAL or not r.fenced:
                return
            r._released = True
        self.free_cell(r._slot_cell)

    # -- transitions (under node.lock unless said) ---------------------------------------
    def start_abort(self, r: Receive, skip: Optional[Leg] = None) -> list[Leg]:
        """``r`` is aborting: the legs an ABORT must go to now (marked sent), but ``skip``
        (a leg whose peer stopped by itself)."""
        self._adopt_all(r)
        r._aborting = True
        self._stop_reads(r)
        if self._dequeue(r):
            self._finished(r, self._progress(r))     # nothing was sent: fenced now
            return []
        out = [leg for leg in r.legs if not leg.fenced and not leg.abort_sent and leg is not skip]
        for leg in out:
            leg.abort_sent = True
        return out

    def send_aborts(self, legs: list[Leg]) -> None:
        """ABORT each leg's peer: posted (the sender thread sends it after the leg's REQUEST,
        and tries again while the engine refuses it and the peer lives)."""
        for leg in legs:
            self.peers.post(leg.peer, C.ABORT, imm=leg.imm)

    def _fence_leg(self, leg: Leg) -> None:
        """No write of ``leg`` can land any more: retire its imm."""
        if leg.fenced or self.reads_pending(leg):
            return                 # (a read of it in flight: reads_drained fences it)
        leg.fenced = True
        self.receives.pop(leg.imm, None)
        if not leg.complete:
            # every write that could carry the imm has landed (fence) or never will (the
            # peer is torn down): retire it, so nothing of it is credited to a later request
            try:
                self.node.engine.discard(leg.imm)
            except KvxferError:
                pass
        self.owe_done(leg)

    def _progress(self, r: Receive) -> Optional[list]:
        """Settle what the legs now allow: the final state (once), then the pages once every
        leg is fenced. Returns the callbacks to run if ``r`` just became final, else None."""
        cbs = None
        if r._state not in FINAL:
            state = None
            if all(leg.complete for leg in r.legs):
                state = "done"
            elif r._fail_now:
                state = "failed"
            elif r._aborting and all(leg.fenced for leg in r.legs):
                state = "failed" if r.error is not None else "aborted"
            if state is not None:
                r._state = state
                r.t_done = time.monotonic()
                if r._hot:
                    r._hot = False
                    try:
                        self.node.engine.hold_awake(False)
                    except KvxferError:
                        pass
                self.rids.pop(r.request_id, None)
                cbs, r._callbacks = r._callbacks, []
                self.node.count("receive_" + state)
                if state == "failed" and isinstance(r.error, (RejectedError, TimeoutError)):
                    self.node.count("receive_rejected" if isinstance(r.error, RejectedError) else "receive_timed_out")
                elif state == "done":
                    g = self.geometry
                    self.node.count("receive_bytes", len(self.ranks) * len(r.dst_pages) * g.num_layers * g.planes
                                    * g.block_bytes)
                self.node.hist.observe("receive", r.t_done - r.t_start)
                self.node.report(r)
        if not r.fenced and all(leg.fenced for leg in r.legs):
            r.fenced = True
            r.t_fenced = time.monotonic()
            self.node.report(r)
            self.busy_pages[r.dst_pages] = False
            self.fencing.discard(r)
        elif r.fenced or not any(leg.fence_target is not None and not leg.fenced for leg in r.legs):
            self.fencing.discard(r)
        return cbs

    def _finished(self, r: Receive, cbs: Optional[list]) -> None:
        """Outside the lock: wake waiters and run callbacks of a Receive that became final."""
        if cbs is None:
            return
        r._event.set()
        r._armed.set()
        for fn in cbs:
            self.node.dispatch(fn, r)

    def fail(self, r: Receive, err: BaseException, *, fence: Callable[[Leg], bool] = lambda leg: False,
             cause: Optional[Leg] = None) -> None:
        """``r`` fails now with ``err`` (once); the legs ``fence`` names are fenced; every other
        leg still open but ``cause`` (the leg whose peer failed it) is aborted with the fence:
        the pages wait for those."""
        with self.node.lock:
            self._adopt_all(r)
            if r.error is None and r._state != "done":    # (the adoption may have completed it)
                r.error = err
            if r._state not in FINAL:
                r._fail_now = True
            self._stop_reads(r)
            self._dequeue(r)
            for leg in r.legs:
                if fence(leg):
                    self._fence_leg(leg)
            legs = [leg for leg in r.legs if not leg.fenced and not leg.abort_sent and leg is not cause]
            if legs:
                r._aborting = True
                for leg in legs:
                    leg.abort_sent = True
            cbs = self._progress(r)
        self.send_aborts(legs)
        self._finished(r, cbs)

    def on_counter(self, r: Receive, leg: Leg) -> None:
        """Every announced message of ``leg`` was credited (engine dispatcher or a waiter)."""
        with self.node.lock:
            if leg.complete or leg.fenced:
                return
            if leg.pull:                     # its context: complete once its reads are too
                leg.ctx_done = True
                if not leg.reads_ok:
                    return
            leg.complete = True
            self._fence_leg(leg)
            cbs = self._progress(r)
        self._finished(r, cbs)

    def most_writes(self, r: Receive) -> int:
        """More messages than any leg of ``r``'s pages can take (each carries >= 1 byte)."""
        g = self.geometry
        return len(self.ranks) * len(r.dst_pages) * g.num_layers * g.planes * g.page_stride + 1

    # -- incoming -------------------------------------------------------------------------
    def _leg_of(self, pg: PeerGroup, imm: int) -> tuple[Optional[Receive], Optional[Leg]]:
        with self.node.lock:
            r = self.receives.get(imm)
        leg = None if r is None else next((x for x in r.legs if x.imm == imm and x.peer is pg), None)
        if leg is None:
            self.node.count("drop_unknown_request")
            return None, None
        return r, leg

    def on_announce(self, pg: PeerGroup, m: C.Control) -> None:
        node = self.node
        key = (pg.uid, m.seq)
        with node.lock:
            if key in self.armed_seqs:     # armed by the engine and taken already: its seq counted
                self.armed_seqs.discard(key)
                return
            r, leg = self._leg_of(pg, m.imm)
            if leg is not None and leg.arm is not None:
                self._adopt(r, leg, m.seq)
                if leg.arm_seq == m.seq:   # this message armed it
                    self.armed_seqs.discard(key)
                    return
        if leg is None:
            return
        with node.lock:
            if leg.pull:
                node.count("drop_unexpected_announce")     # a pull leg's peer exposes, never writes
                return
            if leg.announced is not None:
                node.count("drop_duplicate_announce")
                return
            if leg.fence_target is not None or leg.fenced or (r._state in FINAL and not r._aborting):
                # after the ABORTED (the fence counts what it says was posted): an expectation
                # now would collide with the fence's and leave the pages quarantined
                node.count("drop_late_announce")
                return
            least = 2 if leg.slot >= 0 else 1    # a page, and the context
            most = self.most_writes(r)
            bad = not least <= m.count <= most
            if bad:
                node.count("drop_bad_count")
            else:
                leg.announced = m.count
            if r._state == "pending":
                r._state = "transferring"
                node.hist.observe("receive_announce", time.monotonic() - r.t_start)
        if bad:     # writes may still land, none counted: only a teardown frees the pages
            self.peers.broke_protocol(pg, f"it announced {m.count} writes for request {r.request_id!r}, not "
                                          f"{least} to {most}")
            return
        self.arm_count(r, leg, int(m.count))

    def arm_count(self, r: Receive, leg: Leg, count: int) -> None:
        """Expect ``count`` writes of ``leg`` (its ANNOUNCE, or a pull leg's context)."""
        node = self.node
        try:
            # everything already landed (small requests: the data overtakes the ANNOUNCE): no
            # callback, so the engine's dispatcher thread is not woken for nothing. Banked
            # arrivals only grow (nothing but this messenger discards the imm), so the
            # expectation completes at once.
            eng = node.engine
            landed = eng.banked(leg.imm) >= count
            c = eng.expect(leg.imm, count,
                           callback=None if landed else (lambda _c, r=r, leg=leg: self.on_counter(r, leg)))
        except KvxferError as exc:
            self.fail(r, exc)
            return
        leg.counter = c
        if c.done:                         # everything had landed already: no thread hop
            self.on_counter(r, leg)        # (final: wakes a caller in Receive.wait once, not twice)
        if all(x.counter is not None for x in r.legs):
            r._armed.set()                 # a caller in Receive.wait now waits natively

    def on_aborted(self, pg: PeerGroup, m: C.Control) -> None:
        r, leg = self._leg_of(pg, m.imm)
        if leg is None:
            return
        node = self.node
        others: list[Leg] = []
        with node.lock:
            self._adopt(r, leg, m.seq)
            target = (leg.announced or 0) if m.flags & C.ABORTED_UNKNOWN else m.count   # UNKNOWN: it forgot it
            if leg.fenced or (r._state in FINAL and not r._aborting):
                return
            if leg.fence_target is not None:      # a repeated ABORTED: the first count stands
                node.count("drop_duplicate_aborted")
                return
            most = leg.announced if leg.announced is not None else self.most_writes(r)
            trusted = target <= most              # not more than it announced, or than can exist
            if not trusted:
                node.count("drop_bad_count")
            else:
                if m.flags & C.ABORTED_REJECTED and r.error is None:
                    r.error = RejectedError(f"the prefiller rejected request {r.request_id!r} after posting "
                                            f"{target} write(s) (fenced): {m.reason}")
                elif m.flags & C.ABORTED_BY_PREFILLER and r.error is None:
                    r.error = PeerError(f"the prefiller gave up on request {r.request_id!r}")
                leg.fence_target = target
                leg.fence_since = time.monotonic()
                if leg.counter is None and target > 0:
                    try:
                        leg.fence_counter = node.engine.expect(leg.imm, target)
                    except KvxferError:
                        pass
                self.fencing.add(r)
                others = self.start_abort(r, leg)     # the instance stops: the other legs fence too
        if not trusted:          # no fence can be trusted: only a teardown frees the pages
            self.peers.broke_protocol(pg, f"it reported more writes posted for request {r.request_id!r} "
                                          f"than {most}")
            return
        self.send_aborts(others)
        self.check_fence(r, leg)

    def on_reject(self, pg: PeerGroup, m: C.Control) -> None:
        r, leg = self._leg_of(pg, m.imm)
        if r is None:
            return
        with self.node.lock:
            self._adopt(r, leg, m.seq)
        if r._state in FINAL:
            return
        # fenced only if nothing was announced or fenced: else writes may land (only an
        # ABORTED's count, or a teardown, fences that leg then)
        quiet = leg.announced is None and leg.fence_target is None
        if not quiet:
            with self.node.lock:
                r._aborting = True
        self.fail(r, RejectedError(f"the prefiller rejected request {r.request_id!r}: {m.reason}"),
                  fence=lambda x: x is leg and quiet, cause=leg)

    def check_fence(self, r: Receive, leg: Leg, now: Optional[float] = None) -> None:
        target = leg.fence_target or 0
        c = leg.fence_counter or leg.counter
        got = c.arrived if c is not None else 0
        if c is not None and c.done:
            got = max(got, c.count)
        if got >= target:
            with self.node.lock:
                was = leg.fenced
                leg.fence_ok = True
                self._fence_leg(leg)
                cbs = self._progress(r)
            if not was:
                self.node.count("fences")
                self.node.hist.observe("fence", time.monotonic() - leg.fence_since)
            self._finished(r, cbs)
        elif now is not None and now - leg.fence_since > self.node.peer_timeout and leg.peer.alive:
            # writes the peer says it posted have not landed in peer_timeout: they never will
            # (or land whenever they like); only a teardown makes the pages safe to reuse
            self.peers.broke_protocol(leg.peer, f"{target - got} of the {target} writes it reported posted for "
                                                f"request {r.request_id!r} did not land within "
                                                f"{self.node.peer_timeout} s")

    # -- the messenger thread -----------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Timeouts (abort with the fence) and fences waiting for their writes."""
        node = self.node
        aborts: list[Leg] = []
        with node.lock:
            live = list(dict.fromkeys(self.receives.values()))
            expired = [r for r in live if r._deadline is not None and now >= r._deadline
                       and r._state not in FINAL and not r._aborting]
            for r in expired:
                self._adopt_all(r)         # what its arms took came before the deadline was seen
            expired = [r for r in expired if r._state not in FINAL]
            for r in expired:
                r.error = TimeoutError(f"request {r.request_id!r} not done within its timeout")
                aborts += self.start_abort(r)
            fencing = list(self.fencing)
        self.send_aborts(aborts)
        for r in expired:
            # nobody can answer an ABORT on a dead leg: fail now, fenced once the peer is torn down
            if any(not leg.peer.alive for leg in r.legs):
                self.fail(r, r.error, fence=lambda leg: leg.peer.torn_down)
        for r in fencing:
            for leg in r.legs:
                if leg.fence_target is not None and not leg.fenced:
                    self.check_fence(r, leg, now)

    @property
    def busy(self) -> bool:
        """Fences wait: the messenger thread polls faster."""
        return bool(self.fencing)

    def peer_gone(self, pg: PeerGroup, err: KvxferError) -> None:
        """After ``pg``'s teardown: every Receive with a leg on it fails (also one a timeout
        failed meanwhile); that leg is fenced, the others are aborted with the fence."""
        with self.node.lock:
            recvs = [r for r in dict.fromkeys(self.receives.values()) if any(leg.peer is pg for leg in r.legs)]
            self.armed_seqs = {k for k in self.armed_seqs if k[0] != pg.uid}    # its messages are dropped now
        for r in recvs:
            self.fail(r, err, fence=lambda leg: leg.peer is pg)

    def close(self, err: BaseException) -> None:
        """The messenger closes: nothing is left pending (fenced where the peer is torn down)."""
        with self.node.lock:
            left = [r for r in dict.fromkeys(self.receives.values()) if r._state not in FINAL]
        for r in left:
            self.fail(r, err, fence=lambda leg: leg.peer.torn_down)
        self.drain_reads(2.0)         # the pull road: cancelled reads still in flight
