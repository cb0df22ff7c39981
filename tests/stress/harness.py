"""Run a race of tests/stress/_races.py for N iterations and count what went wrong.

A child that dies is restarted for the iterations left. It counts as a crash when its exit
status is a signal or non-zero, or its stderr has a crash report (a provider's own SIGSEGV
handler may turn a crash into `exit(1)` and a "terminated with signal" line): status and
stderr are both read, never only the signal. A child that prints nothing for `hang_s` is a
hang (killed with its process group).

    python tests/stress/harness.py RACE PROVIDER N      # prints the figures as one JSON line
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CRASH_MARKS = ("terminated with signal", "Segmentation fault", "Fatal Python error", "AddressSanitizer",
               "runtime error:")


def _crash_reason(rc: int, err: str) -> str | None:
    if rc < 0:
        return f"signal {-rc}"
    for m in CRASH_MARKS:
        if m in err:
            return f"exit {rc}: {m}"
    if rc != 0:
        return f"exit {rc}"
    return None


def run(race: str, provider: str, n: int, hang_s: float = 90.0, seed: int | None = None) -> dict:
    recs: list[dict] = []
    crashes: list[str] = []
    hangs = 0
    restarts = 0
    t_start = time.monotonic()
    while len(recs) + len(crashes) + hangs < n:
        left = n - len(recs) - len(crashes) - hangs
        args = [sys.executable, os.path.join(HERE, "_races.py"), race, provider, str(left)]
        if seed is not None:
            args.append(str(seed + restarts))
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        restarts += 1
        buf = ""
        hung = False
        while True:
            r, _, _ = select.select([p.stdout], [], [], hang_s)
            if not r:
                hung = True
                break
            line = p.stdout.readline()
            if not line:
                break
            rec = json.loads(line)
            recs.append(rec)
            if "crash" in rec:        # the target process crashed; this one lives on
                crashes.append(rec["crash"])
        if hung:
            os.killpg(p.pid, signal.SIGKILL)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
        buf = err or ""
        for leftover in os.listdir("/dev/shm"):      # regions of killed children
            if leftover.split(":")[0] == str(p.pid):
                try:
                    os.unlink(os.path.join("/dev/shm", leftover))
                except OSError:
                    pass
        if hung:
            hangs += 1
            continue
        why = _crash_reason(p.returncode, buf)
        if why is not None:
            if "SIGALRM" in buf or p.returncode == -signal.SIGALRM:
                hangs += 1          # the child's own per-iteration alarm: a hang
            else:
                crashes.append(f"{why}: {buf[-1500:]}")
        elif len(recs) + len(crashes) + hangs < n:
            crashes.append(f"child ended early (exit {p.returncode}): {buf[-1500:]}")
    ok = [r for r in recs if "crash" not in r]
    peer = sorted(r["peer_s"] for r in ok if r.get("peer_s") is not None)
    closes = [c for r in ok for c in r.get("close_s", [])]
    errs: dict[str, int] = {}
    for r in ok:
        k = str(r.get("error"))
        errs[k] = errs.get(k, 0) + 1
    return {
        "race": race,
        "provider": provider,
        "iterations": n,
        "crashes": len(crashes),
        "hangs": hangs,
        "leaked_threads": sum(r.get("threads_left", 0) for r in ok),
        "slow_closes": sum(1 for c in closes if c > 1.0),
        "parked": sum(1 for r in ok if r.get("parked")),
        "target_broken": sum(1 for r in ok if r.get("target_broken")),
        "fence_lost": sum(1 for r in ok if r.get("fence_lost")),
        "close_max_s": round(max(closes), 4) if closes else None,
        "peer_error_p50_s": round(statistics.median(peer), 4) if peer else None,
        "peer_error_max_s": round(max(peer), 4) if peer else None,
        "errors_seen": errs,
        "seconds": round(time.monotonic() - t_start, 1),
        "crash_samples": crashes[:3],
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
