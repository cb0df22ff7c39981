"""The stores the rendezvous tests run against: a directory, and real etcd and Redis servers (Debian's
``etcd-server`` and ``redis-server``) started on 127.0.0.1 with free ports and temporary
directories, one per test module; torch's TCPStore only where torch is importable."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import shutil

from kvxfer.rendezvous import servers

BACKENDS = ("file", "redis", "etcd", "tcpstore")

_TCPSTORE_MASTER = """
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=30))
print("READY", flush=True)
sys.stdin.read()
"""


class TCPStoreServer:
    """A TCPStore master in a child process (the role a serving engine plays)."""

    def __init__(self) -> None:
        self.port = servers.free_port()
        self.url = f"tcpstore://127.0.0.1:{self.port}/kvx"
        self.proc = None

    def start(self, timeout: float = 20.0) -> "TCPStoreServer":
        self.proc = subprocess.Popen([sys.executable, "-c", _TCPSTORE_MASTER, str(self.port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError("TCPStore master did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()


def why_not(kind: str):
    if kind == "file":
        return None
    if kind == "tcpstore":
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            return "torch is not importable here (tcpstore:// needs torch.distributed)"
        return None
    try:
        __import__({"redis": "redis", "etcd": "etcd3gw"}[kind])
    except ImportError:
        return f"the {kind} client is not installed (pip install 'kvxfer[{kind}]')"
    return servers.available(kind)


class FileServer:
    """A directory as the 'server': stopping it renames the directory away."""

    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="kvxfer-file-")
        self.root = os.path.join(self.base, "store")
        self.url = "file://" + self.root

    def start(self):
        if os.path.isdir(self.root + ".off"):
            os.rename(self.root + ".off", self.root)
        return self

    def stop(self):
        if os.path.isdir(self.root):
            os.rename(self.root, self.root + ".off")

    def close(self):
        shutil.rmtree(self.base, ignore_errors=True)


def make_server(kind: str):
    if kind == "file":
        return FileServer().start()
    if kind == "tcpstore":
        return TCPStoreServer().start()
    return servers.Server(kind).start()


