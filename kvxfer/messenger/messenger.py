"""The KV messenger: the request life cycle between prefill and decode nodes.

One ``Messenger`` per node, over one ``Engine``. It registers the node's KV regions once,
exchanges handshakes with peers (``PeerGroup``), and runs requests both ways:

* decode side: ``receive(peer, request_id, dst_pages, num_tokens)`` allocates an imm, sends a
  REQUEST and returns a ``Receive``, done once every message of the request (KV of every
  layer from every source rank, and the context) has been credited by the engine's counter;
* prefill side: ``requests()`` (or ``on_request=``) hands out ``Request``s; ``send(request,
  src_pages)`` plans with ``kvxfer.plan``, posts every rank pair's writes with the request's
  imm and ANNOUNCEs the exact message count; ``Send.finish(context)`` writes the context last.

Threads: the messenger thread (``kvxfer-msg``) is the only reader of the engine's control
messages; it also sends heartbeats, declares silent peers dead, runs request timeouts and
fences. The reaper (``kvxfer-msg-reap``) blocks on outstanding sends' transfers (GIL-free
native waits) and finalises them. User callbacks and ``on_request`` run on one dispatcher
thread (``kvxfer-msg-cb``), never on the engine's threads. Posting (``write_batch``) and
counting (``expect``) are native; the GIL is released while they run.

See docs/messenger.md for the protocol, the counting rule, the abort fence and what a dead
peer guarantees on each provider.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from kvxfer.errors import (
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    KvxferError,
    OutOfBoundsError,
    PeerError,
    PlanError,
    TimeoutError,
    UnsupportedError,
)
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _codec as C
from kvxfer.messenger.paged import LayoutRegions, plan_batches, register_layout, transfer_posted
from kvxfer.messenger.stream import LayerCounter, Pass, _Stream, pages_completed
from kvxfer.planner import plan as _plan

__all__ = ["Messenger", "PeerGroup", "Receive", "Request", "Send", "context_stride"]

#: imm values the messenger allocates: [1, 2**31); the upper half stays free for the caller.
IMM_LIMIT = 2**31
_FINAL = ("done", "failed", "aborted")
_STAGING_SLOTS = 64
_ONE = np.ones(1, np.int64)


def context_stride(context_bytes: int) -> int:
    """Bytes between context slots: an 8-byte length, the data, rounded up to 64."""
    return (8 + int(context_bytes) + 63) // 64 * 64


def _request_seed(rid_bytes: bytes) -> int:
    """The MLA replica seed of a request: a hash of its id, so load spreads and is repeatable."""
    return int.from_bytes(hashlib.blake2b(rid_bytes, digest_size=8).digest(), "little")


def _close_at_exit(ref: "weakref.ref[Messenger]") -> None:
    m = ref()
    if m is not None and not m.closed:
        try:
            m.close(timeout=2.0)
        except Exception:
            pass


def _timeout_arg(timeout: Any, name: str = "timeout") -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name} must be a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if not t >= 0:                         # NaN too
        raise InvalidArgumentError(f"{name} must be >= 0, got {timeout!r}")
    return None if t == float("inf") else t


class _Holder:
    """Exports a read-only buffer and keeps its owner (a Receive) alive while viewed."""

    __slots__ = ("_arr", "_owner")

    def __init__(self, arr: np.ndarray, owner: Any) -> None:
        self._arr = arr
        self._owner = owner

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._arr).toreadonly()


# -- peers ---------------------------------------------------------------------------------

class PeerGroup:
    """A connected messenger (one node: its TP ranks, regions and engine parameters)."""

    def __init__(self, m: "Messenger", hs: C.Handshake, peer: Any, remote: dict, ctx: Any) -> None:
        self._m = m
        self.handshake = hs
        self.uid: int = hs.uid
        self.layout: KVLayout = hs.layout
        self.sharding: Sharding = hs.sharding
        self.ranks: tuple[int, ...] = hs.ranks
        self.peer = peer                 #: the engine ``Peer``
        self.remote = remote             #: rank -> RemoteLayout
        self.context_region = ctx
        self.state = "connecting"        #: "connecting", "up", "dead"
        self.error: Optional[KvxferError] = None
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self.send_seq = 0
        self.recv_seq = 0
        self.send_lock = threading.Lock()
        self._resend: deque = deque()    # one-shot messages the engine refused: (type, fields, since)
        self._torn_down = False          # _peer_gone disconnected it: nothing of it lands any more
        self.acked = threading.Event()
        self.heartbeat = min(m.peer_timeout, hs.peer_timeout) / 4
        self._template: Optional[list] = None       # one page's writes (Messenger._batches)
        self._pair_template: Optional[list] = None  # the same per rank pair, for write_pairs (_posts)
        self._orders: dict[tuple, np.ndarray] = {}  # (region pairs, pages) -> the planner's order
        self._ctx_pairs: dict[int, Any] = {}        # staging region id -> (staging, context) RegionPairs
        self._geometry = hs.layout.resolve(hs.sharding)

    @property
    def alive(self) -> bool:
        return self.state != "dead"

    def __repr__(self) -> str:
        return (f"<PeerGroup {self.uid:016x} TP{self.sharding.tp_size} ranks {list(self.ranks)} "
                f"{self.state}>")


# -- decode side ---------------------------------------------------------------------------

class Receive:
    """A request this node (the decoder) made: its pages fill, then it is ``"done"``.

    ``state``: ``"pending"`` (request sent), ``"transferring"`` (the prefiller announced its
    writes), then one of ``"done"``, ``"failed"`` (``error`` says why), ``"aborted"``.
    ``done`` is True in any of the last three (as for a future). ``fenced`` is True once no
    write of this request can land any more (always after done and after a successful abort;
    after a failure only once the peer was torn down): until then the messenger refuses its
    pages to new requests.
    """

    def __init__(self, m: "Messenger", pg: PeerGroup, rid: Any, rid_bytes: bytes, pages: np.ndarray,
                 num_tokens: int, imm: int, slot: int, deadline: Optional[float]) -> None:
        self._m = m
        self.peer = pg
        self.request_id = rid
        self._rid_bytes = rid_bytes
        self.dst_pages = pages
        self.num_tokens = num_tokens
        self.imm = imm
        self._slot = slot
        self._slot_cell = [slot]
        self._deadline = deadline
        self._state = "pending"
        self.error: Optional[BaseException] = None
        self.fenced = False
        self._event = threading.Event()
        self._armed = threading.Event()     # the counter exists (ANNOUNCE handled) or final
        self._callbacks: list[Callable[[Receive], Any]] = []
        self._counter: Any = None
        self._announced: Optional[int] = None
        self._aborting = False
        self._abort_sent = False
        self._fence_target: Optional[int] = None
        self._fence_counter: Any = None
        self._fence_since = 0.0          # when the ABORTED set the fence (monotonic)
        self._fence_ok = False        # fenced by the prefiller's ABORTED, not by a teardown
        self._released = False
        self._hot = False
        self.t_start = time.monotonic()
        self.t_done: Optional[float] = None

    # -- public -----------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def done(self) -> bool:
        return self._state in _FINAL

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until final; return ``"done"`` or ``"aborted"``, raise ``error`` if failed,
        ``TimeoutError`` if ``timeout`` seconds pass first (the request goes on)."""
        timeout = _timeout_arg(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._event.is_set():
            self._wait_counter(deadline)
        if not self._event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"request {self.request_id!r} is still {self._state} after {timeout} s")
        if self._state == "failed" and self.error is not None:
            raise self.error
        return self._state

    @property
    def arrived(self) -> int:
        """Messages of this request credited so far (0 until the prefiller announced its
        count): progress, e.g. layers landing while a stream runs."""
        c = self._counter
        if c is None:
            return 0
        return c.count if c.done else c.arrived

    @property
    def expected(self) -> Optional[int]:
        """The announced message count (None before the ANNOUNCE)."""
        return self._announced

    def _wait_counter(self, deadline: Optional[float]) -> None:
        """The caller's thread waits on the engine's counter itself (a native, GIL-free wait
        woken by the progress thread) once the ANNOUNCE armed it, and completes the request:
        no hop through the engine's callback dispatcher. That callback still runs (for
        callers that never wait); completing twice is a no-op."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._armed.wait(left):
            return
        c = self._counter
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
            if c.state == "done":
                self._m._on_counter(self)
            return

    def add_done_callback(self, fn: Callable[["Receive"], Any]) -> None:
        """``fn(receive)`` once final, on the messenger's dispatcher thread."""
        if not callable(fn):
            raise InvalidArgumentError("callback must be callable")
        with self._m._lock:
            if self._state not in _FINAL:
                self._callbacks.append(fn)
                return
        self._m._dispatch(fn, self)

    @property
    def context(self) -> Optional[memoryview]:
        """A read-only view of the context the prefiller wrote (None before done, or
        without context slots). Valid until ``release()``; the view keeps the Receive alive."""
        if self._state != "done" or self._slot < 0 or self._released:
            return None
        arr = self._m._ctx_array
        stride = self._m._ctx_stride
        base = self._slot * stride
        n = int(arr[base:base + 8].view("<u8")[0])
        n = min(n, self._m.context_bytes)       # a hostile length cannot read past the slot
        return memoryview(_Holder(arr[base + 8:base + 8 + n], self))

    def abort(self, timeout: Optional[float] = None) -> bool:
        """Stop the request with a fence. True once no write of it can land any more (the
        prefiller stopped, reported what it posted, and all of that was credited; or it was
        already done); then the pages may be reused. False if the prefiller did not answer
        within ``timeout`` (None: until it answers or is declared dead): the pages stay
        quarantined (``fenced`` turns True when the peer is torn down)."""
        timeout = _timeout_arg(timeout)
        m = self._m
        send = False
        with m._lock:
            if self._state == "done":
                return True
            if self._state not in _FINAL and not self._aborting:
                self._aborting = True
                send = not self._abort_sent
                self._abort_sent = True
        if send and self.peer.alive:
            m._try_send(self.peer, C.ABORT, imm=self.imm, retry=True)   # resent until it goes
        if not self._event.wait(timeout):
            return False
        return self._state == "done" or self._fence_ok

    def release(self) -> None:
        """Give the context slot back (call once the context was read; also on collection)."""
        self._m._release_receive(self)

    def __repr__(self) -> str:
        return f"<Receive {self.request_id!r} {len(self.dst_pages)} pages imm={self.imm} {self._state}>"


