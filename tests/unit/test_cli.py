"""kvxfer-bench without libfabric: the case grammar, the parser and the target's data check.

Short real runs of ``bw`` and ``lat`` are in tests/fabric/test_bench.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.cli import bench
from kvxfer.cli._cases import ALIASES, GUARD_BYTES, Case, Checker, dst_pages, parse_case, parse_size, pattern
from kvxfer.errors import InvalidArgumentError, UnsupportedError

# -- case grammar ------------------------------------------------------------------------
def test_letters_name_the_documented_cases():
    assert parse_case("a") == Case("write", 64 << 20)
    assert parse_case("b") == Case("pages", 16 << 10, 4096)
    assert parse_case("c") == Case("pages", 2 << 10, 32768)
    assert parse_case("memmove") == Case("memmove", 64 << 20)
    assert parse_case("B").letter == "b"
    for alias, spec in ALIASES.items():
        assert parse_case(spec).spec == spec


def test_spec_round_trips_and_sizes():
    c = parse_case("pages:4Kx64")
    assert (c.kind, c.page_bytes, c.pages, c.nbytes) == ("pages", 4096, 64, 256 << 10)
    assert parse_case(c.spec) == c
    assert parse_case("write:1000").spec == "write:1000"
    assert parse_size("16KiB") == parse_size("16K") == 16384
    assert parse_size("3") == 3


@pytest.mark.parametrize("bad", ["", "x", "write:", "pages:4K", "pages:4Kx0", "pages:4Kxy", "write:-1", "write:4Q",
                                 "read:4K"])
def test_bad_cases_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        parse_case(bad)


def test_bad_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["bw", "--case", "bogus"])
    assert e.value.code == 2
    assert "unknown case" in capsys.readouterr().err


def test_help_lists_subcommands(capsys):
    for argv in (["--help"], ["bw", "--help"], ["lat", "--help"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "bw" in out and "lat" in out and "--provider" in out and "--json" in out
    assert "_target" not in out


# -- the target's check ------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(page=st.sampled_from([8, 24, 64, 4096]), count=st.integers(1, 64), seed=st.integers(0, 2**32 - 1),
       it=st.integers(0, 1000), data=st.data())
def test_checker_accepts_exact_scatter_and_catches_any_wrong_page(page, count, seed, it, data):
    case = Case("pages", page, count)
    chk = Checker(case, seed)
    src = pattern(seed, case.nbytes).reshape(count, page)
    perm = dst_pages(seed, it, count)
    assert sorted(perm.tolist()) == list(range(count))
    dst = chk.buf[: case.nbytes].reshape(count, page)

    dst[perm] = src                       # what a correct paged write leaves behind
    assert chk.check(it) == (0, True)
    assert not chk.buf[: case.nbytes].any(), "the written range is poisoned again"

    dst[perm] = src
    victim = data.draw(st.integers(0, count - 1))
    byte = data.draw(st.integers(0, page - 1))
    dst[perm[victim], byte] ^= 0xFF       # one flipped byte in one page
    assert chk.check(it) == (1, True)

    if count > 1:                         # stale scatter: last iteration's mapping
        dst[dst_pages(seed, it + 1, count)] = src
        bad, _ = chk.check(it)
        assert bad > 0 or np.array_equal(dst_pages(seed, it + 1, count), perm)


@pytest.mark.parametrize("memory", ["anon", "memfd", "memfd-huge"])
def test_checker_catches_a_missing_write_and_an_overrun(memory):
    case = Case("write", 4096)
    try:
        chk = Checker(case, 7, memory)
    except UnsupportedError as exc:       # memfd-huge: this machine's hugetlb pool is empty
        assert memory == "memfd-huge" and "huge pages" in str(exc)
        return
    assert chk.check(0) == (1, True)      # nothing landed: poison is not data
    chk.buf[: case.nbytes] = chk.expected
    chk.buf[case.nbytes + GUARD_BYTES - 1] = 0
    assert chk.check(1) == (0, False)
    chk.buf[: case.nbytes] = chk.expected
    assert chk.check(2) == (0, True)      # the guard was restored
    chk.close()
    with pytest.raises(InvalidArgumentError):
        Checker(case, 7, "tmpfs")


# -- lat beside the floor ------------------------------------------------------------------
def test_lat_row_shows_the_floor_and_the_ratio():
    s = {"size": 8, "p50_us": 30.0, "p99_us": 90.0, "min_us": 20.0, "mean_us": 35.0, "iterations": 10,
         "check": "ok"}
    row = bench.lat_row("shm", s, {"p50_us": 10.0})
    assert "10.0 us" in row and " 3.0 " in row and row.endswith("ok")
    assert bench.lat_row("shm", s, None).count(" - ") >= 1          # no floor: dashes, no ratio
    assert bench.lat_row("shm", s, {"error": "no compiler"}).count(" - ") >= 1


def test_floor_without_its_source_says_why(monkeypatch, tmp_path):
    from kvxfer.cli import _floor

    monkeypatch.setattr(_floor, "source", lambda: tmp_path / "missing.c")
    with pytest.raises(_floor.FloorUnavailable, match="not found"):
        _floor.run_floor("shm")


def test_pin_halves_and_back(monkeypatch):
    """--pin's helpers: halves of this thread's CPUs, the target's half through the
    environment, everything restored by unpin; fewer than 2 CPUs is refused."""
    import os

    from kvxfer.cli import _machine

    cpus = os.sched_getaffinity(0)
    monkeypatch.delenv(_machine.PIN_ENV, raising=False)
    assert _machine.pinned_halves() is None
    if len(cpus) >= 2:
        before = _machine.pin_halves()
        try:
            mine, theirs = _machine.pinned_halves().split(":")
            assert {int(c) for c in mine.split(",")} == os.sched_getaffinity(0)
            assert {int(c) for c in theirs.split(",")} == cpus - os.sched_getaffinity(0)
            assert os.environ[_machine.PIN_ENV] == theirs
        finally:
            _machine.unpin(before)
        assert os.sched_getaffinity(0) == cpus and _machine.PIN_ENV not in os.environ
    one = {min(cpus)}
    os.sched_setaffinity(0, one)
    try:
        with pytest.raises(SystemExit, match="at least 2 CPUs"):
            _machine.pin_halves()
    finally:
        os.sched_setaffinity(0, cpus)


@pytest.mark.parametrize("argv, says", [
    (["bw", "--rounds", "0"], "--rounds"),
    (["bw", "--iov", "0"], "--iov"),
    (["lat", "--rails", "0"], "--rails"),
    (["bw", "--connect", "zz"], "--connect"),
    (["bw", "--connect", "00"], "--connect"),
    (["bw", "--vs", "nixl", "--connect", "00"], "--vs"),
    (["bw", "--listen", "--provider", "shm", "--provider", "tcp;ofi_rxm"], "--listen"),
    (["bw", "--json", "/proc/no/such/dir/x.json"], "--json"),
])
def test_usage_errors_exit_2_before_anything_runs(argv, says, capsys):
    """Each of these used to exit 1 (or after the whole run, with a traceback for --json):
    the docs' exit status 2 is a bad command line, refused before any engine opens."""
    with pytest.raises(SystemExit) as ei:
        bench.main(argv)
    assert ei.value.code == 2
    assert says in capsys.readouterr().err
