"""Direct writes on shm (src/direct.c): into a region that is a memfd mapping, the sender maps
the memfd itself, copies each message's bytes with memcpy and sends its imm as a 0-byte write.
Same bytes, same counts and the same fence as over RMA; everything else stays on RMA. Into a
region whose descriptor carries a host share rule 3 (``pack_min``) does not apply, on the
direct path and the RMA fallback alike, so the count is the region's and the triples' only."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVBuffer, wire
from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, OutOfBoundsError, PeerError, TimeoutError
from _data import pattern_array, until as _until
from _providers import available
from _target import Target


def _mapped(share: wire.HostShare) -> int:
    """Lines of this process's maps that map the share's memfd."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.split()[4:5] == [str(share.inode)])


def _scatter(cap: int, npages: int, seed: int):
    """npages source/destination page pairs out of cap, scattered, with one run of 10 pages
    contiguous on both sides (coalesced into one segment)."""
    rng = np.random.default_rng(seed)
    run_s, run_d = np.arange(100, 110), np.arange(cap - 10, cap)
    rest_s = rng.permutation(np.setdiff1d(np.arange(cap), run_s))[: npages - 10]
    rest_d = rng.permutation(np.setdiff1d(np.arange(cap), run_d))[: npages - 10]
    return np.r_[rest_s[:10], run_s, rest_s[10:]], np.r_[rest_d[:10], run_d, rest_d[10:]]


# -- across processes, the target's buffer a host KVBuffer ------------------------------------

def test_write_lands_directly(shm):
    n = 3 << 20
    src = pattern_array(n, 1)
    with Target("shm", n, memory="memfd") as tgt, kvxfer.Engine("shm") as eng:
        share = wire.Descriptor.decode(tgt.descriptor).host_share
        assert share is not None and share.pid == tgt.pid and share.offset == 0
        mr = eng.register(src)
        peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert dst.direct and eng.info["direct"]
        t = eng.write(mr, 1000, peer, dst, 5, n - 2000, imm=11)
        tgt.expect(11, t.num_writes)
        t.wait(20)
        assert tgt.wait(11) == ("ok", t.num_writes)
        mem = tgt.memory()
        assert np.array_equal(mem[5: 5 + n - 2000], src[1000: n - 1000])
        assert not mem[:5].any() and not mem[5 + n - 2000:].any()
        assert eng.stats()["direct_writes"] == t.num_writes
        time.sleep(0.05)
        assert tgt.call("banked", 11) == 0          # not one arrival more than num_writes


def test_large_write_is_split_directly(shm):
    with kvxfer.Engine("shm", max_write=1 << 20) as eng, Target("shm", 5 << 20, memory="memfd") as tgt:
        src = pattern_array(5 << 20, 2)
        mr = eng.register(src)
        dst = eng.remote(tgt.descriptor)
        assert dst.direct
        t = eng.write(mr, 0, eng.connect(tgt.address), dst, 0, len(src), imm=3)
        assert t.num_writes == 5
        tgt.expect(3, 5)
        t.wait(20)
        assert tgt.wait(3) == ("ok", 5)
        assert np.array_equal(tgt.memory(), src)


