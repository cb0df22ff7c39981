"""Hypothesis for the messenger's handshake and control-message codecs: round trips, and
random or mutated bytes never raise anything but kvxfer's errors."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger import _codec as C

from _strategies import controls  # tests/ is on sys.path (tests/conftest.py)

SECRET = b"0123456789abcdef-shared"


@given(controls(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_control_round_trip(m, tagged):
    secret = SECRET if tagged else None
    data = m.encode(secret)
    got = C.Control.decode(data, secret)
    m.reason = C.reason_bytes(m.reason).decode("utf-8")     # what travels (surrogates as ?)
    assert got == m


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=500, deadline=None)
def test_control_random_bytes(data, tagged):
    try:
        C.Control.decode(data, SECRET if tagged else None)
    except KvxferError:
        pass


@given(controls(), st.data())
@settings(max_examples=300, deadline=None)
def test_control_tampering_is_refused(m, data):
    """Any flipped byte of an authenticated message fails its tag; no tag, wrong secret too."""
    raw = bytearray(m.encode(SECRET))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(DescriptorError):
        C.Control.decode(bytes(raw), SECRET)
    with pytest.raises(DescriptorError):
        C.Control.decode(m.encode(b"another secret of 16+ bytes"), SECRET)
    with pytest.raises(DescriptorError):
        C.Control.decode(m.encode(None), SECRET)


def _handshake(layout, sharding, ranks, slots, cbytes, nregions=None):
    n = layout.num_regions
    regions = tuple(tuple(b"KXM" + bytes([1, r, i]) for i in range(n)) for r in ranks)
    return C.Handshake(uid=12345, address=b"\x01\x02addr", layout=layout, sharding=sharding, ranks=tuple(ranks),
                       provider="shm", iov=4, max_write=1 << 30, pack_min=65, rails=1, context_slots=slots,
                       context_bytes=cbytes, peer_timeout=2.5, regions=regions,
                       context=b"KXMctx" if slots else None)


layouts = st.one_of(
    st.builds(lambda L, h, d, p, n, o: KVLayout.vllm(L, h, d, p, n, "bfloat16", order=o),
              st.integers(1, 6), st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 64, 128]),
              st.integers(1, 32), st.integers(1, 10**6), st.sampled_from(["HND", "NHD"])),
    st.builds(lambda L, d, p, n: KVLayout.mla(L, d, p, n, "float16", layer_regions="layer_major"),
              st.integers(1, 6), st.integers(1, 600), st.integers(1, 32), st.integers(1, 1000)),
    st.builds(lambda L, h: KVLayout.sglang(L, h, 64, 16, 100, "float16"), st.integers(1, 4), st.sampled_from([2, 4])),
)


@given(layouts, st.integers(0, 2), st.integers(0, 64), st.integers(0, 4096), st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_handshake_round_trip(layout, tp_log, slots, cbytes, replicated, tagged):
    sharding = Sharding(2**tp_log, replicated=replicated or layout.kv == "mla")
    if not replicated and layout.kv != "mla" and layout.kv_heads % sharding.tp_size and \
            sharding.tp_size % layout.kv_heads:
        return
    hs = _handshake(layout, sharding, range(sharding.tp_size), slots, cbytes)
    secret = SECRET if tagged else None
    got = C.Handshake.decode(hs.encode(secret), secret)
    assert got == hs


@given(st.binary(max_size=400), st.booleans())
@settings(max_examples=500, deadline=None)
def test_handshake_random_bytes(data, tagged):
    try:
        C.Handshake.decode(data, SECRET if tagged else None)
    except KvxferError:
        pass


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_handshake_mutations(data):
    """Byte flips, truncations and edited JSON fields never crash the decoder."""
    hs = _handshake(KVLayout.vllm(2, 4, 64, 16, 100), Sharding(2), (0, 1), 4, 100)
    raw = bytearray(hs.encode())
    op = data.draw(st.sampled_from(["flip", "cut", "json"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    elif op == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    else:
        import json
        import struct

        (hl,) = struct.unpack_from("<I", raw, 5)
        h = json.loads(raw[9:9 + hl])
        key = data.draw(st.sampled_from(sorted(h)))
        h[key] = data.draw(st.one_of(st.none(), st.integers(-5, 2**70), st.text(max_size=5), st.booleans(),
                                     st.lists(st.integers(-3, 5), max_size=3), st.floats(allow_nan=True)))
        body = json.dumps(h).encode()
        raw = raw[:5] + struct.pack("<I", len(body)) + body + raw[9 + hl:]
    try:
        C.Handshake.decode(bytes(raw))
    except KvxferError:
        pass


def test_handshake_refusals():
    hs = _handshake(KVLayout.vllm(2, 4, 64, 16, 100), Sharding(2), (0, 1), 0, 0)
    raw = hs.encode()
    with pytest.raises(DescriptorError, match="version"):
        C.Handshake.decode(raw[:4] + b"\x02" + raw[5:])
    with pytest.raises(DescriptorError, match="authentication"):
        C.Handshake.decode(raw, SECRET)            # untagged blob where a secret is required
    with pytest.raises(DescriptorError, match="authentication"):
        C.Handshake.decode(hs.encode(b"a different secret!!"), SECRET)
    with pytest.raises(DescriptorError):
        C.Handshake.decode(hs.encode(SECRET))      # a tag where none is expected: trailing bytes
    import dataclasses

    short = dataclasses.replace(hs, regions=hs.regions[:1])      # ranks (0, 1), regions of one rank
    with pytest.raises(DescriptorError, match="descriptors"):
        C.Handshake.decode(short.encode())


def test_request_id_kinds():
    for rid in ("a", "é" * 10, b"\x00\xff", 0, -1, 2**64, -2**100):
        enc = C.encode_request_id(rid)
        assert C.decode_request_id(enc) == (rid, len(enc))
    for bad in (True, 1.5, None, ("a",), "x" * 300):
        with pytest.raises(KvxferError):
            C.encode_request_id(bad)


# -- reasons (REJECT, and ABORTED of a rejection after posting) and items ------------------------

def _rejection(t, reason):
    if t == C.REJECT:
        return C.Control(C.REJECT, 1, 2, 3, imm=9, reason=reason)
    return C.Control(C.ABORTED, 1, 2, 3, imm=9, count=17, flags=C.ABORTED_BY_PREFILLER | C.ABORTED_REJECTED,
                     reason=reason)


@given(st.sampled_from([C.REJECT, C.ABORTED]), st.text(max_size=1500), st.booleans())
@settings(max_examples=300, deadline=None)
def test_reason_round_trip_is_bounded_and_cut_at_a_character(t, reason, tagged):
    """Any text travels as its UTF-8, at most MAX_REASON bytes, cut only before a character
    that does not fit whole: what arrives is a prefix of the text (lone surrogates as ?)."""
    secret = SECRET if tagged else None
    got = C.Control.decode(_rejection(t, reason).encode(secret), secret).reason
    whole = reason.encode("utf-8", "replace")
    sent = got.encode("utf-8")
    assert len(sent) <= C.MAX_REASON
    assert whole.startswith(sent)
    assert len(sent) == len(whole) or len(sent) > C.MAX_REASON - 4   # at most one character cut off
    assert got == C.reason_bytes(reason).decode("utf-8")


@given(st.sampled_from([C.REJECT, C.ABORTED]), st.text(max_size=300), st.data())
@settings(max_examples=300, deadline=None)
def test_reason_cut_short_or_extended_is_refused(t, reason, data):
    """Every proper prefix of a rejection, and any bytes appended to it, is refused with
    DescriptorError (the reason's length says where it ends)."""
    raw = _rejection(t, reason).encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DescriptorError):
        C.Control.decode(raw[:cut])
    with pytest.raises(DescriptorError):
        C.Control.decode(raw + data.draw(st.binary(min_size=1, max_size=8)))


