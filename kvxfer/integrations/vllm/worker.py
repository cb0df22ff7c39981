"""The connector's worker side: one ``Messenger`` per TP rank over vLLM's registered KV cache;
the decoder sends its block ids in a REQUEST and waits for the exact count, the prefiller
writes a finished request's held blocks when that REQUEST comes. Never blocks an engine step
beyond a first connect's HELLO round trip."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from kvxfer.errors import KvxferError, UnsupportedError
from kvxfer.integrations.vllm.layout import CacheRegions, cache_regions
from kvxfer.integrations.vllm.params import KvxferHandshake, Load, Options, StepMeta
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

log = logging.getLogger("kvxfer.integrations.vllm")


def _remember(d: dict, key: str, blocks: list[int], keep: int = 256) -> None:
    d[key] = [int(b) for b in blocks]
    while len(d) > keep:
        del d[next(iter(d))]


class _Loading:
    """A decoder request whose KV is being written into its blocks."""

    __slots__ = ("receive", "load", "t0", "aborted", "error")

    def __init__(self, receive: Any, load: Load, t0: float, error: Optional[BaseException] = None) -> None:
        self.receive = receive
        self.load = load
        self.t0 = t0
        self.aborted = False
        self.error = error


class ConnectorWorker:
    """Worker-side state of one TP rank (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, options: Options, producer: bool) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.options = options
        self.producer = producer
        par = vllm_config.parallel_config
        self.tp_size = int(par.tensor_parallel_size)
        self.tp_rank = 0
        if self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        self.engine: Any = None
        self.messenger: Any = None
        self.cache: Optional[CacheRegions] = None
        self._lock = threading.Lock()
        self._peers: dict[bytes, Any] = {}          # handshake blob -> PeerGroup
        self._loading: dict[str, _Loading] = {}     # decoder: vLLM request id -> its load
        # prefiller, by transfer key (the REQUEST's id: vLLM's request id, or the proxy's
        # kvxfer_request_key): held blocks (vLLM request id, blocks, since), REQUESTs not yet
        # matched, Sends in flight (vLLM request id, Send)
        self._held: dict[str, tuple[str, list[int], float]] = {}
        self._asked: dict[str, Any] = {}
        self._asked_since: dict[str, float] = {}
        self._sending: dict[str, tuple[str, Any]] = {}
        self._done_sending: set[str] = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stats = KvxferConnectorStats()
        self.totals = KvxferConnectorStats()        #: the same counters since start, never reset
        #: the last requests' block ids, for operators and tests: loads (decoder: where the KV
        #: went) and sends (prefiller: where it came from), by request id
        self.recent_loads: dict[str, list[int]] = {}
        self.recent_sends: dict[str, list[int]] = {}

    # -- set-up ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        """Register vLLM's KV storage once and start this rank's messenger."""
        import kvxfer
        from kvxfer.messenger import Messenger

        total_heads = self.vllm_config.model_config.get_total_num_kv_heads()
        self.cache = cache_regions(kv_caches, self.kv_cache_config, total_heads, self.tp_size)
        if self.tp_size > 1 and self.producer:
            # kvxfer main's prefill messenger sends only with every rank in one process
            raise KvxferError("kvxfer's vLLM connector needs tensor_parallel_size=1 on the prefiller for now")
        o = self.options
        self.engine = kvxfer.Engine(o.provider, node=o.node, peer_timeout=o.peer_timeout)
        self.messenger = Messenger(
            self.engine, self.cache.layout, self.cache.sharding, {self.tp_rank: self.cache.regions},
            peer_timeout=o.peer_timeout, secret=o.secret,
            on_request=self._on_request if self.producer else None)
        if self.producer:
            self._thread = threading.Thread(target=self._housekeeping, name="kvxfer-vllm-asked", daemon=True)
            self._thread.start()
        log.info("kvxfer connector rank %d: %s, %d region(s), engine %s", self.tp_rank, self.cache.layout,
                 len(self.cache.regions), self.engine.provider)

    def handshake(self) -> Optional[KvxferHandshake]:
        return None if self.messenger is None else KvxferHandshake(self.messenger.handshake())

    # -- prefiller ---------------------------------------------------------------------
    def _on_request(self, req: Any) -> None:
        """A decoder's REQUEST (callback thread): write at once if the blocks are held."""
        key = str(req.request_id)
        with self._lock:
            held = self._held.get(key)
            if held is None or key in self._sending:
                self._asked[key] = req
                self._asked_since[key] = time.monotonic()
                return
            self._sending[key] = (held[0], None)   # in flight from here: never expired as unclaimed
        self._send(key, req, held[0], held[1])

    def _send(self, key: str, req: Any, rid: str, blocks: list[int]) -> None:
        n = len(req.dst_pages)
        src = blocks[len(blocks) - n:] if 0 < n <= len(blocks) else None
        try:
            if src is None:
                raise KvxferError(f"decoder asks for {n} blocks of {key!r}, which holds {len(blocks)}")
            s = self.messenger.send(req, src)
            s.finish()
            _remember(self.recent_sends, key, src)
        except KvxferError as exc:
            log.warning("kvxfer: cannot write %s: %s", key, exc)
            s = self._refuse(req)
        with self._lock:
            self._sending[key] = (rid, s)

    def _refuse(self, req: Any) -> Any:
        """Refuse a REQUEST with the fence (the decoder fails it and recomputes): a Send that
        posts nothing, aborted by the prefiller (main's messenger has no ``Request.reject``)."""
        s = self.messenger.stream(req)
        s.abort(timeout=0)
        return s

    def _prefill_step(self, meta: StepMeta) -> None:
        now = time.monotonic()
        ready = []
        with self._lock:
            for rid, (key, blocks) in meta.sends.items():
                self._held[key] = (rid, list(blocks), now)
                req = self._asked.pop(key, None)
                self._asked_since.pop(key, None)
                if req is not None:                 # D asked first: write at once
                    ready.append((key, req, rid, list(blocks)))
                    self._sending[key] = (rid, None)
        for key, req, rid, blocks in ready:
            self._send(key, req, rid, blocks)
        with self._lock:
            for key, (rid, s) in list(self._sending.items()):
                if s is not None and s.done:        # None: being posted by another thread
                    del self._sending[key]
                    self._held.pop(key, None)
                    self._done_sending.add(rid)
                    self._stats.record_send("done" if s.state == "done" else "failed")
            for key, (rid, _, since) in list(self._held.items()):
                if key not in self._sending and now - since > self.options.unclaimed_timeout:
                    del self._held[key]
                    self._done_sending.add(rid)
                    self._stats.record_send("unclaimed")

    def _housekeeping(self) -> None:
        """A prefiller's REQUESTs wait outside vLLM's steps (the engine may be idle): forget those
        the decoder aborted or whose decoder died, refuse those unclaimed for too long."""
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                for rid in [r for r, q in self._asked.items() if q.aborted or not q.peer.alive]:
                    del self._asked[rid]
                    self._asked_since.pop(rid, None)
                stale = [r for r, t in self._asked_since.items() if now - t > self.options.unclaimed_timeout]
                reqs = [self._asked.pop(r) for r in stale]
                for r in stale:
                    del self._asked_since[r]
            for req in reqs:                        # asked for a request this node never finished
                try:
                    self._refuse(req)
                except KvxferError as exc:
                    log.warning("kvxfer: cannot refuse %r: %s", req.request_id, exc)

    # -- decoder -----------------------------------------------------------------------
    def _peer(self, blob: bytes) -> Any:
        pg = self._peers.get(blob)
        if pg is None or not pg.alive:
            pg = self.messenger.connect(blob)
            mine = self.cache.layout
            if (pg.layout.kv, pg.layout.order, pg.layout.page_size) != (mine.kv, mine.order, mine.page_size):
                # the CPU kernel keeps a block's K transposed: only whole (head, block) runs of
                # two alike caches are exact, never a block split by tokens
                raise UnsupportedError(f"the prefiller's cache ({pg.layout.kv} {pg.layout.order}, block "
                                       f"{pg.layout.page_size}) is not this one's ({mine.kv} {mine.order}, "
                                       f"block {mine.page_size})")
            self._peers[blob] = pg
        return pg

    def _decode_step(self, meta: StepMeta) -> None:
        now = time.monotonic()
        for rid, load in meta.loads.items():
            if rid in meta.aborts:                  # aborted before it started: nothing to fence
                self._loading[rid] = _Loading(None, load, now)
                continue
            try:
                if len(load.handshakes) != 1:
                    raise KvxferError(f"the prefiller has {len(load.handshakes)} ranks; this connector "
                                      "loads from TP1 prefillers for now")
                pg = self._peer(load.handshakes[0])
                r = self.messenger.receive(pg, load.remote_request_id, load.block_ids, load.num_tokens,
                                           timeout=self.options.load_timeout)
                self._loading[rid] = _Loading(r, load, now)
                _remember(self.recent_loads, rid, load.block_ids)
            except KvxferError as exc:
                log.warning("kvxfer: load of %s failed at once: %s", rid, exc)
                self._loading[rid] = _Loading(None, load, now, exc)
        for rid in meta.aborts:
            ld = self._loading.get(rid)
            if ld is not None:
                ld.aborted = True
                if ld.receive is not None and not ld.receive.done:
                    ld.receive.abort(timeout=0)     # answered in the background; fenced later

    def _decode_results(self) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for rid, ld in list(self._loading.items()):
            r = ld.receive
            if r is None:
                ok, fenced = False, True
            elif not r.done:
                continue
            else:
                ok, fenced = r.state == "done", r.fenced
            if not fenced:                          # a write may still land: keep the blocks
                continue
            del self._loading[rid]
            done.add(rid)
            ms = (now - ld.t0) * 1e3
            if ok:
                nbytes = len(ld.load.block_ids) * self.cache.layout.resolve(self.cache.sharding).page_stride \
                    * self.cache.layout.num_layers if self.cache else 0
                self._stats.record_load("done", ms, nbytes)
            elif ld.aborted:
                self._stats.record_load("aborted", ms)
            else:
                failed.add(rid)
                self._stats.record_load("failed", ms)
                log.warning("kvxfer: load of %s failed: %s", rid, ld.error or (r.error if r else None))
        return done, failed

    # -- every step ----------------------------------------------------------------------
    def start_load_kv(self, meta: StepMeta) -> None:
        if self.messenger is None:
            return
        if self.producer:
            self._prefill_step(meta)
        else:
            self._decode_step(meta)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        if self.messenger is None:
            return set(), set(), set()
        if self.producer:
            self._prefill_step(StepMeta())
            with self._lock:
                out, self._done_sending = self._done_sending, set()
            return out, set(), set()
        done, failed = self._decode_results()
        return set(), done, failed

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._held or self._sending or self._loading)

    def stats(self) -> Optional[KvxferConnectorStats]:
        """The counters since the last call (vLLM's logging interval), or None if nothing moved."""
        if self._stats.is_empty():
            return None
        s, self._stats = self._stats, KvxferConnectorStats()
        self.totals.aggregate(s)
        return s

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.messenger is not None:
            try:
                self.messenger.close()
            finally:
                self.messenger = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
