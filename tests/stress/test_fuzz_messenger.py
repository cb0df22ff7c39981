"""Hostile input for the messenger (issue 12), fed by Hypothesis: its decoders (control
messages, handshake blobs, request ids, context blobs, region tables) and its public entry
points (``Messenger(...)`` options, ``connect``, ``receive``, ``send``/``finish``,
``stream``/``schedule``, the ``Receive``/``Send``/``LayerCounter`` methods, and control
messages a rogue engine sends over the fabric). Only kvxfer.errors come out (each also the
built-in its class promises), valid values round-trip, and a refused call changes nothing
observable: no request left pending, no page busy, no context slot taken, counters unchanged,
nothing written. KVXFER_STRESS=1: 20,000 examples per test (over 100,000 in all; the
constructor test 2,000); KVXFER_FUZZ_EXAMPLES=n sets the count."""

from __future__ import annotations

import builtins
import collections
import json
import os
import struct
import threading
import time
from types import SimpleNamespace

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvxfer
import _strategies
from conftest import STRESS
from kvxfer import KVLayout, Sharding, errors
from kvxfer.messenger import (
    RegionTable,
    Pass,
    PeerGroup,
    Receive,
    RemoteRegionTable,
    Send,
    pack_context,
    pages_completed,
    register_layout,
    remote_layout,
    unpack_context,
)
from kvxfer.messenger import _codec as C

N = int(os.environ.get("KVXFER_FUZZ_EXAMPLES") or (20_000 if STRESS else 150))
pytestmark = pytest.mark.timeout(0 if STRESS else 120)   # pytest-timeout would cut Hypothesis short
fuzz = settings(max_examples=N, deadline=None, derandomize=not STRESS, database=None,
                suppress_health_check=list(HealthCheck))

SECRET = b"fuzz-secret-0123456789"
OTHER = b"another secret, 16+ bytes"
LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")
SH = Sharding(1)
POISON = 0xEE

# -- the rule every call obeys ----------------------------------------------------------------

_BUILTIN = {errors.FabricError: OSError, errors.UnsupportedError: NotImplementedError,
            errors.ArgumentTypeError: TypeError, errors.InvalidArgumentError: ValueError,
            errors.OutOfBoundsError: IndexError, errors.DescriptorError: ValueError,
            errors.PeerError: ConnectionError, errors.TimeoutError: builtins.TimeoutError,
            errors.ClosedError: RuntimeError, errors.LayoutError: ValueError, errors.PlanError: ValueError,
            errors.TopologyError: ValueError, errors.BufferError: builtins.BufferError}
CALLS: collections.Counter = collections.Counter()


def _call(expect, fn, *args, **kw):
    """``fn(*args, **kw)``'s result, or the kvxfer error it raised, which must be one of
    ``expect`` and also the built-in its class promises. Anything else fails the test."""
    CALLS["calls"] += 1
    try:
        return fn(*args, **kw)
    except errors.KvxferError as exc:
        kind = next((k for k in type(exc).__mro__ if k in _BUILTIN), None)
        assert kind is not None, f"a bare {type(exc).__name__} subclasses no built-in: {exc}"
        assert isinstance(exc, _BUILTIN[kind]), type(exc)
        assert isinstance(exc, expect), f"{getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {exc}"
        return exc


def _refused(r) -> bool:
    return isinstance(r, errors.KvxferError)


@pytest.fixture(scope="module", autouse=True)
def _figures(request):
    """Examples and calls per test, printed at the end (the figures of docs/reliability.md)."""
    figs = {}
    yield figs
    lines = [f"{name}: {ex} examples, {calls} calls, {secs:.1f} s" for name, (ex, calls, secs) in figs.items()]
    lines.append(f"total: {sum(f[0] for f in figs.values())} examples, {sum(f[1] for f in figs.values())} calls, "
                 f"{sum(f[2] for f in figs.values()):.1f} s; accepted: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(CALLS.items()) if k.startswith("ok_")))
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
        for line in lines:
            tr.write_line("fuzz_messenger " + line)


@pytest.fixture(autouse=True)
def _per_test(request, _figures):
    c0, e0, t0 = CALLS["calls"], CALLS["examples"], time.monotonic()
    yield
    _figures[request.node.name] = (CALLS["examples"] - e0, CALLS["calls"] - c0, time.monotonic() - t0)


def _example():
    """One example done (every assertion held)."""
    CALLS["examples"] += 1


# -- strategies -----------------------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"]),
                     min_size=1, max_size=3)
rids = st.one_of(st.text(max_size=40), st.binary(max_size=60), st.integers(-2**200, 2**200), surrogates)
# junk of every type; flag_junk lacks numpy arrays (whose truth value raises: not for flags)
flag_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), surrogates, st.binary(max_size=16), st.binary(max_size=8).map(bytearray),
    st.lists(st.integers(-5, 5), max_size=4), st.tuples(st.integers(-2**65, 2**65), st.integers(-2**65, 2**65)),
    st.dictionaries(st.integers(-2, 2), st.integers(-2, 2), max_size=2),
    st.just(np.int64(-1)), st.just(np.uint64(2**63)), st.just(np.float32(1.5)), st.just(object()),
    st.just(memoryview(b"xyz")),
)
junk = st.one_of(flag_junk, st.just(np.arange(3)), st.just(np.zeros((2, 2), np.int32)),
                 st.just(np.arange(10)[::2]), st.just(np.array(["a"])))


def _mostly(valid, bad, odds: int = 3):
    """``valid`` ``odds`` times in ``odds + 1``, else ``bad`` (st.one_of would flatten
    ``bad``'s many branches and drown ``valid``)."""
    return st.integers(0, odds).flatmap(lambda k: bad if k == 0 else valid)


def _bitflips(blob: bytes, flips) -> bytes:
    b = bytearray(blob)
    for i, bit in flips:
        b[i] ^= 1 << bit
    return bytes(b)