@pytest.mark.parametrize("page_bytes,npages", [(2048, 3000), (16384, 200)])
def test_scattered_pages_land_directly(shm, page_bytes, npages):
    cap = npages * 2
    src = pattern_array(cap * page_bytes, 3)
    src_pages, dst_pages = _scatter(cap, npages, page_bytes)
    with Target("shm", cap * page_bytes, memory="memfd") as tgt, kvxfer.Engine("shm") as eng:
        mr = eng.register(src)
        dst = eng.remote(tgt.descriptor)
        assert dst.direct
        t = eng.write_pages(mr, src_pages, eng.connect(tgt.address), dst, dst_pages, page_bytes, imm=42)
        so = src_pages.astype(np.uint64) * page_bytes
        do = dst_pages.astype(np.uint64) * page_bytes
        ln = np.full(npages, page_bytes, np.uint64)
        assert t.num_writes == eng.count_writes(so, do, ln, region=dst) == tgt.call("count", so, do, ln)
        assert t.num_writes == -(-(npages - 9) // eng.iov)      # a host share: no piece travels alone
        tgt.expect(42, t.num_writes)
        t.wait(30)
        assert tgt.wait(42) == ("ok", t.num_writes)
        mem = tgt.memory().reshape(cap, page_bytes)
        assert np.array_equal(mem[dst_pages], src.reshape(cap, page_bytes)[src_pages])
        assert not mem[np.setdiff1d(np.arange(cap), dst_pages)].any()
        assert eng.stats()["direct_writes"] == t.num_writes
        assert tgt.call("banked", 42) == 0


def test_two_rails_write_directly(shm):
    page, npages = 16384, 256
    src = pattern_array(page * npages, 5)
    perm = np.random.default_rng(5).permutation(npages)
    with Target("shm", page * npages, memory="memfd") as tgt, kvxfer.Engine("shm", rails=2) as eng:
        mr = eng.register(src)
        dst = eng.remote(tgt.descriptor)
        t = eng.write_pages(mr, np.arange(npages), eng.connect(tgt.address), dst, perm, page, imm=8)
        so = np.arange(npages, dtype=np.uint64) * page
        assert t.num_writes == eng.count_writes(so, perm.astype(np.uint64) * page, np.full(npages, page, np.uint64),
                                                region=dst)
        tgt.expect(8, t.num_writes)
        t.wait(20)
        assert tgt.wait(8) == ("ok", t.num_writes)
        assert np.array_equal(tgt.memory().reshape(npages, page)[perm], src.reshape(npages, page))
        assert eng.stats()["direct_writes"] == t.num_writes


def test_fence_after_cancel_directly(shm):
    """Cancel mid-transfer; once done, Transfer.posted is final: the target drains exactly
    that many arrivals and retires the imm, and the next write of that imm counts alone."""
    page = 16384
    src = pattern_array(2048 * page, 6)
    with Target("shm", 2048 * page, memory="memfd") as tgt, kvxfer.Engine("shm") as eng:
        mr = eng.register(src)
        peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert dst.direct
        eng.write(mr, 0, peer, dst, 0, 64).wait(10)      # connected: the first posts go out at once
        pages = np.arange(0, 2048, 2)                      # one 4-piece message per 4 pages
        ts = [eng.write_pages(mr, pages, peer, dst, pages, page, imm=21) for _ in range(4)]
        for t in ts:
            t.cancel()
        for t in ts:
            assert _until(lambda: t.done)
        posted = sum(t.posted for t in ts)
        assert 0 <= posted <= sum(t.num_writes for t in ts)
        dropped = tgt.call("discard", 21)
        if dropped < posted:
            tgt.expect(21, posted - dropped)
            assert tgt.wait(21)[0] == "ok"
            assert tgt.call("discard", 21) == 0            # the expectation took exactly the rest
        assert tgt.call("banked", 21) == 0
        tgt.expect(21, 1)
        eng.write(mr, 0, peer, dst, 0, 64, imm=21).wait(10)
        assert tgt.wait(21) == ("ok", 1)
        time.sleep(0.05)
        assert tgt.call("banked", 21) == 0


@pytest.mark.parametrize("case", ["numpy target", "direct=False", "target direct=False", "KVXFER_SHM_DIRECT=0",
                                  "unsealed memfd"])
def test_rma_where_no_direct(shm, monkeypatch, case):
    """A target that is not a sealed memfd, or direct turned off on either side: RMA, same result."""
    page, npages = 4096, 64
    memory = {"numpy target": "numpy", "unsealed memfd": "memfd-unsealed"}.get(case, "memfd")
    target_opts = {"direct": False} if case == "target direct=False" else None
    src = pattern_array(page * npages, 7)
    perm = np.random.default_rng(7).permutation(npages)
    with Target("shm", page * npages, memory=memory, options=target_opts) as tgt:
        if case == "KVXFER_SHM_DIRECT=0":            # this process only: the target offers its share
            monkeypatch.setenv("KVXFER_SHM_DIRECT", "0")
        with kvxfer.Engine("shm", direct=False if case == "direct=False" else None) as eng:
            share = wire.Descriptor.decode(tgt.descriptor).host_share
            assert (share is None) == (case in ("numpy target", "target direct=False"))
            dst = eng.remote(tgt.descriptor)
            assert not dst.direct
            assert eng.info["direct"] == (case not in ("direct=False", "KVXFER_SHM_DIRECT=0"))
            mr = eng.register(src)
            t = eng.write_pages(mr, np.arange(npages), eng.connect(tgt.address), dst, perm, page, imm=9)
            so, do = np.arange(npages, dtype=np.uint64) * page, perm.astype(np.uint64) * page
            ln = np.full(npages, page, np.uint64)
            # 4 KiB pieces are shorter than shm's pack_min: alone, unless the region has a host share
            assert page < eng.pack_min
            rule = wire.count_writes(so, do, ln, eng.iov, eng.max_write, 0 if share is not None else eng.pack_min)
            assert t.num_writes == rule == eng.count_writes(so, do, ln, region=dst) == tgt.call("count", so, do, ln)
            old = wire.count_writes(so, do, ln, eng.iov, eng.max_write, eng.pack_min)
            assert t.num_writes < old if share is not None else t.num_writes == old
            tgt.expect(9, t.num_writes)
            t.wait(20)
            assert tgt.wait(9) == ("ok", t.num_writes)
            assert np.array_equal(tgt.memory().reshape(npages, page)[perm], src.reshape(npages, page))
            assert eng.stats()["direct_writes"] == 0


def _small_pieces(cap: int, npieces: int, page: int, seed: int):
    """write_batch triples of npieces small pieces (1 .. page - 64 bytes), scattered over page
    slots of both regions (one piece per slot, at an odd place in it): none contiguous."""
    rng = np.random.default_rng(seed)
    so = rng.permutation(cap)[:npieces].astype(np.uint64) * page + rng.integers(0, 64, npieces).astype(np.uint64)
    do = rng.permutation(cap)[:npieces].astype(np.uint64) * page + rng.integers(0, 64, npieces).astype(np.uint64)
    return so, do, rng.integers(1, page - 64, npieces).astype(np.uint64)


@pytest.mark.parametrize("mode", ["direct", "direct=False", "KVXFER_SHM_DIRECT=0", "unmappable"])
def test_small_scattered_pieces_pack_on_every_path(shm, monkeypatch, mode):
    """Many small scattered pieces into a region whose descriptor carries a host share pack
    iov to a message (no rule 3), whichever path the sender takes: direct; over RMA with its
    direct writes off (``direct=False``, ``KVXFER_SHM_DIRECT=0``); over RMA where it cannot
    map the memfd (unsealed). The same count on every path (Transfer.num_writes, the
    sender's and the target's own count_writes, the arrivals) and the same bytes."""
    page, cap, npieces = 2048, 8192, 4000
    src = pattern_array(cap * page, 20)
    so, do, ln = _small_pieces(cap, npieces, page, 20)
    want = np.zeros(cap * page, np.uint8)
    for s_, d_, n_ in zip(so.tolist(), do.tolist(), ln.tolist()):
        want[d_: d_ + n_] = src[s_: s_ + n_]
    with Target("shm", cap * page, memory="memfd-unsealed" if mode == "unmappable" else "memfd") as tgt:
        if mode == "KVXFER_SHM_DIRECT=0":                # this process only: the target offers its share
            monkeypatch.setenv("KVXFER_SHM_DIRECT", "0")
        with kvxfer.Engine("shm", direct=False if mode == "direct=False" else None) as eng:
            dst = eng.remote(tgt.descriptor)
            assert dst.host_share is not None and dst.direct == (mode == "direct")
            packed = wire.count_writes(so, do, ln, eng.iov, eng.max_write, 0)
            assert packed == -(-npieces // eng.iov)
            assert wire.count_writes(so, do, ln, eng.iov, eng.max_write, eng.pack_min) == npieces   # the old rule
            assert eng.count_writes(so, do, ln, region=dst) == packed == tgt.call("count", so, do, ln)
            t = eng.write_batch(eng.register(src), eng.connect(tgt.address), dst, so, do, ln, imm=23)
            assert t.num_writes == packed
            tgt.expect(23, packed)
            t.wait(30)
            assert tgt.wait(23) == ("ok", packed)
            assert np.array_equal(tgt.memory(), want)
            assert eng.stats()["direct_writes"] == (packed if mode == "direct" else 0)
            time.sleep(0.05)
            assert tgt.call("banked", 23) == 0           # not one arrival more


def test_tcp_never_writes_directly():
    if not available("tcp;ofi_rxm"):
        pytest.skip("provider tcp;ofi_rxm is not available here")
    n = 1 << 20
    src = pattern_array(n, 8)
    with Target("tcp;ofi_rxm", n, memory="memfd") as tgt, \
            kvxfer.Engine("tcp;ofi_rxm", "127.0.0.1", direct=True) as eng:
        assert not eng.info["direct"]
        d = wire.Descriptor.decode(tgt.descriptor)
        assert d.host_share is None                      # a tcp engine offers none
        # nor uses one: a host share grafted on a tcp descriptor is ignored
        with KVBuffer.allocate(n) as kv:
            fd = kv.fileno()
            st = os.fstat(fd)
            forged = wire.Descriptor(d.provider, d.base, d.nbytes, d.keys, d.virt_addr, d.raw, d.device, d.owner,
                                     wire.HostShare(os.getpid(), fd, st.st_dev, st.st_ino, 0))
            for desc in (tgt.descriptor, forged.encode()):
                assert not eng.remote(desc).direct
        mr = eng.register(src)
        t = eng.write(mr, 0, eng.connect(tgt.address), eng.remote(forged.encode()), 0, n, imm=4)
        tgt.expect(4, t.num_writes)
        t.wait(20)
        assert tgt.wait(4) == ("ok", t.num_writes)
        assert np.array_equal(tgt.memory(), src)
        assert eng.stats()["direct_writes"] == 0


def test_mapping_lives_as_long_as_a_transfer_uses_it(shm):
    """The sender's mapping outlives its RemoteRegion while a transfer copies through it, and
    is unmapped once nothing references it."""
    page, npages = 16384, 1024
    src = pattern_array(page * npages, 9)
    perm = np.random.default_rng(9).permutation(npages)
    with Target("shm", page * npages, memory="memfd") as tgt:
        share = wire.Descriptor.decode(tgt.descriptor).host_share
        with kvxfer.Engine("shm") as eng:
            assert _mapped(share) == 0
            mr = eng.register(src)
            peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
            assert dst.direct and _mapped(share) == 1
            t = eng.write_pages(mr, np.arange(npages), peer, dst, perm, page, imm=12)
            in_flight = not t.done                       # 16 MiB: most of it still queued
            del dst                                      # the RemoteRegion and its DirectMap go;
            gc.collect()                                 # the transfer's reference keeps the mapping
            assert in_flight
            tgt.expect(12, t.num_writes)
            t.wait(20)
            assert tgt.wait(12) == ("ok", t.num_writes)
            assert np.array_equal(tgt.memory().reshape(npages, page)[perm], src.reshape(npages, page))
            assert _mapped(share) == 0           # posting over, the region gone: unmapped already
            dst = eng.remote(tgt.descriptor)
            t = eng.write_pages(mr, np.arange(npages), peer, dst, perm, page, imm=13)
            t.wait(20)
            assert _mapped(share) == 1           # the region still holds it
            del dst
            gc.collect()
            assert _mapped(share) == 0


def test_dead_target_fails_a_direct_transfer_in_time(shm):
    """The target stops, then dies, with a large direct transfer under way: the copies into
    its memfd are harmless (the mapping keeps the pages), its 0-byte writes stop, wait() ends."""
    n = 256 << 20
    with kvxfer.Engine("shm", max_write=1 << 20) as eng:
        tgt = Target("shm", n, memory="memfd")
        try:
            mr = eng.register(np.zeros(n, np.uint8))
            peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
            assert dst.direct
            os.kill(tgt.pid, signal.SIGSTOP)          # no progress at the target from now on
            t = eng.write(mr, 0, peer, dst, 0, n, imm=1)
            os.kill(tgt.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises((PeerError, TimeoutError)):
                t.wait(5)
            assert time.monotonic() - start < 15
        finally:
            tgt.kill()


def test_close_with_direct_transfers_queued_does_not_crash(shm):
    """The sender closes while its progress thread is still copying: the copies stop with the
    thread, and the mapping goes only after (a crash fails the child, not pytest)."""
    n = 8192
    with Target("shm", n * 4096, memory="memfd") as tgt:
        code = textwrap.dedent(f"""
            import numpy as np, kvxfer
            for i in range(5):
                a = kvxfer.Engine("shm")
                src = np.ones({n} * 4096, np.uint8)
                ms = a.register(src)
                peer, rr = a.connect(bytes.fromhex({tgt.address.hex()!r})), a.remote(bytes.fromhex({tgt.descriptor.hex()!r}))
                assert rr.direct
                a.write(ms, 0, peer, rr, 0, 8, imm=9).wait(10)
                t = a.write_pages(ms, np.arange({n}), peer, rr, np.random.default_rng(i).permutation({n}), 4096, imm=1)
                del src, rr
                a.close()
            print("ok")
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
        assert tgt.proc.is_alive()
        assert tgt.call("banked", 9) == 5
    assert tgt.proc.exitcode == 0


def test_forged_or_stale_shares_fall_back_to_rma(shm, tmp_path):
    """remote() maps nothing that is not the memfd the share names, sealed and large enough."""
    n = 1 << 16
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(n) as kv:
        md = b.register(kv)
        d = wire.Descriptor.decode(md.descriptor())
        s = d.host_share
        assert s is not None and a.remote(md.descriptor()).direct
        plain = open(tmp_path / "plain", "wb+")
        plain.truncate(n)
        pst = os.fstat(plain.fileno())
        bad = [
            wire.HostShare(s.pid, s.fd, s.dev, s.inode + 1, 0),            # another file
            wire.HostShare(s.pid, 999_999, s.dev, s.inode, 0),             # no such fd
            wire.HostShare(2**31 - 1, s.fd, s.dev, s.inode, 0),            # no such process
            wire.HostShare(s.pid, s.fd, s.dev, s.inode, n),                # beyond the file
            wire.HostShare(s.pid, plain.fileno(), pst.st_dev, pst.st_ino, 0),   # a regular file, not a memfd
            wire.HostShare(s.pid, 0, s.dev, s.inode, 0),                   # stdin
        ]
        for share in bad:
            forged = wire.Descriptor(d.provider, d.base, d.nbytes, d.keys, d.virt_addr, d.raw, d.device, d.owner,
                                     share)
            assert not a.remote(forged.encode()).direct, share
        plain.close()


# -- in one process -------------------------------------------------------------------------

@pytest.fixture
def memfd_pair(shm):
    """Two shm engines of this process, the second's destination a host KVBuffer."""
    a, b = kvxfer.Engine("shm"), kvxfer.Engine("shm")
    kv = KVBuffer.allocate(1 << 22)
    try:
        src = pattern_array(1 << 22, 10)
        ms, md = a.register(src), b.register(kv)
        dst = a.remote(md.descriptor())
        assert dst.direct
        yield a, b, ms, a.connect(b.address), dst, src, kv.numpy(), md
    finally:
        a.close()
        b.close()
        kv.close()


def test_write_groups_land_directly(memfd_pair):
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    page = 8192
    src2 = pattern_array(64 * page, 11)
    ms2 = a.register(src2)
    rng = np.random.default_rng(11)
    dpages = rng.permutation(mem.nbytes // page)[:96]
    groups = []
    for g, (m, sp, dp) in enumerate([(ms, np.arange(0, 32), dpages[:32]), (ms2, np.arange(10, 42), dpages[32:64]),
                                     (ms, np.arange(100, 132), dpages[64:])]):
        groups.append((m, dst, sp.astype(np.uint64) * page, dp.astype(np.uint64) * page,
                       np.full(len(sp), page, np.uint64)))
    t = a.write_groups(peer, groups, imm=31)
    assert t.num_writes == sum(a.count_writes(so, do, ln, region=dst) for _, _, so, do, ln in groups)
    assert t.num_writes == sum(b.count_writes(so, do, ln, region=md) for _, _, so, do, ln in groups)
    c = b.expect(31, t.num_writes)
    t.wait(10)
    c.wait(10)
    got = mem.reshape(-1, page)
    srcs = {id(ms): src, id(ms2): src2}
    for m, _, so, do, ln in groups:
        s = srcs[id(m)].reshape(-1, page)
        assert np.array_equal(got[(do // page).astype(np.int64)], s[(so // page).astype(np.int64)])
    assert a.stats()["direct_writes"] == t.num_writes
    assert b.banked(31) == 0


def test_watcher_writes_directly(memfd_pair):
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    w = a.watcher()
    pages = np.arange(0, 64, 2, dtype=np.uint64) * 4096
    e = w.arm(1, ms, peer, dst, pages, pages[::-1].copy(), np.full(len(pages), 4096, np.uint64), imm=41)
    assert e.num_writes == 8          # 32 pieces of 4 KiB, packed: the region has a host share
    c = b.expect(41, b.count_writes(pages, pages[::-1].copy(), np.full(len(pages), 4096, np.uint64), region=md))
    w.bump()
    e.wait(10)
    c.wait(10)
    for s, d in zip(pages, pages[::-1]):
        assert np.array_equal(mem[int(d): int(d) + 4096], src[int(s): int(s) + 4096])
    assert a.stats()["direct_writes"] == e.num_writes
    w.close()


def test_write_without_imm_lands_directly(memfd_pair):
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    pages = np.random.default_rng(12).permutation(256)
    t = a.write_pages(ms, np.arange(256), peer, dst, pages, 16384)
    t.wait(10)
    assert t.posted == t.num_writes and t.error is None
    assert np.array_equal(mem.reshape(256, -1)[pages], src.reshape(256, -1))
    assert a.stats()["direct_writes"] == t.num_writes and a.stats()["writes_posted"] == 0


def test_a_view_at_an_odd_offset_is_shared(shm):
    """A region inside a memfd mapping, not page-aligned: the share's offset is the file's."""
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b, KVBuffer.allocate(1 << 20) as kv:
        view = kv.numpy()[4196: 4196 + 65536]
        md = b.register(view)
        assert wire.Descriptor.decode(md.descriptor()).host_share.offset == 4196
        src = pattern_array(65536, 13)
        dst = a.remote(md.descriptor())
        assert dst.direct
        t = a.write(a.register(src), 0, a.connect(b.address), dst, 100, 65436, imm=2)
        c = b.expect(2, t.num_writes)
        t.wait(10)
        c.wait(10)
        whole = kv.numpy()
        assert np.array_equal(whole[4296: 4196 + 65536], src[:65436])
        assert not whole[:4296].any() and not whole[4196 + 65536:].any()


def test_bad_input_raises_and_writes_nothing_directly(memfd_pair):
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    n = mem.nbytes
    calls = [
        (OutOfBoundsError, lambda: a.write(ms, 0, peer, dst, n - 10, 11, imm=1)),
        (OutOfBoundsError, lambda: a.write_pages(ms, [0, 1], peer, dst, [0, n // 4096], 4096, imm=1)),
        (OutOfBoundsError, lambda: a.write_batch(ms, peer, dst, [0, 0], [0, n], [8, 8], imm=1)),
        (OutOfBoundsError, lambda: a.write_groups(peer, [(ms, dst, [0], [0], [8]), (ms, dst, [0], [n - 4], [8])],
                                                  imm=1)),
        (InvalidArgumentError, lambda: a.write(ms, 0, peer, dst, 0, 8, imm=2**32)),
        (ArgumentTypeError, lambda: a.write(ms, 0, peer, dst, 0, 8, imm="1")),
        (InvalidArgumentError, lambda: a.write_pages(ms, [0, 1], peer, dst, [0], 4096)),
    ]
    for err, call in calls:
        with pytest.raises(err):
            call()
    time.sleep(0.05)
    assert not mem.any()
    assert a.stats()["direct_writes"] == 0 and b.banked(1) == 0


def test_groups_use_each_regions_rule(memfd_pair):
    """One write_groups into a region with a host share and one without (same peer): each
    group is counted by its own region's rule, on both sides, and its bytes land."""
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    plain = np.zeros(1 << 22, np.uint8)
    mp = b.register(plain)
    rp = a.remote(mp.descriptor())
    assert mp.host_share is None and rp.host_share is None and md.host_share is not None
    so, do, ln = _small_pieces(1024, 400, 2048, 21)
    groups = [(ms, dst, so[:200], do[:200], ln[:200]), (ms, rp, so[200:], do[200:], ln[200:])]
    t = a.write_groups(peer, groups, imm=33)
    assert a.count_writes(so[:200], do[:200], ln[:200], region=dst) == 50          # packed
    assert a.count_writes(so[200:], do[200:], ln[200:], region=rp) == 200          # alone (pack_min)
    assert t.num_writes == 250
    assert b.count_writes(so[:200], do[:200], ln[:200], region=md) + b.count_writes(so[200:], do[200:], ln[200:],
                                                                                    region=mp) == 250
    c = b.expect(33, 250)
    t.wait(10)
    c.wait(10)
    for (_, _, gso, gdo, gln), out in zip(groups, (mem, plain)):
        for s_, d_, n_ in zip(gso.tolist(), gdo.tolist(), gln.tolist()):
            assert np.array_equal(out[d_: d_ + n_], src[s_: s_ + n_])
    time.sleep(0.05)
    assert b.banked(33) == 0


def test_watcher_groups_use_the_regions_rule(memfd_pair):
    """Layer streaming counts like every other write: armed groups into a region with a host
    share pack their small pieces; into one without, rule 3 holds."""
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    plain = np.zeros(1 << 22, np.uint8)
    mp = b.register(plain)
    rp = a.remote(mp.descriptor())
    so, do, ln = _small_pieces(1024, 96, 2048, 22)
    starts = [0, 32, 64, 96]
    w = a.watcher()
    try:
        for r, local, imm, want in ((dst, md, 43, [8, 8, 8]), (rp, mp, 44, [32, 32, 32])):
            base = w.value
            es = w.arm_groups([base + 1, base + 2, base + 3], ms, peer, r, so, do, ln, starts, imm=imm)
            assert [e.num_writes for e in es] == want
            assert [b.count_writes(so[x:y], do[x:y], ln[x:y], region=local)
                    for x, y in zip(starts, starts[1:])] == want
            c = b.expect(imm, sum(want))
            w.advance(w.value + 3)
            for e in es:
                e.wait(10)
            c.wait(10)
            for s_, d_, n_ in zip(so.tolist(), do.tolist(), ln.tolist()):
                assert np.array_equal((mem if r is dst else plain)[d_: d_ + n_], src[s_: s_ + n_])
    finally:
        w.close()


def test_receiver_counts_agree_on_random_triples(memfd_pair):
    """Engine.count_writes(region=) at the receiver (its MemoryRegion) and at the sender (the
    RemoteRegion) equal Transfer.num_writes and the arrivals, for a region with a host share
    and one without, on random triples around pack_min (runs, tiny pieces)."""
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    plain = np.zeros(1 << 22, np.uint8)
    mp = b.register(plain)
    rp = a.remote(mp.descriptor())
    rng = np.random.default_rng(23)
    for i in range(20):
        k = int(rng.integers(1, 200))
        ln = rng.choice([1, 100, 2048, a.pack_min - 1, a.pack_min, 9000], k).astype(np.uint64)
        gap = rng.choice([0, 0, 64], k).astype(np.uint64)        # zero gap: contiguous runs
        do = np.cumsum(np.r_[0, (ln + gap)[:-1]]).astype(np.uint64)
        so = do if i % 2 else do[::-1].copy() % np.uint64(1 << 21)
        so = np.minimum(so, np.uint64((1 << 22) - 9000))
        for r, local in ((dst, md), (rp, mp)):
            t = a.write_batch(ms, peer, r, so, do, ln, imm=50 + i)
            n = b.count_writes(so, do, ln, region=local)
            assert t.num_writes == n == a.count_writes(so, do, ln, region=r)
            c = b.expect(50 + i, n)
            t.wait(10)
            c.wait(10)
    time.sleep(0.05)
    assert all(b.banked(50 + i) == 0 for i in range(20))


def test_a_share_stays_in_the_descriptor_once_its_fd_is_gone(shm):
    """A KVBuffer closed under its region keeps the mapping but not the fd: the descriptor
    still carries the (now unmappable) host share, so the count stays the region's; the
    sender writes over RMA, with no rule 3."""
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b:
        kv = KVBuffer.allocate(1 << 20)
        md = b.register(kv)
        share = md.host_share
        kv.close()
        d = wire.Descriptor.decode(md.descriptor())
        assert share is not None and d.host_share is not None
        assert (d.host_share.dev, d.host_share.inode) == (share.dev, share.inode)
        dst = a.remote(md.descriptor())
        assert not dst.direct and dst.host_share is not None
        src = pattern_array(1 << 20, 24)
        so, do, ln = _small_pieces(256, 100, 2048, 24)
        t = a.write_batch(a.register(src), a.connect(b.address), dst, so, do, ln, imm=5)
        assert t.num_writes == 25 == b.count_writes(so, do, ln, region=md)
        c = b.expect(5, 25)
        t.wait(10)
        c.wait(10)
        assert a.stats()["direct_writes"] == 0


def test_count_writes_refuses_bad_regions(memfd_pair):
    a, b, ms, peer, dst, src, mem, md = memfd_pair
    one = ([0], [0], [8])
    with pytest.raises(TypeError):
        a.count_writes(*one)                              # the region is not optional
    for bad in (None, md.descriptor(), 3):
        with pytest.raises(ArgumentTypeError):
            a.count_writes(*one, region=bad)
    with pytest.raises(InvalidArgumentError):
        a.count_writes(*one, region=md)                   # b's region, not a's
    with pytest.raises(InvalidArgumentError):
        b.count_writes(*one, region=dst)                  # a's view of it, not b's
    with pytest.raises(InvalidArgumentError):
        a.count_writes(*one, region=a.register(np.zeros(64, np.uint8), remote=False))
    assert a.count_writes(*one, region=dst) == b.count_writes(*one, region=md) == 1
