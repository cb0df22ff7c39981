"""The native layer watcher (``Engine.watcher``): armed writes post when the counter reaches
their threshold, in threshold order, with exact message counts; disarm and cancel say
exactly what was posted; bad input posts nothing; close with entries armed."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import ClosedError, InvalidArgumentError, OutOfBoundsError


def _setup(a, b, n=1 << 16):
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    a.send(peer, b"hello")                 # shm maps a peer on its first message
    assert b.recv(10) == b"hello"
    return src, dst, ms, peer, a.remote(md.descriptor()), md


def _layer(i, pages=4, page=1024):
    """Layer i's triples: ``pages`` pages of ``page`` bytes, every other one (no coalescing)."""
    off = np.arange(pages, dtype=np.uint64) * 2 * page + i * 2 * pages * page
    return off, off, np.full(pages, page, np.uint64)


def _arm_layers(w, ms, peer, rd, n, **kw):
    """Layers 0..n-1 (``_layer``) armed in one ``arm_groups`` at thresholds 1..n: (batch, parts)."""
    parts = [_layer(l) for l in range(n)]
    starts = np.cumsum([0] + [len(p[0]) for p in parts])
    return w.arm_groups(list(range(1, n + 1)), ms, peer, rd, *(np.concatenate([p[i] for p in parts]) for i in range(3)),
                        starts, **kw), parts


def test_fires_in_order_with_exact_counts(pair):
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    entries = [w.arm(l + 1, ms, peer, rd, *_layer(l), imm=77) for l in range(4)]
    assert all(e.state == "armed" and not e.done for e in entries)
    counts = [e.num_writes for e in entries]
    assert counts == [kvxfer.wire.count_writes(*_layer(l), a.iov, a.max_write, a.pack_min) for l in range(4)]
    c = b.expect(77, sum(counts[:2]))
    assert w.bump() == 1
    entries[0].wait(10)
    assert w.bump() == 2
    c.wait(10)
    for e in entries[:2]:
        e.wait(10)
        assert e.state == "posted" and e.posted == e.num_writes and e.fired_ns > 0
    assert [e.state for e in entries[2:]] == ["armed", "armed"]
    assert b.banked(77) == 0                 # nothing of layers 2, 3 arrived
    for l in range(4):
        for o, _, n in zip(*_layer(l)):
            o, n = int(o), int(n)
            assert np.array_equal(dst[o:o + n], src[o:o + n]) == (l < 2), l
    end = 2 * 2 * 4 * 1024
    assert not dst[end:].any()
    assert w.value == 2
    call, post = w.latencies()
    assert len(call) == 2 and all(0 < x <= y for x, y in zip(call, post))   # one sample per bump that fired
    w.close()
    assert [e.state for e in entries[2:]] == ["armed", "armed"]   # never posted after close


def test_a_region_with_an_armed_entry_cannot_be_closed(pair):
    """The watcher posts from the entry's source registration later: closing the region is
    refused (as for a transfer in flight) until the entry is disarmed or its writes completed;
    before the fix the close went through and the watcher later sent whatever the freed
    memory then held."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    e0 = w.arm(1, ms, peer, rd, *_layer(0), imm=11)
    e1, e2 = w.arm_groups([2, 3], ms, peer, rd, *[np.concatenate(x) for x in zip(_layer(1), _layer(2))],
                          [0, 4, 8], imm=12)
    with pytest.raises(InvalidArgumentError, match="watch entries armed"):
        ms.close()
    assert not ms.closed
    w.bump()
    e0.wait(10)
    b.expect(11, e0.num_writes).wait(10)
    assert e0.done
    with pytest.raises(InvalidArgumentError, match="watch entries armed"):
        ms.close()                         # e1, e2 still armed
    assert e1.disarm() and e2.disarm()
    ms.close()                             # posted and complete, or disarmed: free to go
    assert ms.closed
    w.bump(5)
    time.sleep(0.05)
    assert b.banked(12) == 0 and not dst[2 * 4 * 1024:].any()
    w.close()


def test_an_error_unwinding_a_busy_region_is_not_replaced(pair):
    """``with eng.register(buf) as mr:`` left by an exception (kvxfer-bench's initiator on
    Ctrl-C) while mr cannot close yet: the exception goes on, not the close's refusal (which
    turned an interrupted benchmark into a failed one); the engine deregisters it at close."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    with pytest.raises(KeyboardInterrupt):
        with a.register(np.zeros(1 << 16, np.uint8)) as mr:
            e = w.arm(1, mr, peer, rd, *_layer(0), imm=14)
            raise KeyboardInterrupt
    assert not mr.closed and e.state == "armed"
    with pytest.raises(InvalidArgumentError):        # without an error unwinding: refused, as before
        with a.register(np.zeros(1 << 16, np.uint8)) as mr2:
            e2 = w.arm(1, mr2, peer, rd, *_layer(1), imm=15)
    e.disarm()
    e2.disarm()
    w.close()


