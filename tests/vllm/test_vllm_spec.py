"""Speculative decoding through kvxfer's connector, on real vLLM: with a draft model, vLLM puts
the draft model's layers in the KV cache beside the target's (one group, one storage), so the
prompt's draft KV that P computed moves to D with the target's, and D's drafter proposes
from it at once. The draft model here is the tiny model itself (``method="draft_model"``), so
one vLLM accepts every draft token: D accepting as many shows the draft KV arrived;
spoiling only P's draft layers keeps D's tokens (speculative decoding is lossless) but loses
its acceptance, so the KV was used. A decoder without the draft model cannot load a P that
has one (its cache has fewer layers): its loads fail, named, and recompute."""

from __future__ import annotations

import time
from typing import Any

import pytest

from conftest import HAVE_VLLM

if not HAVE_VLLM:
    pytest.skip("vllm is not installed (make test-vllm)", allow_module_level=True)

from _cluster import Instance  # noqa: E402
from _model import LAYERS  # noqa: E402
from test_vllm_pd import BLOCK, BLOCK_BYTES, EXTRA, P_BUDGET, _internal, disaggregated, prompts  # noqa: E402

pytestmark = pytest.mark.timeout(2400)
#: draft tokens proposed per step
K = 3


@pytest.fixture(scope="module")
def spec(model, workdir):
    """A reference with the draft model, P and D with it, and a plain D (no draft model), all
    started at once; D warmed up so its blocks differ from P's."""
    opts = {"speculative": K}
    ref = Instance("spec-reference", model, "none", opts, workdir)
    p = Instance("spec-prefill", model, "kv_producer", dict(opts, extra=EXTRA, max_batched=P_BUDGET), workdir)
    d = Instance("spec-decode", model, "kv_consumer", dict(opts, extra=EXTRA), workdir)
    plain = Instance("plain-decode", model, "kv_consumer", {"extra": EXTRA}, workdir)
    try:
        for x in (ref, p, d, plain):
            x.wait_ready()
        d.call(op="generate", prompts=prompts(98, [70, 45]), max_tokens=2)
        yield ref, p, d, plain
    finally:
        for x in (ref, p, d, plain):
            x.close()


def _spec(x) -> dict:
    return x.call(op="spec_metrics")["spec"]


