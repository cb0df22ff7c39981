"""Disconnecting a peer while something may still post to it (review findings of 2026-12-01).

Before: an address removed from the AV was "untracked", so a post racing ``disconnect`` (a
send from another thread, a watch entry armed to the peer) went straight into libfabric: on
tcp;ofi_rxm a SIGSEGV inside ``fi_writemsg``/``fi_send``; on shm a write landing after the
disconnect; and once libfabric reused the slot for the next peer, the entry meant for the old
one fired at the new one. Now a removed peer's slot stays dead (ENOTCONN) until reused, every
post names the slot's generation, and ``fi_av_remove`` waits for posts inside a provider call
(src/peers.c, ``kx_peer_enter`` / ``kx_peer_retire``). Crash-prone cases run in a child, so
a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvxfer
from kvxfer import errors


def _engines(provider, n):
    return [kvxfer.Engine(provider, "127.0.0.1") for _ in range(n)]


def test_an_entry_armed_to_a_disconnected_peer_reaches_nobody(provider):
    """B is disconnected and C takes its AV slot: B's armed entry fails with ENOTCONN when it
    fires, and neither B nor C sees a byte or an immediate of it; C works normally."""
    a, b, c = _engines(provider, 3)
    try:
        n = 1 << 16
        src = np.full(n, 0xAB, np.uint8)
        db, dc = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        ms, mb, mc = a.register(src), b.register(db), c.register(dc)
        pb = a.connect(b.address)
        a.send(pb, b"hi")                      # shm maps a peer on its first message
        assert b.recv(10) == b"hi"
        w = a.watcher()
        off, ln = np.array([0], np.uint64), np.array([512], np.uint64)
        e = w.arm(1, ms, pb, a.remote(mb.descriptor()), off, off, ln, imm=99)
        pb.close()
        assert a._rails[0].peer_state(pb.fi_addrs[0]) == errno.ENOTCONN
        pc = a.connect(c.address)
        a.send(pc, b"hi")
        assert c.recv(10) == b"hi"
        reused = pc.fi_addrs == pb.fi_addrs
        w.bump()
        with pytest.raises(errors.KvxferError) as ei:
            e.wait(10)
        assert getattr(ei.value, "errno", None) == errno.ENOTCONN or "not connected" in str(ei.value)
        assert b.banked(99) == 0 and c.banked(99) == 0
        assert not db.any() and not dc.any()
        a.write(ms, 0, pc, a.remote(mc.descriptor()), 0, 512, imm=5).wait(10)
        c.expect(5, 1).wait(10)
        assert dc[:512].all()
        if provider.startswith("tcp"):
            assert reused                       # FI_AV_TABLE hands the freed slot on
        with pytest.raises(errors.PeerError):
            a.send(pb, b"late")
        w.close()
    finally:
        for x in (a, b, c):
            x.close()


def _child(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_sends_racing_disconnect_fail_cleanly(provider):
    """One thread sends in a loop while another disconnects the peer: every send either goes
    out or raises PeerError (tcp;ofi_rxm crashed in fi_send within 150 rounds before)."""
    r = _child(f"""
        import threading, time, kvxfer
        from kvxfer.errors import PeerError
        b = kvxfer.Engine({provider!r}, "127.0.0.1")
        a = kvxfer.Engine({provider!r}, "127.0.0.1")
        seen = {{"sent": 0, "peer": 0, "other": []}}
        for it in range(60):
            p = a.connect(b.address)
            go = threading.Event()
            def sender():
                go.wait()
                for _ in range(2000):
                    try:
                        a.send(p, b"x" * 16, timeout=1)
                        seen["sent"] += 1
                    except PeerError:
                        seen["peer"] += 1
                        return
                    except Exception as exc:
                        seen["other"].append(repr(exc))
                        return
            t = threading.Thread(target=sender)
            t.start()
            go.set()
            time.sleep(0.0005 * (it % 7))
            p.close(timeout=0.2)
            t.join()
            try:
                while True:
                    b.recv(0)
            except TimeoutError:
                pass
        a.close(); b.close()
        print("done", seen["peer"], seen["other"])
    """)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split()[0] == "done" and r.stdout.strip().endswith("[]"), r.stdout


def test_a_deferred_shm_close_finished_while_its_owner_frees_it():
    """A closed shm engine whose region another engine of the process still reads is
    deferred; that engine's close finishes it. Its owner dropping it meanwhile used to close
    the same domain and free the rail under the finisher (double fi_freeinfo, then SIGSEGV).
    An LD_PRELOAD shim makes fi_freeinfo sleep to widen that window; it changes nothing else."""
    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("needs a C compiler for the LD_PRELOAD shim")
    shim = Path(__file__).with_name("_slow_freeinfo.c")
    so = Path(tempfile.mkdtemp()) / "slow_freeinfo.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(shim), "-ldl"], check=True)
    code = """
        import gc, os, threading, time, kvxfer
        a = kvxfer.Engine("shm", "127.0.0.1")
        b = kvxfer.Engine("shm", "127.0.0.1")
        pa = a.connect(b.address)
        a.send(pa, b"hi"); assert b.recv(10) == b"hi"
        del pa
        a.close()                              # deferred: b's progress may still read a's region
        os.environ["KX_SLOW_FREEINFO_MS"] = "300"
        os.write(2, b"RACE\\n")
        t = threading.Thread(target=b.close)   # b drops the last hold and finishes a's close
        t.start()
        time.sleep(0.1)
        del a                                  # the owner frees its rail meanwhile
        gc.collect()
        t.join()
        print("survived")
    """
    # KVXFER_SHM_FORGET=0: b keeps a deferred (src/forget.c would have b drop it at a's close)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVXFER_SHM_FORGET": "0",
                            "LD_PRELOAD": " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(so)]))})
    assert r.returncode == 0 and r.stdout.strip() == "survived", f"rc {r.returncode}: {r.stderr[-2000:]}"
    race = r.stderr.split("RACE\n", 1)[-1]
    freed = [ln.split()[-1] for ln in race.splitlines() if ln.startswith("[shim]")]
    assert freed and len(freed) == len(set(freed)), r.stderr    # a's fi_info freed once


def test_a_written_off_write_leaves_the_rails_count():
    """shm never completes a write its target refused (here: beyond the region a forged
    descriptor claims); the stall scan fails the transfer after ``peer_timeout`` and writes its
    operation off the peer's count. It stayed in the rail's ``outstanding`` for good, so the
    progress thread never slept on its fd again and every later close drained to its deadline."""
    from _providers import available

    from kvxfer import wire

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    page = 1 << 16
    a = kvxfer.Engine("shm", "127.0.0.1", peer_timeout=0.5)
    b = kvxfer.Engine("shm", "127.0.0.1")
    try:
        dst = np.zeros(2 * page, np.uint8)
        md = b.register(dst)
        d = wire.Descriptor.decode(md.descriptor())
        forged = wire.Descriptor(d.provider, d.base, 64 * page, d.keys, d.virt_addr, d.raw, d.device, d.owner).encode()
        src = a.register(np.full(page, 0xEE, np.uint8))
        peer = a.connect(b.address)
        a.send(peer, b"hi")
        assert b.recv(10) == b"hi"
        t = a.write(src, 0, peer, a.remote(forged), 40 * page, page, imm=3)
        with pytest.raises(errors.KvxferError):
            t.wait(10)
        assert a.stats()["outstanding"] == 0
        assert b.banked(3) == 0 and not dst.any()
    finally:
        a.close()
        b.close()


def test_the_native_poster_refuses_limits_past_the_rails(pair):
    """libfabric 1.17 checks iov, message size and inject limits only by assert: the engine
    computes legal ones, and each rail's native poster refuses others itself (a caller of
    the Cython layer, or a future rail of another provider, cannot post past them)."""
    a, b = pair
    src = a.register(np.zeros(4096, np.uint8))
    md = b.register(np.zeros(4096, np.uint8))
    peer, rr = a.connect(b.address), a.remote(md.descriptor())
    r = a._rails[0]
    before = a.stats()["writes_posted"]
    cases = [(r.iov_limit + 1, a.max_write, 0), (a.iov, 1024, 2048), (0, a.max_write, 0)]
    if r.max_msg_size < 2**64 - 1:
        cases.append((a.iov, r.max_msg_size + 1, 0))
    for iov, max_write, pack_min in cases:
        with pytest.raises(errors.FabricError):
            r.write_one(peer.fi_addrs[0], peer.gens[0], src.ptr, src._handles[0], rr.base, rr.keys[0], None,
                        0, 0, 4096, 1, iov, max_write, pack_min)
    assert a.stats()["writes_posted"] == before and b.banked(1) == 0


def test_a_removed_peers_leftovers_are_not_the_next_peers():
    """B's 64 MiB write is still in flight (B is stopped) when B is disconnected and C takes
    its slot: C's own bookkeeping (in-flight transfers, what its disconnect waits for) holds
    C's transfers only, not B's leftover, which fails with ENOTCONN."""
    import signal

    from _providers import available

    tcp = "tcp;ofi_rxm"
    if not available(tcp):
        pytest.skip(f"{tcp} is not available here")
    big = 64 << 20
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, numpy as np, kvxfer
        e = kvxfer.Engine({tcp!r}, "127.0.0.1")
        m = e.register(np.zeros({big}, np.uint8))
        print(e.address.hex(), m.descriptor().hex(), flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    a = kvxfer.Engine(tcp, "127.0.0.1", peer_timeout=60)
    c = kvxfer.Engine(tcp, "127.0.0.1")
    try:
        addr, desc = child.stdout.readline().split()
        ms = a.register(np.full(big, 0xAB, np.uint8))
        mc = c.register(np.zeros(4096, np.uint8))
        pb, rb = a.connect(bytes.fromhex(addr)), a.remote(bytes.fromhex(desc))
        a.write(ms, 0, pb, rb, 0, 4096, imm=1).wait(10)
        os.kill(child.pid, signal.SIGSTOP)
        t = a.write(ms, 0, pb, rb, 0, big, imm=2)        # cannot finish: B reads nothing
        pb.close(timeout=0.3)
        pc = a.connect(c.address)
        a.write(ms, 0, pc, a.remote(mc.descriptor()), 0, 512, imm=5).wait(10)
        c.expect(5, 1).wait(10)
        r = a._rails[0]
        # by slot alone, B's leftover counts while rxm still holds its context (most runs);
        # by C's generation it never does
        assert r.wait_peer_idle(pc.fi_addrs[0], 0.0, pc.gens[0]) == (0, 0)
        assert r.peer_state(pc.fi_addrs[0]) == 0
        with pytest.raises(errors.PeerError):
            t.wait(1)
    finally:
        child.kill()
        child.wait()
        a.close()
        c.close()
