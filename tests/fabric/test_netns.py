"""tcp;ofi_rxm between two "hosts": network namespaces joined by a veth pair.

Loopback never leaves one network stack; here every byte crosses a real (virtual) link
between two stacks, and a peer can die or the wire can be cut. Needs root and iproute2;
skips otherwise. The namespaces are made once for the module and deleted even when a test
fails; every process runs with a deadline. How it is set up: docs/testing.md ("Network namespaces").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import _netns as N
import kvxfer

pytestmark = pytest.mark.timeout(90)

WAIT = 10.0        # seconds for any one wait inside a child
DEADLINE = 40      # SIGALRM in every child, whatever happens


@pytest.fixture(scope="module")
def pair():
    why = N.unavailable()
    if why:
        pytest.skip(why)
    if N.PROVIDER not in kvxfer.providers():
        pytest.skip(f"{N.PROVIDER} is not available here")
    N.sweep_stale()
    p = N.NetnsPair()
    try:
        p.create()
    except N.NetnsDenied as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield p
    finally:
        p.destroy()
        left = [ns for ns in N.list_netns() if ns in (p.a, p.b)]
        assert not left, f"namespaces left behind: {left}"


@pytest.fixture
def children():
    """Children started by a test; all of them are killed when it ends, pass or fail."""
    started: list[N.Child] = []
    yield started
    for c in started:
        c.close()


def _start(children, pair, ns, name, *args) -> N.Child:
    c = N.role(pair, ns, name, *args, "--timeout", str(WAIT), "--deadline", str(DEADLINE))
    children.append(c)
    return c


def _rx_bytes(pair) -> int:
    out = N._ip("-n", pair.b, "-j", "-s", "link", "show", "dev", pair.dev_b).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def test_namespaces_are_isolated(pair):
    """B's address is reachable only from A: the host's namespace has no route to it."""
    here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    assert pair.addr_a not in here and pair.addr_b not in here
    inside = N._ip("-n", pair.a, "route", "get", pair.addr_b).stdout
    assert pair.dev_a in inside


def test_pages_and_large_write_land_across_namespaces(pair, children):
    """Scattered pages with imm 7, then one 32 MiB write at odd offsets with imm 8: every
    byte of the target's buffer matches the seeded image, and each counter completed with
    exactly the initiator's num_writes (which the target also computes on its own)."""
    seed = 11
    rx0 = _rx_bytes(pair)
    tgt = _start(children, pair, pair.b, "target", "--node", pair.addr_b, "--seed", str(seed))
    addr, desc = tgt.line("READY ", WAIT).split()
    ini = _start(children, pair, pair.a, "initiator", "--node", pair.addr_a, "--addr", addr, "--desc", desc,
                 "--seed", str(seed))
    sent = ini.result(2 * WAIT)
    assert ini.wait(WAIT) == 0, ini.describe()
    tgt.send(f"EXPECT {sent['pages_writes']} {sent['large_writes']}")
    got = tgt.result(2 * WAIT)
    assert tgt.wait(WAIT) == 0, tgt.describe()

    told = {"7": sent["pages_writes"], "8": sent["large_writes"]}
    assert 0 < sent["pages_writes"] < sent["pages"], "some pages should merge, not all"
    assert got["own"] == told, "initiator and target disagree on num_writes"
    assert got["arrived"] == told, "the counters did not complete"
    assert got["banked"] == {"7": 0, "8": 0}, "more writes arrived than num_writes"
    assert got["bad_pages"] == 0 and got["guard_ok"]
    assert got["bytes_differ"] == 0, f"first wrong byte at offset {got['first_diff']}"
    assert got["ok"]
    # the data really crossed the veth
    assert _rx_bytes(pair) - rx0 >= sent["pages"] * N.PAGE + N.LARGE


def test_bench_across_namespaces(pair, children):
    """``kvxfer-bench bw --listen`` in B, ``--connect`` from A: both exit 0, data checked."""
    listen = N.Child(pair.argv(pair.b, [sys.executable, "-m", "kvxfer.cli.bench", "bw", "--listen",
                                        "--node", pair.addr_b, "--provider", N.PROVIDER, "--timeout", "10"]),
                     "kvxfer-bench --listen")
    children.append(listen)
    addr = listen.line("KVXFER-ADDR ", 2 * WAIT)
    p = subprocess.run(
        pair.argv(pair.a, [sys.executable, "-m", "kvxfer.cli.bench", "bw", "--connect", addr, "--node", pair.addr_a,
                           "--case", "pages:16Kx256", "--iters", "3", "--warmup", "1", "--timeout", "10", "-q"]),
        capture_output=True, text=True, timeout=60, env=N.child_env())
    assert p.returncode == 0, f"--connect failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    rows = [line for line in p.stdout.splitlines() if line.startswith(N.PROVIDER)]
    assert len(rows) == 1 and rows[0].split()[-1] == "ok", p.stdout
    assert listen.wait(WAIT) == 0, listen.describe()


@pytest.mark.parametrize("cut", ["sigkill", "link-down"])
def test_dead_peer_fails_in_bounded_time(pair, children, cut):
    """Writes are flowing when the target is SIGKILLed (its kernel resets the connection) or
    its veth goes down (silence, no reset). The initiator's ``Transfer.wait(3)`` raises
    PeerError or TimeoutError instead of hanging, and the process closes and exits."""
    wait_s = 3.0
    tgt = _start(children, pair, pair.b, "target", "--node", pair.addr_b)
    addr, desc = tgt.line("READY ", WAIT).split()
    flood = N.role(pair, pair.a, "flood", "--node", pair.addr_a, "--addr", addr, "--desc", desc,
                   "--timeout", str(wait_s), "--budget", "15", "--deadline", "25")
    children.append(flood)
    flood.line("FLOWING ", 2 * WAIT)
    time.sleep(0.1)
    t_cut = time.monotonic()
    try:
        if cut == "sigkill":
            tgt.kill()
        else:
            pair.set_link(False)
        failed = json.loads(flood.line("FAILED ", wait_s + 5))
        t_failed = time.monotonic() - t_cut
        out = flood.result(10)
        assert flood.wait(10) == 0, flood.describe()
        t_exit = time.monotonic() - t_cut
    finally:
        if cut == "link-down":
            pair.set_link(True)
    assert failed["error"] in ("PeerError", "TimeoutError"), failed
    assert failed["is_connection_error"] or failed["is_timeout_error"]
    assert failed["writes_before"] >= 2
    assert failed["wait_s"] <= wait_s + 1.0
    assert t_failed <= wait_s + 3.0 and t_exit <= wait_s + 8.0, (t_failed, t_exit)
    assert out["close_s"] < 5.0
    if cut == "link-down":
        assert failed["error"] == "TimeoutError", "no packet can say the peer died: only the clock can"
