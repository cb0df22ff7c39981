"""A write the target refuses must fail its own transfer, and only it: the peer stays usable
(issue 26 #2).

Fixed for the shm direct path, the issue's case: a copy the target's permit refuses (the region
closed) used to post its imm anyway, which the target refused too: 64 KiB with an imm stalled
until ``peer_timeout`` (``PeerError``) and left its source region unclosable, 4 KiB or no imm
reported ``done``. Now the refused copy fails its transfer at once (``EACCES``) and posts
nothing; the write behind it lands (``test_a_refused_direct_copy_fails_alone``, failing
before on all four cases).

NOT FIXED for RMA writes (``test_a_write_into_a_closed_region_fails_alone``, strict xfails,
so the fix turns them into failures to un-mark; docs/reliability.md, "What does not hold yet").

On libfabric 1.17 neither provider tells the sender of a refusal it can act on: shm refuses
silently (4 KiB, or 64 KiB without imm, report ``done``; 64 KiB with imm stalls until
``peer_timeout`` and its source region can no longer be closed), and tcp;ofi_rxm drops the
connection, failing the honest write posted right after the refused one. Direct writes into
a revoked region already fail alone (tests/fabric/test_direct_hostile.py)."""

import errno

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import KvxferError
from _data import pattern_array
from _target import Target

@pytest.mark.parametrize("imm", [None, 5])
@pytest.mark.parametrize("nbytes", [4096, 65536])
def test_a_refused_direct_copy_fails_alone(shm, nbytes, imm):
    n = 1 << 20
    src = pattern_array(n, 31, low=1)
    opts = {"peer_timeout": 2}
    with Target("shm", n, memory="memfd", options=opts) as tgt, kvxfer.Engine("shm", **opts) as eng:
        mr, peer, old = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        assert old.direct
        tgt.call("close")                          # the permit is revoked; the memfd stays
        new = eng.remote(tgt.call("register"))     # the same memory, the slot's next generation
        assert new.direct
        tgt.call("fill", 0)
        refused = eng.write(mr, 0, peer, old, 0, nbytes, imm=imm)
        honest = eng.write(mr, 0, peer, new, 0, 4096, imm=9)
        with pytest.raises(KvxferError) as ei:
            refused.wait(10)
        assert ei.value.errno == errno.EACCES
        honest.wait(10)                            # the peer stays usable
        tgt.expect(9, honest.num_writes)
        assert tgt.wait(9) == ("ok", honest.num_writes)
        got = tgt.memory()
        assert np.array_equal(got[:4096], src[:4096]) and not got[4096:].any()
        if imm is not None:
            assert tgt.call("banked", imm) == 0
        mr.close()                                 # nothing of the refused write is left in flight


@pytest.mark.xfail(strict=True, reason="issue 26 #2: a refused RMA write does not fail alone (1.17)")
@pytest.mark.parametrize("imm", [None, 5])
@pytest.mark.parametrize("nbytes", [4096, 65536])
def test_a_write_into_a_closed_region_fails_alone(provider, nbytes, imm):
    n = 1 << 20
    src = pattern_array(n, 30, low=1)
    opts = {"peer_timeout": 2}
    with Target(provider, n, options=opts) as tgt, kvxfer.Engine(provider, "127.0.0.1", **opts) as eng:
        mr, peer, old = eng.register(src), eng.connect(tgt.address), eng.remote(tgt.descriptor)
        tgt.call("close")                          # the target deregisters; the memory stays
        tgt.call("fill", 0)
        new = eng.remote(tgt.call("register"))     # the same memory, a new registration
        tgt.call("fill", 0)
        refused = eng.write(mr, 0, peer, old, 0, nbytes, imm=imm)
        honest = eng.write(mr, 0, peer, new, 0, 4096, imm=9)      # right behind it
        with pytest.raises(KvxferError):
            refused.wait(10)
        honest.wait(10)                            # the peer stays usable
        tgt.expect(9, honest.num_writes)
        assert tgt.wait(9) == ("ok", honest.num_writes)
        assert np.array_equal(tgt.call("read", 0, 4096), src[:4096].tobytes())
        if imm is not None:
            assert tgt.call("banked", imm) == 0
        mr.close()                                 # nothing of the refused write is left in flight
