"""The rendezvous store interface over every backend that runs here (a directory, real etcd
and Redis servers, torch's TCPStore where importable): bytes round trips, refusals, leases
kept alive, expired, deleted and re-established after the server restarted, watches, and an
unreachable server as a precise error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import kvxfer.rendezvous as R
from kvxfer.errors import ArgumentTypeError, ClosedError, InvalidArgumentError, RendezvousError, UnsupportedError

pytestmark = pytest.mark.timeout(90)
TTL = 1.0


def _until(pred, timeout=10.0, step=0.02):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(step)
    return True


def test_bytes_round_trip_and_namespaces(server, store):
    value = bytes(range(256)) * 3
    store.put("a/b/c", value)
    store.put("a/d", b"")
    assert store.get("a/b/c") == value and store.get("a/d") == b""
    assert store.get("a/none") is None
    assert store.list("a/") == {"a/b/c": value, "a/d": b""}
    assert store.list("a/b") == {"a/b/c": value}
    assert store.list("x/") == {}
    assert store.delete("a/d") is True and store.delete("a/d") is False
    assert store.list("") == {"a/b/c": value}
    if server.kind != "file":         # another namespace of the same server sees nothing of this one
        other = R.open(server.url.rsplit("/", 1)[0] + "/other", op_timeout=1.0)
        try:
            assert other.list("") == {} and other.get("a/b/c") is None
            other.put("a/b/c", b"mine")
            assert store.get("a/b/c") == value
        finally:
            other.delete("a/b/c")
            other.close()


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", "a/../b", "..", "a b", "é", "a/./b", "x" * 513])
def test_bad_keys_refused(store, key):
    with pytest.raises(InvalidArgumentError):
        store.put(key, b"v")
    assert store.list("") == {}


def test_bad_values_and_arguments_refused(store):
    for v in ("text", 5, None, [1]):
        with pytest.raises(ArgumentTypeError):
            store.put("k", v)
    with pytest.raises(InvalidArgumentError):
        store.put("k", b"\0" * (R.store.MAX_VALUE + 1))
    with pytest.raises(ArgumentTypeError):
        store.get(b"k")
    with pytest.raises(InvalidArgumentError):
        store.publish("k", b"v", ttl=0.1)
    with pytest.raises(InvalidArgumentError):
        store.publish("k", b"v", ttl=float("nan"))
    with pytest.raises(ArgumentTypeError):
        store.watch("k/", "not callable")
    assert store.list("") == {}


@pytest.mark.parametrize("url", ["http://h/x", "etcd://h:1", "redis://h:99999/x", "etcd://u:p@h:1/x",
                                 "redis://h/x?db=1", "file://other/dir", "file://relative", 7, "etcd:///x"])
def test_bad_urls_refused(url):
    with pytest.raises(InvalidArgumentError):
        R.open(url)


def test_lease_kept_alive_then_deleted_on_close(store):
    lease = store.publish("prefill/i0/0", b"blob", ttl=TTL)
    time.sleep(3 * TTL)                          # three TTLs: only renewals keep it
    assert store.get("prefill/i0/0") == b"blob"
    assert lease.state == "held" and lease.renewals >= 3
    lease.close()
    assert store.get("prefill/i0/0") is None
    lease.close()                                # idempotent
    assert lease.state == "closed"


_PUBLISHER = """
import sys, time
import kvxfer.rendezvous as R
s = R.open(sys.argv[1], op_timeout=1.0)
s.publish("prefill/dead/0", b"soon gone", ttl=float(sys.argv[2]))
print("PUBLISHED", flush=True)
time.sleep(60)
"""


def test_lease_of_a_killed_publisher_expires(server, store):
    p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, server.url, str(TTL)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert p.stdout.readline().startswith("PUBLISHED")
        assert store.get("prefill/dead/0") == b"soon gone"
        time.sleep(1.5 * TTL)
        assert store.get("prefill/dead/0") == b"soon gone"       # renewed while it lives
        p.kill()
        p.wait(10)
        t0 = time.monotonic()
        # etcd rounds a TTL up to whole seconds and checks expiry on its own clock tick
        assert _until(lambda: store.get("prefill/dead/0") is None, 4 * TTL + 2)
        assert time.monotonic() - t0 <= 4 * TTL + 2
        assert "prefill/dead/0" not in store.list("prefill/")
    finally:
        p.kill()
        p.wait(10)


def test_watch_reports_puts_changes_and_deletes(store):
    seen = []
    cv = threading.Condition()

    def cb(k, v):
        with cv:
            seen.append((k, v))
            cv.notify_all()

    w = store.watch("prefill/", cb, interval=0.05)
    try:
        assert w.wait_first(5)
        store.put("prefill/a/0", b"1")
        store.put("decode/a/0", b"not watched")
        assert _until(lambda: ("prefill/a/0", b"1") in seen)
        store.put("prefill/a/0", b"2")
        assert _until(lambda: ("prefill/a/0", b"2") in seen)
        store.delete("prefill/a/0")
        assert _until(lambda: ("prefill/a/0", None) in seen)
        assert all(k.startswith("prefill/") for k, _ in seen)
        assert w.snapshot() == {}
    finally:
        w.close()
        store.delete("decode/a/0")


def test_callback_errors_do_not_end_a_watch(store):
    got = []

    def cb(k, v):
        got.append(k)
        raise RuntimeError("a user bug")

    w = store.watch("p/", cb, interval=0.05)
    try:
        store.put("p/1", b"x")
        assert _until(lambda: "p/1" in got)
        store.put("p/2", b"y")
        assert _until(lambda: "p/2" in got)
        assert w.callback_errors >= 2 and w.error is None
    finally:
        w.close()
        store.delete("p/1")
        store.delete("p/2")


def test_unreachable_store_then_leases_reestablished(server, store):
    """Server stopped: every call raises RendezvousError (no hang: bounded by op_timeout),
    a watch reports no deletion, the lease goes 'lost'; restarted (Redis comes back empty):
    the lease puts its entry back, the watch sees it unchanged."""
    lease = store.publish("prefill/i1/0", b"hs", ttl=TTL)
    events = []
    w = store.watch("prefill/", lambda k, v: events.append((k, v)), interval=0.05)
    try:
        assert w.wait_first(5) and _until(lambda: events == [("prefill/i1/0", b"hs")])
        server.stop()
        for call in (lambda: store.get("prefill/i1/0"), lambda: store.list(""), lambda: store.put("x", b"y"),
                     lambda: store.delete("x"), lambda: store.publish("prefill/i2/0", b"no", ttl=TTL)):
            t0 = time.monotonic()
            with pytest.raises(RendezvousError) as ei:
                call()
            assert isinstance(ei.value, ConnectionError) and str(server.url) in str(ei.value)
            assert time.monotonic() - t0 < 5.0           # op_timeout 1 s, with the client's own steps
        assert _until(lambda: lease.state == "lost", 5 * TTL)
        assert _until(lambda: w.error is not None, 5)
        assert events == [("prefill/i1/0", b"hs")]      # an unreachable store is not an empty one
        server.start()
        assert _until(lambda: lease.state == "held", 10)
        assert lease.reestablished >= 1
        assert _until(lambda: store.get("prefill/i1/0") == b"hs", 10)
        assert _until(lambda: w.error is None, 5)
        # the entry may show as gone between the restart and the renewal that puts it back
        # (Redis restarts empty; a file or etcd entry whose TTL ran out while down): the
        # Directory's grace covers that window
        time.sleep(0.3)
        assert events[-1] == ("prefill/i1/0", b"hs")
    finally:
        w.close()
        lease.close()


def test_closed_store_refuses(server):
    s = R.open(server.url, op_timeout=1.0)
    lease = s.publish("prefill/c/0", b"x", ttl=TTL)
    s.close()
    assert lease.state == "closed"
    with pytest.raises(ClosedError):
        s.get("prefill/c/0")
    s.close()
    s2 = R.open(server.url, op_timeout=1.0)
    try:
        assert s2.get("prefill/c/0") is None               # close deleted its leased entries
    finally:
        s2.close()


def test_import_costs_nothing_and_missing_client_is_precise():
    code = ("import sys, kvxfer.rendezvous as R, kvxfer.rendezvous.directory; "
            "print(sorted(m for m in ('redis', 'etcd3gw', 'torch', 'requests') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedError, match="torch"):
            R.open("tcpstore://127.0.0.1:1/x")
