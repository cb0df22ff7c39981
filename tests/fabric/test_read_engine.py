"""Engine reads (kvxfer/engine/reads.py) on both providers: readable registration and its
descriptor, read_pages / read_batch / read / read_groups byte-exact over one and two rails, every
bad call refused with its kvxfer.errors class and nothing read, a region not offered for reading
refused by the reader's own engine (the rule the providers do not enforce on 1.17, finding 23),
and a read the target refuses failing its transfer."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer import wire
from kvxfer.errors import (
    ArgumentTypeError,
    ClosedError,
    DescriptorError,
    InvalidArgumentError,
    KvxferError,
    OutOfBoundsError,
    PeerError,
)

N = 1 << 20
PAGE = 4096


@pytest.fixture(params=[1, 2], ids=["1rail", "2rails"])
def ends(provider, request):
    """(reader engine, its local buffer and region, peer, the target's buffer and engine, the
    target's readable region as the reader sees it)."""
    a = kvxfer.Engine(provider, "127.0.0.1", rails=request.param)
    b = kvxfer.Engine(provider, "127.0.0.1", rails=request.param)
    try:
        mine = np.zeros(N, np.uint8)
        theirs = np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)
        local = a.register(mine, remote=False)
        tr = b.register(theirs, readable=True)
        peer = a.connect(b.address)
        b.connect(a.address)
        remote = a.remote(tr.descriptor(reads_only=True))
        yield a, mine, local, peer, b, theirs, tr, remote
    finally:
        a.close()
        b.close()


def test_register_readable_and_its_descriptors(pair):
    a, b = pair
    buf = np.zeros(N, np.uint8)
    r = b.register(buf, readable=True)
    w = b.register(np.zeros(N, np.uint8))
    both = wire.Descriptor.decode(r.descriptor())
    ro = wire.Descriptor.decode(r.descriptor(reads_only=True))
    assert both.readable and both.writable and not ro.writable and ro.read_keys == both.read_keys
    assert set(both.keys).isdisjoint(both.read_keys)          # a separate registration, its own keys
    assert r.descriptor()[3] == 4 and w.descriptor()[3] in (1, 2, 3)
    assert not wire.Descriptor.decode(w.descriptor()).readable and r.readable and not w.readable
    with pytest.raises(InvalidArgumentError, match="readable"):
        w.descriptor(reads_only=True)
    with pytest.raises(InvalidArgumentError, match="remote=False"):
        b.register(np.zeros(N, np.uint8), remote=False, readable=True)
    with pytest.raises(ArgumentTypeError):
        b.register(np.zeros(N, np.uint8), readable="yes")
    r.close()
    with pytest.raises(ClosedError):
        r.descriptor()


