"""Engine.write_groups / region_pairs / write_pairs: many region pairs, one imm, one Transfer.

Byte-exact landing and exact counts on both providers (the sum of the per-group message
rule), rail pinning and striping over several rails, and bad input that posts nothing.
"""

import numpy as np
import pytest

import kvxfer
from kvxfer import errors, wire

TCP = "tcp;ofi_rxm"
LAYERS, PAGES, PAGE = 6, 64, 512
_KEEP: list = []


@pytest.fixture(autouse=True)
def _keep_regions():
    yield
    _KEEP.clear()


def _pools(a, b, rng, layers=LAYERS):
    """Per-layer source and destination regions (one region per layer, as vLLM's layout)."""
    src = [rng.integers(0, 256, PAGES * PAGE, dtype=np.uint8) for _ in range(layers)]
    dst = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(layers)]
    ms = [a.register(x) for x in src]
    md = [b.register(x) for x in dst]
    peer = a.connect(b.address)
    rd = [a.remote(m.descriptor()) for m in md]
    _KEEP.append(md)            # a destination region deregisters when collected: keep them
    return src, dst, ms, rd, peer


def _groups(ms, rd, rng, n):
    """Per layer: n pages from random source pages to random destination pages, plus one
    contiguous run that coalesces on both sides."""
    out, ref = [], []
    for lay in range(len(ms)):
        sp = rng.permutation(PAGES)[:n]
        dp = rng.permutation(PAGES)[:n]
        if n >= 8:
            sp[:4], dp[:4] = np.arange(10, 14), np.arange(40, 44)
            rest = np.setdiff1d(np.arange(PAGES), dp[:4])
            dp[4:] = rng.permutation(rest)[: n - 4]
        so, do = sp.astype(np.uint64) * PAGE, dp.astype(np.uint64) * PAGE
        ln = np.full(n, PAGE, np.uint64)
        out.append((ms[lay], rd[lay], so, do, ln))
        ref.append((lay, sp, dp))
    return out, ref


def _check(src, dst, ref):
    for lay, sp, dp in ref:
        got = dst[lay].reshape(PAGES, PAGE)[dp]
        assert np.array_equal(got, src[lay].reshape(PAGES, PAGE)[sp]), f"layer {lay}"


def _expected(eng, groups, rails=None):
    return sum(wire.count_writes(so, do, ln, eng.iov, eng.max_write, eng.pack_min,
                                 rails=eng.rails if rails is None else rails) for _, _, so, do, ln in groups)


def test_groups_land_byte_exact_and_count_exactly(pair):
    a, b = pair
    rng = np.random.default_rng(1)
    src, dst, ms, rd, peer = _pools(a, b, rng)
    groups, ref = _groups(ms, rd, rng, 24)
    before = a.stats()["writes_posted"]
    t = a.write_groups(peer, groups, imm=41)
    assert t.num_writes == _expected(a, groups)
    c = b.expect(41, t.num_writes)
    t.wait(20)
    c.wait(20)
    assert b.banked(41) == 0                     # exact: nothing beyond the count arrived
    assert t.done and t.error is None and t.posted == t.num_writes
    assert a.stats()["writes_posted"] - before == t.num_writes
    _check(src, dst, ref)


def test_write_pairs_reuses_a_checked_table(pair):
    a, b = pair
    rng = np.random.default_rng(2)
    src, dst, ms, rd, peer = _pools(a, b, rng)
    pairs = a.region_pairs(peer, zip(ms, rd))
    assert len(pairs) == LAYERS
    for k in range(3):
        groups, ref = _groups(ms, rd, rng, 1 + 7 * k)
        # one pair posts nothing (count 0): still exact
        counts = np.array([len(g[4]) for g in groups])
        counts[2] = 0
        so = np.concatenate([g[2] for i, g in enumerate(groups) if i != 2])
        do = np.concatenate([g[3] for i, g in enumerate(groups) if i != 2])
        ln = np.concatenate([g[4] for i, g in enumerate(groups) if i != 2])
        for d in dst:
            d[:] = 0
        t = a.write_pairs(pairs, so, do, ln, counts, imm=50 + k)
        assert t.num_writes == _expected(a, [g for i, g in enumerate(groups) if i != 2])
        b.expect(50 + k, t.num_writes).wait(20)
        t.wait(20)
        assert b.banked(50 + k) == 0
        _check(src, dst, [r for i, r in enumerate(ref) if i != 2])
        assert not dst[2].any()


def test_empty_groups_post_nothing(pair):
    a, b = pair
    rng = np.random.default_rng(3)
    _, _, ms, rd, peer = _pools(a, b, rng, layers=2)
    e = np.array([], np.uint64)
    t = a.write_groups(peer, [(ms[0], rd[0], e, e, e), (ms[1], rd[1], [], [], [])], imm=3)
    assert t.num_writes == 0 and t.done and t.posted == 0
    t = a.write_groups(peer, [], imm=3)
    assert t.num_writes == 0 and t.done


