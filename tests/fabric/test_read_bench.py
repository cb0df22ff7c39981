"""``kvxfer-bench bw --op read`` for real, on each provider: every case read from the target
beside its write in the same run, each checked byte for byte at the reader (kvxfer/cli/_bw_read.py)."""

from __future__ import annotations

import json

from kvxfer.cli import bench


def test_bw_op_read_beside_write(provider, tmp_path, capsys):
    out = tmp_path / "bw.json"
    rc = bench.main(["bw", "--provider", provider, "--case", "write:64K", "--case", "pages:4Kx64",
                     "--case", "memmove:1M", "--op", "write", "--op", "read", "--iters", "3", "--warmup", "1",
                     "--timeout", "20", "-q", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "read pages 4K x 64" in text and "read 64K" in text and "FAIL" not in text
    (run,) = json.loads(out.read_text())["runs"]
    rows = [(r["case"], r.get("op", "write")) for r in run["results"]]
    # each case written then read, the baseline once
    assert rows == [("memmove:1M", "write"), ("write:64K", "write"), ("write:64K", "read"),
                    ("pages:4Kx64", "write"), ("pages:4Kx64", "read")]
    for r in run["results"]:
        assert r["check"] == "ok" and r["iterations"] == 3 and r["gbps"] > 0
    reads = {r["case"]: r for r in run["results"] if r.get("op") == "read"}
    iov = run["info"]["iov"]
    # 64 scattered pages read with at most iov pieces a message (rules 1-2; rule 3 never)
    assert 1 <= reads["pages:4Kx64"]["writes"] <= -(-64 // iov)
    assert reads["pages:4Kx64"]["timing"] == "local completion"


def test_bw_op_read_alone(tmp_path, capsys):
    rc = bench.main(["bw", "--provider", "tcp;ofi_rxm", "--case", "pages:4Kx64", "--op", "read", "--iters", "2",
                     "--warmup", "1", "--timeout", "20", "-q", "--json", str(tmp_path / "bw.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    (run,) = json.loads((tmp_path / "bw.json").read_text())["runs"]
    assert [(r["case"], r.get("op")) for r in run["results"]] == [("pages:4Kx64", "read")]