def test_a_dropped_armed_entry_no_longer_holds_its_region(pair):
    """Entries are remembered weakly: dropping an armed one disarms it (as before), and the
    region can then be closed."""
    import gc

    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    e = w.arm(1, ms, peer, rd, *_layer(0), imm=13)
    with pytest.raises(InvalidArgumentError):
        ms.close()
    del e
    gc.collect()
    ms.close()
    w.bump()
    time.sleep(0.05)
    assert b.banked(13) == 0 and not dst.any()
    w.close()


def test_a_dropped_batch_disarms_its_entries_before_its_region_may_close(pair):
    """A batch is remembered by its region weakly, as one: dropping it disarms every entry
    still armed (with the GIL held, before the region could see it gone), so none posts from
    a region closed after; a bare handle taken from it is disarmed too."""
    import gc

    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher(poll_us=0)
    bt, _ = _arm_layers(w, ms, peer, rd, 3, imm=16)
    bare = bt._h.entries[2]                    # a native handle, without its batch
    with pytest.raises(InvalidArgumentError):
        ms.close()
    del bt
    gc.collect()
    assert bare.state == "disarmed"
    ms.close()
    w.bump(5)
    time.sleep(0.05)
    assert b.banked(16) == 0 and not dst.any()
    w.close()


def test_disarm_and_cancel_tell_what_was_posted(pair):
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    e0 = w.arm(1, ms, peer, rd, *_layer(0), imm=5, tag=9)
    e1 = w.arm(2, ms, peer, rd, *_layer(1), imm=5, tag=9)
    e2 = w.arm(3, ms, peer, rd, *_layer(2), imm=5, tag=8)
    w.bump()
    e0.wait(10)
    assert e0.disarm() is False and e0.state == "posted"
    assert e1.disarm() is True and e1.state == "disarmed" and e1.done and e1.posted == 0
    e1.cancel()                              # idempotent
    assert w.disarm_tag(9) == 0 and w.disarm_tag(8) == 1 and e2.state == "disarmed"
    w.bump(5)
    b.expect(5, e0.num_writes).wait(10)
    time.sleep(0.05)
    assert b.banked(5) == 0 and not dst[2 * 4 * 1024:].any()


def test_threshold_already_reached_posts_at_once_and_equal_thresholds_keep_order(pair):
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    w.bump(10)
    es = [w.arm(5, ms, peer, rd, *_layer(i), imm=6) for i in range(3)]
    for e in es:
        e.wait(10)
    assert [e.state for e in es] == ["posted"] * 3
    assert es[0].fired_ns <= es[1].fired_ns <= es[2].fired_ns
    b.expect(6, sum(e.num_writes for e in es)).wait(10)


