"""The permit of direct writes (src/direct.c, docs/architecture.md "Direct writes"): once the
target closes a region, a sender holding its old RemoteRegion copies nothing more into the
target's memfd, as its RMA writes land nowhere once the key is gone. Each region offering a
host share owns a word of its engine's permit table; the descriptor (version 3) names it.

Before the permit, the first two tests failed: the old RemoteRegion kept memcpying into the
memfd after the target's close (and into the buffer's next registration). A copy the permit
refuses fails its transfer (EACCES) and posts nothing more of it, so its imm never counts
(issue 26: it used to post the imm anyway, which counted where the key was still live)."""


def _refused(t, timeout=10):
    """Wait for t, which the permit refuses: it fails with EACCES."""
    with pytest.raises(FabricError) as ei:
        t.wait(timeout)
    assert ei.value.errno == errno.EACCES

import errno
import gc
import mmap
import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVBuffer, wire
from kvxfer.errors import FabricError, PeerError, TimeoutError
from _data import pattern_array, until as _until
from _target import Target


def PermitTarget(nbytes: int) -> Target:
    """A shm target whose destination is a host KVBuffer (a permitted share), which the tests
    deregister, register again and close under writes (tests/fabric/_target.py)."""
    return Target("shm", nbytes, memory="memfd")


def _write(eng, mr, peer, dst, n, imm):
    t = eng.write(mr, 0, peer, dst, 0, n, imm=imm)
    t.wait(20)
    return t


def test_direct_writes_still_land_and_count(shm):
    """(3) A permitted share: version 3, direct, the bytes land, direct_writes counts them."""
    n = 1 << 20
    src = pattern_array(n, 1, low=1)
    with PermitTarget(n) as tgt, kvxfer.Engine("shm") as eng:
        blob = tgt.descriptor
        share = wire.Descriptor.decode(blob).host_share
        assert blob[3] == 3 and share.permit is not None and share.permit.slot == 0
        mr, peer, dst = eng.register(src), eng.connect(tgt.address), eng.remote(blob)
        assert dst.direct
        t = eng.write(mr, 0, peer, dst, 0, n, imm=7)
        tgt.call("expect", 7, t.num_writes)
        t.wait(20)
        assert tgt.wait(7) == ("ok", t.num_writes)
        assert np.array_equal(tgt.memory(), src)
        st = eng.stats()
        assert st["direct_writes"] == t.num_writes and st["direct_revoked"] == 0
        assert st["direct_permit_stuck"] == 0


@pytest.mark.parametrize("how", ["close", "close_engine"])
def test_a_closed_regions_old_remote_writes_nothing(shm, how):
    """(1) The target closes its region (or its whole engine) and keeps the buffer: a write
    through the old RemoteRegion leaves the memfd's bytes as they were, and no arrival."""
    n = 1 << 20
    src = pattern_array(n, 2, low=1)
    with PermitTarget(n) as tgt, kvxfer.Engine("shm") as eng:
        mr, peer, dst = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert dst.direct
        _write(eng, mr, peer, dst, 4096, 1)
        assert np.array_equal(tgt.memory()[:4096], src[:4096])     # the share works until then
        tgt.call(how)
        tgt.call("fill", 0)
        before = eng.stats()
        # small enough that the caller copies it all inside write() (its first 256 KiB)
        t = eng.write(mr, 0, peer, dst, 0, 65536, imm=2)
        try:
            t.wait(2)
        except FabricError as exc:
            assert exc.errno == errno.EACCES     # the permit refused the copy
        except (PeerError, TimeoutError):
            assert how == "close_engine"        # its endpoint is gone; shm may never answer
        else:
            raise AssertionError("a write into a closed region completed")
        time.sleep(0.1)
        assert not tgt.memory().any()
        after = eng.stats()
        assert after["direct_writes"] == before["direct_writes"]
        if how == "close":
            # the target's REVOKE stopped it before any copy (kvxfer/engine/revoke.py): the
            # permit, its second line, had nothing to refuse (test_direct_hostile.py tests it)
            assert after["revoked_keys"] >= 1
            assert after["direct_revoked"] == before["direct_revoked"]
            assert tgt.call("banked", 2) == 0    # no imm was posted


