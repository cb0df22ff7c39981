"""The demo over real kvxfer messengers, one test body per provider: prefill nodes are
processes (messenger + TP=2 worker processes), the decode node is this process. Any token
mismatch with the colocated run fails. Also the kill-the-prefiller drill."""

from __future__ import annotations

import os

import pytest

kvxfer = pytest.importorskip("kvxfer")
try:
    from kvxfer import _fabric  # noqa: F401
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"kvxfer._fabric not built: {exc}", allow_module_level=True)

from kvxfer.demo import cli
from kvxfer.demo.flow import DemoConfig, run

pytestmark = pytest.mark.timeout(300)
from _procs import dead_shm_files  # noqa: E402
from _providers import available, provider  # noqa: E402,F401  (the shared fixture)


@pytest.mark.parametrize("attention,decode_tp", [("gqa", 1), ("mla", 4)])
def test_tokens_identical_over_the_messenger(provider, attention, decode_tp):
    # streaming (the default), chunk 24: chunk boundaries inside pages (page size 16)
    dc = DemoConfig(prompts=7, min_len=1, max_len=140, max_new=8, attention=attention, decode_tp=decode_tp,
                    chunk=24, max_batch=3, arrival_ms=10, decode_pool_pages=30, transport=provider, seed=7)
    r = run(dc)
    assert not r.failed, [s.error for s in r.requests if s.error]
    assert r.identical, f"mismatching requests: {r.mismatches}"
    moved = [s for s in r.requests if s.prompt_len > 1]
    assert all(s.pages == -(-(s.prompt_len - 1) // 16) and s.bytes > 0 and s.writes > 0 for s in moved)
    assert all(s.node == 0 and s.streamed and s.schedule > 0 for s in moved)
    assert any(s.prompt_len - 1 > 2 * dc.chunk for s in moved)  # several passes per request


def test_no_stream_moves_after_the_last_layer(provider):
    """``stream=False``: the same tokens, every request sent after its prefill (not streamed)."""
    dc = DemoConfig(prompts=4, min_len=2, max_len=90, max_new=4, chunk=24, max_batch=2, arrival_ms=5,
                    transport=provider, stream=False, seed=8)
    r = run(dc)
    assert not r.failed and r.identical, (r.mismatches, [s.error for s in r.requests if s.error])
    assert all(not s.streamed and s.pages > 0 for s in r.requests)


def test_kill_the_prefiller(provider):
    """Prefill node 0 is SIGKILLed after its first prefill: its other requests fail within the
    peer timeout (plus a margin), node 1 serves the rest with identical tokens, and the run
    (so every process) ends cleanly."""
    pt = 1.5
    dc = DemoConfig(prompts=10, min_len=20, max_len=160, max_new=6, chunk=64, max_batch=4, arrival_ms=3,
                    transport=provider, prefill_nodes=2, kill_prefiller_after=1, peer_timeout=pt, seed=11)
    before = set(os.listdir("/dev/shm"))
    try:
        r = run(dc)
    finally:
        dead_shm_files(before)       # the killed node's shm files
    failed = [s for s in r.requests if s.error]
    served = [s for s in r.requests if not s.error]
    assert failed, "node 0 had requests in flight when it was killed"
    assert all(s.node == 0 for s in failed)
    assert all("PeerError" in s.error for s in failed), [s.error for s in failed]
    assert all(s.failed_after <= pt + 3.0 for s in failed), [s.failed_after for s in failed]
    assert any(s.node == 1 for s in served) and r.identical
    assert sorted(r.failed) == [s.rid for s in failed]


def test_cli_kill_drill_exit_status(capsys):
    """The CLI's drill: a kill that fired with only node 0's requests failing after it exits
    0; a drill that never fires (10 prefills asked of node 0, 4 prompts) exits 1 and says so."""
    if not available("shm"):
        pytest.skip("shm is not available here")
    before = set(os.listdir("/dev/shm"))
    try:
        rc = cli.main(["--prompts", "10", "--min-len", "20", "--max-len", "160", "--max-new", "4", "--chunk", "64",
                       "--max-batch", "4", "--arrival-ms", "3", "--transport", "shm", "--prefill-nodes", "2",
                       "--kill-prefiller-after", "1", "--peer-timeout", "1.5", "--seed", "11", "--json"])
    finally:
        dead_shm_files(before)
    cap = capsys.readouterr()
    js = __import__("json").loads(cap.out)
    assert js["killed"] is True and js["failed"], cap.err
    assert all(q["node"] == 0 and q["after_kill"] for q in js["requests"] if q["error"])
    assert rc == 0, cap.err
    rc = cli.main(["--prompts", "4", "--max-len", "40", "--max-new", "2", "--transport", "shm", "--prefill-nodes", "2",
                   "--kill-prefiller-after", "10", "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and "--kill-prefiller-after 10: the kill never fired" in err


def test_cli_default_transport_is_a_messenger(capsys):
    if not available("shm"):
        pytest.skip("shm is not available here")
    rc = cli.main(["--prompts", "3", "--max-len", "40", "--max-new", "4", "-q", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "transport shm" in out and "tokens identical to colocated: yes" in out
    assert "layer streaming: on (2 of 2 transfers" in out
    rc = cli.main(["--prompts", "2", "--min-len", "30", "--max-len", "40", "--max-new", "2", "--json", "--no-stream"])
    js = __import__("json").loads(capsys.readouterr().out)
    assert rc == 0 and js["config"]["stream"] is False and not any(q["streamed"] for q in js["requests"])
    assert all("tail" in q for q in js["requests"])


def test_model_mismatch_fails_before_any_request(provider):
    import threading

    from kvxfer.demo.flow import DecodeNode
    from kvxfer.demo.model import ModelConfig
    from kvxfer.demo.nodes import MessengerTransport

    dec = DecodeNode(ModelConfig(seed=1), 1, 8)
    try:
        with pytest.raises(kvxfer.errors.LayoutError, match="another model"):
            MessengerTransport(ModelConfig(seed=2), DemoConfig(transport=provider), dec, 8, 4, threading.Event())
    finally:
        dec.close()


def test_ctrl_c_stops_every_process(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) in the middle of a
    run: exit status 130 and no process of the run left. libfabric replaces the SIGINT
    handler with one that exits at once; the demo gives it back to Python."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if not available("shm"):
        pytest.skip("shm is not available here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "kvxfer.demo.cli", "--prompts", "40", "--transport", "shm"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            seen.append(line)
            if "decoding" in line or not line:
                break
        assert any("decoding" in x for x in seen), "".join(seen)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, err
        assert "interrupted" in err
        left: list[str] = []
        for _ in range(100):  # the resource tracker and workers may take a moment to go
            left = subprocess.run(["pgrep", "-a", "-s", str(p.pid)], capture_output=True, text=True).stdout.splitlines()
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"processes of the run left: {left}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
