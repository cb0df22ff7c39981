"""A harness around vLLM 0.32's real v1 ``Scheduler`` with ``KvxferConnector`` as its KV
connector, for tests/vllm/test_vllm_sched.py: the scheduler made from a ``VllmConfig`` (vLLM's
connector factory makes the connector's scheduler side), requests, and the model runner's
outputs made by hand, carrying what the connector's worker side would report. Imports vLLM
(a minute of CPU on these cores): test_vllm_pd.py imports it while its instances start."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvxfer.integrations.vllm import KvxferConnector  # noqa: E402
from kvxfer.integrations.vllm.params import KvxferHandshake, producer_params  # noqa: E402

BLOCK = 32
#: what the prefiller's worker ranks would hand their scheduler (``get_handshake_metadata``):
#: the scheduler side only base64s it into ``kv_transfer_params``
HANDSHAKE = b"kvxfer-handshake-of-rank-0"
_ids = itertools.count(1)


def make_scheduler(model: str, role: str, policy: str = "recompute", num_blocks: int = 64,
                   max_batched: int = 2048, prefix_caching: bool = True, extra: dict | None = None) -> Scheduler:
    """vLLM's own ``Scheduler`` with ``KvxferConnector`` as its KV connector (made by vLLM's
    connector factory from the config, scheduler role) over a ``num_blocks`` cache."""
    mc = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=1024)
    cfg = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
            kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"))
    cfg.cache_config.num_gpu_blocks = num_blocks
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                                      dtype=torch.float32))])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                  block_size=BLOCK, log_stats=True)
    assert isinstance(s.connector, KvxferConnector)
    if role == "kv_producer":                     # what the engine core does after the workers' handshake
        s.connector.set_xfer_handshake_metadata({0: KvxferHandshake(HANDSHAKE)})
    return s


def request(n: int, max_tokens: int = 4, params: dict | None = None) -> Request:
    i = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = Request(request_id=f"req-{i}", prompt_token_ids=[(i * 7 + k) % 300 + 3 for k in range(n)],
                sampling_params=sp, pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = params
    return r


def output(reqs, sending=None, recving=None, failed=None, token: int = 5) -> ModelRunnerOutput:
    """The model runner's answer to a step: one sampled token per request it ran (none for a
    prompt still partly uncomputed: a chunked prefill's chunk, as vLLM's runner discards it),
    and what the connector's worker side reported."""
    ids = [r.request_id for r in reqs]
    kv = None
    if sending or recving or failed:
        kv = KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                               failed_recving=set(failed or ()))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={x: i for i, x in enumerate(ids)},
                             sampled_token_ids=[[token] if r.num_computed_tokens >= r.num_tokens else []
                                                for r in reqs], logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=kv)


def step(s: Scheduler, reqs=None, **kv):
    """One engine step: schedule, then the runner's output for the requests scheduled
    (``reqs`` to name them; by default every one scheduled)."""
    so = s.schedule()
    ran = reqs if reqs is not None else [s.requests[x] for x in so.num_scheduled_tokens]
    outs = s.update_from_output(so, output(ran, **kv))
    return so, outs


def free(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(s: Scheduler, rid: str) -> list[int]:
    (ids,) = s.kv_cache_manager.get_block_ids(rid)
    return list(ids)


def decoder_params(rid: str, n: int) -> dict:
    """What a prefiller's ``request_finished`` returned, as the proxy hands it to the decoder."""
    return producer_params(rid, [HANDSHAKE], n)




def ready() -> None:
    """Once per process: vLLM's block hashes need their seed hash."""
    init_none_hash(sha256)
