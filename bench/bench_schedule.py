"""What ``schedule()`` costs per armed write, against the native posting cost per write.

For each ``kvxfer-bench kv`` preset and prompt length (the same layouts, shardings and caps as
``kvxfer/cli/kv.py``), one process holds a prefill and a decode messenger on two engines. Per
request it times

* **schedule**: ``Messenger.schedule([(send, 0, num_tokens, src_pages)])`` of a fresh
  ``stream()`` Send (checking, planning or the per-page template, and arming every layer's
  writes on the native watcher), divided by the triples it armed;
* **write_pairs**: one ``Engine.write_pairs`` call per rank pair posting exactly the same
  triples (the region pairs checked once beforehand, as the messenger does for ``send()``),
  divided by the same count: the native posting cost per write;

alternating the two, median of ``--repeat`` requests each, so both sides of the ratio come
from the same run and the same machine phase (issue 28, item 1: ``ratio`` at most 3).

    python bench/bench_schedule.py [--provider shm] [--tokens 256,1024,4096] [--repeat 7]
        [--preset NAME]... [--profile] [--poll-us 10] [--progress-rt 0,5]

``--profile`` prints the top of a cProfile of the schedule calls per case (``SORT=cumulative``,
``TOP=30`` in the environment: another order, more lines). ``pairs done``: ms
from the write_pairs calls to the completion of their transfers (median). ``--progress-rt``
opens both engines with ``Engine(progress_rt_priority=)``; its progress thread then preempts
the posting caller and moves the queued rest itself, so ``write_pairs ms`` grows while ``pairs
done`` shrinks: compare ``pairs done`` then (docs/benchmarks.md, issue 28).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import kvxfer
from kvxfer.cli.kv import PRESETS, _layouts, fit_tokens

try:
    from kvxfer.cli.kv import DEFAULT_PRESETS
except ImportError:                       # a checkout from before the acceptance preset
    DEFAULT_PRESETS = tuple(sorted(PRESETS))


def _open(preset: str, tokens: int, page_size: int, provider: str, poll_us=None, progress_rt: int = 0):
    sl, ss, dl, ds = _layouts(preset, tokens, page_size)
    node = None if provider.startswith("shm") else "127.0.0.1"
    ea = kvxfer.Engine(provider, node, progress_rt_priority=progress_rt)
    eb = kvxfer.Engine(provider, node, progress_rt_priority=progress_rt)
    kvp = {r: [np.full(s, r + 1, np.uint8) for s in sl.region_sizes(ss)] for r in range(ss.tp_size)}
    kvd = {r: [np.zeros(s, np.uint8) for s in dl.region_sizes(ds)] for r in range(ds.tp_size)}
    p = kvxfer.Messenger(ea, sl, ss, kvp, peer_timeout=60, watch_poll_us=poll_us)
    d = kvxfer.Messenger(eb, dl, ds, kvd, peer_timeout=60)
    pg = d.connect(p.handshake())
    return p, d, pg, (ea, eb, kvp, kvd)


def _schedule_once(p, d, pg, tokens: int, rid: str, prof=None) -> tuple[float, int, list, int]:
    """One streamed request: (schedule seconds, triples armed, the armed batches, messages armed)."""
    npg = -(-tokens // p.layout.page_size)
    r = d.receive(pg, rid, list(range(npg)), tokens)
    (req,) = p.requests(timeout=30)
    s = p.stream(req)
    src = np.arange(npg)
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    p.schedule([(s, 0, req.num_tokens, src)])
    dt = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    s.finish()
    msgs = sum(e.num_writes for e in s.entries) - 1          # the messages armed, less the context
    batches = _batches(p, req, src)
    n = sum(len(b[6]) for b in batches)
    p.layer_counter.bump(p.layout.num_layers)
    r.wait(60)
    s.wait(60)
    r.release()
    return dt, n, batches, msgs


def _batches(p, req, src) -> list:
    """What ``schedule`` armed for the whole request, as ``(s, d, sr, dr, so, do, ln)``: from
    ``Prefiller.arm_batches`` (one per region pair), or ``layer_batches`` (per layer) before it
    (so the same script measures a checkout from before the change)."""
    pf = p._prefill
    if hasattr(pf, "arm_batches"):
        return [(b[0], b[1], b[2], b[3], b[5], b[6], b[7]) for b in pf.arm_batches(req.peer, req, np.arange(len(req.dst_pages)), src)]
    return [b for lay in pf.layer_batches(req.peer, req, req.dst_pages, src) for b in lay]


def _pairs_posts(p, pg_back, batches: list) -> list:
    """The same triples as ``write_pairs`` calls, one per rank pair: (RegionPairs, so, do, ln, counts)."""
    by_rank: dict = {}
    for s, dd, sr, dr, so, do, ln in batches:
        by_rank.setdefault((s, dd), {}).setdefault((sr, dr), []).append((so, do, ln))
    eng = p._node.engine if hasattr(p, "_node") else p.engine
    out = []
    for (s, dd), regs in by_rank.items():
        keys = list(regs)
        rp = eng.region_pairs(pg_back.peer, [(p._prefill.local[s][sr], pg_back.remote[dd][dr]) for sr, dr in keys])
        so = np.concatenate([x[0] for k in keys for x in regs[k]]).astype(np.uint64)
        do = np.concatenate([x[1] for k in keys for x in regs[k]]).astype(np.uint64)
        ln = np.concatenate([x[2] for k in keys for x in regs[k]]).astype(np.uint64)
        counts = np.array([sum(len(x[2]) for x in regs[k]) for k in keys], np.int64)
        out.append((eng, rp, so, do, ln, counts))
    return out


def _write_pairs_once(posts: list, imm: int) -> tuple[float, float]:
    """(seconds the write_pairs calls took, seconds until their transfers completed)."""
    t0 = time.perf_counter()
    ts = [eng.write_pairs(rp, so, do, ln, counts, imm=imm) for eng, rp, so, do, ln, counts in posts]
    dt = time.perf_counter() - t0
    for t in ts:
        t.wait(60)
    return dt, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-mib", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--poll-us", type=float, default=None,
                    help="the prefill messenger's watch_poll_us (default: the messenger's, 0 on a CPU counter)")
    ap.add_argument("--progress-rt", default="0", metavar="PRIO[,PRIO...]",
                    help="Engine(progress_rt_priority=) of both engines; several: each case once per value, "
                         "back to back (default 0)")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} provider {args.provider}, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    prios = [int(x) for x in args.progress_rt.split(",")]
    print(f"{'preset':<16} {'tokens':>6} {'rt':>3} {'msgs':>6} {'writes':>7} {'schedule ms':>11} {'us/write':>8} "
          f"{'write_pairs ms':>14} {'us/write':>8} {'ratio':>6} {'pairs done':>10}")
    done = set()
    for preset in args.preset or DEFAULT_PRESETS:
        for want in (int(x) for x in args.tokens.split(",")):
            tokens = fit_tokens(preset, want, args.page_size, args.max_mib)
            if (preset, tokens) in done:
                continue
            done.add((preset, tokens))
            for prio in prios:
                _case(args, preset, tokens, prio)
    print(f"# load at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _case(args, preset: str, tokens: int, prio: int) -> None:
    """One row: ``--repeat`` requests of one case, schedule and write_pairs alternating."""
    p, d, pg, keep = _open(preset, tokens, args.page_size, args.provider, args.poll_us, prio)
    rt = keep[0].stats()["progress_rt"]
    try:
        back = p._peers[d.uid]
        _, n, batches, msgs = _schedule_once(p, d, pg, tokens, "warm")     # templates, tables, pages
        posts = _pairs_posts(p, back, batches)
        _write_pairs_once(posts, 1)
        prof = None
        if args.profile:
            import cProfile
            prof = cProfile.Profile()
        st, wt, wd = [], [], []
        for i in range(args.repeat):
            st.append(_schedule_once(p, d, pg, tokens, f"r{i}", prof)[0])
            call, done = _write_pairs_once(posts, 2 + i)
            wt.append(call)
            wd.append(done)
        s_med, w_med = statistics.median(st), statistics.median(wt)
        print(f"{preset:<16} {tokens:>6} {rt:>3} {msgs:>6} {n:>7} {s_med * 1e3:>11.3f} {s_med / n * 1e6:>8.2f} "
              f"{w_med * 1e3:>14.3f} {w_med / n * 1e6:>8.2f} {s_med / w_med:>6.2f} {statistics.median(wd) * 1e3:>10.2f}",
              flush=True)
        if prof is not None:
            import pstats
            pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "12")))
    finally:
        d.close()
        p.close()
        keep[0].close()
        keep[1].close()


if __name__ == "__main__":
    main()
