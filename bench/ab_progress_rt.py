"""Streaming tail with and without ``Engine(progress_rt_priority=)``, interleaved in one run.

Runs ``kvxfer-bench kv`` on the streaming acceptance shape (``--preset stream-tp2-tp1 --tokens
384 --layer-ms 20``: TP2 -> TP1, 16 layers of 1.5 MiB, a layer every 20 ms) per round, per
provider, alternating ``--progress-rt 0`` and ``--progress-rt PRIO`` (both nodes' engines opened
with the option), optionally beside a CPU hog (one busy loop per core), and prints one row per
run: one layer's transfer, the tail (decoder done - last bump), their ratio (issue 28 item 3:
goal at most 1.5), the priority each side's progress threads were granted, the load, and the
progress threads' CPU time (``/proc/<pid>/task/*/schedstat`` of threads named
``kvxfer-progress``, both processes, sampled while the run lasts).

    python bench/ab_progress_rt.py [--hog] [--rounds 2] [--prio 5] [--repeat 5]
        [--provider 'tcp;ofi_rxm' --provider shm] [--variant NAME=DIR]

``arm`` is the priority asked (0: the option off), or a ``--variant``'s name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _progress_cpu(pid: int, seen: dict) -> None:
    """Update ``seen[(pid, tid)] = (run_ns, wait_ns)`` for the progress threads of ``pid`` and its children."""
    try:
        kids = [int(x) for x in _read(f"/proc/{pid}/task/{pid}/children").split()]
    except OSError:
        kids = []
    for p in [pid] + kids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                if _read(f"/proc/{p}/task/{t}/comm").strip() != "kvxfer-progress":
                    continue
                run, wait, _ = map(int, _read(f"/proc/{p}/task/{t}/schedstat").split())
            except (OSError, ValueError):
                continue
            seen[(p, int(t))] = (run, wait)


def _one(provider: str, prio: int, repeat: str, tree: str = ROOT) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "kvxfer.cli.bench", "kv", "--preset", "stream-tp2-tp1", "--tokens", "384",
               "--layer-ms", "20", "--repeat", repeat, "--provider", provider, "--progress-rt", str(prio),
               "--json", f.name]
        load = os.getloadavg()[0]
        t0 = time.time()
        p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=tree), cwd=tree,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen: dict = {}
        while p.poll() is None:
            _progress_cpu(p.pid, seen)
            time.sleep(0.05)
        err = p.stderr.read()
        if p.returncode != 0:
            return {"provider": provider, "prio": prio, "error": err.strip().splitlines()[-1:] or p.returncode}
        r = json.loads(_read(f.name))["results"][0]
    return {"provider": provider, "prio": prio, "load": load, "secs": time.time() - t0,
            "layer_ms": r["layer_transfer_ms"], "tail_ms": r["stream_tail_ms"], "ratio": r["tail_over_layer"],
            "granted": (r.get("progress_rt"), r.get("prefill_progress_rt")),
            "progress_cpu_ms": sum(v[0] for v in seen.values()) / 1e6,
            "progress_wait_ms": sum(v[1] for v in seen.values()) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prio", type=int, default=5)
    ap.add_argument("--repeat", default="5")
    ap.add_argument("--hog", action="store_true", help="a busy loop per core beside the runs")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="one more arm per round: --prio with the kvxfer built in checkout DIR (an A/B of a change)")
    args = ap.parse_args()
    providers = args.provider or ["tcp;ofi_rxm", "shm"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(os.cpu_count() or 1)] \
        if args.hog else []
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, hog {bool(hogs)}, "
          f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    arms = [("0", 0, ROOT), (str(args.prio), args.prio, ROOT)]
    arms += [(v.split("=", 1)[0], args.prio, os.path.abspath(v.split("=", 1)[1])) for v in args.variant]
    print(f"{'round':>5} {'provider':<12} {'arm':>6} {'granted d/p':>11} {'load':>5} {'layer ms':>9} "
          f"{'tail ms':>9} {'tail/layer':>10} {'progress cpu ms':>15} {'runq wait ms':>12}", flush=True)
    try:
        for rnd in range(1, args.rounds + 1):
            for prov in providers:
                for name, prio, tree in arms:
                    r = _one(prov, prio, args.repeat, tree)
                    if "error" in r:
                        print(f"{rnd:>5} {prov:<12} {name:>6} failed: {r['error']}", flush=True)
                        continue
                    g = "/".join(str(x) for x in r["granted"])
                    print(f"{rnd:>5} {prov:<12} {name:>6} {g:>11} {r['load']:>5.1f} {r['layer_ms']:>9.2f} "
                          f"{r['tail_ms']:>9.2f} {r['ratio']:>10.2f} {r['progress_cpu_ms']:>15.1f} "
                          f"{r['progress_wait_ms']:>12.1f}", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"# end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
