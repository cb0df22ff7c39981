"""Which threads wait for a CPU while a layer streams: per-thread run time and run-queue wait of both nodes.

Runs ``kvxfer-bench kv`` on the streaming acceptance shape (``--preset stream-tp2-tp1 --tokens
384 --layer-ms 20``: TP2 -> TP1, 16 layers of 1.5 MiB, a layer every 20 ms), optionally beside a
CPU hog (one busy loop per core), and samples ``/proc/<pid>/task/*/schedstat`` of the decode
process and its prefill child every 50 ms; prints the kv row and, per thread, the CPU time it
ran and the time it sat runnable in the run queue (issue 28 item 3: the progress threads'
``wait/run`` is the starvation).

    python bench/trace_stream_sched.py [--provider 'tcp;ofi_rxm'] [--repeat 3] [--hog] [--progress-rt 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _threads(pid: int) -> dict:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            run, wait, n = map(int, open(f"/proc/{pid}/task/{t}/schedstat").read().split())
        except (OSError, ValueError):
            continue
        out[(pid, int(t))] = (comm, run, wait, n)
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="tcp;ofi_rxm")
    ap.add_argument("--repeat", default="3")
    ap.add_argument("--hog", action="store_true", help="a busy loop per core beside the run")
    ap.add_argument("--progress-rt", default="0",
                    help="kvxfer-bench kv --progress-rt: both engines opened with progress_rt_priority=")
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(os.cpu_count() or 1)] \
        if args.hog else []
    try:
        env = dict(os.environ, PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "kvxfer.cli.bench", "kv", "--preset", "stream-tp2-tp1", "--tokens", "384",
               "--layer-ms", "20", "--repeat", args.repeat, "--provider", args.provider,
               "--progress-rt", args.progress_rt]
        print(f"# {time.strftime('%H:%M:%S', time.gmtime())} UTC load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, hog {bool(hogs)}: {' '.join(cmd[2:])}")
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        last: dict = {}
        while p.poll() is None:
            for pid in [p.pid] + _children(p.pid):
                last.update(_threads(pid))
            time.sleep(0.05)
        print(p.stdout.read().strip().splitlines()[-1])
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"{'process':>8} {'thread':<18} {'run ms':>8} {'runq wait ms':>12} {'slices':>7} {'wait/run':>8}")
    for (pid, _tid), (comm, run, wait, n) in sorted(last.items(), key=lambda kv: -kv[1][1])[:14]:
        who = "decode" if pid == p.pid else "prefill"
        print(f"{who:>8} {comm:<18} {run / 1e6:8.1f} {wait / 1e6:12.1f} {n:7d} {wait / max(run, 1):8.2f}")


if __name__ == "__main__":
    main()