def _mutations(blob: bytes, extra: int = 300):
    """A valid encoding with bits flipped, bytes changed, cut, extended, spliced or replaced."""
    n = len(blob)
    return st.one_of(
        st.binary(max_size=extra),
        st.tuples(st.integers(0, n - 1), st.integers(1, 255)).map(
            lambda t: blob[:t[0]] + bytes([blob[t[0]] ^ t[1]]) + blob[t[0] + 1:]),
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)), min_size=1, max_size=8).map(
            lambda f: _bitflips(blob, f)),
        st.integers(0, n - 1).map(lambda k: blob[:k]),
        st.binary(min_size=1, max_size=40).map(lambda x: blob + x),
        st.tuples(st.integers(0, n), st.binary(max_size=40)).map(lambda t: blob[:t[0]] + t[1]),
        st.tuples(st.integers(0, n), st.integers(0, n), st.binary(max_size=8)).map(
            lambda t: blob[:min(t[:2])] + t[2] + blob[max(t[:2]):]),
    )


def controls(**kw):
    """_strategies.controls with this file's request ids (surrogates too) and REJECT reasons
    long enough to be cut at 1 KiB."""
    kw.setdefault("request_ids", rids)
    kw.setdefault("reasons", st.one_of(st.text(max_size=100), st.text(min_size=1020, max_size=1030)))
    return _strategies.controls(**kw)


def _as_sent(m: C.Control) -> C.Control:
    """``m`` as its receiver decodes it: a REJECT's reason (an ABORTED's, flagged REJECTED) is
    at most 1,024 bytes of UTF-8."""
    if m.type == C.REJECT or (m.type == C.ABORTED and m.flags & C.ABORTED_REJECTED):
        m.reason = C.reason_bytes(m.reason).decode("utf-8")       # the codec's own cut, at a character
    return m


def _reencodes(m: C.Control, secret) -> None:
    """A decoded message encodes again, and that decodes to the same message."""
    again = C.Control.decode(m.encode(secret), secret)
    if m.type == C.REJECT or (m.type == C.ABORTED and m.flags & C.ABORTED_REJECTED):
        assert isinstance(again.reason, str)
        again.reason = m.reason        # replacement characters may grow past the 1,024 bytes
    assert again == m


