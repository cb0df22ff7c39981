"""Hostile input (issue 12): every decoder and public entry point, fed by Hypothesis, raises
only kvxfer.errors (which also subclass the matching built-ins), never crashes, and writes
nothing when it refuses. KVXFER_STRESS=1: 20,000 examples per test (over 100,000 in all)."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from conftest import STRESS
from kvxfer import errors, wire

N = 20_000 if STRESS else 150
pytestmark = pytest.mark.timeout(0 if STRESS else 120)   # pytest-timeout would cut Hypothesis short
fuzz = settings(max_examples=N, deadline=None, derandomize=not STRESS, database=None,
                suppress_health_check=list(HealthCheck))

junk = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=16),
    st.lists(st.integers(-5, 5), max_size=4), st.tuples(st.integers(-2**65, 2**65), st.integers(-2**65, 2**65)),
    st.just(np.int64(-1)), st.just(np.uint64(2**63)), st.just(np.float32(1.5)), st.just(object()),
)


def _mutations(blob: bytes):
    """A valid encoding with bytes flipped, cut, extended or spliced."""
    return st.one_of(
        st.binary(max_size=300),
        st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)).map(
            lambda t: blob[:t[0]] + bytes([t[1]]) + blob[t[0] + 1:]),
        st.integers(0, len(blob)).map(lambda k: blob[:k]),
        st.binary(min_size=1, max_size=40).map(lambda x: blob + x),
        st.tuples(st.integers(0, len(blob)), st.binary(max_size=40)).map(lambda t: blob[:t[0]] + t[1]),
    )


@pytest.fixture(scope="module")
def world():
    """Two engines per provider, a source and a target region, and a poisoned copy of the
    target's memory to prove refused calls wrote nothing."""
    out = {}
    kvs = []
    # "shm direct": the target's memory a host KVBuffer, so the descriptor has a host share
    # (mutated shares reach remote()) and accepted writes are direct writes
    for p in ("tcp;ofi_rxm", "shm", "shm direct"):
        prov = p.split()[0]
        try:
            a = kvxfer.Engine(prov, "127.0.0.1", peer_timeout=2.0)
        except errors.KvxferError:
            continue
        b = kvxfer.Engine(prov, "127.0.0.1")
        src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16].copy()
        if p == "shm direct":
            kvs.append(kvxfer.KVBuffer.allocate(1 << 16))
            dst, target = kvs[-1].numpy(), kvs[-1]
            dst[:] = 0xA5
        else:
            dst = target = np.full(1 << 16, 0xA5, np.uint8)
        ms, md = a.register(src), b.register(target)
        out[p] = dict(a=a, b=b, src=src, dst=dst, ms=ms, md=md, peer=a.connect(b.address),
                      rr=a.remote(md.descriptor()), addr=b.address, desc=md.descriptor())
        assert out[p]["rr"].direct == (p == "shm direct")
    yield out
    for w in out.values():
        w["a"].close()
        w["b"].close()
    for kv in kvs:
        kv.close()


