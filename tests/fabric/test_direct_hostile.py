"""Hostile descriptors on the direct-write path (src/direct.c): a peer that lies in a region's
host share about its offset, its length, its memfd or its permit (slot, generation, table)
must not make the sender copy anywhere but inside the memory the target registered for
remote writes, and a copy that is refused or skipped must fail its transfer, its imm never
counted. A share the target's own permit record does not vouch for is not mapped: the sender
writes over RMA, where the target's key check governs (docs/reliability.md, issue 26 #1).

Before the fix each test here failed: a shifted offset copied past the region, a longer
length copied past it too, a share naming the sender's own memfd and permit slot overwrote the
sender's own memory, and a stale or borrowed permit skipped the copies while the imm counted."""

import dataclasses
import errno

import numpy as np
import pytest

import kvxfer
from kvxfer import KVBuffer, wire
from kvxfer.errors import KvxferError
from _data import pattern_array
from _target import Target

N = 1 << 16


def _forge(blob: bytes, *, nbytes: int | None = None, **share) -> bytes:
    """The descriptor ``blob`` with its host share's fields (``permit`` too) replaced."""
    d = wire.Descriptor.decode(blob)
    s = dataclasses.replace(d.host_share, **share)
    return dataclasses.replace(d, host_share=s, nbytes=d.nbytes if nbytes is None else nbytes).encode()


def _permit(blob: bytes, **fields) -> wire.Permit:
    return dataclasses.replace(wire.Descriptor.decode(blob).host_share.permit, **fields)


@pytest.fixture
def hostile(shm):
    """A prefiller ``a`` and a decoder ``b`` in this process (shm). b's region is the middle
    third of a 3 N-byte memfd (``b_file``), so bytes past either end of it stay visible; a's
    source is a pattern, and a also holds a region of its own memfd (``victim``, registered
    for remote writes, so it has a host share and a permit slot of a's own table)."""
    a, b = kvxfer.Engine("shm"), kvxfer.Engine("shm")
    kv_b, kv_a = KVBuffer.allocate(3 * N), KVBuffer.allocate(N)
    try:
        b_file = kv_b.numpy()[: 3 * N]
        md = b.register(b_file[N: 2 * N])
        victim = a.register(kv_a)
        src = pattern_array(N, 26, low=1)
        ms = a.register(src)
        assert md.host_share is not None and md.host_share.permit is not None and victim.host_share is not None
        assert a.remote(md.descriptor()).direct            # the honest share is written directly
        yield a, b, ms, src, a.connect(b.address), md, b_file, victim, kv_a.numpy()[:N]
    finally:
        a.close()
        b.close()
        kv_a.close()
        kv_b.close()


def t_writes(a, dst, n):
    """The messages (imms) a write of n bytes into dst is."""
    return a.count_writes([0], [0], [n], region=dst)


def _write_counted(a, b, ms, peer, dst, dst_off, n, imm):
    """Write n bytes with imm; (the transfer's error or None, arrivals b banked)."""
    err = None
    t = a.write(ms, 0, peer, dst, dst_off, n, imm=imm)
    try:
        t.wait(10)
    except KvxferError as exc:
        err = exc
    return err, b.banked(imm)


@pytest.mark.parametrize("shift", [1024, -1024, 4096])
def test_a_shifted_offset_copies_nothing_outside_the_region(hostile, shift):
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    share = md.host_share
    dst = a.remote(_forge(md.descriptor(), offset=share.offset + shift))
    err, banked = _write_counted(a, b, ms, peer, dst, 0, N, imm=1)
    assert not b_file[:N].any() and not b_file[2 * N:].any()   # nothing past either end
    assert err is None and banked == t_writes(a, dst, N)
    assert np.array_equal(b_file[N: 2 * N], src)               # and all of it inside (RMA)
    assert not dst.direct                       # the target's record says where the region is


def test_a_longer_length_copies_nothing_past_the_region(hostile):
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    dst = a.remote(_forge(md.descriptor(), nbytes=2 * N))
    err, banked = _write_counted(a, b, ms, peer, dst, N, N, imm=2)     # past the registration
    assert not b_file.any()                     # the target's key check refused it
    assert banked == 0
    assert not dst.direct                       # the record holds N bytes, not 2 N


@pytest.mark.parametrize("permit_of", ["sender", "target"])
def test_a_share_naming_the_senders_own_memory_is_refused(hostile, permit_of):
    """The decoder names the prefiller's own memfd (a region the prefiller registered for
    remote writes), with the prefiller's own permit slot or with its own."""
    a, b, ms, src, peer, md, b_file, victim, victim_mem = hostile
    vs = victim.host_share
    permit = vs.permit if permit_of == "sender" else md.host_share.permit
    forged = _forge(md.descriptor(), pid=vs.pid, fd=vs.fd, dev=vs.dev, inode=vs.inode, offset=vs.offset,
                    permit=permit)
    dst = a.remote(forged)
    err, banked = _write_counted(a, b, ms, peer, dst, 0, N, imm=3)
    assert not victim_mem.any()                 # the sender's own memory is untouched
    assert err is None and np.array_equal(b_file[N: 2 * N], src)    # over RMA, into b's region
    assert not dst.direct


