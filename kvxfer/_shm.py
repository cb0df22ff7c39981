"""What libfabric's shm provider leaves in /dev/shm when its process dies unclosed.

shm names its region ``/dev/shm/<pid>:<n>:<m>`` (16 MiB) and kvxfer puts its doorbell beside
it (``<name>.kxbell``, src/bell.c); a closed endpoint removes both, a killed process leaves
them. Whoever spawned and killed the process removes them here (a leaf: os only).
"""

from __future__ import annotations

import os

__all__ = ["remove_files"]


def remove_files(pid: int) -> None:
    """Remove ``/dev/shm/<pid>:*`` (call only for a process that is gone)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if name.startswith(f"{pid}:"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
