"""A review of the direct-write permit, the posting futex and the cached pidfd check
(docs/reliability.md, the review of 2026-12-01, finding 17). Real shm provider; whatever may
hang runs in a spawned child with a deadline."""

import errno
import gc
import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVBuffer
from kvxfer.errors import FabricError
from _data import pattern_array
from _procs import run_in_child


# -- a region's permit slot goes back without the engine's lock --------------------------------

def _register_while_closing():
    """register() finds the engine closed after it took a permit slot, and undoes the region
    (region._close() under the engine's lock), whose slot release took that lock again."""
    import kvxfer.engine as E

    eng = kvxfer.Engine("shm")
    kv = KVBuffer.allocate(1 << 16)
    take = E.Engine._permit_take

    def take_then_close(self, *args):
        slot = take(self, *args)
        th = threading.Thread(target=self.close)       # another thread's close(), in the window
        th.start()
        th.join(10)
        return slot

    E.Engine._permit_take = take_then_close
    try:
        eng.register(kv)
    except kvxfer.errors.ClosedError:
        pass
    finally:
        E.Engine._permit_take = take
    kv.close()
    return "ok"


def test_register_racing_close_does_not_deadlock(shm):
    assert run_in_child(_register_while_closing, timeout=20) == "ok"


def _collect_under_the_engine_lock():
    """A permitted region in a reference cycle is collected by a collection that starts while
    this thread holds the engine's lock (any allocation can start one: connect, register,
    disconnect all allocate under it); its slot's finalizer must not wait for that lock."""
    eng = kvxfer.Engine("shm")
    kv = KVBuffer.allocate(1 << 16)
    md = eng.register(kv)
    assert md.host_share.permit is not None
    md._cycle = md                       # garbage only the cycle collector finds
    del md
    gc.disable()
    try:
        with eng._lock:
            gc.collect()
    finally:
        gc.enable()
    st = eng.stats()
    again = eng.register(kv)             # the slot came back, reusable
    slot = again.host_share.permit.slot
    again.close()
    eng.close()
    kv.close()
    return st["direct_permit_stuck"], slot


def test_a_collected_region_releases_its_slot_under_the_engine_lock(shm):
    assert run_in_child(_collect_under_the_engine_lock, timeout=20) == (0, 0)


# -- generations, slot reuse, fds and mappings (sound) ----------------------------------------

def test_generations_and_slot_reuse_across_many_regions(shm):
    """Slots go back and are reused LIFO with the next generation; an old RemoteRegion of a
    reused slot copies nothing into the slot's new region."""
    n = 1 << 16
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(n) as kv:
        src = pattern_array(n, 11, low=1)
        ms, peer = a.register(src), a.connect(b.address)
        olds = []
        for k in range(50):
            md = b.register(kv)
            f = md.host_share.permit
            assert f.slot == 0 and f.generation == k
            olds.append(a.remote(md.descriptor()))
            md.close()
        md = b.register(kv)
        new = a.remote(md.descriptor())
        kv.numpy()[:] = 0
        for old in olds:
            assert old.direct
            with pytest.raises(FabricError) as ei:      # refused by the permit: the transfer fails
                a.write(ms, 0, peer, old, 0, n).wait(10)
            assert ei.value.errno == errno.EACCES
        time.sleep(0.05)
        assert not kv.numpy().any()
        a.write(ms, 0, peer, new, 0, n).wait(10)
        assert np.array_equal(kv.numpy(), src)
        md.close()
        assert b.stats()["direct_permit_stuck"] == 0


def _fds_and_maps():
    import os

    with open("/proc/self/maps") as f:
        permits = sum("kvxfer-fence" in line for line in f)
    return len(os.listdir("/proc/self/fd")), permits


def test_permit_tables_and_their_mappings_go_with_engines_and_remotes(shm):
    """Many engines, each with regions that took slots, and remotes that mapped their permit
    pages: once closed and dropped, no permit table's fd or mapping is left."""
    with KVBuffer.allocate(1 << 16) as kv:
        gc.collect()
        before = _fds_and_maps()
        with kvxfer.Engine("shm") as a:
            for _ in range(20):
                b = kvxfer.Engine("shm")
                regions = [b.register(kv) for _ in range(3)]
                remotes = [a.remote(md.descriptor()) for md in regions]
                assert all(r.direct for r in remotes)
                regions[0].close()
                del regions[1]                       # dropped: revoked when collected
                b.close()                            # closes regions[2]
                del regions, remotes, b
        gc.collect()
        assert _fds_and_maps() == before


# -- the cached pidfd check: a killed peer still fails fast (sound) ---------------------------

def test_a_post_right_after_a_peers_death_fails_fast(shm):
    """The poster trusts a pidfd's "running" for 0.5 ms (KX_ALIVE_NS): a post in that window
    reaches the dead peer's queue, and the peer scan fails it; either way within a fraction
    of a second, never the stall deadline."""
    from kvxfer.errors import PeerError
    from _target import Target

    n = 1 << 16
    with kvxfer.Engine("shm", peer_timeout=30) as eng:
        tgt = Target("shm", n)
        try:
            mr = eng.register(pattern_array(n, 12, low=1))
            peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
            for _ in range(20):
                eng.write(mr, 0, peer, dst, 0, 64, imm=1).wait(10)
            tgt.proc.kill()
            tgt.proc.join(10)
            start = time.monotonic()
            try:
                for _ in range(1000):                  # the first posts may still be "accepted"
                    eng.write(mr, 0, peer, dst, 0, 64, imm=1).wait(5)
                raise AssertionError("posts to a dead peer kept succeeding")
            except PeerError:
                pass
            assert time.monotonic() - start < 1.0
        finally:
            tgt.kill()
