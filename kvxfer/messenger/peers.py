"""The peers of one messenger: handshakes, HELLO, the outbox of control messages and the
sender thread that drains it, heartbeats, silence, and the teardown of a peer that died or left.

``Peers`` is the table (uid -> ``PeerGroup``), the dead set and the seq counters kept for a
retried connect; ``instance`` checks which groups form one prefill instance (per-rank). It
never decides what a peer's death means for requests: ``gone`` marks the peer dead and calls
the messenger's ``on_gone(pg, err, notify)``, which fails both roles' requests around
``teardown``.

Sending: no caller waits on the engine for a control message. ``post`` appends the message to
its peer's outbox (one FIFO per peer, so the order in which a room posts is the order the peer
reads: an ABORT never overtakes its REQUEST, an ABORTED never its ANNOUNCE) and wakes the
sender thread (``kvxfer-msg-send``, ``run_sender``), which sends every outbox oldest first,
keeps a message the engine refuses at the head and tries again, and declares a peer dead whose
message stayed refused for ``peer_timeout``. It also sends the heartbeats. Only ``teardown``'s
BYE and the tests' crafted messages (``send``) go from the calling thread.

``flush``: a room that posted on the path of a request (a decoder's REQUEST, a prefiller's
ANNOUNCE) and holds no messenger lock sends the outbox itself, one engine try per message
(``Engine.send(timeout=0)``: nothing waits); what the engine refuses, or what the sender
thread is sending meanwhile, stays for the sender thread, in order. A small request then
costs no hand-off to the sender thread on either side (docs/messenger.md, "Threads").
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, LayoutError, PeerError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _codec as C
from kvxfer.messenger._node import Node
from kvxfer.planner import plan as _plan

__all__ = ["PeerGroup", "Peers", "context_stride"]


def context_stride(context_bytes: int) -> int:
    """Bytes between context slots: an 8-byte length, the data, rounded up to 64."""
    return (8 + int(context_bytes) + 63) // 64 * 64


#: the most one try of the sender thread waits for the engine to take a message (a peer that
#: cannot take it must not hold the thread: every other peer's messages and heartbeats wait)
SEND_TRY_S = 0.05
#: the sender thread's wake-up when nothing was posted: heartbeats are due at this grain
_IDLE_S = 0.05
#: its wake-up while a refused message waits to be tried again
_RETRY_S = 0.002


class PeerGroup:
    """A connected messenger (its TP ranks, regions and engine parameters).

    ``state``: ``"connecting"`` (HELLO sent, no answer yet), ``"up"``, then ``"failed"`` (the
    connect got no answer in time: ``error``; never up, nothing was sent to it but HELLO) or
    ``"dead"`` (it died, left or broke the protocol: ``error``). ``torn_down`` is True once its
    engine connection was disconnected after its death: nothing of it lands any more.
    Read-only outside the messenger; any thread may read it.

    Attributes: ``uid`` (the peer messenger's id), ``handshake`` (its decoded blob),
    ``layout``, ``sharding``, ``ranks`` (the TP ranks it holds), ``state``, ``alive``,
    ``error``, ``left`` (it said BYE), ``torn_down``; ``peer``, ``remote`` and
    ``context_region`` are the engine objects the messenger writes through; ``readable``
    (rank -> RemoteRegion per region id, reads-only) what it reads from a peer offering pull
    (None: the peer offers no pull)."""

    def __init__(self, owner: "Peers", hs: C.Handshake, peer: Any, remote: dict, ctx: Any,
                 readable: Optional[dict] = None) -> None:
        self.owner = owner                #: the Peers room holding it
        self.handshake = hs               #: the peer's decoded handshake
        self.uid: int = hs.uid            #: the peer messenger's uid
        self.layout: KVLayout = hs.layout         #: the peer's KV layout
        self.sharding: Sharding = hs.sharding     #: the peer's sharding
        self.ranks: tuple[int, ...] = hs.ranks    #: the TP ranks the peer holds
        self.peer = peer                 #: the engine ``Peer``
        self.remote = remote             #: rank -> list of RemoteRegion, by region id
        self.context_region = ctx        #: the peer's context slots (a RemoteRegion), or None
        self.readable = readable         #: rank -> reads-only RemoteRegions (the peer offers pull), or None
        self.state = "connecting"        #: connecting, up, failed or dead
        self.error: Optional[KvxferError] = None     #: why it failed or died
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self.send_seq = 0
        self.recv_seq = 0
        self.send_lock = threading.Lock()
        self.outbox: deque = deque()     # posted control messages, oldest first: [type, fields, since, refused]
        self.torn_down = False           #: its engine connection is gone: nothing of it lands
        self.acked = threading.Event()
        self.heartbeat = min(owner.node.peer_timeout, hs.peer_timeout) / 4
        self.geometry = hs.layout.resolve(hs.sharding)
        self.cache: dict[str, Any] = {}  # the prefill side's per-peer templates and region pairs
        self.connect_deadline: Optional[float] = None   # a connect(wait=False) fails after it
        self.left = False                #: it said BYE (a clean leave, not a death)

    @property
    def alive(self) -> bool:
        """Connecting or up: not failed, not dead."""
        return self.state in ("connecting", "up")

    def __repr__(self) -> str:
        return (f"<PeerGroup {self.uid:016x} TP{self.sharding.tp_size} ranks {list(self.ranks)} "
                f"{self.state}>")


class Peers:
    """The peer table of one messenger and everything sent on the control plane."""

    def __init__(self, node: Node, layout: KVLayout, sharding: Sharding, context_slots: int,
                 context_bytes: int, blob: Callable[[], bytes],
                 on_gone: Callable[[PeerGroup, KvxferError, bool], None]) -> None:
        self.node = node
        self.layout = layout
        self.sharding = sharding
        self.context_slots = context_slots
        self.context_bytes = context_bytes
        self._blob = blob
        self._on_gone = on_gone
        self.table: dict[int, PeerGroup] = {}
        self.dead: set[int] = set()
        self._seqs: dict[int, tuple[int, int]] = {}     # uid -> seqs of a timed-out connect
        # set by the messenger: a group came up / its connect failed (the decoder's queue)
        self.on_up: Callable[[PeerGroup], None] = lambda pg: None
        self.on_failed: Callable[[PeerGroup, KvxferError], None] = lambda pg, err: None
        self.on_dead: Callable[[PeerGroup], None] = lambda pg: None     # under the lock
        self._wake = threading.Event()                  # something was posted: the sender thread looks

    def live(self) -> list[PeerGroup]:
        with self.node.lock:
            return [p for p in self.table.values() if p.alive]

    def all(self) -> list[PeerGroup]:
        with self.node.lock:
            return list(self.table.values())

    def get(self, uid: int) -> Optional[PeerGroup]:
        with self.node.lock:
            return self.table.get(uid)

    def instance(self, peers: Any) -> list[PeerGroup]:
        """A prefill instance a decoder receives from: one PeerGroup or a sequence of them, all
        of this table, none twice, of one layout and sharding, no source rank held twice, all
        alive (checked up front: nothing is sent on a refusal)."""
        if isinstance(peers, PeerGroup):
            groups = [peers]
        elif isinstance(peers, Sequence) and not isinstance(peers, (str, bytes)) and len(peers) > 0:
            groups = list(peers)
        else:
            raise InvalidArgumentError("peer must be a PeerGroup or a non-empty sequence of them")
        seen: set[int] = set()
        for pg in groups:
            if not isinstance(pg, PeerGroup) or pg.owner is not self:
                raise InvalidArgumentError("peer must come from this messenger's connect()")
            if pg.uid in seen:
                raise InvalidArgumentError(f"peer {pg.uid:016x} is named twice")
            seen.add(pg.uid)
        first = groups[0]
        for pg in groups[1:]:
            if pg.layout != first.layout or pg.sharding != first.sharding:
                raise LayoutError(f"peers {first.uid:016x} and {pg.uid:016x} are not one prefill instance: "
                                  "their layouts or shardings differ")
        held: dict[int, int] = {}
        for pg in groups:
            for r in pg.ranks:
                if r in held:
                    raise InvalidArgumentError(f"source rank {r} is held by two of the peers")
                held[r] = pg.uid
        for pg in groups:
            if pg.state == "failed":
                raise pg.error or PeerError(f"the connect to peer {pg.uid:016x} failed")
            if not pg.alive:
                raise PeerError(f"peer {pg.uid:016x} is dead") from pg.error
        return groups

    # -- connecting ---------------------------------------------------------------------
    def connect(self, blob: bytes, timeout: Optional[float], wait: bool = True) -> PeerGroup:
        node = self.node
        hs = C.safe_decode_handshake(blob, node.secret)
        with node.lock:
            if hs.uid in self.dead:
                raise PeerError(f"peer {hs.uid:016x} was declared dead; a restarted peer has a new handshake")
            pg = self.table.get(hs.uid)
        if pg is None:
            pg = self.make_group(hs)
        if pg.state == "up":
            return pg
        with node.lock:
            if not wait and pg.connect_deadline is not None and pg.state == "connecting":
                return pg                       # a connect(wait=False) of it is under way
            # the messenger thread's tick fails it after this (None: no limit)
            pg.connect_deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        self.post(pg, C.HELLO, blob=self._blob())   # tried until the connect's deadline
        if not wait:
            return pg
        if not pg.acked.wait(timeout):
            self.connect_failed(pg, PeerError(f"peer {hs.uid:016x} did not answer the handshake within {timeout} s"))
        if pg.state in ("failed", "dead"):       # (failed: by this wait or the messenger thread's tick)
            raise pg.error or PeerError("peer died while connecting")
        return pg

    def connect_failed(self, pg: PeerGroup, err: KvxferError) -> bool:
        """A connect of ``pg`` got no answer in time: ``"failed"`` (False if it is not
        connecting any more), out of the table; the decoder fails what it queued for it."""
        node = self.node
        with pg.send_lock, node.lock:        # (send_lock: no HELLO of it is being sent meanwhile)
            if pg.state != "connecting":
                return False
            pg.state = "failed"
            pg.error = err
            pg.outbox.clear()
            self.table.pop(pg.uid, None)
            # a retry's group goes on from these: its HELLO must be newer than this one,
            # which the peer may have accepted after our timeout
            self._seqs[pg.uid] = (pg.send_seq, pg.recv_seq)
            node.count("connects_failed")
        self.disconnect(pg.peer)
        pg.acked.set()
        self.on_failed(pg, err)
        return True

    def _up(self, pg: PeerGroup) -> None:
        """``pg`` answered: up, and what the decoder queued for it goes."""
        with self.node.lock:
            was = pg.state
            if was in ("connecting", "up"):
                pg.state = "up"
        if was not in ("connecting", "up"):
            return
        pg.acked.set()
        if was == "connecting":
            self.node.count("peers_up")
            self.on_up(pg)

    def make_group(self, hs: C.Handshake) -> PeerGroup:
        node, eng = self.node, self.node.engine
        if hs.uid == node.uid:
            raise InvalidArgumentError("that handshake is this messenger's own")
        if hs.provider != eng.provider:
            raise DescriptorError(f"peer runs provider {hs.provider!r}, this engine {eng.provider!r}")
        # the layouts and shardings must be able to meet (LayoutError otherwise): an empty plan
        # checks both directions' geometry; page sizes may differ (requests then move tokens:
        # each side's pages in its own page size, num_tokens deciding each last page)
        _plan(self.layout, self.sharding, hs.layout, hs.sharding, [], [], num_tokens=0)
        _plan(hs.layout, hs.sharding, self.layout, self.sharding, [], [], num_tokens=0)
        if hs.context_slots and context_stride(hs.context_bytes) > eng.max_write + 64:
            raise InvalidArgumentError("the peer's context slot does not fit one message of this engine")
        if self.context_slots and self.context_bytes + 8 > hs.max_write:
            raise InvalidArgumentError("this node's context does not fit one message of the peer's engine")
        peer = eng.connect(hs.address)
        with node.lock:         # one engine Peer per address: its teardown would take the other down
            other = next((g for g in self.table.values() if g.peer is peer and g.uid != hs.uid), None)
        if other is not None:
            raise DescriptorError(f"the handshake names the address of peer {other.uid:016x}")
        try:
            remote = {r: [eng.remote(d) for d in descs] for r, descs in zip(hs.ranks, hs.regions)}
            readable = {r: [eng.remote(d) for d in descs] for r, descs in zip(hs.ranks, hs.read_regions)} \
                if hs.read_regions else None
            ctx = eng.remote(hs.context) if hs.context_slots else None
            if ctx is not None and ctx.nbytes < hs.context_slots * context_stride(hs.context_bytes):
                raise DescriptorError("the peer's context region is smaller than its slots")
            sizes = hs.layout.region_sizes(hs.sharding)
            for r, rr in list(remote.items()) + list((readable or {}).items()):
                if any(x.nbytes < s for x, s in zip(rr, sizes)):
                    raise DescriptorError(f"the peer's rank {r} regions are smaller than its layout")
        except BaseException:
            self.disconnect(peer)
            raise
        pg = PeerGroup(self, hs, peer, remote, ctx, readable)
        with node.lock:
            old = self.table.get(hs.uid)
            if old is not None:
                if old.peer is not peer:       # the engine shares one Peer per address
                    self.disconnect(peer)
                return old
            seqs = self._seqs.pop(hs.uid, None)
            if seqs is not None:
                pg.send_seq, pg.recv_seq = seqs
            self.table[hs.uid] = pg
        return pg

    def disconnect(self, peer: Any) -> None:
        try:
            self.node.engine.disconnect(peer)
        except KvxferError:
            pass

    # -- sending ------------------------------------------------------------------------
    def send(self, pg: PeerGroup, t: int, timeout: Optional[float] = 5.0, **fields: Any) -> None:
        """Encode and send one control message to ``pg`` now, from this thread (``KvxferError``
        if refused): the sender thread's step, teardown's BYE and the tests' crafted messages."""
        node = self.node
        with pg.send_lock:
            self._send_locked(pg, t, timeout, fields)
        node.count("sent_" + C.MSG_TYPES[t])

    def _send_locked(self, pg: PeerGroup, t: int, timeout: Optional[float], fields: dict) -> None:
        """Under ``pg.send_lock``: the next seq, encode, send."""
        node = self.node
        pg.send_seq += 1
        data = C.Control(t, node.uid, pg.uid, pg.send_seq, **fields).encode(node.secret)
        node.engine.send(pg.peer, data, timeout=timeout)
        pg.last_sent = time.monotonic()

    def post(self, pg: PeerGroup, t: int, *, wake: bool = True, **fields: Any) -> bool:
        """Hand one control message for ``pg`` to the sender thread and return at once (no
        wait on the engine, any thread). It goes after every message posted to ``pg`` before
        it; refused by the engine, it is tried again, still first, while the peer lives.
        False (nothing queued) if ``pg`` is failed or dead, or the messenger closed.
        ``wake=False``: the caller ``flush``es ``pg`` itself once out of its locks (the
        sender thread is woken only if something is left then)."""
        node = self.node
        with node.lock:
            if not pg.alive or node.closed:
                return False
            pg.outbox.append([t, fields, time.monotonic(), False])
        if wake:
            self._wake.set()
        return True

    def flush(self, pg: PeerGroup) -> None:
        """Send ``pg``'s outbox now from this thread, one engine try per message (no wait);
        what is left (refused, or the sender thread holds the outbox) the sender thread
        sends. Only from a thread holding no messenger lock. Never raises: the call that
        posted has already made its request."""
        try:
            done = self._drain(pg, timeout=0.0)
        except Exception:              # as the sender thread would: counted, printed, left to it
            self.node.count("send_internal_error")
            traceback.print_exc()
            done = False
        if not done:
            self._wake.set()

    def try_send(self, pg: PeerGroup, t: int, *, timeout: float = 1.0, **fields: Any) -> bool:
        """Send one control message now, from this thread; False (counted ``send_failed``) if
        the engine did not take it within ``timeout``: for messages nothing depends on
        (heartbeats) or that must go before a teardown (BYE)."""
        try:
            self.send(pg, t, timeout=timeout, **fields)
            return True
        except KvxferError:
            self.node.count("send_failed")
            return False

    def wake(self) -> None:
        """Wake the sender thread (the messenger closes)."""
        self._wake.set()

    def run_sender(self, stop: threading.Event) -> None:
        """The sender thread (``kvxfer-msg-send``): each live peer's outbox, oldest first, then
        its heartbeat when one is due; until ``stop``. A peer whose first message the engine
        refuses is left for the next round, so one peer that cannot take messages delays the
        others by one try (``SEND_TRY_S``) a round, never more."""
        wake = self._wake
        idle = min(_IDLE_S, self.node.peer_timeout / 8)
        refused = False
        while not stop.is_set():
            wake.wait(_RETRY_S if refused else idle)
            wake.clear()
            refused = False
            for pg in self.all():
                if not pg.alive or stop.is_set():
                    continue
                try:
                    if pg.outbox and not self._drain(pg):
                        refused = True
                        continue
                    if pg.state == "up" and time.monotonic() - pg.last_sent >= pg.heartbeat and not pg.outbox:
                        self.try_send(pg, C.HEARTBEAT, timeout=SEND_TRY_S)
                except Exception:          # never let one message kill the sender thread (every peer would go silent)
                    self.node.count("send_internal_error")
                    traceback.print_exc()

    def _drain(self, pg: PeerGroup, *, dead_too: bool = False, timeout: float = SEND_TRY_S) -> bool:
        """Send ``pg``'s outbox, oldest first (``dead_too``: also of a dead peer, our close's
        flush); False if the engine refused one (it stays first). A message refused for
        ``peer_timeout`` declares the peer dead (as silence would): its requests fail rather
        than wait for a reply that was never asked for. ``timeout`` 0 (``flush``): one try
        each and no wait for the outbox either; False at the first refusal (counted as any)
        or if another thread is sending it."""
        node = self.node
        trying = timeout == 0
        while True:
            exc: Optional[KvxferError] = None
            if not pg.send_lock.acquire(not trying):      # one sender of this outbox at a time: none twice
                return False
            try:
                with node.lock:
                    if not pg.outbox or not (dead_too or pg.alive):
                        return True
                    item = pg.outbox[0]
                t, fields, since, was_refused = item
                try:
                    self._send_locked(pg, t, timeout, fields)
                except KvxferError as e:
                    exc = e
                    with node.lock:
                        item[3] = True
                else:
                    with node.lock:
                        if pg.outbox and pg.outbox[0] is item:
                            pg.outbox.popleft()
            finally:
                pg.send_lock.release()
            if exc is not None:
                node.count("send_failed")
                if trying:
                    return False                          # the sender thread tries it again
                if time.monotonic() - since > node.peer_timeout and pg.alive:
                    self.gone(pg, PeerError(f"peer {pg.uid:016x}: could not send {C.MSG_TYPES[t]} for "
                                            f"{node.peer_timeout} s ({exc}): declared dead"), notify=False)
                return False
            node.count("sent_" + C.MSG_TYPES[t])
            if was_refused:
                node.count("resent_" + C.MSG_TYPES[t])

    def forgive(self, seconds: float, now: float) -> None:
        """Messenger thread: it could not listen for ``seconds`` (not scheduled, or one round
        ran long), so that time counts neither as any peer's silence nor against a pending
        connect's deadline: a process that was starved does not declare its live peers dead
        on waking, before it has read what they sent meanwhile (``stats()['stalls_forgiven']``).
        A peer that did die is still declared dead, later by at most ``seconds``."""
        with self.node.lock:
            for pg in self.table.values():
                if pg.state == "up":
                    pg.last_heard = min(now, pg.last_heard + seconds)
                elif pg.state == "connecting" and pg.connect_deadline is not None:
                    pg.connect_deadline += seconds
        self.node.count("stalls_forgiven")

    def tick(self, now: float) -> None:
        """Messenger thread: connects past their deadline, silence (declared dead)."""
        pt = self.node.peer_timeout
        for pg in self.all():
            if pg.state == "connecting" and pg.connect_deadline is not None and now >= pg.connect_deadline:
                self.connect_failed(pg, PeerError(f"peer {pg.uid:016x} did not answer the handshake within "
                                                  "its connect's timeout"))
            elif pg.state == "up" and now - pg.last_heard > pt:
                self.gone(pg, PeerError(f"peer {pg.uid:016x} silent for {pt} s: declared dead"), notify=False)

    # -- death ----------------------------------------------------------------------------
    def mark_dead(self, pg: PeerGroup, err: KvxferError) -> bool:
        """``pg`` is dead from now on (False if it already was)."""
        with self.node.lock:
            if pg.state == "dead":
                return False
            pg.state = "dead"
            pg.error = err
            self.on_dead(pg)               # its legs' arms (decode.Decoder.drop_arms)
            if not self.node.closed:       # our close sends what was posted first (teardown)
                pg.outbox.clear()
            self.dead.add(pg.uid)
            # a clean BYE (``left``) and this messenger's close are not deaths
            self.node.count("peers_left" if pg.left else "peers_closed" if self.node.closed else "peers_dead")
        pg.acked.set()
        return True

    def gone(self, pg: PeerGroup, err: KvxferError, *, notify: bool) -> None:
        """``pg`` died (silence), left (BYE), broke the protocol or we close."""
        self._on_gone(pg, err, notify)

    def teardown(self, pg: PeerGroup, notify: bool) -> None:
        """Say BYE if asked (on our close after what was posted to ``pg``, e.g. an ANNOUNCE of a
        send that finished just before), then disconnect: on tcp no byte of ``pg`` is read (so
        lands) after."""
        if notify:
            if self.node.closed:
                self._drain(pg, dead_too=True)
            self.try_send(pg, C.BYE)
        with self.node.lock:
            pg.outbox.clear()
        self.disconnect(pg.peer)
        with self.node.lock:
            pg.torn_down = True

    def broke_protocol(self, pg: PeerGroup, why: str) -> None:
        """A peer whose counts cannot be believed: torn down (its requests fail with
        ``PeerError``, fenced: after the teardown nothing of it lands), so no page stays
        quarantined for as long as it keeps sending heartbeats."""
        self.node.count("peers_broke_protocol")
        self.gone(pg, PeerError(f"peer {pg.uid:016x} broke the protocol ({why}): torn down"), notify=True)

    # -- incoming ---------------------------------------------------------------------------
    def accept(self, pg: PeerGroup, m: C.Control) -> bool:
        """A message from a known live peer: False (dropped) if it is a replay."""
        if m.seq <= pg.recv_seq:
            self.node.count("drop_replayed")
            return False
        pg.recv_seq = m.seq
        now = time.monotonic()
        self.node.hist.observe("peer_silence", now - pg.last_heard)   # how near peer_timeout it came
        pg.last_heard = now
        return True

    def on_hello(self, m: C.Control, pg: Optional[PeerGroup]) -> None:
        node = self.node
        if pg is not None and pg.state == "dead":
            node.count("drop_dead_peer")     # its engine Peer is disconnected: never "up" again
            return
        if pg is None:
            if m.src in self.dead:
                node.count("drop_dead_peer")
                return
            try:
                hs = C.safe_decode_handshake(m.blob, node.secret)
                if hs.uid != m.src:
                    raise DescriptorError("HELLO's sender is not the handshake's")
                pg = self.make_group(hs)
            except KvxferError:
                node.count("drop_bad_handshake")
                return
            pg.recv_seq = m.seq
            pg.last_heard = time.monotonic()
        elif not self.accept(pg, m):
            return
        node.count("recv_HELLO")
        self.post(pg, C.HELLO_ACK)
        self._up(pg)

    def on_hello_ack(self, pg: PeerGroup) -> None:
        self._up(pg)