def _same(a, b) -> bool:
    """Two outcomes agree: equal values, or errors of one class with one message."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


# -- codecs (no fabric) ------------------------------------------------------------------------

@fuzz
@given(controls(), st.sampled_from([None, SECRET]), st.data())
def test_control_messages(m, secret, data):
    raw = m.encode(secret)
    assert C.Control.decode(raw, secret) == _as_sent(m)                       # round trip
    bad = data.draw(_mutations(raw), label="tampered")
    r = _call(errors.DescriptorError, C.Control.decode, bad, secret)
    if secret is not None and bad != raw:
        assert _refused(r), "a changed message passed its authentication tag"
    if isinstance(r, C.Control):
        CALLS["ok_control_tampered"] += 1
        _reencodes(r, secret)
    # an insider holding the secret: behind a good tag the parser sees what it sees without one
    body = data.draw(_mutations(m.encode(None)), label="body")
    a = _call(errors.DescriptorError, C.Control.decode, C._seal(body, SECRET), SECRET)
    b = _call(errors.DescriptorError, C.Control.decode, body, None)
    assert _same(a, b), (a, b)
    if isinstance(a, C.Control):
        CALLS["ok_control_insider"] += 1
        _reencodes(a, SECRET)
    # a tag made with another secret, or none, is refused where a secret is set
    for wrong in (m.encode(OTHER), m.encode(None)):
        assert "authentic" in str(_call(errors.DescriptorError, C.Control.decode, wrong, SECRET))
    if m.type not in (C.HELLO, C.REJECT):        # their payloads take any tail: the tag is data there
        assert _refused(_call(errors.DescriptorError, C.Control.decode, m.encode(SECRET), None))
    r = _call(errors.DescriptorError, C.Control.decode, data.draw(st.one_of(junk, st.binary(max_size=300))),
              data.draw(st.sampled_from([None, SECRET])))
    if isinstance(r, C.Control):
        _reencodes(r, None)
    _example()

def _handshake(layout, sharding, ranks, slots, cbytes, uid=12345, provider="shm"):
    n = layout.num_regions
    regions = tuple(tuple(b"KXM" + bytes([1, r, i]) for i in range(n)) for r in ranks)
    return C.Handshake(uid=uid, address=b"\x01\x02addr", layout=layout, sharding=sharding, ranks=tuple(ranks),
                       provider=provider, iov=4, max_write=1 << 30, pack_min=65, rails=1, context_slots=slots,
                       context_bytes=cbytes, peer_timeout=2.5, regions=regions,
                       context=b"KXMctx" if slots else None)


HANDSHAKES = [
    _handshake(KVLayout.vllm(2, 4, 64, 16, 100), Sharding(2), (0, 1), 4, 100),
    _handshake(KVLayout.mla(3, 576, 16, 50, "float16", layer_regions="layer_major"), Sharding(2, replicated=True),
               (1,), 0, 0),
    _handshake(KVLayout.sglang(1, 2, 64, 16, 100, "float16"), Sharding(1), (0,), 1, 8),
]
def _json_nest(c):
    return st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c, max_size=3))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(0, 8),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
              st.sampled_from(["float16", "HND", "NHD", "mha", "mla", "per_layer", "layer_major", "shm", "00ff"])),
    _json_nest, max_leaves=6)


# numeric header fields and values a valid blob may hold: tweaked, the blob often stays valid
TWEAKS = {(None, "uid"): st.integers(1, 2**64 - 1), (None, "peer_timeout"): st.floats(1e-3, 999_999.0),
          ("engine", "iov"): st.integers(1, 1024), ("engine", "max_write"): st.integers(1, 2**64 - 1),
          ("engine", "pack_min"): st.integers(0, 2**64 - 1), ("engine", "rails"): st.integers(1, 255),
          ("layout", "num_pages"): st.integers(1, 10**6), ("layout", "page_size"): st.integers(1, 64),
          ("layout", "head_dim"): st.integers(1, 1024), ("layout", "kv_heads"): st.integers(1, 16),
          ("layout", "num_layers"): st.integers(1, 4), (None, "address"): st.binary(max_size=40).map(bytes.hex)}


@st.composite
def edited_headers(draw, raw: bytes):
    """The blob with one JSON header field tweaked within its range, set to another value,
    deleted or added."""
    (hl,) = struct.unpack_from("<I", raw, 5)
    h = json.loads(raw[9:9 + hl])
    if draw(st.booleans()):
        sub, key = draw(st.sampled_from(sorted(TWEAKS, key=str)))
        (h if sub is None else h[sub])[key] = draw(TWEAKS[sub, key])
    else:
        sub = draw(st.sampled_from([None, "layout", "engine"]))
        obj = h if sub is None else h[sub]
        key = draw(st.one_of(st.sampled_from(sorted(obj)), st.text(max_size=4)))
        if draw(st.integers(0, 5)) == 0:
            obj.pop(key, None)
        else:
            obj[key] = draw(json_values)
    body = json.dumps(h).encode()
    return raw[:5] + struct.pack("<I", len(body)) + body + raw[9 + hl:]


HS_ERRORS = (errors.DescriptorError, errors.LayoutError)


def _insider(body: bytes):
    """What a holder of the secret makes of a version 1 body (edited or not): version 2, its
    descriptor table encrypted and the whole sealed; None where the body has no table where
    version 1 puts it (magic, version byte or header length edited)."""
    if len(body) < 9 or body[:4] != C.HANDSHAKE_MAGIC or body[4] != C.HANDSHAKE_VERSION:
        return None
    (hl,) = struct.unpack_from("<I", body, 5)
    if 9 + hl > len(body):
        return None
    head = body[:4] + bytes([C.HANDSHAKE_SEALED_VERSION]) + body[5:9 + hl]
    return C._seal(head + C._encrypt_table(SECRET, body[9 + hl:], head), SECRET)


@fuzz
@given(st.sampled_from(HANDSHAKES), st.sampled_from([None, SECRET]), st.data())
def test_handshake_blobs(hs, secret, data):
    raw = hs.encode(secret)
    assert C.safe_decode_handshake(raw, secret) == hs                         # round trip
    bad = data.draw(_mutations(raw, 600), label="tampered")
    r = _call(HS_ERRORS, C.safe_decode_handshake, bad, secret)
    if secret is not None and bad != raw:
        assert _refused(r), "a changed handshake passed its authentication tag"
    if isinstance(r, C.Handshake):
        assert C.Handshake.decode(r.encode(secret), secret) == r
    # edited by an insider holding the secret (tag and cipher are good): the checks behind them decide
    body = data.draw(_mostly(edited_headers(hs.encode(None)), _mutations(hs.encode(None), 600), 1), label="body")
    b = _call(HS_ERRORS, C.safe_decode_handshake, body, None)
    sealed = _insider(body)
    if sealed is None:        # its version byte or header length edited: no table to move
        assert _refused(_call(HS_ERRORS, C.safe_decode_handshake, C._seal(body, SECRET), SECRET))
        a = None
    else:
        a = _call(HS_ERRORS, C.safe_decode_handshake, sealed, SECRET)
        assert _same(a, b), (a, b)
    if isinstance(a, C.Handshake):
        CALLS["ok_handshake_insider"] += 1
        assert C.Handshake.decode(a.encode(SECRET), SECRET) == a
    for wrong in (hs.encode(OTHER), hs.encode(None)):
        assert "authentic" in str(_call(errors.DescriptorError, C.safe_decode_handshake, wrong, SECRET))
    assert _refused(_call(errors.DescriptorError, C.safe_decode_handshake, hs.encode(SECRET), None))
    _call(HS_ERRORS, C.safe_decode_handshake, data.draw(st.one_of(junk, st.binary(max_size=400))), secret)
    _example()

def _secret_bytes(s):
    """What ``s`` is as a secret (None: none), or False where it is no secret."""
    if s is None:
        return None
    if isinstance(s, str):
        try:
            s = s.encode()
        except UnicodeEncodeError:
            return False
    return bytes(s) if isinstance(s, (bytes, bytearray)) and len(s) >= 16 else False


@fuzz
@given(st.sampled_from([None, SECRET]),
       st.one_of(flag_junk, st.text(min_size=16, max_size=20), st.binary(min_size=16, max_size=20),
                 st.just(SECRET), st.just(SECRET.decode()), st.just(bytearray(SECRET))))
@example(None, "\ud800" * 16)          # a str secret UTF-8 cannot encode: Handshake.encode and
#                                        Messenger(secret=) raised UnicodeEncodeError
def test_secrets(sealed_with, secret):
    """A secret is bytes or str of 16 bytes or more (anything else: InvalidArgumentError); the
    right one opens the blob, any other is refused."""
    hs = HANDSHAKES[0]
    r = _call((errors.DescriptorError, errors.InvalidArgumentError), C.safe_decode_handshake,
              hs.encode(sealed_with), secret)
    want = _secret_bytes(secret)
    if want is False:
        assert isinstance(r, errors.InvalidArgumentError), r
    elif want == sealed_with:
        assert r == hs
    else:
        assert isinstance(r, errors.DescriptorError), r
    enc = _call(errors.InvalidArgumentError, hs.encode, secret)
    assert _refused(enc) == (want is False)
    _example()

def _rid_ok(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, str):
        return len(v.encode("utf-8", "surrogatepass")) <= 255
    if isinstance(v, (bytes, bytearray)):
        return len(v) <= 255
    if isinstance(v, (int, np.integer)):
        return (int(v).bit_length() + 8) // 8 <= 255
    return False


@fuzz
@given(st.data())
def test_request_ids(data):
    v = data.draw(st.one_of(rids, junk, st.text(min_size=254, max_size=260), st.integers(-2**2050, 2**2050),
                            st.binary(max_size=300).map(bytearray), st.integers(-2**63, 2**63 - 1).map(np.int64)))
    enc = _call(errors.InvalidArgumentError, C.encode_request_id, v)
    assert (not _refused(enc)) == _rid_ok(v), (v, enc)
    if not _refused(enc):
        got, end = C.decode_request_id(enc)
        assert end == len(enc)
        want = bytes(v) if isinstance(v, bytearray) else int(v) if isinstance(v, np.integer) else v
        assert got == want and type(got) is type(want)
    # random and mutated encodings, at any position
    good = C.encode_request_id(data.draw(rids.filter(_rid_ok)))
    blob = data.draw(st.one_of(_mutations(good, 400), st.binary(max_size=300)))
    pos = data.draw(st.integers(0, len(blob) + 3))
    r = _call(errors.DescriptorError, C.decode_request_id, blob, pos)
    if not _refused(r):
        CALLS["ok_decode_request_id"] += 1
        val, end = r
        assert pos + 3 <= end <= len(blob) and type(val) in (str, bytes, int)
        assert C.decode_request_id(C.encode_request_id(val)) == (val, len(C.encode_request_id(val)))
    _example()


def _packable(kw) -> bool:
    if not kw:
        return False
    for name, v in kw.items():
        try:
            if len(name.encode()) > 255:
                return False
            a = np.asarray(v)
        except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
            return False
        if a.dtype.hasobject:
            return False
    return True


arrays = hnp.arrays(dtype=st.one_of(hnp.scalar_dtypes(), hnp.byte_string_dtypes(), hnp.unicode_string_dtypes()),
                    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
CTX = pack_context(a=np.arange(6, dtype="<f4").reshape(2, 3), b=np.array(b"xy"), c=np.int16(3))


@fuzz
@given(st.dictionaries(_mostly(st.text(max_size=6), st.one_of(surrogates, st.text(min_size=256, max_size=258)), 5),
                       _mostly(arrays, st.one_of(junk, st.just([[1], [1, 2]])), 2), max_size=4),
       st.one_of(_mutations(CTX, 200), junk))
@example({"a": [[1], [1, 2]]}, None)                       # ragged: numpy's ValueError escaped pack_context
@example({"\ud800": 1}, np.arange(10)[::2])                # a name UTF-8 cannot encode; a strided blob
@example({"x": 1}, 5)                                      # not a buffer: TypeError escaped unpack_context
@example({}, b"KXC1\x01\x00\x00\x00\x01a\x01,\x00\x10\x00\x00\x00")  # dtype ",": numpy's SyntaxError escaped
def test_context_blobs(kw, blob):
    """pack_context takes named arrays (InvalidArgumentError otherwise) and unpack_context
    gives them back; unpack_context of anything else: read-only views or DescriptorError."""
    r = _call(errors.InvalidArgumentError, pack_context, **kw)
    assert _refused(r) != _packable(kw), (kw, r)
    if not _refused(r):
        CALLS["ok_pack_context"] += 1
        out = unpack_context(r)
        assert list(out) == list(kw)
        for name, v in kw.items():
            a, o = np.asarray(v), out[name]
            assert o.shape == a.shape and o.dtype == a.dtype and o.tobytes() == np.ascontiguousarray(a).tobytes()
            assert not o.flags.writeable
    r = _call(errors.DescriptorError, unpack_context, blob)
    if not _refused(r):
        size = memoryview(blob).nbytes
        for o in r.values():
            assert isinstance(o, np.ndarray) and not o.flags.writeable and not o.dtype.hasobject
            assert o.nbytes <= size
    _example()


# -- a prefiller and a decoder, a node without a secret, a rogue engine -------------------------

def _regions(fill):
    return [np.full(s, fill, np.uint8) for s in LAYOUT.region_sizes(SH)]


@pytest.fixture(scope="module")
def world():
    """p (prefiller) and d (decoder, 4 context slots of 16 bytes) share a secret and are
    connected; q has no secret; er is a rogue engine connected to p and q; ef is an engine
    for constructing messengers. One provider: shm, else tcp."""
    engines = []
    for prov in ("shm", "tcp;ofi_rxm"):
        try:
            engines.append(kvxfer.Engine(prov, "127.0.0.1"))
            break
        except errors.KvxferError:
            continue
    if not engines:
        pytest.skip("neither shm nor tcp opens here")
    engines += [kvxfer.Engine(prov, "127.0.0.1") for _ in range(4)]
    ea, eb, ec, er, ef = engines
    src, dst = _regions(7), _regions(POISON)
    p = kvxfer.Messenger(ea, LAYOUT, SH, {0: src}, peer_timeout=30, secret=SECRET)
    d = kvxfer.Messenger(eb, LAYOUT, SH, {0: dst}, context_slots=4, context_bytes=16, peer_timeout=30, secret=SECRET)
    q = kvxfer.Messenger(ec, LAYOUT, SH, {0: _regions(0)}, peer_timeout=30)
    pg = d.connect(p.handshake())
    w = SimpleNamespace(provider=prov, p=p, d=d, q=q, pg=pg, src=src, dst=dst, er=er, ef=ef,
                        rogue={id(p): er.connect(ea.address), id(q): er.connect(ec.address)},
                        uids={p.uid, d.uid, q.uid}, serial=iter(range(10**9)))
    yield w
    for m in (d, p, q):
        m.close()
    for e in reversed(engines):
        e.close()


def _counters(m) -> dict:
    """The messenger's counters, heartbeats aside (they tick on their own)."""
    return {k: v for k, v in m.stats().items() if "HEARTBEAT" not in k}


