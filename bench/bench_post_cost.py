"""Posting cost from Python: one request's writes over many region pairs (one region per layer).

Two engines in this process (the target only reads its CQ). For each request size it times
the call alone (validation + native posting, not the wire), median of many calls, in three
ways: 32 ``write_batch`` calls (the old per-region road), one ``write_groups`` call, and one
``write_pairs`` call over a ``RegionPairs`` table checked once (what the messenger does).
Pages are scattered (no coalescing): every page of every layer is its own triple.

    python bench/bench_post_cost.py [--provider shm] [--layers 32] [--page 1024]

Goal (issue 13): at most 0.5 us of posting per page from Python.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvxfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=1024, help="bytes per page and layer")
    ap.add_argument("--sizes", default="1,16,256,1024", help="pages per request")
    args = ap.parse_args()
    node = None if args.provider.startswith("shm") else "127.0.0.1"
    sizes = [int(x) for x in args.sizes.split(",")]
    pool = 2 * max(sizes)
    L, PB = args.layers, args.page
    a, b = kvxfer.Engine(args.provider, node), kvxfer.Engine(args.provider, node)
    try:
        src = [a.register(np.zeros(pool * PB, np.uint8)) for _ in range(L)]
        dmr = [b.register(np.zeros(pool * PB, np.uint8)) for _ in range(L)]
        peer = a.connect(b.address)
        dst = [a.remote(m.descriptor()) for m in dmr]
        pairs = a.region_pairs(peer, zip(src, dst))
        imm = [0]

        def timed(post, n):
            ts = []
            for _ in range(n):
                imm[0] += 1
                t0 = time.perf_counter()
                writes = post(imm[0])
                ts.append(time.perf_counter() - t0)
                b.expect(imm[0], writes).wait(30)          # the target reads its CQ: data lands
            ts.sort()
            return ts[len(ts) // 2]

        print(f"{args.provider}: posting one request of P pages x {L} layers (one region per layer), "
              f"{PB} B per page and layer, scattered; median call time, and per page-layer")
        print(f"{'pages':>6} {'write_batch x' + str(L):>22} {'write_groups':>22} {'write_pairs':>22}")
        for n in sizes:
            off = np.arange(n, dtype=np.uint64) * np.uint64(2 * PB)
            ln = np.full(n, PB, np.uint64)
            groups = [(src[k], dst[k], off, off, ln) for k in range(L)]
            so, lnn, counts = np.tile(off, L), np.tile(ln, L), np.full(L, n)
            reps = 200 if n <= 16 else 20
            r1 = timed(lambda i: sum(a.write_batch(s, peer, d, x, y, z, imm=i).num_writes
                                     for s, d, x, y, z in groups), reps)
            r2 = timed(lambda i: a.write_groups(peer, groups, imm=i).num_writes, reps)
            r3 = timed(lambda i: a.write_pairs(pairs, so, so, lnn, counts, imm=i).num_writes, reps)
            cells = [f"{r * 1e6:8.1f} us {r * 1e6 / (n * L):6.3f}/pg" for r in (r1, r2, r3)]
            print(f"{n:>6} " + " ".join(f"{c:>22}" for c in cells))
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
