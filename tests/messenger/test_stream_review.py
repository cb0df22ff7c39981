"""A review of layer streaming and context (stream.py, the watcher, context.py, ``kvxfer-bench
kv``): each test failed against the code before its fix.

* the counter word wrapped: ``Watcher.bump(n)`` / ``LayerCounter.bump(n)`` past 2**64 - 1
  silently took it back to a small value, so every entry armed at a higher threshold never
  posted (and a negative ``n`` or ``to`` was a bare ``OverflowError``);
* ``pack_context`` of an array with a dimension (or offset) past u32 raised ``struct.error``,
  and a structured dtype packed as raw ``|Vn``: its fields were lost on the way back;
* ``unpack_context`` accepted an array whose data lay over a later entry's header (the
  module promises ``DescriptorError`` for overlaps);
* ``kvxfer-bench kv --poll-us 1e300`` / ``--rt 100`` / a ``--page-size`` whose single page is
  over ``--max-mib``: exit 1 after spawning the prefill process (a traceback in it, or a
  238 TiB allocation), not a usage error before anything runs.

Passing before and after (checked sound): disarm racing fire on both providers.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer.cli import bench
from kvxfer.cli import kv as kv_cli
from kvxfer.errors import InvalidArgumentError, KvxferError
from kvxfer.messenger.context import pack_context, unpack_context


# -- the counter word never wraps -------------------------------------------------------------

def test_watcher_counter_refuses_to_wrap():
    e = kvxfer.Engine("shm")
    try:
        w = e.watcher()
        assert w.bump(2**63 - 1) == 2**63 - 1
        assert w.bump(2**63 - 1) == 2**64 - 2
        with pytest.raises(InvalidArgumentError):
            w.bump(5)                          # would wrap to 3
        assert w.value == 2**64 - 2
        assert w.bump(1) == 2**64 - 1          # up to the top is fine
        with pytest.raises(InvalidArgumentError):
            w.bump(1)
        assert w.value == 2**64 - 1
        for bad in (-1, 2**64, 1.0, True, "1"):
            with pytest.raises(InvalidArgumentError):
                w.bump(bad)
            with pytest.raises(InvalidArgumentError):
                w.advance(bad)
        assert w.value == 2**64 - 1
        w.close()
    finally:
        e.close()


def test_layer_counter_refuses_to_wrap():
    from kvxfer.messenger.stream import LayerCounter

    e = kvxfer.Engine("shm")
    try:
        w = e.watcher()
        lc = LayerCounter(w, 4)
        lc.bump(2**63 - 1)
        lc.bump(2**63 - 1)
        with pytest.raises(InvalidArgumentError):
            lc.bump(2)
        assert lc.value == 2**64 - 2
        w.close()
    finally:
        e.close()


# -- context ------------------------------------------------------------------------------------

def test_pack_context_dimension_past_u32_is_a_kvxfer_error():
    with pytest.raises(InvalidArgumentError):
        pack_context(a=np.zeros((0, 2**32), np.uint8))
    # the largest that fits still round-trips
    got = unpack_context(pack_context(a=np.zeros((0, 2**32 - 1), np.uint8)))["a"]
    assert got.shape == (0, 2**32 - 1)


def test_structured_dtype_is_refused_not_turned_into_void():
    a = np.zeros(2, [("x", "<f4"), ("y", "<i8")])
    with pytest.raises(InvalidArgumentError):
        pack_context(a=a)
    # its bytes, as the caller chooses to see them, still travel
    got = unpack_context(pack_context(a=a.view(np.uint8)))["a"]
    assert got.tobytes() == a.tobytes()


# -- kvxfer-bench kv usage -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,what", [
    (["kv", "--poll-us", "1e300"], "argument --poll-us: "),
    (["kv", "--poll-us", "inf"], "argument --poll-us: "),
    (["kv", "--rt", "100"], "argument --rt: "),
    (["kv", "--page-size", "1000000000"], "--page-size 1000000000"),
    (["kv", "--preset", "deepseek-r1", "--max-mib", "1", "--page-size", "4096"], "--max-mib"),
])
def test_kv_usage_errors_exit_2_before_anything_runs(capsys, monkeypatch, argv, what):
    def no_run(*a, **kw):
        raise AssertionError("ran")

    monkeypatch.setattr(kvxfer, "Engine", no_run)
    monkeypatch.setattr(kv_cli, "_Prefill", no_run)
    try:
        rc = bench.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert what in err and "Traceback" not in err, err


def test_kv_good_values_still_parse():
    p = bench.build_parser()
    a = p.parse_args(["kv", "--poll-us", "1000000000", "--rt", "99", "--page-size", "64"])
    assert a.poll_us == 1e9 and a.rt == 99 and a.page_size == 64


def test_unpack_refuses_data_overlapping_a_later_header():
    """An array's data placed over the next entry's header (``off`` past its own header but
    inside the header table) was accepted: its view showed header bytes."""
    import struct

    def entry(name, off):
        return bytes([1]) + name + bytes([3]) + b"|u1" + bytes([1]) + struct.pack("<I", 4) + struct.pack("<I", off)

    first_end = 8 + len(entry(b"a", 0))
    blob = b"KXC1" + struct.pack("<I", 2) + entry(b"a", first_end) + entry(b"b", 64)
    blob += bytes(80 - len(blob))
    from kvxfer.errors import DescriptorError

    with pytest.raises(DescriptorError):
        unpack_context(blob)


@pytest.mark.parametrize("prov", ["shm", "tcp;ofi_rxm"])
def test_disarm_racing_fire_is_exact(prov):
    """Disarming entries while another thread bumps them due: each one either never posts
    (disarm said True) or posts all its writes, and the target counts exactly those."""
    import threading

    a, b = kvxfer.Engine(prov, "127.0.0.1"), kvxfer.Engine(prov, "127.0.0.1")
    try:
        n, page = 200, 256
        src = np.random.default_rng(1).integers(0, 256, n * 2 * page, dtype=np.uint8)
        dst = np.zeros_like(src)
        ms, md = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        a.send(peer, b"hi")
        assert b.recv(10) == b"hi"
        rd = a.remote(md.descriptor())
        w = a.watcher(poll_us=1)
        es = []
        for i in range(n):
            off = np.array([2 * i * page, (2 * i + 1) * page], np.uint64)
            es.append(w.arm(i + 1, ms, peer, rd, off, off, np.full(2, page // 2, np.uint64), imm=9))
        order = np.random.default_rng(2).permutation(n)
        go = threading.Event()

        def bumper():
            go.wait()
            for _ in range(n):
                w.bump()

        t = threading.Thread(target=bumper)
        t.start()
        go.set()
        said = {int(i): es[i].disarm() for i in order}
        t.join()
        posted = 0
        for i, e in enumerate(es):
            if said[i]:
                assert e.state == "disarmed" and e.posted == 0
            else:
                e.wait(10)
                assert e.state == "posted" and e.posted == e.num_writes
                posted += e.num_writes
        if posted:
            b.expect(9, posted).wait(10)
        import time

        time.sleep(0.2)
        assert b.banked(9) == 0                    # nothing beyond what was counted
        for i, e in enumerate(es):
            o = 2 * i * page
            assert np.array_equal(dst[o:o + page // 2], src[o:o + page // 2]) == (not said[i]), i
        w.close()
    finally:
        a.close()
        b.close()


# -- the watcher of a CPU counter does not poll -------------------------------------------------
def test_a_cpu_layer_counter_is_not_polled_and_its_bumps_stream(provider):
    """The messenger's default on a CPU counter (no ``counter_device``): its watcher never
    polls, armed or not (a handful of wake-ups while a pass waits 200 ms, where a 10 µs poll
    makes thousands and takes half a core here); each ``bump()`` still wakes it, so the
    layers stream and the request completes byte-exact. ``watch_poll_us=0`` with a device
    counter is refused before anything is made."""
    import time

    from kvxfer import KVLayout, Sharding

    lay = KVLayout.vllm(4, 2, 8, 4, 16, "float16")
    node = None if provider.startswith("shm") else "127.0.0.1"
    ea, eb = kvxfer.Engine(provider, node), kvxfer.Engine(provider, node)
    p = d = None
    try:
        kvp = {0: [np.random.default_rng(3).integers(0, 256, s, dtype=np.uint8) for s in lay.region_sizes(Sharding(1))]}
        kvd = {0: [np.zeros(s, np.uint8) for s in lay.region_sizes(Sharding(1))]}
        with pytest.raises(InvalidArgumentError, match="poll_us=0"):
            kvxfer.Messenger(ea, lay, Sharding(1), kvp, counter_device=0, watch_poll_us=0)
        p = kvxfer.Messenger(ea, lay, Sharding(1), kvp, peer_timeout=30)
        d = kvxfer.Messenger(eb, lay, Sharding(1), kvd, peer_timeout=30)
        pg = d.connect(p.handshake())
        r = d.receive(pg, "r", [5, 9], 8)
        (req,) = p.requests(timeout=30)
        s = p.stream(req)
        lc = p.layer_counter
        p.schedule([(s, 0, 8, [2, 3])])
        s.finish()
        w0 = lc.stats()["wakeups"]
        time.sleep(0.2)
        assert lc.stats()["wakeups"] - w0 < 5 and lc.stats()["armed"] > 0
        for _ in range(lay.num_layers):
            lc.bump()
        r.wait(30)
        assert r.state == "done"
        for src, dst in zip(kvp[0], kvd[0]):
            sv, dv = src.reshape(lay.num_pages, -1), dst.reshape(lay.num_pages, -1)   # a page: its K, then V
            assert np.array_equal(dv[[5, 9]], sv[[2, 3]])
            assert not np.delete(dv, [5, 9], axis=0).any()
    finally:
        for m in (d, p):
            if m is not None:
                m.close()
        ea.close()
        eb.close()
