"""The context blob (``pack_context``/``unpack_context``): round trips of named arrays of
any dtype and shape (hypothesis), zero-copy read-only views, and garbage refused with
``DescriptorError`` only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvxfer.errors import DescriptorError, InvalidArgumentError
from kvxfer.messenger.context import pack_context, unpack_context

_dtypes = st.sampled_from(["<f2", "<f4", "<i8", "|u1", "<u2", "<c8"])
_arrays = _dtypes.flatmap(lambda d: hnp.arrays(np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)))
_names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(lambda s: len(s.encode()) < 200)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_names, _arrays, min_size=1, max_size=4))
def test_round_trip(arrays):
    blob = pack_context(**arrays)
    got = unpack_context(blob)
    assert list(got) == list(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape
        assert got[k].tobytes() == np.ascontiguousarray(a).tobytes()
        assert not got[k].flags.writeable


def test_hidden_state_of_a_large_model_fits_a_slot_and_is_a_view():
    hidden = np.arange(7168, dtype=np.uint16)           # bf16 bits
    blob = pack_context(hidden=hidden, token=np.array([42], np.int64))
    assert len(blob) < 7168 * 2 + 128
    slot = bytearray(blob)
    got = unpack_context(memoryview(slot))
    assert np.array_equal(got["hidden"], hidden) and got["token"][0] == 42
    assert got["hidden"].base is not None                   # a view of the slot, not a copy


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_raises_only_descriptor_error(data):
    try:
        unpack_context(data)
    except DescriptorError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutations_raise_only_descriptor_error(data):
    blob = bytearray(pack_context(a=np.arange(10, dtype="<f4"), b=np.ones((2, 3), "<i2")))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        unpack_context(bytes(blob[:cut]))
    except DescriptorError:
        pass


def test_refusals():
    with pytest.raises(InvalidArgumentError):
        pack_context()
    with pytest.raises(InvalidArgumentError):
        pack_context(x=np.array([object()]))
    with pytest.raises(DescriptorError):
        unpack_context(b"KXC2" + bytes(8))
