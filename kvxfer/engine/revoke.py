"""The revoke exchange, the engine's half: a region's close is announced to the peers that may
write into it, and it is deregistered once they have acknowledged (src/revoke.c).

On libfabric 1.17 a write into a region its target closed is refused in ways no sender can
act on (shm reports it done, lands it in deregistered memory or stalls until
``peer_timeout``; tcp;ofi_rxm drops the connection, failing the honest writes behind it), so
such a write must never be posted. ``Engine.connect`` sends the peer a HELLO with this
engine's address and waits (at most ``HELLO_WAIT`` s) until it was sent; the peer's engine
keeps it (and reads its CQ before it takes the list). ``Engine.close`` and
``Engine.disconnect`` send a BYE: the peer then announces nothing more here. ``MemoryRegion.close`` on an open engine first sends a REVOKE with the
region's keys to every peer that said HELLO and is neither disconnected nor dead, and waits
(at most ``REVOKE_WAIT`` s) for each one's ACK, or for its send to fail (the peer is gone).
A peer's native layer, on a REVOKE, refuses every later post to those keys (the transfer
fails with ``EACCES``, nothing of it posted; ``stats()["revoked_keys"]``) and acknowledges
once the writes it already posted to them are ahead of the ACK on the endpoint. A readable
region's read keys are revoked with its write keys: reads of it stop the same way.

The HELLOs and BYEs are read when a region is first closed after them, each address's last
word counting: a writer that said BYE is never connected back (it may be a closed engine of
this process, whose name shm 1.17 cannot even insert: src/rail.c refuses it), and a peer
connected here only by the exchange is disconnected after its BYE. A caller's
``Engine.disconnect`` voids that peer's HELLO (one read later was sent before) and waits, at
most ``HELLO_WAIT``, until its BYE went out, before the address is removed.

What it does not cover: a peer that connects while the region is being closed, holding its
descriptor, and writes at once (its HELLO arrives after the list of peers was taken); the
writes of a peer's rail beyond this engine's rail count (an ACK orders only the writes of
the rail it travels on); a peer that does not answer within ``REVOKE_WAIT`` (it is then
written to as before, and a late write of its is refused by the provider). Regions dropped
without ``close()`` and those of a closing engine are not announced: their endpoints close
first, and a peer's writes to a closed endpoint fail as writes to a dead peer.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from kvxfer.engine.rails import _fabric
from kvxfer.errors import KvxferError

if TYPE_CHECKING:
    from kvxfer.engine.engine import Engine
    from kvxfer.engine.rails import Peer
    from kvxfer.engine.regions import MemoryRegion

#: how long connect() waits for its HELLO to be delivered
HELLO_WAIT = 1.0
#: how long MemoryRegion.close() waits for each peer's ACK
REVOKE_WAIT = 1.0
_SENT = 1 << 63          # a token's bit in the answers: our own send of it completed ...
_FAILED = 1 << 62        # ... with an error
_SLICE = 0.01


class Revocations:
    """An engine's side of the exchange: the peers that said HELLO, and the answers."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._answered: dict[int, None] = {}   # tokens answered, not yet claimed (in order)
        self._writers: dict[bytes, None] = {}  # addresses of peers that said HELLO
        self._own: set[bytes] = set()          # ... of those, connected by the exchange, not by a caller
        self._quiet: set[bytes] = set()        # peers being removed after their BYE: told nothing
        self._said: dict[bytes, int] = {}      # HELLOs and BYEs read, not yet handled (last word each)

    def _read_said(self) -> None:
        """Take the HELLOs and BYEs received so far (each address's last word counts)."""
        try:
            said = self._engine._rails[0].ctl_hellos()
        except KvxferError:
            return                      # closing
        with self._lock:
            for kind, a in said:
                self._said.pop(a, None)
                self._said[a] = kind

    def _wait(self, want: set, timeout: float, until_one: Optional[dict] = None) -> set:
        """Wait up to ``timeout`` s until every token of ``want`` was answered; returns those
        that were (claimed). ``until_one``: {token: other token}: a token also ends when its
        other token is answered (a REVOKE's ACK, or its send's failure)."""
        rail = self._engine._rails[0]
        got: set = set()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for t in list(want):
                    other = until_one.get(t) if until_one else None
                    if t in self._answered or (other is not None and other in self._answered):
                        self._answered.pop(t, None)
                        if other is not None:
                            self._answered.pop(other, None)
                        want.discard(t)
                        got.add(t)
            left = deadline - time.monotonic()
            if not want or left <= 0 or self._engine.closed:
                return got
            try:
                answers = rail.ctl_take(min(_SLICE, left))
            except KvxferError:
                return got
            if answers:
                with self._lock:
                    for a in answers:
                        self._answered[a] = None
                    while len(self._answered) > 4096:     # answers nobody waits for any more
                        self._answered.pop(next(iter(self._answered)))

    def hello(self, peer: "Peer") -> None:
        """Tell a newly connected peer our address (``Engine.connect``); wait until it has it,
        so a region it closes from now on is announced to us."""
        eng = self._engine
        rail = eng._rails[0]
        token = next(self._tokens)
        try:
            if not rail.ctl_send(peer.fi_addrs[0], peer.gens[0], _fabric.CTL_HELLO, token,
                                 np.frombuffer(eng.address, dtype=np.uint8), 0.05):
                return
        except KvxferError:
            return       # a peer that is gone already: its first write says so, as before
        wait = HELLO_WAIT if eng.peer_timeout is None else min(HELLO_WAIT, eng.peer_timeout)
        self._wait({token | _SENT}, wait, {token | _SENT: token | _SENT | _FAILED})

    def claimed(self, address: bytes) -> None:
        """A caller's ``Engine.connect`` returned the peer we had connected: it is the caller's
        now, and a BYE of it no longer removes it."""
        self._own.discard(address)

    def bye(self, peers: Optional[list] = None) -> None:
        """``Engine.close`` (every peer) and ``Engine.disconnect`` (that one): tell the peers
        we said HELLO to that we write nothing more to them, so their closes do not wait for
        our ACK (we answer none once we no longer know them)."""
        eng = self._engine
        rail = eng._rails[0]
        data = np.frombuffer(eng.address, dtype=np.uint8)
        if peers is not None:
            # a caller's disconnect: a HELLO of theirs read from now on but sent before is
            # void (connecting back to it, we would wait REVOKE_WAIT at each close for an
            # ACK it cannot send: it disconnected us too, as the messenger does)
            for r in eng._rails:
                r.flush(1.0)            # a HELLO delivered before now is read here
            self._read_said()
            with self._lock:
                for p in peers:
                    self._said.pop(p.address, None)
                    self._writers.pop(p.address, None)
                    self._own.discard(p.address)
        sent: dict = {}
        for p in (list(eng._peers.values()) if peers is None else peers):
            if p.closed or p.address in self._quiet:
                continue
            token = next(self._tokens)
            try:
                if rail.ctl_send(p.fi_addrs[0], p.gens[0], _fabric.CTL_BYE, token, data, 0.05):
                    sent[token | _SENT] = token | _SENT | _FAILED
            except KvxferError:
                pass
        if peers is not None and sent:
            # a caller's disconnect removes the address next: the BYE goes out first, so no
            # send of ours is left outstanding to a removed peer (at most HELLO_WAIT)
            self._wait(set(sent), HELLO_WAIT, sent)

    def _peers(self) -> list:
        """The live peers that said HELLO: connected here when their HELLO is first seen; one
        disconnected since (``Engine.disconnect``) is no longer told, until it says HELLO again."""
        eng = self._engine
        for r in eng._rails:
            r.flush(1.0)                # a HELLO delivered before now is handled after this
        self._read_said()
        with self._lock:
            said, self._said = self._said, {}
        for a, kind in said.items():
            if kind == _fabric.CTL_BYE:
                # closing: it writes nothing more. Never connect back to it (a closed engine
                # of this process must not be posted to); one we connected only to announce
                # closes is removed, so the address vector does not grow with every writer
                self._writers.pop(a, None)
                p = eng._peers.get(a)
                if a in self._own and p is not None and not p.closed:
                    self._own.discard(a)
                    self._quiet.add(a)          # no BYE back: it is closing
                    try:
                        eng.disconnect(p, 0.1)
                    finally:
                        self._quiet.discard(a)
                continue
            known = eng._peers.get(a)
            if known is None or known.closed:
                try:
                    eng.connect(a)
                except KvxferError:
                    continue            # not an address of this provider, or gone already
                self._own.add(a)        # connected here, by the exchange alone
            self._writers[a] = None
        out = []
        for a in list(self._writers):
            p = eng._peers.get(a)
            if p is None or p.closed:
                self._writers.pop(a, None)
                self._own.discard(a)
            else:
                out.append(p)
        return out

    def revoke(self, region: "MemoryRegion") -> None:
        """Announce ``region``'s close to the peers that may write into it; return once each
        acknowledged, is gone, or ``REVOKE_WAIT`` passed."""
        eng = self._engine
        handles = region._handles
        if eng.closed or not handles or not region.remote or handles[0].raw_key:
            return
        keys = [int(h.key) for h in region._read_handles + handles]    # its reads stop too
        peers = self._peers()
        if not peers:
            return
        want: set = set()
        until: dict = {}
        for p in peers:
            for k, r in enumerate(eng._rails):
                token = next(self._tokens)
                name = r.getname()
                data = struct.pack(f"<QII{len(keys)}Q", token, len(keys), len(name), *keys) + name
                try:
                    if not r.ctl_send(p.fi_addrs[k], p.gens[k], _fabric.CTL_REVOKE, token,
                                      np.frombuffer(data, dtype=np.uint8), 0.05):
                        continue
                except KvxferError:
                    continue     # dead or disconnected: it writes nothing more
                want.add(token)
                until[token] = token | _SENT | _FAILED
        if want:
            self._wait(want, REVOKE_WAIT, until)
