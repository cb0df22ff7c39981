"""The connector's scheduler side inside vLLM 0.32's real v1 ``Scheduler``, no forward pass and
no network: the tests play the model runner, handing the scheduler ``ModelRunnerOutput``s
whose ``kv_connector_output`` says what the connector's worker side would have said
(finished_sending, finished_recving, failed_recving). The state machine vLLM and the
connector share: a prefiller holds a finished ``do_remote_decode`` request's blocks until
finished_sending; a decoder's request waits (``WAITING_FOR_REMOTE_KVS``) on its async load
into the blocks the connector names; a failed load recomputes or fails per
``kv_load_failure_policy``; an abort or a preemption never frees blocks a load may still
write. Well under a second each; the harness (tests/vllm/_sched.py) imports vLLM when the
first test needs it, which test_vllm_pd.py's instances have paid for already in a full run."""

from __future__ import annotations

import pytest

from conftest import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vllm is not installed (make test-vllm)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def h():
    """The harness (tests/vllm/_sched.py: vLLM's Scheduler with the connector, by hand)."""
    import _sched

    _sched.ready()
    return _sched


@pytest.fixture(scope="module")
def tiny(model):
    return str(model)


def test_connector_options_are_checked_when_vllm_makes_it(h, tiny):
    """``kv_connector_extra_config`` is read when vLLM's factory makes the connector: ``road``,
    ``progress_rt_priority`` and ``idle_wait`` reach its options, a bad value is refused there with
    ``InvalidArgumentError`` naming the key."""
    from kvxfer.errors import InvalidArgumentError

    s = h.make_scheduler(tiny, "kv_producer", extra={"road": "pull", "progress_rt_priority": 3})
    assert (s.connector.options.road, s.connector.options.progress_rt_priority) == ("pull", 3)
    s = h.make_scheduler(tiny, "kv_consumer")
    assert (s.connector.options.road, s.connector.options.progress_rt_priority) == ("push", 0)
    assert s.connector.options.idle_wait == 0.005
    assert h.make_scheduler(tiny, "kv_consumer", extra={"idle_wait": 0}).connector.options.idle_wait == 0.0
    for bad, key in (({"road": "sideways"}, "road"), ({"progress_rt_priority": 100}, "progress_rt_priority"),
                     ({"progress_rt_priority": True}, "progress_rt_priority"), ({"idle_wait": -0.001}, "idle_wait"),
                     ({"idle_wait": 2}, "idle_wait"), ({"idle_wait": True}, "idle_wait"),
                     ({"idle_wait": "5ms"}, "idle_wait"), ({"idle_wait": float("nan")}, "idle_wait")):
        with pytest.raises(InvalidArgumentError, match=key):
            h.make_scheduler(tiny, "kv_consumer", extra=bad)


# -- the prefiller ------------------------------------------------------------------------------

def test_prefiller_holds_blocks_until_finished_sending(h, tiny):
    """A ``do_remote_decode`` request finishes after its one token; vLLM's scheduler keeps its
    blocks (the connector's ``request_finished`` delays the free) and the next step's
    metadata names them for the worker; the engine keeps stepping
    (``has_pending_push_work``) until the worker's finished_sending frees them."""
    s = h.make_scheduler(tiny, "kv_producer")
    free0 = h.free(s)
    r = h.request(70, max_tokens=1, params={"do_remote_decode": True})
    s.add_request(r)
    so, outs = h.step(s)
    assert so.num_scheduled_tokens[r.request_id] == 70
    (eco,) = outs[0].outputs
    assert eco.finish_reason is not None
    params = eco.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_request_id"] == r.request_id
    assert params["remote_num_tokens"] == 70 and len(params["remote_handshakes"]) == 1
    held = h.block_ids(s, r.request_id)
    assert len(held) == 3 and h.free(s) == free0 - 3              # held, not freed
    assert r.request_id in s.requests and s.has_requests()       # has_pending_push_work
    so, _ = h.step(s)                                              # the step the worker learns them
    assert so.kv_connector_metadata.sends == {r.request_id: (r.request_id, held)}
    for _ in range(3):                                           # the decoder has not asked yet
        h.step(s)
    assert h.free(s) == free0 - 3 and s.connector.has_pending_push_work()
    h.step(s, sending={r.request_id})
    assert h.free(s) == free0 and r.request_id not in s.requests
    assert not s.connector.has_pending_push_work() and not s.has_requests()


