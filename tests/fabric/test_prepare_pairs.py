"""``_fabric.prepare_pairs``, ``Engine.write_pairs``' native fast path, against the Python
checks it stands in for (``_Writes._pair_args``): the same arrays wherever it answers, and
None (the Python checks then decide) for anything they refuse or it does not take."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import _fabric
from kvxfer.engine.writes import _Writes
from kvxfer.errors import KvxferError


class _Pairs:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _python(so, do, ln, counts):
    try:
        return _Writes._pair_args(_Pairs(len(counts)), so, do, ln, counts)
    except KvxferError:
        return None


_big = st.one_of(st.integers(0, 1 << 20), st.integers((1 << 62) - 2, (1 << 62) + 2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_big, _big, _big), max_size=12), st.lists(st.integers(-2, 14), max_size=6),
       st.sampled_from(["uint64", "int64", "uint32"]), st.sampled_from(["int64", "uint64", "int32"]))
def test_it_agrees_with_the_python_checks(triples, counts, tdtype, cdtype):
    cols = [np.array([t[k] for t in triples], dtype=np.uint64) for k in range(3)]
    if tdtype != "uint64":
        cols = [c.astype(tdtype) for c in cols]     # wraps where it does not fit: still input
    c = np.array(counts, dtype=np.int64).astype(cdtype)
    fast = _fabric.prepare_pairs(*cols, c)
    slow = _python(*cols, c)
    if fast is None:
        # not taken: a dtype it does not read natively, or input the Python checks refuse
        assert slow is None or tdtype != "uint64" or cdtype != "int64"
        return
    assert tdtype == "uint64" and cdtype == "int64"
    assert slow is not None
    so, do, ln, starts, which, nbytes = fast
    for a, b in zip((so, do, ln, starts, which), slow[:5]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert nbytes == int(slow[2].sum())
    assert np.array_equal(np.diff(starts), slow[5])


def test_it_copies_the_triples():
    so = np.arange(4, dtype=np.uint64)
    out = _fabric.prepare_pairs(so, so, so, np.array([4], np.int64))
    so[:] = 99
    assert out is not None and list(out[0]) == [0, 1, 2, 3] and list(out[2]) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", ["strided", "2d", "list", "readonly"])
def test_shapes_it_does_not_take_or_takes_safely(bad):
    base = np.arange(8, dtype=np.uint64)
    c = np.array([4], np.int64)
    if bad == "strided":
        assert _fabric.prepare_pairs(base[::2], base[::2], base[::2], c) is None
    elif bad == "2d":
        assert _fabric.prepare_pairs(base.reshape(2, 4), base[:4], base[:4], c) is None
    elif bad == "list":
        assert _fabric.prepare_pairs([0, 1, 2, 3], base[:4], base[:4], c) is None
    else:
        ro = base[:4].copy()
        ro.flags.writeable = False
        out = _fabric.prepare_pairs(ro, ro, ro, c)
        assert out is not None and out[0].flags.writeable
