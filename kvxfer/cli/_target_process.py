"""``TargetProcess``: a benchmark target running as a child process of the initiator, on this machine."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Optional

import kvxfer
from kvxfer._shm import remove_files as remove_shm_files
from kvxfer.cli._channel import ADDR_PREFIX, RemoteFailure

__all__ = ["TargetProcess"]


class TargetProcess:
    """A target child on this machine. Its stderr goes to a file, shown if it fails."""

    def __init__(self, provider: str, node: Optional[str], *, progress: str, idle_timeout: float,
                 deadline: float, start_timeout: float = 60.0, rails: int = 1) -> None:
        self._err = tempfile.TemporaryFile(mode="w+b")
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "kvxfer.cli.bench", "_target", "--provider", provider,
               "--progress", progress, "--parent-pid", str(os.getpid()),
               "--idle-timeout", str(idle_timeout), "--deadline", str(int(deadline)), "--rails", str(rails)]
        if node:
            cmd += ["--node", node]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._err,
                                     env=env, close_fds=True)
        self.address = self._read_address(start_timeout)

    def _read_address(self, timeout: float) -> bytes:
        out = self.proc.stdout
        end = time.monotonic() + timeout
        line = b""
        while time.monotonic() < end:
            r, _, _ = select.select([out], [], [], 0.2)
            if r:
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
                if b"\n" in line:
                    first = line.split(b"\n", 1)[0].decode(errors="replace")
                    if first.startswith(ADDR_PREFIX):
                        return bytes.fromhex(first[len(ADDR_PREFIX):].strip())
                    break
            elif self.proc.poll() is not None:
                break
        self.stop(kill=True)
        raise RemoteFailure(f"the target process did not start:\n{self.stderr_text()}")

    def dead(self) -> Optional[str]:
        rc = self.proc.poll()
        return None if rc is None else f"the target process exited with status {rc}:\n{self.stderr_text()}"

    def stderr_text(self, limit: int = 8000) -> str:
        try:
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-limit:]
        except (OSError, ValueError):
            return ""

    def stop(self, kill: bool = False, timeout: float = 10.0) -> Optional[int]:
        """Wait for the target to exit (``kill``: ask it to, SIGTERM, so that it closes its
        engine; SIGKILL after 3 s). A target killed outright leaves shm's region and bell in
        /dev/shm (16 MiB of tmpfs a run): those of its pid are removed once it is gone."""
        p = self.proc
        if p.poll() is None:
            if kill:
                p.terminate()
                timeout = min(timeout, 3.0)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p.returncode is not None and p.returncode < 0:
            remove_shm_files(p.pid)
        if p.stdout:
            p.stdout.close()
        return p.returncode

    def close(self) -> None:
        self.stop(kill=True, timeout=5)
        self._err.close()
