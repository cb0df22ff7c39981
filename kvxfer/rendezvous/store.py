"""The rendezvous store interface: bytes under keys of one namespace, leases kept alive from a
background thread, and watches of a prefix.

A backend (etcd, Redis, TCPStore, a directory) implements five primitives on keys already
checked and already prefixed with its namespace: ``_put(key, value, ttl)``, ``_get``,
``_delete``, ``_list(prefix)`` and ``_renew(lease)``. Everything a user calls lives here:

* ``put`` / ``get`` / ``delete`` / ``list`` of bytes (no pickle anywhere: values are bytes in,
  bytes out);
* ``publish(key, value, ttl)`` returns a ``Lease``: the entry exists while the lease is
  renewed (every ``ttl / 3`` s by the store's one ``kvxfer-rdv-lease`` thread, each renewal
  at most ``RETRIES`` tries of at most ``op_timeout`` s each); a store that is unreachable
  marks the lease ``"lost"`` once ``ttl`` has passed without a renewal, and the next renewal
  that reaches the store puts the entry back (``"held"`` again). ``Lease.close()`` deletes it;
* ``watch(prefix, callback)`` polls ``list(prefix)`` every ``interval`` s on a
  ``kvxfer-rdv-watch`` thread and calls ``callback(key, value)`` for each entry that appeared
  or changed and ``callback(key, None)`` for each that went; a poll that fails changes nothing
  (an unreachable store is not an empty one), ``Watch.error`` says why.

Every store failure is a ``RendezvousError`` (a ``ConnectionError``); bad keys and values are
``InvalidArgumentError`` / ``ArgumentTypeError`` and touch nothing.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from typing import Callable, Optional

from kvxfer.errors import ArgumentTypeError, ClosedError, InvalidArgumentError, KvxferError, RendezvousError

#: tries per lease renewal before it waits for the next period
RETRIES = 3
#: the largest value a store takes (a handshake fits one 64 KiB control message)
MAX_VALUE = 1 << 20
_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


def check_key(key: object, *, prefix: bool = False) -> str:
    """A key (or, with ``prefix``, a key prefix, which may be empty or end in ``/``):
    segments of ``[A-Za-z0-9._-]`` joined by ``/``, no ``.``/``..`` segment, at most 512 chars."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"a rendezvous key is a str, got {type(key).__name__}")
    body = key[:-1] if prefix and key.endswith("/") else key
    if prefix and body == "":
        return key
    if len(key) > 512 or not _KEY.match(body) or any(s in (".", "..") for s in body.split("/")):
        raise InvalidArgumentError(f"bad rendezvous key {key!r}: segments of [A-Za-z0-9._-] joined by '/'")
    return key