def test_bad_input_arms_nothing(pair):
    a, b = pair
    src, dst, ms, peer, rd, md = _setup(a, b)
    w = a.watcher()
    with pytest.raises(OutOfBoundsError):
        w.arm(1, ms, peer, rd, [0], [len(dst) - 10], [64])
    with pytest.raises(InvalidArgumentError):
        w.arm(1, ms, peer, rd, [0, 1], [0], [1])
    with pytest.raises(InvalidArgumentError):
        w.arm(-1, ms, peer, rd, [0], [0], [1])
    with pytest.raises(InvalidArgumentError):
        w.arm(1, ms, peer, rd, [0], [0], [1], rail=3)
    word = np.zeros(1, np.uint64)
    for poll in (-1, 1e-4, float("nan"), 2e9):    # 1e-4 µs would be 0 ns: no polling unasked
        with pytest.raises(InvalidArgumentError):
            a.watcher(poll_us=poll)
    with pytest.raises(InvalidArgumentError, match="poll_us=0"):
        a.watcher(word=word.ctypes.data, keep=word, poll_us=0)   # written elsewhere: must be polled
    # what would reach native code unchecked: every one a kvxfer error, nothing armed
    bad = [lambda: w.arm(1, ms, peer, rd, [0], [0], [1], rail=0.0),
           lambda: w.arm(1, ms, peer, rd, [0], [0], [1], tag="x"),
           lambda: w.arm(1, ms, peer, rd, [0], [0], [1], tag=2**64),
           lambda: w.arm(2**64, ms, peer, rd, [0], [0], [1]),
           lambda: w.arm_groups([1, 2], ms, peer, rd, [0, 8], [0, 8], [8, 8], ["a", "b", "c"]),
           lambda: w.arm_groups([1, 2], ms, peer, rd, [0, 8], [0, 8], [8, 8], [0, 2**70, 2]),
           lambda: w.arm_groups([1, 2], ms, peer, rd, [0, 8], [0, 8], [8, 8], [0, 1, 2], tag=-1),
           lambda: w.disarm_tag("x"),
           lambda: w.close("x"),
           lambda: a.watcher(word=8),            # not mapped: the thread would read it and crash
           lambda: a.watcher(word=-1),
           lambda: a.watcher(word=ms.ptr + 4),   # not aligned
           lambda: a.watcher(word=1.5)]
    for call in bad:
        with pytest.raises(kvxfer.errors.KvxferError):
            call()
    e = w.arm(1 << 40, ms, peer, rd, [0], [0], [1])
    for t in ("1", float("nan"), -1):
        with pytest.raises(kvxfer.errors.KvxferError):
            e.wait(t)
    assert e.disarm()
    assert w.stats()["armed"] == 0
    word = np.zeros(1, np.uint64)                # a counter of the caller's own: accepted
    w2 = a.watcher(word=word.ctypes.data, keep=word)
    assert w2.bump(3) == 3 and word[0] == 3
    w2.close()
    w.close()
    with pytest.raises(ClosedError):
        w.arm(1, ms, peer, rd, [0], [0], [1])


def test_blocks_when_idle_and_bump_from_another_thread(pair):
    """Nothing armed: the thread sleeps (a handful of wake-ups in 200 ms); a bump from
    another thread fires what is armed."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    time.sleep(0.2)
    assert w.stats()["wakeups"] < 5
    e = w.arm(1, ms, peer, rd, *_layer(0), imm=3)
    t = threading.Thread(target=w.bump)
    t.start()
    t.join(5)
    e.wait(10)
    b.expect(3, e.num_writes).wait(10)


def test_a_watcher_that_does_not_poll_sleeps_while_armed_and_wakes_on_bump(pair):
    """``poll_us=0``: armed or not, the thread sleeps (a handful of wake-ups in 200 ms, where
    a 10 µs poll makes thousands) until a bump, an advance or an arming due at once wakes it;
    callers waiting on entries meanwhile sleep on another condition variable than the thread,
    so a bump's signal cannot wake one of them instead (with one shared, glibc's condition
    variable happened to wake the thread first in three runs: this shows the behaviour, it
    does not catch that mistake)."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher(poll_us=0)
    e1 = w.arm(1, ms, peer, rd, *_layer(0), imm=5)
    e2 = w.arm(2, ms, peer, rd, *_layer(1), imm=5)
    time.sleep(0.2)
    assert w.stats()["wakeups"] < 5 and e1.state == "armed"
    waiters = [threading.Thread(target=e.wait, args=(10,)) for e in (e1, e2) for _ in range(2)]
    for t in waiters:
        t.start()
    time.sleep(0.05)                           # the waiters sleep on the entries' condition
    t = threading.Thread(target=w.bump)
    t.start()
    t.join(5)
    e1.wait(10)
    assert e1.state == "posted" and e2.state == "armed"
    assert w.advance(2) == 2
    e2.wait(10)
    e3 = w.arm(2, ms, peer, rd, *_layer(2), imm=5)     # due when armed: the arming wakes it
    e3.wait(10)
    for t in waiters:
        t.join(10)
        assert not t.is_alive()
    b.expect(5, e1.num_writes + e2.num_writes + e3.num_writes).wait(10)
    for l in range(3):
        for o, _, n in zip(*_layer(l)):
            assert np.array_equal(dst[int(o):int(o) + int(n)], src[int(o):int(o) + int(n)])
    w.close()


