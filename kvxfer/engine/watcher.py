"""The watcher: a native thread that posts armed writes when a 64-bit counter reaches their threshold.

``Watcher`` owns the thread (``_fabric.WatcherHandle``); ``WatchEntry`` is one armed group of
writes, which quacks like a ``Transfer``; ``WatchBatch`` the entries of one ``arm_groups`` call,
which quacks like one over all of them. Armed writes are checked like ``write_batch`` when
armed, then posted natively with no Python per layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from kvxfer import _maps
from kvxfer._check import as_int, check_triples
from kvxfer.engine._args import _as_offsets, _check_imm, _check_timeout, _check_rail, _nonneg, _timeout, _u64
from kvxfer.engine.rails import _fabric
from kvxfer.errors import InvalidArgumentError, KvxferError, TimeoutError

if TYPE_CHECKING:
    from kvxfer.engine.engine import Engine
    from kvxfer.engine.rails import Peer
    from kvxfer.engine.regions import MemoryRegion, RemoteRegion


#: The longest watcher poll interval (µs) ``Engine.watcher`` takes: its nanoseconds fit an int64.
MAX_POLL_US = 1e9


def check_watch(poll_us, rt_priority, prefix: str = "", *, polled: bool = False) -> None:
    """A watcher's poll interval (µs, at most ``MAX_POLL_US``; 0: it never polls, only a
    ``bump()``, ``advance()`` or arming an entry due now wakes it) and SCHED_FIFO priority (0..99); ``prefix``
    names them as the caller's options do (the messenger's ``watch_``). ``polled``: the counter
    is written where no bump is seen (a caller's own word, a CUDA-mapped one), so 0 is refused:
    the thread would never see it move."""
    if isinstance(poll_us, bool) or not isinstance(poll_us, (int, float)) or not 0 <= poll_us <= MAX_POLL_US:
        raise InvalidArgumentError(f"{prefix}poll_us must be a number from 0 to {MAX_POLL_US:g}, "
                                   f"got {poll_us!r}")
    if poll_us == 0 and polled:
        raise InvalidArgumentError(f"{prefix}poll_us=0 (no polling) needs a counter that only bump() and "
                                   "advance() change: this one is written elsewhere (a caller's word or a "
                                   "CUDA-mapped one), so the watcher must poll it")
    if 0 < poll_us < 1e-3:
        raise InvalidArgumentError(f"{prefix}poll_us must be 0 or at least 0.001 (1 ns), got {poll_us!r}")
    as_int(rt_priority, f"{prefix}rt_priority", minimum=0, maximum=99)


_check_watch = check_watch          # the name of before (kvxfer.engine still exports it)


def _check_word(word) -> int:
    """A watcher's counter address: 0 (it allocates one) or an 8-byte-aligned u64 that is
    mapped writable in this process (the thread reads it natively; a wild one would crash)."""
    word = _nonneg(word, "word")
    if word:
        if word % 8 or word >= 2**64 - 8:
            raise InvalidArgumentError(f"word {word:#x} is not the address of an aligned 64-bit counter")
        _maps.check_writable(word, 8)
    return word




class WatchEntry:
    """Writes armed on a ``Watcher``: posted natively once its counter reaches ``threshold``.

    Quacks like a ``Transfer``: ``num_writes`` (exact, known at arming), ``posted``,
    ``done`` (posted and complete, or disarmed), ``error``, ``cancel()`` (disarm, or stop
    posting what was posted), ``wait()``. ``state``: "armed", "posting", "posted",
    "disarmed" or "failed". It keeps its source region alive."""

    __slots__ = ("_h", "_src", "_batch", "nbytes", "imm", "tag", "__weakref__")

    def __init__(self, h: Any, src: "MemoryRegion", nbytes: int, imm: Optional[int], tag: int,
                 batch: Any = None) -> None:
        self._h = h
        self._src = src
        self._batch = batch     # a batch's entry keeps its batch (the region tracks the batch)
        self.nbytes = nbytes
        self.imm = imm
        self.tag = tag

    num_writes = property(lambda self: self._h.num_writes, doc="Messages it posts (the message rule).")
    posted = property(lambda self: self._h.posted, doc="Messages handed to the provider so far.")
    done = property(lambda self: self._h.done, doc="Disarmed, failed, or posted and complete.")
    state = property(lambda self: self._h.state, doc="armed, posting, posted, disarmed or failed.")
    threshold = property(lambda self: self._h.threshold, doc="The counter value that fires it.")
    fired_ns = property(lambda self: self._h.fired_ns, doc="CLOCK_MONOTONIC ns of its post call (0 before).")

    @property
    def fired(self) -> bool:
        """Posted (or failed to post)."""
        return self._h.state in ("posted", "failed")

    @property
    def error(self) -> Optional[KvxferError]:
        return self._h.error

    def entries_in(self, state: str, above: int = 0, upto: int = 2**64 - 1) -> int:
        """1 if it is in ``state`` with its threshold in ``(above, upto]``, else 0 (as
        ``WatchBatch.entries_in`` over one entry)."""
        if state not in _STATES:
            raise InvalidArgumentError(f"state must be one of {', '.join(_STATES)}, got {state!r}")
        return int(self._h.state == state and _u64(above, "above") < self._h.threshold <= _u64(upto, "upto"))

    def disarm(self) -> bool:
        """True if it was still armed and now never posts; False if it was already posted."""
        return self._h.disarm()

    def cancel(self) -> None:
        """Disarm it, or if it was posted post nothing more (what was posted completes)."""
        self._h.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until ``done``; raise its error, or TimeoutError."""
        if not self._h.wait(_timeout(timeout)):
            raise TimeoutError(f"watch entry still {self.state} after {timeout} s")
        err = self.error
        if err is not None:
            raise err

    def __repr__(self) -> str:
        return f"<WatchEntry at {self.threshold}: {self.num_writes} writes, {self.state}>"


class WatchBatch(Sequence[WatchEntry]):
    """The entries of one ``Watcher.arm_groups`` call, one per group in group order
    (``batch[g]`` is a ``WatchEntry``, made on first use), and also, over all of them, what a
    ``Transfer`` answers: ``num_writes``, ``nbytes``, ``posted``, ``done``, ``error``,
    ``cancel()``, ``wait()``, each one native loop. A request's streamed writes are one batch
    per region pair, so the messenger asks a batch, not each of its thousands of entries;
    ``entries_in(state, above, upto)`` counts the entries in a state with thresholds in
    ``(above, upto]``."""

    __slots__ = ("_h", "_src", "_entries", "imm", "tag")

    def __init__(self, h: Any, src: "MemoryRegion", imm: Optional[int], tag: int) -> None:
        self._h = h
        self._src = src
        self._entries: Optional[list[WatchEntry]] = None
        self.imm = imm
        self.tag = tag

    num_writes = property(lambda self: self._h.num_writes, doc="Messages its entries post (the message rule).")
    nbytes = property(lambda self: self._h.nbytes, doc="Bytes its entries write.")
    posted = property(lambda self: self._h.posted, doc="Messages handed to the provider so far.")
    done = property(lambda self: self._h.done, doc="Every entry disarmed, failed, or posted and complete.")
    error = property(lambda self: self._h.error, doc="The first entry's error, in group order, or None.")

    def _all(self) -> list[WatchEntry]:
        if self._entries is None:
            self._entries = [WatchEntry(h, self._src, h.nbytes, self.imm, self.tag, self._h)
                             for h in self._h.entries]
        return self._entries

    def __len__(self) -> int:
        return len(self._h)

    def __getitem__(self, i):  # type: ignore[override]
        return self._all()[i]

    def __iter__(self) -> Iterator[WatchEntry]:
        return iter(self._all())

    def entries_in(self, state: str, above: int = 0, upto: int = 2**64 - 1) -> int:
        """Entries in ``state`` (armed, posting, posted, disarmed, failed) whose threshold is
        in ``(above, upto]``."""
        if state not in _STATES:
            raise InvalidArgumentError(f"state must be one of {', '.join(_STATES)}, got {state!r}")
        return self._h.count(state, _u64(above, "above"), _u64(upto, "upto"))

    def cancel(self) -> None:
        """Cancel every entry (``WatchEntry.cancel``)."""
        self._h.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until ``done``; raise the first error, or TimeoutError."""
        if not self._h.wait(_timeout(timeout)):
            raise TimeoutError(f"{len(self)} watch entries not all done after {timeout} s")
        err = self.error
        if err is not None:
            raise err

    def __repr__(self) -> str:
        return f"<WatchBatch of {len(self)} entries: {self.num_writes} writes>"


_STATES = ("armed", "posting", "posted", "disarmed", "failed")


class Watcher:
    """A native thread (``kvxfer-watch``) that watches a monotonic 64-bit counter and posts
    armed writes when it reaches their threshold (``Engine.watcher``). No Python runs per
    layer: the thread compares, then posts through the engine's native path.

    ``word``: the counter's address; 0 lets the watcher allocate it (``ptr``). ``keep``: the
    owner of external memory, kept alive. The thread blocks when nothing is armed, polls every
    ``poll_us`` while something is, and ``bump()`` wakes it at once. ``poll_us=0`` (its own
    word only): it never polls, armed or not; ``bump()``, ``advance()`` and arming a due entry wake it, and
    a write to ``ptr`` by any other means is not seen until one of them. ``rt_priority`` > 0 asks
    for SCHED_FIFO (it sleeps between polls; ``stats()["rt"]`` says whether it was granted)."""

    def __init__(self, engine: "Engine", word: int = 0, poll_us: float = 10.0, cpus: Iterable[int] = (),
                 keep: Any = None, rt_priority: int = 0) -> None:
        self.engine = engine
        self._h = _fabric.WatcherHandle(int(word), int(poll_us * 1000), tuple(cpus), keep, int(rt_priority))

    @property
    def ptr(self) -> int:
        """The counter's address (host memory)."""
        return self._h.word

    @property
    def value(self) -> int:
        return self._h.value

    def bump(self, n: int = 1) -> int:
        """Add ``n`` (CPU) and wake the thread; returns the new value. Refused
        (``InvalidArgumentError``, nothing added) when it would take the counter past
        2**64 - 1: a wrapped counter would never reach the thresholds armed above it."""
        return self._h.bump(_u64(n, "n"))

    def advance(self, to: int) -> int:
        """Raise the counter to at least ``to``; returns its value after."""
        return self._h.advance(_u64(to, "to"))

    def arm(self, threshold: int, src: "MemoryRegion", peer: "Peer", dst: "RemoteRegion", src_offsets, dst_offsets,
            lengths, *, imm: Optional[int] = None, tag: int = 0, rail: int = 0) -> WatchEntry:
        """Arm ``write_batch``'s triples for when the counter reaches ``threshold`` (checked
        like ``write_batch`` now; posted on local rail ``rail`` to the peer's rail
        ``rail % peer rails``). ``tag`` groups entries for ``disarm_tag``."""
        eng = self.engine
        eng._endpoints(src, peer, dst)
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        check_triples(so, do, ln, src.nbytes, dst.nbytes)
        imm = _check_imm(imm)
        threshold = _u64(threshold, "threshold")
        if threshold >= 2**62:             # as arm_groups bounds its thresholds (kx_watch_bounds)
            raise InvalidArgumentError(f"threshold must be below 2**62, got {threshold}")
        tag = _u64(tag, "tag")
        rail = _check_rail(rail, len(eng._rails))
        handles = src._live()
        r = eng._rails[rail]
        h = self._h.arm(threshold, tag, r, peer.fi_addrs[rail], peer.gens[rail], src.ptr, handles[rail], dst.base, dst.keys[rail],
                        dst._direct_from(src), np.ascontiguousarray(so, np.uint64),
                        np.ascontiguousarray(do, np.uint64), np.ascontiguousarray(ln, np.uint64), imm, eng.iov,
                        eng.max_write, dst._pack_min, src.nbytes, dst.nbytes)
        return WatchEntry(h, src, h.nbytes, imm, int(tag))

    def arm_groups(self, thresholds, src: "MemoryRegion", peer: "Peer", dst: "RemoteRegion", src_offsets,
                   dst_offsets, lengths, starts, *, base: int = 0, imm: Optional[int] = None, tag: int = 0,
                   rail: int = 0) -> "WatchBatch":
        """``arm`` for many groups of one region pair at once (e.g. every layer of a rank
        pair): group g is triples ``[starts[g], starts[g + 1])`` armed at ``base +
        thresholds[g]``. Armed in one native loop that checks uint64 thresholds and triples and
        int64 starts on its own copies (any other form, or a failed check, goes through
        numpy's checks, which name the defect); the entries come back as one ``WatchBatch``."""
        eng = self.engine
        eng._endpoints(src, peer, dst)
        tag = _u64(tag, "tag")
        base = _u64(base, "base")
        imm = _check_imm(imm)
        rail = _check_rail(rail, len(eng._rails))
        handles = src._live()
        args = (base, tag, eng._rails[rail], peer.fi_addrs[rail], peer.gens[rail], src.ptr, handles[rail], dst.base,
                dst.keys[rail], dst._direct_from(src))
        limits = (imm, eng.iov, eng.max_write, dst._pack_min, src.nbytes, dst.nbytes)
        try:
            hb = self._h.arm_groups(thresholds, *args, src_offsets, dst_offsets, lengths, starts, *limits)
        except (TypeError, ValueError, BufferError):       # not the arrays the native pass takes
            hb = None
        if hb is None:
            th, so, do, ln, st = self._group_args(thresholds, base, src, dst, src_offsets, dst_offsets, lengths,
                                                  starts)
            hb = self._h.arm_groups(th, *args, so, do, ln, st, *limits)
            if hb is None:                # checked above: only another thread's change gets here
                raise InvalidArgumentError("arm_groups' arguments changed while being armed")
        return WatchBatch(hb, src, imm, int(tag))

    @staticmethod
    def _group_args(thresholds, base: int, src: "MemoryRegion", dst: "RemoteRegion", src_offsets, dst_offsets,
                    lengths, starts) -> tuple:
        """``arm_groups``' checks of what the native pass refused or does not take: the
        arguments as private contiguous arrays (uint64, starts int64), or the precise error."""
        so = _as_offsets(src_offsets, "src_offsets")
        do = _as_offsets(dst_offsets, "dst_offsets")
        ln = _as_offsets(lengths, "lengths")
        th = _as_offsets(thresholds, "thresholds")
        st = _as_offsets(starts, "starts").astype(np.int64)
        if not (len(so) == len(do) == len(ln)):
            raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
        if (st.ndim != 1 or len(st) != len(th) + 1 or st[0] != 0 or st[-1] != len(ln)
                or (np.diff(st) < 0).any()):
            raise InvalidArgumentError("starts must run from 0 to the number of triples, one more than thresholds")
        check_triples(so, do, ln, src.nbytes, dst.nbytes)
        top = int(th.max()) if len(th) else 0
        if base + top >= 2**62:
            raise InvalidArgumentError(f"base + thresholds must be below 2**62, got {base} + {top}")
        if len(ln) and (np.cumsum(ln, dtype=np.uint64) < ln).any():    # each below 2**62: a wrap shows
            raise InvalidArgumentError("the lengths add up past 2**64 bytes")
        return th, so, do, ln, st          # private copies (_as_offsets)

    def disarm_tag(self, tag: int) -> int:
        """Disarm every still-armed entry of ``tag``; returns how many."""
        return self._h.disarm_tag(_u64(tag, "tag"))

    def latencies(self) -> tuple[list[int], list[int]]:
        """CPU ``bump()`` -> first post of what it fired, in ns, since the last call: to the
        native post call, and to its return."""
        return self._h.latencies()

    def stats(self) -> dict:
        return self._h.stats()

    def close(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (idempotent); armed entries never post."""
        self._h.close(_check_timeout(timeout))

    @property
    def closed(self) -> bool:
        return bool(self._h.closed)

