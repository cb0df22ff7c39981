"""The tests' vLLM instances as processes: start them together (their imports take minutes),
talk to each over a pipe, kill them, and tear everything down with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: every instance's startup (a vLLM import is minutes on 2 loaded cores) must end by then
START_TIMEOUT = float(os.environ.get("KVXFER_VLLM_START_TIMEOUT", "900"))


class Instance:
    """One ``_instance.py`` process (see its docstring); ``call`` sends a command and waits."""

    def __init__(self, name: str, model: Path, role: str, opts: dict, logdir: Path,
                 env: Optional[dict] = None) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        e = dict(os.environ)      # kvxfer as this interpreter finds it (installed, or PYTHONPATH)
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_instance.py"), str(model), role, json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, env=e, start_new_session=True)
        self.pid = self.proc.pid
        self.ready: Optional[dict] = None

    def _read(self, timeout: float) -> dict:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box:
            raise TimeoutError(f"{self.name}: no answer within {timeout} s; log tail:\n{self.tail()}")
        if not box[0]:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()}); log tail:\n{self.tail()}")
        return json.loads(box[0])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict:
        if self.ready is None:
            self.ready = self._read(timeout)
        return self.ready

    def send(self, **cmd: Any) -> None:
        self.wait_ready()
        self._op = cmd.get("op")
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 300) -> dict:
        r = self._read(timeout)
        if not r.get("ok"):
            raise AssertionError(f"{self.name} {self._op}: {r.get('error')}")
        return r

    def call(self, timeout: float = 300, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.answer(timeout)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9 of the instance and every process it started (its session)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def close(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        try:
            os.killpg(self.pid, signal.SIGKILL)      # children of a default-layout engine
        except (ProcessLookupError, PermissionError):
            pass


def make_model(path: Path) -> Path:
    """The tiny model (tests/vllm/_model.py), made in a child of this interpreter."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                        f"from _model import make_model; make_model({str(path)!r})"],
                       check=True, timeout=600, stdout=subprocess.DEVNULL)
    return path
