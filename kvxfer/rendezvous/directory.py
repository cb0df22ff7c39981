"""The messenger over a rendezvous store: an ``Announcement`` publishes a messenger's
handshake under ``role/instance/rank``; a ``Directory`` lists and watches one role's
instances and connects to them lazily, with lease expiry as a second failure signal.

Only the messenger's public API is used: ``Messenger.handshake()``, ``.ranks``,
``.connect(blob)``, ``.drop_peer(group, error)`` and ``PeerGroup.alive``. When an instance's
lease expires the instance is marked ``"gone"`` (no new request is routed to it) and the
directory declares its groups dead with ``Messenger.drop_peer``: their requests fail at once,
fenced by the teardown, instead of waiting for ``peer_timeout`` of silence.

Store failures stay off the data path: a Directory keeps the last instance list it read,
groups already connected go on, and only a lookup that needs the store (connecting to an
instance while the store is unreachable) fails, with ``RendezvousError``. An entry absent from
a successful poll counts as expired only after ``grace`` s, so a store that restarted empty
(Redis without persistence) does not look like every instance leaving: live publishers put
their entries back within their renewal period.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Optional

from kvxfer.errors import InvalidArgumentError, KvxferError, PeerError
from kvxfer.rendezvous.store import Lease, Store, Watch, check_key, check_seconds


class Announcement:
    """``messenger``'s handshake under ``role/instance/rank`` for each rank it holds (or
    ``ranks``), each entry on its own lease of ``ttl`` s. ``close()`` deletes them: close it
    before (or with) the messenger. ``state`` is ``"held"`` while every lease is."""

    def __init__(self, store: Store, messenger: Any, role: str, instance: str, *,
                 ranks: Optional[Iterable[int]] = None, ttl: float = 10.0) -> None:
        check_key(role)
        check_key(instance)
        if "/" in role or "/" in instance:
            raise InvalidArgumentError("role and instance are single key segments (no '/')")
        self.store = store
        self.role = role
        self.instance = instance
        blob = messenger.handshake()
        rs = tuple(messenger.ranks if ranks is None else ranks)
        if not rs:
            raise InvalidArgumentError("an announcement names at least one rank")
        self.keys = tuple(f"{role}/{instance}/{int(r)}" for r in rs)
        self.leases: list[Lease] = []
        try:
            for k in self.keys:
                self.leases.append(store.publish(k, blob, ttl))
        except BaseException:
            self.close()
            raise

    @property
    def state(self) -> str:
        states = {le.state for le in self.leases}
        return "held" if states == {"held"} else "closed" if states == {"closed"} else "lost"

    def close(self) -> None:
        """Delete the entries (best effort: an unreachable store lets them expire). Idempotent."""
        for le in self.leases:
            le.close()

    def __enter__(self) -> "Announcement":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Instance:
    """One instance of the directory's role: its handshakes per rank, and the messenger's
    groups once connected. ``state``: ``"listed"`` (in the store, not connected), ``"up"``,
    ``"gone"`` (its entries expired or were deleted: no new request goes to it), ``"dead"``
    (a group of it died: heartbeats, or the messenger was told by the lease)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.blobs: dict[int, bytes] = {}      #: rank -> handshake, as listed now
        self.seen: dict[int, bytes] = {}       # rank -> the last handshake listed (kept when it goes)
        self.groups: list[Any] = []
        self.state = "listed"
        self.error: Optional[BaseException] = None
        self.absent_since: Optional[float] = None
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        if self.state in ("gone", "dead"):
            return False
        return all(g.alive for g in self.groups)

    @property
    def peer(self) -> Any:
        """The one group of a node-mode instance (every rank in one messenger)."""
        if len(self.groups) != 1:
            raise InvalidArgumentError(f"instance {self.name!r} has {len(self.groups)} groups (per-rank mode): "
                                       "use .groups")
        return self.groups[0]

    def __repr__(self) -> str:
        return f"<Instance {self.name!r} ranks {sorted(self.blobs)} {self.state}>"


