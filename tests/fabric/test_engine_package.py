"""kvxfer.engine as a package: every name the one-module kvxfer.engine had is still importable
from it (the messenger, the CLI and users import some of its private ones too)."""

import importlib

import pytest

#: the module-level names of kvxfer/engine.py before it became a package
NAMES = ("Counter", "Engine", "PERMIT_SLOTS", "PERMIT_WAIT", "MAX_POLL_US", "MemoryRegion", "PREFERENCE", "Peer",
         "RegionPairs", "RemoteRegion", "Transfer", "WatchEntry", "Watcher", "_PermitSlot", "_MAX_TIMEOUT", "_U32",
         "_as_index", "_as_offsets", "_check_cpus", "_check_imm", "_check_nics", "_check_options", "_check_rail",
         "_check_timeout", "_check_watch", "_check_word", "_concat_index", "_message_limits", "_need_native",
         "_nonneg", "_open_rails", "_resolve_buffer", "_timeout", "_u64", "providers", "_fabric")


@pytest.mark.parametrize("name", NAMES)
def test_every_name_of_the_old_module_is_importable(name):
    engine = importlib.import_module("kvxfer.engine")
    assert getattr(engine, name) is not None or name == "_fabric"


def test_the_public_names_are_the_same_objects_as_kvxfers():
    import kvxfer
    import kvxfer.engine as engine

    for name in ("Engine", "Peer", "MemoryRegion", "RemoteRegion", "Transfer", "Counter", "providers"):
        assert getattr(kvxfer, name) is getattr(engine, name)
    assert set(engine.__all__) <= set(dir(engine))


def test_inf_means_no_deadline_and_calls_that_must_end_refuse_it():
    """One timeout parser (kvxfer._check.as_timeout): ``inf`` is ``None`` (no deadline) for a
    wait, and refused where the call must end (it was refused everywhere, as too long, while
    the messenger took it as no deadline)."""
    import math

    import numpy as np

    import kvxfer
    from kvxfer.errors import InvalidArgumentError

    with kvxfer.Engine("tcp;ofi_rxm", "127.0.0.1", peer_timeout=math.inf) as a, \
            kvxfer.Engine("tcp;ofi_rxm", "127.0.0.1") as b:
        assert a.peer_timeout is None
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        ms, md = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        c = b.expect(5, 1)
        t = a.write(ms, 0, peer, a.remote(md.descriptor()), 0, 64, imm=5)
        t.wait(math.inf)
        c.wait(math.inf)
        assert (dst == src).all()
        with pytest.raises(InvalidArgumentError):
            a.disconnect(peer, timeout=math.inf)
