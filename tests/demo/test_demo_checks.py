"""What the demo's check must catch, and what its exit status means:

* KV that arrives wrong is a mismatch even when the tokens happen to agree: after each
  receive the decoder checksums the prompt KV in the request's pages and compares it with
  the colocated run's (a transport spoiled after ``copy_plan``, as a reviewer's harness did);
* the kill drill excuses only failures on the killed node after its kill, and fails when the
  kill never fired;
* a TP worker that dies at start fails the run at once (rank and exit code), exit status 1;
  2 stays for a bad command line."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer.demo.flow as flow
import kvxfer.demo.tp as tp
from kvxfer.demo import cli
from kvxfer.demo.flow import DemoConfig, Report, RequestStats, run
from kvxfer.demo.model import ModelConfig
from kvxfer.demo.runtime import LocalGroup, context_of, kv_crc
from kvxfer.demo.transport import copy_plan
from kvxfer.errors import PeerError

pytestmark = pytest.mark.timeout(300)


def _spoiling(mode: str):
    """``copy_plan`` that copies, then spoils what it wrote, following the same plan."""

    def spoiled(plan, src_regions, dst_regions):
        w, n = copy_plan(plan, src_regions, dst_regions)
        for s, d in plan.pairs:
            wr = plan.writes(s, d)
            for k, (dr, do, ln) in enumerate(zip(wr.dst_region.tolist(), wr.dst_offset.tolist(), wr.length.tolist())):
                if mode == "zero_last_write" and k == len(wr) - 1:
                    dst_regions[d][dr][do:do + ln] = 0
                elif mode == "perturb_all":
                    v = dst_regions[d][dr][do:do + ln].view(np.float32)
                    v *= np.float32(1.001)
        return w, n

    return spoiled


def _dc(**kw) -> DemoConfig:
    base = dict(prompts=6, min_len=2, max_len=200, max_new=8, arrival_ms=5, transport="numpy", seed=3)
    base.update(kw)
    return DemoConfig(**base)


@pytest.mark.parametrize("mode,attention,decode_tp", [("perturb_all", "gqa", 1), ("zero_last_write", "gqa", 1),
                                                      ("zero_last_write", "mla", 4)])
def test_spoiled_transport_is_a_mismatch(monkeypatch, mode, attention, decode_tp):
    monkeypatch.setattr(flow, "copy_plan", _spoiling(mode))
    r = run(_dc(attention=attention, decode_tp=decode_tp))
    assert not r.failed
    assert not r.identical
    # every request moved KV (min_len 2), and every one of them is caught, tokens or not
    assert r.kv_mismatches == r.mismatches == [s.rid for s in r.requests]
    assert all(s.kv_identical is False and s.identical is False for s in r.requests)


def test_unspoiled_run_is_identical_kv_included():
    r = run(_dc(decode_tp=4))
    assert r.identical and not r.mismatches and not r.kv_mismatches
    assert all(s.kv_identical for s in r.requests)
    assert all(s.kv_crc not in (0, -1) for s in r.requests)


def test_cli_exits_1_on_spoiled_kv(monkeypatch, capsys):
    monkeypatch.setattr(flow, "copy_plan", _spoiling("perturb_all"))
    rc = cli.main(["--prompts", "3", "--min-len", "2", "--max-len", "40", "--max-new", "4", "-q",
                   "--transport", "numpy", "--seed", "2"])
    cap = capsys.readouterr()
    assert rc == 1
    assert "received KV pages identical to colocated: NO (requests [0, 1, 2])" in cap.out
    assert "received KV pages differ for [0, 1, 2]" in cap.err


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_kv_crc_is_the_same_for_any_tp_and_sees_one_float(attention, tp_size):
    cfg = ModelConfig(attention=attention)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, 53)
    pages = np.array([5, 1, 3, 0])
    one, many = LocalGroup(cfg, 1, 6), LocalGroup(cfg, tp_size, 6)
    context_of(cfg, one.run, prompt, pages, 24)
    context_of(cfg, many.run, prompt, pages, 24)
    n = len(prompt) - 1
    want = kv_crc(cfg, one.caches, pages, n)
    assert kv_crc(cfg, many.caches, pages, n) == want
    # one float of the last layer's last prompt position, on the last rank
    c = many.caches[-1].layers[cfg.layers - 1]
    c[pages[(n - 1) // 16], -1, -1, (n - 1) % 16, -1] *= np.float32(1.001)
    assert kv_crc(cfg, many.caches, pages, n) != want
    # positions past the prompt are not part of it
    c[pages[n // 16], 0, 0, n % 16, 0] += 1
    assert kv_crc(cfg, one.caches, pages, n) == want


# -- the kill drill's verdict -----------------------------------------------------------

def _report(kill: int, killed: bool, failures: list[tuple[int, bool]]) -> Report:
    """A report of 4 requests; ``failures``: (node, after the kill) of requests 0, 1, ..."""
    reqs = [RequestStats(i, 20, node=i % 2, identical=True) for i in range(4)]
    for s, (node, after) in zip(reqs, failures):
        s.error, s.node, s.after_kill, s.identical = "PeerError: gone", node, after, None
    cfg = dict(vars(_dc()), kill_prefiller_after=kill, prefill_nodes=2)
    return Report(config=cfg, requests=reqs, wall=1.0, tokens_per_s=1.0, identical=True, mismatches=[],
                  failed=[s.rid for s in reqs if s.error], killed=killed)


def test_drill_excuses_only_the_killed_nodes_failures_after_the_kill():
    assert cli.verdict(_report(1, True, [(0, True), (0, True)])) == []
    assert cli.verdict(_report(1, True, [])) == []
    # another node's failure, node 0 failing before the kill, a request no node took
    for failures in ([(1, True)], [(0, False)], [(-1, True)]):
        why = cli.verdict(_report(1, True, failures))
        assert len(why) == 1 and "requests [0] failed (not on the killed node after its kill)" in why[0]
    # without the drill no failure is excused
    why = cli.verdict(_report(0, False, [(0, True)]))
    assert why and "requests [0] failed: PeerError" in why[0]


def test_drill_whose_kill_never_fired_fails():
    why = cli.verdict(_report(10, False, []))
    assert len(why) == 1 and "--kill-prefiller-after 10: the kill never fired" in why[0]
    # and failures cannot be excused by a kill that did not happen
    assert len(cli.verdict(_report(10, False, [(0, True)]))) == 2


# -- a TP worker dying at start ---------------------------------------------------------

def test_worker_dying_at_start_fails_at_once(monkeypatch):
    from _dying_worker import EXIT_CODE, die_on_rank_1

    monkeypatch.setattr(tp, "_worker", die_on_rank_1)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=rf"TP rank 1 exited \(code {EXIT_CODE}\) before handing over"):
        tp.WorkerGroup(ModelConfig(), 2, 8, 64, start_timeout=60)
    assert time.monotonic() - t0 < 20  # not the 60 s start timeout


def test_cli_runtime_failure_is_exit_1_bad_command_line_2(monkeypatch, capsys):
    from _dying_worker import EXIT_CODE, die_on_rank_1

    monkeypatch.setattr(tp, "_worker", die_on_rank_1)
    rc = cli.main(["--prompts", "2", "--max-len", "20", "-q", "--transport", "numpy"])
    err = capsys.readouterr().err
    assert rc == 1 and f"PeerError: TP rank 1 exited (code {EXIT_CODE})" in err
    assert "Traceback" not in err and "EOFError" not in err
    # refused before anything starts: still 2
    assert cli.main(["--prompts", "2", "--transport", "numpy", "--prefill-nodes", "2", "-q"]) == 2
    assert "numpy transport runs one prefill node" in capsys.readouterr().err