@given(st.sampled_from([C.REJECT, C.ABORTED]), st.binary(min_size=1, max_size=64))
@settings(max_examples=300, deadline=None)
def test_reason_garbage_is_refused_precisely(t, junk):
    """A reason that is not UTF-8, or whose length exceeds MAX_REASON, is refused by name."""
    head = _rejection(t, "").encode()[:-2]              # everything before the reason's length
    try:
        junk.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(DescriptorError, match="reason is not UTF-8"):
            C.Control.decode(head + C.pack_item(junk))
    long = head + struct.pack("<H", C.MAX_REASON + 1) + b"a" * (C.MAX_REASON + 1)
    with pytest.raises(DescriptorError, match=f"reason is {C.MAX_REASON + 1} bytes; at most {C.MAX_REASON}"):
        C.Control.decode(long)


def test_aborted_without_rejection_carries_no_reason():
    m = C.Control(C.ABORTED, 1, 2, 3, imm=9, count=4, flags=C.ABORTED_BY_PREFILLER, reason="not sent")
    raw = m.encode()
    assert b"not sent" not in raw
    assert C.Control.decode(raw).reason == ""
    with pytest.raises(DescriptorError, match="ABORTED payload"):
        C.Control.decode(raw + C.pack_item(b"x"))      # a reason without the flag: trailing bytes


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=20), st.data())
@settings(max_examples=200, deadline=None)
def test_items_round_trip_and_truncation(items, data):
    """The one length-prefixed list parser (handshake descriptor table, region table)."""
    raw = b"".join(C.pack_item(b) for b in items)
    assert C.read_items(raw, 0, len(items), "x") == (items, len(raw))
    if raw:
        with pytest.raises(DescriptorError, match="x is truncated"):
            C.read_items(raw[:data.draw(st.integers(0, len(raw) - 1))], 0, len(items), "x")
    with pytest.raises(DescriptorError, match="x is empty"):
        C.read_items(raw + C.pack_item(b""), 0, len(items) + 1, "x")
    with pytest.raises(InvalidArgumentError):
        C.pack_item(b"a" * 65536)
