"""A prefill request and its ``Send``: the writes of one request from the ranks this
messenger holds, and every transition of them (posting, ANNOUNCE, the context write last,
abort, failure, the ABORTED answer, settling).

A ``Send`` owns its state: ``post`` (one engine call per rank pair, then the exact count),
``fail`` (the one way to stop with an error: cancel, answer ABORTED with what was posted),
``request_abort`` (the decoder's ABORT or ours), ``kill`` (its peer is gone), ``finalize``
(the reaper: every transfer final), and for streaming ``arm_chunk`` (stream.py arms the
writes; the Send records the chunk and announces at the last). Its room
(``prefill.Prefiller``) stages the context, settles it and runs the reaper.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kvxfer._templates import request_seed
from kvxfer.engine.watcher import WatchBatch
from kvxfer.errors import InvalidArgumentError, KvxferError, PeerError, TimeoutError
from kvxfer.messenger import _args
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P
from kvxfer.messenger._node import FINAL
from kvxfer.messenger.peers import PeerGroup

if TYPE_CHECKING:
    from kvxfer.messenger.prefill import Prefiller

__all__ = ["Request", "Send", "StreamState"]


class Request:
    """A request a decoder sent to this messenger (the prefiller), from ``requests()`` or
    ``on_request``. Its attributes are read-only; read them from any thread. Hand it to
    ``send``/``stream`` once (any thread), or ``reject`` it.

    Attributes: ``request_id`` (str, bytes or int: the decoder's id), ``num_tokens`` (tokens
    of the request), ``first_token`` (the decoder holds ``[0, first_token)`` already: only the
    rest is written), ``meta`` (the decoder engine's bytes, at most ``MAX_META``),
    ``dst_pages`` (the decoder's pages, read-only int64 array, covering ``[first_token,
    num_tokens)``), ``peer`` (the decoder's ``PeerGroup``), ``slot`` (the decoder's context
    slot this messenger writes; -1 when it writes none: no slots, or another rank process of
    a per-rank instance writes it), ``imm`` (the request's imm on this leg), ``aborted``,
    ``rejected``, ``send`` (its Send once made), ``t_arrived``, ``room``, ``replica_seed``,
    ``pull`` (the decoder reads the pages itself: ``send`` exposes them, kvxfer/messenger/pullsend.py)."""

    def __init__(self, room: "Prefiller", pg: PeerGroup, msg: C.Control) -> None:
        self.room = room                          #: the Prefiller (room) that received it
        self.peer = pg                            #: the decoder's PeerGroup
        self.request_id = msg.request_id          #: the decoder's request id (str, bytes or int)
        self.num_tokens = msg.num_tokens          #: tokens of the request, ``[0, num_tokens)``
        self.first_token = msg.first_token        #: tokens before it the decoder holds (not written)
        self.meta = msg.meta                      #: the decoder engine's bytes (``receive(meta=)``)
        self.dst_pages: np.ndarray = msg.pages    #: the decoder's pages, from ``first_token``'s page
        self.dst_pages.flags.writeable = False
        self.imm = msg.imm                        #: this leg's imm (every write of it carries it)
        self.slot = msg.slot                      #: the decoder's context slot written here, -1: none
        self.pull = bool(msg.flags & P.REQUEST_PULL)   #: the decoder pulls: ``send`` exposes the pages
        self.aborted = False          #: the decoder aborted it before ``send`` (or it was rejected)
        self.rejected: Optional[str] = None   #: the reason given to ``reject``
        self.send: Optional[Send] = None      #: its Send, once ``send``/``stream`` made one
        self.t_arrived = time.monotonic()     #: when the REQUEST was read (monotonic)

    @property
    def replica_seed(self) -> int:
        """The seed every process of the request draws replica owners with (the decoder's
        ``writing_ranks``, each prefill rank's template): ``kvxfer.planner.request_seed`` of
        the encoded request id. An engine that routes requests to ranks itself (the vLLM
        connector's prefill ranks) computes the same owners with it."""
        return request_seed(C.encode_request_id(self.request_id))

    def reject(self, reason: str) -> None:
        """Refuse this request (its KV is gone, it was preempted, the id is unknown): the
        decoder's Receive fails with ``RejectedError`` (meaning "recompute", not "peer dead")
        whose message names ``reason`` (UTF-8; at most ``MAX_REASON`` = 1024 bytes travel, a
        longer one is cut before the first character that does not fit). Before
        ``send``/``stream`` nothing was posted: a REJECT carries the reason and the decoder's
        pages are free at once. After it, posting stops and the decoder fences on what was
        posted: the ABORTED carries the count and the reason.
        Raises ``InvalidArgumentError`` once the Send is final; a request the decoder
        aborted meanwhile is left alone. Any thread."""
        self.room.reject(self, reason)

    def __repr__(self) -> str:
        return f"<Request {self.request_id!r} {len(self.dst_pages)} pages from {self.peer.uid:016x}>"


def context_view(pg: PeerGroup, context: Any) -> Optional[memoryview]:
    """``context`` (bytes, a C-contiguous buffer or None) as bytes for ``pg``'s slots
    (``InvalidArgumentError`` if it is not one or does not fit)."""
    if context is None:
        return None
    try:
        data = memoryview(context).cast("B") if not isinstance(context, (bytes, bytearray)) \
            else memoryview(context)
    except (TypeError, ValueError):
        raise InvalidArgumentError("context must be bytes or a C-contiguous buffer") from None
    if data.nbytes and not pg.handshake.context_slots:
        raise InvalidArgumentError("the decoder has no context slots; finish() takes no context")
    if data.nbytes > pg.handshake.context_bytes:
        raise InvalidArgumentError(f"context of {data.nbytes} bytes exceeds the decoder's "
                                   f"{pg.handshake.context_bytes}-byte slots")
    return data


class StreamState:
    """A streaming Send's progress: source pages known so far, next token, last pass."""

    __slots__ = ("src_pages", "next_token", "end", "context", "context_armed", "passes", "watcher")

    def __init__(self, src_pages: Optional[np.ndarray], watcher: Any) -> None:
        self.src_pages = src_pages
        self.next_token = 0
        self.end: Optional[int] = None          # the last pass's end, once the last chunk is scheduled
        self.context: Optional[tuple] = None    # (data,) once finish() came
        self.context_armed = False
        self.passes: list[int] = []
        self.watcher = watcher


class Send:
    """The writes of one request. ``done`` (final: done, failed or aborted) is the moment the
    source pages may be freed; ``Messenger.poll()`` reports it, ``add_done_callback`` says so
    on the dispatcher thread. ``state``: ``"pending"``, ``"transferring"`` (announced), then
    ``"done"``, ``"failed"`` (``error``) or ``"aborted"``; ``request``: its Request.

    Threads: ``finish``, ``abort``, ``add`` and the properties may be called from any thread
    (``add`` from one at a time); ``wait`` blocks the caller, every other call returns
    without waiting for the network (``abort(timeout=0)`` only asks). A partial last page is
    copied whole on the page path (the source's bytes past ``num_tokens`` travel into that
    page); the token path (page sizes differ, or a prefix) moves exactly the tokens."""

    def __init__(self, room: "Prefiller", req: Request, stream: Optional[StreamState] = None) -> None:
        self._room = room
        self.request = req
        self._state = "pending"
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._transfers: list = []
        self._posting_done = False
        self._finished = False
        self._abort_req = False
        self._abort_flags = 0
        self._reply = False           # answer ABORTED when final
        self._count = 0
        self._event = threading.Event()
        self._callbacks: list[Callable[[Send], Any]] = []
        self._stream = stream
        self._chunks: Optional[dict] = None    # a chunked Send (send(request, chunked=True)): its progress

    # -- public -----------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def streaming(self) -> bool:
        """Made by ``Messenger.stream``: its writes are posted layer by layer by ``schedule``."""
        return self._stream is not None

    @property
    def last_chunk(self) -> bool:
        """A streaming Send whose last chunk (the one ending at ``num_tokens``) was scheduled."""
        return self._stream is not None and self._stream.end is not None

    @property
    def entries(self) -> list:
        """A streaming Send's armed writes (``kvxfer.engine.WatchEntry``: ``threshold``,
        ``nbytes``, ``num_writes``, ``state``, ``fired_ns``), in arming order; the context's last.
        (``transfers`` holds them as armed: a ``WatchBatch`` per region pair and chunk.)"""
        if self._stream is None:
            return []
        out: list = []
        for t in self._transfers:
            if isinstance(t, WatchBatch):
                out.extend(t)
            else:
                out.append(t)
        return out

    def count_entries(self, *states: str) -> int:
        """A streaming Send's ``entries`` in any of ``states`` (armed, posting, posted,
        disarmed, failed), or all of them with none named; one native loop per batch, no
        object per entry."""
        if self._stream is None:
            return 0
        if not states:
            return sum(len(t) if isinstance(t, WatchBatch) else 1 for t in self._transfers)
        return sum(t.entries_in(st) for t in self._transfers for st in states)

    @property
    def next_token(self) -> int:
        """A streaming Send's next chunk starts here."""
        return self._stream.next_token if self._stream is not None else self.request.num_tokens

    @property
    def src_pages(self) -> Optional[np.ndarray]:
        """A streaming Send's source pages known so far (None before any)."""
        return self._stream.src_pages if self._stream is not None else None

    @property
    def done(self) -> bool:
        return self._state in FINAL

    @property
    def stopped(self) -> bool:
        """Aborted, failed or final: nothing more is posted or armed."""
        return self._abort_req or self._state in FINAL

    @property
    def num_writes(self) -> int:
        """Messages announced to the decoder (the context's included once finished)."""
        return self._count

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until final; return ``"done"``/``"aborted"``, raise ``error`` if failed."""
        timeout = _args.timeout(timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"send of {self.request.request_id!r} still {self._state} after {timeout} s")
        if self._state == "failed" and self.error is not None:
            raise self.error
        return self._state

    def add_done_callback(self, fn: Callable[["Send"], Any]) -> None:
        _args.callback(fn)
        with self._room.node.lock:
            if self._state not in FINAL:
                self._callbacks.append(fn)
                return
        self._room.node.dispatch(fn, self)

    def finish(self, context: Any = None) -> "Send":
        """Write the context data (bytes or a contiguous array) into the decoder's slot, last;
        then the send completes once every write completed. Call it exactly once, also with
        no context (and on every rank of a per-rank instance: only the one holding the slot
        writes it). Too much context raises before anything is written."""
        data = context_view(self.request.peer, context)
        if self._stream is not None:
            return self._finish_stream(data)
        with self._lock:
            if self._finished:
                if self.stopped:
                    return self
                raise InvalidArgumentError("finish() was already called")
            if self._chunks is not None and not self._chunks["last"] and not self.stopped:
                raise InvalidArgumentError(f"finish() before request {self.request.request_id!r}'s last chunk "
                                           "(add(..., num_tokens))")
            self._finished = True
            if self.request.slot >= 0:
                try:
                    self._transfers.append(self._room.post_context(self, data))
                except KvxferError as exc:
                    self._fail_locked(exc)
        self._room.queue_reap(self)
        return self

    def reject(self) -> None:
        """``Request.reject`` after this Send began: stop with the decoder told it was a
        rejection (ABORTED flagged REJECTED, with the posted count: it fences on it)."""
        with self._lock:
            if self._state in FINAL or self._abort_req:
                return
            self._abort_flags |= C.ABORTED_REJECTED
        self.request_abort(by_prefiller=True)

    # -- chunked prefill (send(request, chunked=True)) ------------------------------------
    def open_chunks(self) -> None:
        """Made by ``send(request, chunked=True)``: ``add`` posts, chunk by chunk."""
        with self._lock:
            self._chunks = {"next": 0, "src": None, "last": False, "adding": False}
            self._posting_done = True            # between adds an abort cancels at once

    def add(self, src_pages: Any, end_token: int) -> "Send":
        """Chunked prefill: tokens up to ``end_token`` are computed; post now, every layer, the
        writes of the pages they complete (a partial page waits for the chunk that completes
        it or for the last; where page sizes differ or the decoder holds a prefix, exactly
        the chunk's tokens). ``src_pages``: the request's source pages so far (a prefix that
        grows). The chunk runs from the previous ``end_token`` (0 at first); the one ending at
        ``num_tokens`` is the last: it announces the exact total, then call ``finish``.
        Raises before anything of the chunk is posted (``PlanError`` for pages,
        ``InvalidArgumentError`` for a bad range, or a Send not made this way); a Send
        aborted or failed meanwhile posts nothing and returns. One thread at a time."""
        ch = self._chunks
        if ch is None:
            raise InvalidArgumentError("add() is for a Send made by send(request, chunked=True), without src_pages")
        if isinstance(end_token, bool) or not isinstance(end_token, (int, np.integer)):
            raise InvalidArgumentError(f"end_token must be an int, got {end_token!r}")
        end, req = int(end_token), self.request
        with self._lock:
            if self.stopped:
                return self
            if ch["adding"]:
                raise InvalidArgumentError("add() is already running on another thread")
            if ch["last"]:
                raise InvalidArgumentError(f"request {req.request_id!r}'s last chunk was already added")
            start = ch["next"]
            if not start < end <= req.num_tokens:
                raise InvalidArgumentError(f"a chunk of request {req.request_id!r} ends after {start} and at most at "
                                           f"{req.num_tokens}, got {end}")
            ch["adding"] = True
            self._posting_done = False           # an abort now is seen below
        err: Optional[BaseException] = None
        posts: list = []
        try:
            sp, posts = self._room.chunk_posts(req, ch["src"], src_pages, start, end)
        except BaseException as exc:
            with self._lock:
                ch["adding"] = False
                self._posting_done = True
                stopped = self._abort_req
                if stopped:
                    self._cancel_locked()
            if stopped:
                self._room.queue_reap(self)
            raise exc
        try:
            for src, fn in posts:
                if self._abort_req:
                    break
                self._transfers.append(fn(imm=req.imm, rail=self._room.rails.get(src)))
                self._first_post()
        except KvxferError as exc:
            err = exc
        with self._lock:
            ch["adding"] = False
            ch["next"], ch["src"] = end, sp
            self._posting_done = True
            if err is not None:
                self._fail_locked(err)
            elif self._abort_req:
                self._cancel_locked()
            elif end == req.num_tokens:
                ch["last"] = True
                self._count = sum(t.num_writes for t in self._transfers) + (1 if req.slot >= 0 else 0)
                self._announce_locked(self._count)
            stopped = self._abort_req
        if stopped:
            self._room.queue_reap(self)
        return self

    def _announce_locked(self, count: int, wake: bool = True) -> bool:
        """Under ``_lock``: post the ANNOUNCE of ``count`` messages (the sender thread sends it,
        or with ``wake=False`` the caller ``flush``es it once out of the lock; this never waits
        on the engine). Posted under the lock that an abort takes, and the ABORTED is posted
        only once the Send settled after that, to the same peer's outbox: the decoder never
        reads the ABORTED before the ANNOUNCE. A dead peer: failed (the teardown fences the
        decoder's side), False."""
        pg = self.request.peer
        if self._room.peers.post(pg, C.ANNOUNCE, wake=wake, imm=self.request.imm, count=count):
            if self._state == "pending":
                self._state = "transferring"
            return True
        self._fail_locked(PeerError(f"could not announce to peer {pg.uid:016x}: it is {pg.state}"))
        return False

    def _first_post(self) -> None:
        if len(self._transfers) == 1:
            self._room.node.hist.observe("send_first_post", time.monotonic() - self.request.t_arrived)

    def _cancel_locked(self) -> None:
        for t in self._transfers:
            t.cancel()
        self._finished = True

    def abort(self, timeout: Optional[float] = None) -> bool:
        """Give up: post nothing more, tell the decoder what was posted (it fences and fails
        its request). True once the posted writes are final, so the source pages are free."""
        timeout = _args.timeout(timeout)
        self.request_abort(by_prefiller=True)
        return self._event.wait(timeout)

    def __repr__(self) -> str:
        return f"<Send {self.request.request_id!r} {self._count} writes {self._state}>"

    # -- transitions ----------------------------------------------------------------------
    def _fail_locked(self, err: BaseException) -> None:
        """Under ``_lock``: stop with ``err``; the decoder is told what was posted (ABORTED)."""
        if err is not None:
            self.error = err
        self._abort_req = True
        self._abort_flags |= C.ABORTED_BY_PREFILLER
        self._reply = True
        for t in self._transfers:
            t.cancel()
        self._posting_done = self._finished = True

    def fail(self, err: BaseException) -> None:
        """Stop with ``err``: cancel, and answer ABORTED once the posted writes are final."""
        with self._lock:
            self._fail_locked(err)
        self._room.queue_reap(self)

    def request_abort(self, *, by_prefiller: bool) -> None:
        """Stop posting (the decoder's ABORT, or ours); answer ABORTED once final."""
        with self._lock:
            if self._state in FINAL or self._abort_req:
                return
            self._abort_req = True
            self._reply = True
            if by_prefiller:
                self._abort_flags |= C.ABORTED_BY_PREFILLER
            if self._stream is not None:
                self._posting_done = True        # entries disarm (or stop posting) outside
            if not self._posting_done:
                return                           # post() sees the flag when it stops posting
            for t in self._transfers:
                t.cancel()
            self._finished = True
        self._room.queue_reap(self)

    def refuse(self, aborted: bool) -> None:
        """Made for a request aborted before it was sent, or of a dead peer: final at once
        (under the room's lock)."""
        self._state = "aborted" if aborted else "failed"
        self.error = None if aborted else PeerError(f"peer {self.request.peer.uid:016x} is dead")
        self._posting_done = self._finished = True
        self._event.set()

    def kill(self, err: BaseException) -> None:
        """Its peer is gone: cancel everything and settle failed now (the source pages are free)."""
        with self._lock:
            self._abort_req = True
            self._finished = True
            for t in self._transfers:
                t.cancel()
        self._room.settle(self, "failed", err)

    def post(self, posts: list, rails: Mapping[int, int]) -> None:
        """Post every rank pair's writes (one engine call each), then ANNOUNCE the count."""
        req = self.request
        err: Optional[BaseException] = None
        try:
            for src, fn in posts:
                if self._abort_req:
                    break
                self._transfers.append(fn(imm=req.imm, rail=rails.get(src)))
                self._first_post()
        except KvxferError as exc:
            err = exc
        count = sum(t.num_writes for t in self._transfers) + (1 if req.slot >= 0 else 0)
        announced = False
        with self._lock:
            self._count = count
            self._posting_done = True
            if err is not None:
                self._fail_locked(err)
            elif self._abort_req:
                for t in self._transfers:
                    t.cancel()
                self._finished = True
            else:
                announced = self._announce_locked(count, wake=False)
        if announced:
            self._room.peers.flush(req.peer)      # the ANNOUNCE from this thread: no hand-off
        if self._abort_req:
            self._room.queue_reap(self)

    def finalize(self) -> bool:
        """Reaper: every transfer is final: settle the state, answer the decoder if asked.
        False (nothing done) if a transfer was added meanwhile and is still running."""
        req = self.request
        pg = req.peer
        with self._lock:
            if self._state in FINAL:
                return True
            if not all(t.done for t in self._transfers):     # finish() appended one since the check
                return False
            err = self.error or next((t.error for t in self._transfers if t.error is not None), None)
            # engine Transfers and WatchEntries: both count what they handed to the provider
            posted = sum(int(t.posted) for t in self._transfers)
            if self._stream is not None and not self._abort_req and any(t.entries_in("disarmed")
                                                                        for t in self._transfers):
                # a write that never posts (its pass was abandoned): the decoder must fence
                self._abort_req = self._reply = True
                self._abort_flags |= C.ABORTED_BY_PREFILLER
            if self._abort_req:
                state = "failed" if self.error is not None else "aborted"
            elif err is not None:
                state = "failed"
                self._reply = True
                self._abort_flags |= C.ABORTED_BY_PREFILLER
            else:
                state = "done"
            reply = self._reply and pg.alive
            flags = self._abort_flags
        # settled first: a decoder told "aborted" (and so done with its fence) never finds
        # this side's Send still transferring
        self._room.settle(self, state, err)
        if reply:
            self._room.peers.post(pg, C.ABORTED, imm=req.imm, count=posted, flags=flags,
                                  reason=req.rejected if flags & C.ABORTED_REJECTED else "")
        return True

    @property
    def transfers(self) -> tuple:
        """Its engine transfers (and watch entries), in posting order."""
        return tuple(self._transfers)

    def wake(self) -> None:
        """Final: wake the waiters (the room calls it once ``settled`` said so)."""
        self._event.set()

    def settled(self, state: str, err: Optional[BaseException]) -> Optional[list]:
        """Under the room's lock: the final state (once); the callbacks to run, or None."""
        if self._state in FINAL:
            return None
        self._state = state
        if err is not None and self.error is None:
            self.error = err
        cbs, self._callbacks = self._callbacks, []
        return cbs

    # -- streaming (stream.py arms; the Send keeps its own state) ---------------------------
    def arm_chunk(self, pass_id: int, pass_end: int, end: int, sp: Optional[np.ndarray],
                  arm: Callable[[], list]) -> None:
        """Record a scheduled chunk ending at ``end`` and arm its writes (``arm()`` returns the
        watch entries). The last chunk (``end == num_tokens``) announces the exact count and
        arms the context at the pass's end; a failure fails the Send with the fence."""
        req = self.request
        st = self._stream
        announce = None
        err: Optional[BaseException] = None
        with self._lock:
            if self.stopped:
                return
            st.src_pages = sp
            st.next_token = end
            st.passes.append(pass_id)
            try:
                self._transfers.extend(arm())
            except KvxferError as exc:
                err = exc
            if err is None and end == req.num_tokens:
                st.end = pass_end
                announce = sum(t.num_writes for t in self._transfers) + (1 if req.slot >= 0 else 0)
                self._count = announce
                if st.context is not None:
                    try:
                        self._arm_context()
                    except KvxferError as exc:
                        err = exc
            if err is not None:
                self._fail_locked(err)
            elif announce is not None:
                self._announce_locked(announce)     # (a dead peer fails the Send)
            failed = self._abort_req
        if failed:
            self._room.queue_reap(self)
        elif announce is not None:
            self._done_arming()

    def _arm_context(self) -> None:
        """Under ``_lock``: arm the context write at the last pass's end."""
        st = self._stream
        if st.context_armed:
            return
        st.context_armed = True
        if self.request.slot < 0:
            return
        (data,) = st.context
        self._transfers.append(self._room.arm_context(self, st.watcher, st.end, st.passes[-1], data))

    def _done_arming(self) -> None:
        """Last chunk scheduled and context armed: nothing more to arm; the reaper settles
        it once every entry posted and completed."""
        with self._lock:
            st = self._stream
            if self._posting_done or st.end is None or not st.context_armed:
                return
            self._posting_done = self._finished = True
        self._room.queue_reap(self)

    def _finish_stream(self, data: Optional[memoryview]) -> "Send":
        err = None
        with self._lock:
            st = self._stream
            if self.stopped:
                return self
            if st.context is not None:
                raise InvalidArgumentError("finish() was already called")
            st.context = (None if data is None else bytes(data),)
            if st.end is not None:
                try:
                    self._arm_context()
                except KvxferError as exc:
                    err = exc
        if err is not None:
            self.error = err
            self.request_abort(by_prefiller=True)
            return self
        self._done_arming()
        return self

    def armed_in(self, base: int, end: int) -> int:
        """Entries still armed with thresholds in ``(base, end]`` (a pass being abandoned)."""
        return sum(t.entries_in("armed", base, end) for t in self._transfers)
