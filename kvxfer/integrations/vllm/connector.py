"""``KvxferConnector``: vLLM 0.32's ``KVConnectorBase_V1`` over kvxfer, a thin facade that
forwards the scheduler-side calls to ``ConnectorScheduler`` and the worker-side calls to
``ConnectorWorker``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.integrations.vllm.params import Options, StepMeta
from kvxfer.integrations.vllm.scheduler import ConnectorScheduler
from kvxfer.integrations.vllm.stats import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.integrations.vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvxferConnector(KVConnectorBase_V1):
    """The P/D connector (``kv_role`` ``kv_producer`` for prefill, ``kv_consumer`` for
    decode). The proxy gives P a request with ``kv_transfer_params={"do_remote_decode":
    True}`` and ``max_tokens=1``; P's output carries the decoder's ``kv_transfer_params``
    (P's handshake, its request id), which go into D's request as they are."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"KvxferConnector needs kv_role kv_producer or kv_consumer, got {ktc.kv_role!r}")
        producer = ktc.kv_role == "kv_producer"
        self.options = Options.from_config(ktc.kv_connector_extra_config)
        self.connector_scheduler: Optional[ConnectorScheduler] = None
        self.connector_worker: Optional[ConnectorWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(vllm_config, producer)
        else:
            self.connector_worker = ConnectorWorker(vllm_config, kv_cache_config, self.options, producer)

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_handshakes(metadata)

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self.connector_worker is None else self.connector_worker.handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # before the forward pass (vLLM 0.32 calls start_load_kv after it when no load is
        # synchronous): a streaming prefiller schedules this pass's writes here
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(connector_metadata, StepMeta):
            self.connector_worker.begin_pass(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._connector_metadata
        self.connector_worker.start_load_kv(meta if isinstance(meta, StepMeta) else StepMeta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                      # loads finish before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # a streaming prefiller bumps its layer counter (D first); otherwise nothing
        if self.connector_worker is not None:
            self.connector_worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        meta = self._connector_metadata           # still bound: vLLM clears it after this call
        idle = isinstance(meta, StepMeta) and meta.idle
        sending, recving, failed = self.connector_worker.transfer_results(idle)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        return None if self.connector_worker is None else self.connector_worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferConnectorStats | None:
        return KvxferConnectorStats(data=data) if data is not None else KvxferConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
