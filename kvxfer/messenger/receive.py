"""A decoder's request: the ``Receive`` the engine holds (its state, wait, abort, context)
and its ``Leg``s, one per prefill peer written to.

The public object of the decode side. Every transition is the decode room's
(``decode.Decoder``: REQUEST out, ANNOUNCE / ABORTED / REJECT in, the fence); a Receive
reads its own state and asks its room for the rest, so this module holds no protocol rule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kvxfer.errors import KvxferError, TimeoutError
from kvxfer.messenger import _args
from kvxfer.messenger._node import FINAL
from kvxfer.messenger.peers import PeerGroup

if TYPE_CHECKING:
    from kvxfer.messenger.decode import Decoder

__all__ = ["Receive", "Leg"]


class _Holder:
    """Exports a read-only buffer and keeps its owner (a Receive) alive while viewed."""

    __slots__ = ("_arr", "_owner")

    def __init__(self, arr: np.ndarray, owner: Any) -> None:
        self._arr = arr
        self._owner = owner

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._arr).toreadonly()


class Leg:
    """One prefill peer's part of a Receive (read-only outside this module): its imm, the
    context slot it writes (-1: none), what it announced, and its fence; on the pull road
    (``pull``) also its reads (kvxfer/messenger/pullrecv.py)."""

    __slots__ = ("peer", "imm", "slot", "announced", "counter", "arm", "arm_seq", "fence_target", "fence_counter",
                 "fence_since", "fence_ok", "abort_sent", "complete", "fenced",
                 "pull", "exposed", "reads", "drained", "reads_ok", "ctx_done", "fence_pending", "done_sent")

    def __init__(self, peer: PeerGroup, imm: int, slot: int, pull: bool = False) -> None:
        self.peer = peer
        self.imm = imm
        self.slot = slot
        self.announced: Optional[int] = None
        self.counter: Any = None
        self.arm: Any = None             # its ANNOUNCE armed by the engine (decode.Decoder._adopt)
        self.arm_seq = 0                 # the seq of the ANNOUNCE that armed it
        self.fence_target: Optional[int] = None
        self.fence_counter: Any = None
        self.fence_since = 0.0           # when the ABORTED set the fence (monotonic)
        self.fence_ok = False            # fenced by the prefiller's ABORTED, not by a teardown
        self.abort_sent = False
        self.complete = False            # every announced write credited
        self.fenced = False              # nothing of this leg can land any more
        self.pull = pull                 # the decoder reads this leg's pages (the pull road)
        self.exposed = False             # its EXPOSE came: a DONE is owed to its peer once fenced
        self.reads: list = []            # the ReadTransfers posted for it
        self.drained = True              # no read of it is in flight
        self.reads_ok = False            # every read completed without error
        self.ctx_done = False            # its context write (the EXPOSE's count) was credited
        self.fence_pending = False       # fenced once its reads drain
        self.done_sent = False

    def __repr__(self) -> str:
        return f"<Leg {self.peer.uid:016x} imm={self.imm} announced={self.announced} fenced={self.fenced}>"


class Receive:
    """A request this node (the decoder) made: its pages fill, then it is ``"done"``.

    ``state``: ``"pending"`` (request sent), ``"transferring"`` (a prefill peer announced its
    writes), then one of ``"done"``, ``"failed"`` (``error`` says why), ``"aborted"``.
    ``done`` is True in any of the last three (as for a future). ``fenced`` is True once no
    write of this request can land any more (always after done and after a successful abort;
    after a failure once every leg was fenced or its peer torn down): until then the
    messenger refuses its pages to new requests. ``legs``: one per prefill peer written to.
    ``pull``: this decoder reads the pages itself (``receive(..., pull=True)``); the states,
    ``fenced`` (no read or write of it in flight any more) and ``poll()`` mean the same.

    Attributes: ``request_id``, ``dst_pages`` (read-only), ``num_tokens``, ``first_token``,
    ``meta`` (as given to ``receive``), ``peer``/``peers`` (the first leg's / every leg's
    PeerGroup), ``imm`` (the first leg's), ``error`` (why it failed: ``RejectedError`` =
    recompute, ``PeerError`` = the peer is gone, ``TimeoutError``, ``ClosedError``),
    ``t_start``, ``t_landed`` (the engine's stamp of the last write), ``t_done``, ``t_fenced``
    (monotonic seconds), ``arrived``, ``expected``, ``context``.

    Threads: every method and property may be called from any thread, concurrently.
    ``wait`` blocks the caller; ``abort(timeout=0)`` never does (it sends the ABORTs and
    returns; the fence finishes in the background: ``fenced`` and ``poll()`` say when).
    Callbacks run on the messenger's dispatcher thread (``kvxfer-msg-cb``), one at a time.
    """

    def __init__(self, dec: "Decoder", legs: list[Leg], rid: Any, pages: np.ndarray, num_tokens: int,
                 slot: int, deadline: Optional[float]) -> None:
        self._dec = dec
        self.legs: tuple[Leg, ...] = tuple(legs)
        self.peer: PeerGroup = legs[0].peer          #: the first leg's peer
        self.peers: tuple[PeerGroup, ...] = tuple(leg.peer for leg in legs)
        self.imm: int = legs[0].imm                  #: the first leg's imm
        self.request_id = rid                        #: the id given to ``receive``
        self.dst_pages = pages                       #: this decoder's pages (read-only)
        self.num_tokens = num_tokens                 #: tokens of the request
        self.first_token = 0                         #: tokens before it were held here already
        self.meta = b""                              #: the bytes given to ``receive(meta=)``
        self.pull = False                            #: the pull road: this decoder reads the pages
        self._slot = slot
        self._slot_cell = [slot]
        self._deadline = deadline
        self._state = "pending"
        self.error: Optional[BaseException] = None  #: why it failed (None otherwise)
        self.fenced = False                          #: no write of it can land any more: pages reusable
        self._event = threading.Event()
        self._armed = threading.Event()     # every leg's counter exists (ANNOUNCEs handled) or final
        self._callbacks: list[Callable[[Receive], Any]] = []
        self._aborting = False              # ABORT goes (went) to every leg not fenced
        self._fail_now = False              # final at once (a peer died, a REJECT), fenced later
        self._released = False
        self._hot = False
        self.t_start = time.monotonic()              #: when ``receive`` made it (monotonic)
        self.t_done: Optional[float] = None          #: when it became final
        self.t_fenced: Optional[float] = None        #: when it became fenced

    # -- public -----------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def done(self) -> bool:
        return self._state in FINAL

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until final; return ``"done"`` or ``"aborted"``, raise ``error`` if failed,
        ``TimeoutError`` if ``timeout`` seconds pass first (the request goes on)."""
        timeout = _args.timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._event.is_set():
            self._wait_counters(deadline)
        if not self._event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"request {self.request_id!r} is still {self._state} after {timeout} s")
        if self._state == "failed" and self.error is not None:
            raise self.error
        return self._state

    @property
    def arrived(self) -> int:
        """Messages of this request credited so far (0 until a prefill peer announced its
        count): progress, e.g. layers landing while a stream runs."""
        n = 0
        for leg in self.legs:
            c = leg.counter
            if c is not None:
                n += c.count if c.done else c.arrived
        return n

    @property
    def t_landed(self) -> Optional[float]:
        """When the last leg was counted, in ``time.monotonic()`` seconds: the latest of its legs'
        ``Counter.done_ns``, each the later of its last write's crediting (by whichever thread
        read the CQ: the progress thread, or a waiter driving it) and the arming of its
        announced count (writes that overtook their ANNOUNCE are counted when the messenger
        thread arms it). For a request that became ``"done"``, ``t_done - t_landed`` is what
        this messenger took after the engine had counted everything. None until every leg is
        counted, for good once a leg's count was withdrawn (abort, failure), and on the pull
        road (its reads complete in this engine: ``t_done``)."""
        if self.pull:
            return None
        ns = 0
        for leg in self.legs:
            c = leg.counter
            d = 0 if c is None else c.done_ns
            if not d:
                return None
            ns = max(ns, d)
        return ns / 1e9

    @property
    def expected(self) -> Optional[int]:
        """The announced message count, every leg's together (None before the last ANNOUNCE)."""
        counts = [leg.announced for leg in self.legs]
        return None if any(c is None for c in counts) else sum(counts)

    def _wait_counters(self, deadline: Optional[float]) -> None:
        """The caller's thread waits on the engine's counters itself (native, GIL-free waits
        woken by the progress thread) once the ANNOUNCEs armed them, and completes the
        request: no hop through the engine's callback dispatcher. First on each leg's arm:
        an ANNOUNCE that comes after its writes is met by the thread that read it, and this
        caller completes the request without the messenger thread. That callback still runs
        (for callers that never wait); completing twice is a no-op."""
        arms = [leg.arm for leg in self.legs]
        held = [a for a in arms[1:] if a is not None]
        for a in held:                  # waited on next: their ANNOUNCEs arm them meanwhile too
            a.hold(1)
        try:
            for leg, arm in zip(self.legs, arms):
                if arm is not None and not self._event.is_set():   # armed by the engine (src/announce.c)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not arm.wait(left):
                        return
                    self._dec.adopt(self, leg)
                    if self._event.is_set():    # completed by the adoption: nothing left to wait on
                        return
        finally:
            for a in held:
                a.hold(-1)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._armed.wait(left):
            return
        for leg in self.legs:
            c = leg.counter
            while c is not None and not self._event.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    c.wait(0.2 if left is None else min(left, 0.2))     # slices: a failure sets _event
                except TimeoutError:
                    continue
                except KvxferError:                  # discarded (abort, failure) or engine closed
                    return
                if c.state != "done":
                    return
                self._dec.on_counter(self, leg)
                break

    def add_done_callback(self, fn: Callable[["Receive"], Any]) -> None:
        """``fn(receive)`` once final, on the messenger's dispatcher thread."""
        _args.callback(fn)
        with self._dec.node.lock:
            if self._state not in FINAL:
                self._callbacks.append(fn)
                return
        self._dec.node.dispatch(fn, self)

    @property
    def context(self) -> Optional[memoryview]:
        """A read-only view of the context the prefiller wrote (None before done, or
        without context slots). Valid until ``release()``; the view keeps the Receive alive."""
        if self._state != "done" or self._slot < 0 or self._released:
            return None
        arr, stride, most = self._dec.ctx_array, self._dec.ctx_stride, self._dec.context_bytes
        base = self._slot * stride
        n = min(int(arr[base:base + 8].view("<u8")[0]), most)   # a hostile length cannot read past the slot
        return memoryview(_Holder(arr[base + 8:base + 8 + n], self))

    def abort(self, timeout: Optional[float] = None) -> bool:
        """Stop the request with a fence. True once no write of it can land any more (every
        prefill peer stopped, reported what it posted, and all of that was credited; or it
        was already done); then the pages may be reused. A pull (``pull``) also cancels its
        reads and is fenced only once none is in flight; each peer is then told DONE. False if a peer did not answer
        within ``timeout`` (None: until it answers or is declared dead), or died: the pages
        stay quarantined until ``fenced`` turns True (the dead peer torn down, the others'
        writes fenced). ``abort(timeout=0)`` is the scheduler loop's non-blocking abort: it
        asks every peer and returns at once (False unless already fenced); the fence
        finishes in the background and ``Messenger.poll()`` reports the Receive once
        ``fenced``."""
        timeout = _args.timeout(timeout)
        with self._dec.node.lock:
            if self._state == "done":
                return True
            legs = self._dec.start_abort(self) if self._state not in FINAL else []
        self._dec.send_aborts(legs)
        if not self._event.wait(timeout):
            return False
        return self._state == "done" or all(leg.fence_ok or leg.complete for leg in self.legs)

    def release(self) -> None:
        """Give the context slot back (call once the context was read; also on collection)."""
        self._dec.release(self)

    def __repr__(self) -> str:
        return (f"<Receive {self.request_id!r} {len(self.dst_pages)} pages {len(self.legs)} leg(s) "
                f"imm={self.imm} {self._state}>")