def _accepted(x, run) -> tuple[Any, dict]:
    """Run ``run()`` (it generates on ``x``): its result, and ``x``'s draft rounds
    (``drafts``), draft tokens proposed and accepted meanwhile."""
    a = _spec(x)
    out = run()
    b = _spec(x)
    return out, {k: b[k] - a[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}


def test_draft_layers_are_in_the_moved_cache(spec):
    """P's and D's caches both hold the draft model's layers after the target's, and the
    connector's layout counts them."""
    _, p, d, plain = spec
    for x in (p, d):
        names = x.call(op="spec_metrics")["layers"]
        assert len(names) == 2 * LAYERS
        assert all(n.startswith("model.") for n in names[:LAYERS])
        assert all(n.startswith("draft_model.") for n in names[LAYERS:])
    assert len(plain.call(op="spec_metrics")["layers"]) == LAYERS


def test_decoder_accepts_draft_tokens_from_the_moved_draft_kv(spec):
    """P first: D's greedy tokens equal one vLLM's with the same draft model, D accepts draft
    tokens at that instance's rate, and the bytes moved are the target's and the draft's."""
    ref, p, d, _ = spec
    ps = prompts(31, [40, 2 * BLOCK, 100])
    r, rs = _accepted(ref, lambda: ref.call(op="generate", prompts=ps, max_tokens=16)["outputs"])
    assert rs["draft_tokens"] > 0 and rs["accepted_tokens"] == rs["draft_tokens"], rs   # it drafts for itself
    p.call(op="drain")
    sent0 = p.call(op="inspect")["stats"]["bytes_sent"]
    (rp, rd, params), ds = _accepted(d, lambda: disaggregated(p, d, ps, max_tokens=16))
    assert [o["tokens"] for o in rd["outputs"]] == [o["tokens"] for o in r]
    # every draft token the reference accepted, D accepted too; vLLM runs one more round a
    # request on D (the step after its async load verifies K placeholder drafts: none accepted)
    assert ds["accepted_tokens"] == rs["accepted_tokens"], (ds, rs)
    assert rs["drafts"] <= ds["drafts"] <= rs["drafts"] + len(ps), (ds, rs)
    din = d.call(op="inspect")
    for o, length in zip(rd["outputs"], [40, 2 * BLOCK, 100]):
        assert _internal(din["external"], o["id"]) == length
    p.call(op="drain")
    blocks = sum(-(-n // BLOCK) for n in (40, 2 * BLOCK, 100))
    assert p.call(op="inspect")["stats"]["bytes_sent"] - sent0 == blocks * 2 * BLOCK_BYTES


def test_spoiled_draft_kv_keeps_the_tokens_but_not_the_acceptance(spec):
    """The control: P's draft layers overwritten with noise before D asks (its target layers
    untouched): D's tokens still equal the reference's (the target decides them), but D
    accepts far fewer draft tokens, so the draft KV moved above was what D's drafter used."""
    ref, p, d, _ = spec
    ps = prompts(32, [90, 120])
    r, rs = _accepted(ref, lambda: ref.call(op="generate", prompts=ps, max_tokens=16)["outputs"])

    def run():
        rp = p.call(op="generate", prompts=ps, max_tokens=1, params=[{"do_remote_decode": True}] * len(ps))
        params = [o["kv_transfer_params"] for o in rp["outputs"]]
        p.call(op="spoil", ids=[x["remote_request_id"] for x in params], layers="draft")
        return d.call(op="generate", prompts=ps, max_tokens=16, params=params)["outputs"]

    out, ds = _accepted(d, run)
    assert [o["tokens"] for o in out] == [o["tokens"] for o in r]
    assert ds["draft_tokens"] > 0 and ds["accepted_tokens"] < rs["accepted_tokens"] / 2, (ds, rs)


def test_decoder_first_streams_the_draft_layers_too(spec):
    """D first, prompt in three chunks (P's budget): the streamed Send's layer counter is bumped
    by layer name, so the draft model's layers (computed after the target's, and again for
    each later draft token of the step) are counted once each: one Send through every chunk,
    some writes posted before the pass's last layer, D's tokens and accepted draft tokens as one vLLM's."""
    ref, p, d, _ = spec
    key, n = "spec-d-first", 700
    (prompt,) = prompts(33, [n])
    r, rs = _accepted(ref, lambda: ref.call(op="generate", prompts=[prompt], max_tokens=16)["outputs"])
    hs = p.call(op="generate", prompts=prompts(34, [8]), max_tokens=1,
                params=[{"do_remote_decode": True}])["outputs"][0]["kv_transfer_params"]["remote_handshakes"]
    p.call(op="drain")
    before = p.call(op="inspect")["stats"]
    a = _spec(d)
    d.send(op="generate", prompts=[prompt], max_tokens=16, params=[{
        "do_remote_prefill": True, "kvxfer": 1, "remote_request_id": key,
        "remote_handshakes": hs, "remote_num_tokens": n}])
    deadline = time.monotonic() + 60
    while key not in p.call(op="inspect")["asked"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert key in p.call(op="inspect")["asked"]
    p.call(op="generate", prompts=[prompt], max_tokens=1, params=[{"do_remote_decode": True, "kvxfer_request_key": key}])
    rd = d.answer(timeout=120)
    b = _spec(d)
    assert rd["outputs"][0]["tokens"] == r[0]["tokens"]
    assert _internal(d.call(op="inspect")["external"], rd["outputs"][0]["id"]) == n
    assert b["accepted_tokens"] - a["accepted_tokens"] == rs["accepted_tokens"] > 0, (a, b, rs)
    p.call(op="drain")
    after = p.call(op="inspect")["stats"]
    assert after["sends_streamed"] == before["sends_streamed"] + 1
    assert after["stream_chunks"] == before["stream_chunks"] + 3
    assert after["sends_done"] == before["sends_done"] + 1
    assert after["stream_entries_early"] > before["stream_entries_early"], after
    assert after["bytes_sent"] - before["bytes_sent"] == -(-n // BLOCK) * 2 * BLOCK_BYTES


def test_a_decoder_without_the_draft_model_fails_its_load_named_and_recomputes(spec):
    """A plain D (no draft model: half the layers) given P's params: the load fails at once
    with the cause named (the caches differ in layers: the same speculative_config is needed),
    and the recompute policy gives the reference's tokens."""
    ref, p, _, plain = spec
    ps = prompts(35, [50])
    r = ref.call(op="generate", prompts=ps, max_tokens=8)["outputs"]
    before = plain.call(op="inspect")["stats"]
    _, rd, _ = disaggregated(p, plain, ps)
    assert rd["outputs"][0]["tokens"] == r[0]["tokens"]
    after = plain.call(op="inspect")["stats"]
    assert after["loads_failed"] == before["loads_failed"] + 1
    assert after["loads_done"] == before["loads_done"]
    log = plain.log.read_text(errors="replace")
    assert f"num_layers: {LAYERS} vs {2 * LAYERS}" in log and "speculative_config" in log
    p.call(op="drain", timeout=60)          # P's blocks for it: unclaimed, freed after its timeout