def _idle(m) -> None:
    """Nothing in flight: no receive, request, busy page, fence or taken context slot."""
    with m._lock:
        state = dict(receives=len(m._receives), rids=len(m._rids), busy=int(m._busy_pages.sum()),
                     slots_taken=m.context_slots - len(m._free_slots), inbox=len(m._inbox),
                     requests=len(m._requests), fencing=len(m._fencing))
    assert not any(state.values()), state


def _untouched(dst) -> bool:
    return all((r == POISON).all() for r in dst)


def _landed(dst) -> bool:
    """Something landed, and only the source's bytes (every source byte is 7)."""
    changed = [r[r != POISON] for r in dst]
    return sum(c.size for c in changed) > 0 and all((c == 7).all() for c in changed)


def _repoison(dst) -> None:
    for r in dst:
        r[:] = POISON


def _is(x, token: str) -> bool:
    """``x`` is the placeholder ``token`` (which the test replaces by a real object)."""
    return type(x) is str and x == token


def _no_wait(t):
    """A timeout that never blocks: None and positive numbers become 0 (junk stays junk)."""
    if t is None or (not isinstance(t, bool) and isinstance(t, (int, float, np.integer, np.floating))
                     and t == t and t > 0):
        return 0.0
    return t


def _wait_final(r) -> None:
    deadline = time.monotonic() + 20
    while not r.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert r.done, r


