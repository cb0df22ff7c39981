"""Hypothesis for the pull road's codecs (kvxfer/messenger/_pullcodec.py, control messages
version 3): EXPOSE and DONE round trips, every truncation and junk flag refused with
``DescriptorError``, a version 2 message refused; the handshake of a messenger offering pull
(its reads-only descriptor table) round trips, and a table of the wrong size is refused.
The general round trip of every type (tests/_strategies.py ``controls``) is test_codec.py's."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import DescriptorError, InvalidArgumentError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P

from _strategies import rids  # tests/ is on sys.path (tests/conftest.py)

SECRET = b"0123456789abcdef-shared"
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def pull_messages(draw):
    if draw(st.booleans()):
        return C.Control(C.EXPOSE, draw(u64), draw(u64), draw(u64), imm=draw(u32), num_tokens=draw(u64),
                         count=draw(u64), request_id=draw(rids),
                         pages=np.array(draw(st.lists(u32, max_size=64)), np.int64))
    return C.Control(C.DONE, draw(u64), draw(u64), draw(u64), imm=draw(u32), flags=draw(st.integers(0, 3)))


@given(pull_messages(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_round_trip(m, tagged):
    secret = SECRET if tagged else None
    assert C.Control.decode(m.encode(secret), secret) == m


@given(pull_messages())
@settings(max_examples=100, deadline=None)
def test_every_truncation_is_refused(m):
    data = m.encode()
    for n in range(len(data)):
        with pytest.raises(DescriptorError):
            C.Control.decode(data[:n])
    with pytest.raises(DescriptorError):
        C.Control.decode(data + b"\0")           # and one byte too many


@given(st.integers(4, 255), u32)
def test_done_with_unknown_flags_is_refused(flags, imm):
    raw = struct.pack("<2sBBQQQ", b"KC", C.CONTROL_VERSION, C.DONE, 1, 2, 3) + struct.pack("<IB", imm, flags)
    with pytest.raises(DescriptorError, match="unknown flags"):
        C.Control.decode(raw)
    with pytest.raises(InvalidArgumentError):
        C.Control(C.DONE, 1, 2, 3, imm=imm, flags=flags).encode()


def test_request_flags_and_version():
    m = C.Control(C.REQUEST, 1, 2, 3, imm=5, num_tokens=9, request_id="r", pages=np.array([1]),
                  flags=P.REQUEST_PULL)
    data = bytearray(m.encode())
    assert C.Control.decode(bytes(data)).flags == P.REQUEST_PULL
    data[-1] = 2                                   # the flags byte (no meta): unknown
    with pytest.raises(DescriptorError, match="unknown flags"):
        C.Control.decode(bytes(data))
    data[2] = 2                                    # a version 2 peer
    with pytest.raises(DescriptorError, match="version 2"):
        C.Control.decode(bytes(data))


def test_expose_page_count_must_match():
    m = C.Control(C.EXPOSE, 1, 2, 3, imm=5, num_tokens=9, count=1, request_id=7, pages=np.array([1, 2, 3]))
    data = bytearray(m.encode())
    struct.pack_into("<I", data, 28 + 20, 4)       # header 28 bytes; claims 4 pages, carries 3
    with pytest.raises(DescriptorError, match="page list"):
        C.Control.decode(bytes(data))
    with pytest.raises(InvalidArgumentError, match="at most"):
        C.Control(C.EXPOSE, 1, 2, 3, request_id=1, pages=np.zeros(C.MAX_PAGES + 1)).encode()


def _handshake(ranks, slots, reads):
    layout, sharding = KVLayout.vllm(2, 4, 8, 16, 32, "float16"), Sharding(2)
    n = layout.num_regions
    regions = tuple(tuple(b"W" + bytes([r, i]) for i in range(n)) for r in ranks)
    read_regions = tuple(tuple(b"R" + bytes([r, i]) for i in range(n)) for r in ranks) if reads else ()
    return C.Handshake(uid=9, address=b"\x01addr", layout=layout, sharding=sharding, ranks=tuple(ranks),
                       provider="shm", iov=4, max_write=1 << 20, pack_min=65, rails=1, context_slots=slots,
                       context_bytes=16 if slots else 0, peer_timeout=2.0, regions=regions,
                       context=b"ctx" if slots else None, read_regions=read_regions)


@pytest.mark.parametrize("ranks", [(0,), (1,), (0, 1)])
@pytest.mark.parametrize("slots", [0, 3])
@pytest.mark.parametrize("reads", [False, True])
@pytest.mark.parametrize("secret", [None, SECRET])
def test_handshake_with_a_reads_table_round_trips(ranks, slots, reads, secret):
    hs = _handshake(ranks, slots, reads)
    got = C.Handshake.decode(hs.encode(secret), secret)
    assert got == hs
    assert bool(got.read_regions) == reads and all(d[:1] == b"R" for rr in got.read_regions for d in rr)


def test_handshake_reads_field_and_table_must_agree():
    hs = _handshake((0, 1), 0, True)
    blob = hs.encode()
    # drop the reads field from the header: the table then has twice the descriptors expected
    bad = blob.replace(b',"reads":1', b"")
    bad = bad[:5] + struct.pack("<I", struct.unpack_from("<I", blob, 5)[0] - len(b',"reads":1')) + bad[9:]
    with pytest.raises(DescriptorError, match="descriptors"):
        C.Handshake.decode(bad)
    bad2 = blob.replace(b'"reads":1', b'"reads":2')
    with pytest.raises(DescriptorError, match="unknown fields"):
        C.Handshake.decode(bad2)
    with pytest.raises(InvalidArgumentError, match="every rank"):
        C.Handshake(**{**hs.__dict__, "read_regions": hs.read_regions[:1]}).encode()
