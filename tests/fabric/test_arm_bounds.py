"""Arming checks its arguments natively, on its own copies: ``Watcher.arm_groups`` arms exactly
what ``Watcher._group_args`` (numpy's checks) accepts, at ``base + thresholds``, and refuses
everything else with the error those checks name, nothing armed, whatever the arrays' form."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer.engine.watcher import Watcher
from kvxfer.errors import KvxferError

SRC, DST = 1 << 13, 3 << 12


@pytest.fixture(scope="module")
def armed_pair():
    """One shm (else tcp) engine pair, a watcher nobody bumps, a source and a destination."""
    prov = "shm" if "shm" in kvxfer.providers() else "tcp;ofi_rxm"
    a, b = kvxfer.Engine(prov, "127.0.0.1"), kvxfer.Engine(prov, "127.0.0.1")
    src, dst = np.zeros(SRC, np.uint8), np.zeros(DST, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    a.send(peer, b"hello")
    assert b.recv(10) == b"hello"
    w = a.watcher(poll_us=0)
    try:
        yield w, ms, peer, a.remote(md.descriptor())
    finally:
        w.close()
        a.close()
        b.close()


class _Region:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


_big = st.one_of(st.integers(0, 1 << 12), st.integers((1 << 62) - 2, (1 << 62) + 2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_big, _big, _big), max_size=8), st.lists(st.integers(-1, 10), max_size=6),
       st.lists(_big, max_size=6), st.sampled_from([1, 5, (1 << 62) - 3, 1 << 62, (1 << 64) - 1]),
       st.sampled_from(["uint64", "int64"]), st.sampled_from(["int64", "uint64"]))
def test_it_arms_what_the_python_checks_accept(armed_pair, triples, starts, th, base, tdtype, sdtype):
    # base >= 1 over a counter that stays 0: no entry is ever due, so none fires meanwhile
    w, ms, peer, rd = armed_pair
    so, do, ln = (np.array([t[k] for t in triples], dtype=np.uint64).astype(tdtype) for k in range(3))
    thr = np.array(th[:max(len(starts) - 1, 0)], np.uint64).astype(tdtype)
    stt = np.array(starts, np.int64).astype(sdtype)
    try:
        ref = Watcher._group_args(thr, base, _Region(SRC), _Region(DST), so, do, ln, stt)
        want = None
    except KvxferError as exc:
        ref, want = None, exc
    before = w.stats()["armed"]
    if want is not None:
        with pytest.raises(type(want)) as got:
            w.arm_groups(thr, ms, peer, rd, so, do, ln, stt, base=base)
        assert str(got.value) == str(want)
        assert w.stats()["armed"] == before
        return
    b = w.arm_groups(thr, ms, peer, rd, so, do, ln, stt, base=base)
    try:
        rth, rso, rdo, rln, rst = ref
        assert len(b) == len(rth) and w.stats()["armed"] == before + len(rth)
        assert [e.threshold for e in b] == [base + int(t) for t in rth]
        sums = [int(rln[rst[g]:rst[g + 1]].sum()) for g in range(len(rth))]
        assert [e.nbytes for e in b] == sums and b.nbytes == sum(sums)
        assert b.entries_in("armed") == len(rth)
    finally:
        b.cancel()
    assert w.stats()["armed"] == before


def test_the_native_pass_refuses_with_nothing_armed(armed_pair):
    """Where the arrays are already its form (uint64, starts int64) the native pass alone
    checks them: a range past its region, starts that skip a triple, a threshold past 2**62
    with the base: None from the handle, nothing armed; through ``arm_groups`` the precise error."""
    w, ms, peer, rd = armed_pair
    eng = w.engine
    so = np.array([0, 64], np.uint64)
    ln = np.array([64, 64], np.uint64)
    th = np.array([1, 2], np.uint64)
    st_ = np.array([0, 1, 2], np.int64)
    args = (eng._rails[0], peer.fi_addrs[0], peer.gens[0], ms.ptr, ms._live()[0], rd.base, rd.keys[0],
            rd._direct_from(ms))
    lim = (None, eng.iov, eng.max_write, rd._pack_min)

    def native(th_, base, so_, do_, ln_, st2, dst_size=DST):
        return w._h.arm_groups(th_, base, 0, *args, so_, do_, ln_, st2, *lim, SRC, dst_size)

    before = w.stats()["armed"]
    ok = native(th, 0, so, np.array([0, DST - 64], np.uint64), ln, st_)     # the last byte of the region
    assert ok is not None and len(ok) == 2 and ok.nbytes == 128 and w.stats()["armed"] == before + 2
    ok.cancel()
    assert w.stats()["armed"] == before
    refused = [native(th, 0, so, np.array([0, DST - 63], np.uint64), ln, st_),
               native(th, 0, so, so, ln, np.array([0, 1, 1], np.int64)),
               native(th, 0, so, so, ln, np.array([0, 2, 1], np.int64)),
               native(th, (1 << 62) - 2, so, so, ln, st_),
               native(th, 0, so, so, ln, st_, dst_size=100)]
    assert refused == [None] * 5 and w.stats()["armed"] == before
    with pytest.raises(kvxfer.errors.OutOfBoundsError):
        w.arm_groups(th, ms, peer, rd, so, np.array([0, DST - 63], np.uint64), ln, st_)
    with pytest.raises(kvxfer.errors.InvalidArgumentError, match="base"):
        w.arm_groups(th, ms, peer, rd, so, so, ln, st_, base=(1 << 62) - 2)
    e = np.zeros(0, np.uint64)
    with pytest.raises(kvxfer.errors.InvalidArgumentError, match="base"):     # no group: base alone
        w.arm_groups(e, ms, peer, rd, e, e, e, np.zeros(1, np.int64), base=1 << 62)
    with pytest.raises(kvxfer.errors.InvalidArgumentError, match="below 2\\*\\*62"):
        w.arm(1 << 62, ms, peer, rd, [0], [0], [1])
    assert w.stats()["armed"] == before