@fuzz
@given(blob=_mostly(st.sampled_from(["P", "Q", "D", "MUT", "MUT"]), st.one_of(junk, st.binary(max_size=300))),
       timeout=_mostly(st.one_of(st.none(), st.floats(0.1, 100)), junk, 2), data=st.data())
def test_connect(world, blob, timeout, data):
    """connect() of a tampered, foreign or junk blob is refused before anything changes; the
    real blob gives the existing group."""
    w = world
    good = w.p.handshake()
    blob = {"P": good, "Q": w.q.handshake(), "D": w.d.handshake()}.get(blob, blob) if type(blob) is str else blob
    if _is(blob, "MUT"):
        blob = data.draw(_mutations(good, 600))
    before = _counters(w.d)
    r = _call((errors.DescriptorError, errors.InvalidArgumentError, errors.LayoutError, errors.PeerError),
              w.d.connect, blob, timeout)
    if isinstance(r, PeerGroup):
        CALLS["ok_connect"] += 1
        assert r is w.pg and bytes(blob) == good
    else:
        assert _refused(r)
    assert _counters(w.d) == before and w.d.peers == [w.pg] and w.pg.state == "up"
    _idle(w.d)
    _example()

valid_pages = st.lists(st.integers(0, LAYOUT.num_pages - 1), min_size=1, max_size=4, unique=True)
pages_st = _mostly(
    st.one_of(valid_pages, valid_pages.map(lambda x: np.array(x, np.uint16))),
    st.one_of(
        junk,
        st.lists(st.integers(-2, 34), max_size=6),
        st.lists(st.integers(-2**64, 2**64), max_size=3),
        hnp.arrays(st.sampled_from([np.int8, np.uint16, np.int64, np.uint64, np.float64, np.bool_]), st.integers(0, 5)),
        hnp.arrays(np.int32, st.tuples(st.integers(1, 2), st.integers(1, 2)), elements=st.integers(0, 31)),
    ))


@fuzz
@given(peer=_mostly(st.just("PG"), junk, 7), rid=_mostly(rids, junk, 5), pages=pages_st,
       ntok=_mostly(st.integers(1, 4), st.one_of(junk, st.integers(-1, 20))),
       timeout=_mostly(st.one_of(st.none(), st.floats(0.5, 100), st.floats(0, 0.01)), junk),
       hot=_mostly(st.booleans(), flag_junk), wait_t=_mostly(st.none(), junk, 1), cb=flag_junk)
@example(peer="PG", rid=bytearray(b"id"), pages=[1], ntok=1, timeout=None, hot=False, wait_t=0, cb=None)
def test_receive(world, peer, rid, pages, ntok, timeout, hot, wait_t, cb):
    """receive() with junk is refused with nothing taken and nothing sent; an accepted one
    reaches the prefiller and aborts with the fence, leaving both nodes idle."""
    w = world
    d, p = w.d, w.p
    peer = w.pg if _is(peer, "PG") else peer
    before, p_before = _counters(d), _counters(p)
    r = _call((errors.InvalidArgumentError, errors.OutOfBoundsError, errors.PeerError), d.receive,
              peer, rid, pages, ntok, timeout=timeout, hot=hot)
    if isinstance(r, Receive):
        CALLS["ok_receive"] += 1
        assert r.request_id == rid and r.num_tokens == ntok and r.state in ("pending", "failed", "aborted")
        # a live Receive's methods, with junk: never a stray exception, never blocking
        _call((errors.InvalidArgumentError, errors.TimeoutError), r.wait, _no_wait(wait_t))
        assert _refused(_call(errors.InvalidArgumentError, r.add_done_callback, cb))
        assert _call(errors.InvalidArgumentError, r.abort, 20) is True
        assert r.done and r.fenced and r.context is None and r.state in ("aborted", "failed")
        r.release()
        assert p.requests(timeout=0) == []        # withdrawn at the prefiller before anyone took it
    else:
        assert _counters(d) == before and _counters(p) == p_before
    _idle(d)
    _idle(p)
    assert _untouched(w.dst)
    _example()


bad_src = st.one_of(junk, st.lists(st.integers(-2, 34), max_size=6))
src_st = _mostly(st.just("VALID"), bad_src, 2)
chunk_st = st.tuples(_mostly(st.just("S"), st.one_of(flag_junk, st.just("junk")), 5),
                     _mostly(st.just(0), st.one_of(flag_junk, st.integers(-1, 20))),
                     _mostly(st.sampled_from(["END", "END", "END", 1, 2, 5]),
                             st.one_of(flag_junk, st.integers(-1, 20))),
                     _mostly(st.just("VALID"), bad_src, 5))


