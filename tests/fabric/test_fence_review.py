"""A review of the direct-write fence, the posting futex and the cached pidfd check
(docs/reliability.md, the review of 2026-12-01, finding 17). Real shm provider; whatever may
hang runs in a spawned child with a deadline."""

import gc
import threading
import time

import numpy as np

import kvxfer
from kvxfer import KVBuffer
from _data import pattern_array
from _procs import run_in_child


# -- a region's fence slot goes back without the engine's lock --------------------------------

def _register_while_closing():
    """register() finds the engine closed after it took a fence slot, and undoes the region
    (region._close() under the engine's lock), whose slot release took that lock again."""
    import kvxfer.engine as E

    eng = kvxfer.Engine("shm")
    kv = KVBuffer.allocate(1 << 16)
    take = E.Engine._fence_take

    def take_then_close(self):
        slot = take(self)
        th = threading.Thread(target=self.close)       # another thread's close(), in the window
        th.start()
        th.join(10)
        return slot

    E.Engine._fence_take = take_then_close
    try:
        eng.register(kv)
    except kvxfer.errors.ClosedError:
        pass
    finally:
        E.Engine._fence_take = take
    kv.close()
    return "ok"


def test_register_racing_close_does_not_deadlock(shm):
    assert run_in_child(_register_while_closing, timeout=20) == "ok"


def _collect_under_the_engine_lock():
    """A fenced region in a reference cycle is collected by a collection that starts while
    this thread holds the engine's lock (any allocation can start one: connect, register,
    disconnect all allocate under it); its slot's finalizer must not wait for that lock."""
    eng = kvxfer.Engine("shm")
    kv = KVBuffer.allocate(1 << 16)
    md = eng.register(kv)
    assert md.host_share.fence is not None
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
    slot = again.host_share.fence.slot
    again.close()
    eng.close()
    kv.close()
    return st["direct_fence_stuck"], slot


def test_a_collected_region_releases_its_slot_under_the_engine_lock(shm):
    assert run_in_child(_collect_under_the_engine_lock, timeout=20) == (0, 0)


# -- the cached pidfd check: a killed peer still fails fast -----------------------------------

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
            f = md.host_share.fence
            assert f.slot == 0 and f.generation == k
            olds.append(a.remote(md.descriptor()))
            md.close()
        md = b.register(kv)
        new = a.remote(md.descriptor())
        kv.numpy()[:] = 0
        for old in olds:
            assert old.direct
            a.write(ms, 0, peer, old, 0, n).wait(10)
        time.sleep(0.05)
        assert not kv.numpy().any()
        a.write(ms, 0, peer, new, 0, n).wait(10)
        assert np.array_equal(kv.numpy(), src)
        md.close()
        assert b.stats()["direct_fence_stuck"] == 0
