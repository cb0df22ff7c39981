"""The connector's worker side: each vLLM worker (TP rank) its own ``Engine`` and its own
``Messenger(..., ranks=[rank])`` over the KV cache vLLM allocated; a decoder rank loads with
``loader.Loader``, a prefiller rank writes with ``sender.Sender``. Nothing here waits for the
network inside an engine step: connects do not wait for the HELLO, finished work comes from
``Messenger.poll()``."""

from __future__ import annotations

import logging
from typing import Any, Optional

from kvxfer.errors import UnsupportedError
from kvxfer.integrations.vllm.layout import CacheRegions, cache_regions
from kvxfer.integrations.vllm.loader import Loader
from kvxfer.integrations.vllm.params import KvxferHandshake, Options, StepMeta
from kvxfer.integrations.vllm.sender import Sender
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

log = logging.getLogger("kvxfer.integrations.vllm")


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
        self._layer_index: dict[str, int] = {}      # layer name -> its index in the layout
        self.loader: Optional[Loader] = None
        self.sender: Optional[Sender] = None
        self._stats = KvxferConnectorStats()
        self.totals = KvxferConnectorStats()        #: the same counters since start, never reset
        self._prom: Any = None
        self._last_metrics: dict = {}

    # -- set-up ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        """Register this rank's KV storage once and start its engine and messenger."""
        import kvxfer
        from kvxfer.messenger import Messenger

        total_heads = self.vllm_config.model_config.get_total_num_kv_heads()
        self.cache = cache_regions(kv_caches, self.kv_cache_config, total_heads, self.tp_size)
        self._layer_index = {n: i for i, n in enumerate(self.cache.layer_names)}
        device = self.cache.owner[0].device
        if device.type != "cpu":
            # the layout is described (packed_rows); registering device memory here would take
            # Engine(hmem=True) and a device buffer per region, not run without a GPU
            raise UnsupportedError(f"the KV cache is on {device}: this connector registers host memory only "
                                   f"(vLLM's CPU backend); its layout would be {self.cache.layout}")
        o = self.options
        self.engine = kvxfer.Engine(o.provider, node=o.node, peer_timeout=o.peer_timeout,
                                    progress_rt_priority=o.progress_rt_priority)
        self.messenger = Messenger(
            self.engine, self.cache.layout, self.cache.sharding, {self.tp_rank: self.cache.regions},
            ranks=[self.tp_rank], peer_timeout=o.peer_timeout, secret=o.secret,
            on_request=self._on_request if self.producer else None,
            offer_pull=self.producer and o.road == "pull")
        if self.producer:
            self.sender = Sender(self.messenger, self.tp_rank, o, self._stats)
        else:
            geo = self.cache.layout.resolve(self.cache.sharding)
            self.loader = Loader(self.messenger, o, self._stats, geo.page_stride * self.cache.layout.num_layers)
        if o.metrics_port is not None:
            from kvxfer.messenger.metrics import serve_prometheus

            self._prom = serve_prometheus([self.messenger], o.metrics_port + self.tp_rank, addr=o.metrics_addr)
        log.info("kvxfer connector rank %d/%d: %s, %d region(s), engine %s, road %s, progress_rt %d",
                 self.tp_rank, self.tp_size, self.cache.layout, len(self.cache.regions), self.engine.provider,
                 o.road, self.engine.stats().get("progress_rt", 0))

    def _on_request(self, req: Any) -> None:
        if self.sender is not None:
            self.sender.on_request(req)

    def handshake(self) -> Optional[KvxferHandshake]:
        return None if self.messenger is None else KvxferHandshake(self.messenger.handshake())

    # -- every step ----------------------------------------------------------------------
    def begin_pass(self, meta: StepMeta) -> None:
        """Before the forward pass: a prefiller gives up the streams of prompts stopped before
        their last chunk, then streams the prompts (or chunks) the pass computes."""
        if self.sender is not None and meta.stream_ends:
            self.sender.end_streams(meta.stream_ends)
        if self.sender is not None and meta.streams:
            self.sender.begin_pass(meta.streams)

    def start_load_kv(self, meta: StepMeta) -> None:
        if self.sender is not None:
            self.sender.step(meta.sends)
        elif self.loader is not None:
            self.loader.start(meta.loads, meta.aborts)

    def transfer_results(self, idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call. On an
        ``idle`` step (it computed nothing) with transfers in flight, waits up to the
        ``idle_wait`` option for one to end (the engine would otherwise spin)."""
        wait = self.options.idle_wait if idle else 0.0
        if self.sender is not None:
            return self.sender.finished(wait), set(), set()
        if self.loader is not None:
            done, failed = self.loader.finished(wait)
            return set(), done, failed
        return set(), set(), set()

    def save_kv_layer(self, layer_name: str) -> None:
        """``layer_name`` computed (a target layer, or a draft model's: both are in the cache)."""
        if self.sender is not None:
            self.sender.layer_done(self._layer_index.get(layer_name))

    def wait_for_save(self) -> None:
        if self.sender is not None:
            self.sender.end_pass()

    def has_work(self) -> bool:
        return (self.sender is not None and self.sender.busy()) or (self.loader is not None and self.loader.busy())

    # -- what operators and tests read -----------------------------------------------------
    @property
    def recent_loads(self) -> dict:
        return self.loader.recent_loads if self.loader is not None else {}

    @property
    def recent_sends(self) -> dict:
        return self.sender.recent_sends if self.sender is not None else {}

    def stats(self) -> Optional[KvxferConnectorStats]:
        """The counters since the last call (vLLM's logging interval), the messenger's bytes and
        peer events among them, or None if nothing happened."""
        if self.messenger is not None and not self.messenger.closed:
            self._last_metrics = self._stats.record_metrics(self.messenger.metrics(), self._last_metrics)
        if self._stats.is_empty():
            return None
        s = KvxferConnectorStats(data=dict(self._stats.data, load_ms=list(self._stats.data["load_ms"])))
        self._stats.reset()
        self.totals.aggregate(s)
        return s

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.messenger is not None:
            try:
                self.messenger.close()
            finally:
                self.messenger = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
