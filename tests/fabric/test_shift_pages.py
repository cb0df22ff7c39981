"""The native shift of a page template, ``_fabric.shift_pages``, against numpy's broadcast of
it (``PageTemplate.pair_writes``), and what it declines."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import _fabric


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
