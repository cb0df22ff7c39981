"""The connector's scheduler side inside vLLM 0.32's real v1 ``Scheduler``, no forward pass and
no network: the tests play the model runner, handing the scheduler ``ModelRunnerOutput``s
whose ``kv_connector_output`` says what the connector's worker side would have said
(finished_sending, finished_recving, failed_recving). The state machine vLLM and the
connector share: a prefiller holds a finished ``do_remote_decode`` request's blocks until
finished_sending; a decoder's request waits (``WAITING_FOR_REMOTE_KVS``) on its async load
into the blocks the connector names; a failed load recomputes or fails per
``kv_load_failure_policy``; an abort or a preemption never frees blocks a load may still
write. Seconds each (vLLM's import is the cost), so they run in ``make test-vllm``."""

from __future__ import annotations

import itertools
import os

import pytest

from conftest import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vllm is not installed (make test-vllm)", allow_module_level=True)

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

pytestmark = pytest.mark.timeout(300)
BLOCK = 32
#: what the prefiller's worker ranks would hand their scheduler (``get_handshake_metadata``):
#: the scheduler side only base64s it into ``kv_transfer_params``
HANDSHAKE = b"kvxfer-handshake-of-rank-0"
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def tiny(model):
    init_none_hash(sha256)
    return str(model)


def make_scheduler(model: str, role: str, policy: str = "recompute", num_blocks: int = 64,
                   max_batched: int = 2048, prefix_caching: bool = True) -> Scheduler:
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
            kv_role=role, kv_load_failure_policy=policy),
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


# -- the prefiller ------------------------------------------------------------------------------

def test_prefiller_holds_blocks_until_finished_sending(tiny):
    """A ``do_remote_decode`` request finishes after its one token; vLLM's scheduler keeps its
    blocks (the connector's ``request_finished`` delays the free) and the next step's
    metadata names them for the worker; the engine keeps stepping
    (``has_pending_push_work``) until the worker's finished_sending frees them."""
    s = make_scheduler(tiny, "kv_producer")
    free0 = free(s)
    r = request(70, max_tokens=1, params={"do_remote_decode": True})
    s.add_request(r)
    so, outs = step(s)
    assert so.num_scheduled_tokens[r.request_id] == 70
    (eco,) = outs[0].outputs
    assert eco.finish_reason is not None
    params = eco.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_request_id"] == r.request_id
    assert params["remote_num_tokens"] == 70 and len(params["remote_handshakes"]) == 1
    held = block_ids(s, r.request_id)
    assert len(held) == 3 and free(s) == free0 - 3              # held, not freed
    assert r.request_id in s.requests and s.has_requests()       # has_pending_push_work
    so, _ = step(s)                                              # the step the worker learns them
    assert so.kv_connector_metadata.sends == {r.request_id: (r.request_id, held)}
    for _ in range(3):                                           # the decoder has not asked yet
        step(s)
    assert free(s) == free0 - 3 and s.connector.has_pending_push_work()
    step(s, sending={r.request_id})
    assert free(s) == free0 and r.request_id not in s.requests
    assert not s.connector.has_pending_push_work() and not s.has_requests()


def test_prefiller_frees_requests_not_for_remote_decode_and_aborted_ones(tiny):
    """A plain request and an aborted ``do_remote_decode`` one (it never finished its prefill)
    are freed at once: nothing is held, no ``kv_transfer_params`` go out."""
    s = make_scheduler(tiny, "kv_producer")
    free0 = free(s)
    plain = request(40, max_tokens=1)
    aborted = request(40, max_tokens=3, params={"do_remote_decode": True})
    s.add_request(plain)
    s.add_request(aborted)
    _, outs = step(s)
    (eco,) = [o for o in outs[0].outputs if o.request_id == plain.request_id]
    assert eco.finish_reason is not None and eco.kv_transfer_params is None
    s.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    assert free(s) == free0 and s.requests == {}
    assert step(s)[0].kv_connector_metadata.sends == {}


