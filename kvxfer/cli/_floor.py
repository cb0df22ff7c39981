"""The floor: bench/fi_pingpong.c, plain libfabric with no kvxfer layer, run in the same session.

``kvxfer-bench lat`` prints the provider's own round trip beside kvxfer's, so machine load
affects both. The C source ships in the repository's bench/ (not in a wheel); it is compiled
once with ``cc`` against ``pkg-config libfabric`` into ``build/`` of the checkout (or
``$KVXFER_CACHE``). Where that cannot be done the floor is reported missing, with the reason,
and the benchmark goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

__all__ = ["source", "binary", "run_floor", "FloorUnavailable"]


class FloorUnavailable(Exception):
    """The floor program cannot be built or run here (the message says why)."""


def source() -> Path:
    """bench/fi_pingpong.c of the checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "bench" / "fi_pingpong.c"


def binary() -> Path:
    """Path of the compiled floor program, building it when missing or older than its source."""
    src = source()
    if not src.exists():
        raise FloorUnavailable(f"{src} not found (the floor ships with the source checkout)")
    out_dir = Path(os.environ.get("KVXFER_CACHE") or src.parents[1] / "build")
    exe = out_dir / "fi_pingpong"
    if exe.exists() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc or not shutil.which("pkg-config"):
        raise FloorUnavailable("needs a C compiler and pkg-config to build bench/fi_pingpong.c")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "libfabric"], capture_output=True, text=True)
    if flags.returncode:
        raise FloorUnavailable(f"pkg-config libfabric: {flags.stderr.strip()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_suffix(f".tmp{os.getpid()}")
    r = subprocess.run([cc, "-O2", "-pthread", "-o", str(tmp), str(src), *flags.stdout.split()], capture_output=True, text=True)
    if r.returncode:
        raise FloorUnavailable(f"building {src.name} failed: {r.stderr.strip()[-400:]}")
    os.replace(tmp, exe)
    return exe


def run_floor(provider: str, *, mode: str = "lat", size: int = 8, iters: int = 10000, warmup: int = 500,
              page_bytes: int = 0, pages: int = 0, iov: int = 16, timeout: float = 120.0,
              extra: Optional[list] = None) -> dict:
    """Run the floor once; its JSON line as a dict. ``mode``: "lat" (round trips of ``size``
    bytes) or "pages" (``pages`` × ``page_bytes`` scattered, ``iov`` per message)."""
    exe = binary()
    argv = [str(exe), "-m", mode, "-p", provider, "-n", str(iters), "-w", str(warmup)]
    if mode == "lat":
        argv += ["-s", str(size)]
    else:
        argv += ["-P", str(page_bytes), "-N", str(pages), "-I", str(iov)]
    argv += list(extra or [])
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FloorUnavailable(f"{exe.name} took longer than {timeout} s") from None
    if r.returncode:
        raise FloorUnavailable(f"{exe.name} exited with {r.returncode}: {r.stderr.strip()[-300:]}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise FloorUnavailable(f"{exe.name} printed no result: {r.stdout[-200:]!r}") from None
