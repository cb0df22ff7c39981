"""One-sided reads at the native layer (src/read.c through kvxfer/_fabric_read.pxi): two rails in
this process on each provider, scattered reads byte-exact, the message rule's rules 1-2 with
iov and max_read limits, reads refused outside either region with nothing posted, and the
target's registration access honoured where the provider enforces it (tcp; shm's CMA copy
checks no key or access flag, see docs/reliability.md)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import _fabric, wire
from kvxfer.errors import FabricError, InvalidArgumentError, OutOfBoundsError, PeerError

NBYTES = 1 << 20


class _Side:
    """One rail with a registered buffer; closed in the engine's order (drain, quiesce, endpoint,
    registrations, domain)."""

    def __init__(self, provider: str, remote: int) -> None:
        self.rail = _fabric.Rail(provider, "127.0.0.1")
        self.rail.start()
        self.buf = np.zeros(NBYTES, np.uint8)
        self.region = self.rail.mr_reg(self.buf.ctypes.data, NBYTES, remote=remote)

    @property
    def base(self) -> int:
        """What a peer names as this region's first byte (virtual address or 0)."""
        return self.buf.ctypes.data if self.rail.mr_mode & _fabric.MR_VIRT_ADDR else 0

    def close(self) -> None:
        self.rail.drain(1.0)
        self.rail.close_endpoint()
        self.region.close()
        self.rail.close()


@pytest.fixture
def sides(provider):
    target = _Side(provider, _fabric.REMOTE_READ | _fabric.REMOTE_WRITE)
    reader = _Side(provider, 0)
    try:
        if target.region.raw_key:
            pytest.skip("raw keys (FI_MR_RAW) are not exercised here")
        peer, gen = reader.rail.av_insert(np.frombuffer(target.rail.getname(), np.uint8))
        yield reader, target, peer, gen
    finally:
        reader.close()
        target.close()


def _read(reader, target, peer, gen, lo, ro, ln, iov=4, max_read=1 << 20, key=None, remote_len=NBYTES):
    t = _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key if key is None else key,
                     remote_len, np.asarray(lo, np.uint64), np.asarray(ro, np.uint64), np.asarray(ln, np.uint64),
                     iov, max_read)
    assert t.wait(10.0), "read did not complete"
    return t