def test_prefiller_decoder_first_streams_only_a_whole_prompt(tiny):
    """D first (``kvxfer_request_key``): a prompt this step computes whole is offered to the
    worker for layer streaming; one split by chunked prefill is not (a chunk boundary inside a
    block is not exact for the CPU cache), and is written when it finishes."""
    s = make_scheduler(tiny, "kv_producer", max_batched=64)
    whole = request(60, max_tokens=1, params={"do_remote_decode": True, "kvxfer_request_key": "k-whole"})
    s.add_request(whole)
    so, _ = step(s)
    assert so.kv_connector_metadata.streams == {whole.request_id: ("k-whole", block_ids(s, whole.request_id), 60)}
    step(s, sending={whole.request_id})
    chunked = request(100, max_tokens=1, params={"do_remote_decode": True, "kvxfer_request_key": "k-chunked"})
    s.add_request(chunked)
    so, outs = step(s)
    assert so.num_scheduled_tokens[chunked.request_id] == 64 and so.kv_connector_metadata.streams == {}
    so, outs = step(s)
    assert so.kv_connector_metadata.streams == {}
    params = outs[0].outputs[0].kv_transfer_params
    assert params["remote_request_id"] == "k-chunked"            # the proxy's key, not P's id
    assert step(s)[0].kv_connector_metadata.sends == {chunked.request_id: ("k-chunked",
                                                                          block_ids(s, chunked.request_id))}


# -- the decoder --------------------------------------------------------------------------------

def test_decoder_waits_for_its_async_load_then_computes_the_last_token(tiny):
    """A request with the prefiller's ``kv_transfer_params``: the connector claims the whole
    prompt as external tokens, loaded async into the blocks vLLM allocated (the step's
    metadata names them); the request waits in ``WAITING_FOR_REMOTE_KVS`` through steps
    without finished_recving, then runs only its last prompt token (to sample from) and
    decodes."""
    s = make_scheduler(tiny, "kv_consumer")
    free0 = free(s)
    r = request(77, max_tokens=3, params=decoder_params("p-1", 77))
    s.add_request(r)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = so.kv_connector_metadata.loads.values()
    assert load.remote_request_id == "p-1" and load.handshakes == [HANDSHAKE]
    assert load.block_ids == block_ids(s, r.request_id) and len(load.block_ids) == 3
    assert (load.first_token, load.num_tokens) == (0, 77)
    assert s.connector.connector_scheduler.external[r.request_id] == 77
    assert free(s) == free0 - 3
    for _ in range(3):
        so, _ = step(s)
        assert so.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert so.kv_connector_metadata.loads == {}
    step(s, recving={r.request_id})
    so, _ = step(s)
    assert so.num_scheduled_tokens == {r.request_id: 1} and r.status == RequestStatus.RUNNING
    assert block_ids(s, r.request_id) == load.block_ids          # the loaded blocks, kept
    while s.has_requests():
        step(s)
    assert free(s) == free0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decoder_failed_load_recomputes_or_fails_per_policy(tiny, policy):
    """The worker reports a load failed (``failed_recving``, with finished_recving: it is
    fenced): "recompute" computes the whole prompt locally and never asks the prefiller again;
    "fail" ends the request with an error. Its blocks are back either way."""
    s = make_scheduler(tiny, "kv_consumer", policy=policy)
    free0 = free(s)
    r = request(50, max_tokens=2, params=decoder_params("p-2", 50))
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _, outs = step(s, recving={r.request_id}, failed={r.request_id})
    if policy == "fail":
        (eco,) = outs[0].outputs
        assert eco.finish_reason is not None and str(eco.finish_reason) == "error" and eco.new_token_ids == []
        assert r.status == RequestStatus.FINISHED_ERROR and r.request_id not in s.requests
        assert free(s) == free0
        return
    so, _ = step(s)
    assert so.num_scheduled_tokens == {r.request_id: 50}        # recomputed from token 0
    assert so.kv_connector_metadata.loads == {}                  # no second load
    while s.has_requests():
        step(s)
    assert free(s) == free0


