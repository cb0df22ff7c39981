"""The --vs comparison without any peer library: matching, ratios, table, JSON and chart."""

from __future__ import annotations

import json

import pytest

from kvxfer.cli import bench
from kvxfer.cli._compare import chart, compare, table


def _res(case, label, letter, gbps, local, check="ok", kind="pages"):
    return {"case": case, "label": label, "letter": letter, "kind": kind, "gbps": gbps, "local_p50_s": local,
            "check": check}


OURS = [_res("memmove:64M", "memmove 64M", "memmove", 9.0, None, kind="memmove"),
        _res("write:4K", "write 4K", None, 0.1, 10e-6, kind="write"),
        _res("pages:16Kx4096", "pages 16K x 4096 (b)", "b", 4.0, 0.02),
        _res("pages:2Kx32768", "pages 2K x 32768 (c)", "c", 1.0, 0.05)]
THEIRS = [_res("write:4K", "write 4K", None, 0.05, 40e-6, kind="write"),
          _res("pages:16Kx4096", "pages 16K x 4096 (b)", "b", 2.0, 0.03, check="FAIL")]


def test_rows_match_cases_and_ratios_favour_kvxfer_above_one():
    rows = compare("shm", OURS, THEIRS, "nixl")
    assert [r["case"] for r in rows] == ["write:4K", "pages:16Kx4096"]   # memmove and unmatched (c) left out
    w, b = rows
    assert w["gbps_ratio"] == pytest.approx(2.0) and w["sender_ratio"] == pytest.approx(4.0)
    assert b["gbps_ratio"] == pytest.approx(2.0) and b["sender_ratio"] == pytest.approx(1.5)
    assert b["goal"] == 2.0 and w["goal"] is None
    assert b["peer_check"] == "FAIL"
    json.dumps(rows)   # plain data


def test_a_read_row_is_held_against_the_peers_read_of_the_same_case_never_its_write():
    """``--op write --op read --vs nixl``: both ops of one case share its spec; each is matched
    with the peer's row of the same op, and the write goals (issue 13) are not read goals."""
    read = lambda r, gbps, local: dict(r, op="read", label="read " + r["label"], gbps=gbps, local_p50_s=local)  # noqa: E731
    ours = [OURS[2], read(OURS[2], 3.0, 0.01)]
    theirs = [read(THEIRS[1], 1.0, 0.04), dict(THEIRS[1], check="ok")]     # the peer's read first
    w, r = compare("shm", ours, theirs, "nixl")
    assert (w["label"], w["gbps_ratio"], w["goal"]) == ("pages 16K x 4096 (b)", pytest.approx(2.0), 2.0)
    assert (r["label"], r["gbps_ratio"], r["sender_ratio"], r["goal"]) == \
        ("read pages 16K x 4096 (b)", pytest.approx(3.0), pytest.approx(4.0), None)
    assert r["peer_check"] == "FAIL" and w["peer_check"] == "ok"
    assert "read pages 16K x 4096 (b)" in table([w, r])


def test_missing_numbers_give_no_ratio():
    (row,) = compare("tcp", [_res("write:4K", "w", None, None, 0.0, kind="write")],
                     [_res("write:4K", "w", None, 1.0, float("nan"), kind="write")], "nixl")
    assert row["gbps_ratio"] is None and row["sender_ratio"] is None


def test_table_has_a_line_per_row_and_flags_failed_checks():
    rows = compare("shm", OURS, THEIRS, "nixl")
    text = table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "x nixl" in lines[0] and "goal" in lines[0]
    assert lines[2].split()[-1] == "ok" and lines[3].split()[-1] == "FAIL"
    assert "2.00" in lines[3] and "10.0 us" in lines[2] and "40.0 us" in lines[2]
    assert table([]) == ""


def test_two_peers_get_a_block_each_and_one_chart(tmp_path):
    rows = compare("tcp", OURS, THEIRS, "nixl") + compare("tcp", OURS, THEIRS[:1], "mooncake")
    blocks = table(rows).split("\n\n")
    assert len(blocks) == 2
    assert "x nixl" in blocks[0] and "mooncake" not in blocks[0]
    assert "x mooncake" in blocks[1] and len(blocks[1].splitlines()) == 3
    why = chart(rows, str(tmp_path / "two.png"))
    assert why is None or "matplotlib" in why


