"""Bad input of issue 9's list: a precise kvxfer error or a dropped message with a counted
reason; nothing written, nothing hangs. Two messengers (and a rogue engine) in one process."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.errors import (
    RejectedError,
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    LayoutError,
    OutOfBoundsError,
    PeerError,
    PlanError,
)
from kvxfer.messenger import _codec as C
from _pair import LAYOUT, SECRET, SH, open_pair, regions



@pytest.fixture
def pair(provider):
    """A prefill and a decode messenger, each on its own engine, with a shared secret."""
    t = open_pair(provider)
    yield t.p, t.d, t.pg, t.src, t.dst
    t.close()


def _untouched(dst):
    return all((r == 0xEE).all() for r in dst)


def test_decoder_side_refusals(pair):
    p, d, pg, src, dst = pair
    with pytest.raises(OutOfBoundsError):
        d.receive(pg, "a", [0, 32], 4)                   # page 32 is outside the pool of 32
    with pytest.raises(OutOfBoundsError):
        d.receive(pg, "a", [-1], 1)
    with pytest.raises(InvalidArgumentError, match="twice"):
        d.receive(pg, "a", [3, 3], 4)
    with pytest.raises(InvalidArgumentError):
        d.receive(pg, "a", [], 1)
    with pytest.raises(InvalidArgumentError):
        d.receive(pg, "a", [1.0], 1)
    with pytest.raises(InvalidArgumentError, match="num_tokens 5 from first_token 0 fill exactly 2 page"):
        d.receive(pg, "a", [1], 5)                       # 5 tokens do not fit one 4-token page
    with pytest.raises(InvalidArgumentError, match="num_tokens 4 from first_token 0 fill exactly 1 page"):
        d.receive(pg, "a", [1, 2], 4)                    # nor do 4 tokens fill two (checked both ways)
    with pytest.raises(InvalidArgumentError, match="fill exactly 1 page"):
        d.receive(pg, "a", [1, 2], 8, first_token=4)     # a prefix hit names [first_token's page, ...)
    with pytest.raises(InvalidArgumentError):
        d.receive(pg, ("tuple", "id"), [1], 1)
    with pytest.raises(InvalidArgumentError):
        d.receive("not a peer", "a", [1], 1)
    with pytest.raises(InvalidArgumentError):
        d.receive(pg, "a", [1], 1, timeout=float("nan"))
    r = d.receive(pg, "a", [1, 2], 5)
    with pytest.raises(InvalidArgumentError, match="in flight"):
        d.receive(pg, "a", [5], 1)                       # the id is in flight
    with pytest.raises(InvalidArgumentError, match="unfinished or quarantined"):
        d.receive(pg, "b", [2], 1)                       # its pages are taken
    assert r.abort(10) is True and r.state == "aborted"
    assert _untouched(dst)
    assert p.stats()["recv_REQUEST"] == 1 and p.stats()["recv_ABORT"] == 1
    assert p.requests(timeout=0.1) == []                  # withdrawn from the inbox before it was taken


def test_request_timeout_aborts_with_fence(pair):
    """A request not done within its timeout is aborted (with the fence) and fails with
    TimeoutError; its pages are free again."""
    p, d, pg, src, dst = pair
    r = d.receive(pg, "slow", [9], 1, timeout=0.2)      # nobody serves it
    with pytest.raises(kvxfer.errors.TimeoutError, match="timeout"):
        r.wait(10)
    assert r.state == "failed" and r.fenced
    r2 = d.receive(pg, "slow", [9], 1)                  # id and page are free again
    reqs = p.requests(timeout=5)
    assert [q.request_id for q in reqs] == ["slow"]     # the first was withdrawn before it was taken
    p.send(reqs[0], [2]).finish(b"ok")
    assert r2.wait(10) == "done" and bytes(r2.context) == b"ok"


def test_prefiller_side_refusals(pair):
    p, d, pg, src, dst = pair
    r = d.receive(pg, 7, [4, 5], 8)
    (req,) = p.requests(timeout=5)
    assert req.request_id == 7 and list(req.dst_pages) == [4, 5]
    with pytest.raises(PlanError):
        p.send(req, [0, 99])                             # a source page outside the pool
    with pytest.raises(PlanError):
        p.send(req, [0])                                 # fewer source pages than destinations
    with pytest.raises(InvalidArgumentError):
        p.send("not a request", [0, 1])
    assert _untouched(dst)                               # nothing was posted
    s = p.send(req, [0, 1])
    with pytest.raises(InvalidArgumentError, match="already sent"):
        p.send(req, [0, 1])
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        s.finish(b"x" * 17)                              # 16-byte context slots
    s.finish(b"ctx")
    with pytest.raises(InvalidArgumentError, match="already"):
        s.finish(b"ctx")
    assert r.wait(10) == "done" and bytes(r.context) == b"ctx"
    assert s.wait(10) == "done"


def test_connect_refusals(pair, provider):
    p, d, pg, src, dst = pair
    with pytest.raises(DescriptorError):
        d.connect(b"garbage")
    with pytest.raises(DescriptorError, match="authentication"):
        d.connect(p.handshake()[:-1] + bytes([p.handshake()[-1] ^ 1]))
    with pytest.raises(InvalidArgumentError, match="own"):
        d.connect(d.handshake())
    assert d.connect(p.handshake()) is pg                 # idempotent
    with kvxfer.Engine(provider, "127.0.0.1") as ec:
        other = KVLayout.vllm(2, 4, 16, 4, 32, "float16")  # another head_dim
        bad = kvxfer.Messenger(ec, other, SH, {0: [np.zeros(s, np.uint8) for s in other.region_sizes(SH)]},
                               secret=SECRET)
        try:
            with pytest.raises(LayoutError):
                d.connect(bad.handshake())
        finally:
            bad.close()
        nosecret = kvxfer.Messenger(ec, LAYOUT, SH, {0: regions(0)})
        try:
            with pytest.raises(DescriptorError, match="authentication"):
                d.connect(nosecret.handshake())          # an untagged handshake is refused
            with pytest.raises(DescriptorError):
                nosecret.connect(d.handshake())          # and a tagged one without the secret
        finally:
            nosecret.close()


def test_rogue_messages_are_dropped(pair, provider):
    """An engine that never handshook (or lacks the secret) sends well-formed and malformed
    control messages: each is dropped with a counted reason and nothing is written."""
    p, d, pg, src, dst = pair
    with kvxfer.Engine(provider, "127.0.0.1") as rogue:
        to_p = rogue.connect(p.engine.address)
        req = C.Control(C.REQUEST, 999, p.uid, 1, imm=5, num_tokens=1, slot=0, request_id="evil",
                        pages=np.array([0]))
        rogue.send(to_p, req.encode(SECRET))              # right secret, unknown sender
        rogue.send(to_p, req.encode(None))                # no tag
        rogue.send(to_p, req.encode(b"guessed secret 1234"))
        forged = C.Control(C.ABORT, d.uid, p.uid, 10**6, imm=5)
        rogue.send(to_p, forged.encode(b"guessed secret 1234"))   # claims to be the decoder
        rogue.send(to_p, b"\x00" * 10)                      # no tag either
        rogue.send(to_p, C._seal(b"\x00" * 40, SECRET))     # authentic bytes, not a message
        ack = C.Control(C.HELLO, 999, p.uid, 1, blob=b"not a handshake")
        rogue.send(to_p, ack.encode(SECRET))
        # a captured (authentic) message of the real decoder, sent again: its seq is old
        rogue.send(to_p, C.Control(C.HEARTBEAT, d.uid, p.uid, 1).encode(SECRET))
        deadline = time.monotonic() + 10
        want = {"drop_unknown_peer": 1, "drop_unauthenticated": 4, "drop_malformed": 1, "drop_bad_handshake": 1,
                "drop_replayed": 1}
        while time.monotonic() < deadline:
            st = p.stats()
            if all(st.get(k, 0) >= v for k, v in want.items()):
                break
            time.sleep(0.02)
        st = p.stats()
        assert {k: st.get(k, 0) for k in want} == want, st
        assert p.requests(timeout=0.2) == []
        rogue.disconnect(to_p)
    assert _untouched(dst)


def test_prefiller_rejects_hostile_request(pair):
    """A request naming pages outside the decoder's own pool (as a buggy or hostile decoder
    would send) is refused by the prefiller with a REJECT, and the Receive fails."""
    from _nodes import hostile_request

    p, d, pg, src, dst = pair
    r = hostile_request(d, pg)
    with pytest.raises(RejectedError, match="rejected"):
        r.wait(10)
    assert p.stats().get("drop_bad_request") == 1
    assert p.requests(timeout=0.2) == []


def test_closed_messenger_refuses(provider):
    with kvxfer.Engine(provider, "127.0.0.1") as e:
        m = kvxfer.Messenger(e, LAYOUT, SH, {0: regions(0)})
        m.close()
        m.close()
        with pytest.raises(ClosedError):
            m.connect(b"x")
        with pytest.raises(ClosedError):
            m.requests(timeout=0)


def test_constructor_refusals(provider):
    with kvxfer.Engine(provider, "127.0.0.1") as e:
        with pytest.raises(InvalidArgumentError, match="needs"):
            kvxfer.Messenger(e, LAYOUT, SH, {0: [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]})
        with pytest.raises(InvalidArgumentError, match="not a rank of TP2"):
            kvxfer.Messenger(e, LAYOUT, Sharding(2), {0: regions(0), 5: regions(0)})
        with pytest.raises(LayoutError):
            kvxfer.Messenger(e, KVLayout.vllm(2, 3, 8, 4, 32), Sharding(2), {0: regions(0)})
        with pytest.raises(InvalidArgumentError, match="secret"):
            kvxfer.Messenger(e, LAYOUT, SH, {0: regions(0)}, secret=b"short")
        with pytest.raises(InvalidArgumentError):
            kvxfer.Messenger(e, LAYOUT, SH, {0: regions(0)}, peer_timeout=0)


def test_dead_peer_refused_and_new_address_is_new_peer(provider):
    """A peer that closed (BYE) is dead: its old handshake is refused; a restarted peer
    (new engine, new handshake) connects as a new group."""
    with kvxfer.Engine(provider, "127.0.0.1") as eb:
        d = kvxfer.Messenger(eb, LAYOUT, SH, {0: regions(0xEE)}, peer_timeout=5)
        try:
            ea = kvxfer.Engine(provider, "127.0.0.1")
            p = kvxfer.Messenger(ea, LAYOUT, SH, {0: regions(7)}, peer_timeout=5)
            pg = d.connect(p.handshake())
            r = d.receive(pg, "x", [0], 1)
            old = p.handshake()
            p.close()                                      # BYE: the decoder fails its request
            with pytest.raises(PeerError):
                r.wait(10)
            assert r.fenced and not pg.alive
            with pytest.raises(PeerError, match="dead"):
                d.connect(old)
            ea.close()
            with kvxfer.Engine(provider, "127.0.0.1") as ea2:
                p2 = kvxfer.Messenger(ea2, LAYOUT, SH, {0: regions(9)}, peer_timeout=5)
                pg2 = d.connect(p2.handshake())
                assert pg2 is not pg and pg2.alive
                r2 = d.receive(pg2, "x", [0], 1)           # the id and page are free again
                (q,) = p2.requests(timeout=5)
                p2.send(q, [3]).finish()
                assert r2.wait(10) == "done"
                p2.close()
        finally:
            d.close()
