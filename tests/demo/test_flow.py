"""The disaggregated flow with real processes: TP=2 prefill workers whose memfd KV shards are
imported by the node, a decode scheduler, the numpy transport; tokens checked against the
colocated run. Worker failures come back as PeerError with the worker's traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvxfer.demo import cli
import threading

from kvxfer.demo.flow import DecodeNode, DemoConfig, NumpyTransport, run
from kvxfer.demo.model import ModelConfig
from kvxfer.demo.runtime import LocalGroup, colocated, context_of
from kvxfer.demo.tp import WorkerGroup
from kvxfer.errors import InvalidArgumentError, LayoutError, PeerError

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("attention,decode_tp", [("gqa", 1), ("gqa", 4), ("mla", 4), ("mla", 1)])
def test_disaggregated_tokens_identical(attention, decode_tp):
    # several decoding at once, prefills overlapping decodes, a pool too small for all at once
    dc = DemoConfig(prompts=8, min_len=1, max_len=150, max_new=10, attention=attention, decode_tp=decode_tp,
                    chunk=32, max_batch=3, arrival_ms=5, decode_pool_pages=30, seed=4,
                    transport="numpy")
    r = run(dc)
    assert r.identical, f"mismatching requests: {r.mismatches}"
    assert [len(s.tokens) for s in r.requests] == [10] * 8
    long = [s for s in r.requests if s.prompt_len > 17]
    assert long and all(s.pages > 0 and s.bytes > 0 for s in long)
    assert r.requests[0].prompt_len == 1 and r.requests[0].pages == 0


def test_worker_shards_hold_the_reference_kv():
    """Byte-exact: the pages the TP=2 workers wrote (seen through the node's imported
    mapping) equal those of an in-process TP=2 group; the lead bumped once per layer."""
    cfg = ModelConfig()
    prompt = np.random.default_rng(5).integers(0, cfg.vocab, 150)
    pages = np.array([7, 2, 9, 0, 4, 1, 3, 8, 5, 6])
    with WorkerGroup(cfg, 2, 12, 64) as w:
        ctx, _ = w.prefill("r", prompt[:-1], pages)
        ref = LocalGroup(cfg, 2, 12)
        ref_ctx = context_of(cfg, ref.run, prompt, pages, 64)
        assert ctx.tobytes() == ref_ctx.tobytes()
        assert int(w.layer_counter[0]) == cfg.layers * 3  # 3 chunks of the 149 prefilled tokens
        for got, want in zip(w.caches, ref.caches):
            for layer in range(cfg.layers):
                a = got.layers[layer].reshape(12, -1, 16, cfg.head_dim)
                b = want.layers[layer].reshape(12, -1, 16, cfg.head_dim)
                assert np.array_equal(a[pages], b[pages])
        # bad input is refused before any worker sees it
        for bad in ([12], [0, 0], [-1]):
            with pytest.raises(InvalidArgumentError):
                w.prefill("x", prompt[:3], np.array(bad))
        with pytest.raises(InvalidArgumentError):
            w.prefill("x", np.array([1, cfg.vocab]), np.array([0]))
        # still serving after refusals
        ctx2, _ = w.prefill("r2", prompt[:-1], pages)
        assert ctx2.tobytes() == ref_ctx.tobytes()


def test_layer_signal_is_exact_and_ordered_with_the_passes():
    """The streaming node's contract with the TP group: ``before_chunk`` runs once per chunk
    (boundaries inside pages: chunk 24, page 16), in order, before that pass computes
    anything and after every layer of the pass before the previous one (pass k + 1 is
    scheduled while pass k computes); the lead signals exactly once per layer."""
    cfg = ModelConfig()
    prompt = np.random.default_rng(6).integers(0, cfg.vocab, 80)
    pages = np.arange(5)
    with WorkerGroup(cfg, 2, 8, 24, layer_signal=True) as w:
        seen: list[tuple[int, int]] = []
        got = [0]

        def drain() -> None:
            while n := w.wait_layers(0.0):
                got[0] += n

        def before_chunk(a: int, b: int) -> None:
            k = len(seen)
            drain()
            assert max(k - 1, 0) * cfg.layers <= got[0] <= k * cfg.layers, (k, got[0])
            seen.append((a, b))

        w.prefill("r", prompt[:-1], pages, before_chunk=before_chunk)
        while got[0] < 4 * cfg.layers:
            n = w.wait_layers(10.0)
            assert n, "a layer was never signalled"
            got[0] += n
        assert w.wait_layers(0.05) == 0  # no extra signal
        assert seen == [(0, 24), (24, 48), (48, 72), (72, 79)]
        assert got[0] == int(w.layer_counter[0]) == 4 * cfg.layers
        assert w.t_last_layer > 0
    with WorkerGroup(cfg, 1, 8, 24) as w:
        with pytest.raises(InvalidArgumentError, match="layer_signal"):
            w.wait_layers(0.01)


def test_model_mismatch_fails_the_handshake():
    dec = DecodeNode(ModelConfig(seed=1), 1, 8)
    try:
        with pytest.raises(LayoutError, match="another model"):
            NumpyTransport(ModelConfig(seed=2), DemoConfig(transport="numpy"), dec, 8, threading.Event())
    finally:
        dec.close()


def test_prompt_too_long_for_the_decoder_is_refused():
    dc = DemoConfig(max_new=4, decode_pool_pages=3, transport="numpy")
    with pytest.raises(InvalidArgumentError, match="refused"):
        run(dc, prompts=[[1, 2, 3], list(range(60))])  # 63 positions: 4 pages


def test_given_reference_mismatch_is_reported():
    """The check can fail: a wrong reference makes the run say so."""
    dc = DemoConfig(max_new=4, decode_pool_pages=8, transport="numpy")
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    good = colocated(dc.model(), prompts, max_new=4, chunk=dc.chunk)
    bad = [good[0], type(good[1])(tuple((t + 1) % 512 for t in good[1].tokens), good[1].accepted)]
    r = run(dc, prompts=prompts, reference=bad)
    assert not r.identical and r.mismatches == [1]


def test_cli_json(capsys):
    rc = cli.main(["--prompts", "3", "--max-len", "40", "--max-new", "4", "--json", "--seed", "2", "--transport", "numpy"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["identical"] is True
    assert len(out["requests"]) == 3
    r = out["requests"][-1]
    assert r["prompt_len"] == 40 and r["pages"] == 3 and r["bytes"] > 0 and r["ttft"] > 0
    assert out["tokens_per_s"] > 0


def test_cli_table_and_bad_input(capsys):
    rc = cli.main(["--prompts", "2", "--max-len", "20", "--max-new", "3", "-q", "--attention", "mla", "--transport", "numpy",
                   "--decode-tp", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens identical to colocated: yes" in out and "TP2 -> TP4" in out
    rc = cli.main(["--prompts", "2", "--min-len", "30", "--max-len", "20", "-q"])
    assert rc == 2 and "InvalidArgumentError" in capsys.readouterr().err
    rc = cli.main(["--prompts", "2", "--prefill-tp", "3", "-q"])
    assert rc == 2 and "tp=3 must divide" in capsys.readouterr().err


def test_dead_worker_fails_the_group_not_hangs():
    cfg = ModelConfig()
    with WorkerGroup(cfg, 2, 8, 64) as w:
        w._procs[1].kill()
        w._procs[1].join(5)
        with pytest.raises(PeerError, match="rank 1"):
            w.prefill("r", np.arange(40), np.arange(3))
        assert w.broken
        with pytest.raises(PeerError, match="broken"):
            w.prefill("r", np.arange(40), np.arange(3))


def test_worker_error_comes_back_with_its_traceback():
    cfg = ModelConfig()
    with WorkerGroup(cfg, 2, 8, 64) as w:
        # bypasses the checks: too few pages
        w._conns[1].send(("chunk", "r", np.arange(40), 0, np.array([0]), True))
        w._conns[0].send(("chunk", "r", np.arange(40), 0, np.array([0]), True))
        with pytest.raises(PeerError, match="Traceback") as e:
            w._gather("done", 60)
        assert "page table has 1 pages" in str(e.value)


def test_requests_queue_for_pages_never_half_written():
    """A pool that holds one request at a time: every other request waits in the queue for
    pages (never overtakes, never starts half-allocated) and still decodes identically."""
    from kvxfer.demo.runtime import decode_pages

    cfg = ModelConfig()
    prompts = [list(range(1, 1 + n)) for n in (90, 30, 60, 5)]
    one = decode_pages(cfg, 90, 4)
    dc = DemoConfig(max_new=4, decode_pool_pages=one, arrival_ms=0.01, transport="numpy", max_batch=4)
    r = run(dc, prompts=prompts)
    assert r.identical and not r.failed
    # one request at a time: each arrives at ~0 and waits for the previous one's pages
    ttft = [s.ttft for s in r.requests]
    assert ttft == sorted(ttft)
    assert all(s.queued > r.requests[0].prefill for s in r.requests[1:])
