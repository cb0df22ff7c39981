"""Wire formats and the message-count rule, without libfabric."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import wire
from kvxfer.errors import DescriptorError, InvalidArgumentError

providers = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
names = st.binary(min_size=1, max_size=300)


@given(providers, st.lists(names, min_size=1, max_size=8))
def test_address_round_trip(prov, ns):
    a = wire.Address(prov, tuple(ns))
    assert wire.Address.decode(a.encode()) == a


host_shares = st.builds(wire.HostShare, st.integers(1, 2**31 - 1), st.integers(0, 2**31 - 1),
                        st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**62))


@given(providers, st.integers(0, 2**63), st.integers(0, 2**62), st.booleans(), st.booleans(), st.booleans(),
       st.binary(min_size=8, max_size=8), st.one_of(st.none(), host_shares), st.data())
def test_descriptor_round_trip(prov, base, nbytes, virt, raw, dev, owner, share, data):
    key = st.binary(min_size=1, max_size=64) if raw else st.binary(min_size=8, max_size=8)
    keys = tuple(data.draw(st.lists(key, min_size=1, max_size=6)))
    d = wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner, share)
    blob = d.encode()
    assert wire.Descriptor.decode(blob) == d
    # version 1 wherever it suffices: what older peers read, byte for byte
    assert blob[3] == (1 if share is None else 2)
    if share is not None:
        assert blob[:3] + bytes([1, blob[4] & ~wire.FLAG_HOST_SHARE]) + blob[5:-32] == \
            wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner).encode()


permits = st.builds(wire.Permit, st.integers(0, 2**31 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                   st.integers(0, 2**28 - 1), st.integers(0, 2**32 - 1))


@given(providers, st.integers(0, 2**63), st.integers(0, 2**62), st.booleans(), st.booleans(), st.booleans(),
       st.binary(min_size=8, max_size=8), host_shares, permits, st.data())
def test_permitted_descriptor_round_trip(prov, base, nbytes, virt, raw, dev, owner, share, permit, data):
    """Version 3: a host share with its permit (docs/architecture.md, "Direct writes")."""
    key = st.binary(min_size=1, max_size=64) if raw else st.binary(min_size=8, max_size=8)
    keys = tuple(data.draw(st.lists(key, min_size=1, max_size=6)))
    permitted = dataclasses.replace(share, permit=permit)
    d = wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner, permitted)
    blob = d.encode()
    got = wire.Descriptor.decode(blob)
    assert got == d and got.host_share.permit == permit
    assert blob[3] == 3 and blob[4] & wire.FLAG_PERMIT and blob[4] & wire.FLAG_HOST_SHARE
    # the same bytes as version 2 plus 28 bytes of permit: the share's layout did not move
    assert blob[:3] + bytes([2, blob[4] & ~wire.FLAG_PERMIT]) + blob[5:-28] == \
        wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner, share).encode()


def test_older_descriptors_still_decode_without_a_permit():
    """Versions 1 and 2 decode as before: a share without a permit (its sender writes over RMA)."""
    share = wire.HostShare(1234, 7, 1, 99, 4096)
    v2 = wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=share).encode()
    v1 = wire.Descriptor("shm", 1, 2, (b"k" * 8,)).encode()
    assert (v1[3], v2[3]) == (1, 2)
    assert wire.Descriptor.decode(v2).host_share == share and share.permit is None
    assert wire.Descriptor.decode(v1).host_share is None
    assert wire.DESCRIPTOR_VERSIONS[:3] == (1, 2, 3)


def test_permit_is_checked():
    permit = wire.Permit(9, 1, 100, 5, 7)
    share = wire.HostShare(1234, 7, 1, 99, 4096, permit)
    d = bytearray(wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=share).encode())
    assert d[3] == 3
    for version, flags in ((2, d[4]),                                  # the permit flag in version 2
                           (3, d[4] & ~wire.FLAG_PERMIT),               # version 3 without its permit
                           (3, d[4] & ~wire.FLAG_HOST_SHARE)):         # a permit without a share
        e = bytearray(d)
        e[3], e[4] = version, flags
        with pytest.raises(DescriptorError, match="flags"):
            wire.Descriptor.decode(bytes(e))
    for at, bad in ((-28, 0xFF), (-24, 0xFF)):                        # fd beyond 2**31; slot beyond 2**28
        e = bytearray(d)
        e[at:at + 4] = bytes([bad]) * 4
        with pytest.raises(DescriptorError, match="permit"):
            wire.Descriptor.decode(bytes(e))
    for cut in range(1, 29):
        with pytest.raises(DescriptorError):
            wire.Descriptor.decode(bytes(d[:-cut]))
    with pytest.raises(InvalidArgumentError):
        wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=wire.HostShare(1, 7, 1, 99, 0,
                                                                         wire.Permit(2**31, 1, 1, 0, 0))).encode()
    with pytest.raises(InvalidArgumentError):
        wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=wire.HostShare(1, 7, 1, 99, 0,
                                                                         wire.Permit(3, 1, 1, 2**28, 0))).encode()


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_never_decodes_to_anything_but_an_error(blob):
    for codec in (wire.Address, wire.Descriptor):
        try:
            codec.decode(blob)
        except DescriptorError:
            pass


@settings(max_examples=200)
@given(st.data())
def test_every_truncation_and_extension_is_refused(data):
    d = wire.Descriptor("tcp;ofi_rxm", 0, 4096, (b"\x01" * 8, b"\x02" * 8), owner=b"ownerxyz").encode()
    cut = data.draw(st.integers(0, len(d) - 1))
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(d[:cut])
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(d + data.draw(st.binary(min_size=1, max_size=5)))


@settings(max_examples=200)
@given(st.data())
def test_every_truncation_and_extension_of_a_host_share_is_refused(data):
    d = wire.Descriptor("shm", 4096, 8192, (b"k" * 8,), True, owner=b"o" * 8,
                        host_share=wire.HostShare(1234, 7, 1, 99, 4096)).encode()
    cut = data.draw(st.integers(0, len(d) - 1))
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(d[:cut])
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(d + data.draw(st.binary(min_size=1, max_size=5)))


def test_host_share_is_checked():
    share = wire.HostShare(1234, 7, 1, 99, 4096)
    d = bytearray(wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=share).encode())
    assert d[3] == 2 and d[4] & wire.FLAG_HOST_SHARE
    d[3] = 1                              # the flag does not exist in version 1
    with pytest.raises(DescriptorError, match="flags"):
        wire.Descriptor.decode(bytes(d))
    d[3] = 2
    for at, bad in ((-32, 0), (-28, 0xFF)):   # pid 0; fd beyond 2**31
        e = bytearray(d)
        e[at:at + 4] = bytes([bad]) * 4
        with pytest.raises(DescriptorError, match="host share"):
            wire.Descriptor.decode(bytes(e))
    far = wire.Descriptor("shm", 1, 2**62, (b"k" * 8,), host_share=wire.HostShare(1, 7, 1, 99, 2**62 + 1))
    with pytest.raises(InvalidArgumentError):          # its end lies past any file offset (2**63)
        far.encode()
    with pytest.raises(InvalidArgumentError):
        wire.Descriptor("shm", 1, 2, (b"k" * 8,), host_share=wire.HostShare(0, 7, 1, 99, 0)).encode()


def test_version_and_flags_are_checked():
    d = bytearray(wire.Descriptor("shm", 1, 2, (b"k" * 8,)).encode())
    d[3] = 4
    with pytest.raises(DescriptorError, match="version"):
        wire.Descriptor.decode(bytes(d))
    d[3] = 1
    d[4] = 0x80
    with pytest.raises(DescriptorError, match="flags"):
        wire.Descriptor.decode(bytes(d))
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(wire.Descriptor("shm", 1, 2, (b"short",), raw=False).encode())


def _reference_count(so, do, ln, iov, max_write, pack_min):
    """The message rule written out byte by byte, independently of wire.count_writes."""
    segs = []
    for s, d, n in zip(so, do, ln):
        if segs and segs[-1][0] + segs[-1][2] == s and segs[-1][1] + segs[-1][2] == d:
            segs[-1][2] += n
        else:
            segs.append([s, d, n])
    msgs, cur = [], []
    for _, _, n in segs:
        while n > 0:
            if cur and (len(cur) == iov or sum(cur) == max_write):
                msgs.append(cur)
                cur = []
            if n < pack_min:
                if cur:
                    msgs.append(cur)
                msgs.append([n])
                cur = []
                n = 0
                continue
            take = min(max_write - sum(cur), n)
            cur.append(take)
            n -= take
    if cur:
        msgs.append(cur)
    assert all(len(m) <= iov and sum(m) <= max(max_write, max(m)) for m in msgs)
    return len(msgs)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_count_writes_matches_reference(data):
    k = data.draw(st.integers(0, 40))
    ln = data.draw(st.lists(st.integers(0, 3000), min_size=k, max_size=k))
    contiguous = data.draw(st.booleans())
    so = list(np.cumsum([0] + ln[:-1])) if contiguous and k else data.draw(
        st.lists(st.integers(0, 10**6), min_size=k, max_size=k))
    do = list(np.cumsum([0] + ln[:-1])) if data.draw(st.booleans()) and k else data.draw(
        st.lists(st.integers(0, 10**6), min_size=k, max_size=k))
    iov = data.draw(st.integers(1, 6))
    max_write = data.draw(st.sampled_from([1, 7, 100, 1024, 4096, 1 << 30]))
    pack_min = data.draw(st.sampled_from([0, 1, 65, 1000, 4097]))
    pack_min = min(pack_min, max_write)
    so, do = [int(x) for x in so], [int(x) for x in do]
    assert wire.count_writes(so, do, ln, iov, max_write, pack_min) == _reference_count(so, do, ln, iov, max_write,
                                                                                         pack_min)


@given(st.integers(0, 500), st.integers(1, 9))
def test_stripe_bounds_cover_in_order(n, rails):
    b = wire.stripe_bounds(n, rails)
    assert b[0] == 0 and b[-1] == n and len(b) == rails + 1
    sizes = np.diff(b)
    assert (sizes >= 0).all() and sizes.max() - sizes.min() <= 1


@given(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 10**7), st.integers(1, 8))
def test_split_write_covers_the_range(s, d, n, rails):
    so, do, ln = wire.split_write(s, d, n, rails)
    assert int(ln.sum()) == n
    assert int(so[0]) == s and int(do[0]) == d
    assert (so[1:] == so[:-1] + ln[:-1]).all() and (do[1:] == do[:-1] + ln[:-1]).all()


def test_count_writes_rejects_mismatched_arrays():
    with pytest.raises(InvalidArgumentError):
        wire.count_writes([0, 1], [0], [1, 1], 4, 100)
    with pytest.raises(InvalidArgumentError):
        wire.count_writes([0], [0], [1], 4, 0)
