"""A prefiller at TP2 (vLLM's mp executor: one worker process per rank, each rank its own kvxfer
engine and ``Messenger(..., ranks=[rank])``) and a TP1 decoder that receives from both rank
processes at once; and (``KVXFER_VLLM_TP_DECODER=1``) a TP1 prefiller and a TP2 decoder, each
decode rank its own REQUEST: the decoder's greedy tokens equal one vLLM without a connector."""

from __future__ import annotations

import os
import time

import pytest

from conftest import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vllm is not installed (make test-vllm)", allow_module_level=True)

from _cluster import Instance  # noqa: E402
from test_vllm_pd import BLOCK, EXTRA, disaggregated, prompts  # noqa: E402

pytestmark = pytest.mark.timeout(2400)   # setup included (test_vllm_pd.py)

#: the connector's default peer_timeout (10 s), not the kill tests' 6 s: nothing is killed here,
#: and with four vLLM processes on two cores a decoder starved of CPU for 3-10 s (measured with
#: its messenger's loop_gap histogram, the stop-29 CI failure) stopped sending heartbeats long
#: enough for the prefill ranks to declare it dead at 3 s (docs/reliability.md, finding 26)
EXTRA_TP = {**EXTRA, "peer_timeout": 10.0}

#: the TP2 prefiller's pair: unclaimed_timeout 60 s, not 10. Nothing goes unclaimed here, and a
#: decoder starved the same way (the TP2 prefiller's workers busy-loop after each step) sent its
#: REQUESTs more than 10 s after P finished in 2 of 4 runs of this file on this VM (2026-12-02),
#: so P had freed the blocks ("expired unclaimed"), vLLM recomputed and the loads counted rejected
EXTRA_TP2_P = {**EXTRA_TP, "unclaimed_timeout": 60}


def _ready_pair(p, d, reference, seed: int):
    """A module fixture's body for the started pair (P, D): both and the reference ready, D
    warmed up with prompts of ``seed`` so its block ids differ from P's, then closed."""
    try:
        for x in (reference, p, d):
            x.wait_ready()
        d.call(op="generate", prompts=prompts(seed, [70, 40]), max_tokens=2)     # other block ids than P's
        yield p, d
    finally:
        for x in (p, d):
            x.close()


