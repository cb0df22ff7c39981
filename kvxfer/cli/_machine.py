"""Facts about this machine that a benchmark report carries."""

from __future__ import annotations

import os

import numpy as np

import kvxfer

__all__ = ["machine_info"]


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
