"""A peer killed with operations of ours unanswered fails only its own transfers: those to a live
peer of the same engine, posted behind them, complete byte-exact (docs/reliability.md,
finding 24).

On shm (libfabric 1.17) every write with imm above 4 KiB and every read takes a slot of the
sender's one response queue, which its progress reads in order; a killed target never answers
its slots, which used to hide every later completion of the engine until ``peer_timeout``
failed them all (and every one after). kvxfer answers the dead process's slots for it
(src/unblock.c). On tcp the provider fails the dead peer's operations by itself: the same
tests hold there as the rule both providers keep.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import KvxferError, PeerError

from _data import pattern_array
from _drain import close_drained
from _target import Target

PAGE = 64 << 10
PAGES = 256                 # 4 x 16 MiB to the victim: it cannot have answered all of it when killed
DEADLINE = 60.0


def _kill_during(provider: str, post_to_victim, check, reads: bool = False):
    """Warm both targets, post to the victim, kill it at once, then run `check` against the
    live target; returns the engine's stats at the end. `post_to_victim` returns its transfers
    and the regions it registered."""
    n = PAGES * PAGE
    src = pattern_array(n, 41, low=1)
    opts = {"peer_timeout": 10}
    with Target(provider, n, options=opts, readable=True) as victim, \
            Target(provider, n, options=opts, readable=True) as live, \
            kvxfer.Engine(provider, "127.0.0.1", **opts) as eng:
        mr = eng.register(src)
        peers = [eng.connect(t.address) for t in (victim, live)]
        remotes = [eng.remote(t.descriptor) for t in (victim, live)]
        pages = np.arange(PAGES)
        warm = eng.register(np.zeros(n, np.uint8), remote=False) if reads else None
        for p, r in zip(peers, remotes):           # both answered once before (as in the finding)
            eng.write_pages(mr, pages, p, r, pages, PAGE).wait(DEADLINE)
            if warm is not None:
                eng.read_pages(warm, pages, p, r, pages, PAGE).wait(DEADLINE)
        if warm is not None:
            warm.close()
        doomed, extra = post_to_victim(eng, mr, peers[0], remotes[0], pages)
        victim.kill()
        check(eng, mr, peers[1], remotes[1], pages, live, src)
        for t in doomed:
            try:
                t.wait(DEADLINE)
            except KvxferError as exc:
                assert isinstance(exc, PeerError), exc
            assert t.done
        for m in [mr, *extra]:
            close_drained(m)                       # nothing of either target's is left in flight
        return eng.stats()


def _writes_to_the_live_target_land(eng, mr, peer, remote, pages, live, src):
    live.call("fill", 0)
    t = eng.write_pages(mr, pages[::-1], peer, remote, pages, PAGE, imm=7)
    t.wait(DEADLINE)                               # a PeerError (ETIMEDOUT) here was finding 24
    assert t.error is None
    mem = live.memory().reshape(PAGES, PAGE)
    assert np.array_equal(mem, src.reshape(PAGES, PAGE)[::-1])


@pytest.mark.parametrize("imm", [None, 5])
def test_a_target_killed_mid_write_fails_only_its_writes(provider, imm):
    stats = _kill_during(
        provider, lambda eng, mr, p, r, pages: ([eng.write_pages(mr, pages, p, r, pages, PAGE, imm=imm) for _ in range(4)], []),
        _writes_to_the_live_target_land)
    assert stats["outstanding"] == 0, stats


def test_a_target_killed_mid_read_fails_only_its_reads(provider):
    """Reads too: the live target's pages read back byte-exact after the victim's death."""
    def reads_from_the_live_target(eng, mr, peer, remote, pages, live, src):
        got = np.zeros(PAGES * PAGE, np.uint8)
        with eng.register(got, remote=False) as mine:
            live.call("fill", 0x3C)
            eng.read_pages(mine, pages, peer, remote, pages[::-1], PAGE).wait(DEADLINE)
            assert (got == 0x3C).all()

    def reads_from_the_victim(eng, mr, p, r, pages):
        sink = eng.register(np.zeros(PAGES * PAGE, np.uint8), remote=False)
        return [eng.read_pages(sink, pages, p, r, pages, PAGE) for _ in range(4)], [sink]

    stats = _kill_during(provider, reads_from_the_victim, reads_from_the_live_target, reads=True)
    assert stats["outstanding"] == 0, stats
