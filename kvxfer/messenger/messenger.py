"""The KV messenger: one node's or one rank's end of the request life cycle, its threads and
the routing of control messages to the rooms that own them.

One ``Messenger`` per ``Engine``. It registers the KV regions of the TP ranks it holds (every
rank of a node, or one rank process's own), exchanges handshakes with peers and runs requests
both ways. The rooms, each in its own module: ``peers.Peers`` (handshake, HELLO, heartbeats,
resends, teardown), ``decode.Decoder`` (``Receive`` and its legs, the fence),
``prefill.Prefiller`` (``Request``, ``Send``, posting, the reaper), ``stream.Streamer`` (the
layer counter, ``schedule``, ``Pass``); the pull road's halves are ``pullsend.PullSend`` and
the decode room's mixin ``pullrecv.PullReader``. The messenger wires them together: it routes each
control message, and a peer's death to both roles.

Threads: the messenger thread (``kvxfer-msg``) is the only reader of the engine's control
messages; it also declares silent peers dead, runs request timeouts and fences. The sender
(``kvxfer-msg-send``) is the only thread that waits on the engine for a control message: every
room posts its messages to the peer's outbox (peers.py) and returns. The reaper
(``kvxfer-msg-reap``) settles sends. User callbacks and ``on_request`` run on one dispatcher
thread (``kvxfer-msg-cb``), never on the engine's threads.

See docs/messenger.md for the protocol, the counting rule, the abort fence and what a dead
peer guarantees on each provider.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional


from kvxfer._check import as_timeout, is_int
from kvxfer.errors import (
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    KvxferError,
    PeerError,
    PlanError,
    UnsupportedError,
)
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _args
from kvxfer.messenger import _codec as C
from kvxfer.messenger._node import Node
from kvxfer.messenger.decode import IMM_LIMIT, Decoder, Receive
from kvxfer.messenger.metrics import snapshot as metrics_snapshot
from kvxfer.messenger.paged import RegionTable, register_layout
from kvxfer.messenger.peers import PeerGroup, Peers, context_stride
from kvxfer.messenger.prefill import Prefiller
from kvxfer.messenger.send import Request, Send, context_view
from kvxfer.messenger.stream import LayerCounter, Pass, Streamer

__all__ = ["Messenger", "PeerGroup", "Receive", "Request", "Send", "context_stride", "IMM_LIMIT"]


#: ``send``'s default ``context``: leave the Send open for ``finish``
_OPEN: Any = object()

#: a round of the messenger thread this much past its wait is a stall of this process: the
#: excess is forgiven to every peer's silence (``Peers.forgive``)
_STALL_S = 0.1


def _close_at_exit(ref: "weakref.ref[Messenger]") -> None:
    m = ref()
    if m is not None and not m.closed:
        try:
            m.close(timeout=2.0)
        except Exception:
            pass


def _ranks(kv: Any, ranks: Optional[Iterable[int]], sharding: Sharding) -> tuple[tuple[int, ...], list]:
    """The ranks held and their regions, both in rank order."""
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
        if not is_int(r) or not 0 <= r < sharding.tp_size:
            raise InvalidArgumentError(f"rank {r!r} is not a rank of TP{sharding.tp_size}")
    if not rs or len(set(rs)) != len(rs):
        raise InvalidArgumentError(f"ranks must be distinct and at least one, got {list(rs)}")
    return tuple(int(r) for r in rs), regions


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
        if is_int(p):
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


class Messenger:
    """One node's (or one TP rank process's) end of the KV protocol over ``engine``.

    ``kv`` maps each TP rank this messenger holds to its regions in region-id order (numpy,
    torch, ``KVBuffer`` or ``(ptr, nbytes)``; ``layout.region_sizes(sharding)`` says how
    big), or is a sequence in the order of ``ranks`` (default: every rank of ``sharding``).
    A prefill messenger holding a subset of the ranks (``ranks=[r]`` in rank ``r``'s own
    process) sends its share of every request; a decoder ``receive``s from all the prefill
    rank messengers of one instance at once. ``context_slots`` x ``context_bytes`` is the
    decoder-side space for per-request context data. ``secret`` (bytes, >= 16) authenticates
    handshakes and control messages with HMAC-SHA256; peers must share it.
    ``on_request(request)`` replaces ``requests()``; it runs on the callback thread, or with
    ``inline_requests=True`` on the messenger thread that read the REQUEST (no thread
    hand-off: the lowest latency, but it must not block, since every control message waits
    for it; ``send(...).finish()`` is fine). ``placements`` maps a source rank to its GPU's
    ``Placement`` (``Topology.assign``) or directly to a local rail index: that rank's writes
    go over the engine rail nearest to it (``Engine.nearest_rail``); without one they are
    striped over every rail. Streaming (``layer_counter``, ``stream``, ``schedule``;
    kvxfer/messenger/stream.py): ``counter_device`` puts the layer counter in pinned host
    memory mapped into that CUDA device; ``watch_poll_us``, ``watch_cpus`` and
    ``watch_rt_priority`` tune its native watcher thread (poll interval while writes are
    armed, CPUs to pin to, SCHED_FIFO). ``watch_poll_us`` None (the default): 10 µs with
    ``counter_device`` (a kernel's bumps are seen only by polling), else 0: the watcher never
    polls and each ``LayerCounter.bump()`` wakes it (armed and polling every 10 µs it took
    half a core here). A CPU counter written other than by ``bump()`` (a native kernel
    writing ``LayerCounter.ptr``) needs a poll interval; 0 is refused with ``counter_device``. ``offer_pull``: register the regions readable too and
    put their reads-only descriptors in the handshake, so decoders may ``receive(...,
    pull=True)`` from this messenger (it then exposes a request's pages and holds them until
    the decoder's reads are done: docs/messenger.md, "Push or pull").
    """

    def __init__(self, engine: Any, layout: KVLayout, sharding: Sharding, kv: Any, *,
                 ranks: Optional[Iterable[int]] = None, context_slots: int = 0, context_bytes: int = 0,
                 peer_timeout: float = 10.0, secret: Optional[bytes] = None,
                 on_request: Optional[Callable[[Request], Any]] = None, inline_requests: bool = False,
                 placements: Optional[Mapping[int, Any]] = None, counter_device: Optional[int] = None,
                 watch_poll_us: Optional[float] = None, watch_cpus: Optional[Iterable[int]] = None,
                 watch_rt_priority: int = 0, offer_pull: bool = False) -> None:
        from kvxfer.engine import Engine, check_watch      # here: the codecs import without libfabric

        if not isinstance(engine, Engine):
            raise InvalidArgumentError(f"engine must be a kvxfer Engine, got {type(engine).__name__}")
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(sharding, Sharding):
            raise InvalidArgumentError(f"sharding must be a Sharding, got {type(sharding).__name__}")
        layout.resolve(sharding)                      # LayoutError if they cannot meet
        # the bounds a peer's handshake decoder accepts (kvxfer/messenger/_codec.py)
        slots = _args.bounded_int(context_slots, "context_slots", 0, 2**31 - 1)
        cbytes = _args.bounded_int(context_bytes, "context_bytes", 0, 2**40)
        pt = _args.timeout(peer_timeout, "peer_timeout")
        if not pt or pt >= 1e6:
            raise InvalidArgumentError(f"peer_timeout must be positive and under 1e6 s, got {peer_timeout!r}")
        if on_request is not None:
            _args.callback(on_request, "on_request")
        secret = C._check_secret(secret)
        if slots and cbytes + 8 > engine.max_write:
            raise InvalidArgumentError(f"context_bytes {context_bytes} exceeds one message of this engine")
        if counter_device is not None and (not is_int(counter_device) or counter_device < 0):
            raise InvalidArgumentError(f"counter_device must be a CUDA device ordinal, got {counter_device!r}")
        # Engine.watcher's own check, up front (a CUDA-mapped counter is only seen by polling)
        if watch_poll_us is None:
            watch_poll_us = 10.0 if counter_device is not None else 0.0
        check_watch(watch_poll_us, watch_rt_priority, "watch_", polled=counter_device is not None)
        if not isinstance(offer_pull, bool):
            raise InvalidArgumentError(f"offer_pull must be a bool, got {offer_pull!r}")
        poll_us, rt = float(watch_poll_us), int(watch_rt_priority)
        cpus = _args.cpus(watch_cpus)
        self.secret = secret
        self.engine = engine
        self.layout = layout
        self.sharding = sharding
        self.peer_timeout = float(pt)
        self.context_slots = slots
        self.context_bytes = cbytes
        self.ranks, regions = _ranks(kv, ranks, sharding)
        rails = _rails_of(engine, placements, self.ranks)
        self.uid = int.from_bytes(os.urandom(8), "little") | 1
        node = self._node = Node(engine, self.uid, secret, self.peer_timeout)
        self._lock = node.lock
        self.counts = node.counts
        self._local: dict[int, RegionTable] = {}
        self._ctx_mr = None
        self._peers_room = Peers(node, layout, sharding, slots, cbytes, lambda: self._blob, self._peer_gone)
        dec = self._decode = Decoder(node, self._peers_room, layout, sharding, self.ranks, slots, cbytes)
        self._peers_room.on_up, self._peers_room.on_failed = dec.peer_up, dec.connect_failed
        self._peers_room.on_dead = dec.drop_arms
        try:
            if dec.native:
                try:
                    engine.announce_key(secret)        # the legs' arms check the ANNOUNCEs' tags
                except InvalidArgumentError:           # a secret longer than the engine keeps
                    dec.native = False
            for r, objs in zip(self.ranks, regions):
                self._local[r] = register_layout(engine, layout, sharding, objs, readable=offer_pull)
            self._ctx_mr = engine.register(dec.ctx_array) if slots else None
            self._hs = C.Handshake(
                uid=self.uid, address=engine.address, layout=layout, sharding=sharding, ranks=self.ranks,
                provider=engine.provider, iov=int(engine.iov), max_write=int(engine.max_write),
                pack_min=int(engine.pack_min), rails=int(engine.rails), context_slots=slots,
                context_bytes=cbytes, peer_timeout=self.peer_timeout,
                regions=tuple(tuple(self._local[r].descriptors()) for r in self.ranks),
                context=self._ctx_mr.descriptor() if self._ctx_mr is not None else None,
                read_regions=tuple(tuple(mr.descriptor(reads_only=True) for mr in self._local[r].regions)
                                   for r in self.ranks) if offer_pull else (),
            )
            self._blob = self._hs.encode(secret)
            if len(self._blob) > C.MAX_MESSAGE - 64:
                raise UnsupportedError(f"handshake of {len(self._blob)} bytes does not fit one control message "
                                       "(fewer regions per rank, e.g. a layer-major layout, make it smaller)")
        except BaseException:
            for lr in self._local.values():
                lr.close()
            if self._ctx_mr is not None:
                self._ctx_mr.close()
            raise
        self._prefill = Prefiller(node, self._peers_room, layout, sharding, self.ranks, self._local, rails,
                                  on_request, bool(inline_requests), offer_pull)
        dec.local, dec.reap = self._local, self._prefill.queue_reap
        self._streamer = Streamer(node, self._prefill, layout.num_layers, layout.page_size, layout.num_pages,
                                  counter_device, poll_us, cpus, rt)
        # the rooms' tables under the names the stress tests read
        self._peers = self._peers_room.table
        self._receives, self._rids, self._fencing = dec.receives, dec.rids, dec.fencing
        self._busy_pages, self._free_slots = dec.busy_pages, dec.free_slots
        self._requests, self._inbox, self._reap = self._prefill.requests, self._prefill.inbox, self._prefill.reap
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="kvxfer-msg", daemon=True),
            threading.Thread(target=self._peers_room.run_sender, args=(self._stop,), name="kvxfer-msg-send",
                             daemon=True),
            threading.Thread(target=self._prefill.run_reaper, name="kvxfer-msg-reap", daemon=True),
            threading.Thread(target=node.run_dispatcher, name="kvxfer-msg-cb", daemon=True),
        ]
        for t in self._threads:
            t.start()
        # an unclosed messenger's threads must not call into an engine that interpreter
        # shutdown is finalising: close it first (weakly: atexit must not keep it alive)
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- life cycle ---------------------------------------------------------------------
    def handshake(self) -> bytes:
        """This messenger's versioned blob (address, region descriptors, layout, sharding,
        ranks, engine parameters, context slots; HMAC-tagged with a secret). Give it to peers."""
        return self._blob

    @property
    def closed(self) -> bool:
        return self._node.closed

    @property
    def peers(self) -> list[PeerGroup]:
        return self._peers_room.live()

    @property
    def _watcher(self) -> Any:
        return self._streamer.watcher

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is in flight (``ClosedError``), tell peers (BYE), stop the threads and
        deregister. The engine stays open (the caller owns it)."""
        if _args.timeout(timeout) is None:      # checked before anything closes
            raise InvalidArgumentError(f"close timeout must be a finite number of seconds, got {timeout!r}")
        node = self._node
        with node.lock:
            if node.closed:
                return
            node.closed = True
        err = ClosedError("messenger closed")
        # the pull road: our reads stop and drain before any BYE lets a prefiller free its pages
        self._decode.stop_pulls(err, min(2.0, timeout))
        for pg in self._peers_room.all():
            if pg.alive:
                self._peer_gone(pg, err, notify=True)
        self._stop.set()
        self._peers_room.wake()
        self._prefill.stop_reaper()
        self._prefill.wake()
        node.stop_dispatcher()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        # nothing is left pending: a Receive of a peer that died meanwhile fails too (fenced
        # once that peer was torn down)
        self._decode.close(err)
        self._streamer.close(deadline - time.monotonic())
        if self.engine.closed:
            return
        regions = [mr for lr in self._local.values() for mr in lr.regions] + self._prefill.staging_mrs
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
        """Counters: messages received (``recv_*``: accepted ones, not drops) and sent by type,
        drops by reason (``drop_*``), requests."""
        with self._node.lock:
            return dict(self._node.counts)

    def metrics(self) -> dict[str, Any]:
        """Counters and histograms as plain data (dicts of ints; histograms as ``count``,
        ``sum`` and cumulative ``buckets`` of seconds): requests by outcome, bytes, transfer
        times, fences and their wait, peers up / left (a clean BYE) / dead / closed, control
        messages dropped by reason (kvxfer/messenger/metrics.py says what each is). Any
        thread; ``kvxfer.messenger.metrics.serve_prometheus([m], port)`` exports them."""
        with self._node.lock:
            counts = dict(self._node.counts)
        return metrics_snapshot(counts, self._node.hist)

    def poll(self, timeout: float = 0.0) -> list[Receive | Send]:
        """The ``Receive``s and ``Send``s that became final (done, failed or aborted) since the
        last call, in the order they did, and the ``Receive``s whose pages became safe to
        reuse (``fenced`` turned True, at ``t_fenced``). A Receive final and fenced by then
        appears once; one final before its fence appears again once fenced (read ``fenced``
        to tell). Takes no lock the messenger's threads hold for long, runs no callback: the
        call for an engine's scheduler loop (vLLM's ``get_finished``, SGLang's ``poll``).
        With nothing to report it returns at once, or with ``timeout`` (seconds) waits up to
        that long for the first report (an idle engine step that would otherwise spin: the
        wait ends the moment one comes). The first call turns reporting on and returns
        ``[]`` at once (call it once at start-up): a messenger never polled keeps nothing.
        Any thread may call it; two threads polling at once each get a part."""
        wait = 0.0 if type(timeout) is float and timeout == 0.0 else as_timeout(timeout, "timeout", forever=False)
        node = self._node
        if not node.polling:
            node.polling = True
            return []
        q = node.events
        if wait and not q:
            node.reported.clear()
            if not q:                    # a report between the test and the clear is in q
                node.reported.wait(wait)
        out = []
        for _ in range(len(q)):          # bounded: what is there now; later ones wait
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return list(dict.fromkeys(out))

    def _check_open(self) -> None:
        if self._node.closed:
            raise ClosedError("messenger is closed")

    def _send(self, pg: PeerGroup, t: int, timeout: Optional[float] = 5.0, **fields: Any) -> None:
        """One control message to ``pg`` now, from this thread, past the outbox (the tests'
        door for crafted messages)."""
        self._peers_room.send(pg, t, timeout, **fields)

    # -- the public calls -------------------------------------------------------------------
    def connect(self, blob: bytes, timeout: Optional[float] = None, *, wait: bool = True) -> PeerGroup:
        """Connect to the messenger whose ``handshake()`` this is: check versions, layouts,
        shardings and engine parameters up front, exchange HELLOs, and return its group once
        it answered (``PeerError`` after ``timeout``, default ``peer_timeout``). Each rank
        process of a per-rank prefill instance is connected on its own.

        ``wait=False``: the checks and the HELLO only (no round trip), the group returned at
        once in ``state`` ``"connecting"``; it turns ``"up"``, or ``"failed"`` with ``error``
        after ``timeout`` (the messenger thread decides). ``receive()`` on a connecting group
        queues its REQUEST, sent once every peer of the request is up; if the connect fails
        the Receive fails with the connect's error (fenced: nothing was sent)."""
        self._check_open()
        timeout = self.peer_timeout if timeout is None else _args.timeout(timeout)
        return self._peers_room.connect(blob, timeout, bool(wait))

    def drop_peer(self, peer: PeerGroup, error: Optional[KvxferError] = None) -> None:
        """Declare ``peer`` dead now, as ``peer_timeout`` of silence would: its requests fail on
        both roles with ``error`` (a ``PeerError`` naming the peer by default), it is told BYE
        and disconnected, and its receives are fenced by that teardown. For a failure signal
        the messenger cannot see itself, such as a rendezvous lease that expired
        (kvxfer.rendezvous). Idempotent (a dead group stays as it died); any thread."""
        self._check_open()
        if not isinstance(peer, PeerGroup) or peer.owner is not self._peers_room:
            raise InvalidArgumentError(f"drop_peer takes one of this messenger's peer groups, got {peer!r}")
        if error is None:
            error = PeerError(f"peer {peer.uid:016x} dropped")
        elif not isinstance(error, KvxferError):
            raise InvalidArgumentError(f"drop_peer's error must be a kvxfer error, got {error!r}")
        if peer.alive:
            self._peers_room.gone(peer, error, notify=True)

    def receive(self, peer: PeerGroup | Sequence[PeerGroup], request_id: Any, dst_pages: Any, num_tokens: int, *,
                timeout: Optional[float] = None, hot: bool = False, first_token: int = 0,
                meta: bytes = b"", pull: bool = False) -> Receive:
        """Ask a prefill instance for ``request_id``'s KV into ``dst_pages`` (indices of this
        messenger's layout, on every rank it holds). ``peer``: the instance's one PeerGroup
        (a node) or a sequence of them (one per prefill rank process) that together hold
        every source rank this request needs (else ``LayoutError``; groups of different
        layouts or shardings, or holding a rank twice, are refused; nothing is sent). Returns
        at once; the ``Receive`` is done once every peer's announced writes and the context
        landed. With ``timeout``, a request not done by then is aborted (with the fence) and
        fails with ``TimeoutError``. ``hot``: keep the engine's progress threads polling until
        the request is final (``Engine.hold_awake``), so each streamed layer lands without a
        sleeping thread's wake-up (costs CPU meanwhile).

        ``num_tokens`` is checked here and again by the prefiller: ``dst_pages`` hold at least
        the pages tokens ``[first_token, num_tokens)`` need (``InvalidArgumentError``). A partial
        last page is copied whole (the source's bytes past ``num_tokens`` travel) unless the
        token path runs (page sizes differ, or ``first_token``). ``first_token``: a local
        prefix-cache hit; the decoder holds tokens ``[0, first_token)`` and ``dst_pages``
        start with the page holding ``first_token`` (page-aligned or not); the prefiller
        writes only tokens ``[first_token, num_tokens)`` (kvxfer/messenger/prefix.py).
        ``meta``: up to ``MAX_META`` (256) bytes of the engine's own that reach the
        prefiller as ``Request.meta``.

        ``pull=True``: the pull road. Each prefill peer exposes the request's pages once its
        engine ``send``s it, and this messenger reads them itself with the same plan a push
        writes; the Receive is done once every read of every peer completed (and the context
        landed), fenced once none is in flight, and each peer is then told DONE (its pages go
        free). Every peer must offer pull (``Messenger(offer_pull=True)``), else
        ``UnsupportedError`` and nothing is sent. Same states, ``abort``, ``poll()``."""
        self._check_open()
        return self._decode.receive(peer, request_id, dst_pages, num_tokens, timeout, hot, first_token, meta, pull)

    def requests(self, timeout: Optional[float] = None) -> list[Request]:
        """Requests received and not yet handed out; waits up to ``timeout`` s for the first
        (None: forever), returns [] if none came."""
        return self._prefill.take(_args.timeout(timeout))

    def send(self, request: Request, src_pages: Any = None, *, context: Any = _OPEN, chunked: bool = False) -> Send:
        """Post every layer of ``request`` from the ranks this messenger holds:
        ``src_pages[i]`` of this layout becomes ``request.dst_pages[i]`` at the decoder.
        Returns a ``Send``; call ``finish(context)`` after it, or pass ``context=`` (bytes,
        a buffer, or None for none) to send and finish in one call. Raises before anything is
        posted on bad pages (``PlanError``) or a request that was already sent; a request the
        decoder aborted meanwhile gives a Send that is already ``"aborted"``.

        ``chunked=True`` (without ``src_pages``) posts nothing yet: chunked prefill,
        ``Send.add(src_pages so far, end_token)`` after each chunk is computed, the last one
        (``end_token == num_tokens``) announcing the total, then ``finish``."""
        self._check_open()
        if chunked and (src_pages is not None or context is not _OPEN):
            raise InvalidArgumentError("send(request, chunked=True) takes no src_pages or context: add() and "
                                       "finish() give them")
        if not chunked and src_pages is None:
            raise PlanError("src_pages must be the request's source pages (chunked prefill: chunked=True)")
        if context is not _OPEN and isinstance(request, Request):
            context_view(request.peer, context)        # refused before anything is posted
        s = self._prefill.send(request, src_pages)
        if context is not _OPEN:
            s.finish(context)
        return s

    @property
    def layer_counter(self) -> LayerCounter:
        """The counter the model bumps once per layer (made, with its native watcher thread,
        on first use; device-visible with ``counter_device``). One per messenger: in a
        per-rank process the rank's own model bumps it."""
        return self._streamer.counter()

    def stream(self, request: Request, src_pages: Any = None) -> Send:
        """A Send whose writes ``schedule`` posts layer by layer as the model computes them.
        ``src_pages``: the request's source pages, all or a prefix (a chunk may extend them).
        Call ``finish(context)`` any time; the context is written after the last layer."""
        self._check_open()
        return self._streamer.stream(request, src_pages)

    def schedule(self, chunks: Iterable[Any]) -> Pass:
        """Before a forward pass: the request chunks it computes, as ``(send, start_token,
        end_token)`` or ``(send, start_token, end_token, src_pages)`` (the request's source
        pages so far, a prefix that grows). Arms, for every layer ``l``, the writes of the
        pages each chunk completes, to be posted by the watcher when the layer counter
        reaches ``pass.base + l + 1``. A chunk ending at ``num_tokens`` is the request's last:
        its count is announced now. Chunks of Sends already aborted are skipped. Everything
        is checked before anything is armed."""
        self._check_open()
        return self._streamer.schedule(chunks)

    # -- wiring ---------------------------------------------------------------------------
    def _peer_gone(self, pg: PeerGroup, err: KvxferError, notify: bool) -> None:
        """``pg`` died (silence), left (BYE), broke the protocol or we close: fail everything
        with it, both roles; its receives once its connection is torn down."""
        if not self._peers_room.mark_dead(pg, err):
            return
        self._prefill.peer_gone(pg, err)          # source pages are released now
        self._peers_room.teardown(pg, notify)
        self._decode.peer_gone(pg, err)
        self._prefill.wake()

    def _run(self) -> None:
        """The messenger thread: read control messages, route them, tick."""
        next_tick = 0.0
        eng, st, dec = self.engine, self._streamer, self._decode
        hist = self._node.hist
        last = time.monotonic()
        while not self._stop.is_set():
            skips = st.skipping
            if skips:
                st.tick()                  # a kernel bumped to an abandoned pass's base
            slice_s = 0.001 if skips else 0.002 if dec.busy else min(0.05, self.peer_timeout / 8)
            try:
                data = eng.recv(slice_s)
            except ClosedError:
                return
            except KvxferError:            # TimeoutError too
                data = None
            n = 0
            while data is not None:
                try:
                    self._handle(data)
                except Exception:            # never let a message kill the messenger thread
                    self._node.count("drop_internal_error")
                    traceback.print_exc()
                n += 1
                if n >= 256:
                    break
                try:
                    data = eng.recv(0)
                except KvxferError:
                    data = None
            now = time.monotonic()
            gap, last = now - last, now
            hist.observe("loop_gap", gap)        # one round: its wait, its messages, any starvation
            if gap - slice_s > _STALL_S:         # this thread did not listen: no peer was silent then
                self._peers_room.forgive(gap - slice_s, now)
            if dec.busy or now >= next_tick:
                try:
                    dec.tick(now)
                    self._peers_room.tick(now)
                except Exception:
                    traceback.print_exc()
                if now >= next_tick:
                    next_tick = now + min(0.05, self.peer_timeout / 8)

    def _handle(self, data: bytes) -> None:
        """Route one control message to its room. ``recv_<TYPE>`` counts the accepted ones;
        a message dropped (unauthenticated, for another uid, of an unknown or dead peer, a
        replay) counts only its ``drop_<reason>``."""
        node = self._node
        try:
            m = C.Control.decode(data, self.secret)
        except DescriptorError as exc:
            node.count("drop_unauthenticated" if "authentication" in str(exc) else "drop_malformed")
            return
        if m.dst != self.uid:
            node.count("drop_wrong_destination")
            return
        peers = self._peers_room
        pg = peers.get(m.src)
        if m.type == C.HELLO:
            peers.on_hello(m, pg)
            return
        if pg is None:
            node.count("drop_dead_peer" if m.src in peers.dead else "drop_unknown_peer")
            return
        if pg.state == "dead":
            node.count("drop_dead_peer")
            return
        if not peers.accept(pg, m):
            return
        t = m.type
        node.count("recv_" + C.MSG_TYPES[t])
        if t == C.HELLO_ACK:
            peers.on_hello_ack(pg)
        elif t == C.HEARTBEAT:
            pass
        elif t == C.REQUEST:
            self._prefill.on_request_msg(pg, m)
        elif t == C.ANNOUNCE:
            self._decode.on_announce(pg, m)
        elif t == C.ABORT:
            self._prefill.on_abort(pg, m)
        elif t == C.ABORTED:
            self._decode.on_aborted(pg, m)
        elif t == C.REJECT:
            self._decode.on_reject(pg, m)
        elif t == C.EXPOSE:
            self._decode.on_expose(pg, m)
        elif t == C.DONE:
            self._prefill.on_done(pg, m)
        elif t == C.BYE:
            pg.left = True
            peers.gone(pg, PeerError(f"peer {pg.uid:016x} closed"), notify=False)
