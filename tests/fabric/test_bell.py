"""The shm doorbell (src/bell.c): a sleeping shm progress thread is woken by the process that
writes to it, instead of finding the write at the end of its back-off. What must hold: the
bell lives exactly as long as its engine, a write to a sleeping peer rings it (across
processes and within one), an engine without a bell is still served, a file at the
bell's path that is not a bell is never rung, and the files a dead process left under our
pid (shm's region and its bell) do not stop an engine from opening."""

import os
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvxfer
from _target import Target


def _bell_path(eng: kvxfer.Engine) -> str:
    name = eng._rails[0].getname().rstrip(b"\0").decode()
    assert name.startswith("fi_shm://")
    return f"/dev/shm/{name[len('fi_shm://'):]}.kxbell"


def _idle_writes(eng, peer, src_mr, dst, expect, wait, n=5):
    """n 4 KiB writes, each after the target has idled long enough to sleep in its back-off."""
    for i in range(n):
        time.sleep(0.02)
        expect(500 + i, 1)
        t = eng.write(src_mr, 4096 * i, peer, dst, 4096 * i, 4096, imm=500 + i)
        t.wait(20)
        wait(500 + i)


def _idle_writes_in_process(a, b, src):
    """_idle_writes from engine a into engine b of this process; b's landed bytes."""
    buf = np.zeros(src.nbytes, np.uint8)
    smr, dmr = a.register(src), b.register(buf)
    peer, dst = a.connect(b.address), a.remote(dmr.descriptor())
    counters = {}
    _idle_writes(a, peer, smr, dst, lambda imm, n: counters.__setitem__(imm, b.expect(imm, n)),
                 lambda imm: counters.pop(imm).wait(20))
    return buf


def test_bell_lives_with_its_engine(shm):
    with kvxfer.Engine("shm", rails=2) as eng:
        names = [r.getname().rstrip(b"\0").decode()[len("fi_shm://"):] for r in eng._rails]
        paths = [f"/dev/shm/{n}.kxbell" for n in names]
        for p in paths:
            st = os.stat(p)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == 4096
    for p in paths:
        assert not os.path.exists(p)


def test_write_rings_a_sleeping_peer_in_another_process(shm):
    src = np.random.default_rng(3).integers(0, 256, 5 * 4096, dtype=np.uint8)
    with Target("shm", 5 * 4096) as tgt, kvxfer.Engine("shm") as eng:
        mr = eng.register(src)
        peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
        _idle_writes(eng, peer, mr, dst, tgt.expect, lambda imm: tgt.wait(imm))
        assert np.array_equal(tgt.memory(), src)
        assert eng.stats()["bell_rings"] >= 1
        assert tgt.call("stats")["bell_wakes"] >= 1


def test_write_rings_a_sleeping_peer_in_this_process(shm):
    src = np.arange(5 * 4096, dtype=np.uint32).view(np.uint8)[: 5 * 4096].copy()
    with kvxfer.Engine("shm") as a, kvxfer.Engine("shm") as b:
        assert np.array_equal(_idle_writes_in_process(a, b, src), src)
        assert a.stats()["bell_rings"] >= 1 and b.stats()["bell_wakes"] >= 1


def test_peer_without_a_bell_is_served_by_the_back_off(shm, monkeypatch):
    monkeypatch.setenv("KVXFER_SHM_BELL", "0")
    src = np.full(5 * 4096, 7, np.uint8)
    with Target("shm", 5 * 4096) as tgt:
        monkeypatch.delenv("KVXFER_SHM_BELL")
        with kvxfer.Engine("shm") as eng:
            mr = eng.register(src)
            peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
            _idle_writes(eng, peer, mr, dst, tgt.expect, lambda imm: tgt.wait(imm))
            assert np.array_equal(tgt.memory(), src)
            assert eng.stats()["bell_rings"] == 0
            assert tgt.call("stats")["bell_wakes"] == 0


@pytest.mark.parametrize("content", [b"\0" * 4096, b"bell" + b"\xff" * 4092, b"short"])
def test_a_file_that_is_not_a_bell_is_never_rung(shm, monkeypatch, content):
    """Someone else's file at a bell's path (here: an engine without a bell, and a file put
    there): the writer must not map it, let alone write into it."""
    monkeypatch.setenv("KVXFER_SHM_BELL", "0")
    with kvxfer.Engine("shm") as b:
        monkeypatch.delenv("KVXFER_SHM_BELL")
        path = _bell_path(b)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.write(fd, content)
            src = np.full(5 * 4096, 9, np.uint8)
            with kvxfer.Engine("shm") as a:
                assert np.array_equal(_idle_writes_in_process(a, b, src), src)
                assert a.stats()["bell_rings"] == 0
            os.lseek(fd, 0, os.SEEK_SET)
            assert os.read(fd, 8192) == content           # not a byte changed
        finally:
            os.close(fd)
            os.unlink(path)


def test_files_of_a_dead_process_with_our_pid_do_not_block_an_engine(shm):
    """shm refuses to enable an endpoint whose region file exists (EBUSY); a crashed or
    killed process leaves its region, and pids come round again. The first shm endpoint of a
    process is named <pid>:0:0: a fresh process puts stale files there, then opens one."""
    code = textwrap.dedent("""
        import os, kvxfer
        pid = os.getpid()
        for suffix in ("", ".kxbell"):
            with open(f"/dev/shm/{pid}:0:0{suffix}", "wb") as f:
                f.write(b"stale" * 100)
        with kvxfer.Engine("shm") as e:
            assert e._rails[0].getname().rstrip(b"\\0").decode() == f"fi_shm://{pid}:0:0"
            bell = os.stat(f"/dev/shm/{pid}:0:0.kxbell")
            assert bell.st_size == 4096                  # a bell of its own, not the stale file
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"{pid}:")]
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
