"""Descriptor version 4, the read keys of a readable region: Hypothesis round trips with and
without a host share and fence, reads-only descriptors (no write keys), the older versions'
bytes unchanged, and every malformed version 4 refused."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import wire
from kvxfer.errors import DescriptorError, InvalidArgumentError

providers = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
host_shares = st.builds(wire.HostShare, st.integers(1, 2**31 - 1), st.integers(0, 2**31 - 1),
                        st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**62))
fences = st.builds(wire.Permit, st.integers(0, 2**31 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                   st.integers(0, 2**28 - 1), st.integers(0, 2**32 - 1))


def _tail(keys):
    return bytes([len(keys)]) + b"".join(bytes([len(k)]) + k for k in keys)


@settings(deadline=None)      # a shared, loaded machine: a slow example is not a failure
@given(providers, st.integers(0, 2**63), st.integers(0, 2**62), st.booleans(), st.booleans(), st.booleans(),
       st.binary(min_size=8, max_size=8), st.one_of(st.none(), host_shares), st.one_of(st.none(), fences),
       st.booleans(), st.data())
def test_readable_descriptor_round_trip(prov, base, nbytes, virt, raw, dev, owner, share, fence, reads_only, data):
    key = st.binary(min_size=1, max_size=64) if raw else st.binary(min_size=8, max_size=8)
    keys = () if reads_only else tuple(data.draw(st.lists(key, min_size=1, max_size=6)))
    read_keys = tuple(data.draw(st.lists(key, min_size=1, max_size=6)))
    if share is not None and fence is not None:
        share = dataclasses.replace(share, fence=fence)
    d = wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner, share, read_keys)
    blob = d.encode()
    got = wire.Descriptor.decode(blob)
    assert got == d and got.readable and got.read_keys == read_keys and got.writable == (not reads_only)
    assert blob[3] == 4 and blob[4] & wire.FLAG_READABLE
    if not reads_only:
        # the older version's bytes plus the read keys: nothing else moved
        old = wire.Descriptor(prov, base, nbytes, keys, virt, raw, dev, owner, share).encode()
        assert blob[:3] + bytes([old[3], blob[4] & ~wire.FLAG_READABLE]) + blob[5:-len(_tail(read_keys))] == old
        assert blob.endswith(_tail(read_keys))


@settings(deadline=None)
@given(st.lists(st.binary(min_size=8, max_size=8), min_size=1, max_size=4), st.one_of(st.none(), host_shares),
       st.one_of(st.none(), fences))
def test_a_descriptor_without_read_keys_keeps_its_old_version(keys, share, fence):
    """Only a readable region's descriptor is version 4: every other one is written as before
    (1, 2 or 3), which older peers read."""
    if share is not None and fence is not None:
        share = dataclasses.replace(share, fence=fence)
    d = wire.Descriptor("tcp;ofi_rxm", 0, 4096, tuple(keys), host_share=share)
    blob = d.encode()
    assert blob[3] == (1 if share is None else 2 if share.permit is None else 3)
    assert not blob[4] & wire.FLAG_READABLE
    got = wire.Descriptor.decode(blob)
    assert got == d and not got.readable and got.read_keys == ()


def _v4(**kw):
    args = dict(provider="shm", base=1, nbytes=4096, keys=(b"w" * 8,), read_keys=(b"r" * 8, b"s" * 8))
    args.update(kw)
    return bytearray(wire.Descriptor(**args).encode())


def test_malformed_version_4_is_refused():
    d = _v4()
    cases = [
        (3, d[4]),                                   # read keys in version 3
        (4, d[4] & ~wire.FLAG_READABLE),             # version 4 without them
    ]
    for version, flags in cases:
        e = bytearray(d)
        e[3], e[4] = version, flags
        with pytest.raises(DescriptorError):
            wire.Descriptor.decode(bytes(e))
    for cut in range(1, 20):                         # every truncation of the read keys
        with pytest.raises(DescriptorError):
            wire.Descriptor.decode(bytes(d[:-cut]))
    with pytest.raises(DescriptorError, match="trailing"):
        wire.Descriptor.decode(bytes(d) + b"\0")
    e = bytearray(d)
    e[-18] = 0                                       # a readable flag with no read keys
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(bytes(e[:-18]) + b"\0")
    e = bytearray(d)
    e[-9] = 7                                        # a read key of 7 bytes (not raw)
    with pytest.raises(DescriptorError):
        wire.Descriptor.decode(bytes(e[:-1]))


def test_no_write_keys_only_with_read_keys():
    """A reads-only descriptor (version 4, no write keys) decodes; no version before 4 may
    carry no keys, and encoding a descriptor with no keys at all is refused."""
    ro = _v4(keys=())
    got = wire.Descriptor.decode(bytes(ro))
    assert got.keys == () and not got.writable and got.readable
    v1 = bytearray(wire.Descriptor("shm", 1, 4096, (b"w" * 8,)).encode())
    with pytest.raises(DescriptorError, match="no keys"):
        wire.Descriptor.decode(bytes(v1[:-10]) + b"\0")
    with pytest.raises(InvalidArgumentError):
        wire.Descriptor("shm", 1, 4096, ()).encode()
    with pytest.raises(DescriptorError, match="length"):     # a non-raw read key is 8 bytes
        wire.Descriptor.decode(wire.Descriptor("shm", 1, 4096, (b"w" * 8,), read_keys=(b"r" * 7,)).encode())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_version_4_garbage_is_only_ever_a_descriptor_error(junk):
    blob = b"KXM\x04" + junk
    try:
        wire.Descriptor.decode(blob)
    except DescriptorError:
        pass
