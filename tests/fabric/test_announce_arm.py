"""The engine's arm of a decoder leg's ANNOUNCE (src/announce.c, ``Engine.arm_announce``) on the
real providers: what it takes and what it leaves to the messenger thread, its one-shot hand-over,
a waiting caller woken at the last write, the quiet message still read in order, and the check
alone against the messenger's own codec (hypothesis)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import _fabric
from kvxfer.errors import DescriptorError, InvalidArgumentError
from kvxfer.messenger import _codec as C

from _data import until

SECRET = b"a-secret-of-at-least-16-bytes"
SRC, DST = 0x1111_2222_3333_4445, 0x5555_6666_7777_8889


def _announce(seq: int, imm: int, count: int, secret=SECRET, src=SRC, dst=DST) -> bytes:
    return C.Control(C.ANNOUNCE, src, dst, seq, imm=imm, count=count).encode(secret)


@pytest.fixture
def linked(pair):
    """a writes into b's region and sends b control messages; b's arms check with SECRET."""
    a, b = pair
    src = np.arange(1 << 12, dtype=np.uint8)
    dst = np.zeros(len(src), np.uint8)
    ms, md = a.register(src), b.register(dst)
    b.announce_key(SECRET)
    yield a, b, ms, a.connect(b.address), a.remote(md.descriptor())


def _writes(a, ms, peer, rr, imm, n):
    for i in range(n):
        a.write(ms, 64 * i, peer, rr, 64 * i, 64, imm=imm).wait(10)


def _until(pred, timeout=10.0):
    assert until(pred, timeout), "timed out"


def test_an_announce_after_its_writes_is_met_by_the_engine(linked):
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(7, SRC, DST, 4, 2, 10)
    assert arm.state == "open"
    _writes(a, ms, peer, rr, 7, 3)
    _until(lambda: b.banked(7) == 3)
    t0 = time.monotonic_ns()
    msg = _announce(5, 7, 3)
    a.send(peer, msg)
    _until(lambda: arm.state == "armed")
    assert b.recv(5) == msg                         # the messenger thread still reads it
    assert b.banked(7) == 0 and b.stats()["armed"] == 1
    count, seq, c = arm.close()
    assert (count, seq) == (3, 5) and c.done and c.state == "done" and c.arrived == 3
    assert t0 <= c.done_ns <= time.monotonic_ns()
    assert arm.close() is None and arm.state == "closed"       # handed over once
    assert arm.wait(0) is True


@pytest.mark.parametrize("why", ["tag", "secretless", "sender", "receiver", "replay", "few", "many", "imm",
                                 "aborted"])
def test_an_announce_the_messenger_would_refuse_is_left_to_it(linked, why):
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(9, SRC, DST, 4, 2, 10)
    _writes(a, ms, peer, rr, 9, 3)
    _until(lambda: b.banked(9) == 3)
    msg = {"tag": _announce(5, 9, 3)[:-1] + b"\0", "secretless": _announce(5, 9, 3, secret=None),
           "sender": _announce(5, 9, 3, src=SRC + 2), "receiver": _announce(5, 9, 3, dst=DST + 2),
           "replay": _announce(4, 9, 3), "few": _announce(5, 9, 1), "many": _announce(5, 9, 11),
           "imm": _announce(5, 8, 3),
           "aborted": C.Control(C.ABORTED, SRC, DST, 5, imm=9, count=3, flags=0).encode(SECRET)}[why]
    a.send(peer, msg)
    assert b.recv(5) == msg
    assert arm.state == "open" and b.banked(9) == 3 and b.stats()["armed"] == 0
    assert arm.close() is None
    a.send(peer, _announce(6, 9, 3))                # closed: nothing arms it any more
    b.recv(5)
    assert b.banked(9) == 3 and b.stats()["armed"] == 0


def test_an_announce_before_its_writes_is_left_alone_unless_a_caller_waits(linked):
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(11, SRC, DST, 0, 1, 10)
    a.send(peer, _announce(1, 11, 2))               # nothing landed, nobody waits
    assert b.recv(5) is not None
    assert arm.state == "open"
    assert arm.close() is None
    # a caller waits: armed at once, woken only by the last write
    arm = b.arm_announce(12, SRC, DST, 1, 1, 10)
    woke = []
    t = threading.Thread(target=lambda: woke.append((arm.wait(10), time.monotonic_ns())))
    t.start()
    _until(lambda: arm.waiting == 1)                # the caller is in the native wait
    a.send(peer, _announce(2, 12, 2))
    _until(lambda: arm.state == "armed")
    time.sleep(0.05)
    assert not woke                                 # armed, its counter not met
    _writes(a, ms, peer, rr, 12, 1)
    time.sleep(0.05)
    assert not woke
    t_last = time.monotonic_ns()
    _writes(a, ms, peer, rr, 12, 1)
    t.join(10)
    assert woke and woke[0][0] is True and woke[0][1] >= t_last
    count, seq, c = arm.close()
    assert (count, seq) == (2, 2) and c.done and c.done_ns >= t_last
    # the message was queued quiet: still read, in order, once a reader's slice passes
    assert C.Control.decode(b.recv(5), SECRET).seq == 2


def test_a_pending_armed_counter_gets_its_callback(linked):
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(13, SRC, DST, 0, 1, 10)
    t = threading.Thread(target=lambda: arm.wait(30))
    t.start()
    _until(lambda: arm.waiting == 1)
    a.send(peer, _announce(1, 13, 2))
    _until(lambda: arm.state == "armed")
    count, seq, c = arm.close()                     # the waiter sees the close and returns
    t.join(5)
    assert not t.is_alive()
    assert not c.done
    fired = threading.Event()
    assert b.set_callback(c, lambda _c: fired.set()) is True
    with pytest.raises(InvalidArgumentError, match="already"):
        b.set_callback(c, lambda _c: None)
    _writes(a, ms, peer, rr, 13, 2)
    assert fired.wait(10) and c.done
    _writes(a, ms, peer, rr, 14, 1)
    _until(lambda: b.banked(14) == 1)
    c2 = b.expect(14, 1)                            # met at once from the banked write
    assert b.set_callback(c2, lambda _c: fired.clear()) is False     # met already: no callback
    time.sleep(0.05)
    assert fired.is_set() and c2.callback is None


def test_closing_for_an_older_message_undoes_a_later_arming(linked):
    """The messenger, handling a message of seq 5, closes an arm a later ANNOUNCE (seq 6)
    armed: nothing is taken and every arrival it was credited is banked again, so the
    messenger's own expectation (when it reads seq 6) finds them."""
    a, b, ms, peer, rr = linked
    for pending in (False, True):
        imm = 15 + pending
        arm = b.arm_announce(imm, SRC, DST, 0, 1, 10)
        t = None
        if pending:                                 # a caller waits: armed before all landed
            t = threading.Thread(target=lambda: arm.wait(30))
            t.start()
            _until(lambda: arm.waiting == 1)
        _writes(a, ms, peer, rr, imm, 1 if pending else 2)
        _until(lambda: b.banked(imm) == (1 if pending else 2))
        a.send(peer, _announce(6, imm, 2))
        _until(lambda: arm.state == "armed")
        assert arm.close(before=5) is None and arm.state == "closed"
        if t is not None:
            t.join(5)
        assert b.banked(imm) == (1 if pending else 2)
        c = b.expect(imm, 2)
        if pending:
            _writes(a, ms, peer, rr, imm, 1)
        c.wait(10)
        assert c.state == "done" and c.arrived == 2


