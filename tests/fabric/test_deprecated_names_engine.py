"""The engine's names issue 22 renamed still work, each with a DeprecationWarning (the rest,
without the engine: tests/unit/test_deprecated_names.py). This file names the old names on
purpose: the rename codemod leaves it alone."""

import pytest

import kvxfer


def test_engine_fence_constants_warn():
    import kvxfer.engine as E
    with pytest.warns(DeprecationWarning, match="PERMIT_SLOTS"):
        assert E.FENCE_SLOTS == E.PERMIT_SLOTS
    with pytest.warns(DeprecationWarning, match="PERMIT_WAIT"):
        assert E.FENCE_WAIT == E.PERMIT_WAIT
    with pytest.raises(AttributeError):
        E.NoSuchName  # noqa: B018


def test_engine_stats_keep_the_old_key_with_a_warning():
    with kvxfer.Engine("tcp;ofi_rxm", "127.0.0.1") as e:
        st = e.stats()
        assert "direct_permit_stuck" in st and "direct_fence_stuck" not in st
        with pytest.warns(DeprecationWarning, match="direct_permit_stuck"):
            assert st["direct_fence_stuck"] == st["direct_permit_stuck"] == 0
        with pytest.raises(KeyError):
            st["no_such_stat"]