def test_prefiller_frees_requests_not_for_remote_decode_and_aborted_ones(h, tiny):
    """A plain request and an aborted ``do_remote_decode`` one (it never finished its prefill)
    are freed at once: nothing is held, no ``kv_transfer_params`` go out."""
    s = h.make_scheduler(tiny, "kv_producer")
    free0 = h.free(s)
    plain = h.request(40, max_tokens=1)
    aborted = h.request(40, max_tokens=3, params={"do_remote_decode": True})
    s.add_request(plain)
    s.add_request(aborted)
    _, outs = h.step(s)
    (eco,) = [o for o in outs[0].outputs if o.request_id == plain.request_id]
    assert eco.finish_reason is not None and eco.kv_transfer_params is None
    s.finish_requests(aborted.request_id, h.RequestStatus.FINISHED_ABORTED)
    assert h.free(s) == free0 and s.requests == {}
    assert h.step(s)[0].kv_connector_metadata.sends == {}


def test_prefiller_decoder_first_streams_whole_prompts_and_chunks(h, tiny):
    """D first (``kvxfer_request_key``): a prompt this step computes whole is offered to the
    worker for layer streaming in that step; one split by chunked prefill is offered at each
    of its chunks, with its blocks so far and the tokens computed once the pass is over; it
    is held under the proxy's key when it finishes, as any other."""
    from kvxfer.integrations.vllm.params import Stream

    s = h.make_scheduler(tiny, "kv_producer", max_batched=64)
    whole = h.request(60, max_tokens=1, params={"do_remote_decode": True, "kvxfer_request_key": "k-whole"})
    s.add_request(whole)
    so, _ = h.step(s)
    assert so.kv_connector_metadata.streams == {whole.request_id: Stream("k-whole", h.block_ids(s, whole.request_id),
                                                                         60, 60)}
    h.step(s, sending={whole.request_id})
    chunked = h.request(150, max_tokens=1, params={"do_remote_decode": True, "kvxfer_request_key": "k-chunked"})
    s.add_request(chunked)
    ends = []
    for _ in range(3):
        so, outs = h.step(s)
        (st,) = so.kv_connector_metadata.streams.values()
        assert (st.key, st.num_tokens) == ("k-chunked", 150)
        assert st.blocks == h.block_ids(s, chunked.request_id)[:len(st.blocks)] and len(st.blocks) == -(-st.end // 32)
        ends.append(st.end)
    assert ends == [64, 128, 150] and so.kv_connector_metadata.stream_ends == {}
    params = outs[0].outputs[0].kv_transfer_params
    assert params["remote_request_id"] == "k-chunked"            # the proxy's key, not P's id
    so, _ = h.step(s)
    assert so.kv_connector_metadata.streams == {}
    assert so.kv_connector_metadata.sends == {chunked.request_id: ("k-chunked", h.block_ids(s, chunked.request_id))}


def test_prefiller_chunked_stream_aborted_midway_is_given_up_and_held(h, tiny):
    """A chunked D-first prompt aborted between its chunks: the next step tells the worker to
    give its stream up (``stream_ends``, True: vLLM holds the blocks), and its blocks come
    back only with the worker's finished_sending (its aborted writes final)."""
    s = h.make_scheduler(tiny, "kv_producer", max_batched=64)
    free0 = h.free(s)
    r = h.request(150, max_tokens=1, params={"do_remote_decode": True, "kvxfer_request_key": "k-ab"})
    s.add_request(r)
    so, _ = h.step(s)
    assert so.kv_connector_metadata.streams[r.request_id].end == 64
    s.finish_requests(r.request_id, h.RequestStatus.FINISHED_ABORTED)
    assert h.free(s) < free0                                     # held for the stream's writes
    so, _ = h.step(s)
    assert so.kv_connector_metadata.stream_ends == {r.request_id: True} and so.kv_connector_metadata.streams == {}
    assert s.connector.has_pending_push_work()
    h.step(s, sending={r.request_id})
    assert h.free(s) == free0 and not s.connector.has_pending_push_work()


# -- the decoder --------------------------------------------------------------------------------

def test_decoder_waits_for_its_async_load_then_computes_the_last_token(h, tiny):
    """A request with the prefiller's ``kv_transfer_params``: the connector claims the whole
    prompt as external tokens, loaded async into the blocks vLLM allocated (the step's
    metadata names them); the request waits in ``WAITING_FOR_REMOTE_KVS`` through steps
    without finished_recving, then runs only its last prompt token (to sample from) and
    decodes."""
    s = h.make_scheduler(tiny, "kv_consumer")
    free0 = h.free(s)
    r = h.request(77, max_tokens=3, params=h.decoder_params("p-1", 77))
    s.add_request(r)
    so, _ = h.step(s)
    assert so.num_scheduled_tokens == {}
    assert r.status == h.RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = so.kv_connector_metadata.loads.values()
    assert load.remote_request_id == "p-1" and load.handshakes == [h.HANDSHAKE]
    assert load.block_ids == h.block_ids(s, r.request_id) and len(load.block_ids) == 3
    assert (load.first_token, load.num_tokens) == (0, 77)
    assert s.connector.connector_scheduler.external[r.request_id] == 77
    assert h.free(s) == free0 - 3
    for _ in range(3):
        so, _ = h.step(s)
        assert so.num_scheduled_tokens == {} and r.status == h.RequestStatus.WAITING_FOR_REMOTE_KVS
        assert so.kv_connector_metadata.loads == {}
        assert so.kv_connector_metadata.idle          # nothing computed: the worker may wait
    h.step(s, recving={r.request_id})
    so, _ = h.step(s)
    assert so.num_scheduled_tokens == {r.request_id: 1} and r.status == h.RequestStatus.RUNNING
    assert not so.kv_connector_metadata.idle
    assert h.block_ids(s, r.request_id) == load.block_ids          # the loaded blocks, kept
    while s.has_requests():
        h.step(s)
    assert h.free(s) == free0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decoder_failed_load_recomputes_or_fails_per_policy(h, tiny, policy):
    """The worker reports a load failed (``failed_recving``, with finished_recving: it is
    fenced): "recompute" computes the whole prompt locally and never asks the prefiller again;
    "fail" ends the request with an error. Its blocks are back either way."""
    s = h.make_scheduler(tiny, "kv_consumer", policy=policy)
    free0 = h.free(s)
    r = h.request(50, max_tokens=2, params=h.decoder_params("p-2", 50))
    s.add_request(r)
    h.step(s)
    assert r.status == h.RequestStatus.WAITING_FOR_REMOTE_KVS
    _, outs = h.step(s, recving={r.request_id}, failed={r.request_id})
    if policy == "fail":
        (eco,) = outs[0].outputs
        assert eco.finish_reason is not None and str(eco.finish_reason) == "error" and eco.new_token_ids == []
        assert r.status == h.RequestStatus.FINISHED_ERROR and r.request_id not in s.requests
        assert h.free(s) == free0
        return
    so, _ = h.step(s)
    assert so.num_scheduled_tokens == {r.request_id: 50}        # recomputed from token 0
    assert so.kv_connector_metadata.loads == {}                  # no second load
    while s.has_requests():
        h.step(s)
    assert h.free(s) == free0


def test_decoder_abort_while_loading_frees_only_once_fenced(h, tiny):
    """The client aborts a request whose load is in flight: vLLM keeps its blocks (a write may
    still land), the next step's metadata asks the worker to abort it, and the blocks go back
    only with the worker's finished_recving (its Receive fenced)."""
    s = h.make_scheduler(tiny, "kv_consumer")
    free0 = h.free(s)
    r = h.request(90, params=h.decoder_params("p-3", 90))
    s.add_request(r)
    h.step(s)
    s.finish_requests(r.request_id, h.RequestStatus.FINISHED_ABORTED)
    assert h.free(s) == free0 - 3
    so, _ = h.step(s)
    assert so.kv_connector_metadata.aborts == {r.request_id}
    h.step(s)
    assert h.free(s) == free0 - 3
    h.step(s, recving={r.request_id})
    assert h.free(s) == free0 and s.requests == {}


def test_decoder_load_in_flight_survives_preemption_pressure(h, tiny):
    """A small cache: request B runs and grows while A's load is in flight. The blocks A's load
    writes are never taken for B (a request waiting for remote KV is not a preemption victim:
    B preempts itself); A runs once its load is done, B afterwards; all blocks come back."""
    s = h.make_scheduler(tiny, "kv_consumer", num_blocks=6)       # 5 usable (vLLM keeps one)
    free0 = h.free(s)
    a = h.request(3 * h.BLOCK, max_tokens=2, params=h.decoder_params("p-4", 3 * h.BLOCK))
    s.add_request(a)
    so, _ = h.step(s)
    (load,) = so.kv_connector_metadata.loads.values()
    a_blocks = list(load.block_ids)
    b = h.request(h.BLOCK - 1, max_tokens=2 * h.BLOCK)                 # needs a 2nd, then a 3rd block
    s.add_request(b)
    preempted = False
    for _ in range(2 * h.BLOCK):
        so, _ = h.step(s)
        assert h.block_ids(s, a.request_id) == a_blocks and a.status == h.RequestStatus.WAITING_FOR_REMOTE_KVS
        preempted = preempted or b.request_id in so.preempted_req_ids
        if preempted:
            break
    assert preempted and b.num_preemptions >= 1
    h.step(s, recving={a.request_id})
    so, _ = h.step(s)
    assert so.num_scheduled_tokens.get(a.request_id) == 1       # A runs on its loaded blocks
    for _ in range(200):
        if not s.has_requests():
            break
        h.step(s)
    assert not s.has_requests() and h.free(s) == free0


def test_decoder_preempted_after_its_load_recomputes_without_loading_again(h, tiny):
    """A request that loaded its prompt and decodes is preempted (the cache is full; it came
    after B, so it is the victim): vLLM frees its blocks; when it comes back it is computed
    locally (its prompt and what it generated, less any local prefix hit) and the connector
    starts no second load (the prefiller freed its blocks long ago). Both finish, every block
    comes back. No prefix caching: A's cached blocks would cover its prompt anyway."""
    s = h.make_scheduler(tiny, "kv_consumer", num_blocks=6, prefix_caching=False)   # 5 usable: B (3), A (4)
    free0 = h.free(s)
    b = h.request(h.BLOCK + 1, max_tokens=40)
    s.add_request(b)
    h.step(s)
    a = h.request(2 * h.BLOCK - 1, max_tokens=40, params=h.decoder_params("p-5", 2 * h.BLOCK - 1))
    s.add_request(a)
    so, _ = h.step(s)
    assert len(so.kv_connector_metadata.loads) == 1
    h.step(s, recving={a.request_id})
    so, _ = h.step(s)
    assert so.num_scheduled_tokens.get(a.request_id) == 1       # running on its loaded blocks
    preempted, back = False, None
    for _ in range(300):
        so, _ = h.step(s)
        assert so.kv_connector_metadata.loads == {}              # never a second load
        preempted = preempted or a.request_id in so.preempted_req_ids
        if preempted and back is None and a.request_id in so.num_scheduled_tokens:
            back = so.num_scheduled_tokens[a.request_id]
        if not s.requests:
            break
    assert preempted and a.num_preemptions >= 1 and back is not None
    assert a.request_id not in s.connector.connector_scheduler._local
    assert a.status == h.RequestStatus.FINISHED_LENGTH_CAPPED and len(a.output_token_ids) == 40
    assert h.free(s) == free0
