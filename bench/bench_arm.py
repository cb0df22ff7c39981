"""What arming costs alone: ``Watcher.arm_groups`` of G groups of N triples, in a process with
nothing else running (one engine pair, one watcher), p50 and p10 of ``--iters`` calls, each
followed by ``disarm_tag`` (issue 28, item 1: set beside ``bench/bench_schedule.py``, whose
``schedule()`` spends most of its time in the same call).

    python bench/bench_arm.py [--provider shm] [--groups 32] [--triples 64] [--iters 300] [--poll-us 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kvxfer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--groups", type=int, default=32, help="groups (a rank pair's layers)")
    ap.add_argument("--triples", type=int, default=64, help="triples per group")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--poll-us", type=float, default=10.0)
    a = ap.parse_args()
    g, n = a.groups, a.triples
    with kvxfer.Engine(a.provider, "127.0.0.1") as eng, kvxfer.Engine(a.provider, "127.0.0.1") as tgt:
        src = np.zeros(g * n * 4096, np.uint8)
        dst = np.zeros(g * n * 4096, np.uint8)
        smr, dmr = eng.register(src), tgt.register(dst)
        peer, rr = eng.connect(tgt.address), eng.remote(dmr.descriptor())
        w = eng.watcher(poll_us=a.poll_us)
        so = np.arange(g * n, dtype=np.uint64) * 4096
        ln = np.full(g * n, 2048, np.uint64)
        starts = np.arange(0, g * n + 1, n)
        th = np.arange(1, g + 1, dtype=np.uint64) + 10**9     # never reached: nothing posts
        took = []
        for k in range(a.iters):
            t0 = time.perf_counter_ns()
            w.arm_groups(th, smr, peer, rr, so, so, ln, starts, tag=k + 1)
            took.append(time.perf_counter_ns() - t0)
            w.disarm_tag(k + 1)
        took.sort()
        print(f"arm_groups of {g} groups x {n} triples ({a.provider}, poll {a.poll_us:g} us): "
              f"p50 {statistics.median(took) / 1e3:.1f} us, p10 {took[len(took) // 10] / 1e3:.1f} us")
        w.close()
        smr.close()
        dmr.close()


if __name__ == "__main__":
    main()
