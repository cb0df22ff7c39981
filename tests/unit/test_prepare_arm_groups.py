"""The native fast paths of arming a request: ``_fabric.prepare_arm_groups`` against the
Python checks it stands in for (``Watcher._group_args``: the same arrays wherever it answers,
None where they refuse or it does not take the input), and ``_fabric.shift_pages`` against
numpy's broadcast of a page template (``PageTemplate.pair_writes``)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import _fabric
from kvxfer.engine.watcher import Watcher
from kvxfer.errors import KvxferError


class _Region:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _python(th, so, do, ln, starts, src_size, dst_size):
    try:
        return Watcher._group_args(th, _Region(src_size), _Region(dst_size), so, do, ln, starts)
    except KvxferError:
        return None


_big = st.one_of(st.integers(0, 1 << 12), st.integers((1 << 62) - 2, (1 << 62) + 2))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_big, _big, _big), max_size=10), st.lists(st.integers(-1, 12), max_size=6),
       st.lists(_big, max_size=6), st.integers(0, 1 << 13), st.integers(0, 1 << 13),
       st.sampled_from(["uint64", "int64"]), st.sampled_from(["int64", "uint64"]))
def test_it_agrees_with_the_python_checks(triples, starts, th, src_size, dst_size, tdtype, sdtype):
    so, do, ln = (np.array([t[k] for t in triples], dtype=np.uint64).astype(tdtype) for k in range(3))
    thr = np.array(th[:max(len(starts) - 1, 0)], np.uint64).astype(tdtype)
    stt = np.array(starts, np.int64).astype(sdtype)
    fast = _fabric.prepare_arm_groups(thr, so, do, ln, stt, src_size, dst_size)
    slow = _python(thr, so, do, ln, stt, src_size, dst_size)
    if fast is None:
        assert slow is None or tdtype != "uint64" or sdtype != "int64"
        return
    assert tdtype == "uint64" and sdtype == "int64" and slow is not None
    for a, b in zip(fast[:5], slow):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    total, sums = fast[5], fast[6]
    assert total == int(slow[3].sum())
    cs = np.concatenate([[0], np.cumsum(slow[3], dtype=np.uint64)])
    assert list(sums) == [int(cs[slow[4][g + 1]] - cs[slow[4][g]]) for g in range(len(slow[0]))]


def test_it_copies_what_it_checked():
    so = np.arange(4, dtype=np.uint64)
    st_ = np.array([0, 2, 4], np.int64)
    th = np.array([1, 2], np.uint64)
    out = _fabric.prepare_arm_groups(th, so, so, so, st_, 1 << 20, 1 << 20)
    so[:] = 1 << 40
    st_[:] = 0
    th[:] = 7
    assert out is not None and list(out[1]) == [0, 1, 2, 3] and list(out[4]) == [0, 2, 4] and list(out[0]) == [1, 2]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(0, 5), st.integers(0, 2**20), st.integers(0, 2**20), st.randoms())
def test_shift_pages_is_the_template_broadcast(m, n, ss, ds, rnd):
    so = np.array([rnd.randrange(1 << 30) for _ in range(m)], np.uint64)
    do = np.array([rnd.randrange(1 << 30) for _ in range(m)], np.uint64)
    sp = np.array([rnd.randrange(1 << 16) for _ in range(n)], np.int64)
    dp = np.array([rnd.randrange(1 << 16) for _ in range(n)], np.int64)
    order = np.array(rnd.sample(range(n * m), n * m), np.int64)
    a = (so[None, :] + (sp * ss)[:, None].astype(np.uint64)).ravel()[order]
    b = (do[None, :] + (dp * ds)[:, None].astype(np.uint64)).ravel()[order]
    out = _fabric.shift_pages(so, do, sp, dp, ss, ds, order)
    assert out is not None and np.array_equal(out[0], a) and np.array_equal(out[1], b)
    assert out[0].dtype == np.uint64


def test_shift_pages_declines_what_it_does_not_take():
    so = np.arange(3, dtype=np.uint64)
    sp = np.arange(2, dtype=np.int64)
    order = np.arange(6, dtype=np.int64)
    assert _fabric.shift_pages(so, so, sp.astype(np.int32), sp, 1, 1, order) is None     # not int64 pages
    assert _fabric.shift_pages(so, so, sp, sp[:1], 1, 1, order) is None                  # page counts differ
    assert _fabric.shift_pages(so, so, sp, sp, 1, 1, order[:5]) is None                  # not n * m
    assert _fabric.shift_pages(so, so, sp, sp, 1, 1, np.array([0, 1, 2, 3, 4, 6])) is None   # beyond the pairs
