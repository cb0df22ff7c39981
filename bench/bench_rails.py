"""Striping over rails: paged-write bandwidth with 1..N endpoints per engine, one process.

    .venv/bin/python bench/bench_rails.py --provider shm --rails 1 2 --page 16K --pages 4096

Both engines live in this process (each rail has its own progress thread); destination pages
are a random permutation of a pool twice the size; time is from the write_pages call to the
receiver's counter completing. The stand-in NICs are the provider's one domain ("lo" for
tcp;ofi_rxm on loopback, "shm" for shm), named once per rail.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvxfer


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def run(provider: str, rails: int, page: int, n: int, iters: int) -> float:
    domain = "shm" if provider == "shm" else "lo"
    with kvxfer.Engine(provider, "127.0.0.1", nics=[domain] * rails) as a, \
         kvxfer.Engine(provider, "127.0.0.1", nics=[domain] * rails) as b:
        src = np.ones(n * page, np.uint8)
        dst = np.zeros(2 * n * page, np.uint8)
        ms, md = a.register(src), b.register(dst)
        peer, rr = a.connect(b.address), a.remote(md.descriptor())
        rng = np.random.default_rng(0)
        times = []
        for it in range(iters + 3):
            dp = rng.permutation(2 * n)[:n]
            t0 = time.perf_counter()
            t = a.write_pages(ms, np.arange(n), peer, rr, dp, page, imm=it)
            b.expect(it, t.num_writes).wait(60)
            times.append(time.perf_counter() - t0)
            t.wait(60)
        times = sorted(times[3:])
        return n * page / times[len(times) // 2] / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--provider", default="shm")
    p.add_argument("--rails", type=int, nargs="+", default=[1, 2])
    p.add_argument("--page", type=size, default=16 << 10)
    p.add_argument("--pages", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    for r in a.rails:
        gbs = run(a.provider, r, a.page, a.pages, a.iters)
        print(f"{a.provider:12s} rails={r} page={a.page} pages={a.pages}  p50 {gbs:.2f} GB/s")


if __name__ == "__main__":
    main()