@fuzz
@given(stream=st.booleans(), npages=st.integers(1, 4), ntok_left=st.integers(0, 3),
       req=_mostly(st.just("REQ"), junk, 7), src=src_st,
       ctx=_mostly(st.one_of(st.none(), st.binary(max_size=16)), st.one_of(junk, st.binary(min_size=17, max_size=20))),
       chunks=_mostly(_mostly(st.lists(chunk_st, min_size=1, max_size=1), st.lists(chunk_st, max_size=3), 3), junk, 4),
       short=st.booleans())
@example(stream=True, npages=1, ntok_left=0, req="REQ", src="VALID", ctx=None, chunks=5,
         short=False)                               # schedule(5): TypeError escaped (not iterable)
def test_send_and_stream(world, stream, npages, ntok_left, req, src, ctx, chunks, short):
    """The prefiller's side on a real request: send()/stream()/schedule()/finish() with junk
    are refused with nothing posted or written; accepted ones land exactly the source's bytes
    and the context, or abort with the fence."""
    w = world
    p, d, pg = w.p, w.d, w.pg
    assert _untouched(w.dst), "a write of an earlier request landed late"
    dst_pages = sorted(set((np.arange(npages) * 7 + next(w.serial)) % LAYOUT.num_pages))
    ntok = len(dst_pages) * LAYOUT.page_size - ntok_left
    rid = f"s{next(w.serial)}"
    r = d.receive(pg, rid, dst_pages, ntok)
    (q,) = p.requests(timeout=20)
    assert q.request_id == rid and list(q.dst_pages) == dst_pages and q.num_tokens == ntok
    valid_src = list(range(len(dst_pages)))
    src = valid_src if _is(src, "VALID") else src
    req = q if _is(req, "REQ") else req
    before = _counters(p)
    s = _call((errors.InvalidArgumentError, errors.PlanError), p.stream if stream else p.send, req, src)
    if _refused(s):
        assert q.send is None and _counters(p) == before and _untouched(w.dst)
        assert r.abort(20) is True and r.state == "aborted"
    else:
        CALLS["ok_stream" if stream else "ok_send"] += 1
        assert isinstance(s, Send) and s.request is q and q.send is s
        f = _call(errors.InvalidArgumentError, s.finish, ctx)
        if _refused(f):                             # a refused finish leaves finish() to call
            ctx = None
            assert s.finish() is s
        want_ctx = b"" if ctx is None else bytes(memoryview(ctx).cast("B"))
        complete = True
        if stream:
            sch = chunks
            if isinstance(chunks, list):
                sch = []
                for t in chunks:
                    if not isinstance(t, tuple):      # junk lists: ints, not chunks
                        sch.append(t)
                        continue
                    t = tuple(s if _is(x, "S") else None if _is(x, "junk") else ntok if _is(x, "END")
                              else valid_src if _is(x, "VALID") else x for x in t)
                    sch.append(t[:3] if short else t)
            c0 = p.layer_counter.value
            ps = _call((errors.InvalidArgumentError, errors.PlanError), p.schedule, sch)
            assert isinstance(ps, (Pass, errors.KvxferError))
            if _refused(ps):
                assert p.layer_counter.value == c0 and not s.entries
            complete = isinstance(ps, Pass) and s.last_chunk
            if complete:
                p.layer_counter.bump(max(1, ps.end - p.layer_counter.value))
        if complete:
            CALLS["ok_stream_done" if stream else "ok_send_done"] += 1
            assert s.wait(20) == "done" and r.wait(20) == "done"
            assert bytes(r.context) == want_ctx and _landed(w.dst)
        else:
            assert s.abort(20) is True and s.done
            _wait_final(r)
            assert r.fenced and r.state in ("failed", "aborted")
            assert _untouched(w.dst), "an aborted stream wrote before its layers were computed"
    r.release()
    _wait_final(r)
    deadline = time.monotonic() + 20
    while (p._requests or p._reap) and time.monotonic() < deadline:
        time.sleep(0.001)
    _idle(d)
    _idle(p)
    _repoison(w.dst)
    _example()

FAKE_UIDS = [0xBAD0_0000_0000_0001, 0xBAD0_0000_0000_0003, 2**64 - 1, 1]


@st.composite
def rogue_messages(draw, uid: int):
    """What a rogue engine sends a messenger: a forged sender (never a real one), with or
    without the right tag, tampered, or just bytes. Each one must be dropped."""
    src = draw(st.sampled_from(FAKE_UIDS))
    sealed_with = draw(st.sampled_from([None, SECRET, OTHER]))
    hello = st.sampled_from([None, SECRET]).map(                  # another provider: _make_group refuses
        lambda s: _handshake(LAYOUT, SH, (0,), 0, 0, uid=src, provider="nope").encode(s))
    m = draw(controls(src=st.just(src), dst=st.one_of(st.just(uid), st.just(uid), u64), hello_blob=hello))
    kind = draw(st.sampled_from(["plain", "tampered", "sealed_tampered", "bytes", "sealed_bytes"]))
    if kind == "plain":
        return m.encode(sealed_with)
    if kind == "tampered":
        return draw(_mutations(m.encode(sealed_with)))
    if kind == "sealed_tampered":
        return C._seal(draw(_mutations(m.encode(None))), SECRET)
    b = draw(st.binary(max_size=300))
    return C._seal(b, SECRET) if kind == "sealed_bytes" else b


def _drops(st_: dict) -> int:
    return sum(v for k, v in st_.items() if k.startswith("drop_"))


