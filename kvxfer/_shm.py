"""What libfabric's shm provider leaves in /dev/shm when its process dies unclosed.

shm names its region ``/dev/shm/<pid>:<n>:<m>`` (16 MiB) and kvxfer puts its doorbell beside
it (``<name>.kxbell``, src/bell.c); a closed endpoint removes both, a killed process leaves
them. Whoever spawned and killed the process removes them (``remove_files``); any later shm
engine of the same user reaps the files of owners that are gone (``reap_stale``). A leaf: os
and re only.
"""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["remove_files", "reap_stale"]

SHM_DIR = "/dev/shm"

#: shm's region and kvxfer's doorbell: ``<pid>:<n>:<m>`` and ``<pid>:<n>:<m>.kxbell``
_NAME = re.compile(r"(\d+):\d+:\d+(\.kxbell)?")

#: a process that started this long after a file was last modified cannot have made it; the
#: slack covers the clocks' resolutions (the boot time is in whole seconds, a start in clock
#: ticks, an mtime in the file system's)
_SLACK_S = 2.0


def remove_files(pid: int) -> None:
    """Remove ``/dev/shm/<pid>:*`` (call only for a process that is gone)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(f"{pid}:"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def process_start(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), or None when there is no such
    live process (none, or a zombie: its files are garbage too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()      # after "pid (comm) ": state is field 3
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    boot = _boot_time()
    if boot is None:
        return 0.0          # unknown: never taken for a reused pid
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def reap_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's shm files whose owning process is gone; return their names.

    The owner is the pid in the name. It is gone when no live process has that pid, or when
    the process that has it now started after the file was last modified (a reused pid: the
    file's maker existed when it wrote it). This process's own files are never touched (its
    engines' stale names are cleared when they open, src/names.c), nor other users'."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    me, uid, reaped = os.getpid(), os.getuid(), []
    starts: dict[int, Optional[float]] = {}
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == me or pid <= 0:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not (st.st_mode & 0o170000 == 0o100000):
            continue
        if pid not in starts:
            starts[pid] = process_start(pid)
        start = starts[pid]
        if start is not None and start <= st.st_mtime + _SLACK_S:
            continue            # a live process that may have made it
        try:
            os.unlink(path)
        except OSError:
            continue
        reaped.append(name)
    return reaped