def test_engine_close_stops_armed_watchers(provider):
    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    try:
        src, dst, ms, peer, rd, _ = _setup(a, b)
        w = a.watcher()
        e = w.arm(1, ms, peer, rd, *_layer(0), imm=4)
    finally:
        a.close()
        b.close()
    assert w.closed and e.state == "armed"
    with pytest.raises(ClosedError):
        e.wait()                              # never hangs on an entry that cannot fire
    del e, w                                  # freeing after the engine closed is safe


def test_hold_awake_nests(engine):
    engine.hold_awake()
    engine.hold_awake()
    engine.hold_awake(False)
    engine.hold_awake(False)


def test_arm_groups_matches_arm(pair):
    """Many layers of one region pair armed in one call: the same entries as one by one."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher()
    parts = [_layer(l) for l in range(4)]
    starts = np.cumsum([0] + [len(p[0]) for p in parts])
    es = w.arm_groups([1, 2, 3, 4], ms, peer, rd, *(np.concatenate([p[i] for p in parts]) for i in range(3)),
                      starts, imm=11, tag=2)
    assert [e.threshold for e in es] == [1, 2, 3, 4]
    assert [e.num_writes for e in es] == [kvxfer.wire.count_writes(*p, a.iov, a.max_write, a.pack_min) for p in parts]
    assert [e.nbytes for e in es] == [4 * 1024] * 4
    w.bump(2)
    b.expect(11, es[0].num_writes + es[1].num_writes).wait(10)
    assert w.disarm_tag(2) == 2
    with pytest.raises(InvalidArgumentError):
        w.arm_groups([1], ms, peer, rd, [0], [0], [1], [0, 2])
    with pytest.raises(OutOfBoundsError):
        w.arm_groups([1], ms, peer, rd, [0], [len(dst)], [1], [0, 1])


def test_batches_of_the_same_thresholds_keep_arming_order_through_disarms(pair):
    """Batches arming the same thresholds (a request's region pairs: one layer's threshold
    per batch) post in arming order within each threshold, whatever was disarmed between
    them and where thresholds share the native run cache's slot (1 and 257)."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher(poll_us=0)
    th = [1, 2, 3, 257]
    slot = iter(range(64))

    def batch():
        o = np.array([next(slot) * 512 for _ in th], np.uint64)
        return w.arm_groups(th, ms, peer, rd, o, o, np.full(len(th), 64, np.uint64), np.arange(len(th) + 1), imm=9)

    A, B = batch(), batch()
    assert B[1].disarm()                                   # B's 2: the end of threshold 2's run
    C = batch()
    assert A[3].disarm()                                   # A's 257, under B's and C's
    E = w.arm(257, ms, peer, rd, [60 * 512], [60 * 512], [64], imm=9)
    D = batch()
    assert isinstance(A, kvxfer.engine.WatchBatch) and len(A) == 4 and A.entries_in("disarmed") == 1
    assert A.entries_in("armed", 0, 3) == 3 and D.entries_in("armed", 1, 257) == 3
    want = ([A[0], B[0], C[0], D[0]], [A[1], C[1], D[1]], [A[2], B[2], C[2], D[2]], [B[3], C[3], E, D[3]])
    w.bump(257)
    for bt in (A, B, C, D, E):
        bt.wait(10)
    fired = [e.fired_ns for run in want for e in run]
    assert all(e.state == "posted" for run in want for e in run)
    assert fired == sorted(fired)                          # one batch of posts, in list order
    assert A.num_writes == sum(e.num_writes for e in A) and A.posted == 3 and A.done and A.error is None
    b.expect(9, sum(len(run) for run in want)).wait(10)