def test_scattered_pages_read_byte_exact(sides):
    reader, target, peer, gen = sides
    target.buf[:] = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    page = 4096
    rng = np.random.default_rng(2)
    src = rng.permutation(NBYTES // page)[:100]
    dst = rng.permutation(NBYTES // page)[:100]
    lo, ro, ln = dst * page, src * page, np.full(100, page)
    t = _read(reader, target, peer, gen, lo, ro, ln)
    assert t.errno == 0 and t.completed == t.planned == wire.count_writes(lo, ro, ln, 4, 1 << 20)
    for s, d in zip(src, dst):
        np.testing.assert_array_equal(reader.buf[d * page:(d + 1) * page], target.buf[s * page:(s + 1) * page])
    untouched = np.ones(NBYTES, bool)
    for d in dst:
        untouched[d * page:(d + 1) * page] = False
    assert (reader.buf[untouched] == 0).all()


@pytest.mark.parametrize("iov,max_read", [(1, 1 << 20), (2, 3000), (4, 777)])
def test_message_rule_splits_and_merges(sides, iov, max_read):
    """Contiguous triples merge, messages hold at most iov pieces and max_read bytes: as many
    messages as wire.count_writes says (pack_min 0), and the bytes are right."""
    reader, target, peer, gen = sides
    if iov > reader.rail.iov_limit:
        pytest.skip(f"provider takes {reader.rail.iov_limit} iovecs")
    target.buf[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    lo = np.array([0, 1000, 2000, 50_000, 90_000], np.uint64)
    ro = np.array([7, 1007, 2007, 300_000, 12], np.uint64)
    ln = np.array([1000, 1000, 5000, 20_000, 1], np.uint64)
    t = _read(reader, target, peer, gen, lo, ro, ln, iov=iov, max_read=max_read)
    assert t.errno == 0 and t.planned == wire.count_writes(lo, ro, ln, iov, max_read)
    for a, b, n in zip(lo, ro, ln):
        np.testing.assert_array_equal(reader.buf[a:a + n], target.buf[b:b + n])


@pytest.mark.parametrize("lo,ro,ln", [
    ([NBYTES - 10], [0], [11]),               # past the local region
    ([0], [NBYTES - 10], [11]),               # past the remote region
    ([0, 2**64 - 8], [0, 0], [8, 16]),         # an offset that wraps
    ([0], [0], [NBYTES + 1]),
])
def test_reads_outside_a_region_are_refused_before_posting(sides, lo, ro, ln):
    reader, target, peer, gen = sides
    target.buf[:] = 7
    posted = reader.rail.stats()
    with pytest.raises(OutOfBoundsError):
        _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key, NBYTES,
                     np.asarray(lo, np.uint64), np.asarray(ro, np.uint64), np.asarray(ln, np.uint64), 4, 1 << 20)
    assert (reader.buf == 0).all()
    assert reader.rail.stats()["outstanding"] == posted["outstanding"] == 0


def test_a_smaller_remote_length_bounds_the_read(sides):
    """remote_len is the region the reader was given (a descriptor's length), not the target's
    whole registration."""
    reader, target, peer, gen = sides
    with pytest.raises(OutOfBoundsError):
        _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key, 4096,
                     np.array([0], np.uint64), np.array([4000], np.uint64), np.array([100], np.uint64), 4, 1 << 20)


def test_bad_arrays_and_limits(sides):
    reader, target, peer, gen = sides
    with pytest.raises(InvalidArgumentError, match="differ"):
        _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key, NBYTES,
                     np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.ones(2, np.uint64), 4, 1 << 20)
    with pytest.raises(InvalidArgumentError, match="limits"):
        _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key, NBYTES,
                     np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.uint64),
                     reader.rail.iov_limit + 1, 1 << 20)


def test_empty_read_is_done_at_once(sides):
    reader, target, peer, gen = sides
    t = _read(reader, target, peer, gen, [], [], [])
    assert t.planned == 0 and t.done


def test_what_the_provider_checks_of_a_read(provider):
    """The boundary a read meets at the target: tcp;ofi_rxm refuses a wrong key (the read's
    completion fails, nothing lands); shm's CMA copy checks no key, so there a wrong key lands
    (the boundary is the OS user, as for writes). Neither provider here (libfabric 1.17, tcp
    with mr_mode 0) checks FI_REMOTE_READ: a region registered for remote writes only is
    readable by whoever holds its key, so the engine must refuse reads against descriptors not
    offered for reading, and key secrecy is what protects the rest (docs/reliability.md)."""
    target = _Side(provider, _fabric.REMOTE_WRITE)
    reader = _Side(provider, 0)
    try:
        target.buf[:] = 9
        peer, gen = reader.rail.av_insert(np.frombuffer(target.rail.getname(), np.uint8))
        t = _fabric.read(reader.rail, peer, gen, reader.region, target.base, target.region.key ^ 0x5A5A, NBYTES,
                         np.array([0], np.uint64), np.array([0], np.uint64), np.array([4096], np.uint64), 1, 1 << 20)
        assert t.wait(10.0)
        if provider == "shm":
            assert t.errno == 0 and (reader.buf[:4096] == 9).all()
        else:
            assert t.errno != 0 and (reader.buf == 0).all()
            assert isinstance(_fabric.error_from("fi_readmsg", t.errno), (PeerError, FabricError))
    finally:
        reader.close()
        target.close()