def _bad_inputs(a, b, ms, rd, peer):
    one = np.zeros(1, np.uint64)
    pg = np.full(1, PAGE, np.uint64)
    end = np.array([PAGES * PAGE - 100], np.uint64)
    other = kvxfer.Engine(a.provider, "127.0.0.1")
    try:
        foreign = a.remote(other.register(np.zeros(4096, np.uint8)).descriptor())
    except BaseException:
        other.close()
        raise
    ok = (ms[0], rd[0], one, one, pg)
    cases = [
        ([ok, (ms[1], rd[1], end, one, pg)], errors.OutOfBoundsError),           # source beyond its region
        ([ok, (ms[1], rd[1], one, end, pg)], errors.OutOfBoundsError),           # destination beyond
        ([ok, (ms[1], rd[1], np.array([-1]), one, pg)], errors.OutOfBoundsError),
        ([ok, (ms[1], rd[1], one, one, np.array([1.5]))], errors.InvalidArgumentError),
        ([ok, (ms[1], rd[1], one, [0, 0], pg)], errors.InvalidArgumentError),    # lengths differ
        ([ok, (ms[1], rd[1], one, one)], errors.InvalidArgumentError),           # not a 5-tuple
        ([ok, (rd[1], ms[1], one, one, pg)], errors.InvalidArgumentError),       # src/dst swapped
        ([ok, (ms[1], foreign, one, one, pg)], errors.DescriptorError),          # another engine's region
        ([ok, (ms[1], rd[1], np.zeros((1, 1), np.uint64), one, pg)], errors.InvalidArgumentError),
        ([ok, ([1], rd[1], one, one, pg)], errors.InvalidArgumentError),         # unhashable src
        ([ok, (ms[1], rd[1], one, one, np.array([True]))], errors.InvalidArgumentError),  # bool beside ints
        ([ok, (ms[1], rd[1], np.array([0.0]), one, pg)], errors.InvalidArgumentError),    # float beside ints
    ]
    return cases, other


def test_bad_input_posts_nothing(pair):
    a, b = pair
    rng = np.random.default_rng(4)
    _, dst, ms, rd, peer = _pools(a, b, rng, layers=2)
    cases, other = _bad_inputs(a, b, ms, rd, peer)
    try:
        before = a.stats()["writes_posted"]
        for groups, exc in cases:
            with pytest.raises(exc):
                a.write_groups(peer, groups, imm=9)
        pairs = a.region_pairs(peer, zip(ms, rd))
        one = np.zeros(1, np.uint64)
        for kw, exc in [
            (dict(src_offsets=one, dst_offsets=one, lengths=np.full(1, PAGE), counts=[1, 1]), errors.InvalidArgumentError),
            (dict(src_offsets=one, dst_offsets=one, lengths=np.full(1, PAGE), counts=[1]), errors.InvalidArgumentError),
            (dict(src_offsets=[0, PAGES * PAGE], dst_offsets=[0, 0], lengths=[8, 8], counts=[1, 1]),
             errors.OutOfBoundsError),
        ]:
            with pytest.raises(exc):
                a.write_pairs(pairs, kw["src_offsets"], kw["dst_offsets"], kw["lengths"], kw["counts"], imm=9)
        with pytest.raises(errors.InvalidArgumentError):
            a.write_pairs(pairs, one, one, np.full(1, 8), [1, 0], imm=9, rail=a.rails)
        with pytest.raises(errors.InvalidArgumentError):
            a.write_pairs(pairs, one, one, np.full(1, 8), [1, 0], imm=2**32)
        ms[1].close()                               # a closed source region is refused natively
        with pytest.raises(errors.ClosedError):
            a.write_pairs(pairs, [0, 0], [0, 0], [8, 8], [1, 1], imm=9)
        assert a.stats()["writes_posted"] == before
        assert b.banked(9) == 0 and not any(d.any() for d in dst)
    finally:
        other.close()


def _rails_engine(rails):
    try:
        return kvxfer.Engine(TCP, "127.0.0.1", nics=["lo"] * rails)
    except errors.KvxferError as exc:  # pragma: no cover - only where tcp is missing
        pytest.skip(f"{TCP} on lo unavailable: {exc}")


@pytest.mark.parametrize("rail", [None, 0, 2])
def test_groups_over_several_rails(rail):
    """rail=None cuts each group over the rails as write_batch does; rail=k posts every group
    on local rail k only (the rail nearest the source GPU). Counts exact either way."""
    with _rails_engine(3) as a, _rails_engine(2) as b:
        rng = np.random.default_rng(5)
        src, dst, ms, rd, peer = _pools(a, b, rng)
        groups, ref = _groups(ms, rd, rng, 17)
        before = [r.stats()["writes_posted"] for r in a._rails]
        t = a.write_groups(peer, groups, imm=77, rail=rail)
        assert t.num_writes == _expected(a, groups, rails=None if rail is None else 1)
        b.expect(77, t.num_writes).wait(20)
        t.wait(20)
        assert b.banked(77) == 0
        _check(src, dst, ref)
        used = [r.stats()["writes_posted"] - x for r, x in zip(a._rails, before)]
        if rail is None:
            assert all(u > 0 for u in used)
        else:
            assert used[rail] == t.num_writes and sum(used) == t.num_writes


def test_nearest_rail_follows_the_placement():
    class _Placement:                     # what Topology.assign gives: NIC domains, nearest first
        def __init__(self, domains):
            self.domains = domains

    with _rails_engine(2) as a:
        dom = a.info["rails"][0]
        assert a.nearest_rail(_Placement(("mlx5_9", dom))) == 0
        assert a.nearest_rail(_Placement(("mlx5_9",))) is None
