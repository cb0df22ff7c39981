"""Soak: N paged transfers (and optionally N connects) in one process; prints RSS, fds and
threads over time as JSON, for the RSS slope (bytes per transfer after warm-up).

    python tests/stress/_soak.py PROVIDER N [connects]
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


WARM_MESSAGES = 400_000


def soak(provider: str, n: int) -> dict:
    import kvxfer

    a, b = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src = np.ones(64 * 4096, np.uint8)
    dst = np.zeros(64 * 4096, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer, rr = a.connect(b.address), a.remote(md.descriptor())
    pages = np.arange(64)
    rev = pages[::-1].copy()
    # Warm-up: libfabric's pools are touched for the first time, page by page: tcp;ofi_rxm's
    # grow RSS by ~48 B per message until ~300,000 messages (two engines), then stay flat
    # (docs/reliability.md, finding 7). The warm-up covers 400,000 messages or n/10 transfers.
    per = a.write_pages(ms, pages, peer, rr, rev, 4096, imm=7).num_writes
    b.expect(7, per).wait(10)
    warm = max(1000, n // 10, -(-WARM_MESSAGES // per))
    samples = []
    t0 = time.monotonic()
    for i in range(n + warm):
        t = a.write_pages(ms, pages, peer, rr, rev, 4096, imm=7)
        c = b.expect(7, t.num_writes)
        t.wait(10)
        c.wait(10)
        if i >= warm and (i - warm) % max(1, n // 20) == 0:
            samples.append((i - warm, rss(), fds(), threads()))
    samples.append((n, rss(), fds(), threads()))
    xs = np.array([s[0] for s in samples], float)
    ys = np.array([s[1] for s in samples], float)
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(xs) > 1 else 0.0
    a.close()
    b.close()
    return {
        "provider": provider, "transfers": n, "warm_up_transfers": warm, "messages_per_transfer": per,
        "seconds": round(time.monotonic() - t0, 1),
        "rss_slope_bytes_per_transfer": round(slope, 2),
        "rss_growth_bytes": int(ys[-1] - ys[0]),
        "rss_mib": [round(y / 2**20, 2) for y in ys],
        "fds": [samples[0][2], samples[-1][2]], "threads": [samples[0][3], samples[-1][3]],
    }


def connects(provider: str, n: int) -> dict:
    """n connects to one peer (deduplicated), then n connects to n/10 distinct peers (each
    connected and disconnected 10 times: every connect a fresh address-vector insert)."""
    import kvxfer

    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    r0, f0, t0 = rss(), fds(), time.monotonic()
    peers = {id(a.connect(b.address)) for _ in range(n)}
    distinct = 0
    for _ in range(max(1, n // 10)):
        c = kvxfer.Engine(provider, "127.0.0.1")
        for _ in range(10):
            p = a.connect(c.address)
            a.disconnect(p)
            distinct += 1
        c.close()
    out = {"provider": provider, "same_peer_connects": n, "distinct_peers": len(peers),
           "distinct_connects": distinct, "distinct_engines": max(1, n // 10), "seconds": round(time.monotonic() - t0, 1), "rss_growth_bytes": rss() - r0, "fd_growth": fds() - f0}
    a.close()
    b.close()
    return out


if __name__ == "__main__":
    prov, n = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "connects":
        print(json.dumps(connects(prov, n)))
    else:
        print(json.dumps(soak(prov, n)))
