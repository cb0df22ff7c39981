"""Local store servers for the tests and ``kvxfer-bench cluster``: a real ``etcd`` or
``redis-server`` (Debian's packages) on a free port of one address, its files in a temporary
directory, stopped (``kill -9`` too) and restarted on the same port.

``argv`` may be wrapped (``prefix=["ip", "netns", "exec", NS]``) to run the server inside a
network namespace. Every wait has a deadline; ``close()`` kills the process and removes the
directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Optional, Sequence

from kvxfer.errors import RendezvousError, UnsupportedError

BINARIES = {"etcd": "etcd", "redis": "redis-server"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def available(kind: str) -> Optional[str]:
    """Why a ``kind`` server cannot run here, or None."""
    b = BINARIES.get(kind)
    if b is None:
        return f"no local server for {kind!r}"
    if shutil.which(b) is None:
        pkg = "etcd-server" if kind == "etcd" else "redis-server"
        return f"{b} is not installed (apt-get install -y {pkg})"
    return None


class Server:
    """One ``etcd`` or ``redis-server`` process listening on ``host:port``."""

    def __init__(self, kind: str, host: str = "127.0.0.1", port: Optional[int] = None,
                 prefix: Sequence[str] = (), namespace: str = "kvx") -> None:
        why = available(kind)
        if why:
            raise UnsupportedError(why)
        self.kind = kind
        self.host = host
        self.port = port or free_port(host if not prefix else "127.0.0.1")
        self.peer_port = free_port("127.0.0.1")
        self.prefix = list(prefix)
        self.dir = tempfile.mkdtemp(prefix=f"kvxfer-{kind}-")
        self.url = f"{kind}://{host}:{self.port}/{namespace}"
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.dir, "server.log")

    def argv(self) -> list[str]:
        if self.kind == "etcd":
            return [*self.prefix, "etcd", "--name", "kvx", "--data-dir", os.path.join(self.dir, "data"),
                    "--listen-client-urls", f"http://{self.host}:{self.port}",
                    "--advertise-client-urls", f"http://{self.host}:{self.port}",
                    "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                    "--initial-cluster", f"kvx=http://127.0.0.1:{self.peer_port}",
                    "--log-level", "error", "--logger", "zap"]
        return [*self.prefix, "redis-server", "--bind", self.host, "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]

    def start(self, timeout: float = 20.0) -> "Server":
        """Start (or restart, same port and data) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, close_fds=True)
        finally:
            log.close()
        end = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise RendezvousError(f"{self.kind} exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > end:
                self.stop()
                raise RendezvousError(f"{self.kind} did not answer on {self.host}:{self.port} within {timeout} s: "
                                      f"{self.log()}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        if self.prefix:           # inside a namespace: ask from there
            probe = [*self.prefix, "python3", "-c",
                     "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.5); "
                     "s.sendall(sys.argv[3].encode()); sys.exit(0 if s.recv(64) else 1)",
                     self.host, str(self.port), self._probe()]
            try:
                return subprocess.run(probe, capture_output=True, timeout=5).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        try:
            with socket.create_connection((self.host, self.port), 0.5) as s:
                s.settimeout(1.0)
                s.sendall(self._probe().encode())
                return bool(s.recv(64))
        except OSError:
            return False

    def _probe(self) -> str:
        if self.kind == "etcd":
            return "GET /health HTTP/1.0\r\n\r\n"
        return "PING\r\n"

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Stop it (``kill -9`` by default); the data directory stays for a restart."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def log(self, limit: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-limit:]
        except OSError:
            return ""

    def close(self) -> None:
        """Kill it and remove its directory. Idempotent."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