def check_value(value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"a rendezvous value is bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) > MAX_VALUE:
        raise InvalidArgumentError(f"a rendezvous value is at most {MAX_VALUE} bytes, got {len(value)}")
    return value


def check_seconds(v: object, name: str, lo: float = 0.05, hi: float = 86400.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
        raise InvalidArgumentError(f"{name} must be a number of seconds in [{lo}, {hi}], got {v!r}")
    return float(v)


class Lease:
    """One published entry kept alive while this object is open (see the module docstring).

    ``state``: ``"held"`` (the last renewal reached the store), ``"lost"`` (none did for
    ``ttl`` s: readers may no longer see the entry), ``"closed"``. ``renewals``, ``failures``
    and ``error`` (the last failure) are for the curious; ``reestablished`` counts the times
    a lost lease was put back."""

    def __init__(self, store: "Store", key: str, value: bytes, ttl: float) -> None:
        self.store = store
        self.key = key
        self.value = value
        self.ttl = ttl
        self.state = "held"
        self.renewals = 0
        self.failures = 0
        self.reestablished = 0
        self.error: Optional[RendezvousError] = None
        self.last_ok = time.monotonic()
        self.next_at = self.last_ok + ttl / 3
        self.backend: object = None          # the backend's own handle (an etcd lease id)
        self._lock = threading.Lock()        # a renewal and the release never overlap

    def _renewed(self) -> None:
        if self.state == "lost":
            self.reestablished += 1
        self.state = "held"
        self.renewals += 1
        self.error = None
        self.last_ok = time.monotonic()

    def _failed(self, err: RendezvousError) -> None:
        self.failures += 1
        self.error = err
        if time.monotonic() - self.last_ok > self.ttl:
            self.state = "lost"

    def close(self) -> None:
        """Stop renewing and delete the entry (best effort when the store is unreachable: it
        then expires within ``ttl``). Idempotent."""
        if self.state == "closed":
            return
        self.state = "closed"
        self.store._drop_lease(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Lease {self.key!r} ttl={self.ttl} {self.state}>"


class Watch:
    """A poll of ``list(prefix)`` every ``interval`` s that reports changes to ``callback``
    (see the module docstring). ``snapshot()`` is the last successful view; ``error`` is the
    last poll's failure (None once one succeeds again); ``polls`` counts successful polls."""

    def __init__(self, store: "Store", prefix: str, callback: Callable[[str, Optional[bytes]], object],
                 interval: float) -> None:
        self.store = store
        self.prefix = prefix
        self.interval = interval
        self.error: Optional[RendezvousError] = None
        self.callback_errors = 0
        self.polls = 0
        self._cb = callback
        self._view: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-rdv-watch", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._view)

    def wait_first(self, timeout: float) -> bool:
        """True once one poll succeeded (within ``timeout`` s)."""
        return self._first.wait(timeout)

    def poll(self) -> None:
        """One poll now (the thread also calls it): RendezvousError if the store is unreachable."""
        try:
            now = self.store.list(self.prefix)
        except RendezvousError as exc:
            self.error = exc
            raise
        with self._lock:
            old, self._view = self._view, now
            self.error = None
            self.polls += 1
        self._first.set()
        for k, v in now.items():
            if old.get(k) != v:
                self._call(k, v)
        for k in old:
            if k not in now:
                self._call(k, None)

    def _call(self, key: str, value: Optional[bytes]) -> None:
        try:
            self._cb(key, value)
        except Exception:          # a callback's bug must not end the watch; counted
            self.callback_errors += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except (RendezvousError, ClosedError):
                pass
            self._stop.wait(self.interval)

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling (joins the thread within ``timeout``). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class Store:
    """Base of every backend; open one with ``kvxfer.rendezvous.open(url)``.

    ``namespace`` prefixes every key (so stores of several clusters can share one server);
    ``op_timeout`` bounds each call to the server."""

    scheme = ""

    def __init__(self, url: str, namespace: str, op_timeout: float = 2.0) -> None:
        self.url = url
        self.namespace = namespace.strip("/")
        if self.namespace:
            check_key(self.namespace)
        self.op_timeout = check_seconds(op_timeout, "op_timeout")
        self._closed = False
        self._leases: list[Lease] = []
        self._watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
        self._cv = threading.Condition()
        self._renewer: Optional[threading.Thread] = None

    # -- keys --------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return f"{self.namespace}/{key}" if self.namespace else key

    def _rel(self, full: str) -> str:
        return full[len(self.namespace) + 1:] if self.namespace else full

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"rendezvous store {self.url} is closed")

    # -- the interface -------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` with no lease (it stays until deleted)."""
        self._check_open()
        k, v = self._full(check_key(key)), check_value(value)
        self._put(k, v, None)

    def get(self, key: str) -> Optional[bytes]:
        """The value under ``key``, or None."""
        self._check_open()
        return self._get(self._full(check_key(key)))

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        self._check_open()
        return self._delete(self._full(check_key(key)))

    def list(self, prefix: str = "") -> dict[str, bytes]:
        """Every live entry whose key starts with ``prefix``: key (without the namespace) -> value."""
        self._check_open()
        p = check_key(prefix, prefix=True)
        full = self._full(p) if p else (self.namespace + "/" if self.namespace else "")
        return {self._rel(k): v for k, v in self._list(full).items()}

    def publish(self, key: str, value: bytes, ttl: float = 10.0) -> Lease:
        """Put ``value`` under ``key`` with a lease of ``ttl`` s that this store renews from its
        background thread until ``Lease.close()`` (or ``Store.close()``), which deletes it.
        The first put must reach the store (RendezvousError otherwise)."""
        self._check_open()
        k, v = self._full(check_key(key)), check_value(value)
        ttl = check_seconds(ttl, "ttl", 1.0)
        lease = Lease(self, k, v, ttl)
        self._first_put(lease)
        with self._cv:
            self._check_open()
            self._leases.append(lease)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, name="kvxfer-rdv-lease", daemon=True)
                self._renewer.start()
            self._cv.notify_all()
        return lease

    def watch(self, prefix: str, callback: Callable[[str, Optional[bytes]], object], *,
              interval: float = 0.25) -> Watch:
        """Report changes under ``prefix`` to ``callback(key, value or None)`` (polls every
        ``interval`` s on one thread; close the Watch, or the store, to stop)."""
        self._check_open()
        if not callable(callback):
            raise ArgumentTypeError("callback must be callable")
        w = Watch(self, check_key(prefix, prefix=True), callback, check_seconds(interval, "interval", 0.01, 60.0))
        self._watches.add(w)
        return w

    def close(self, timeout: float = 5.0) -> None:
        """Stop watches and renewals, delete this store's leased entries (best effort, bounded
        by ``op_timeout`` each), and close the client. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True              # the renewer stops at its next step
            leases, self._leases = self._leases, []
            self._cv.notify_all()
        for w in list(self._watches):
            w.close(timeout)
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout)      # a renewal in flight ends within op_timeout
        for lease in leases:
            with lease._lock:
                lease.state = "closed"
                self._release(lease)
        self._close_client()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    # -- leases --------------------------------------------------------------------------
    def _first_put(self, lease: Lease) -> None:
        self._renew(lease)

    def _drop_lease(self, lease: Lease) -> None:
        with self._cv:
            if lease in self._leases:
                self._leases.remove(lease)
        with lease._lock:                    # after a renewal in flight: nothing puts it back
            self._release(lease)

    def _release(self, lease: Lease) -> None:
        try:
            self._delete(lease.key)
        except (RendezvousError, ClosedError):
            pass

    def _renew_loop(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [le for le in self._leases if le.next_at <= now]
                if not due:
                    nxt = min((le.next_at for le in self._leases), default=now + 1.0)
                    self._cv.wait(max(0.01, min(1.0, nxt - now)))
                    continue
            for lease in due:
                self._renew_once(lease)

    def _renew_once(self, lease: Lease) -> None:
        err: Optional[RendezvousError] = None
        for i in range(RETRIES):
            try:
                with lease._lock:
                    if lease.state == "closed" or self._closed:
                        return
                    self._renew(lease)
            except RendezvousError as exc:
                err = exc
                time.sleep(min(0.05 * (2 ** i), lease.ttl / 10))
                continue
            except KvxferError as exc:   # e.g. ClosedError from a client closed under us
                err = RendezvousError(str(exc))
                break
            if lease.state != "closed":
                lease._renewed()
            lease.next_at = time.monotonic() + lease.ttl / 3
            return
        if err is not None and lease.state != "closed":
            lease._failed(err)
        # a failing store is retried sooner than the renewal period, but not in a tight loop
        lease.next_at = time.monotonic() + min(lease.ttl / 6, 1.0)

    # -- what a backend implements ---------------------------------------------------------
    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        raise NotImplementedError

    def _get(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        raise NotImplementedError

    def _list(self, prefix: str) -> dict[str, bytes]:
        raise NotImplementedError

    def _renew(self, lease: Lease) -> None:
        """Keep ``lease``'s entry alive for another ``ttl`` (put it back if it is gone)."""
        self._put(lease.key, lease.value, lease.ttl)

    def _close_client(self) -> None:
        pass
