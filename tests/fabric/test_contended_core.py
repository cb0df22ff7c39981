"""A progress thread whose core a busy thread holds sleeps between its polls instead of yielding
(src/progress.c, kx_progress_pause): a yield beside a busy loop lasts the loop's slice, about a
millisecond, during which nothing is read. The sleeps are counted (``stats()["naps"]``) and
change nothing a transfer guarantees: every byte lands and every count is exact."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvxfer


@pytest.fixture
def busy_core():
    """CPU 0 held by a busy loop of another process for the test's length."""
    if 0 not in os.sched_getaffinity(0):
        pytest.skip("CPU 0 is not ours to pin to")
    hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile 1: pass"])
    try:
        yield 0
    finally:
        hog.kill()
        hog.wait()


def test_progress_threads_on_a_busy_core_sleep_and_every_page_lands(provider, busy_core):
    a = kvxfer.Engine(provider, "127.0.0.1", cpus=[busy_core])
    b = kvxfer.Engine(provider, "127.0.0.1", cpus=[busy_core])
    try:
        page, n = 16384, 512                           # 8 MiB a round, past the caller's own budget
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, page * n, dtype=np.uint8)
        dst = np.zeros_like(src)
        ms, md = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        rr = a.remote(md.descriptor())
        rounds = 0
        # two yields in a row that last a slice mark the core contended; a round lasts tens of
        # milliseconds beside the busy loop, so a few rounds bring many pauses
        while rounds < 40 and (rounds < 4 or a.stats()["naps"] + b.stats()["naps"] == 0):
            perm = rng.permutation(n)
            dst[:] = 0
            want = a.count_writes(np.arange(n, dtype=np.uint64) * page, perm.astype(np.uint64) * page,
                                  np.full(n, page, np.uint64), region=rr)
            c = b.expect(100 + rounds, want)
            t = a.write_pages(ms, np.arange(n), peer, rr, perm, page, imm=100 + rounds)
            t.wait(60)
            c.wait(60)
            assert t.error is None and c.done
            assert np.array_equal(dst.reshape(n, page)[perm], src.reshape(n, page))
            rounds += 1
        assert a.stats()["naps"] + b.stats()["naps"] > 0, f"no nap in {rounds} rounds beside a busy loop"
        # a second transfer's control message still arrives in order after the naps
        a.send(peer, b"after")
        assert b.recv(10) == b"after"
    finally:
        a.close()
        b.close()


def test_an_idle_engine_counts_no_nap(provider):
    a = kvxfer.Engine(provider, "127.0.0.1")
    try:
        assert a.stats()["naps"] == 0
    finally:
        a.close()