def test_an_engine_closing_under_an_armed_count_ends_it_unmet(pair):
    a, b = pair
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    arm = b.arm_announce(17, SRC, DST, 0, 1, 10)
    got = []
    t = threading.Thread(target=lambda: got.append(arm.wait(30)))
    t.start()
    _until(lambda: arm.waiting == 1)
    a.send(peer, C.Control(C.ANNOUNCE, SRC, DST, 1, imm=17, count=3).encode(None))
    _until(lambda: arm.state == "armed")
    b.close()
    t.join(10)
    assert got == [True]
    count, seq, c = arm.close()
    assert count == 3 and c.done and c.state == "closed" and c.done_ns == 0     # ended, not met
    del md


def test_a_long_secret_is_a_key_too(pair):
    a, b = pair
    key = bytes(range(100))                         # longer than SHA-256's block: HMAC hashes it
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer, rr = a.connect(b.address), a.remote(md.descriptor())
    b.announce_key(key)
    arm = b.arm_announce(19, SRC, DST, 0, 1, 10)
    a.write(ms, 0, peer, rr, 0, 8, imm=19).wait(10)
    _until(lambda: b.banked(19) == 1)
    a.send(peer, _announce(1, 19, 1, secret=key[:99]))    # another key's tag
    b.recv(5)
    assert arm.state == "open"
    a.send(peer, _announce(2, 19, 1, secret=key))
    _until(lambda: arm.state == "armed")
    assert arm.close()[0] == 1


