"""Immediate counters: many imm values at once, early arrivals, re-arming, callbacks."""

import threading

import numpy as np
import pytest

import kvxfer
from _target import Target


@pytest.fixture
def linked(pair):
    """``pair`` (tests/fabric/conftest.py) with a source region in a, a destination in b, a's peer b."""
    a, b = pair
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros(len(src), np.uint8)
    ms, md = a.register(src), b.register(dst)
    yield a, b, ms, a.connect(b.address), a.remote(md.descriptor()), src, dst  # the frame keeps md registered


def test_early_arrivals_are_banked(linked):
    a, b, ms, peer, rr, src, dst = linked
    ts = [a.write(ms, i * 64, peer, rr, i * 64, 64, imm=5) for i in range(10)]
    for t in ts:
        t.wait(10)
    # every write has been completed at the sender; let the target's progress bank them
    for _ in range(500):
        if b.banked(5) == 10:
            break
        threading.Event().wait(0.01)
    assert b.banked(5) == 10
    c = b.expect(5, 4)
    assert c.done and c.arrived == 4
    assert b.banked(5) == 6
    c2 = b.expect(5, 6)
    c2.wait(5)
    assert b.banked(5) == 0
    c3 = b.expect(5, 1)          # a finished imm can be expected again
    assert not c3.done
    a.write(ms, 0, peer, rr, 0, 64, imm=5).wait(10)
    c3.wait(10)
    assert c3.arrived == 1


def test_many_concurrent_imms(linked):
    a, b, ms, peer, rr, src, dst = linked
    rng = np.random.default_rng(0)
    imms = rng.choice(2**32, 300, replace=False)
    counts = rng.integers(1, 5, len(imms))
    early = set(imms[:100].tolist())
    counters = {}
    for imm, n in zip(imms, counts):
        if int(imm) not in early:
            counters[int(imm)] = b.expect(int(imm), int(n))
    ts = []
    for imm, n in zip(imms, counts):
        for j in range(n):
            ts.append(a.write(ms, 64 * j, peer, rr, 64 * j, 64, imm=int(imm)))
    for imm, n in zip(imms[:100], counts[:100]):
        counters[int(imm)] = b.expect(int(imm), int(n))
    for t in ts:
        t.wait(20)
    for imm, c in counters.items():
        c.wait(20)
        assert c.arrived == c.count
    for imm in imms:
        assert b.banked(int(imm)) == 0


def test_double_expectation_rejected(pair):
    a, b, *_ = pair
    keep = b.expect(9, 3)  # noqa: F841 - a dropped expectation is withdrawn
    with pytest.raises(kvxfer.errors.InvalidArgumentError):
        b.expect(9, 1)
    for bad in (-1, 2**32, 1.5, None, True):
        with pytest.raises(kvxfer.errors.InvalidArgumentError):
            b.expect(bad, 1)
    with pytest.raises(kvxfer.errors.InvalidArgumentError):
        b.expect(10, 0)


def test_dropped_expectation_banks_its_arrivals(linked):
    a, b, ms, peer, rr, src, dst = linked
    c = b.expect(21, 5)
    for _ in range(2):
        a.write(ms, 0, peer, rr, 0, 64, imm=21).wait(10)
    for _ in range(500):
        if c.arrived == 2:
            break
        threading.Event().wait(0.01)
    assert c.arrived == 2
    del c
    assert b.banked(21) == 2
    c = b.expect(21, 2)
    assert c.done


def test_callback_runs_once_on_dispatcher(linked):
    a, b, ms, peer, rr, src, dst = linked
    seen = []
    done = threading.Event()

    def cb(counter):
        seen.append((counter.imm, counter.arrived, threading.current_thread().name))
        done.set()

    b.expect(33, 3, callback=cb)   # not kept by the caller: the engine keeps it
    for _ in range(3):
        a.write(ms, 0, peer, rr, 0, 64, imm=33)
    assert done.wait(10)
    assert seen == [(33, 3, "kvxfer-dispatch")]


def test_timeout_and_wait_on_counter(pair):
    a, b, *_ = pair
    c = b.expect(44, 1)
    with pytest.raises(kvxfer.errors.TimeoutError) as ei:
        c.wait(0.2)
    assert isinstance(ei.value, TimeoutError)


def test_counter_across_processes_with_many_writers(provider):
    with Target(provider, 1 << 20) as tgt, kvxfer.Engine(provider, "127.0.0.1") as eng:
        src = np.ones(1 << 20, np.uint8)
        mr = eng.register(src)
        peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
        ts = [eng.write_pages(mr, [i], peer, dst, [i], 4096, imm=7) for i in range(64)]
        for t in ts:
            t.wait(20)
        tgt.expect(7, 64)           # every arrival happened (or happens) before: banked
        assert tgt.wait(7) == ("ok", 64)


def test_done_ns_is_the_last_arrivals_stamp(linked):
    """``Counter.done_ns``: 0 while pending; once done, a CLOCK_MONOTONIC stamp (time.monotonic_ns's
    clock) after the last write was posted and no later than the waiter's return; for arrivals
    banked before the expectation, the moment it was made; 0 for a discarded expectation."""
    import time

    a, b, ms, peer, rr, src, dst = linked
    c = b.expect(7, 3)
    assert not c.done and c.done_ns == 0
    for i in range(2):
        a.write(ms, i * 64, peer, rr, i * 64, 64, imm=7).wait(10)
    assert c.done_ns == 0                          # two of three: still pending
    t0 = time.monotonic_ns()
    a.write(ms, 128, peer, rr, 128, 64, imm=7).wait(10)
    c.wait(10)
    t1 = time.monotonic_ns()
    assert c.state == "done" and t0 <= c.done_ns <= t1

    a.write(ms, 0, peer, rr, 0, 64, imm=8).wait(10)
    for _ in range(500):                           # banked before anyone expects imm 8
        if b.banked(8) == 1:
            break
        threading.Event().wait(0.01)
    t2 = time.monotonic_ns()
    early = b.expect(8, 1)
    assert early.done and t2 <= early.done_ns <= time.monotonic_ns()

    gone = b.expect(9, 2)
    b.discard(9)
    assert gone.state == "discarded" and gone.done_ns == 0