def test_mooncake_stands_in_for_tcp_only():
    from kvxfer.cli import _mooncake

    assert _mooncake.supports("tcp;ofi_rxm") is None
    assert "tcp only" in _mooncake.supports("shm")


def test_chart_is_a_png_or_says_why_not(tmp_path):
    path = tmp_path / "vs.png"
    why = chart(compare("shm", OURS, THEIRS, "nixl"), str(path))
    if why is None:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in why
    assert chart([], str(path)) == "nothing to draw"


def test_vs_is_refused_with_connect(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["bw", "--vs", "nixl", "--connect", "00"])
    assert e.value.code == 2 and "--connect" in capsys.readouterr().err


def test_vs_accepts_only_known_peers(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["bw", "--vs", "bogus"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# -- bw --rounds ----------------------------------------------------------------------------
def test_median_round_keeps_one_whole_round_and_every_rounds_figures():
    from kvxfer.cli._compare import median_round

    rounds = [_res("pages:16Kx4096", "b", "b", g, t) for g, t in ((3.0, 0.02), (1.0, 0.06), (2.0, 0.03))]
    m = median_round(rounds)
    assert m["gbps"] == 2.0 and m["local_p50_s"] == 0.03 and m["round"] == 2   # one round, whole
    assert [r["gbps"] for r in m["rounds"]] == [3.0, 1.0, 2.0] and m["check"] == "ok"
    assert median_round(rounds[:2])["gbps"] == 1.0                              # even: the lower middle
    bad = median_round([rounds[0], dict(rounds[1], check="FAIL", problems=["iteration 3: 2 pages differ"],
                                        bad_iterations=1), rounds[2]])
    assert bad["gbps"] == 2.0 and bad["check"] == "FAIL"                         # any failed round fails it
    assert bad["problems"] == ["round 2: iteration 3: 2 pages differ"] and bad["bad_iterations"] == 1
    with pytest.raises(ValueError):
        median_round([])


def test_rounds_pair_up_in_the_comparison_and_the_table_shows_their_range():
    from kvxfer.cli._compare import median_round

    ours = median_round([_res("pages:16Kx4096", "b", "b", g, t) for g, t in ((3.0, 0.2), (3.2, 0.02), (1.5, 0.02))])
    theirs = median_round([_res("pages:16Kx4096", "b", "b", g, 0.04) for g in (1.0, 2.0, 1.5)])
    (row,) = compare("tcp", [ours], [theirs], "nixl")
    assert row["gbps_ratio"] == pytest.approx(3.0 / 1.5) and row["rounds"] == 3   # medians of each figure
    # the median-GB/s round (3.0) is whole in the results, but the sender p50 is the median of
    # the rounds' (0.02), not that round's
    assert row["kvxfer_sender_p50_s"] == pytest.approx(0.02) and row["sender_ratio"] == pytest.approx(2.0)
    assert row["round_ratios"] == pytest.approx([3.0, 1.6, 1.0])                  # round k against round k
    assert ours["local_p50_s"] == 0.2 and row["sender_round_ratios"] == pytest.approx([0.2, 2.0, 2.0])
    line = table([row]).splitlines()[2]
    assert "1.00-3.00" in line and "0.20-2.00" in line
    (plain,) = compare("tcp", OURS[2:3], THEIRS[1:], "nixl")                     # one round: no range
    assert "round_ratios" not in plain and " - " in table([plain]).splitlines()[2]


def test_an_even_number_of_rounds_compares_the_rows_it_prints():
    from kvxfer.cli._compare import median_round

    ours = median_round([_res("pages:16Kx4096", "b", "b", g, 0.02) for g in (3.0, 1.0)])
    theirs = median_round([_res("pages:16Kx4096", "b", "b", g, 0.04) for g in (2.0, 0.5)])
    (row,) = compare("tcp", [ours], [theirs], "nixl")
    assert row["kvxfer_gbps"] == ours["gbps"] == 1.0 and row["peer_gbps"] == theirs["gbps"] == 0.5
    assert row["gbps_ratio"] == pytest.approx(2.0)