def test_read_groups_from_two_regions_byte_exact(sides, provider):
    """read_groups: groups of triples into two local regions from two of the peer's, one
    GIL-free loop, one TransferSet; every byte where the groups say."""
    reader, target, peer, gen = sides
    target.buf[:] = np.random.default_rng(3).integers(0, 256, NBYTES, dtype=np.uint8)
    other = np.random.default_rng(4).integers(0, 256, NBYTES // 2, dtype=np.uint8)
    oreg = target.rail.mr_reg(other.ctypes.data, other.nbytes, remote=_fabric.REMOTE_READ)
    mine = np.zeros(NBYTES // 4, np.uint8)
    mreg = reader.rail.mr_reg(mine.ctypes.data, mine.nbytes, remote=0)
    try:
        obase = other.ctypes.data if target.rail.mr_mode & _fabric.MR_VIRT_ADDR else 0
        # pair 0: reader.region <- target.region; pair 1: mreg <- oreg
        lo = np.array([0, 8192, 100, 5000, 60_000], np.uint64)
        ro = np.array([4096, 0, 7, 300_000, 1], np.uint64)
        ln = np.array([4096, 100, 900, 2000, 3000], np.uint64)
        starts = np.array([0, 2, 5], np.int64)
        pair = np.array([0, 1], np.int64)
        t = _fabric.read_groups(reader.rail, peer, gen, [reader.region, mreg],
                                np.array([target.base, obase], np.uint64),
                                np.array([target.region.key, oreg.key], np.uint64),
                                np.array([NBYTES, other.nbytes], np.uint64), pair, lo, ro, ln, starts, 4, 1 << 20)
        assert t.wait(10.0) and t.errno == 0 and t.groups == 2
        for i in range(2):
            np.testing.assert_array_equal(reader.buf[lo[i]:lo[i] + ln[i]], target.buf[ro[i]:ro[i] + ln[i]])
        for i in range(2, 5):
            np.testing.assert_array_equal(mine[lo[i]:lo[i] + ln[i]], other[ro[i]:ro[i] + ln[i]])
        # a triple past the second remote region refuses the whole call: nothing posted
        mine[:] = 0
        reader.buf[:] = 0
        bad = ln.copy()
        bad[4] = other.nbytes
        with pytest.raises(OutOfBoundsError, match="group 1"):
            _fabric.read_groups(reader.rail, peer, gen, [reader.region, mreg],
                                np.array([target.base, obase], np.uint64),
                                np.array([target.region.key, oreg.key], np.uint64),
                                np.array([NBYTES, other.nbytes], np.uint64), pair, lo, ro, bad, starts, 4, 1 << 20)
        assert (reader.buf == 0).all() and (mine == 0).all()
    finally:
        reader.rail.drain(1.0)
        target.rail.drain(1.0)
        reader.rail.close_endpoint()
        target.rail.close_endpoint()
        mreg.close()
        oreg.close()


def test_what_the_provider_checks_of_a_write_with_a_read_key(provider):
    """The other half of finding 23: the key of a registration for remote reads only (what a
    readable region's read keys name), used to write. tcp;ofi_rxm (1.17) checks write access:
    nothing lands, and with delivery-complete (the engine's default on rxm) the write fails at
    the sender; without it the sender is told "done" (a refused write's known false success).
    shm: a write with an imm is refused the same way (nothing lands); one without an imm is the
    sender's own process_vm_writev and lands (no key or flag checked: the OS user boundary)."""
    # shm is run as the engine runs it there: without delivery-complete
    for dc, imm in ((False, None), (False, 7)) if provider == "shm" else ((False, None), (True, None)):
        target = _Side(provider, _fabric.REMOTE_READ)
        writer = _Side(provider, 0)
        try:
            writer.rail.set_delivery_complete(dc)
            writer.buf[:] = 6
            peer, gen = writer.rail.av_insert(np.frombuffer(target.rail.getname(), np.uint8))
            t = writer.rail.write(peer, gen, writer.buf.ctypes.data, writer.region, target.base, target.region.key,
                                  None, np.array([0], np.uint64), np.array([0], np.uint64),
                                  np.array([4096], np.uint64), imm, 1, 1 << 20, 0)
            finished = t.wait(15.0)
            lands = provider == "shm" and imm is None
            deadline = time.monotonic() + (3.0 if not lands else 10.0)   # the bytes may still be on their way
            while not (target.buf[:4096] == 6).any() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert bool((target.buf[:4096] == 6).all()) == lands, (dc, imm)
            if provider != "shm":
                assert finished and (t.errno != 0) == dc, (dc, t.errno)
        finally:
            writer.close()
            target.close()