def test_close_under_a_stream_of_direct_writes_stops_them(shm):
    """(1, racing) Close while the sender copies large transfers: once close() has returned,
    not one more byte lands (close waits for copies in progress)."""
    n = 32 << 20
    src = pattern_array(n, 3, low=1)
    with PermitTarget(n) as tgt, kvxfer.Engine("shm") as eng:
        mr, peer, dst = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert dst.direct
        stop, errors = threading.Event(), []

        def writer():
            try:
                while not stop.is_set():
                    eng.write(mr, 0, peer, dst, 0, n).wait(20)   # no imm: every message a copy
            except FabricError as exc:                          # the permit refused: the end
                if exc.errno != errno.EACCES:                   # pragma: no cover
                    errors.append(exc)
            except BaseException as exc:                        # pragma: no cover
                errors.append(exc)

        th = threading.Thread(target=writer)
        th.start()
        try:
            assert _until(lambda: eng.stats()["direct_writes"] > 8)
            left = tgt.call("close_fill_watch", 0.3)
            assert left == 0                     # bytes landed after close() returned: none
            # stopped by the target's REVOKE (revoke.py), or by the permit mid-copy
            assert _until(lambda: eng.stats()["direct_revoked"] > 0 or eng.stats()["revoked_keys"] > 0)
        finally:
            stop.set()
            th.join(30)
        assert not errors
        assert not tgt.memory().any()


def test_a_re_registered_buffer_takes_only_the_new_regions_writes(shm):
    """(2) The target closes its region and registers the same KVBuffer memory again (a
    messenger restarted on its KV buffer): the slot is reused with the next generation, so the
    old RemoteRegion's writes do not land, and the new one's do."""
    n = 1 << 20
    old_src, new_src = pattern_array(n, 4, low=1), pattern_array(n, 5, low=1)
    with PermitTarget(n) as tgt, kvxfer.Engine("shm") as eng:
        ms_old, ms_new, peer = eng.register(old_src), eng.register(new_src), eng.connect(tgt.address)
        old = eng.remote(tgt.descriptor)
        assert old.direct
        tgt.call("close")
        blob = tgt.call("register")
        f_old, f_new = old.host_share.permit, wire.Descriptor.decode(blob).host_share.permit
        assert (f_new.slot, f_new.generation) == (f_old.slot, f_old.generation + 1)
        new = eng.remote(blob)
        assert new.direct
        tgt.call("fill", 0)
        t = eng.write(ms_old, 0, peer, old, 0, n, imm=3)
        _refused(t, 20)
        time.sleep(0.1)
        assert not tgt.memory().any()
        assert eng.stats()["revoked_keys"] >= 1        # refused before any copy (revoke.py)
        assert tgt.call("banked", 3) == 0
        t = eng.write(ms_new, 0, peer, new, 0, n, imm=4)
        tgt.call("expect", 4, t.num_writes)
        t.wait(20)
        assert tgt.wait(4) == ("ok", t.num_writes)
        assert np.array_equal(tgt.memory(), new_src)
        assert eng.stats()["direct_writes"] == t.num_writes