class Directory:
    """The instances of ``role`` in ``store``, watched every ``interval`` s; ``connect(name)``
    connects ``messenger`` to one lazily (one group per distinct handshake: a per-rank
    instance's groups go to ``receive`` together). ``ranks``: the role's TP size, so an
    instance whose rank processes are not all listed yet takes no request. ``on_change(instance)`` (optional) runs on the watch
    thread when an instance appears, is replaced, goes or dies."""

    def __init__(self, store: Store, messenger: Any, role: str = "prefill", *, interval: float = 0.25,
                 grace: float = 5.0, connect_timeout: Optional[float] = None, ranks: Optional[int] = None,
                 on_change: Optional[Callable[[Instance], Any]] = None) -> None:
        check_key(role)
        self.store = store
        self.m = messenger
        self.role = role
        self.grace = check_seconds(grace, "grace", 0.0)
        if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
            raise InvalidArgumentError(f"ranks must be a positive int (the TP size of the role), got {ranks!r}")
        self.ranks = ranks
        self.connect_timeout = connect_timeout
        self._on_change = on_change
        self._lock = threading.RLock()
        self._inst: dict[str, Instance] = {}
        self._later: list[Instance] = []     # gone, not yet told (_flush)
        self.counts = {"appeared": 0, "replaced": 0, "expired": 0, "dropped": 0, "connects": 0}
        self._watch: Watch = store.watch(role + "/", self._event, interval=interval, on_poll=self._tick)

    # -- what the watch sees -------------------------------------------------------------
    def _event(self, key: str, value: Optional[bytes]) -> None:
        parts = key.split("/")
        if len(parts) != 3 or not parts[2].isdigit():
            return
        name, rank = parts[1], int(parts[2])
        changed = None
        with self._lock:
            inst = self._inst.get(name)
            if value is None:
                if inst is not None and inst.blobs.pop(rank, None) is not None and not inst.blobs:
                    inst.absent_since = time.monotonic()
            else:
                if inst is not None and inst.groups and inst.seen.get(rank, value) != value:
                    # a new handshake under a connected name: the instance restarted (a new uid)
                    self._expire(inst, "restarted with a new handshake")
                    self.counts["replaced"] += 1
                    inst = None
                elif inst is not None and inst.state == "gone":
                    inst = None            # came back after it was declared gone: a new one
                if inst is None:
                    inst = self._inst[name] = Instance(name)
                    self.counts["appeared"] += 1
                    changed = inst
                inst.blobs[rank] = inst.seen[rank] = value
                inst.absent_since = None
            self._sweep()
        self._flush()
        if changed is not None:
            self._notify(changed)

    def _tick(self) -> None:
        """Every successful poll: an entry that went stays absent without any further event,
        so its grace runs out here, not only when someone asks for ``names()``."""
        with self._lock:
            self._sweep()
        self._flush()

    def _sweep(self) -> None:
        now = time.monotonic()
        for inst in list(self._inst.values()):
            if inst.absent_since is not None and now - inst.absent_since >= self.grace and inst.state != "gone":
                self._expire(inst, f"its lease expired (absent from the store for {self.grace} s)")

    def _expire(self, inst: Instance, why: str) -> None:
        """Lease expiry: the second failure signal. The instance takes no new requests; its
        groups are declared dead where the messenger can be told."""
        inst.state = "gone"
        inst.error = PeerError(f"instance {inst.name!r}: {why}")
        self.counts["expired"] += 1
        self._later.append(inst)             # told outside the lock (_flush)

    def _flush(self) -> None:
        """Tell the messenger and ``on_change`` about instances that went (never under the
        directory's lock: the messenger's teardown takes its own)."""
        while True:
            with self._lock:
                if not self._later:
                    return
                inst = self._later.pop(0)
            for g in inst.groups:
                if g.alive:
                    try:
                        self.m.drop_peer(g, inst.error)
                        self.counts["dropped"] += 1
                    except KvxferError:       # the messenger closed meanwhile
                        pass
            self._notify(inst)

    def _notify(self, inst: Instance) -> None:
        if self._on_change is not None:
            try:
                self._on_change(inst)
            except Exception:
                pass

    # -- the interface -------------------------------------------------------------------
    @property
    def store_ok(self) -> bool:
        """False while the last poll of the store failed (the list is then the last one read)."""
        return self._watch.error is None and self._watch.polls > 0

    def wait_for(self, n: int, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s until ``n`` instances are listed; returns them
        (``PeerError`` if fewer came)."""
        end = time.monotonic() + timeout
        while True:
            names = self.names()
            if len(names) >= n:
                return names
            if time.monotonic() > end:
                raise PeerError(f"{len(names)} {self.role} instance(s) listed after {timeout} s, wanted {n}: {names}"
                                + ("" if self.store_ok else f" (store: {self._watch.error})"))
            time.sleep(0.02)

    def names(self) -> list[str]:
        """The instances a request may go to: listed with every rank's entry, or connected,
        and neither gone nor dead (from the last successful poll: no store call)."""
        with self._lock:
            self._sweep()
            out = []
            for name, inst in sorted(self._inst.items()):
                if inst.groups:
                    if inst.alive:
                        out.append(name)
                    elif inst.state == "up":
                        inst.state = "dead"
                        inst.error = next((g.error for g in inst.groups if not g.alive), None)
                elif inst.state == "listed" and self._complete(inst):
                    out.append(name)
        self._flush()
        return out

    def instance(self, name: str) -> Optional[Instance]:
        with self._lock:
            return self._inst.get(name)

    def _complete(self, inst: Instance) -> bool:
        """An instance takes requests once ``ranks`` entries are listed (every TP rank: a
        per-rank instance publishes one per rank process, a node-mode one the same handshake
        under each rank); without ``ranks``, once any is."""
        return len(inst.blobs) >= (self.ranks or 1)

    def connect(self, name: str, timeout: Optional[float] = None) -> Instance:
        """The instance ``name``, connected (its groups up). Already connected and alive: no
        store call. Otherwise its handshakes come from the watch's view when the last poll
        succeeded and showed it, else from the store now (``RendezvousError`` if unreachable);
        ``PeerError`` if it is not listed, gone or dead, or does not answer."""
        check_key(name)
        with self._lock:
            inst = self._inst.get(name)
            if inst is not None and inst.groups:
                if inst.alive:
                    return inst
                raise inst.error or PeerError(f"instance {name!r} is dead")
            # a name the last poll did not show is looked up in the store now (so an unreachable
            # store is a RendezvousError, never "not listed"); a listed one needs no call
            fresh = not self.store_ok or inst is None or not inst.blobs or inst.state == "gone"
        if fresh:
            rows = self.store.list(f"{self.role}/{name}/")      # RendezvousError when unreachable
            for k, v in rows.items():
                self._event(k, v)
        with self._lock:
            inst = self._inst.get(name)
            if inst is None or not inst.blobs or inst.state == "gone":
                raise PeerError(f"no {self.role} instance {name!r} in {self.store.url}")
            if not self._complete(inst):
                raise PeerError(f"{self.role} instance {name!r} lists ranks {sorted(inst.blobs)} of {self.ranks}")
            blobs = list(dict.fromkeys(inst.blobs[r] for r in sorted(inst.blobs)))   # node mode: one blob
        with inst._lock:
            if inst.groups:
                return inst
            groups = []
            for b in blobs:
                groups.append(self.m.connect(b, timeout=timeout if timeout is not None else self.connect_timeout))
            with self._lock:
                self.counts["connects"] += len(groups)
                inst.groups = groups
                if inst.state == "listed":
                    inst.state = "up"
        return inst

    def close(self) -> None:
        """Stop watching (the messenger's groups stay: the messenger owns them)."""
        self._watch.close()

    def __enter__(self) -> "Directory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
