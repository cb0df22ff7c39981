"""This process's shm files and memory, as the tests of closed shm engines count them (issue 26.5):
its /dev/shm entries (shm names them by pid), its resident set, and a bounded wait for a change."""

import os
import time


def mine() -> list:
    """This process's /dev/shm files, sorted."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{os.getpid()}:"))


def rss_mib() -> float:
    """This process's resident set (VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def until(cond, timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` s passed; its last value."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(step)
    return cond()
