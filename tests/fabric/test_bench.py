"""kvxfer-bench for real: tiny ``bw`` and ``lat`` runs against a spawned target on each provider
(a few seconds each), and a target's failure coming back with its traceback."""

from __future__ import annotations

import json

import pytest

from kvxfer.cli import bench


def test_bw_tiny_run_checks_data_and_writes_json(provider, tmp_path, capsys):
    out = tmp_path / "bw.json"
    rc = bench.main(["bw", "--provider", provider, "--case", "write:64K", "--case", "pages:4Kx64",
                     "--case", "memmove:1M", "--iters", "3", "--warmup", "1", "--timeout", "20", "-q",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "pages 4K x 64" in text and "FAIL" not in text
    doc = json.loads(out.read_text())
    assert doc["subcommand"] == "bw" and doc["command"][:2] == ["kvxfer-bench", "bw"]
    assert doc["machine"]["nproc"] >= 1 and doc["timestamp"]
    (run,) = doc["runs"]
    assert run["provider"] == provider and run["error"] is None
    assert run["info"]["provider"] == provider and run["target"]["info"]["provider"] == provider
    res = {r["case"]: r for r in run["results"]}
    assert set(res) == {"write:64K", "pages:4Kx64", "memmove:1M"}
    for r in res.values():
        assert r["check"] == "ok" and r["iterations"] == 3 and len(r["samples_us"]) == 3
        assert r["gbps"] > 0 and r["p99_s"] >= r["p50_s"] > 0
    paged = res["pages:4Kx64"]
    assert paged["bytes"] == 64 * 4096 and paged["pages"] == 64
    # 64 scattered pages, at most iov per message: as many immediates as count_writes says
    iov = run["info"]["iov"]
    if provider == "shm":     # into a memfd (a host share) no page travels alone: packed, fewer where runs merge
        assert 1 <= paged["writes"] <= -(-64 // iov)
    else:
        assert -(-64 // iov) <= paged["writes"] <= 64
    assert paged["post_per_page_s"] > 0 and paged["acked_p50_s"] > 0 and paged["local_p50_s"] > 0
    assert paged["timing"] == "target clock"
    # the target's buffer is a memfd by default: on shm, kvxfer writes into it directly
    assert doc["options"]["target_memory"] == "memfd"
    assert all(res[c]["direct"] is (provider == "shm") for c in ("write:64K", "pages:4Kx64"))


def test_bw_into_anonymous_memory_is_not_direct(tmp_path, capsys):
    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    out = tmp_path / "bw.json"
    rc = bench.main(["bw", "--provider", "shm", "--case", "pages:4Kx64", "--iters", "2", "--warmup", "1",
                     "--timeout", "20", "-q", "--target-memory", "anon", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    (r,) = json.loads(out.read_text())["runs"][0]["results"]
    assert r["check"] == "ok" and r["direct"] is False


def test_lat_tiny_run(provider, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = bench.main(["lat", "--provider", provider, "--iters", "50", "--warmup", "5", "-q", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    (r,) = run["results"]
    assert r["check"] == "ok" and r["iterations"] == 50 and r["size"] == 8
    assert 0 < r["min_us"] <= r["p50_us"] <= r["p99_us"]
    floor = r.get("floor")
    if floor and not floor.get("error"):        # the floor pays kvxfer's completion semantics
        dc = provider == "tcp;ofi_rxm"         # delivery-complete is tcp;ofi_rxm's default
        assert floor["delivery_complete"] == int(dc) and floor["p50_us"] > 0
        assert ("plain" in floor) == dc and (not dc or floor["plain"]["delivery_complete"] == 0)


def test_bw_hot_target_and_transmit_completions(provider, capsys):
    """--target-wait hot and --no-delivery-complete change how the two sides wait, not what lands."""
    rc = bench.main(["bw", "--provider", provider, "--case", "pages:4Kx64", "--case", "write:8K", "--iters", "3",
                     "--warmup", "1", "--timeout", "20", "-q", "--target-wait", "hot", "--no-delivery-complete"])
    text = capsys.readouterr().out
    assert rc == 0 and "FAIL" not in text and text.count(" ok") >= 2, text


def test_bw_rounds_and_the_floor(provider, tmp_path, capsys):
    """--rounds: each case's median round with every round kept; --floor: the provider's C floor
    over as many endpoints as kvxfer has rails, and on tcp the kernel's socket ceiling."""
    out = tmp_path / "r.json"
    rc = bench.main(["bw", "--provider", provider, "--case", "pages:4Kx64", "--iters", "2", "--warmup", "1",
                     "--rounds", "3", "--rails", "2", "--floor", "--timeout", "20", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    (run,) = json.loads(out.read_text())["runs"]
    (r,) = run["results"]
    assert r["check"] == "ok" and len(r["rounds"]) == 3 and 0 <= r["round"] < 3
    assert sorted(x["gbps"] for x in r["rounds"])[1] == r["gbps"]
    floor = {f.get("mode"): f for f in run["floor"]}
    if "pages" not in floor:            # no C compiler here: the floor says why
        assert all(f.get("error") for f in run["floor"])
        return
    assert floor["pages"]["rails"] == 2 and floor["pages"]["gbps"] > 0 and "floor (C)" in text
    if provider == "tcp;ofi_rxm":
        assert floor["sock"]["rails"] == 2 and floor["sock"]["gbps"] > 0 and "socket (C)" in text
    else:
        assert "sock" not in floor


def test_target_failure_comes_back_with_its_traceback(provider):
    if provider != "tcp;ofi_rxm":
        pytest.skip("one provider is enough: the failure path does not depend on it")
    import kvxfer
    from kvxfer.cli._channel import RemoteFailure
    from kvxfer.cli._initiator import Initiator
    from kvxfer.cli._target_process import TargetProcess

    with kvxfer.Engine("tcp;ofi_rxm", node="127.0.0.1") as eng:
        tp = TargetProcess(eng.provider, "127.0.0.1", progress="block", idle_timeout=20, deadline=60)
        try:
            ini = Initiator(eng, tp.address, timeout=20, alive=tp.dead)
            ini.ch.send("bw", case="bogus", seed=0, warmup=1, imm_base=1, iov=eng.iov, max_write=eng.max_write,
                        timeout=5)
            with pytest.raises(RemoteFailure, match="unknown case"):
                ini.ch.recv("desc", 20)
            assert tp.stop(timeout=20) == 1   # the target ends by itself, with a failure status
        finally:
            tp.close()


@pytest.mark.parametrize("peer", ["nixl", "mooncake"])
def test_vs_peer_tiny_run(peer, tmp_path, capsys):
    """--vs for real where the peer library is installed (optional: pip install nixl /
    mooncake-transfer-engine-non-cuda); its target checks every byte as kvxfer's does."""
    from kvxfer.cli import _mooncake, _nixl

    why = (_nixl if peer == "nixl" else _mooncake).available()
    if why:
        pytest.skip(f"{peer} is not installed: {why}")
    out = tmp_path / "vs.json"
    rc = bench.main(["bw", "--provider", "tcp;ofi_rxm", "--vs", peer, "--case", "pages:4Kx64", "--case", "write:64K",
                     "--iters", "3", "--warmup", "1", "--timeout", "30", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = json.loads(out.read_text())["comparison"]
    assert {r["case"] for r in rows} == {"pages:4Kx64", "write:64K"}
    assert all(r["peer"] == peer and r["peer_check"] == "ok" and r["kvxfer_check"] == "ok" for r in rows)
    assert all(r["peer_gbps"] > 0 for r in rows)


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_vs_nixl_reads_beside_kvxfer_reads(provider, tmp_path, capsys):
    """``--op write --op read --vs nixl`` (issue 25): NIXL's READ pulls each case into a
    checked buffer as kvxfer's read does, and each op is compared with its own kind."""
    from _providers import available
    from kvxfer.cli import _nixl

    why = _nixl.available()
    if why:
        pytest.skip(f"nixl is not installed: {why}")
    if not available(provider):
        pytest.skip(f"provider {provider} is not available here")
    out = tmp_path / "vs.json"
    rc = bench.main(["bw", "--provider", provider, "--vs", "nixl", "--op", "write", "--op", "read",
                     "--case", "pages:4Kx64", "--case", "write:64K", "--iters", "3", "--warmup", "1",
                     "--timeout", "30", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    rows = doc["comparison"]
    assert sorted((r["case"], r["label"].startswith("read ")) for r in rows) == [
        ("pages:4Kx64", False), ("pages:4Kx64", True), ("write:64K", False), ("write:64K", True)]
    assert all(r["peer_check"] == "ok" and r["kvxfer_check"] == "ok" and r["peer_gbps"] > 0 for r in rows)
    (run,) = doc["runs"]
    reads = [x for x in run["vs"]["nixl"]["results"] if x.get("op") == "read"]
    assert len(reads) == 2 and all(x["iterations"] == 3 and x["check"] == "ok" for x in reads)


def test_the_floor_leaves_no_shm_region_behind():
    """bench/fi_pingpong.c closes its endpoints: shm removes /dev/shm/<pid>:... only then, and
    every floor run used to leave 16 MiB of tmpfs per endpoint (and a name a later process
    with that pid could not enable on)."""
    import os

    from _providers import available
    from kvxfer.cli._floor import FloorUnavailable, run_floor

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    before = set(os.listdir("/dev/shm"))
    try:
        lat = run_floor("shm", iters=200, warmup=10)
        pages = run_floor("shm", mode="pages", page_bytes=4096, pages=64, iov=4, iters=2, warmup=1, extra=["-R", "2"])
    except FloorUnavailable as exc:
        pytest.skip(f"no floor here: {exc}")
    assert lat["p50_us"] > 0 and pages["rails"] == 2
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if n.split(":")[0].isdigit() and not os.path.exists(f"/proc/{n.split(':')[0]}")]
    assert left == []


def test_the_tcp_staging_probe_runs_and_checks_its_pages():
    """bench/probe_tcp_staging.py (docs/benchmarks.md, staging on tcp): both modes land every
    page where it belongs, with the source scattered too (--gather)."""
    import subprocess
    import sys
    from pathlib import Path

    from _providers import available

    if not available("tcp;ofi_rxm"):
        pytest.skip("provider tcp;ofi_rxm is not available here")
    probe = Path(__file__).resolve().parents[2] / "bench" / "probe_tcp_staging.py"
    r = subprocess.run([sys.executable, str(probe), "--iters", "2", "--chunk", "4M", "--gather"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["rma", "stage"]
    assert all(ln.endswith("data ok") for ln in lines)


def test_a_peer_failing_in_a_later_round_is_let_go_at_once(monkeypatch, tmp_path, capsys):
    """--rounds with a --vs peer that fails in round 2 (a stand-in for NIXL): the peer is
    closed right then and asked nothing more, its error is in the JSON with no half-measured
    case, and kvxfer's own rounds and checks go on."""
    from _providers import available
    from kvxfer.cli._results import CaseResult

    if not available("tcp;ofi_rxm"):
        pytest.skip("provider tcp;ofi_rxm is not available here")
    events = []

    class FailingPeer:
        def bw(self, case, seed, **kw):
            events.append(("bw", case.spec))
            if len([e for e in events if e[0] == "bw"]) == 2:
                raise RuntimeError("the peer's target went away")
            r = CaseResult(case, iterations=2, warmup=1, num_writes=1)
            r.landed = r.acked = r.local = r.post = [1e-3, 1e-3]
            return r

        def close(self):
            events.append(("close", None))

    def open_peer(peer, run):
        rec = {"results": [], "error": None}
        run.record.setdefault("vs", {})[peer] = rec
        return peer, FailingPeer(), rec

    monkeypatch.setattr(bench, "_open_peer", open_peer)
    out = tmp_path / "r.json"
    rc = bench.main(["bw", "--provider", "tcp;ofi_rxm", "--vs", "nixl", "--rounds", "3", "--case", "pages:4Kx64",
                     "--case", "write:64K", "--iters", "2", "--warmup", "1", "--timeout", "20", "-q",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    # round 1 ran, round 2 failed, and then the peer was closed once and never asked again
    assert events == [("bw", "pages:4Kx64"), ("bw", "pages:4Kx64"), ("close", None)]
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    rec = run["vs"]["nixl"]
    assert "RuntimeError" in rec["error"] and rec["results"] == []
    assert [len(r["rounds"]) for r in run["results"]] == [3, 3]
    assert all(r["check"] == "ok" for r in run["results"])
    assert doc["comparison"] == [] and "no comparison" in text


def test_pin_splits_the_cpus_between_initiator_and_target(tmp_path, capsys):
    """--pin: the initiator on the first half of the CPUs, the target process on the second
    (the JSON's machine facts of each side say how many each may use), and the calling
    process gets its CPUs back afterwards."""
    import os

    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("--pin needs 2 CPUs")
    out = tmp_path / "pin.json"
    rc = bench.main(["lat", "--provider", "shm", "--iters", "50", "--warmup", "5", "--pin", "-q", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    assert os.sched_getaffinity(0) == cpus and "KVXFER_BENCH_CPUS" not in os.environ
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["options"]["pin"] is True
    assert doc["machine"]["affinity"] == len(cpus) // 2
    assert run["target"]["machine"]["affinity"] == len(cpus) - len(cpus) // 2
    assert run["results"][0]["check"] == "ok"


def test_pin_is_for_local_runs():
    with pytest.raises(SystemExit):
        bench.main(["bw", "--pin", "--connect", "00"])


def test_lat_of_fewer_than_8_bytes_checks_only_what_travels(capsys):
    """Both sides compared the whole 8-byte word while a 1-byte write carries one byte: every
    round trip from the 257th on "failed"."""
    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    rc = bench.main(["lat", "-q", "--provider", "shm", "--size", "1", "--iters", "300", "--warmup", "0",
                     "--no-floor", "--timeout", "20"])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("ok"), out


def test_an_interrupted_run_leaves_nothing_behind():
    """SIGINT to the initiator mid-case: exit 130, and the target closes its engine (SIGTERM
    first) or has its shm files removed: none of its /dev/shm region (16 MiB) or bell stays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    before = set(os.listdir("/dev/shm"))
    p = subprocess.Popen([sys.executable, "-m", "kvxfer.cli.bench", "bw", "-q", "--case", "pages:16Kx1024",
                          "--iters", "100000", "--max-iters", "100000", "--provider", "shm"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        time.sleep(4)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, out
    time.sleep(0.3)
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if n.split(":")[0].isdigit() and not os.path.exists(f"/proc/{n.split(':')[0]}")]
    assert left == []


def test_a_failing_target_keeps_the_rows_measured_before(tmp_path, capsys):
    """The target fails on the second case (hugetlb pages asked for, none reserved): the row
    measured before stays in the JSON with the error, and the target leaves no files."""
    import json
    import os

    from _providers import available

    if not available("shm"):
        pytest.skip("provider shm is not available here")
    free = [ln for ln in open("/proc/meminfo") if ln.startswith("HugePages_Free")]
    if free and int(free[0].split()[1]) > 0:
        pytest.skip("huge pages are reserved here: the target would not fail")
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "bw.json"
    rc = bench.main(["bw", "-q", "--provider", "shm", "--case", "memmove:1M", "--case", "write:4K", "--iters", "2",
                     "--target-memory", "memfd-huge", "--timeout", "20", "--json", str(out)])
    assert rc == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert [r["case"] for r in run["results"]] == ["memmove:1M"] and "huge pages" in run["error"]
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if n.split(":")[0].isdigit() and not os.path.exists(f"/proc/{n.split(':')[0]}")]
    assert left == []
