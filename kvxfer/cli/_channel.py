"""The benchmark's control channel: tagged JSON messages between initiator and target over ``Engine.send``/``recv``.

Never the data path. Per iteration of a ``bw`` case the target sends two: ``landed`` as soon as its
counter for the iteration's imm completes, stamped with its clock (on one host that stamp
ends the measurement; across hosts the ack's arrival does), and ``ready`` after it has
checked and re-poisoned the destination (so the next write cannot race the check).
Everything that waits has a deadline, so a vanished peer ends a process instead of
hanging it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

import kvxfer
from kvxfer.errors import KvxferError, PeerError, TimeoutError

__all__ = ["ADDR_PREFIX", "SLICE", "Channel", "RemoteFailure", "wait_counter"]

#: The line a target prints on stdout with its address (hex of ``Engine.address``).
ADDR_PREFIX = "KVXFER-ADDR "
SLICE = 1.0  # seconds: waits block in slices so a dead parent or peer is noticed


class RemoteFailure(KvxferError):
    """The other process failed; carries its traceback text."""


class Channel:
    """Tagged JSON messages to one peer. Messages of other kinds than the one awaited are
    kept for later, so the protocol does not depend on delivery order."""

    def __init__(self, eng: "kvxfer.Engine", alive: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.eng = eng
        self.peer: Optional[kvxfer.Peer] = None
        self._held: list[dict] = []
        self._alive = alive  # returns a reason string when the other side is known dead

    def send(self, kind: str, **fields: Any) -> None:
        fields["t"] = kind
        data = json.dumps(fields, separators=(",", ":")).encode()
        self.eng.send(self.peer, data)

    def recv(self, kinds: str | tuple[str, ...], timeout: Optional[float], i: Optional[int] = None) -> dict:
        """The next message of ``kinds`` (and iteration ``i``); RemoteFailure if the peer
        reported an error, TimeoutError after ``timeout`` s (None: wait forever)."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for n, m in enumerate(self._held):
                if m.get("t") == "error":
                    raise RemoteFailure(m.get("trace") or m.get("error", "peer failed"))
                if m.get("t") in kinds and (i is None or m.get("i") == i):
                    return self._held.pop(n)
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no {'/'.join(kinds)} message within {timeout} s")
            try:
                raw = self.eng.recv(left)
            except TimeoutError:
                if self._alive is not None:
                    why = self._alive()
                    if why:
                        raise PeerError(why) from None
                continue
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # not ours
            if isinstance(msg, dict):
                self._held.append(msg)


def wait_counter(c: "kvxfer.Counter", timeout: float, alive: Optional[Callable[[], Optional[str]]]) -> None:
    """``c.wait(timeout)`` in slices, raising ``PeerError`` as soon as ``alive`` names a dead peer."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            c.wait(max(0.001, min(SLICE, left)))
            return
        except TimeoutError:
            if left <= SLICE:
                raise TimeoutError(f"imm {c.imm}: {c.arrived}/{c.count} writes arrived after {timeout} s") from None
            why = alive() if alive else None
            if why:
                raise PeerError(why) from None