def test_a_held_arm_counts_as_waited_on(linked):
    """A Receive's later legs are held while its caller waits on the first: their ANNOUNCEs
    arm them before their writes land, queued quiet, as for a caller inside wait()."""
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(23, SRC, DST, 0, 1, 10)
    arm.hold(1)
    assert arm.waiting == 1
    a.send(peer, _announce(1, 23, 1))
    _until(lambda: arm.state == "armed")
    arm.hold(-1)
    assert arm.waiting == 0
    _writes(a, ms, peer, rr, 23, 1)
    assert arm.wait(10)
    count, seq, c = arm.close()
    assert count == 1 and c.state == "done"
    with pytest.raises(InvalidArgumentError):
        arm.hold(2)


def test_arm_refusals(linked):
    a, b, ms, peer, rr = linked
    arm = b.arm_announce(21, SRC, DST, 0, 1, 10)
    with pytest.raises(InvalidArgumentError, match="open arm"):
        b.arm_announce(21, SRC, DST, 0, 1, 10)
    with pytest.raises(InvalidArgumentError):
        b.arm_announce(22, SRC, DST, 0, 5, 4)
    with pytest.raises(InvalidArgumentError):
        b.arm_announce(None, SRC, DST, 0, 1, 4)
    with pytest.raises(InvalidArgumentError):
        b.arm_announce(22, -1, DST, 0, 1, 4)
    with pytest.raises(InvalidArgumentError):
        b.announce_key(b"k" * 257)
    arm.close()
    b.arm_announce(21, SRC, DST, 0, 1, 10).close()   # closed: the imm can be armed again


def test_closing_the_engine_settles_open_arms(pair):
    a, b = pair
    arm = b.arm_announce(31, SRC, DST, 0, 1, 10)
    got = []
    t = threading.Thread(target=lambda: got.append(arm.wait(30)))
    t.start()
    _until(lambda: arm.waiting == 1)
    b.close()
    t.join(10)
    assert got == [True] and arm.state == "closed" and arm.close() is None


@settings(max_examples=400, deadline=None)
@given(src=st.integers(0, 2**64 - 1), dst=st.integers(0, 2**64 - 1), seq=st.integers(0, 2**64 - 1),
       imm=st.integers(1, 2**32 - 1), count=st.integers(0, 2**64 - 1), floor=st.integers(0, 2**64 - 1),
       least=st.integers(0, 8), most=st.integers(0, 2**64 - 1), keyed=st.booleans(),
       flip=st.one_of(st.none(), st.tuples(st.integers(0, 71), st.integers(1, 255))),
       cut=st.integers(-3, 3), other=st.sampled_from([None, "src", "dst", "imm"]))
def test_the_check_agrees_with_the_codec(src, dst, seq, imm, count, floor, least, most, keyed, flip, cut, other):
    """kx_announce_count takes exactly what the messenger's on_announce would: a message its
    codec decodes (tag, magic, version, sizes) as an ANNOUNCE from this sender to this
    receiver, newer than the floor, for this imm, with a count in the bounds."""
    secret = SECRET if keyed else None
    data = bytearray(C.Control(C.ANNOUNCE, src, dst, seq, imm=imm, count=count).encode(secret))
    if flip is not None and flip[0] < len(data):
        data[flip[0]] ^= flip[1]
    data = bytes(data[:len(data) + cut] if cut < 0 else data + b"\0" * cut)
    want_src, want_dst, want_imm = src, dst, imm
    if other == "src":
        want_src ^= 1
    elif other == "dst":
        want_dst ^= 1
    elif other == "imm":
        want_imm = want_imm % (2**32 - 1) + 1
    try:
        m = C.Control.decode(data, secret)
        ok = (m.type == C.ANNOUNCE and m.src == want_src and m.dst == want_dst and m.seq > floor
              and m.imm == want_imm and least <= m.count <= most and m.count < 2**63)
        expected = m.count if ok else -1
    except DescriptorError:
        expected = -1
    got = _fabric.announce_count(data, secret or b"", want_imm, want_src, want_dst, floor, least, most)
    assert got == expected
