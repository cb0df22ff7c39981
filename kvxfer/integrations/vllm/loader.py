"""The decoder's loads: one TP rank's ``receive()``s into the blocks vLLM allocated, over
non-blocking connects to every prefill rank, written by the prefiller (push) or read from it
(``road="pull"``), finished through ``Messenger.poll()`` only once fenced (a block goes back to
vLLM only when no write or read of it can land any more)."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from kvxfer.errors import KvxferError, LayoutError, RejectedError, UnsupportedError
from kvxfer.integrations.vllm.params import Load
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

log = logging.getLogger("kvxfer.integrations.vllm")


def remember(d: dict, key: str, blocks: list[int], keep: int = 256) -> None:
    """``d[key] = blocks``, the oldest entries dropped past ``keep`` (for operators and tests)."""
    d[key] = [int(b) for b in blocks]
    while len(d) > keep:
        del d[next(iter(d))]


def outcome(r: Any, aborted: bool, error: Optional[BaseException]) -> str:
    """A finished load's outcome: done, aborted (by the client), rejected (the prefiller
    refused it: ``RejectedError``, recompute) or failed (a dead peer, a timeout, a bad peer)."""
    if r is not None and r.state == "done":
        return "done"
    if aborted:
        return "aborted"
    err = error if error is not None else (r.error if r is not None else None)
    return "rejected" if isinstance(err, RejectedError) else "failed"


class _Loading:
    """A decoder request whose KV is being written into its blocks."""

    __slots__ = ("receive", "load", "t0", "aborted", "error")

    def __init__(self, receive: Any, load: Load, t0: float, error: Optional[BaseException] = None) -> None:
        self.receive = receive
        self.load = load
        self.t0 = t0
        self.aborted = False
        self.error = error


class Loader:
    """The loads of one decoder rank (its own ``messenger``): ``start`` from each step's
    metadata, ``finished`` from ``poll()``; neither waits for the network."""

    def __init__(self, messenger: Any, options: Any, stats: KvxferConnectorStats, bytes_per_block: int) -> None:
        self.messenger = messenger
        self.options = options
        self.stats = stats
        self.bytes_per_block = bytes_per_block
        self._peers: dict[bytes, Any] = {}           # a prefill rank's handshake -> its PeerGroup
        self._loading: dict[str, _Loading] = {}      # vLLM request id -> its load
        self._by_receive: dict[Any, str] = {}        # Receive -> vLLM request id
        self._failed_now: list[str] = []             # loads that failed before a Receive existed
        self.recent_loads: dict[str, list[int]] = {}
        messenger.poll()                             # reporting on (the first call returns [])

    def _group(self, blob: bytes) -> Any:
        """The prefill rank's PeerGroup, connecting without waiting for its HELLO_ACK (a
        ``receive`` on it is queued until it is up, or fails with the connect's error)."""
        pg = self._peers.get(blob)
        if pg is None or not pg.alive:
            mine = self.messenger.layout
            try:
                pg = self.messenger.connect(blob, wait=False)
            except LayoutError as exc:
                raise LayoutError(f"{exc}: the prefiller's cache and this one ({mine.num_layers} layers) must be "
                                  "alike, and a draft model's layers are in the cache, so both instances need "
                                  "the same speculative_config") from exc
            theirs = pg.layout
            alike = theirs.page_size == mine.page_size and (
                theirs.kv == mine.kv == "packed_rows" or (theirs.kv, theirs.order) == (mine.kv, mine.order))
            if not alike:
                # the CPU kernel keeps a block's K transposed: only whole (head, block) runs of
                # two alike caches are exact, never a block split by tokens (the GPU backends'
                # rows, HND or NHD, meet each other by rows)
                raise UnsupportedError(f"the prefiller's cache ({theirs.kv} {theirs.order}, block "
                                       f"{theirs.page_size}) is not this one's ({mine.kv} {mine.order}, "
                                       f"block {mine.page_size})")
            self._peers[blob] = pg
        return pg

    def start(self, loads: dict[str, Load], aborts: set[str]) -> None:
        now = time.monotonic()
        for rid, load in loads.items():
            if rid in aborts:                        # aborted before it started: nothing to fence
                self._loading[rid] = _Loading(None, load, now)
                self._loading[rid].aborted = True
                self._failed_now.append(rid)
                continue
            try:
                groups = [self._group(b) for b in load.handshakes]
                # whole blocks only (K is stored transposed per block): the count is rounded up
                # to the last block's end, so even the token path of a prefix hit moves whole
                # (head, block) runs; the source's bytes past the prompt travel, as before
                bs = self.messenger.layout.page_size
                end = -(-load.num_tokens // bs) * bs
                r = self.messenger.receive(groups, load.remote_request_id, load.block_ids, end,
                                           first_token=load.first_token, timeout=self.options.load_timeout,
                                           pull=self.options.road == "pull")
            except KvxferError as exc:
                log.warning("kvxfer: load of %s failed at once: %s", rid, exc)
                self._loading[rid] = _Loading(None, load, now, exc)
                self._failed_now.append(rid)
                continue
            self._loading[rid] = _Loading(r, load, now)
            self._by_receive[r] = rid
            remember(self.recent_loads, rid, load.block_ids)
        for rid in aborts:
            ld = self._loading.get(rid)
            if ld is not None and not ld.aborted:
                ld.aborted = True
                if ld.receive is not None and not ld.receive.done:
                    ld.receive.abort(timeout=0)      # asks; the fence comes through poll()

    def finished(self, wait: float = 0.0) -> tuple[set[str], set[str]]:
        """(finished, failed) vLLM request ids since the last call: every one fenced. With
        loads in flight and none ended, waits up to ``wait`` seconds for one."""
        ended = [(rid, None) for rid in self._failed_now]
        self._failed_now = []
        for x in self.messenger.poll(wait if self._loading and not ended else 0.0):
            rid = self._by_receive.get(x)
            if rid is not None and x.done and x.fenced:   # a final one not yet fenced comes again
                del self._by_receive[x]
                ended.append((rid, x))
        done: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for rid, r in ended:
            ld = self._loading.pop(rid, None)
            if ld is None:
                continue
            if r is not None:
                r.release()
            what = outcome(r, ld.aborted, ld.error)
            done.add(rid)
            ms = (now - ld.t0) * 1e3
            self.stats.record_load(what, ms, len(ld.load.block_ids) * self.bytes_per_block if what == "done" else 0)
            if what in ("failed", "rejected"):
                failed.add(rid)
                log.warning("kvxfer: load of %s %s: %s", rid, what, ld.error or (r.error if r else None))
        return done, failed

    def busy(self) -> bool:
        return bool(self._loading)