# -- prefill side --------------------------------------------------------------------------

class Request:
    """A request a decoder sent to this node (the prefiller)."""

    def __init__(self, m: "Messenger", pg: PeerGroup, msg: C.Control) -> None:
        self._m = m
        self.peer = pg
        self.request_id = msg.request_id
        self.num_tokens = msg.num_tokens
        self.dst_pages: np.ndarray = msg.pages
        self.dst_pages.flags.writeable = False
        self.imm = msg.imm
        self.slot = msg.slot
        self.aborted = False          #: the decoder aborted it before ``send``
        self.send: Optional[Send] = None

    def __repr__(self) -> str:
        return f"<Request {self.request_id!r} {len(self.dst_pages)} pages from {self.peer.uid:016x}>"


class Send:
    """The writes of one request. ``done`` (final: done, failed or aborted) is the moment the
    source pages may be freed; ``add_done_callback`` says so on the dispatcher thread."""

    def __init__(self, m: "Messenger", req: Request) -> None:
        self._m = m
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
        self._staging: Optional[tuple] = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[Send], Any]] = []
        self._stream: Optional[_Stream] = None

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
        ``nbytes``, ``num_writes``, ``state``, ``fired_ns``), in arming order; the context's last."""
        return list(self._transfers) if self._stream is not None else []

    @property
    def next_token(self) -> int:
        """A streaming Send's next chunk starts here."""
        return self._stream.next_token if self._stream is not None else self.request.num_tokens

    @property
    def done(self) -> bool:
        return self._state in _FINAL

    @property
    def num_writes(self) -> int:
        """Messages announced to the decoder (the context's included once finished)."""
        return self._count

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until final; return ``"done"``/``"aborted"``, raise ``error`` if failed."""
        timeout = _timeout_arg(timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"send of {self.request.request_id!r} still {self._state} after {timeout} s")
        if self._state == "failed" and self.error is not None:
            raise self.error
        return self._state

    def add_done_callback(self, fn: Callable[["Send"], Any]) -> None:
        if not callable(fn):
            raise InvalidArgumentError("callback must be callable")
        with self._m._lock:
            if self._state not in _FINAL:
                self._callbacks.append(fn)
                return
        self._m._dispatch(fn, self)

    def finish(self, context: Any = None) -> "Send":
        """Write the context data (bytes or a contiguous array) into the decoder's slot, last;
        then the send completes once every write completed. Call it exactly once, also with
        no context. Too much context raises before anything is written."""
        return self._m._finish(self, context)

    def abort(self, timeout: Optional[float] = None) -> bool:
        """Give up: post nothing more, tell the decoder what was posted (it fences and fails
        its request). True once the posted writes are final, so the source pages are free."""
        timeout = _timeout_arg(timeout)
        self._m._abort_send(self, by_prefiller=True)
        if not self._event.wait(timeout):
            return False
        return True

    def __repr__(self) -> str:
        return f"<Send {self.request.request_id!r} {self._count} writes {self._state}>"


# -- the messenger -------------------------------------------------------------------------

class Messenger:
    """One node's end of the KV protocol over ``engine`` (see the module docstring).

    ``kv`` maps each TP rank this node holds to its regions in region-id order (numpy,
    torch, ``KVBuffer`` or ``(ptr, nbytes)``; ``layout.region_sizes(sharding)`` says how
    big), or is a sequence in the order of ``ranks`` (default: every rank of ``sharding``).
    ``context_slots`` x ``context_bytes`` is the decoder-side space for per-request context
    data. ``secret`` (bytes, >= 16) authenticates handshakes and control messages with
    HMAC-SHA256; peers must share it. ``on_request(request)`` replaces ``requests()``; it runs
    on the callback thread, or with ``inline_requests=True`` on the messenger thread that read
    the REQUEST (no thread hand-off: the lowest latency, but it must not block, since every
    control message waits for it; ``send(...).finish()`` is fine). ``placements`` maps a
    source rank to its GPU's ``Placement`` (``Topology.assign``) or directly to a local rail
    index: that rank's writes go over the engine rail nearest to it (``Engine.nearest_rail``);
    without one they are striped over every rail.
    Streaming (``layer_counter``, ``stream``, ``schedule``; kvxfer/messenger/stream.py):
    ``counter_device`` puts the layer counter in pinned host memory mapped into that CUDA
    device; ``watch_poll_us``, ``watch_cpus`` and ``watch_rt_priority`` tune its native
    watcher thread (poll interval while writes are armed, CPUs to pin to, SCHED_FIFO).
    """

    def __init__(self, engine: Any, layout: KVLayout, sharding: Sharding, kv: Any, *,
                 ranks: Optional[Iterable[int]] = None, context_slots: int = 0, context_bytes: int = 0,
                 peer_timeout: float = 10.0, secret: Optional[bytes] = None,
                 on_request: Optional[Callable[[Request], Any]] = None, inline_requests: bool = False,
                 placements: Optional[Mapping[int, Any]] = None, counter_device: Optional[int] = None,
                 watch_poll_us: float = 10.0, watch_cpus: Optional[Iterable[int]] = None,
                 watch_rt_priority: int = 0) -> None:
        from kvxfer.engine import Engine, _check_cpus, _check_watch   # here: the codecs import without libfabric

        if not isinstance(engine, Engine):
            raise InvalidArgumentError(f"engine must be a kvxfer Engine, got {type(engine).__name__}")
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(sharding, Sharding):
            raise InvalidArgumentError(f"sharding must be a Sharding, got {type(sharding).__name__}")
        layout.resolve(sharding)                      # LayoutError if they cannot meet
        # the bounds a peer's handshake decoder accepts (kvxfer/messenger/_codec.py)
        for name, v, hi in (("context_slots", context_slots, 2**31 - 1), ("context_bytes", context_bytes, 2**40)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= hi:
                raise InvalidArgumentError(f"{name} must be an int in [0, {hi}], got {v!r}")
        pt = _timeout_arg(peer_timeout, "peer_timeout")
        if not pt or pt >= 1e6:
            raise InvalidArgumentError(f"peer_timeout must be positive and under 1e6 s, got {peer_timeout!r}")
        if on_request is not None and not callable(on_request):
            raise InvalidArgumentError("on_request must be callable")
        self.secret = C._check_secret(secret)
        self.engine = engine
        self.layout = layout
        self.sharding = sharding
        self.peer_timeout = float(pt)
        self.context_slots = int(context_slots)
        self.context_bytes = int(context_bytes)
        if self.context_slots and self.context_bytes + 8 > engine.max_write:
            raise InvalidArgumentError(f"context_bytes {context_bytes} exceeds one message of this engine")
        self._on_request = on_request
        self._inline_requests = bool(inline_requests)
        if counter_device is not None and (isinstance(counter_device, bool) or not isinstance(counter_device, int)
                                           or counter_device < 0):
            raise InvalidArgumentError(f"counter_device must be a CUDA device ordinal, got {counter_device!r}")
        _check_watch(watch_poll_us, watch_rt_priority, "watch_")
        self._counter_opts = (counter_device, float(watch_poll_us),
                              None if watch_cpus is None else _check_cpus(watch_cpus), watch_rt_priority)
        self._counter: Optional[LayerCounter] = None
        self._watcher: Any = None
        self._counter_release: Optional[Callable[[], None]] = None
        self.ranks, regions = self._ranks(kv, ranks, sharding)
        self._rails = self._rails_of(engine, placements, self.ranks)
        self.uid = int.from_bytes(os.urandom(8), "little") | 1
        self._lock = threading.RLock()
        self._closed = False
        self._local: dict[int, LayoutRegions] = {}
        self._ctx_mr = None
        try:
            for r, objs in zip(self.ranks, regions):
                self._local[r] = register_layout(engine, layout, sharding, objs)
            self._ctx_stride = context_stride(self.context_bytes)
            self._ctx_array = np.zeros(max(1, self.context_slots) * self._ctx_stride, np.uint8)
            self._ctx_mr = engine.register(self._ctx_array) if self.context_slots else None
            self._hs = C.Handshake(
                uid=self.uid, address=engine.address, layout=layout, sharding=sharding, ranks=self.ranks,
                provider=engine.provider, iov=int(engine.iov), max_write=int(engine.max_write),
                pack_min=int(engine.pack_min), rails=int(engine.rails), context_slots=self.context_slots,
                context_bytes=self.context_bytes, peer_timeout=self.peer_timeout,
                regions=tuple(tuple(self._local[r].descriptors()) for r in self.ranks),
                context=self._ctx_mr.descriptor() if self._ctx_mr is not None else None,
            )
            self._blob = self._hs.encode(self.secret)
            if len(self._blob) > C.MAX_MESSAGE - 64:
                raise UnsupportedError(f"handshake of {len(self._blob)} bytes does not fit one control message "
                                       "(fewer regions per rank, e.g. a layer-major layout, make it smaller)")
        except BaseException:
            for lr in self._local.values():
                lr.close()
            if getattr(self, "_ctx_mr", None) is not None:
                self._ctx_mr.close()
            raise
        self._geometry = layout.resolve(sharding)
        self._free_slots = deque(range(self.context_slots))
        self._busy_pages = np.zeros(layout.num_pages, bool)   # pages of unfenced receives
        self._staging: dict[int, list] = {}                    # stride -> [free slots]
        self._staging_mrs: list = []
        self._peers: dict[int, PeerGroup] = {}
        self._dead: set[int] = set()
        self._seqs: dict[int, tuple[int, int]] = {}             # uid -> seqs of a timed-out connect
        self._receives: dict[int, Receive] = {}                # imm -> Receive (not yet retired)
        self._rids: dict[Any, Receive] = {}                    # request id -> Receive in flight
        self._next_imm = 1 + int.from_bytes(os.urandom(3), "little")
        self._requests: dict[tuple[int, int], Request] = {}    # (peer uid, imm) -> Request
        self._inbox: deque[Request] = deque()
        self._inbox_cv = threading.Condition(self._lock)
        self._fencing: set[Receive] = set()
        self._reap: dict[Send, None] = {}                     # insertion-ordered set
        self._reap_cv = threading.Condition(threading.Lock())
        self._cbq: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="kvxfer-msg", daemon=True),
            threading.Thread(target=self._reaper, name="kvxfer-msg-reap", daemon=True),
            threading.Thread(target=self._dispatcher, name="kvxfer-msg-cb", daemon=True),
        ]
        for t in self._threads:
            t.start()
        # an unclosed messenger's threads must not call into an engine that interpreter
        # shutdown is finalising: close it first (weakly: atexit must not keep it alive)
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    @staticmethod
    def _ranks(kv: Any, ranks: Optional[Iterable[int]], sharding: Sharding) -> tuple[tuple[int, ...], list]:
        try:
            if isinstance(kv, Mapping):
                keys = sorted(kv)
                rs = tuple(keys) if ranks is None else tuple(ranks)
                if sorted(rs) != keys:
                    raise InvalidArgumentError(f"kv holds ranks {keys} but ranks says {list(rs)}")
                regions = [kv[r] for r in sorted(rs)]
                rs = tuple(sorted(rs))
            else:
                if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence):
                    raise InvalidArgumentError("kv must map ranks to their regions, or list them per rank")
                rs = tuple(range(sharding.tp_size)) if ranks is None else tuple(ranks)
                if len(kv) != len(rs):
                    raise InvalidArgumentError(f"kv lists {len(kv)} rank(s) for ranks {list(rs)}")
                order = sorted(range(len(rs)), key=lambda i: rs[i])
                regions = [kv[i] for i in order]
                rs = tuple(rs[i] for i in order)
        except TypeError:                     # ranks not iterable, ranks or keys that do not sort
            raise InvalidArgumentError(f"ranks (and kv's keys) must be ints, got ranks={ranks!r}") from None
        for r in rs:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < sharding.tp_size:
                raise InvalidArgumentError(f"rank {r!r} is not a rank of TP{sharding.tp_size}")
        if not rs or len(set(rs)) != len(rs):
            raise InvalidArgumentError(f"ranks must be distinct and at least one, got {list(rs)}")
        return tuple(int(r) for r in rs), regions

    @staticmethod
    def _rails_of(engine: Any, placements: Optional[Mapping[int, Any]], ranks: tuple) -> dict[int, int]:
        """Source rank -> the local rail its writes take (absent: striped over every rail)."""
        if placements is None:
            return {}
        if not isinstance(placements, Mapping):
            raise InvalidArgumentError("placements must map source ranks to a Placement or a rail index")
        out = {}
        for r, p in placements.items():
            if r not in ranks:
                raise InvalidArgumentError(f"placements names rank {r!r}, which this messenger does not hold")
            if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
                if not 0 <= int(p) < engine.rails:
                    raise InvalidArgumentError(f"rail {p} of rank {r} is not one of the engine's {engine.rails}")
                out[r] = int(p)
            elif hasattr(p, "domains"):
                k = engine.nearest_rail(p)
                if k is not None:
                    out[r] = k
            else:
                raise InvalidArgumentError(f"placement of rank {r} is neither a Placement nor a rail index: {p!r}")
        return out

    # -- life cycle ---------------------------------------------------------------------
    def handshake(self) -> bytes:
        """This node's versioned blob (address, region descriptors, layout, sharding, ranks,
        engine parameters, context slots; HMAC-tagged with a secret). Give it to peers."""
        return self._blob

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> list[PeerGroup]:
        with self._lock:
            return [p for p in self._peers.values() if p.alive]

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is in flight (``ClosedError``), tell peers (BYE), stop the threads and
        deregister. The engine stays open (the caller owns it)."""
        if _timeout_arg(timeout) is None:      # checked before anything closes
            raise InvalidArgumentError(f"close timeout must be a finite number of seconds, got {timeout!r}")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        err = ClosedError("messenger closed")
        for pg in peers:
            if pg.alive:
                self._peer_gone(pg, err, notify=True)
        self._stop.set()
        with self._reap_cv:
            self._reap_cv.notify_all()
        with self._inbox_cv:
            self._inbox_cv.notify_all()
        self._cbq.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        # nothing is left pending: a Receive of a peer that died meanwhile fails too (fenced
        # once that peer was torn down)
        with self._lock:
            left = [r for r in self._receives.values() if r._state not in _FINAL]
        for r in left:
            self._finish_receive(r, "failed", err, fenced=r.peer._torn_down)
        if self._watcher is not None:          # armed writes never post after this
            self._watcher.close(max(0.1, deadline - time.monotonic()))
            if self._counter_release is not None:
                self._counter_release()
                self._counter_release = None
        if self.engine.closed:
            return
        regions = [mr for lr in self._local.values() for mr in lr.regions] + self._staging_mrs
        if self._ctx_mr is not None:
            regions.append(self._ctx_mr)
        for mr in regions:
            while True:
                try:
                    mr.close()
                    break
                except InvalidArgumentError:       # a transfer from it still in flight
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
                except KvxferError:
                    break

    def __enter__(self) -> "Messenger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: messages sent/received by type, drops by reason (``drop_*``), requests."""
        with self._lock:
            return dict(self.counts)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("messenger is closed")

    # -- connecting ---------------------------------------------------------------------
    def connect(self, blob: bytes, timeout: Optional[float] = None) -> PeerGroup:
        """Connect to the messenger whose ``handshake()`` this is: check versions, layouts,
        shardings and engine parameters up front, exchange HELLOs, and return its group once
        it answered (``PeerError`` after ``timeout``, default ``peer_timeout``)."""
        self._check_open()
        timeout = self.peer_timeout if timeout is None else _timeout_arg(timeout)
        hs = C.safe_decode_handshake(blob, self.secret)
        with self._lock:
            if hs.uid in self._dead:
                raise PeerError(f"peer {hs.uid:016x} was declared dead; a restarted peer has a new handshake")
            pg = self._peers.get(hs.uid)
        if pg is None:
            pg = self._make_group(hs)
        if pg.state == "up":
            return pg
        self._send(pg, C.HELLO, blob=self._blob)
        if not pg.acked.wait(timeout):
            with self._lock:
                if pg.state == "connecting":
                    self._peers.pop(pg.uid, None)
                    # a retry's group goes on from these: its HELLO must be newer than this
                    # one, which the peer may have accepted after our timeout
                    self._seqs[pg.uid] = (pg.send_seq, pg.recv_seq)
                    self._forget_peer(pg)
            raise PeerError(f"peer {hs.uid:016x} did not answer the handshake within {timeout} s")
        if pg.state == "dead":
            raise pg.error or PeerError("peer died while connecting")
        return pg

    def _make_group(self, hs: C.Handshake) -> PeerGroup:
        if hs.uid == self.uid:
            raise InvalidArgumentError("that handshake is this messenger's own")
        if hs.provider != self.engine.provider:
            raise DescriptorError(f"peer runs provider {hs.provider!r}, this engine {self.engine.provider!r}")
        # the layouts and shardings must be able to meet (LayoutError otherwise): an empty plan
        # checks both directions' geometry
        _plan(self.layout, self.sharding, hs.layout, hs.sharding, [], [])
        _plan(hs.layout, hs.sharding, self.layout, self.sharding, [], [])
        if hs.context_slots and context_stride(hs.context_bytes) > self.engine.max_write + 64:
            raise InvalidArgumentError("the peer's context slot does not fit one message of this engine")
        if self.context_slots and self.context_bytes + 8 > hs.max_write:
            raise InvalidArgumentError("this node's context does not fit one message of the peer's engine")
        peer = self.engine.connect(hs.address)
        with self._lock:         # one engine Peer per address: its teardown would take the other down
            other = next((g for g in self._peers.values() if g.peer is peer and g.uid != hs.uid), None)
        if other is not None:
            raise DescriptorError(f"the handshake names the address of peer {other.uid:016x}")
        try:
            remote = {}
            for r, descs in zip(hs.ranks, hs.regions):
                remote[r] = [self.engine.remote(d) for d in descs]
            ctx = self.engine.remote(hs.context) if hs.context_slots else None
            if ctx is not None and ctx.nbytes < hs.context_slots * context_stride(hs.context_bytes):
                raise DescriptorError("the peer's context region is smaller than its slots")
            sizes = hs.layout.region_sizes(hs.sharding)
            for r, rr in remote.items():
                if any(x.nbytes < s for x, s in zip(rr, sizes)):
                    raise DescriptorError(f"the peer's rank {r} regions are smaller than its layout")
        except BaseException:
            self._disconnect(peer)
            raise
        pg = PeerGroup(self, hs, peer, remote, ctx)
        with self._lock:
            old = self._peers.get(hs.uid)
            if old is not None:
                if old.peer is not peer:       # the engine shares one Peer per address
                    self._disconnect(peer)
                return old
            seqs = self._seqs.pop(hs.uid, None)
            if seqs is not None:
                pg.send_seq, pg.recv_seq = seqs
            self._peers[hs.uid] = pg
        return pg

    def _disconnect(self, peer: Any) -> None:
        try:
            self.engine.disconnect(peer)
        except KvxferError:
            pass

    def _forget_peer(self, pg: PeerGroup) -> None:
        self._disconnect(pg.peer)

    # -- sending control messages -----------------------------------------------------------
    def _send(self, pg: PeerGroup, t: int, timeout: Optional[float] = 5.0, **fields: Any) -> None:
        with pg.send_lock:
            pg.send_seq += 1
            data = C.Control(t, self.uid, pg.uid, pg.send_seq, **fields).encode(self.secret)
            self.engine.send(pg.peer, data, timeout=timeout)
            pg.last_sent = time.monotonic()
        self._count("sent_" + C.MSG_TYPES[t])

    def _try_send(self, pg: PeerGroup, t: int, *, retry: bool = False, **fields: Any) -> bool:
        """Send one control message. ``retry``: a one-shot message (HELLO_ACK, ABORT,
        ABORTED, REJECT) that nothing else would repeat: if the engine does not take it
        (backpressure), the messenger thread resends it, in order, while the peer lives."""
        if retry:
            with self._lock:
                if pg._resend:               # behind the ones waiting: one-shots keep their order
                    if pg.alive and not self._closed:
                        pg._resend.append((t, fields, time.monotonic()))
                    return False
        try:
            self._send(pg, t, timeout=1.0, **fields)
            return True
        except KvxferError:
            with self._lock:
                self._count("send_failed")
                if retry and pg.alive and not self._closed:
                    pg._resend.append((t, fields, time.monotonic()))
            return False

    def _resend_pending(self, pg: PeerGroup, now: float) -> None:
        """Messenger thread: resend ``pg``'s refused one-shot messages, oldest first, until one
        is refused again. A message the engine refused for ``peer_timeout`` declares the peer
        dead (as silence would): its requests fail rather than wait for a reply never sent."""
        while True:
            with self._lock:
                if not pg._resend or not pg.alive:
                    return
                t, fields, since = pg._resend[0]
            try:
                self._send(pg, t, timeout=0.05, **fields)
            except KvxferError as exc:
                self._count("send_failed")
                if now - since > self.peer_timeout:
                    self._peer_gone(pg, PeerError(f"peer {pg.uid:016x}: could not send {C.MSG_TYPES[t]} for "
                                                  f"{self.peer_timeout} s ({exc}): declared dead"), notify=False)
                return
            with self._lock:
                if pg._resend and pg._resend[0][0] == t and pg._resend[0][1] is fields:
                    pg._resend.popleft()
            self._count("resent_" + C.MSG_TYPES[t])

    # -- decode side --------------------------------------------------------------------
    def receive(self, peer: PeerGroup, request_id: Any, dst_pages: Any, num_tokens: int, *,
                timeout: Optional[float] = None, hot: bool = False) -> Receive:
        """Ask ``peer`` (a prefill node) for ``request_id``'s KV into ``dst_pages`` (indices of
        this node's layout, on every rank it holds). Returns at once; the ``Receive`` is done
        once every write and the context landed. With ``timeout``, a request not done by then
        is aborted (with the fence) and fails with ``TimeoutError``. ``hot``: keep the engine's
        progress threads polling until the request is final (``Engine.hold_awake``), so each
        streamed layer lands without a sleeping thread's wake-up (costs CPU meanwhile)."""
        self._check_open()
        if not isinstance(peer, PeerGroup) or peer._m is not self:
            raise InvalidArgumentError("peer must come from this messenger's connect()")
        if not peer.alive:
            raise PeerError(f"peer {peer.uid:016x} is dead") from peer.error
        timeout = _timeout_arg(timeout)
        if (type(dst_pages) is list and 0 < len(dst_pages) <= 64
                and all(type(x) is int for x in dst_pages)):       # the common small case, without numpy
            lo, hi = min(dst_pages), max(dst_pages)
            if lo < 0 or hi >= self.layout.num_pages:
                bad = lo if lo < 0 else hi
                raise OutOfBoundsError(f"page {bad} is outside this node's {self.layout.num_pages} pages")
            if len(set(dst_pages)) != len(dst_pages):
                raise InvalidArgumentError("dst_pages names a page twice")
            pages = np.array(dst_pages, np.int64)
        else:
            pages = self._dst_pages(dst_pages)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise InvalidArgumentError(f"num_tokens must be an int, got {num_tokens!r}")
        if not 0 < int(num_tokens) <= len(pages) * self.layout.page_size:
            raise InvalidArgumentError(f"num_tokens {num_tokens} does not fit {len(pages)} page(s) of "
                                       f"{self.layout.page_size} tokens")
        rid_bytes = C.encode_request_id(request_id)
        if isinstance(request_id, bytearray):
            request_id = bytes(request_id)        # a key of the in-flight table; the prefiller sees bytes
        pages.flags.writeable = False
        with self._lock:
            self._check_open()
            # again under the lock: _peer_gone marks the peer dead and collects its receives
            # under it, so a Receive is either refused here or failed by the teardown
            if not peer.alive:
                raise PeerError(f"peer {peer.uid:016x} is dead") from peer.error
            if request_id in self._rids:
                raise InvalidArgumentError(f"request id {request_id!r} is already in flight")
            busy = self._busy_pages[pages]
            if busy.any():
                raise InvalidArgumentError(f"page {int(pages[busy][0])} still belongs to an unfinished or "
                                           "quarantined request")
            if self.context_slots and not self._free_slots:
                raise InvalidArgumentError(f"all {self.context_slots} context slots are in use: release() "
                                           "finished receives")
            imm = self._alloc_imm()
            slot = self._free_slots.popleft() if self.context_slots else -1
            deadline = None if timeout is None else time.monotonic() + timeout
            r = Receive(self, peer, request_id, rid_bytes, pages, int(num_tokens), imm, slot, deadline)
            if hot:
                self.engine.hold_awake(True)
                r._hot = True
            self._busy_pages[pages] = True
            self._receives[imm] = r
            self._rids[request_id] = r
            self._count("receives")
        if slot >= 0:
            weakref.finalize(r, self._free_cell, r._slot_cell)
        try:
            self._send(peer, C.REQUEST, imm=imm, num_tokens=int(num_tokens), slot=slot, request_id=request_id,
                       pages=pages)
        except KvxferError as exc:
            with self._lock:
                self._receives.pop(imm, None)
                self._rids.pop(request_id, None)
                self._busy_pages[pages] = False
                r._state = "failed"
                r.fenced = True
                r._released = True
                if r._hot:
                    r._hot = False
                    self.engine.hold_awake(False)
            self._free_cell(r._slot_cell)
            raise PeerError(f"could not send the request to peer {peer.uid:016x}: {exc}") from exc
        return r

    def _dst_pages(self, dst_pages: Any) -> np.ndarray:
        pages = np.asarray(dst_pages)
        if pages.ndim != 1 or pages.size == 0:
            raise InvalidArgumentError(f"dst_pages must be a non-empty 1-D list of page indices, got shape {pages.shape}")
        if pages.dtype.kind not in "iu":
            raise InvalidArgumentError(f"dst_pages must hold integers, got dtype {pages.dtype}")
        pages = pages.astype(np.int64)
        if int(pages.min()) < 0 or int(pages.max()) >= self.layout.num_pages:
            bad = int(pages[(pages < 0) | (pages >= self.layout.num_pages)][0])
            raise OutOfBoundsError(f"page {bad} is outside this node's {self.layout.num_pages} pages")
        if len(pages) > C.MAX_PAGES:
            raise InvalidArgumentError(f"a request names at most {C.MAX_PAGES} pages, got {len(pages)}")
        if len(pages) > 1 and len(np.unique(pages)) != len(pages):
            raise InvalidArgumentError("dst_pages names a page twice")
        return pages

    def _alloc_imm(self) -> int:
        while True:
            imm = self._next_imm
            self._next_imm = imm + 1 if imm + 1 < IMM_LIMIT else 1
            if imm not in self._receives:
                return imm

    def _free_cell(self, cell: list) -> None:
        """Give a context slot back, once (``cell`` is shared with the Receive's finalizer)."""
        with self._lock:
            if cell[0] >= 0:
                self._free_slots.append(cell[0])
                cell[0] = -1

    def _release_receive(self, r: Receive) -> None:
        with self._lock:
            if r._released or r._state not in _FINAL or not r.fenced:
                return
            r._released = True
        self._free_cell(r._slot_cell)

    def _finish_receive(self, r: Receive, state: str, error: Optional[BaseException] = None, *,
                        fenced: bool) -> None:
        """Move ``r`` to a final state (once); retire its imm and pages when fenced."""
        with self._lock:
            if r._state in _FINAL:
                if fenced and not r.fenced:
                    self._retire(r)
                return
            r._state = state
            if error is not None and r.error is None:
                r.error = error
            r.t_done = time.monotonic()
            if r._hot:
                r._hot = False
                try:
                    self.engine.hold_awake(False)
                except KvxferError:
                    pass
            self._rids.pop(r.request_id, None)
            self._fencing.discard(r)
            if fenced:
                self._retire(r)
            cbs, r._callbacks = r._callbacks, []
            self._count("receive_" + state)
        r._event.set()
        r._armed.set()
        for fn in cbs:
            self._dispatch(fn, r)

    def _retire(self, r: Receive) -> None:
        """No write of ``r`` can land any more: free its pages and imm (under the lock)."""
        r.fenced = True
        self._busy_pages[r.dst_pages] = False
        self._receives.pop(r.imm, None)
        if r._state != "done":
            # every write that could carry the imm has landed (fence) or never will (the
            # peer is torn down): retire it, so nothing of it is credited to a later request
            try:
                self.engine.discard(r.imm)
            except KvxferError:
                pass

    def _on_counter(self, r: Receive) -> None:
        """Engine dispatcher: every announced message of ``r`` was credited."""
        self._finish_receive(r, "done", fenced=True)

    # -- prefill side -------------------------------------------------------------------
    def requests(self, timeout: Optional[float] = None) -> list[Request]:
        """Requests received and not yet handed out; waits up to ``timeout`` s for the first
        (None: forever), returns [] if none came."""
        timeout = _timeout_arg(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._inbox_cv:
            while not self._inbox:
                self._check_open()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._inbox_cv.wait(0.2 if left is None else min(left, 0.2))
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def send(self, request: Request, src_pages: Any) -> Send:
        """Post every layer of ``request``: ``src_pages[i]`` of this node's layout becomes
        ``request.dst_pages[i]`` at the decoder, on every rank it holds. Returns a ``Send``;
        call ``finish(context)`` after it. Raises before anything is posted on bad pages
        (``PlanError``) or a request that was already sent; a request the decoder aborted
        meanwhile gives a Send that is already ``"aborted"``."""
        self._check_open()
        if not isinstance(request, Request) or request._m is not self:
            raise InvalidArgumentError("request must come from this messenger's requests()")
        pg = request.peer
        if len(self.ranks) != self.sharding.tp_size:
            raise UnsupportedError(f"sending needs every rank of TP{self.sharding.tp_size} in this messenger; "
                                   f"it holds {list(self.ranks)}")
        posts = self._posts(pg, request, src_pages)
        s = Send(self, request)
        with self._lock:
            if request.send is not None:
                raise InvalidArgumentError(f"request {request.request_id!r} was already sent")
            request.send = s
            if request.aborted or not pg.alive:
                err = None if request.aborted else PeerError(f"peer {pg.uid:016x} is dead")
                s._state = "aborted" if request.aborted else "failed"
                s.error = err
                s._posting_done = s._finished = True
                s._event.set()
                self._requests.pop((pg.uid, request.imm), None)
                return s
        err: Optional[BaseException] = None
        try:
            for src, post in posts:          # one engine call per rank pair (write_pairs)
                if s._abort_req:
                    break
                s._transfers.append(post(imm=request.imm, rail=self._rails.get(src)))
        except KvxferError as exc:
            err = exc
        count = sum(t.num_writes for t in s._transfers) + (1 if pg.handshake.context_slots else 0)
        with s._lock:
            s._count = count
            s._posting_done = True
            if err is not None:
                s.error = err
                s._abort_req = True
                s._abort_flags = C.ABORTED_BY_PREFILLER
                s._reply = True
            if s._abort_req:
                for t in s._transfers:
                    t.cancel()
                s._finished = True
            else:
                try:
                    self._send(pg, C.ANNOUNCE, imm=request.imm, count=count)
                    s._state = "transferring"
                except KvxferError as exc:
                    s.error = PeerError(f"could not announce to peer {pg.uid:016x}: {exc}")
                    s._abort_req = True
                    s._abort_flags = C.ABORTED_BY_PREFILLER
                    s._reply = True           # the decoder fences on what was posted (resent if refused)
                    s._finished = True
                    for t in s._transfers:
                        t.cancel()
        with self._lock:
            self._count("sends")
        if s._abort_req:
            self._queue_reap(s)
        return s

    # -- streaming (layer by layer; see kvxfer/messenger/stream.py) ---------------------------
    @property
    def layer_counter(self) -> LayerCounter:
        """The counter the model bumps once per layer (made, with its native watcher thread,
        on first use; device-visible with ``counter_device``)."""
        with self._lock:
            if self._counter is None:
                self._check_open()
                device, poll_us, cpus, rt = self._counter_opts
                word, dptr, keep = 0, None, None
                if device is not None:
                    from kvxfer.messenger import _cudabump

                    word, dptr, self._counter_release = _cudabump.alloc_mapped_word(device)
                self._watcher = self.engine.watcher(word=word, poll_us=poll_us, cpus=cpus, keep=keep, rt_priority=rt)
                self._counter = LayerCounter(self._watcher, self.layout.num_layers, dptr, device)
            return self._counter

    def stream(self, request: Request, src_pages: Any = None) -> Send:
        """A Send whose writes ``schedule`` posts layer by layer as the model computes them.
        ``src_pages``: the request's source pages, all or a prefix (a chunk may extend them).
        Call ``finish(context)`` any time; the context is written after the last layer."""
        self._check_open()
        if not isinstance(request, Request) or request._m is not self:
            raise InvalidArgumentError("request must come from this messenger's requests()")
        if len(self.ranks) != self.sharding.tp_size:
            raise UnsupportedError(f"sending needs every rank of TP{self.sharding.tp_size} in this messenger; "
                                   f"it holds {list(self.ranks)}")
        sp = None if src_pages is None else self._src_prefix(src_pages, request)
        self.layer_counter                      # the watcher exists before anything is armed
        pg = request.peer
        s = Send(self, request)
        s._stream = _Stream(sp)
        with self._lock:
            if request.send is not None:
                raise InvalidArgumentError(f"request {request.request_id!r} was already sent")
            request.send = s
            if request.aborted or not pg.alive:
                s._state = "aborted" if request.aborted else "failed"
                s.error = None if request.aborted else PeerError(f"peer {pg.uid:016x} is dead")
                s._posting_done = s._finished = True
                s._event.set()
                self._requests.pop((pg.uid, request.imm), None)
            self._count("sends")
        return s

    def _src_prefix(self, src_pages: Any, request: Request) -> np.ndarray:
        a = np.asarray(src_pages)
        n = len(request.dst_pages)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise PlanError("src_pages must be a 1-D list of page indices")
        if a.shape[0] > n:
            raise PlanError(f"src_pages has {a.shape[0]} pages but the request has {n}")
        return self._src_pages(a, a.shape[0])

    def schedule(self, chunks: Iterable[Any]) -> Pass:
        """Before a forward pass: the request chunks it computes, as ``(send, start_token,
        end_token)`` or ``(send, start_token, end_token, src_pages)`` (the request's source
        pages so far, a prefix that grows). Arms, for every layer ``l``, the writes of the
        pages each chunk completes, to be posted by the watcher when the layer counter
        reaches ``pass.base + l + 1``. A chunk ending at ``num_tokens`` is the request's last:
        its count is announced now. Chunks of Sends already aborted are skipped. Everything
        is checked before anything is armed."""
        self._check_open()
        try:
            chunks = list(chunks)
        except TypeError:
            raise InvalidArgumentError(f"chunks must be an iterable of chunks, got {type(chunks).__name__}") from None
        lc = self.layer_counter
        work = []
        seen: set[int] = set()
        for ch in chunks:
            if not isinstance(ch, tuple) or len(ch) not in (3, 4):
                raise InvalidArgumentError(f"a chunk is (send, start_token, end_token[, src_pages]), got {ch!r}")
            send, start, end = ch[:3]
            if not isinstance(send, Send) or send._m is not self or send._stream is None:
                raise InvalidArgumentError("a chunk's send must come from this messenger's stream()")
            if id(send) in seen:
                raise InvalidArgumentError(f"request {send.request.request_id!r} has two chunks in one pass")
            seen.add(id(send))
            for name, v in (("start_token", start), ("end_token", end)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise InvalidArgumentError(f"{name} must be an int, got {v!r}")
            start, end = int(start), int(end)
            st = send._stream
            req = send.request
            if send._abort_req or send._state in _FINAL:
                continue                       # left between passes (aborted, failed)
            if st.end is not None:
                raise InvalidArgumentError(f"request {req.request_id!r}'s last chunk was already scheduled")
            if start != st.next_token or not start < end <= req.num_tokens:
                raise InvalidArgumentError(f"chunk [{start}, {end}) of request {req.request_id!r} must start at "
                                           f"{st.next_token} and end after it, at most at {req.num_tokens}")
            sp = st.src_pages
            if len(ch) == 4:
                new = self._src_prefix(ch[3], req)
                if sp is not None and not np.array_equal(new[:len(sp)], sp[:len(new)]):
                    raise PlanError(f"request {req.request_id!r}'s source pages changed between chunks")
                if sp is None or len(new) > len(sp):
                    sp = new
            idx = pages_completed(req.num_tokens, self.layout.page_size, start, end)
            if len(idx) and (sp is None or int(idx[-1]) >= len(sp)):
                raise PlanError(f"chunk [{start}, {end}) of request {req.request_id!r} completes page "
                                f"{int(idx[-1])} but only {0 if sp is None else len(sp)} source pages are known")
            layers = self._layer_batches(req.peer, req, req.dst_pages[idx], sp[idx]) if len(idx) else None
            work.append((send, start, end, sp, layers))
        base, end_ = lc._take_pass()
        p = Pass(self, base, end_, [w[0] for w in work])
        for send, start, end, sp, layers in work:
            self._arm_chunk(p, send, end, sp, layers)
        return p

    def _arm_chunk(self, p: Pass, s: Send, end: int, sp: Optional[np.ndarray], layers: Optional[list]) -> None:
        req = s.request
        pg = req.peer
        st = s._stream
        w = self._watcher
        nrails = self.engine.rails
        announce = None
        err: Optional[BaseException] = None
        with s._lock:
            if s._abort_req or s._state in _FINAL:
                return
            st.src_pages = sp
            st.next_token = end
            st.passes.append(p.id)
            try:
                if layers is not None:
                    # one native arming loop per region pair, its layers as groups
                    by_pair: dict = {}
                    for lay, batches in enumerate(layers):
                        for src, dst, sr, dr, so, do, ln in batches:
                            by_pair.setdefault((src, dst, sr, dr), []).append((p.base + lay + 1, so, do, ln))
                    for (src, dst, sr, dr), groups in by_pair.items():
                        starts = np.zeros(len(groups) + 1, np.int64)
                        np.cumsum([len(g[3]) for g in groups], out=starts[1:])
                        s._transfers.extend(w.arm_groups(
                            [g[0] for g in groups], self._local[src][sr], pg.peer, pg.remote[dst][dr],
                            np.concatenate([g[1] for g in groups]), np.concatenate([g[2] for g in groups]),
                            np.concatenate([g[3] for g in groups]), starts, imm=req.imm, tag=p.id,
                            rail=self._rails.get(src, src % nrails)))
            except KvxferError as exc:
                err = exc
            if err is None and end == req.num_tokens:
                st.end = p.end
                announce = sum(t.num_writes for t in s._transfers) + (1 if pg.handshake.context_slots else 0)
                s._count = announce
                if st.context is not None:
                    try:
                        self._arm_context(s)
                    except KvxferError as exc:
                        err = exc
            if err is None and announce is not None:
                # under s._lock, as send() does: an abort (which takes it) answers ABORTED
                # only after this, so the decoder never gets the ANNOUNCE after the ABORTED
                try:
                    self._send(pg, C.ANNOUNCE, imm=req.imm, count=announce)
                    if s._state == "pending":
                        s._state = "transferring"
                except KvxferError as exc:
                    err = PeerError(f"could not announce to peer {pg.uid:016x}: {exc}")
            if err is not None:
                s.error = err
                s._abort_req = True
                s._abort_flags = C.ABORTED_BY_PREFILLER
                s._reply = True
                for t in s._transfers:
                    t.cancel()
                s._posting_done = s._finished = True
                announce = None
        if err is not None:
            self._queue_reap(s)
            return
        if announce is not None:
            self._maybe_done_posting(s)

    def _arm_context(self, s: Send) -> None:
        """Arm the context write at the last pass's end (under ``s._lock``)."""
        st = s._stream
        pg = s.request.peer
        if st.context_armed:
            return
        st.context_armed = True
        if not pg.handshake.context_slots:
            return
        (data,) = st.context
        stride = context_stride(pg.handshake.context_bytes)
        mr, arr, idx = self._staging_slot(stride)
        s._staging = (stride, (mr, arr, idx))
        n = 0 if data is None else len(data)
        base = idx * stride
        arr[base:base + 8].view("<u8")[0] = n
        if n:
            arr[base + 8:base + 8 + n] = np.frombuffer(data, np.uint8)
        s._transfers.append(self._watcher.arm(st.end, mr, pg.peer, pg.context_region, np.array([base], np.uint64),
                                              np.array([s.request.slot * stride], np.uint64),
                                              np.array([8 + n], np.uint64), imm=s.request.imm, tag=st.passes[-1],
                                              rail=self._rails.get(self.ranks[0], 0)))

    def _maybe_done_posting(self, s: Send) -> None:
        """A streaming Send whose last chunk was scheduled and whose context is armed has
        nothing more to arm: the reaper settles it once every entry posted and completed."""
        with s._lock:
            st = s._stream
            if s._posting_done or st.end is None or not st.context_armed:
                return
            s._posting_done = s._finished = True
        self._queue_reap(s)

    def _abandon_pass(self, p: Pass) -> int:
        if p.abandoned:
            return 0
        p.abandoned = True
        n = 0
        for s in p.sends:                   # aborting first: the reaper never sees them "done"
            n += sum(1 for t in s._transfers if t.threshold > p.base and t.threshold <= p.end
                     and t.state == "armed")
            if not s.done:
                self._abort_send(s, by_prefiller=True)
        self._watcher.disarm_tag(p.id)
        # skip the pass's layers on the counter, but never before it reached p.base: a pass
        # scheduled ahead is abandoned while the one before it still runs, whose remaining
        # layers must fire when computed (LayerCounter._skip_pass)
        self._counter._skip_pass(p.base, p.end)
        return n

    def _layer_batches(self, pg: PeerGroup, request: Request, dst_pages: np.ndarray, src_pages: np.ndarray) -> list:
        """The writes of these pages, per layer: ``[layer] -> [(src rank, dst rank, src region,
        dst region, so, do, ln)]``, in the planner's order within a layer (page, then entry)
        so contiguous pages coalesce. Same two roads as ``_batches``."""
        nl = self.layout.num_layers
        out: list[list] = [[] for _ in range(nl)]
        sh = self.sharding
        if sh.replicated or self.layout.kv_heads < sh.tp_size:
            seed = _request_seed(C.encode_request_id(request.request_id))
            p = _plan(self.layout, sh, pg.layout, pg.sharding, src_pages, dst_pages, seed=seed)
            for lay in p.layers:
                pl = p.layer(lay)
                for s, d in p.pairs:
                    if d in pg.remote:
                        out[lay].extend((s, d, *b) for b in plan_batches(pl, s, d))
            return out
        sp, dp = src_pages, dst_pages
        if len(sp) > 1:
            order = np.argsort(sp, kind="stable")
            sp, dp = sp[order], dp[order]
        t = pg._template
        if t is None:
            t = pg._template = self._make_template(pg)
        soff = sp * self._geometry.page_stride
        doff = dp * pg._geometry.page_stride
        for s, d, sr, dr, so, do, ln, lay in t:
            for layer in np.unique(lay).tolist():
                sel = lay == layer
                a, b, c = so[sel], do[sel], ln[sel]
                out[layer].append((s, d, sr, dr, (a[None, :] + soff[:, None]).ravel(),
                                   (b[None, :] + doff[:, None]).ravel(),
                                   np.broadcast_to(c, (len(sp), len(c))).ravel()))
        return out

    def _posts(self, pg: PeerGroup, request: Request, src_pages: Any) -> list:
        """A request's writes as ``(src rank, post)``, one per rank pair: ``post(imm=, rail=)``
        is ONE engine call (``write_pairs`` over the pair's region pairs, or ``write_groups``)
        and returns one ``Transfer``. Same writes, same order as ``_batches``; the template
        road shifts one page's writes of all region pairs at once (see ``_batches``)."""
        sh = self.sharding
        eng = self.engine
        if sh.replicated or self.layout.kv_heads < sh.tp_size:
            out = []
            by_pair: dict[tuple[int, int], list] = {}
            for s_, d, sr, dr, so, do, ln in self._batches(pg, request, src_pages):
                by_pair.setdefault((s_, d), []).append((self._local[s_][sr], pg.remote[d][dr], so, do, ln))
            for (s_, d), groups in by_pair.items():
                out.append((s_, lambda imm, rail, g=groups: eng.write_groups(pg.peer, g, imm=imm, rail=rail)))
            return out
        sp = self._src_pages(src_pages, len(request.dst_pages))
        dp = request.dst_pages
        n = len(sp)
        if n > 1:
            order = np.argsort(sp, kind="stable")
            sp, dp = sp[order], dp[order]
        t = pg._pair_template
        if t is None:
            t = pg._pair_template = self._make_pair_template(pg)
        ds = self._geometry.page_stride
        dd = pg._geometry.page_stride
        out = []
        for s_, pairs, so, do, ln, counts, key in t:
            if n == 1:
                a, b, c, k = so + int(sp[0]) * ds, do + int(dp[0]) * dd, ln, counts
            else:
                idx = pg._orders.get((id(pairs), n))
                if idx is None:
                    # (region pair, layer, page, entry): the planner's order within each pair
                    m = len(so)
                    page = np.repeat(np.arange(n), m)
                    entry = np.tile(np.arange(m), n)
                    idx = np.lexsort((entry, page, np.tile(key, n)))
                    if len(pg._orders) < 64:
                        pg._orders[(id(pairs), n)] = idx
                a = (so[None, :] + (sp * ds)[:, None].astype(np.uint64)).ravel()[idx]
                b = (do[None, :] + (dp * dd)[:, None].astype(np.uint64)).ravel()[idx]
                c = np.tile(ln, n)[idx]
                k = counts * n
            out.append((s_, lambda imm, rail, p=pairs, a=a, b=b, c=c, k=k: eng.write_pairs(p, a, b, c, k, imm=imm,
                                                                                          rail=rail)))
        return out

    def _make_pair_template(self, pg: PeerGroup) -> list:
        """``_make_template`` per rank pair: ``(s, RegionPairs, so, do, ln, counts, key)`` with
        the region pairs' writes concatenated and ``key`` = region pair x layers + layer."""
        by_pair: dict[tuple[int, int], list] = {}
        for s_, d, sr, dr, so, do, ln, lay in self._make_template(pg):
            by_pair.setdefault((s_, d), []).append((sr, dr, so, do, ln, lay))
        out = []
        nl = max(1, self.layout.num_layers)
        for (s_, d), rows in by_pair.items():
            pairs = self.engine.region_pairs(pg.peer, [(self._local[s_][sr], pg.remote[d][dr])
                                                       for sr, dr, *_ in rows])
            so = np.concatenate([r[2] for r in rows]).astype(np.uint64)
            do = np.concatenate([r[3] for r in rows]).astype(np.uint64)
            ln = np.concatenate([r[4] for r in rows]).astype(np.uint64)
            counts = np.array([len(r[4]) for r in rows], np.int64)
            key = np.concatenate([i * nl + r[5].astype(np.int64) for i, r in enumerate(rows)])
            out.append((s_, pairs, so, do, ln, counts, key))
        return out

    def _batches(self, pg: PeerGroup, request: Request, src_pages: Any) -> list:
        """Every write of a request as ``(src rank, dst rank, src region, dst region, so, do,
        ln)``, one engine ``write_batch`` each (region pairs of all layers concatenated).

        When no replica has to be chosen (the source sharding neither replicates nor has
        fewer heads than ranks) a page's writes do not depend on the other pages: the
        planner runs once per peer for one page, and a request shifts that template by each
        page's offset (``page * page_stride`` on both sides), ordered as the planner orders
        them (by layer, then by source page) so the engine still coalesces contiguous pages.
        Otherwise every request is planned, seeded by its id (MLA: the replica set is drawn
        per request)."""
        sh = self.sharding
        if sh.replicated or self.layout.kv_heads < sh.tp_size:
            seed = _request_seed(C.encode_request_id(request.request_id))
            p = _plan(self.layout, sh, pg.layout, pg.sharding, src_pages, request.dst_pages, seed=seed)
            return [(s, d, *b) for (s, d) in p.pairs if d in pg.remote for b in plan_batches(p, s, d)]
        sp = self._src_pages(src_pages, len(request.dst_pages))
        dp = request.dst_pages
        if len(sp) > 1:
            order = np.argsort(sp, kind="stable")
            sp, dp = sp[order], dp[order]
        t = pg._template
        if t is None:
            t = pg._template = self._make_template(pg)
        soff = sp * self._geometry.page_stride
        doff = dp * pg._geometry.page_stride
        n = len(sp)
        out = []
        for s, d, sr, dr, so, do, ln, lay in t:
            if n == 1:
                out.append((s, d, sr, dr, so + soff[0], do + doff[0], ln))
                continue
            m = len(so)
            key = (lay[None, :].astype(np.int64) * n + np.arange(n, dtype=np.int64)[:, None]).ravel()
            idx = np.argsort(key, kind="stable")      # (layer, page, entry): the planner's order
            out.append((s, d, sr, dr, (so[None, :] + soff[:, None]).ravel()[idx],
                        (do[None, :] + doff[:, None]).ravel()[idx], np.broadcast_to(ln, (n, m)).ravel()[idx]))
        return out

    def _src_pages(self, pages: Any, n: int) -> np.ndarray:
        a = np.asarray(pages)
        if a.ndim != 1:
            raise PlanError(f"src_pages must be a 1-D list of page indices, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise PlanError(f"src_pages must hold integers, got dtype {a.dtype}")
        if a.shape[0] != n:
            raise PlanError(f"src_pages has {a.shape[0]} pages but dst_pages has {n}")
        a = a.astype(np.int64)
        if n and (int(a.min()) < 0 or int(a.max()) >= self.layout.num_pages):
            bad = int(a[(a < 0) | (a >= self.layout.num_pages)][0])
            raise PlanError(f"src page {bad} is outside the layout's {self.layout.num_pages} pages")
        return a

    def _make_template(self, pg: PeerGroup) -> list:
        """The planner's writes for source page 0 -> destination page 0, per rank pair and
        region pair: ``(s, d, src region, dst region, so, do, ln, layer)``."""
        p1 = _plan(self.layout, self.sharding, pg.layout, pg.sharding, [0], [0])
        out = []
        for s, d in p1.pairs:
            if d not in pg.remote:
                continue
            w = p1.writes(s, d)
            pairs = w.src_region.astype(np.int64) * (1 << 32) + w.dst_region
            for key in dict.fromkeys(pairs.tolist()):
                sel = pairs == key
                out.append((s, d, key >> 32, key & 0xFFFFFFFF, w.src_offset[sel], w.dst_offset[sel], w.length[sel],
                            w.layer[sel]))
        return out

    def _finish(self, s: Send, context: Any) -> Send:
        req = s.request
        pg = req.peer
        slots = pg.handshake.context_slots
        data: Optional[memoryview] = None
        if context is not None:
            try:
                data = memoryview(context).cast("B") if not isinstance(context, (bytes, bytearray)) else memoryview(context)
            except (TypeError, ValueError):
                raise InvalidArgumentError("context must be bytes or a C-contiguous buffer") from None
            if data.nbytes and not slots:
                raise InvalidArgumentError("the decoder has no context slots; finish() takes no context")
            if data.nbytes > pg.handshake.context_bytes:
                raise InvalidArgumentError(f"context of {data.nbytes} bytes exceeds the decoder's "
                                           f"{pg.handshake.context_bytes}-byte slots")
        if s._stream is not None:
            return self._finish_stream(s, data)
        with s._lock:
            if s._finished:
                if s._abort_req or s._state in _FINAL:
                    return s
                raise InvalidArgumentError("finish() was already called")
            s._finished = True
            if slots:
                try:
                    s._transfers.append(self._post_context(s, data))
                except KvxferError as exc:
                    s.error = exc
                    s._abort_req = True
                    s._abort_flags = C.ABORTED_BY_PREFILLER
                    s._reply = True
                    for t in s._transfers:
                        t.cancel()
        self._queue_reap(s)
        return s

    def _finish_stream(self, s: Send, data: Optional[memoryview]) -> Send:
        err = None
        with s._lock:
            st = s._stream
            if st.context is not None or s._abort_req or s._state in _FINAL:
                if s._abort_req or s._state in _FINAL:
                    return s
                raise InvalidArgumentError("finish() was already called")
            st.context = (None if data is None else bytes(data),)
            if st.end is not None:
                try:
                    self._arm_context(s)
                except KvxferError as exc:
                    err = exc
        if err is not None:
            s.error = err
            self._abort_send(s, by_prefiller=True)
            return s
        self._maybe_done_posting(s)
        return s

    def _post_context(self, s: Send, data: Optional[memoryview]) -> Any:
        pg = s.request.peer
        stride = context_stride(pg.handshake.context_bytes)
        mr, arr, idx = self._staging_slot(stride)
        s._staging = (stride, (mr, arr, idx))
        n = 0 if data is None else data.nbytes
        base = idx * stride
        arr[base:base + 8].view("<u8")[0] = n
        if n:
            arr[base + 8:base + 8 + n] = np.frombuffer(data, np.uint8)
        dst = s.request.slot * stride
        pairs = pg._ctx_pairs.get(id(mr))
        if pairs is None:
            pairs = pg._ctx_pairs[id(mr)] = self.engine.region_pairs(pg.peer, [(mr, pg.context_region)])
        # one message, on the rail of this node's first rank when placements pin it
        return self.engine.write_pairs(pairs, np.array([base], np.uint64), np.array([dst], np.uint64),
                                       np.array([8 + n], np.uint64), _ONE, imm=s.request.imm,
                                       rail=self._rails.get(self.ranks[0]))

    def _staging_slot(self, stride: int) -> tuple:
        with self._lock:
            free = self._staging.setdefault(stride, [])
            if not free:
                arr = np.zeros(_STAGING_SLOTS * stride, np.uint8)
                mr = self.engine.register(arr, remote=False)
                self._staging_mrs.append(mr)
                free.extend((mr, arr, i) for i in range(_STAGING_SLOTS))
            return free.pop()

    def _abort_send(self, s: Send, *, by_prefiller: bool) -> None:
        with s._lock:
            if s._state in _FINAL or s._abort_req:
                return
            s._abort_req = True
            s._reply = True
            if by_prefiller:
                s._abort_flags |= C.ABORTED_BY_PREFILLER
            if s._stream is not None:
                s._posting_done = True        # entries disarm (or stop posting) below
            if not s._posting_done:
                return                        # send() sees the flag when it stops posting
            for t in s._transfers:
                t.cancel()
            s._finished = True
        self._queue_reap(s)

    def _queue_reap(self, s: Send) -> None:
        with self._reap_cv:
            self._reap[s] = None
            self._reap_cv.notify()

    def _finalize_send(self, s: Send) -> bool:
        """Every transfer of ``s`` is final: settle its state, answer the decoder if asked.
        False (nothing done) if a transfer was added meanwhile and is still running."""
        req = s.request
        pg = req.peer
        with s._lock:
            if s._state in _FINAL:
                return True
            if not all(t.done for t in s._transfers):     # finish() appended one since the check
                return False
            err = s.error or next((t.error for t in s._transfers if t.error is not None), None)
            posted = sum(transfer_posted(t) for t in s._transfers)
            if s._stream is not None and not s._abort_req and any(t.state == "disarmed" for t in s._transfers):
                # a write that never posts (its pass was abandoned): the decoder must fence
                s._abort_req = True
                s._reply = True
                s._abort_flags |= C.ABORTED_BY_PREFILLER
            if s._abort_req:
                state = "failed" if s.error is not None else "aborted"
            elif err is not None:
                state = "failed"
                s._reply = True
                s._abort_flags |= C.ABORTED_BY_PREFILLER
            else:
                state = "done"
            reply = s._reply and pg.alive
        # settled first: a decoder told "aborted" (and so done with its fence) never finds
        # this side's Send still transferring
        self._settle_send(s, state, err)
        if reply:
            self._try_send(pg, C.ABORTED, imm=req.imm, count=posted, flags=s._abort_flags, retry=True)
        return True

    def _settle_send(self, s: Send, state: str, err: Optional[BaseException]) -> None:
        req = s.request
        with self._lock:
            if s._state in _FINAL:
                return
            s._state = state
            if err is not None and s.error is None:
                s.error = err
            self._requests.pop((req.peer.uid, req.imm), None)
            cbs, s._callbacks = s._callbacks, []
            self._count("send_" + state)
            if s._staging is not None:
                stride, slot = s._staging
                self._staging.setdefault(stride, []).append(slot)
        s._event.set()
        for fn in cbs:
            self._dispatch(fn, s)

    # -- threads --------------------------------------------------------------------------
    def _dispatch(self, fn: Callable, arg: Any) -> None:
        self._cbq.put((fn, arg))

    def _dispatcher(self) -> None:
        while True:
            item = self._cbq.get()
            if item is None:
                return
            fn, arg = item
            try:
                fn(arg)
            except Exception:            # a user callback must not kill the dispatcher
                with self._lock:
                    self._count("callback_errors")
                traceback.print_exc()

    def _reaper(self) -> None:
        while not self._stop.is_set():
            with self._reap_cv:
                while not self._reap and not self._stop.is_set():
                    self._reap_cv.wait(0.5)
                batch = list(self._reap)
            if not batch:
                continue
            settled = []
            for s in batch:
                if all(t.done for t in reversed(s._transfers)):   # the last finishes last
                    if self._finalize_send(s):
                        settled.append(s)
                elif s._state in _FINAL:
                    settled.append(s)
            if settled:
                with self._reap_cv:
                    for s in settled:
                        self._reap.pop(s, None)
                continue
            pending = next((t for s in batch for t in s._transfers if not t.done), None)
            if pending is not None:
                try:
                    pending.wait(0.05)       # GIL-free native wait
                except KvxferError:
                    pass

    def _run(self) -> None:
        next_tick = 0.0
        while not self._stop.is_set():
            lc = self._counter
            skips = lc is not None and bool(lc._skips)
            if skips:
                try:
                    lc._apply_skips()          # a kernel bumped to an abandoned pass's base
                except KvxferError:
                    pass
            slice_s = 0.001 if skips else 0.002 if self._fencing else min(0.05, self.peer_timeout / 8)
            try:
                data = self.engine.recv(slice_s)
            except TimeoutError:
                data = None
            except ClosedError:
                return
            except KvxferError:
                data = None
            n = 0
            while data is not None:
                try:
                    self._handle(data)
                except Exception:            # never let a message kill the messenger thread
                    with self._lock:
                        self._count("drop_internal_error")
                    traceback.print_exc()
                n += 1
                if n >= 256:
                    break
                try:
                    data = self.engine.recv(0)
                except KvxferError:
                    data = None
            now = time.monotonic()
            if self._fencing or now >= next_tick:
                try:
                    self._tick(now)
                except Exception:
                    traceback.print_exc()
                if now >= next_tick:
                    next_tick = now + min(0.05, self.peer_timeout / 8)

    def _tick(self, now: float) -> None:
        with self._lock:
            expired = [r for r in self._receives.values()
                       if r._deadline is not None and now >= r._deadline and r._state not in _FINAL and not r._aborting]
            for r in expired:
                r._aborting = True
                r.error = TimeoutError(f"request {r.request_id!r} not done within its timeout")
            fencing = list(self._fencing)
            peers = list(self._peers.values())
        for r in expired:
            if r.peer.alive:
                if not r._abort_sent:
                    r._abort_sent = True
                    self._try_send(r.peer, C.ABORT, imm=r.imm, retry=True)   # resent until it goes
            else:
                # nobody can answer an ABORT: fail it now, fenced once the peer is torn down
                # (else the teardown in progress retires it)
                self._finish_receive(r, "failed", fenced=r.peer._torn_down)
        for r in fencing:
            self._check_fence(r, now)
        for pg in peers:
            if pg.state == "dead":
                continue
            if pg._resend:
                self._resend_pending(pg, now)
                if pg.state == "dead":
                    continue
            if now - pg.last_heard > self.peer_timeout and pg.state == "up":
                self._peer_gone(pg, PeerError(f"peer {pg.uid:016x} silent for {self.peer_timeout} s: declared dead"),
                                notify=False)
            elif now - pg.last_sent >= pg.heartbeat and pg.state == "up":
                self._try_send(pg, C.HEARTBEAT)

    def _check_fence(self, r: Receive, now: Optional[float] = None) -> None:
        target = r._fence_target or 0
        c = r._fence_counter or r._counter
        got = c.arrived if c is not None else 0
        if c is not None and c.done:
            got = max(got, c.count)
        if got >= target:
            r._fence_ok = True
            state = "failed" if r.error is not None else "aborted"
            self._finish_receive(r, state, fenced=True)
        elif now is not None and now - r._fence_since > self.peer_timeout and r.peer.alive:
            # writes the peer says it posted have not landed in peer_timeout: they never will
            # (or land whenever they like); only a teardown makes the pages safe to reuse
            self._broke_protocol(r.peer, f"{target - got} of the {target} writes it reported posted for request "
                                         f"{r.request_id!r} did not land within {self.peer_timeout} s")

    def _broke_protocol(self, pg: PeerGroup, why: str) -> None:
        """A peer whose counts cannot be believed: torn down (its requests fail with
        ``PeerError``, fenced: after the teardown nothing of it lands), so no page stays
        quarantined for as long as it keeps sending heartbeats."""
        self._count("peers_broke_protocol")
        self._peer_gone(pg, PeerError(f"peer {pg.uid:016x} broke the protocol ({why}): torn down"), notify=True)

    def _peer_gone(self, pg: PeerGroup, err: KvxferError, *, notify: bool) -> None:
        """``pg`` died (silence), left (BYE) or we close: fail everything with it, both roles."""
        with self._lock:
            if pg.state == "dead":
                return
            pg.state = "dead"
            pg.error = err
            pg._resend.clear()
            self._dead.add(pg.uid)
            reqs = [q for (u, _), q in self._requests.items() if u == pg.uid]
            self._count("peers_dead")
        pg.acked.set()
        for q in reqs:
            s = q.send
            if s is None:
                q.aborted = True
                with self._lock:
                    self._requests.pop((pg.uid, q.imm), None)
                continue
            with s._lock:
                s._abort_req = True
                s._finished = True
                for t in s._transfers:
                    t.cancel()
            self._settle_send(s, "failed", err)     # source pages are released now
        if notify:
            self._try_send(pg, C.BYE)
        # tear the connection down: on tcp no byte of this peer is read (so lands) after it
        self._forget_peer(pg)
        with self._lock:
            pg._torn_down = True
            # collected after the teardown: every Receive of pg not yet retired, also one a
            # timeout failed meanwhile (unfenced: retired now)
            recvs = [r for r in self._receives.values() if r.peer is pg]
        for r in recvs:
            self._finish_receive(r, "failed", err, fenced=True)
        with self._inbox_cv:
            self._inbox_cv.notify_all()

    # -- incoming -------------------------------------------------------------------------
    def _drop(self, reason: str) -> None:
        with self._lock:
            self._count("drop_" + reason)

    def _handle(self, data: bytes) -> None:
        try:
            m = C.Control.decode(data, self.secret)
        except DescriptorError as exc:
            self._drop("unauthenticated" if "authentication" in str(exc) else "malformed")
            return
        if m.dst != self.uid:
            self._drop("wrong_destination")
            return
        with self._lock:
            self._count("recv_" + C.MSG_TYPES[m.type])
            pg = self._peers.get(m.src)
        if m.type == C.HELLO:
            self._on_hello(m, pg)
            return
        if pg is None:
            self._drop("dead_peer" if m.src in self._dead else "unknown_peer")
            return
        if pg.state == "dead":
            self._drop("dead_peer")
            return
        if m.seq <= pg.recv_seq:
            self._drop("replayed")
            return
        pg.recv_seq = m.seq
        pg.last_heard = time.monotonic()
        t = m.type
        if t == C.HELLO_ACK:
            pg.state = "up"
            pg.acked.set()
        elif t == C.HEARTBEAT:
            pass
        elif t == C.REQUEST:
            self._on_request_msg(pg, m)
        elif t == C.ANNOUNCE:
            self._on_announce(pg, m)
        elif t == C.ABORT:
            self._on_abort(pg, m)
        elif t == C.ABORTED:
            self._on_aborted(pg, m)
        elif t == C.REJECT:
            r = self._receive_of(pg, m.imm)
            if r is not None:    # fenced only if nothing was announced or fenced: else writes may land
                self._finish_receive(r, "failed", InvalidArgumentError(f"the prefiller rejected the request: {m.reason}"),
                                     fenced=r._announced is None and r._fence_target is None and not r.done)
        elif t == C.BYE:
            self._peer_gone(pg, PeerError(f"peer {pg.uid:016x} closed"), notify=False)

    def _on_hello(self, m: C.Control, pg: Optional[PeerGroup]) -> None:
        if pg is not None and pg.state == "dead":
            self._drop("dead_peer")          # its engine Peer is disconnected: never "up" again
            return
        if pg is None:
            if m.src in self._dead:
                self._drop("dead_peer")
                return
            try:
                hs = C.safe_decode_handshake(m.blob, self.secret)
                if hs.uid != m.src:
                    raise DescriptorError("HELLO's sender is not the handshake's")
                pg = self._make_group(hs)
            except KvxferError:
                self._drop("bad_handshake")
                return
        elif m.seq <= pg.recv_seq:
            self._drop("replayed")
            return
        pg.recv_seq = m.seq
        pg.last_heard = time.monotonic()
        pg.state = "up"
        pg.acked.set()
        self._try_send(pg, C.HELLO_ACK, retry=True)

    def _receive_of(self, pg: PeerGroup, imm: int) -> Optional[Receive]:
        with self._lock:
            r = self._receives.get(imm)
        if r is None or r.peer is not pg:
            self._drop("unknown_request")
            return None
        return r

    def _most_writes(self, r: Receive) -> int:
        """More messages than any request of ``r``'s pages can take (each carries >= 1 byte)."""
        g = self._geometry
        return len(self.ranks) * len(r.dst_pages) * g.num_layers * g.planes * g.page_stride + 1

    def _on_request_msg(self, pg: PeerGroup, m: C.Control) -> None:
        hs = pg.handshake
        reason = None
        pages = m.pages
        if len(pages) == 0:
            reason = "no pages"
        elif int(pages.max()) >= hs.layout.num_pages:
            reason = f"page {int(pages.max())} is outside the decoder's {hs.layout.num_pages} pages"
        elif len(pages) > 1 and len(np.unique(pages)) != len(pages):
            reason = "a destination page is named twice"
        elif not 0 < m.num_tokens <= len(pages) * hs.layout.page_size:
            reason = f"num_tokens {m.num_tokens} does not fit {len(pages)} pages"
        elif (hs.context_slots and not 0 <= m.slot < hs.context_slots) or (not hs.context_slots and m.slot != -1):
            reason = f"context slot {m.slot} does not exist"
        elif not 0 < m.imm < 2**32:
            reason = "imm 0 is reserved"
        with self._lock:
            if reason is None and (pg.uid, m.imm) in self._requests:
                reason = f"imm {m.imm} is already in flight"
            if reason is None:
                req = Request(self, pg, m)
                self._requests[(pg.uid, m.imm)] = req
                self._count("requests")
        if reason is not None:
            self._drop("bad_request")
            self._try_send(pg, C.REJECT, imm=m.imm, reason=reason, retry=True)
            return
        if self._on_request is not None and self._inline_requests:
            try:                             # on this thread: no hand-off before the writes
                self._on_request(req)
            except Exception:
                with self._lock:
                    self._count("callback_errors")
                traceback.print_exc()
        elif self._on_request is not None:
            self._dispatch(self._on_request, req)
        else:
            with self._inbox_cv:
                self._inbox.append(req)
                self._inbox_cv.notify()

    def _on_announce(self, pg: PeerGroup, m: C.Control) -> None:
        r = self._receive_of(pg, m.imm)
        if r is None:
            return
        with self._lock:
            if r._announced is not None:
                self._drop("duplicate_announce")
                return
            if r._fence_target is not None or r._state in _FINAL:
                # after the ABORTED (the fence counts what it says was posted): an expectation
                # now would collide with the fence's and leave the pages quarantined
                self._drop("late_announce")
                return
            least = 2 if self.context_slots else 1    # a page, and the context
            most = self._most_writes(r)
            bad = not least <= m.count <= most
            if bad:
                self._count("drop_bad_count")
            else:
                r._announced = m.count
            if r._state == "pending":
                r._state = "transferring"
        if bad:     # writes may still land, none counted: only a teardown frees the pages
            self._broke_protocol(pg, f"it announced {m.count} writes for request {r.request_id!r}, not "
                                     f"{least} to {most}")
            return
        try:
            # everything already landed (small requests: the data overtakes the ANNOUNCE): no
            # callback, so the engine's dispatcher thread is not woken for nothing. Banked
            # arrivals only grow (nothing but this messenger discards the imm), so the
            # expectation completes at once.
            landed = self.engine.banked(r.imm) >= m.count
            c = self.engine.expect(r.imm, int(m.count),
                                   callback=None if landed else (lambda _c, r=r: self._on_counter(r)))
        except KvxferError as exc:
            self._finish_receive(r, "failed", exc, fenced=False)
            return
        r._counter = c
        r._armed.set()                     # a caller in Receive.wait now waits on c natively
        if c.done:                         # everything had landed already: no thread hop
            self._on_counter(r)

    def _on_abort(self, pg: PeerGroup, m: C.Control) -> None:
        # the reply is decided under the lock that send()/stream() take to attach a Send:
        # either the Send exists now (it answers ABORTED when final) or a later send() sees
        # ``aborted`` and posts nothing, and this answers ABORTED(0) (never neither)
        send: Optional[Send] = None
        with self._lock:
            req = self._requests.get((pg.uid, m.imm))
            if req is not None:
                send = req.send
                if send is None:
                    req.aborted = True
                    self._requests.pop((pg.uid, m.imm), None)
                    try:
                        self._inbox.remove(req)
                    except ValueError:
                        pass
        if req is None:
            self._try_send(pg, C.ABORTED, imm=m.imm, count=0, flags=C.ABORTED_UNKNOWN, retry=True)
        elif send is None:
            self._try_send(pg, C.ABORTED, imm=m.imm, count=0, flags=0, retry=True)
        else:
            self._abort_send(send, by_prefiller=False)

    def _on_aborted(self, pg: PeerGroup, m: C.Control) -> None:
        r = self._receive_of(pg, m.imm)
        if r is None:
            return
        if m.flags & C.ABORTED_UNKNOWN:
            target = r._announced or 0        # the prefiller finished and forgot it
        else:
            target = m.count
        with self._lock:
            if r._state in _FINAL:
                return
            if r._fence_target is not None:      # a repeated ABORTED: the first count stands
                self._count("drop_duplicate_aborted")
                return
            most = r._announced if r._announced is not None else self._most_writes(r)
            if target > most:                    # more than it announced, or than can exist
                self._count("drop_bad_count")
                trusted = False
            else:
                trusted = True
                if m.flags & C.ABORTED_BY_PREFILLER and r.error is None:
                    r.error = PeerError(f"the prefiller gave up on request {r.request_id!r}")
                r._fence_target = target
                r._fence_since = time.monotonic()
                if r._counter is None and target > 0:
                    try:
                        r._fence_counter = self.engine.expect(r.imm, target)
                    except KvxferError:
                        pass
                self._fencing.add(r)
        if not trusted:          # no fence can be trusted: only a teardown frees the pages
            self._broke_protocol(pg, f"it reported more writes posted for request {r.request_id!r} than {most}")
            return
        self._check_fence(r)