@fuzz
@given(st.data())
def test_rogue_control_messages(world, data):
    """Forged, tampered and random control messages over the fabric, to a node with a secret
    and to one without: each is dropped with a counted reason (never an internal error), and
    nothing else changes: no peer, no request, no reply."""
    w = world
    assert not set(FAKE_UIDS) & w.uids
    for m in (w.p, w.q):
        msgs = data.draw(st.lists(rogue_messages(m.uid), min_size=1, max_size=4))
        before = m.stats()
        peers = m.peers
        for x in msgs:
            CALLS["calls"] += 1
            w.er.send(w.rogue[id(m)], x)
        deadline = time.monotonic() + 20
        while _drops(m.stats()) < _drops(before) + len(msgs) and time.monotonic() < deadline:
            time.sleep(0.0005)
        after = m.stats()
        assert _drops(after) == _drops(before) + len(msgs), (before, after)
        assert not after.get("drop_internal_error") and not after.get("callback_errors"), after
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert all(k.startswith(("drop_", "recv_")) or "HEARTBEAT" in k for k in changed), changed
        assert m.peers == peers
        _idle(m)
    assert w.pg.state == "up"
    with pytest.raises(errors.TimeoutError):
        w.er.recv(0)                              # and no node answered a stranger
    _example()

Messenger = kvxfer.Messenger


def _junk_but(lo: int, hi: int):
    """Junk without the ints in [lo, hi] (valid values too big to allocate for a test)."""
    return flag_junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi)


OPTIONS = st.fixed_dictionaries({
    "engine": _mostly(st.just("E"), flag_junk, 7),
    "layout": _mostly(st.just("L"), st.one_of(st.just(KVLayout.vllm(2, 4, 16, 4, 32)), flag_junk), 7),
    "sharding": _mostly(st.just("S"), st.one_of(st.just(Sharding(2)), flag_junk), 7),
    "kv": _mostly(st.sampled_from(["map", "list"]),
                  st.one_of(st.sampled_from(["map_junk", "keys_junk", "list_junk", "short", "rank5"]), flag_junk), 5),
}, optional={
    "ranks": _mostly(st.sampled_from([[0], (0,)]), flag_junk, 7),
    "context_slots": _mostly(st.integers(0, 8), st.one_of(st.integers(-3, -1), st.integers(2**31, 2**70),
                                                          _junk_but(0, 2**31 - 1)), 7),
    "context_bytes": _mostly(st.integers(0, 64), st.one_of(st.integers(2**40 + 1, 2**42), _junk_but(0, 2**40)), 7),
    "peer_timeout": _mostly(st.floats(0.1, 60), st.one_of(st.floats(1e6, 1e300), flag_junk), 7),
    "secret": _mostly(st.sampled_from([SECRET, SECRET.decode(), None]),
                      st.one_of(flag_junk, surrogates.map(lambda x: x * 16)), 7),
    "on_request": _mostly(st.sampled_from([None, print]), flag_junk, 7),
    "inline_requests": _mostly(st.booleans(), flag_junk, 7),
    "placements": _mostly(st.sampled_from([None, {0: 0}]), st.one_of(st.sampled_from([{0: 5}, {1: 0}, {0: "x"}]),
                                                                      flag_junk), 7),
    "counter_device": _mostly(st.none(), st.one_of(st.just(0), flag_junk), 7),
    "watch_poll_us": _mostly(st.one_of(st.floats(0.5, 100), st.sampled_from([0, 0.0, None])),
                             st.one_of(st.floats(1e9, 1e300), flag_junk), 7),
    "watch_cpus": _mostly(st.sampled_from([None, sorted(os.sched_getaffinity(0))[:1]]), flag_junk, 7),
    "watch_rt_priority": _mostly(st.just(0), st.one_of(st.integers(-1, 100), flag_junk), 7),
})


@settings(fuzz, max_examples=max(30, N // 10))
@given(OPTIONS)
@example({"engine": 5, "layout": "L", "sharding": "S", "kv": "map"})            # AttributeError escaped
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "ranks": 5})        # TypeError
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "keys_junk"})              # TypeError (sorting)
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "list_junk"})              # TypeError
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "watch_cpus": 5})   # TypeError
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "context_slots": 2**40})  # MemoryError
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "peer_timeout": 1e300})   # blob peers refuse
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "watch_rt_priority": "x"})
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "secret": "\ud800" * 16})
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "watch_poll_us": 2**53 * 1.0})  # layer_counter:
#   OverflowError escaped (the watcher's poll interval in ns past int64); inf too
@example({"engine": "E", "layout": "L", "sharding": "S", "kv": "map", "counter_device": 0})   # TypeError escaped:
#   _cudabump called kvxfer._cuda.driver, an instance since 9e6cb5b (layer_counter never worked on a GPU)
def test_messenger_options(world, opts):
    """Messenger(...) with junk options is refused before a thread starts or a region stays
    registered; an accepted one makes a handshake its peers decode, and closes."""
    w = world
    opts = dict(opts)
    regions = _regions(0)
    kv = {"map": {0: regions}, "list": [regions], "map_junk": {0: 5}, "keys_junk": {0: regions, "a": regions},
          "list_junk": [5], "short": {0: regions[:1]}, "rank5": {5: regions}}
    e, lay, sh, k = (opts.pop(k) for k in ("engine", "layout", "sharding", "kv"))
    args = (w.ef if _is(e, "E") else e, LAYOUT if _is(lay, "L") else lay, SH if _is(sh, "S") else sh,
            kv[k] if type(k) is str and k in kv else k)
    threads = threading.active_count()
    m = _call((errors.InvalidArgumentError, errors.LayoutError, errors.UnsupportedError), Messenger, *args, **opts)
    if _refused(m):
        assert threading.active_count() == threads, "a refused Messenger left threads running"
        _example()
        return
    CALLS["ok_messenger"] += 1
    try:
        hs = C.Handshake.decode(m.handshake(), m.secret)       # what its peers will decode
        assert hs == m._hs and hs.peer_timeout == m.peer_timeout and hs.context_slots == m.context_slots
        t = opts.get("peer_timeout")
        assert _refused(_call(errors.InvalidArgumentError, m.close, "x")) and not m.closed
        _call(errors.InvalidArgumentError, m.requests, _no_wait(t))
        lc = _call((errors.UnsupportedError, errors.InvalidArgumentError, errors.BufferError, errors.FabricError),
                   lambda: m.layer_counter)
        if not _refused(lc):
            v = lc.value
            assert lc.bump(2) == v + 2 and lc.value == v + 2
    finally:
        m.close()
    assert m.closed
    _example()

