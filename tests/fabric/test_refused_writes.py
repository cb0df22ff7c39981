"""A write the target refuses must fail its own transfer, and only it: the peer stays usable
(issue 26 #2).

Fixed for the shm direct path, the issue's case: a copy the target's permit refuses (the region
closed) used to post its imm anyway, which the target refused too: 64 KiB with an imm stalled
until ``peer_timeout`` (``PeerError``) and left its source region unclosable, 4 KiB or no imm
reported ``done``. Now the refused copy fails its transfer at once (``EACCES``) and posts
nothing; the write behind it lands (``test_a_refused_direct_copy_fails_alone``, failing
before on all four cases).

Fixed for RMA writes too (``test_a_write_into_a_closed_region_fails_alone``, strict xfails
before, on both providers): on libfabric 1.17 neither provider tells the sender of a refusal
it can act on (shm refuses silently: 4 KiB, or 64 KiB without imm, report ``done``; 64 KiB
with imm stalls until ``peer_timeout`` and its source region can no longer be closed;
tcp;ofi_rxm drops the connection, failing the honest write posted right after the refused
one), so such a write is never posted: the target announces the close (the revoke exchange,
src/revoke.c, kvxfer/engine/revoke.py) and the sender fails the write itself with
``EACCES``."""

import errno
import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import KvxferError, PeerError
from _data import pattern_array
from _target import Target

@pytest.mark.parametrize("imm", [None, 5])
@pytest.mark.parametrize("nbytes", [4096, 65536])
def test_a_refused_direct_copy_fails_alone(shm, nbytes, imm):
    n = 1 << 20
    src = pattern_array(n, 31, low=1)
    opts = {"peer_timeout": 2}
    with Target("shm", n, memory="memfd", options=opts) as tgt, kvxfer.Engine("shm", **opts) as eng:
        mr, peer, old = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert old.direct
        tgt.call("close")                          # the permit is revoked; the memfd stays
        new = eng.remote(tgt.call("register"))     # the same memory, the slot's next generation
        assert new.direct
        tgt.call("fill", 0)
        refused = eng.write(mr, 0, peer, old, 0, nbytes, imm=imm)
        honest = eng.write(mr, 0, peer, new, 0, 4096, imm=9)
        with pytest.raises(KvxferError) as ei:
            refused.wait(10)
        assert ei.value.errno == errno.EACCES
        honest.wait(10)                            # the peer stays usable
        tgt.expect(9, honest.num_writes)
        assert tgt.wait(9) == ("ok", honest.num_writes)
        got = tgt.memory()
        assert np.array_equal(got[:4096], src[:4096]) and not got[4096:].any()
        if imm is not None:
            assert tgt.call("banked", imm) == 0
        mr.close()                                 # nothing of the refused write is left in flight



@pytest.mark.parametrize("imm", [None, 5])
@pytest.mark.parametrize("nbytes", [4096, 65536])
def test_a_write_into_a_closed_region_fails_alone(provider, nbytes, imm):
    n = 1 << 20
    src = pattern_array(n, 30, low=1)
    opts = {"peer_timeout": 2}
    with Target(provider, n, options=opts) as tgt, kvxfer.Engine(provider, "127.0.0.1", **opts) as eng:
        mr, peer, old = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        tgt.call("close")                          # the target deregisters; the memory stays
        tgt.call("fill", 0)
        new = eng.remote(tgt.call("register"))     # the same memory, a new registration
        tgt.call("fill", 0)
        refused = eng.write(mr, 0, peer, old, 0, nbytes, imm=imm)
        honest = eng.write(mr, 0, peer, new, 0, 4096, imm=9)      # right behind it
        with pytest.raises(KvxferError) as ei:
            refused.wait(10)
        assert ei.value.errno == errno.EACCES      # refused here, before anything was posted
        assert eng.stats()["revoked_keys"] >= 1
        honest.wait(10)                            # the peer stays usable
        tgt.expect(9, honest.num_writes)
        assert tgt.wait(9) == ("ok", honest.num_writes)
        assert np.array_equal(tgt.call("read", 0, 4096), src[:4096].tobytes())
        if imm is not None:
            assert tgt.call("banked", imm) == 0
        mr.close()                                 # nothing of the refused write is left in flight


