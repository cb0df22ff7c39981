"""Waiters that drive progress (``KVXFER_DRIVE_US``, off by default; a small transfer's waiter on shm by default): the same guarantees as the
progress thread's reading — every byte lands, counts are exact, control messages stay in order,
queued writes get posted — with several threads driving the same rail at once."""

import threading

import numpy as np
import pytest

import kvxfer


@pytest.fixture
def driving(provider, monkeypatch):
    """Two engines whose waiters drive for up to 2 ms (read when the progress thread starts)."""
    monkeypatch.setenv("KVXFER_DRIVE_US", "2000")
    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_ping_pong_with_driving_waiters(driving):
    a, b = driving
    abuf, bbuf = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    ma, mb = a.register(abuf), b.register(bbuf)
    pa, pb = a.connect(b.address), b.connect(a.address)
    a.send(pa, b"hello")
    assert b.recv(10) == b"hello"
    ra, rb = a.remote(mb.descriptor()), b.remote(ma.descriptor())
    words_a, words_b = abuf[:8].view(np.uint64), bbuf[:8].view(np.uint64)
    for i in range(300):
        c = b.expect(1000 + i, 1)
        back = a.expect(5000 + i, 1)
        words_a[0] = i
        t = a.write(ma, 0, pa, ra, 0, 64, imm=1000 + i)
        c.wait(10)
        assert int(words_b[0]) == i
        b.write(mb, 0, pb, rb, 0, 64, imm=5000 + i).wait(10)
        back.wait(10)
        t.wait(10)
        assert int(words_a[0]) == i


def test_messages_stay_in_order_while_writes_complete(driving):
    a, b = driving
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(len(src), np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    rr = a.remote(md.descriptor())
    got = []

    def receive():
        for _ in range(200):
            got.append(b.recv(20))

    th = threading.Thread(target=receive)
    th.start()
    c = b.expect(7, 200)
    for i in range(200):
        a.send(peer, i.to_bytes(4, "little"))
        a.write(ms, i * 4096, peer, rr, i * 4096, 4096, imm=7)
    c.wait(20)            # this thread and the receiver drive b's rail at the same time
    th.join(30)
    assert not th.is_alive()
    assert [int.from_bytes(m, "little") for m in got] == list(range(200))
    assert np.array_equal(dst[: 200 * 4096], src[: 200 * 4096])


def test_queued_pages_are_posted_by_a_driving_waiter(driving):
    a, b = driving
    page, n = 4096, 2048                    # 8 MiB: far past the caller's own budget (KX_CALLER_BUDGET)
    src = np.random.default_rng(1).integers(0, 256, page * n, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    rr = a.remote(md.descriptor())
    perm = np.random.default_rng(2).permutation(n)
    c = b.expect(9, a.count_writes(np.arange(n, dtype=np.uint64) * page, perm.astype(np.uint64) * page,
                                   np.full(n, page, np.uint64), region=rr))
    waiters = []
    t = a.write_pages(ms, np.arange(n), peer, rr, perm, page, imm=9)
    for w in (t.wait, c.wait):             # two threads drive the two engines' rails at once
        th = threading.Thread(target=w, args=(30,))
        th.start()
        waiters.append(th)
    for th in waiters:
        th.join(40)
        assert not th.is_alive()
    assert t.done and c.done and t.error is None
    assert np.array_equal(dst.reshape(n, page)[perm], src.reshape(n, page))


# -- the default: a small transfer's waiter drives on shm, and nothing else does ------------

def _small_writes(a, b, n=200, nbytes=4096):
    """``n`` writes of ``nbytes`` from a to b, each waited for; a's stats after them."""
    src, dst = np.arange(nbytes, dtype=np.uint64).view(np.uint8)[:nbytes].copy(), np.zeros(nbytes, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    rr = a.remote(md.descriptor())
    c = b.expect(11, n)
    for i in range(n):
        a.write(ms, 0, peer, rr, 0, nbytes, imm=11).wait(10)
    c.wait(10)
    assert np.array_equal(dst, src)
    return a.stats()


@pytest.fixture
def pair(provider, monkeypatch, request):
    """Two engines opened with the environment the test sets first (read at the progress
    thread's start)."""
    made = []

    def open_pair(**env):
        for k in ("KVXFER_DRIVE_US", "KVXFER_DRIVE_TX_US"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        a, b = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
        made.extend((a, b))
        return a, b

    yield open_pair
    for e in made:
        e.close()


def test_a_small_transfers_waiter_drives_by_default_on_shm_only(pair, provider):
    s = _small_writes(*pair())
    if provider == "shm":
        # the write completes within microseconds of its post: its waiter reads the CQ
        # itself (no hand-off through the progress thread) and mostly gets it in its window
        assert s["drives"] > 0
        assert 0 < s["drives_got"] <= s["drives"] <= 200
    else:                          # tcp: its completion waits for the target's acknowledgement
        assert s["drives"] == 0 and s["drives_got"] == 0


def test_a_large_transfers_waiter_does_not_drive_by_default(pair):
    s = _small_writes(*pair(), n=20, nbytes=1 << 20)
    assert s["drives"] == 0


def test_the_transfers_window_is_set_apart_and_turned_off(pair, provider):
    assert _small_writes(*pair(KVXFER_DRIVE_TX_US="0"))["drives"] == 0
    # KVXFER_DRIVE_US=0 turns every window off, the transfers' default too
    assert _small_writes(*pair(KVXFER_DRIVE_US="0"))["drives"] == 0
    # KVXFER_DRIVE_TX_US wins for small transfers, on any provider
    assert _small_writes(*pair(KVXFER_DRIVE_US="0", KVXFER_DRIVE_TX_US="2000"))["drives"] > 0


def test_counters_and_messages_do_not_drive_by_default(pair):
    a, b = pair()
    abuf = np.zeros(4096, np.uint8)
    ma = a.register(abuf)
    pb = b.connect(a.address)
    ra = b.remote(ma.descriptor())
    bbuf = np.ones(4096, np.uint8)
    mb = b.register(bbuf)
    for i in range(100):
        c = a.expect(300 + i, 1)
        b.write(mb, 0, pb, ra, 0, 4096, imm=300 + i)
        c.wait(10)                  # a counter's wait: no drive
        b.send(pb, b"x")
        assert a.recv(10) == b"x"   # a message's wait: no drive
    assert a.stats()["drives"] == 0
    assert np.array_equal(abuf, bbuf)