def test_read_pages_scattered_byte_exact(ends):
    a, mine, local, peer, b, theirs, tr, remote = ends
    rng = np.random.default_rng(1)
    n = N // PAGE

    def pages(run):           # 100 distinct pages, ``run`` contiguous at 10..19 (fewer messages)
        rest = rng.permutation(np.setdiff1d(np.arange(n), run))[:90]
        return np.concatenate([rest[:10], run, rest[10:]])

    lp, rp = pages(np.arange(40, 50)), pages(np.arange(7, 17))
    t = a.read_pages(local, lp, peer, remote, rp, PAGE)
    t.wait(30)
    assert t.done and t.error is None and t.nbytes == 100 * PAGE and t.num_reads < 100
    for i, j in zip(lp, rp):
        np.testing.assert_array_equal(mine[i * PAGE:(i + 1) * PAGE], theirs[j * PAGE:(j + 1) * PAGE])
    untouched = np.ones(N // PAGE, bool)
    untouched[lp] = False
    assert not mine.reshape(-1, PAGE)[untouched].any()


def test_read_batch_read_and_strides(ends):
    a, mine, local, peer, b, theirs, tr, remote = ends
    a.read_batch(local, peer, remote, [0, 5000, 100_000], [17, 3, 900_000], [1000, 33, 100_000]).wait(30)
    np.testing.assert_array_equal(mine[0:1000], theirs[17:1017])
    np.testing.assert_array_equal(mine[5000:5033], theirs[3:36])
    np.testing.assert_array_equal(mine[100_000:200_000], theirs[900_000:1_000_000])
    mine[:] = 0
    a.read(local, 300_000, peer, remote, 12_345, 200_001).wait(30)
    np.testing.assert_array_equal(mine[300_000:500_001], theirs[12_345:212_346])
    mine[:] = 0
    a.read_pages(local, [1, 2], peer, remote, [3, 0], 100, local_stride=1000, remote_stride=512, local_offset=7,
                 remote_offset=9).wait(30)
    np.testing.assert_array_equal(mine[1007:1107], theirs[9 + 3 * 512:9 + 3 * 512 + 100])
    np.testing.assert_array_equal(mine[2007:2107], theirs[9:109])


def test_read_groups_byte_exact_and_pinned(ends):
    a, mine, local, peer, b, theirs, tr, remote = ends
    other = np.random.default_rng(9).integers(0, 256, N // 2, dtype=np.uint8)
    tr2 = b.register(other, readable=True)
    remote2 = a.remote(tr2.descriptor())
    mine2 = np.zeros(N // 4, np.uint8)
    local2 = a.register(mine2)
    groups = [(local, remote, np.arange(0, 40) * PAGE, np.arange(100, 140) * PAGE, np.full(40, PAGE)),
              (local2, remote2, [0, 9000], [5, 400_000], [8000, 3000]),
              (local, remote2, [], [], [])]
    for rail in (None, a.rails - 1):
        mine[:] = 0
        mine2[:] = 0
        t = a.read_groups(peer, groups, rail=rail)
        t.wait(30)
        assert t.nbytes == 40 * PAGE + 11000 and t.error is None
        np.testing.assert_array_equal(mine[:40 * PAGE], theirs[100 * PAGE:140 * PAGE])
        np.testing.assert_array_equal(mine2[:8000], other[5:8005])
        np.testing.assert_array_equal(mine2[9000:12000], other[400_000:403_000])
        assert not mine[40 * PAGE:].any()
    a.read_groups(peer, []).wait(5)


def _refused(a, mine, call, exc, match=None):
    mine[:] = 0
    with pytest.raises(exc, match=match):
        call()
    assert not mine.any(), "a refused call read something"


def test_bad_reads_are_refused_and_nothing_is_read(ends):
    a, mine, local, peer, b, theirs, tr, remote = ends
    n = N // PAGE
    cases = [
        (lambda: a.read_pages(local, [n], peer, remote, [0], PAGE), OutOfBoundsError, "local page"),
        (lambda: a.read_pages(local, [0], peer, remote, [n], PAGE), OutOfBoundsError, "remote page"),
        (lambda: a.read_pages(local, [0, 1], peer, remote, [0], PAGE), InvalidArgumentError, "pages"),
        (lambda: a.read_pages(local, [-1], peer, remote, [0], PAGE), OutOfBoundsError, "negative"),
        (lambda: a.read_pages(local, [0.5], peer, remote, [0], PAGE), InvalidArgumentError, None),
        (lambda: a.read_pages(local, [0], peer, remote, [0], 0), InvalidArgumentError, None),
        (lambda: a.read_pages(local, [0], peer, remote, [0], PAGE, remote_offset=N), OutOfBoundsError, None),
        (lambda: a.read_batch(local, peer, remote, [0], [N - 10], [11]), OutOfBoundsError, "remote read 0"),
        (lambda: a.read_batch(local, peer, remote, [N - 10], [0], [11]), OutOfBoundsError, "local read 0"),
        (lambda: a.read_batch(local, peer, remote, [0], [0, 1], [1]), InvalidArgumentError, None),
        (lambda: a.read_batch(local, peer, remote, [0], [2**64 - 1], [2]), OutOfBoundsError, "beyond any region"),
        (lambda: a.read(local, 0, peer, remote, N, 1), OutOfBoundsError, None),
        (lambda: a.read(remote, 0, peer, remote, 0, 1), InvalidArgumentError, "local"),
        (lambda: a.read(local, 0, peer, local, 0, 1), InvalidArgumentError, "remote"),
        (lambda: a.read(local, 0, "peer", remote, 0, 1), InvalidArgumentError, "peer"),
        (lambda: a.read_groups(peer, [(local, remote, [0], [0], [PAGE]), (local, remote, [0], [N], [1])]),
         OutOfBoundsError, "group 1"),
        (lambda: a.read_groups(peer, [(local, remote, [0], [0])]), InvalidArgumentError, "each group"),
        (lambda: a.read_groups(peer, [(local, remote, [0], [0], [1, 2])]), InvalidArgumentError, "group 0"),
        (lambda: a.read_groups(peer, [(local, remote, [0], [0], [1])], rail=a.rails), InvalidArgumentError, None),
    ]
    for call, exc, match in cases:
        _refused(a, mine, call, exc, match)


def test_only_regions_offered_for_reading_are_read(ends):
    """The reader's own rule: a write-only descriptor (or a descriptor of another engine) is
    refused before anything is posted, although tcp 1.17 would serve a read with its key
    (finding 23) and shm checks no key at all; a reads-only descriptor is refused for writes."""
    a, mine, local, peer, b, theirs, tr, remote = ends
    wo = b.register(theirs.copy())
    wo_remote = a.remote(wo.descriptor())
    assert not wo_remote.readable and remote.readable
    _refused(a, mine, lambda: a.read_pages(local, [0], peer, wo_remote, [0], PAGE), DescriptorError, "not offered")
    _refused(a, mine, lambda: a.read_groups(peer, [(local, wo_remote, [0], [0], [PAGE])]), DescriptorError,
             "group 0")
    src = a.register(np.ones(N, np.uint8))
    with pytest.raises(DescriptorError, match="no write keys"):
        a.write(src, 0, peer, remote, 0, 16)
    with pytest.raises(DescriptorError, match="no write keys"):
        a.region_pairs(peer, [(src, remote)])
    assert (theirs == np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)).all()
    # a third engine's readable region, read through this peer: refused by its owner digest
    with kvxfer.Engine(a.provider, "127.0.0.1", rails=a.rails) as c:
        cr = c.register(np.zeros(N, np.uint8), readable=True)
        foreign = a.remote(cr.descriptor())
        _refused(a, mine, lambda: a.read_pages(local, [0], peer, foreign, [0], PAGE), DescriptorError, "another")


def test_a_read_the_target_refuses_fails_its_transfer(provider):
    """Once the target closed the region, a read with its key fails its transfer with
    ``EACCES`` before anything is posted, and reads nothing: the close's REVOKE carries the
    read keys too (the revoke exchange, kvxfer/engine/revoke.py). Before, shm's CMA copy,
    which checks no key (finding 23), read the closed region's still-mapped memory, and tcp
    failed the read at the target. The peer stays usable; a read to a peer that is gone fails."""
    a = kvxfer.Engine(provider, "127.0.0.1", peer_timeout=5.0)
    b = kvxfer.Engine(provider, "127.0.0.1", peer_timeout=5.0)
    try:
        mine = np.zeros(N, np.uint8)
        theirs = np.full(N, 5, np.uint8)
        local = a.register(mine)
        tr = b.register(theirs, readable=True)
        peer = a.connect(b.address)
        remote = a.remote(tr.descriptor())
        a.read_pages(local, [0], peer, remote, [0], PAGE).wait(30)
        assert (mine[:PAGE] == 5).all()
        mine[:] = 0
        tr.close()
        t = a.read_pages(local, [1], peer, remote, [1], PAGE)
        with pytest.raises(KvxferError) as ei:
            t.wait(30)
        assert ei.value.errno == errno.EACCES and t.posted == 0
        assert not mine.any()
        again = b.register(theirs, readable=True)           # the peer stays usable
        a.read_pages(local, [2], peer, a.remote(again.descriptor()), [2], PAGE).wait(30)
        assert (mine[2 * PAGE:3 * PAGE] == 5).all() and not mine[:2 * PAGE].any()
        b.close()
        t2 = a.read_pages(local, [3], peer, remote, [3], PAGE)
        with pytest.raises(KvxferError):
            t2.wait(30)
        assert t2.error is not None
    finally:
        a.close()
        b.close()


_offsets = st.one_of(
    st.lists(st.integers(-3, N + 5), max_size=6),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3),
    st.lists(st.floats(0, N), min_size=1, max_size=3),
    st.just([[0, 1]]), st.just("x"), st.just(None),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_read_batches_read_exactly_or_nothing(pair, data):
    """Random triples (negative, huge, float, mismatched, not arrays): a call either reads
    exactly its triples or raises a kvxfer.errors class having read nothing."""
    a, b = pair
    theirs = np.arange(N, dtype=np.uint64).astype(np.uint8)
    mine = np.zeros(N, np.uint8)
    local, tr = a.register(mine, remote=False), b.register(theirs, readable=True)
    try:
        peer, remote = a.connect(b.address), a.remote(tr.descriptor(reads_only=True))
        lo, ro, ln = (data.draw(_offsets) for _ in range(3))
        try:
            t = a.read_batch(local, peer, remote, lo, ro, ln)
        except KvxferError:
            assert not mine.any(), "a refused read_batch read something"
            return
        t.wait(30)
        want = np.zeros(N, np.uint8)
        cover = np.zeros(N, np.int64)
        for x, y, n in zip(lo, ro, ln):
            want[x:x + n] = theirs[y:y + n]
            cover[x:x + n] += 1
        if cover.max(initial=0) > 1:        # overlapping reads land in any order: only the rest is checked
            assert not mine[cover == 0].any()
        else:
            np.testing.assert_array_equal(mine, want)
    finally:
        local.close()
        tr.close()
