"""A closed shm engine leaves the maps of the live engines of its process (issue 26.5,
src/forget.c): the long-lived engine that dropped it keeps working with every other peer,
same-process and cross-process, byte-exact, during and after; a stale handle of the closed
peer disconnects nothing; short-lived engines in another process are unaffected."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvxfer
from _shmfiles import mine as _mine, until as _until
from _target import Target

pytestmark = pytest.mark.skipif("shm" not in kvxfer.providers(), reason="no shm provider")

N = 1 << 16


def _write_checked(src_engine, src_mr, src_buf, peer, dst_engine_or_target, dst_desc, imm, value, view):
    """write N bytes of `value` and check they landed (view(): the destination's bytes)"""
    src_buf[:] = value
    if isinstance(dst_engine_or_target, Target):
        dst_engine_or_target.expect(imm, 1)
    else:
        c = dst_engine_or_target.expect(imm, 1)
    src_engine.write(src_mr, 0, peer, src_engine.remote(dst_desc), 0, N, imm=imm).wait(10)
    if isinstance(dst_engine_or_target, Target):
        status, arrived = dst_engine_or_target.wait(imm)
        assert status == "ok", (status, arrived)
    else:
        c.wait(10)
    got = view()
    assert (got == value).all(), (imm, value, np.unique(got))


def test_the_long_lived_engine_keeps_serving_its_other_peers():
    with kvxfer.Engine("shm") as long_lived, kvxfer.Engine("shm") as mate, \
            Target("shm", N) as far:
        src = np.empty(N, np.uint8)
        ms = long_lived.register(src)
        land = np.zeros(N, np.uint8)
        ml = long_lived.register(land)
        mate_dst = np.zeros(N, np.uint8)
        mate_md = mate.register(mate_dst)
        mate_src = np.empty(N, np.uint8)
        mate_ms = mate.register(mate_src)
        to_mate = long_lived.connect(mate.address)
        to_far = long_lived.connect(far.address)
        mate_to_long = mate.connect(long_lived.address)
        before = _mine()
        for i in range(25):
            value = i % 250 + 1
            with kvxfer.Engine("shm") as short:
                sdst = np.zeros(N, np.uint8)
                smd = short.register(sdst)
                ssrc = np.full(N, value, np.uint8)
                sms = short.register(ssrc)
                to_short = long_lived.connect(short.address)
                c = long_lived.expect(10_000 + i, 1)
                short.write(sms, 0, short.connect(long_lived.address), short.remote(ml.descriptor()), 0, N,
                            imm=10_000 + i).wait(10)
                c.wait(10)
                assert (land == value).all()
                _write_checked(long_lived, ms, src, to_short, short, smd.descriptor(), 20_000 + i, value,
                               lambda: sdst)
                # during: the other peers, while the short engine is live
                _write_checked(long_lived, ms, src, to_mate, mate, mate_md.descriptor(), 30_000 + i, value,
                               lambda: mate_dst)
                smd.close()
                sms.close()
            # after its close: the same-process mate both ways and the peer in another process
            _write_checked(long_lived, ms, src, to_mate, mate, mate_md.descriptor(), 40_000 + i, 255 - value,
                           lambda: mate_dst)
            _write_checked(mate, mate_ms, mate_src, mate_to_long, long_lived, ml.descriptor(), 50_000 + i, value,
                           lambda: land)
            _write_checked(long_lived, ms, src, to_far, far, far.descriptor, 60_000 + i, value,
                           lambda: far.memory())
            assert _until(lambda: _mine() == before), (i, _mine(), before)
        assert long_lived.stats()["outstanding"] == 0


def test_a_stale_handle_of_a_closed_engine_disconnects_nothing():
    """The closed engine's address was removed natively; its old handle's disconnect must not
    remove the peer that libfabric put in the same slot since (kx_av_remove's generation)."""
    with kvxfer.Engine("shm") as long_lived:
        src = np.full(N, 9, np.uint8)
        ms = long_lived.register(src)
        first = kvxfer.Engine("shm")
        stale = long_lived.connect(first.address)
        dst1 = np.zeros(N, np.uint8)
        md1 = first.register(dst1)
        long_lived.write(ms, 0, stale, long_lived.remote(md1.descriptor()), 0, N, imm=1).wait(10)
        md1.close()
        first.close()
        with kvxfer.Engine("shm") as second:
            dst2 = np.zeros(N, np.uint8)
            md2 = second.register(dst2)
            fresh = long_lived.connect(second.address)
            long_lived.disconnect(stale)          # nothing of `fresh` goes with it
            c = second.expect(2, 1)
            long_lived.write(ms, 0, fresh, long_lived.remote(md2.descriptor()), 0, N, imm=2).wait(10)
            c.wait(10)
            assert (dst2 == 9).all()
            with pytest.raises(kvxfer.errors.PeerError):
                long_lived.write(ms, 0, stale, long_lived.remote(md2.descriptor()), 0, N, imm=3).wait(10)
            md2.close()


def test_more_short_lived_engines_than_shm_has_peer_slots():
    """shm 1.17's map has 256 slots and reuses freed ones: 300 short engines in turn, each
    connected both ways, every transfer byte-exact, and no file left."""
    with kvxfer.Engine("shm") as long_lived:
        src = np.empty(4096, np.uint8)
        ms = long_lived.register(src)
        land = np.zeros(4096, np.uint8)
        ml = long_lived.register(land)
        before = _mine()
        for i in range(300):
            value = i % 250 + 1
            with kvxfer.Engine("shm") as short:
                sdst = np.zeros(4096, np.uint8)
                smd = short.register(sdst)
                sms = short.register(np.full(4096, value, np.uint8))
                c = long_lived.expect(i, 1)
                short.write(sms, 0, short.connect(long_lived.address), short.remote(ml.descriptor()), 0, 4096,
                            imm=i).wait(10)
                c.wait(10)
                assert (land == value).all(), i
                src[:] = 255 - value
                c = short.expect(i, 1)
                long_lived.write(ms, 0, long_lived.connect(short.address), long_lived.remote(smd.descriptor()),
                                 0, 4096, imm=i).wait(10)
                c.wait(10)
                assert (sdst == 255 - value).all(), i
                smd.close()
                sms.close()
        assert _until(lambda: _mine() == before), (_mine(), before)


_FAR = textwrap.dedent("""
    import os, sys
    import numpy as np
    import kvxfer
    address, desc, n = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
    for i in range(n):
        with kvxfer.Engine("shm") as short:
            ms = short.register(np.full(4096, i + 1, np.uint8))
            short.write(ms, 0, short.connect(address), short.remote(desc), 0, 4096, imm=300 + i).wait(10)
            ms.close()
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"{os.getpid()}:")]
        print(i, len(left), flush=True)
""")


def test_short_lived_engines_in_another_process_are_unaffected():
    """The closed engines' peer is in another process (nothing deferred, nothing forgotten):
    each short engine's files go with its close, and the long-lived engine here, which also
    has a same-process peer, takes every write."""
    with kvxfer.Engine("shm") as long_lived, kvxfer.Engine("shm") as mate:
        land = np.zeros(4096, np.uint8)
        ml = long_lived.register(land)
        mate.connect(long_lived.address)
        counters = [long_lived.expect(300 + i, 1) for i in range(10)]
        r = subprocess.run([sys.executable, "-c", _FAR, long_lived.address.hex(), ml.descriptor().hex(), "10"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert [line.split() for line in r.stdout.split("\n") if line] == [[str(i), "0"] for i in range(10)]
        for c in counters:
            c.wait(10)
        assert (land == 10).all()


@pytest.mark.parametrize("local", [False, True], ids=["other_process", "same_process"])
def test_a_peer_connected_after_a_disconnect_gets_a_fresh_slot(local):
    """shm 1.17's fi_av_remove leaves the freed slot's peer id in our region and the next
    peer connected takes the slot: our first command to it named the old peer's id, without
    a connection request, and the new peer's process died (SIGSEGV; on main: the second
    target, 'Connection reset by peer'). kx_av_remove resets the slot (src/forget.c)."""
    with kvxfer.Engine("shm") as long_lived:
        src = np.empty(N, np.uint8)
        ms = long_lived.register(src)
        for i in range(4):
            if local:
                with kvxfer.Engine("shm") as peer_engine:
                    dst = np.zeros(N, np.uint8)
                    md = peer_engine.register(dst)
                    p = long_lived.connect(peer_engine.address)
                    _write_checked(long_lived, ms, src, p, peer_engine, md.descriptor(), i, i + 1, lambda: dst)
                    long_lived.disconnect(p)
                    md.close()
            else:
                with Target("shm", N) as far:
                    p = long_lived.connect(far.address)
                    _write_checked(long_lived, ms, src, p, far, far.descriptor, i, i + 1, lambda: far.memory())
                    long_lived.disconnect(p)
