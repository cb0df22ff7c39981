"""Announcement and Directory over real messengers (tcp;ofi_rxm on 127.0.0.1, in this
process) and each store that runs here: names published per rank, lazy connects, requests
byte-exact through a looked-up peer, a restarted instance seen as a new one, a forged entry
refused with a secret, lease expiry as a failure signal, and lookups while the store is down."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
import kvxfer.rendezvous as R
from kvxfer import KVLayout, Sharding
from kvxfer.errors import DescriptorError, InvalidArgumentError, PeerError, RendezvousError

pytestmark = pytest.mark.timeout(120)
PROVIDER = "tcp;ofi_rxm"
LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")
SECRET = b"rendezvous-test-secret-0123"


@pytest.fixture(scope="module", params=["file", "redis", "etcd"])
def server(request):
    from _backends import make_server, why_not

    if PROVIDER not in kvxfer.providers():
        pytest.skip(f"{PROVIDER} is not available here")
    why = why_not(request.param)
    if why:
        pytest.skip(why)
    srv = make_server(request.param)
    srv.kind = request.param
    try:
        yield srv
    finally:
        srv.close()


class _Node:
    """A messenger on its own engine; ``serve``: answer every request from source pages 0..n-1."""

    def __init__(self, sharding, fill, secret=SECRET, serve=False):
        self.eng = kvxfer.Engine(PROVIDER, "127.0.0.1")
        self.regions = {r: [np.full(s, fill + r, np.uint8) for s in LAYOUT.region_sizes(sharding)]
                        for r in range(sharding.tp_size)}
        kw = dict(on_request=self._serve) if serve else dict(context_slots=0)
        self.m = kvxfer.Messenger(self.eng, LAYOUT, sharding, self.regions, peer_timeout=2.0, secret=secret, **kw)

    def _serve(self, req):
        self.m.send(req, list(range(len(req.dst_pages)))).finish(None)

    def close(self):
        self.m.close()
        self.eng.close()


@pytest.fixture
def nodes():
    made = []
    yield made
    for n in reversed(made):
        n.close()


def _prefill(nodes, fill=10):
    n = _Node(Sharding(2), fill, serve=True)
    nodes.append(n)
    return n


def test_announce_then_lazy_connect_and_requests(store, nodes):
    pre = _prefill(nodes)
    dec = _Node(Sharding(1), 0xEE)
    nodes.append(dec)
    ann = R.Announcement(store, pre.m, "prefill", "p0", ttl=2.0)
    assert sorted(store.list("prefill/")) == ["prefill/p0/0", "prefill/p0/1"]
    assert set(store.list("prefill/").values()) == {pre.m.handshake()}
    d = R.Directory(store, dec.m, "prefill", interval=0.05, grace=1.0)
    try:
        assert d.wait_for(1, 10) == ["p0"]
        assert dec.m.peers == []                     # listed, not connected: connects are lazy
        inst = d.connect("p0")
        assert inst.state == "up" and len(inst.groups) == 1 and d.connect("p0") is inst
        r = dec.m.receive(inst.peer, "req-1", [3, 5], 8)
        assert r.wait(20) == "done"
        # TP2 -> TP1: each rank's heads come from its own source regions (fill 10, 11)
        assert {int(v) for reg in dec.regions[0] for v in np.unique(reg)} >= {10, 11}
        r.release()
        with pytest.raises(PeerError, match="no prefill instance"):
            d.connect("p9")
        ann.close()
        assert store.list("prefill/") == {}
        assert _wait(lambda: d.names() == [] or inst.state == "gone", 10)
        assert _wait(lambda: inst.state == "gone", 5)
        assert d.counts["expired"] == 1
    finally:
        d.close()


def test_an_expired_lease_fails_the_instances_requests_through_drop_peer(store, nodes):
    """The lease as a second failure signal: the entries go (here: the announcement closed,
    the prefiller itself alive and heartbeating), and the decoder's pending request fails with
    the directory's PeerError naming the instance, fenced, not with heartbeat silence."""
    pre = _Node(Sharding(2), 10)                     # takes requests, never answers them
    nodes.append(pre)
    dec = _Node(Sharding(1), 0xEE)
    nodes.append(dec)
    ann = R.Announcement(store, pre.m, "prefill", "p0", ttl=2.0)
    d = R.Directory(store, dec.m, "prefill", interval=0.05, grace=0.5)
    try:
        assert d.wait_for(1, 10) == ["p0"]
        inst = d.connect("p0")
        r = dec.m.receive(inst.peer, "req-lease", [3, 5], 8, timeout=60)
        ann.close()
        with pytest.raises(PeerError, match="instance 'p0'"):
            r.wait(20)
        assert r.fenced and not inst.groups[0].alive
        assert d.counts["dropped"] == 1 and d.counts["expired"] == 1
    finally:
        d.close()


