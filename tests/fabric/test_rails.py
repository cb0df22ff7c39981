"""Several rails (one endpoint per NIC): striping, exact counters, pairing, pinning.

On this machine the NICs are stood in for by several tcp;ofi_rxm endpoints on the loopback
domain "lo"; the code path is the one a node with several EFA or ConnectX NICs takes.
"""

import os
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import errors, wire

TCP = "tcp;ofi_rxm"


def _engine(rails: int, **kw):
    try:
        return kvxfer.Engine(TCP, "127.0.0.1", nics=["lo"] * rails, **kw)
    except errors.KvxferError as exc:  # pragma: no cover - only where tcp is missing
        pytest.skip(f"{TCP} on lo unavailable: {exc}")


@pytest.mark.parametrize("src_rails,dst_rails", [(2, 2), (3, 1), (1, 2), (4, 3)])
def test_striped_pages_land_and_count_exactly(src_rails, dst_rails):
    page, cap, n = 4096, 600, 500
    rng = np.random.default_rng(src_rails * 10 + dst_rails)
    src = rng.integers(0, 256, cap * page, dtype=np.uint8)
    dst = np.zeros(cap * page, np.uint8)
    with _engine(src_rails) as a, _engine(dst_rails) as b:
        assert a.rails == src_rails and len(wire.Address.decode(a.address).names) == src_rails
        ms, md = a.register(src), b.register(dst)
        assert len(wire.Descriptor.decode(md.descriptor()).keys) == dst_rails
        sp, dp = rng.permutation(cap)[:n], rng.permutation(cap)[:n]
        sp[100:140], dp[100:140] = np.arange(0, 40), np.arange(200, 240)   # a run that coalesces
        dp[100:140] = np.arange(200, 240)
        # keep destination pages unique after planting the run
        rest = np.setdiff1d(np.arange(cap), dp[100:140])
        dp[:100], dp[140:] = rest[:100], rest[100 : n - 40]
        rr = a.remote(md.descriptor())
        t = a.write_pages(ms, sp, a.connect(b.address), rr, dp, page, imm=99)
        expected = a.count_writes(sp.astype(np.uint64) * page, dp.astype(np.uint64) * page, np.full(n, page),
                                  region=rr)
        assert t.num_writes == expected
        assert expected == wire.count_writes(sp * page, dp * page, np.full(n, page), a.iov, a.max_write, a.pack_min,
                                             rails=src_rails)
        c = b.expect(99, t.num_writes)
        t.wait(20)
        c.wait(20)
        assert b.banked(99) == 0          # exact: nothing more arrived than counted
        assert np.array_equal(dst.reshape(cap, page)[dp], src.reshape(cap, page)[sp])
        assert a.stats()["writes_posted"] == t.num_writes


def test_single_write_is_split_across_rails():
    n = 3 * (1 << 20) + 7
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    with _engine(3) as a, _engine(3) as b:
        ms, md = a.register(src), b.register(dst)
        t = a.write(ms, 0, a.connect(b.address), a.remote(md.descriptor()), 0, n, imm=5)
        assert t.num_writes == 3
        b.expect(5, 3).wait(20)
        t.wait(20)
        assert np.array_equal(dst, src)


def test_descriptor_and_peer_rails_must_match():
    with _engine(2) as a, _engine(2) as b, _engine(1) as c:
        ms = a.register(bytearray(8192))
        one_rail = a.remote(c.register(bytearray(8192)).descriptor())
        with pytest.raises(errors.DescriptorError):
            a.write(ms, 0, a.connect(b.address), one_rail, 0, 64)


def _allowed_cpus(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def test_progress_threads_are_pinned():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with _engine(2, cpus=[cpu]) as e:
        deadline = time.monotonic() + 10
        tids = e.progress_threads()
        while not all(tids) and time.monotonic() < deadline:   # threads record their id as they start
            time.sleep(0.01)
            tids = e.progress_threads()
        assert len(tids) == 2 and all(tids)
        for tid in tids:
            assert _allowed_cpus(tid) == str(cpu)
            with open(f"/proc/self/task/{tid}/comm") as f:
                assert f.read().strip() == "kvxfer-progress"


def test_placement_drives_nics_and_cpus():
    topo_mod = pytest.importorskip("kvxfer.topology")
    try:
        host = topo_mod.Topology.discover().assign_host()
    except errors.KvxferError as exc:
        pytest.skip(f"no topology here: {exc}")
    # this machine has no RDMA NIC: the placement carries CPUs only, and the engine keeps one rail
    with kvxfer.Engine(TCP, "127.0.0.1", placement=host) as e:
        assert e.rails == 1
        assert e.cpus == tuple(host.cpus)