def test_a_share_without_a_permit_is_written_over_rma(shm):
    """(4) A descriptor whose share has no permit (version 2, an older kvxfer) decodes, and the
    sender writes over RMA: the same count (no rule 3 into a host share), no direct write."""
    n = 1 << 20
    src = pattern_array(n, 6, low=1)
    with PermitTarget(n) as tgt, kvxfer.Engine("shm") as eng:
        d = wire.Descriptor.decode(tgt.descriptor)
        v2 = wire.Descriptor(d.provider, d.base, d.nbytes, d.keys, d.virt_addr, d.raw, d.device, d.owner,
                             wire.HostShare(d.host_share.pid, d.host_share.fd, d.host_share.dev,
                                            d.host_share.inode, d.host_share.offset)).encode()
        assert v2[3] == 2
        permitted, plain = eng.remote(tgt.descriptor), eng.remote(v2)
        assert permitted.direct and not plain.direct and plain.host_share is not None
        mr, peer = eng.register(src), eng.connect(tgt.address)
        page = 2048                       # pieces below pack_min: rule 3 would split them
        perm = np.random.default_rng(6).permutation(n // page)[:200]
        so, do = np.arange(200, dtype=np.uint64) * page, perm.astype(np.uint64) * page
        ln = np.full(200, page, np.uint64)
        assert eng.count_writes(so, do, ln, region=plain) == eng.count_writes(so, do, ln, region=permitted) == 50
        t = eng.write_batch(mr, peer, plain, so, do, ln, imm=5)
        assert t.num_writes == 50
        tgt.call("expect", 5, 50)
        t.wait(20)
        assert tgt.wait(5) == ("ok", 50)
        got = tgt.memory().reshape(-1, page)
        assert np.array_equal(got[perm], src[: 200 * page].reshape(-1, page))
        assert eng.stats()["direct_writes"] == 0 and eng.stats()["direct_revoked"] == 0


# -- in one process ---------------------------------------------------------------------------

def test_a_dropped_region_is_revoked(shm):
    """A region dropped without close() deregisters when collected: its permit is revoked."""
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(1 << 20) as kv:
        md = b.register(kv)
        dst = a.remote(md.descriptor())
        ms, peer = a.register(pattern_array(1 << 20, 7, low=1)), a.connect(b.address)
        assert dst.direct
        del md
        gc.collect()
        _refused(a.write(ms, 0, peer, dst, 0, 1 << 16, imm=1))
        time.sleep(0.05)
        assert not kv.numpy().any() and a.stats()["direct_revoked"] > 0


def test_a_dropped_region_still_registered_keeps_its_permit(shm):
    """A region dropped while its registration lives on (a transfer from it still holds it):
    its key still takes RMA writes, so its permit must still take copies; revoking it then let
    a peer's imm count without its data. It is revoked when the registration goes."""
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(1 << 20) as kv:
        md = b.register(kv)
        dst = a.remote(md.descriptor())
        ms, peer = a.register(pattern_array(1 << 20, 8, low=1)), a.connect(b.address)
        assert dst.direct
        held = md._handles[0]              # as a TransferSet holds its source registration
        del md
        gc.collect()
        c = b.expect(11, 1)
        a.write(ms, 0, peer, dst, 0, 1 << 16, imm=11).wait(10)
        c.wait(10)                         # counted, and its data is there
        assert kv.numpy()[: 1 << 16].all() and a.stats()["direct_revoked"] == 0
        kv.numpy()[:] = 0
        del held
        gc.collect()                       # the registration goes: now the permit is revoked
        _refused(a.write(ms, 0, peer, dst, 0, 1 << 16, imm=12))
        time.sleep(0.05)
        assert not kv.numpy().any() and a.stats()["direct_revoked"] > 0 and b.banked(12) == 0


def test_a_writer_that_never_leaves_retires_its_slot(shm):
    """A writer killed mid-copy leaves its count in the word: close() waits its bound (1 s),
    proceeds, counts it, and never hands that slot out again."""
    with kvxfer.Engine("shm") as b, KVBuffer.allocate(1 << 16) as kv:
        md = b.register(kv)
        f = md.host_share.permit
        with open(f"/proc/self/fd/{f.fd}", "r+b") as fh:
            table = mmap.mmap(fh.fileno(), 8 * (f.slot + 1))
        word = np.frombuffer(table, np.uint64)
        word[f.slot] += np.uint64(1)                 # a copy that started and never ended
        start = time.monotonic()
        md.close()
        waited = time.monotonic() - start
        assert 0.9 < waited < 5
        assert b.stats()["direct_permit_stuck"] == 1
        assert int(word[f.slot]) & (1 << 31)         # still revoked: no copy ever starts again
        md2 = b.register(kv)
        assert md2.host_share.permit.slot != f.slot
        del word
        table.close()
        md2.close()
        start = time.monotonic()
        md3 = b.register(kv)                         # an ordinary close does not wait
        md3.close()
        assert time.monotonic() - start < 0.5


def test_a_forged_or_stale_permit_is_written_over_rma(shm):
    """The permit is opened with the data's checks: another file, a slot beyond the table, or
    no such fd maps nothing, and the region is written over RMA."""
    import dataclasses

    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(1 << 16) as kv:
        md = b.register(kv)
        d = wire.Descriptor.decode(md.descriptor())
        f = d.host_share.permit
        assert a.remote(md.descriptor()).direct
        for bad in (dataclasses.replace(f, inode=f.inode + 1), dataclasses.replace(f, slot=b._permit.slots),
                    dataclasses.replace(f, fd=999_999)):
            forged = dataclasses.replace(d, host_share=dataclasses.replace(d.host_share, permit=bad))
            assert not a.remote(forged.encode()).direct, bad
