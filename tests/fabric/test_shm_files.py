"""A shm engine's /dev/shm files (issue 26.4): shm's region ``<pid>:<n>:<m>`` (16 MiB) and
kvxfer's doorbell ``<name>.kxbell``. A process that ends without closing its engine closes it
at interpreter exit; the files of a SIGKILLed process are reaped by the next shm engine of the
same user (kvxfer._shm.reap_stale)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvxfer
from _shmfiles import mine as _mine, rss_mib as _rss_mib, until as _until

pytestmark = pytest.mark.skipif("shm" not in kvxfer.providers(), reason="no shm provider")

_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    import kvxfer
    how, address, desc = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    e = kvxfer.Engine("shm")
    src = e.register(np.ones(4096, np.uint8))
    peer, dst = e.connect(address), e.remote(desc)
    e.write(src, 0, peer, dst, 0, 4096, imm=7).wait(10)
    # a thread of the program still holds the engine at exit (a server loop, a messenger's
    # threads): no finalizer closes it then, only the interpreter-exit hook
    threading.Thread(target=lambda e=e: time.sleep(600), daemon=True).start()
    print(os.getpid(), flush=True)
    if how == "raise":
        raise RuntimeError("an uncaught exception, the engine left open")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": the interpreter ends with the engine open
""")


def _files(pid):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{pid}:"))


def _child(how, b, md):
    r = subprocess.run([sys.executable, "-c", _CHILD, how, b.address.hex(), md.descriptor().hex()],
                       capture_output=True, text=True, timeout=60)
    pid = int(r.stdout.split()[0])
    return pid, r


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_an_unclosed_engine_is_closed_at_exit_and_leaves_no_files(how):
    with kvxfer.Engine("shm") as b:                     # the peer lives on
        dst = np.zeros(4096, np.uint8)
        md = b.register(dst)
        c = b.expect(7, 1)
        pid, r = _child(how, b, md)
        assert r.returncode == (0 if how == "exit" else 1), r.stderr[-2000:]
        c.wait(10)
        assert (dst == 1).all()
        assert _files(pid) == [], r.stderr[-2000:]


def test_a_killed_engines_files_are_reaped_by_the_next_engine():
    with kvxfer.Engine("shm") as b:
        md = b.register(np.zeros(4096, np.uint8))
        pid, r = _child("kill", b, md)
        assert r.returncode == -9
        left = _files(pid)
        assert left, "a SIGKILLed shm process leaves its region"   # (unless another engine reaped it already)
        with kvxfer.Engine("shm"):
            assert _files(pid) == []


CYCLES = 40


@pytest.mark.parametrize("who", ["short_writes", "long_writes", "both_write"])
def test_closed_short_lived_engines_release_their_region_beside_a_long_lived_one(who):
    """Issue 26.5: one long-lived shm engine; short-lived ones connect to it (or it to them),
    write, close. Each close leaves nothing in /dev/shm and gives its memory back. Before the
    fix each closed one kept its region (1 file, ~5.4 MiB of RSS) until the long-lived engine
    closed: shm 1.17 keeps a same-process peer's region by pointer in the long-lived engine's
    map, so kvxfer deferred the close; now the long-lived engine's progress drops it from its
    map (src/forget.c) and the close completes."""
    with kvxfer.Engine("shm") as long_lived:
        land = np.zeros(1 << 16, np.uint8)
        md = long_lived.register(land)
        src = np.empty(1 << 16, np.uint8)
        ml = long_lived.register(src)
        before = _mine()
        rss = []
        for i in range(CYCLES):
            with kvxfer.Engine("shm") as short:
                ms = short.register(np.full(1 << 16, i % 251 + 1, np.uint8))
                dst = np.zeros(1 << 16, np.uint8)
                md_s = short.register(dst)
                if who in ("short_writes", "both_write"):
                    c = long_lived.expect(1000 + i, 1)
                    short.write(ms, 0, short.connect(long_lived.address), short.remote(md.descriptor()), 0, 4096,
                                imm=1000 + i).wait(10)
                    c.wait(10)
                    assert (land[:4096] == i % 251 + 1).all()
                if who in ("long_writes", "both_write"):
                    src[:] = (i * 7) % 251 + 1
                    c = short.expect(2000 + i, 1)
                    long_lived.write(ml, 0, long_lived.connect(short.address), long_lived.remote(md_s.descriptor()),
                                     0, 1 << 16, imm=2000 + i).wait(10)    # 64 KiB: shm's CMA path
                    c.wait(10)
                    assert (dst == (i * 7) % 251 + 1).all()
                ms.close()
                md_s.close()
            assert _until(lambda: _mine() == before), (i, _mine(), before)
            rss.append(_rss_mib())
        # before the fix: +5.4 MiB per cycle (~190 MiB over these 35); allocator noise is far less
        assert rss[-1] - rss[4] < 16, rss
        assert _mine() == before
