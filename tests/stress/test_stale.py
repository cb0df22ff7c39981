"""Stale arrivals (issue 12): writes of a cancelled transfer, or of an expectation given up
on, must never complete a later expectation of the same imm. The fence: the sender's final
Transfer.posted P; the target discards, expects what is still to come, discards again."""

import numpy as np
import pytest

import kvxfer
from kvxfer import errors


@pytest.fixture
def pair(provider):
    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    yield a, b
    a.close()
    b.close()


def _fence(b, imm, posted):
    dropped = b.discard(imm)
    if dropped < posted:
        b.expect(imm, posted - dropped).wait(20)
        b.discard(imm)


def _setup(a, b, n):
    src = np.full(n * 4096, 1, np.uint8)
    dst = np.zeros(n * 4096, np.uint8)
    ms, md = a.register(src), b.register(dst)
    return src, dst, ms, md, a.connect(b.address), a.remote(md.descriptor())


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
def test_stale_arrivals_never_credit_a_later_expectation(pair, how):
    a, b = pair
    n = 4096
    src, dst, ms, md, peer, rr = _setup(a, b, n)
    pages = np.arange(n)
    t = a.write_pages(ms, pages, peer, rr, pages[::-1].copy(), 4096, imm=9)
    if how == "cancelled":
        t.cancel()
    else:
        c = b.expect(9, t.num_writes + 1)     # never completes: one more than will come
        with pytest.raises(errors.TimeoutError):
            c.wait(0.05)
        del c                                 # given up on: its arrivals are banked again
    t.wait(30) if how == "timed_out" else _wait_ended(t)
    _fence(b, 9, t.posted)
    assert b.banked(9) == 0
    # the next transfer with the same imm: its counter completes only with its own write
    src[:] = 2
    t2 = a.write(ms, 0, peer, rr, 0, 4096, imm=9)
    c2 = b.expect(9, t2.num_writes)
    c2.wait(20)
    assert (dst[:4096] == 2).all()            # its data landed: nothing stale credited it
    t2.wait(20)
    assert b.banked(9) == 0


def _wait_ended(t):
    try:
        t.wait(30)
    except errors.PeerError:      # cancelled: ends with PeerError (ECANCELED) if any was queued
        pass