def test_a_watch_batch_answers_for_all_its_entries(pair):
    """WatchBatch: a Sequence of its entries, and one Transfer-like object over them."""
    a, b = pair
    src, dst, ms, peer, rd, _ = _setup(a, b)
    w = a.watcher(poll_us=0)
    bt, parts = _arm_layers(w, ms, peer, rd, 3, imm=12, tag=5)
    assert len(bt) == 3 and [e.threshold for e in bt] == [1, 2, 3] and bt[-1] is list(bt)[2]
    assert bt.count(bt[0]) == 1 and bt.index(bt[2]) == 2          # a Sequence's own methods
    assert bt.nbytes == 3 * 4 * 1024 == sum(e.nbytes for e in bt)
    assert bt.num_writes == sum(kvxfer.wire.count_writes(*p, a.iov, a.max_write, a.pack_min) for p in parts)
    assert not bt.done and bt.posted == 0 and bt.entries_in("armed") == 3 and bt.entries_in("armed", 1) == 2
    with pytest.raises(InvalidArgumentError):
        bt.entries_in("sleeping")
    with pytest.raises(kvxfer.errors.TimeoutError):
        bt.wait(0.05)
    w.bump(1)
    bt[0].wait(10)
    bt.cancel()                                            # 2 and 3 disarm; 1 was posted
    assert [e.state for e in bt] == ["posted", "disarmed", "disarmed"] and bt.done
    assert bt.posted == bt[0].num_writes and bt.entries_in("disarmed", 1, 3) == 2
    b.expect(12, bt[0].num_writes).wait(10)
    # the region tracks the batch: an entry taken from it keeps it (and the refusal) alive
    e = w.arm_groups([9, 10], ms, peer, rd, [0, 8], [0, 8], [8, 8], [0, 1, 2])[1]
    import gc
    gc.collect()
    with pytest.raises(InvalidArgumentError, match="watch entries armed"):
        ms.close()
    assert e.disarm() and e._batch is not None
    with pytest.raises(InvalidArgumentError, match="watch entries armed"):
        ms.close()                                         # its batch's entry at 9 is armed still
    del e
    gc.collect()                                           # the batch is gone: its entries disarmed
    ms.close()                                             # every batch final or gone
    assert ms.closed


def _slice_ns(tid):
    """The thread's EEVDF slice from /proc (se.slice), or None where the kernel shows none."""
    try:
        with open(f"/proc/self/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(float(line.split(":")[1]))
    except OSError:
        pass
    return None


def _custom_slices():
    """Linux >= 6.12: a normal thread's sched_setattr runtime sets its slice."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 12)


@pytest.mark.parametrize("env, want", [(None, 100_000), ("250", 250_000), ("0", None)])
def test_watcher_asks_for_a_short_slice(engine, monkeypatch, env, want):
    """The watcher thread asks for a 100 us slice (src/sched.c), KVXFER_SLICE_US another, 0 none."""
    if env is None:
        monkeypatch.delenv("KVXFER_SLICE_US", raising=False)
    else:
        monkeypatch.setenv("KVXFER_SLICE_US", env)
    w = engine.watcher()
    try:
        deadline = time.monotonic() + 5
        while w.stats()["tid"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        tid = w.stats()["tid"]
        got = _slice_ns(tid)
        while want is not None and got != want and time.monotonic() < deadline:
            time.sleep(0.001)               # the thread sets its slice first thing
            got = _slice_ns(tid)
        if want is None:
            time.sleep(0.05)                # time to have set one, were it going to
            got = _slice_ns(tid)
        if got is None or not _custom_slices():
            pytest.skip(f"kernel {os.uname().release} has no per-thread slice")
        main = _slice_ns(threading.get_native_id())
        if want is None:
            assert got == main               # the kernel's own, as this thread's
        else:
            assert got == want and main != want
    finally:
        w.close()
