"""kvxfer's KV connector for vLLM: ``KVTransferConfig(kv_connector="KvxferConnector",
kv_connector_module_path="kvxfer.integrations.vllm", kv_role="kv_producer" | "kv_consumer")``.

Pinned to vLLM 0.32 (its ``KVConnectorBase_V1`` is marked experimental). See docs/vllm.md.
"""

from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.params import VLLM_VERSION
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

__all__ = ["KvxferConnector", "KvxferConnectorStats", "VLLM_VERSION"]
