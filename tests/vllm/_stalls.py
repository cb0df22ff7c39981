"""A stall watch for one test instance process: windows where its Python threads did not run,
who had the CPU meanwhile, and a messenger thread stuck inside one call, with its stack.

A thread of its own wakes every ``TICK`` s. Woken more than ``AFTER`` s late, it records the
window (``stalls``: its start, its length), every thread's CPU time in it
(``/proc/self/task/*/stat``, named by Python's ``threading`` names where a thread has one,
else by its comm) and the host's load and CPU pressure: one thread of this process running all
along while the others did not points at a thread holding the GIL, none of them running at
the host starving the process. Each wake-up it also looks at the messenger's two looping
threads (``WATCHED``, whose waits are at most 50 ms): one found in the same frame at the same
instruction for more than ``AFTER`` s is stuck in one call, and ``stuck`` gets its stack
(``sys._current_frames``, read with the GIL: nothing is stopped, nothing read unsafely) and,
once it moves on, for how long (docs/reliability.md, finding 29).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

TICK = 0.25
AFTER = 3.0
WATCHED = ("kvxfer-msg", "kvxfer-msg-send")


def _read(path: str) -> str:
    """A /proc file's text, stripped; "" if it cannot be read (its thread ended)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _cpu_ms() -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        st = _read(f"/proc/self/task/{tid}/stat")
        if st:                                   # (a thread that ended meanwhile reads "")
            f = st[st.rfind(")") + 2:].split()
            out[int(tid)] = (int(f[11]) + int(f[12])) * 1e3 / tick
    return out


def _names() -> dict[int, str]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in names:
            names[int(tid)] = _read(f"/proc/self/task/{tid}/comm") + f"/{tid}"
    return names


class StallWatch:
    """Start once; ``stalls`` and ``stuck`` are what it saw (dicts, JSON-ready)."""

    def __init__(self) -> None:
        self.stalls: list[dict] = []
        self.stuck: list[dict] = []
        self._seen: dict[int, tuple] = {}       # thread ident -> (frame key, since, its report or None)
        self._t = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._t.start()

    def _run(self) -> None:
        before, t0 = _cpu_ms(), time.monotonic()
        while True:
            time.sleep(TICK)
            now, cpu = time.monotonic(), _cpu_ms()
            late = now - t0 - TICK
            if late > AFTER:
                names = _names()
                used = {tid: ms - before.get(tid, 0.0) for tid, ms in cpu.items()}
                ran = {names.get(tid, str(tid)): round(ms) for tid, ms in used.items() if ms >= 1}
                self.stalls.append({"at": round(time.time() - late - TICK, 3), "seconds": round(late + TICK, 3),
                                    "cpu_ms_by_thread": ran, "loadavg": _read("/proc/loadavg"),
                                    "cpu_pressure": _read("/proc/pressure/cpu").splitlines()[:1]})
            before, t0 = cpu, now
            self._look(now)

    def _look(self, now: float) -> None:
        frames = sys._current_frames()
        for t in threading.enumerate():
            if t.name not in WATCHED or t.ident not in frames:
                continue
            f = frames[t.ident]
            key = (id(f), f.f_lasti, f.f_lineno)
            old = self._seen.get(t.ident)
            if old is None or old[0] != key:
                if old is not None and old[2] is not None:
                    old[2]["seconds"] = round(now - old[1], 3)       # how long, now that it moved on
                self._seen[t.ident] = (key, now, None)
            elif old[2] is None and now - old[1] > AFTER:
                rep = {"thread": t.name, "at": round(time.time() - (now - old[1]), 3), "seconds": None,
                       "stack": traceback.format_stack(f)[-12:]}
                self.stuck.append(rep)
                self._seen[t.ident] = (key, old[1], rep)