def _wait(pred, timeout):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_restarted_instance_is_a_new_one(store, nodes):
    dec = _Node(Sharding(1), 0xEE)
    nodes.append(dec)
    d = R.Directory(store, dec.m, "prefill", interval=0.05, grace=5.0)
    try:
        first = _prefill(nodes)
        a1 = R.Announcement(store, first.m, "prefill", "p0", ttl=2.0)
        d.wait_for(1, 10)
        i1 = d.connect("p0")
        a1.close()
        first.close()
        nodes.remove(first)
        second = _prefill(nodes, fill=20)
        a2 = R.Announcement(store, second.m, "prefill", "p0", ttl=2.0)
        assert _wait(lambda: d.instance("p0") is not i1, 10)
        assert i1.state == "gone"
        i2 = d.connect("p0")
        assert i2.peer.uid == second.m.uid != i1.peer.uid
        r = dec.m.receive(i2.peer, "again", [1], 1)
        assert r.wait(20) == "done"
        r.release()
        a2.close()
    finally:
        d.close()


def test_forged_entry_refused_with_a_secret(store, nodes):
    dec = _Node(Sharding(1), 0xEE)
    nodes.append(dec)
    rogue = _Node(Sharding(2), 1, secret=b"another-secret-0123456789")
    nodes.append(rogue)
    store.put("prefill/evil/0", rogue.m.handshake())
    store.put("prefill/junk/0", b"not a handshake at all")
    d = R.Directory(store, dec.m, "prefill", interval=0.05)
    try:
        assert d.wait_for(2, 10) == ["evil", "junk"]
        with pytest.raises(DescriptorError):
            d.connect("evil")
        with pytest.raises(DescriptorError):
            d.connect("junk")
        assert dec.m.peers == []
    finally:
        d.close()
        store.delete("prefill/evil/0")
        store.delete("prefill/junk/0")


def test_store_down_connected_goes_on_lookups_fail(server, store, nodes):
    pre = _prefill(nodes)
    other = _prefill(nodes, fill=30)
    dec = _Node(Sharding(1), 0xEE)
    nodes.append(dec)
    a0 = R.Announcement(store, pre.m, "prefill", "p0", ttl=2.0)
    a1 = R.Announcement(store, other.m, "prefill", "p1", ttl=2.0)
    d = R.Directory(store, dec.m, "prefill", interval=0.05, grace=3.0)
    try:
        d.wait_for(2, 10)
        inst = d.connect("p0")
        server.stop()
        assert _wait(lambda: not d.store_ok, 5)
        assert d.names() == ["p0", "p1"]             # the last list stands
        for i in range(5):                            # the data path goes on
            r = dec.m.receive(inst.peer, f"down-{i}", [i], 1)
            assert r.wait(20) == "done"
            r.release()
        with pytest.raises(RendezvousError):          # a new lookup needs the store
            d.connect("p1")
        with pytest.raises(RendezvousError):
            d.connect("p7")
        assert _wait(lambda: a0.state == "lost", 10)
        server.start()
        assert _wait(lambda: a0.state == "held" and a1.state == "held", 10)
        assert _wait(lambda: d.store_ok, 5)
        assert d.connect("p1").state == "up"
        assert inst.state == "up" and d.names() == ["p0", "p1"]
    finally:
        d.close()
        a0.close()
        a1.close()


def test_bad_names_refused(store, nodes):
    pre = _prefill(nodes)
    for role, inst in (("pre/fill", "p0"), ("prefill", "a/b"), ("prefill", ""), ("", "p0")):
        with pytest.raises(InvalidArgumentError):
            R.Announcement(store, pre.m, role, inst)
    assert store.list("") == {}
