"""What every room of one messenger shares: its engine, identity, lock, counters and the
callback dispatcher thread.

The rooms (``peers.Peers``, ``decode.Decoder``, ``prefill.Prefiller``) take one ``Node`` and
keep no other link between them; the ``Messenger`` wires their events together.
"""

from __future__ import annotations

import queue
from collections import deque
import threading
import traceback
from collections.abc import Callable
from typing import Any, Optional

from kvxfer.messenger.metrics import Histograms

__all__ = ["Node", "FINAL"]

#: the final states of a Receive and a Send
FINAL = ("done", "failed", "aborted")


class Node:
    """One messenger's shared state. ``lock`` guards every table of every room."""

    def __init__(self, engine: Any, uid: int, secret: Optional[bytes], peer_timeout: float) -> None:
        self.engine = engine
        self.uid = uid
        self.secret = secret
        self.peer_timeout = peer_timeout
        self.lock = threading.RLock()
        self.counts: dict[str, int] = {}
        self.closed = False
        self._cbq: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.hist = Histograms()              # seconds of the transitions (kvxfer/messenger/metrics.py)
        self.polling = False                  # Messenger.poll() was called: transitions are kept
        self.events: deque = deque()          # Receives and Sends that turned final or fenced
        self.reported = threading.Event()     # set at each report: a waiting poll wakes

    def report(self, obj: Any) -> None:
        """``obj`` (a Receive or Send) turned final, or a Receive fenced: kept for ``poll``
        once polling is on (an append, then the event a waiting ``poll`` sleeps on)."""
        if self.polling:
            self.events.append(obj)
            self.reported.set()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def dispatch(self, fn: Callable, arg: Any) -> None:
        """Run ``fn(arg)`` on the dispatcher thread (user callbacks, ``on_request``)."""
        self._cbq.put((fn, arg))

    def stop_dispatcher(self) -> None:
        self._cbq.put(None)

    def run_dispatcher(self) -> None:
        """The dispatcher thread's loop (``kvxfer-msg-cb``): until ``stop_dispatcher``."""
        while True:
            item = self._cbq.get()
            if item is None:
                return
            fn, arg = item
            self.call(fn, arg)

    def call(self, fn: Callable, arg: Any) -> None:
        """``fn(arg)``, a user callback: its exception is counted and printed, never raised."""
        try:
            fn(arg)
        except Exception:
            self.count("callback_errors")
            traceback.print_exc()
