"""Facts about this machine that a benchmark report carries."""

from __future__ import annotations

import os

import numpy as np

import kvxfer

__all__ = ["machine_info", "pin_halves", "unpin", "pin_from_env", "pinned_halves", "PIN_ENV"]

#: ``kvxfer-bench --pin``: the CPUs the benchmark's target processes (kvxfer's and the --vs
#: peers') pin themselves to, set by the initiator for its children
PIN_ENV = "KVXFER_BENCH_CPUS"


def machine_info() -> dict:
    """CPU, OS, versions and boot id: the header of every report (the boot id tells whether two processes share a clock)."""
    import platform

    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "node": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kvxfer": kvxfer.__version__,
        "boot_id": _boot_id(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pin_halves() -> tuple:
    """``--pin``: this thread (the initiator's main thread, before any engine starts its
    threads) onto the first half of the CPUs it may use, the target processes it starts onto
    the second (through ``PIN_ENV``). Returns what ``unpin`` restores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"kvxfer-bench: --pin needs at least 2 CPUs; this process may use {len(cpus)}")
    half = len(cpus) // 2
    before = (set(cpus), os.environ.get(PIN_ENV))
    os.sched_setaffinity(0, cpus[:half])
    os.environ[PIN_ENV] = ",".join(str(c) for c in cpus[half:])
    return before


def unpin(before: tuple) -> None:
    """Undo ``pin_halves`` (the benchmark may run inside a longer-lived process, e.g. a test)."""
    cpus, env = before
    os.sched_setaffinity(0, cpus)
    if env is None:
        os.environ.pop(PIN_ENV, None)
    else:
        os.environ[PIN_ENV] = env


def pin_from_env() -> None:
    """In a target process: pin onto the CPUs the initiator chose (``PIN_ENV``), if any,
    before any engine starts its threads."""
    v = os.environ.get(PIN_ENV)
    if v:
        os.sched_setaffinity(0, {int(c) for c in v.split(",")})


def pinned_halves() -> "str | None":
    """``fi_pingpong -C``'s argument for the halves ``--pin`` chose, None without ``--pin``."""
    v = os.environ.get(PIN_ENV)
    if not v:
        return None
    mine = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return f"{mine}:{v}"