def _only_kvxfer_errors(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except errors.KvxferError as exc:
        # each kvxfer error is also a built-in a caller may catch
        assert isinstance(exc, (ValueError, TypeError, IndexError, OSError, ConnectionError,
                                TimeoutError, RuntimeError, NotImplementedError, BufferError)), type(exc)
        return exc


@fuzz
@given(st.data())
def test_decoders(data):
    good_a = wire.Address("tcp;ofi_rxm", (b"\x02\x00" + bytes(14),)).encode()
    good_d = wire.Descriptor("shm", 4096, 8192, (b"k" * 8,), True, owner=b"o" * 8).encode()
    good_s = wire.Descriptor("shm", 4096, 8192, (b"k" * 8,), True, owner=b"o" * 8,
                             host_share=wire.HostShare(4242, 9, 1, 77, 8192)).encode()     # version 2
    for codec, good in ((wire.Address, good_a), (wire.Descriptor, good_d), (wire.Descriptor, good_s)):
        blob = data.draw(_mutations(good))
        r = _only_kvxfer_errors(codec.decode, blob)
        assert isinstance(r, (codec, errors.DescriptorError))
    _only_kvxfer_errors(wire.Address.decode, data.draw(junk))
    _only_kvxfer_errors(wire.Descriptor.decode, data.draw(junk))


@fuzz
@given(st.data())
def test_connect_and_remote(world, data):
    for w in world.values():
        a = w["a"]
        _only_kvxfer_errors(a.connect, data.draw(st.one_of(_mutations(w["addr"]), junk)))
        _only_kvxfer_errors(a.remote, data.draw(st.one_of(_mutations(w["desc"]), junk)))
    for w in world.values():       # one bad address must never poison later connects
        assert w["a"].connect(w["addr"]) is w["peer"]


@fuzz
@given(st.data())
def test_register(world, data):
    w = next(iter(world.values()))
    obj = data.draw(st.one_of(
        junk,
        st.sampled_from(["object", "readonly", "bool", "empty"]).map(lambda k: {
            "object": np.empty(4, object), "readonly": np.frombuffer(b"x" * 64, np.uint8),
            "bool": (True, 4096), "empty": np.empty(0, np.uint8)}[k]),
        st.tuples(st.integers(0, 2**64 + 1), st.integers(-1, 2**64)),
    ))
    r = _only_kvxfer_errors(w["a"].register, obj)
    if isinstance(r, kvxfer.MemoryRegion):
        r.close()


@fuzz
@given(st.data())
def test_writes_refused_write_nothing(world, data):
    for p, w in world.items():
        a, ms, peer, rr, dst = w["a"], w["ms"], w["peer"], w["rr"], w["dst"]
        kind = data.draw(st.sampled_from(["write", "pages", "batch"]))
        ints = st.one_of(junk, st.integers(-10, 1 << 17))
        arrs = st.one_of(junk, st.lists(st.integers(-3, 40), max_size=6),
                         st.lists(st.integers(0, 2**64 - 1), max_size=3).map(lambda x: np.array(x, np.uint64)),
                         st.lists(st.floats(0, 5), max_size=3).map(np.array))
        imm = data.draw(st.one_of(st.none(), junk, st.integers(0, 2**32 + 1)))
        if kind == "write":
            call = lambda: a.write(ms, data.draw(ints), peer, rr, data.draw(ints), data.draw(ints), imm=imm)  # noqa: E731
        elif kind == "pages":
            call = lambda: a.write_pages(ms, data.draw(arrs), peer, rr, data.draw(arrs), data.draw(ints),  # noqa: E731
                                         src_stride=data.draw(st.one_of(st.none(), ints)), imm=imm)
        else:
            call = lambda: a.write_batch(ms, peer, rr, data.draw(arrs), data.draw(arrs), data.draw(arrs), imm=imm)  # noqa: E731
        before = dst.copy()
        r = _only_kvxfer_errors(call)
        if isinstance(r, kvxfer.Transfer):
            r.wait(20)                # accepted: it lands within its bounds
            if r.imm is not None:
                w["b"].discard(r.imm)
            dst[:] = 0xA5
        else:
            assert (dst == before).all(), f"a refused {kind} wrote into the target ({p})"


@fuzz
@given(st.data())
def test_other_entry_points(world, data):
    for w in world.values():
        a, b = w["a"], w["b"]
        t = data.draw(st.one_of(junk, st.just(0.0)))
        if t is None or (isinstance(t, (int, float, np.integer, np.floating)) and not isinstance(t, bool)
                         and not (isinstance(t, float) and math.isnan(t)) and t > 0):
            t = 0.0           # never block the fuzzer on a real wait (None waits for ever)
        _only_kvxfer_errors(a.expect, data.draw(junk), data.draw(junk))
        _only_kvxfer_errors(a.banked, data.draw(junk))
        _only_kvxfer_errors(a.discard, data.draw(junk))
        _only_kvxfer_errors(b.recv, t)
        _only_kvxfer_errors(a.send, w["peer"], data.draw(st.one_of(junk, st.binary(min_size=65537, max_size=65540))))


@settings(fuzz, max_examples=max(20, N // 50))
@given(st.data())
def test_engine_options(data):
    e = _only_kvxfer_errors(kvxfer.Engine, data.draw(st.sampled_from(["tcp;ofi_rxm", "shm"])), "127.0.0.1",
                            progress=data.draw(st.one_of(junk, st.just("block"))),
                            peer_timeout=data.draw(st.one_of(junk, st.just(1.0))),
                            iov=data.draw(st.one_of(st.none(), junk)),
                            max_write=data.draw(st.one_of(st.none(), junk)),
                            direct=data.draw(st.one_of(st.none(), st.booleans(), junk)))
    if isinstance(e, kvxfer.Engine):
        e.close()