def test_a_share_naming_the_senders_permit_table_with_the_targets_memfd_is_refused(hostile):
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    forged = _forge(md.descriptor(), permit=victim.host_share.permit)
    assert not a.remote(forged).direct          # a's table names a, not b


def test_another_regions_permit_slot_is_refused(hostile):
    """The share borrows the slot (and generation) of another region of the target: when
    that region closes, the copies were skipped while the imm counted."""
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    with KVBuffer.allocate(N) as other:
        mo = b.register(other)
        forged = _forge(md.descriptor(), permit=mo.host_share.permit)
        dst = a.remote(forged)
        mo.close()
        err, banked = _write_counted(a, b, ms, peer, dst, 0, N, imm=4)
        if banked:                              # counted: then with its data
            assert np.array_equal(b_file[N: 2 * N], src)
        assert err is None and banked == t_writes(a, dst, N)
        assert not dst.direct                   # the slot's record is the other region's


@pytest.mark.parametrize("delta", [1, -1])
def test_a_wrong_generation_is_refused(hostile, delta):
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    f = md.host_share.permit
    dst = a.remote(_forge(md.descriptor(), permit=_permit(md.descriptor(), generation=(f.generation + delta) % 2**32)))
    err, banked = _write_counted(a, b, ms, peer, dst, 0, N, imm=5)
    if banked:
        assert np.array_equal(b_file[N: 2 * N], src)      # counted only with its data
    assert err is None and banked == t_writes(a, dst, N)
    assert not dst.direct


def test_a_copy_revoked_under_a_live_key_fails_and_never_counts(hostile):
    """The target revokes its permit word while its key stays registered (a lying or broken
    target): the copies are refused, so the transfer fails and its imm is never posted."""
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    dst = a.remote(md.descriptor())
    assert dst.direct
    b._permit.revoke(md.host_share.permit.slot, 0.0)          # the key still takes RMA writes
    before = a.stats()["direct_revoked"]
    err, banked = _write_counted(a, b, ms, peer, dst, 0, N, imm=6)
    assert isinstance(err, KvxferError) and getattr(err, "errno", None) == errno.EACCES, err
    assert banked == 0 and not b_file.any()
    assert a.stats()["direct_revoked"] == before + 1
    # the peer stays usable: an honest write over RMA lands and counts
    rma = a.remote(_forge(md.descriptor(), permit=None))
    err, banked = _write_counted(a, b, ms, peer, rma, 0, N, imm=7)
    assert err is None and banked == t_writes(a, rma, N) and np.array_equal(b_file[N: 2 * N], src)


def test_a_decoder_in_another_process_cannot_aim_at_the_senders_memory(shm):
    """The issue's case: a decoder process hands the prefiller a share naming the
    prefiller's own memfd and permit slot (every decoder holds the prefiller's handshake)."""
    with Target("shm", N, memory="memfd") as tgt, kvxfer.Engine("shm") as a, KVBuffer.allocate(N) as kv:
        victim = a.register(kv)
        src = pattern_array(N, 27, low=1)
        ms, peer = a.register(src), a.connect(tgt.address)
        vs = victim.host_share
        for permit in (vs.permit, wire.Descriptor.decode(tgt.descriptor).host_share.permit):
            forged = _forge(tgt.descriptor, pid=vs.pid, fd=vs.fd, dev=vs.dev, inode=vs.inode, offset=vs.offset,
                            permit=permit)
            dst = a.remote(forged)
            t = a.write(ms, 0, peer, dst, 0, N, imm=8)
            t.wait(10)
            assert not kv.numpy()[:N].any()     # the prefiller's own memory is untouched
            tgt.expect(8, t.num_writes)
            assert tgt.wait(8) == ("ok", t.num_writes)
            assert np.array_equal(tgt.memory(), src)
            assert not dst.direct
            tgt.call("fill", 0)


def test_a_slot_never_handed_out_is_refused(hostile):
    """Defence in depth (it held before too, by the empty record): a fresh slot starts revoked."""
    a, b, ms, src, peer, md, b_file, victim, _ = hostile
    free = b._permit_next + 3                                # never issued
    assert a.remote(_forge(md.descriptor(), permit=_permit(md.descriptor(), slot=free, generation=0))).direct is False
    assert b._permit.word(free) == 1 << 31                   # revoked, generation 0, no writers