@pytest.mark.parametrize("imm", [None, 5])
def test_writes_racing_a_close_each_land_or_fail_alone(provider, imm):
    """A stream of writes into a region while its target closes it: each one either landed
    before the close (done, and with an imm counted) or fails with EACCES before it is posted;
    none is refused by the provider, so the peer stays usable."""
    n = 1 << 20
    src = pattern_array(n, 29, low=1)
    opts = {"peer_timeout": 2}
    with Target(provider, n, options=opts) as tgt, kvxfer.Engine(provider, "127.0.0.1", **opts) as eng:
        mr, peer, old = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        sent, stop = [], threading.Event()

        def stream():
            while not stop.is_set() and len(sent) < 20000:
                try:
                    sent.append(eng.write(mr, 0, peer, old, (len(sent) % 16) * 65536, 65536, imm=imm))
                except KvxferError as exc:     # refused at the call: counts as refused
                    sent.append(exc)
                    return

        th = threading.Thread(target=stream)
        th.start()
        try:
            deadline = time.monotonic() + 10
            while len(sent) < 50 and time.monotonic() < deadline:
                time.sleep(0.005)
            tgt.call("close")
            time.sleep(0.05)
        finally:
            stop.set()
            th.join(30)
        done = refused = landed = 0
        for t in sent:
            if isinstance(t, KvxferError):
                assert t.errno == errno.EACCES
                refused += 1
                continue
            try:
                t.wait(10)
                done += 1
                landed += t.num_writes
            except KvxferError as exc:
                assert exc.errno == errno.EACCES, exc
                refused += 1
        assert done >= 1 and refused >= 1, (done, refused)
        if imm is not None:          # every write reported done was counted by the target
            assert tgt.call("banked", imm) == landed
        new = eng.remote(tgt.call("register"))
        tgt.call("fill", 0)
        honest = eng.write(mr, 0, peer, new, 0, 4096, imm=9)
        honest.wait(10)
        tgt.expect(9, honest.num_writes)
        assert tgt.wait(9) == ("ok", honest.num_writes)
        assert np.array_equal(tgt.call("read", 0, 4096), src[:4096].tobytes())
        mr.close()


def test_a_close_waits_for_no_dead_writer(provider):
    """A peer that said HELLO and was killed does not hold a region's close for long (its
    REVOKE fails, or goes unanswered for at most revoke.REVOKE_WAIT)."""
    n = 1 << 16
    with kvxfer.Engine(provider, "127.0.0.1") as eng:
        mr = eng.register(np.zeros(n, np.uint8))
        writer = Target(provider, n)
        try:
            writer.call("connect", eng.address)
            writer.kill()
            t0 = time.monotonic()
            mr.close()
            assert time.monotonic() - t0 < 5.0
        finally:
            writer.close()


def test_a_writer_that_closed_is_never_connected_back(provider):
    """Engines of this process that said HELLO and then closed (BYE) are not connected back
    when the target first closes a region (shm 1.17 crashed inside ``fi_av_insert`` of such
    a name, see the next test), and the target keeps no peer for them."""
    with kvxfer.Engine(provider, "127.0.0.1") as tgt:
        mr = tgt.register(np.zeros(1 << 16, np.uint8))
        for _ in range(3):
            with kvxfer.Engine(provider, "127.0.0.1") as w:
                w.connect(tgt.address)              # HELLO
            # closed: BYE
        tgt.register(np.zeros(4096, np.uint8)).close()     # reads the HELLOs and BYEs
        assert tgt._peers == {}
        live = kvxfer.Engine(provider, "127.0.0.1")
        try:
            live.connect(tgt.address)
            tgt.register(np.zeros(4096, np.uint8)).close()  # a live writer is connected back
            assert list(tgt._peers) == [live.address]
            live.close()
            mr.close()                                      # ... and removed after its BYE
            assert tgt._peers == {}
        finally:
            live.close()


def test_connecting_to_a_closed_engine_of_this_process_raises(provider):
    """shm 1.17 crashed (SIGSEGV inside ``fi_av_insert``) inserting the name of an engine of
    its own process that had closed: refused now with ``PeerError`` (ECONNREFUSED) before the
    provider sees it. tcp inserts the address, and a write to it fails as to a gone peer."""
    a = kvxfer.Engine(provider, "127.0.0.1", peer_timeout=1)
    b = kvxfer.Engine(provider, "127.0.0.1", peer_timeout=1)
    try:
        src = b.register(np.ones(1 << 16, np.uint8))
        dst = a.register(np.zeros(1 << 16, np.uint8))
        address, descriptor = a.address, dst.descriptor()
        a.close()
        if provider == "shm":
            with pytest.raises(PeerError) as ei:
                b.connect(address)
            assert ei.value.errno == errno.ECONNREFUSED
            assert b._peers == {}
        else:
            peer = b.connect(address)
            with pytest.raises(PeerError):
                b.write(src, 0, peer, b.remote(descriptor), 0, 4096, imm=3).wait(30)
        other = kvxfer.Engine(provider, "127.0.0.1")      # b stays usable
        try:
            b.connect(other.address)
        finally:
            other.close()
    finally:
        a.close()
        b.close()


def test_a_peer_the_caller_disconnected_is_not_connected_back(provider):
    """A HELLO read after the caller disconnected that peer, sent before, is void: the next
    region close neither connects back to it nor announces anything to it. (The messenger
    disconnects both ways at close; connecting back, each of its region closes waited
    REVOKE_WAIT for an ACK the peer, which had disconnected us too, could not send.)"""
    with kvxfer.Engine(provider, "127.0.0.1") as a, kvxfer.Engine(provider, "127.0.0.1") as b:
        pb = b.connect(a.address)
        a.connect(b.address)                      # a's HELLO, not yet read by b
        b.disconnect(pb)
        b.register(np.zeros(4096, np.uint8)).close()
        assert a.address not in b._peers
        again = b.connect(a.address)              # a caller's connect: announced to again
        assert again is not pb
        b.register(np.zeros(4096, np.uint8)).close()
        a.connect(b.address)
        b.register(np.zeros(4096, np.uint8)).close()
        assert list(b._peers) == [a.address]