MISC = st.one_of(
    st.tuples(st.just("pages_completed"), st.tuples(st.one_of(st.integers(-2, 40), flag_junk),
                                                    st.one_of(st.integers(-1, 9), flag_junk),
                                                    st.one_of(st.integers(-2, 40), flag_junk),
                                                    st.one_of(st.integers(-2, 40), flag_junk))),
    st.tuples(st.just("pages_completed"), st.tuples(st.integers(0, 2**70), st.integers(1, 2**70),
                                                    st.integers(0, 40), st.integers(0, 40))),
    st.tuples(st.just("bump"), st.tuples(st.one_of(st.integers(-2, 4), st.integers(2**63, 2**70),
                                                   _junk_but(5, 2**63 - 1)))),
    st.tuples(st.just("close"), st.tuples(flag_junk)),
    st.tuples(st.just("requests"), st.tuples(st.one_of(st.none(), flag_junk))),
    st.tuples(st.just("schedule"), st.tuples(st.one_of(junk, st.lists(flag_junk, max_size=3)))),
    st.tuples(st.just("remote_layout"), st.tuples(st.one_of(junk, st.lists(flag_junk, max_size=3), st.just("MUT")))),
    st.tuples(st.just("register_layout"), st.tuples(st.one_of(junk, st.just("OK")))),
    st.tuples(st.just("wait"), st.tuples(flag_junk)),
)


@fuzz
@given(MISC, st.data())
@example(("schedule", (5,)), None)                  # TypeError escaped (not iterable)
@example(("close", ("x",)), None)                   # closed half the messenger, then TypeError
@example(("bump", (2**70,)), None)                  # OverflowError escaped
@example(("pages_completed", (10, 0, 0, 5)), None)  # ZeroDivisionError escaped
@example(("pages_completed", (2**62, 1, 0, 5)), None)   # numpy's ValueError (array too big) escaped
@example(("pages_completed", (0, 2**63, 0, 0)), None)   # OverflowError escaped (page_size past int64)
@example(("pages_completed", (2**63 - 1, 2**62, 0, 2**63 - 1)), None)   # int64 wrap-around: [0], not [0, 1]
@example(("remote_layout", (5,)), None)             # TypeError escaped (not iterable)
@example(("register_layout", (5,)), None)           # TypeError escaped (not iterable)
def test_other_entry_points(world, call, data):
    """The remaining public calls with junk: only kvxfer errors, and a refused one changes
    nothing (close leaves the node open, bump leaves the counter, requests returns nothing)."""
    w = world
    p = w.p
    name, args = call
    IA = errors.InvalidArgumentError
    if name == "pages_completed":
        r = _call(IA, pages_completed, *args)
        ints = all(not isinstance(a, bool) and isinstance(a, (int, np.integer)) for a in args)
        n, ps, a, b = args
        valid = ints and 1 <= ps < 2**63 and 0 <= n < 2**63 and -(-n // ps) <= C.MAX_PAGES
        assert _refused(r) != valid, (args, r)
        if valid:
            want = [k for k in range(-(-n // ps)) if a <= min((k + 1) * ps, n) - 1 < b]
            assert r.tolist() == want
    elif name == "bump":
        lc = p.layer_counter
        v = lc.value
        (k,) = args
        r = _call(IA, lc.bump, k)
        if _refused(r):
            assert lc.value == v
        else:
            assert 1 <= k < 2**63 and r == v + k == lc.value
            assert k <= 4                                  # big valid bumps are not drawn here
    elif name == "close":
        (t,) = args
        if _no_wait(t) == 0.0 and t is not None:          # a valid timeout would close the node
            t = float("nan")
        assert _refused(_call(IA, p.close, t)) and not p.closed and w.pg.state == "up"
    elif name == "requests":
        r = _call(IA, p.requests, _no_wait(args[0]))
        assert r == [] or _refused(r)
    elif name == "schedule":
        c0 = p.layer_counter.value
        r = _call((IA, errors.PlanError), p.schedule, args[0])
        if not isinstance(r, Pass):
            assert p.layer_counter.value == c0
        else:
            assert not r.sends          # only an empty list of chunks is a pass
    elif name == "remote_layout":
        table = p._local[0].descriptor()
        (x,) = args
        if _is(x, "MUT"):
            x = data.draw(_mutations(table, 200))
        r = _call((errors.DescriptorError, IA), remote_layout, w.er, x)
        if isinstance(r, RemoteRegionTable) and isinstance(x, bytes) and x == table:
            assert len(r) == LAYOUT.num_regions
        assert isinstance(r, (RemoteRegionTable, errors.KvxferError))
        assert isinstance(_call(errors.DescriptorError, remote_layout, w.er, table), RemoteRegionTable)
    elif name == "register_layout":
        (x,) = args
        regs = _regions(1) if _is(x, "OK") else x
        r = _call(IA, register_layout, w.ef, LAYOUT, SH, regs)
        if isinstance(r, RegionTable):
            assert len(r) == LAYOUT.num_regions
            r.close()
    elif name == "wait":
        # Send/Receive waits on objects that finished long ago
        r = w.d.receive(w.pg, f"w{next(w.serial)}", [0], 1)
        assert r.abort(20) is True
        r2 = _call(IA, r.wait, _no_wait(args[0]))
        assert r2 == "aborted" or _refused(r2)
        r.release()
    _idle(p)
    _idle(w.d)
    _example()