def test_decoder_abort_while_loading_frees_only_once_fenced(tiny):
    """The client aborts a request whose load is in flight: vLLM keeps its blocks (a write may
    still land), the next step's metadata asks the worker to abort it, and the blocks go back
    only with the worker's finished_recving (its Receive fenced)."""
    s = make_scheduler(tiny, "kv_consumer")
    free0 = free(s)
    r = request(90, params=decoder_params("p-3", 90))
    s.add_request(r)
    step(s)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert free(s) == free0 - 3
    so, _ = step(s)
    assert so.kv_connector_metadata.aborts == {r.request_id}
    step(s)
    assert free(s) == free0 - 3
    step(s, recving={r.request_id})
    assert free(s) == free0 and s.requests == {}


def test_decoder_load_in_flight_survives_preemption_pressure(tiny):
    """A small cache: request B runs and grows while A's load is in flight. The blocks A's load
    writes are never taken for B (a request waiting for remote KV is not a preemption victim:
    B preempts itself); A runs once its load is done, B afterwards; all blocks come back."""
    s = make_scheduler(tiny, "kv_consumer", num_blocks=6)       # 5 usable (vLLM keeps one)
    free0 = free(s)
    a = request(3 * BLOCK, max_tokens=2, params=decoder_params("p-4", 3 * BLOCK))
    s.add_request(a)
    so, _ = step(s)
    (load,) = so.kv_connector_metadata.loads.values()
    a_blocks = list(load.block_ids)
    b = request(BLOCK - 1, max_tokens=2 * BLOCK)                 # needs a 2nd, then a 3rd block
    s.add_request(b)
    preempted = False
    for _ in range(2 * BLOCK):
        so, _ = step(s)
        assert block_ids(s, a.request_id) == a_blocks and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        preempted = preempted or b.request_id in so.preempted_req_ids
        if preempted:
            break
    assert preempted and b.num_preemptions >= 1
    step(s, recving={a.request_id})
    so, _ = step(s)
    assert so.num_scheduled_tokens.get(a.request_id) == 1       # A runs on its loaded blocks
    for _ in range(200):
        if not s.has_requests():
            break
        step(s)
    assert not s.has_requests() and free(s) == free0


def test_decoder_preempted_after_its_load_recomputes_without_loading_again(tiny):
    """A request that loaded its prompt and decodes is preempted (the cache is full; it came
    after B, so it is the victim): vLLM frees its blocks; when it comes back it is computed
    locally (its prompt and what it generated, less any local prefix hit) and the connector
    starts no second load (the prefiller freed its blocks long ago). Both finish, every block
    comes back. No prefix caching: A's cached blocks would cover its prompt anyway."""
    s = make_scheduler(tiny, "kv_consumer", num_blocks=6, prefix_caching=False)   # 5 usable: B (3), A (4)
    free0 = free(s)
    b = request(BLOCK + 1, max_tokens=40)
    s.add_request(b)
    step(s)
    a = request(2 * BLOCK - 1, max_tokens=40, params=decoder_params("p-5", 2 * BLOCK - 1))
    s.add_request(a)
    so, _ = step(s)
    assert len(so.kv_connector_metadata.loads) == 1
    step(s, recving={a.request_id})
    so, _ = step(s)
    assert so.num_scheduled_tokens.get(a.request_id) == 1       # running on its loaded blocks
    preempted, back = False, None
    for _ in range(300):
        so, _ = step(s)
        assert so.kv_connector_metadata.loads == {}              # never a second load
        preempted = preempted or a.request_id in so.preempted_req_ids
        if preempted and back is None and a.request_id in so.num_scheduled_tokens:
            back = so.num_scheduled_tokens[a.request_id]
        if not s.requests:
            break
    assert preempted and a.num_preemptions >= 1 and back is not None
    assert a.request_id not in s.connector.connector_scheduler._local
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(a.output_token_ids) == 40
    assert free(s) == free0
