"""The prefill side of the protocol: REQUEST and ABORT in, the request table and inbox, what a
request's writes are (posting plans), the context staging, and the reaper that settles sends.

A prefill messenger holds any subset of the source ranks (one rank process, a node, or
anything between): it posts the writes of its own ranks only and announces its own exact
count; the decoder counts each prefill peer on its own leg. The context is written by the
peer the decoder gave the request's context slot (``Request.slot``; -1: another peer of the
instance writes it). A ``Send`` (send.py) owns its transitions; the ``Prefiller`` owns the
request table, the inbox, the staging slots and the reaper thread (``kvxfer-msg-reap``),
which blocks on outstanding sends' transfers with GIL-free native waits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from kvxfer.errors import ClosedError, InvalidArgumentError, KvxferError, PlanError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _args
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P
from kvxfer.messenger import prefix
from kvxfer.messenger._node import Node
from kvxfer.messenger.paged import RegionTable, plan_batches
from kvxfer.messenger.peers import PeerGroup, Peers, context_stride
from kvxfer.messenger.pullsend import PullSend
from kvxfer.messenger.send import Request, Send, StreamState
from kvxfer._templates import PageTemplate, plan_layers

__all__ = ["Prefiller"]

_STAGING_SLOTS = 64
_ONE = np.ones(1, np.int64)


class Prefiller:
    """The prefill room of one messenger: its requests, inbox, posting and the reaper."""

    def __init__(self, node: Node, peers: Peers, layout: KVLayout, sharding: Sharding, ranks: tuple,
                 local: Mapping[int, RegionTable], rails: Mapping[int, int],
                 on_request: Optional[Callable[[Request], Any]], inline: bool, offer_pull: bool = False) -> None:
        self.node = node
        self.peers = peers
        self.layout = layout
        self.sharding = sharding
        self.ranks = ranks
        self.local = local
        self.rails = rails
        self._on_request = on_request
        self._inline = inline
        self.offer_pull = offer_pull         # its regions are readable: pull requests are served
        self.requests: dict[tuple[int, int], Request] = {}     # (peer uid, imm) -> Request
        self.inbox: deque[Request] = deque()
        self.inbox_cv = threading.Condition(node.lock)
        self.reap: dict[Send, None] = {}                        # insertion-ordered set
        self.reap_cv = threading.Condition(threading.Lock())
        self._staging: dict[int, list] = {}                     # stride -> [free slots]
        self._staged: dict[Send, tuple] = {}                    # Send -> (stride, its slot)
        self.staging_mrs: list = []
        self.stop = threading.Event()

    # -- requests in ------------------------------------------------------------------------
    def take(self, timeout: Optional[float]) -> list[Request]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.inbox_cv:
            while not self.inbox:
                if self.node.closed:
                    raise ClosedError("messenger is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self.inbox_cv.wait(0.2 if left is None else min(left, 0.2))
            out = list(self.inbox)
            self.inbox.clear()
        return out

    def wake(self) -> None:
        with self.inbox_cv:
            self.inbox_cv.notify_all()

    def on_request_msg(self, pg: PeerGroup, m: C.Control) -> None:
        hs = pg.handshake
        reason = None
        pages = m.pages
        if len(pages) == 0:
            reason = "no pages"
        elif int(pages.max()) >= hs.layout.num_pages:
            reason = f"page {int(pages.max())} is outside the decoder's {hs.layout.num_pages} pages"
        elif len(pages) > 1 and len(np.unique(pages)) != len(pages):
            reason = "a destination page is named twice"
        elif not 0 <= m.first_token < m.num_tokens < 2**63 or \
                len(pages) != prefix.dst_page_count(m.num_tokens, m.first_token, hs.layout.page_size):
            reason = f"tokens [{m.first_token}, {m.num_tokens}) do not fill exactly {len(pages)} pages"
        elif not (m.slot == -1 or (hs.context_slots and 0 <= m.slot < hs.context_slots)):
            reason = f"context slot {m.slot} does not exist"
        elif not 0 < m.imm < 2**32:
            reason = "imm 0 is reserved"
        elif m.flags & P.REQUEST_PULL and not self.offer_pull:
            reason = "this prefiller offers no pull (its messenger was made without offer_pull=True)"
        node = self.node
        with node.lock:
            if reason is None and (pg.uid, m.imm) in self.requests:
                reason = f"imm {m.imm} is already in flight"
            if reason is None:
                req = Request(self, pg, m)
                self.requests[(pg.uid, m.imm)] = req
                node.count("requests")
        if reason is not None:
            node.count("drop_bad_request")
            self.peers.post(pg, C.REJECT, imm=m.imm, reason=reason)
            return
        if self._on_request is not None and self._inline:
            node.call(self._on_request, req)         # on this thread: no hand-off before the writes
        elif self._on_request is not None:
            node.dispatch(self._on_request, req)
        else:
            with self.inbox_cv:
                self.inbox.append(req)
                self.inbox_cv.notify()

    def on_abort(self, pg: PeerGroup, m: C.Control) -> None:
        # the reply is decided under the lock that send()/stream() take to attach a Send:
        # either the Send exists now (it answers ABORTED when final) or a later send() sees
        # ``aborted`` and posts nothing, and this answers ABORTED(0) (never neither)
        send: Optional[Send] = None
        with self.node.lock:
            req = self.requests.get((pg.uid, m.imm))
            if req is not None:
                send = req.send
                if send is None:
                    req.aborted = True
                    self.requests.pop((pg.uid, m.imm), None)
                    try:
                        self.inbox.remove(req)
                    except ValueError:
                        pass
        if req is None:
            self.peers.post(pg, C.ABORTED, imm=m.imm, count=0, flags=C.ABORTED_UNKNOWN)
        elif send is None:
            self.peers.post(pg, C.ABORTED, imm=m.imm, count=0, flags=0)
        else:
            send.request_abort(by_prefiller=False)

    def reject(self, req: Request, reason: Any) -> None:
        """``Request.reject``: before a Send, forget the request and answer REJECT; after
        one, the Send stops and answers ABORTED flagged REJECTED."""
        if not isinstance(reason, str):
            raise InvalidArgumentError(f"reason must be a str, got {type(reason).__name__}")
        pg = req.peer
        with self.node.lock:
            s = req.send
            if s is None:
                if req.aborted:
                    return                      # the decoder aborted it (answered), or rejected already
                req.aborted = True              # a later send()/stream() posts nothing
                req.rejected = reason
                self.requests.pop((pg.uid, req.imm), None)
                try:
                    self.inbox.remove(req)
                except ValueError:
                    pass
                self.node.count("requests_rejected")
            elif s.done:
                raise InvalidArgumentError(f"request {req.request_id!r} is already {s.state}: too late to reject")
            else:
                req.rejected = reason
                self.node.count("requests_rejected")
        if s is None:
            self.peers.post(pg, C.REJECT, imm=req.imm, reason=reason)
        else:
            s.reject()

    def on_done(self, pg: PeerGroup, m: C.Control) -> None:
        """The decoder's DONE of a pull request: its reads are over, the Send settles."""
        with self.node.lock:
            req = self.requests.get((pg.uid, m.imm))
        s = None if req is None else req.send
        if not isinstance(s, PullSend) or not s.on_done(m.flags):
            self.node.count("drop_unexpected_done")

    def peer_gone(self, pg: PeerGroup, err: KvxferError) -> None:
        """Before ``pg``'s teardown: its requests are forgotten, its Sends fail now."""
        with self.node.lock:
            reqs = [q for (u, _), q in self.requests.items() if u == pg.uid]
        for q in reqs:
            if q.send is None:
                q.aborted = True
                with self.node.lock:
                    self.requests.pop((pg.uid, q.imm), None)
            else:
                q.send.kill(err)

    # -- sends ------------------------------------------------------------------------------
    def attach(self, request: Any, stream: Optional[StreamState] = None) -> Send:
        """A new Send for ``request`` (refused if sent already); final at once if the decoder
        aborted it or its peer is dead."""
        if not isinstance(request, Request) or request.room is not self:
            raise InvalidArgumentError("request must come from this messenger's requests()")
        if request.pull and stream is not None:
            raise InvalidArgumentError(f"request {request.request_id!r} is a pull: the decoder reads its pages once "
                                       "they are all computed; send(request, src_pages), not stream()")
        s = PullSend(self, request) if request.pull else Send(self, request, stream)
        pg = request.peer
        with self.node.lock:
            if request.send is not None:
                raise InvalidArgumentError(f"request {request.request_id!r} was already sent")
            request.send = s
            if request.aborted or not pg.alive:
                s.refuse(request.aborted)
                self.node.report(s)
                self.requests.pop((pg.uid, request.imm), None)
                if stream is None:
                    return s
            self.node.count("sends")
        return s

    def send(self, request: Any, src_pages: Any) -> Send:
        if not isinstance(request, Request) or request.room is not self:
            raise InvalidArgumentError("request must come from this messenger's requests()")
        if request.pull:                        # the pull road: exposed whole, the decoder reads
            if src_pages is None:
                raise InvalidArgumentError(f"request {request.request_id!r} is a pull: send(request, src_pages) "
                                           "with every source page, not chunked=True")
            sp = _args.src_pages(src_pages, prefix.src_page_count(request.num_tokens, self.layout.page_size),
                                 self.layout.num_pages)
            s = self.attach(request)
            if not s.done:
                s.expose(sp)
                self.node.count("sends_pull")
            return s
        if src_pages is None:                   # chunked: Send.add posts, the last announces
            s = self.attach(request)
            s.open_chunks()
            return s
        posts = self._posts(request.peer, request, src_pages)
        s = self.attach(request)
        if not s.done:
            s.post(posts, self.rails)
        return s

    # -- chunks (Send.add) --------------------------------------------------------------------
    def chunk_posts(self, request: Request, known: Optional[np.ndarray], src_pages: Any, start: int,
                    end: int) -> tuple:
        """``(source pages known now, posts)`` of chunk ``[start, end)`` of ``request``: by
        stream.py's chunk rule (the pages the chunk completes; where the page sizes differ or
        the decoder holds a prefix, the chunk's own tokens), every layer, one ``(src rank,
        post)`` per source rank. Raises (``PlanError``) before anything is posted."""
        pg, ps = request.peer, self.layout.page_size
        token_path = pg.layout.page_size != ps or request.first_token > 0
        sp = _args.src_prefix(src_pages, prefix.src_page_count(request.num_tokens, ps), self.layout.num_pages)
        if known is not None and not np.array_equal(sp[:len(known)], known[:len(sp)]):
            raise PlanError(f"request {request.request_id!r}'s source pages changed between chunks")
        if known is not None and len(known) > len(sp):
            sp = known
        if token_path:
            need = -(-end // ps)
            if len(sp) < need:
                raise PlanError(f"chunk [{start}, {end}) of request {request.request_id!r} needs {need} source "
                                f"pages but only {len(sp)} are known")
            batches = self.token_arm_batches(pg, request, sp, start, end)
        else:
            # stream.py's pages_completed: the pages whose last token lies in [start, end)
            last = np.minimum(np.arange(1, -(-request.num_tokens // ps) + 1, dtype=np.int64) * ps,
                              request.num_tokens) - 1
            idx = np.nonzero((last >= start) & (last < end))[0]
            if len(idx) and int(idx[-1]) >= len(sp):
                raise PlanError(f"chunk [{start}, {end}) of request {request.request_id!r} completes page "
                                f"{int(idx[-1])} but only {len(sp)} source pages are known")
            batches = self.arm_batches(pg, request, idx, sp[idx]) if len(idx) else []
        by_src: dict[int, list] = {}
        for src, dst, sr, dr, _, so, do, ln, _ in batches:
            by_src.setdefault(src, []).append((self.local[src][sr], pg.remote[dst][dr], so, do, ln))
        eng = self.node.engine
        return sp, [(src, lambda imm, rail, g=g: eng.write_groups(pg.peer, g, imm=imm, rail=rail))
                    for src, g in by_src.items()]

    def _posts(self, pg: PeerGroup, request: Request, src_pages: Any) -> list:
        """A request's writes from this messenger's ranks as ``(src rank, post)``, one per
        rank pair: ``post(imm=, rail=)`` is ONE engine call (``write_pairs`` over the pair's
        region pairs, or ``write_groups``) and returns one ``Transfer``."""
        eng = self.node.engine
        # exactly the pages the request's tokens fill, whatever the path (PlanError otherwise)
        sp = _args.src_pages(src_pages, prefix.src_page_count(request.num_tokens, self.layout.page_size),
                             self.layout.num_pages)
        if self.layout.page_size != pg.layout.page_size or request.first_token:
            p = self._plan(pg, request, sp, request.num_tokens)
            out = []
            for s_, d in p.pairs:
                if s_ in self.local and d in pg.remote:
                    g = [(self.local[s_][sr], pg.remote[d][dr], so, do, ln) for sr, dr, so, do, ln in plan_batches(p, s_, d)]
                    out.append((s_, lambda imm, rail, g=g: eng.write_groups(pg.peer, g, imm=imm, rail=rail)))
            return out
        t = self.template(pg)
        pairs = pg.cache.get("pairs")
        if pairs is None:
            pairs = pg.cache["pairs"] = [eng.region_pairs(pg.peer, [(self.local[s_][sr], pg.remote[d][dr])
                                                                    for sr, dr in regs])
                                         for s_, d, regs, *_ in t.pairs]
        out = []
        for i, spi, dpi in t.assign(sp, request.dst_pages, self._seed(t, request)):
            a, b, c, k = t.pair_writes(i, spi, dpi)
            out.append((t.pairs[i][0], lambda imm, rail, p=pairs[i], a=a, b=b, c=c, k=k:
                        eng.write_pairs(p, a, b, c, k, imm=imm, rail=rail)))
        return out

    @staticmethod
    def _seed(t: PageTemplate, request: Request) -> Optional[int]:
        """The request's replica seed where the template draws owners (else none is needed)."""
        return request.replica_seed if t.replicas else None

    def _plan(self, pg: PeerGroup, request: Request, src_pages: Any, end: int, first: int = 0) -> Any:
        """The planner's plan of ``request`` from this messenger's ranks to ``pg``'s (tokens
        ``[first, end)`` where the page sizes differ, each side's pages in its own size; the
        pages ``src_pages`` / ``request.dst_pages`` whole otherwise), with the request's
        replica seed."""
        return prefix.request_plan(self.layout, self.sharding, pg.layout, pg.sharding, src_pages, request.dst_pages,
                                   request.first_token, request.num_tokens, request.replica_seed, first, end)

    def template(self, pg: PeerGroup) -> PageTemplate:
        """The per-page template from this messenger's ranks to ``pg``'s (made once per peer)."""
        t = pg.cache.get("template")
        if t is None:
            t = pg.cache["template"] = PageTemplate(self.layout, self.sharding, pg.layout, pg.sharding,
                                                    self.local, pg.remote)
        return t

    def arm_batches(self, pg: PeerGroup, request: Request, part: np.ndarray, src_pages: np.ndarray) -> list:
        """The writes of some pages of ``request`` from this messenger's ranks, for arming:
        ``part`` are the pages' positions in the request's ``dst_pages``, ``src_pages`` their
        source pages; one ``kvxfer._templates.ArmBatch`` per (rank pair, region pair), its layers
        as groups, in the planner's order within a layer (page, then entry) so contiguous pages
        coalesce. A replica choice is the template's permutation for the request's seed over
        the whole request (never a draw over the part: its owners could be ranks the request
        never asked), not a plan."""
        t = self.template(pg)
        out: list = []
        for i, a, b in t.assign_part(src_pages, request.dst_pages, part, self._seed(t, request)):
            out.extend(t.pair_layers(i, a, b))
        return out

    def token_arm_batches(self, pg: PeerGroup, request: Request, src_pages: np.ndarray, start: int,
                          end: int) -> list:
        """``arm_batches`` of tokens ``[start, end)`` where the page sizes differ (a chunk of
        a streamed prefill: its own tokens, whatever pages they share with other chunks)."""
        if end <= request.first_token:
            return []                           # the decoder holds these tokens already
        return plan_layers(self._plan(pg, request, src_pages, end, start), self.local, pg.remote)

    # -- the context --------------------------------------------------------------------------
    def _stage(self, s: Send, data: Optional[bytes | memoryview]) -> tuple:
        """Copy the context (8-byte length, data) into a staging slot of ``s``."""
        stride = context_stride(s.request.peer.handshake.context_bytes)
        mr, arr, idx = self._staging_slot(stride)
        with self.node.lock:
            self._staged[s] = (stride, (mr, arr, idx))
        n = 0 if data is None else len(memoryview(data).cast("B"))
        base = idx * stride
        arr[base:base + 8].view("<u8")[0] = n
        if n:
            arr[base + 8:base + 8 + n] = np.frombuffer(data, np.uint8)
        return mr, base, s.request.slot * stride, 8 + n

    def post_context(self, s: Send, data: Optional[memoryview]) -> Any:
        """The context write of ``s``: one message, on the rail of this messenger's first
        rank when placements pin it."""
        pg = s.request.peer
        mr, base, dst, n = self._stage(s, data)
        pairs = pg.cache.setdefault("ctx_pairs", {})
        rp = pairs.get(id(mr))
        if rp is None:
            rp = pairs[id(mr)] = self.node.engine.region_pairs(pg.peer, [(mr, pg.context_region)])
        return self.node.engine.write_pairs(rp, np.array([base], np.uint64), np.array([dst], np.uint64),
                                            np.array([n], np.uint64), _ONE, imm=s.request.imm,
                                            rail=self.rails.get(self.ranks[0]))

    def arm_context(self, s: Send, watcher: Any, threshold: int, tag: int, data: Optional[bytes]) -> Any:
        """The context write of a streaming ``s``, armed at ``threshold``."""
        pg = s.request.peer
        mr, base, dst, n = self._stage(s, data)
        return watcher.arm(threshold, mr, pg.peer, pg.context_region, np.array([base], np.uint64),
                           np.array([dst], np.uint64), np.array([n], np.uint64), imm=s.request.imm, tag=tag,
                           rail=self.rails.get(self.ranks[0], 0))

    def _staging_slot(self, stride: int) -> tuple:
        with self.node.lock:
            free = self._staging.setdefault(stride, [])
            if not free:
                arr = np.zeros(_STAGING_SLOTS * stride, np.uint8)
                mr = self.node.engine.register(arr, remote=False)
                self.staging_mrs.append(mr)
                free.extend((mr, arr, i) for i in range(_STAGING_SLOTS))
            return free.pop()

    # -- settling ---------------------------------------------------------------------------
    def settle(self, s: Send, state: str, err: Optional[BaseException]) -> None:
        """``s`` is final: forget its request, give its staging slot back, run its callbacks."""
        req = s.request
        with self.node.lock:
            cbs = s.settled(state, err)
            if cbs is None:
                return
            self.requests.pop((req.peer.uid, req.imm), None)
            self.node.count("send_" + state)
            if req.rejected is not None:
                self.node.count("send_rejected")
            self.node.count("send_bytes", sum(int(getattr(t, "nbytes", 0) or 0) for t in s.transfers
                                              if getattr(t, "state", "done") != "disarmed"))
            self.node.report(s)
            staged = self._staged.pop(s, None)
            if staged is not None:
                stride, slot = staged
                self._staging.setdefault(stride, []).append(slot)
        self.node.hist.observe("send", time.monotonic() - req.t_arrived)
        s.wake()
        for fn in cbs:
            self.node.dispatch(fn, s)

    def queue_reap(self, s: Send) -> None:
        with self.reap_cv:
            self.reap[s] = None
            self.reap_cv.notify()

    def stop_reaper(self) -> None:
        self.stop.set()
        with self.reap_cv:
            self.reap_cv.notify_all()

    def run_reaper(self) -> None:
        """The reaper thread: settle every queued Send once all its transfers are final."""
        while not self.stop.is_set():
            with self.reap_cv:
                while not self.reap and not self.stop.is_set():
                    self.reap_cv.wait(0.5)
                batch = list(self.reap)
            if not batch:
                continue
            settled = []
            for s in batch:
                if all(t.done for t in reversed(s.transfers)):   # the last finishes last
                    if s.finalize():
                        settled.append(s)
                elif s.done:
                    settled.append(s)
            if settled:
                with self.reap_cv:
                    for s in settled:
                        self.reap.pop(s, None)
                continue
            pending = next((t for s in batch for t in s.transfers if not t.done), None)
            if pending is not None:
                try:
                    pending.wait(0.05)       # GIL-free native wait
                except KvxferError:
                    pass