@pytest.fixture(scope="module")
def tp2(model, workdir, reference):
    """P at TP2 (its two ranks bound to one core each) and a TP1 D, started together."""
    p = Instance("prefill-tp2", model, "kv_producer", {"extra": EXTRA_TP2_P, "tp": 2}, workdir,
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    d = Instance("decode-for-tp2", model, "kv_consumer", {"extra": EXTRA_TP2_P}, workdir)
    yield from _ready_pair(p, d, reference, 98)


def test_tp2_prefiller_to_tp1_decoder(tp2, reference):
    """Each P rank writes its KV head (1 of the 2) of every block; D's one Receive spans both
    rank processes (two legs, each announcing its own count). Prompts shorter than a block,
    aligned and not, at once; then P frees its blocks (every rank reported finished_sending)."""
    p, d = tp2
    lengths = [5, BLOCK, 77, 2 * BLOCK + 1]
    ps = prompts(31, lengths)
    free_p = p.call(op="inspect")["free_blocks"]
    ref = reference.call(op="generate", prompts=ps, max_tokens=8)["outputs"]
    rp, rd, params = disaggregated(p, d, ps)
    assert all(len(x["remote_handshakes"]) == 2 for x in params)     # one messenger per rank
    for r, o_p, o_d, n in zip(ref, rp["outputs"], rd["outputs"], lengths):
        assert o_p["tokens"] == r["tokens"][:1]
        assert o_d["tokens"] == r["tokens"], f"prompt of {n} tokens"
    assert not p.call(op="drain", timeout=60)["busy"]
    pin, din = p.call(op="inspect"), d.call(op="inspect")
    assert pin["free_blocks"] == free_p and not pin["pending_push"]
    # the decoder's counters (they lag the tokens by a step or two): read again for a bounded
    # while; on failure say them, both sides' messenger counters and liveness histograms, and
    # the logs
    end = time.monotonic() + 10
    while din["stats"]["loads_done"] < len(ps) and time.monotonic() < end:
        time.sleep(0.5)
        din = d.call(op="inspect")

    def said() -> str:          # built on failure only: it asks P's ranks for their counters
        return f"{din['stats']}\ndecoder's messenger: {din['messenger']}\ndecoder's stalls: {din['stalls']}\n" \
               f"decoder's stuck messenger threads: {din['stuck']}\n" \
               f"prefill ranks' messengers: {p.call(op='inspect')['messenger']}\n" \
               f"decoder log:\n{d.tail(80)}\nprefiller log:\n{p.tail(80)}"

    starved = [w for w in din["stalls"] if w["seconds"] > EXTRA_TP["peer_timeout"]
               and sum(w["cpu_ms_by_thread"].values()) < 100 * w["seconds"]]      # < 10 % of one core
    if din["stats"]["loads_done"] < len(ps) and starved:
        # none of the decoder's Python threads ran for longer than peer_timeout (its stall
        # watch: the process had next to no CPU in that window, docs/reliability.md finding
        # 29): its heartbeats stopped, so the prefill ranks rightly declared it dead, or its
        # REQUESTs came after unclaimed_timeout. What must hold then: every load ended, failed
        # or rejected (never done without its data), the tokens right (recomputed, above) and
        # P's blocks all freed (above). A messenger thread stuck while the rest of the process
        # ran is not this case: it fails below, with the thread's stack in ``said()``
        s = din["stats"]
        assert s["loads_done"] + s["loads_failed"] + s["loads_rejected"] == len(ps), said()
        pytest.xfail(f"the decoder's process did not run for {max(w['seconds'] for w in starved)} s, more than "
                     f"peer_timeout (finding 29): {said()}")
    assert din["stats"]["loads_done"] >= len(ps) and din["stats"]["loads_failed"] == 0, said()
    assert din["stats"]["peers_up"] >= 2                               # both rank processes


#: the TP2 decoder's pair of instances costs minutes more of this suite's startup on two
#: cores, so it runs on request: ``KVXFER_VLLM_TP_DECODER=1 make test-vllm`` (passed once by hand
#: on 2026-12-02: 7.6 s of test after 17.4 min of startup at load 20-38, docs/vllm.md)
TP_DECODER = bool(os.environ.get("KVXFER_VLLM_TP_DECODER"))


@pytest.fixture(scope="module")
def tp1_to_tp2(model, workdir, reference):
    """P at TP1 and D at TP2 (its two ranks bound to one core each), started together."""
    if not TP_DECODER:
        pytest.skip("the TP2 decoder runs with KVXFER_VLLM_TP_DECODER=1 (minutes of startup)")
    p = Instance("prefill-for-tp2", model, "kv_producer", {"extra": EXTRA_TP}, workdir)
    d = Instance("decode-tp2", model, "kv_consumer", {"extra": EXTRA_TP, "tp": 2}, workdir,
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield from _ready_pair(p, d, reference, 97)


def test_tp1_prefiller_to_tp2_decoder(tp1_to_tp2, reference):
    """Each D rank (its own worker process, engine and ``Messenger(ranks=[rank])``) sends its
    own REQUEST for the same blocks to the one P rank, which writes each D rank its KV head;
    D reports the load finished once both ranks did (vLLM's output aggregator). Tokens equal
    the reference's; P frees its blocks once both D ranks were served; both D ranks loaded."""
    p, d = tp1_to_tp2
    lengths = [5, BLOCK, 77, 2 * BLOCK + 1]
    ps = prompts(32, lengths)
    free_p, free_d = p.call(op="inspect")["free_blocks"], d.call(op="inspect")["free_blocks"]
    ref = reference.call(op="generate", prompts=ps, max_tokens=8)["outputs"]
    rp, rd, params = disaggregated(p, d, ps)
    assert all(len(x["remote_handshakes"]) == 1 for x in params)
    for r, o_p, o_d, n in zip(ref, rp["outputs"], rd["outputs"], lengths):
        assert o_p["tokens"] == r["tokens"][:1]
        assert o_d["tokens"] == r["tokens"], f"prompt of {n} tokens"
    assert not p.call(op="drain", timeout=60)["busy"]
    assert not d.call(op="drain", timeout=60)["busy"]
    pin, din = p.call(op="inspect"), d.call(op="inspect")
    assert pin["held"] == [] and pin["free_blocks"] == free_p and din["free_blocks"] == free_d
    assert pin["stats"]["sends_done"] >= 2 * len(ps), pin["stats"]        # one Send per D rank
    ranks = din["messenger"]                                               # per D rank
    assert len(ranks) == 2, ranks
    for m in ranks:                                                        # each rank loaded, none failed
        assert m["stats"].get("receive_done", 0) >= len(ps) and not m["stats"].get("receive_failed"), m["stats"]
