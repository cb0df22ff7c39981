"""Child processes for tests and checks: spawn one, get back its result or its traceback, tell a crash from a failure.

Used by tests/ (``import _procs``: tests/conftest.py puts tests/ on ``sys.path``) and by
bench/gpu_check.py. Children start with the ``spawn`` method, as a TP worker would (CUDA does
not survive ``fork``). A child's stderr goes to a file the parent reads, so a failure report
carries the child's last words.

A crash is read from the exit status **and** stderr: libfabric's psm2 provider installs a
SIGSEGV handler that prints a backtrace and "terminated with signal 11" and then exits with
status 1, so a segfault can look like an ordinary failed exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

CTX = mp.get_context("spawn")
DEADLINE = 60.0

# what a crashing child leaves on stderr: psm2's handler, the shell's and Python's fault reports, ASan
_CRASH_LINES = re.compile(r"terminated with signal (\d+)|Segmentation fault|Fatal Python error|ERROR: AddressSanitizer")


class ChildFailed(AssertionError):
    """A child raised (its traceback is the message), crashed, hung or exited badly."""


class ChildSkipped(Exception):
    """A child asked to be reported as skipped (it raised ``Skip``-like exceptions)."""


def crash_reason(exitcode: int | None, stderr: str) -> str | None:
    """Why a child looks crashed, or None: killed by a signal, or a crash line on its stderr."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    m = _CRASH_LINES.search(stderr or "")
    if m is None:
        return None
    sig = int(m.group(1)) if m.group(1) else None
    names = {s.value: s.name for s in signal.Signals}
    return f"crashed: {m.group(0)}" + (f" ({names[sig]})" if sig in names else "")


def _trampoline(fn: Callable[..., Any], conn: Any, stderr_path: str, with_conn: bool,
                skip: tuple[type[BaseException], ...], args: tuple[Any, ...]) -> None:
    """Runs in the child: stderr to the parent's file, then ('ok', value), ('skip', text) or ('err', traceback)."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        value = fn(conn, *args) if with_conn else fn(*args)
        conn.send(("ok", value))
    except skip as e:
        conn.send(("skip", str(e) if type(e).__name__ == "Skip" else f"{type(e).__name__}: {e}"))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


class Child:
    """One spawned child: ``result()`` its next message, ``finish()`` result plus a clean exit."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str | None = None, with_conn: bool = False,
                 skip: tuple[type[BaseException], ...] = (), deadline: float = DEADLINE) -> None:
        self.name = name or getattr(fn, "__name__", "child")
        self.deadline = deadline
        fd, self._stderr_path = tempfile.mkstemp(prefix="kvxfer-child-", suffix=".stderr")
        os.close(fd)
        self.conn, theirs = CTX.Pipe()
        self.proc = CTX.Process(target=_trampoline, args=(fn, theirs, self._stderr_path, with_conn, skip, args),
                                name=self.name, daemon=True)
        self.proc.start()
        theirs.close()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def stderr(self, limit: int = 6000) -> str:
        """The child's stderr so far (the last ``limit`` characters)."""
        try:
            with open(self._stderr_path, errors="replace") as f:
                return f.read()[-limit:]
        except OSError:
            return ""

    def describe(self, what: str) -> str:
        """``what`` happened to the child, with its exit status, any crash and its stderr."""
        self.proc.join(1)
        why = crash_reason(self.proc.exitcode, self.stderr())
        text = f"{self.name}: {what} (exit status {self.proc.exitcode}"
        text += f", {why})" if why else ")"
        err = self.stderr().strip()
        return text + (f"\n--- its stderr ---\n{err}" if err else "")

    def result(self, timeout: float | None = None) -> Any:
        """The value of the child's next message: a note it sent itself as ``(tag, value)`` on its
        conn, or its return value. Raises ``ChildFailed``
        with its traceback (or crash, or silence), ``ChildSkipped`` when it skipped."""
        timeout = self.deadline if timeout is None else timeout
        if not self.conn.poll(timeout):
            self.kill()
            raise ChildFailed(self.describe(f"no answer within {timeout} s"))
        try:
            msg = self.conn.recv()
        except EOFError:
            raise ChildFailed(self.describe("died without an answer")) from None
        status, value = msg  # ('ok', value), ('err', traceback), ('skip', why) or a note (tag, value)
        if status == "err":
            raise ChildFailed(f"{self.name} failed:\n{value}")
        if status == "skip":
            raise ChildSkipped(value)
        return value

    def join(self, timeout: float | None = None) -> int | None:
        """Wait for the exit; ``ChildFailed`` if it hangs, crashes or exits non-zero."""
        timeout = self.deadline if timeout is None else timeout
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.kill()
            raise ChildFailed(self.describe(f"did not exit within {timeout} s"))
        if self.proc.exitcode != 0 or crash_reason(self.proc.exitcode, self.stderr()):
            raise ChildFailed(self.describe("exited badly"))
        return self.proc.exitcode

    def finish(self, timeout: float | None = None) -> Any:
        """``result()`` then ``join()``, and ``close()`` whatever happens."""
        try:
            value = self.result(timeout)
            self.join(timeout)
            return value
        finally:
            self.close()

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            remove_shm_files(self.proc.pid)

    def close(self, grace: float = 0.0, keep_process: bool = False) -> None:
        """Give the child ``grace`` seconds to exit, kill it if it has not, release every fd
        (``keep_process``: all but the ``Process`` object, whose ``exitcode`` stays readable)."""
        if self.conn.closed:
            return
        if self.proc.is_alive() and grace:
            self.proc.join(grace)
        self.kill()
        self.conn.close()
        if self.proc.exitcode is not None and not keep_process:
            self.proc.close()  # releases the sentinel fd
        try:
            os.unlink(self._stderr_path)
        except OSError:
            pass


def remove_shm_files(pid: int) -> None:
    """What a killed process's shm endpoints leave in /dev/shm: shm's regions ``<pid>:<n>:<m>``
    and kvxfer's doorbells (harmless since kvxfer clears its own name, but they pile up)."""
    from kvxfer._shm import remove_files

    remove_files(pid)


def dead_shm_files(since: set) -> None:
    """Remove the shm files that appeared after the listing ``since`` and whose process is
    gone (a test that kills processes it did not spawn itself, e.g. the demo's drill)."""
    for name in set(os.listdir("/dev/shm")) - since:
        pid = name.split(":")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_shm_files(int(pid))


def spawn(fn: Callable[..., Any], *args: Any, **kw: Any) -> Child:
    """Start ``fn(*args)`` (``fn(conn, *args)`` with ``with_conn=True``) in a spawned child."""
    return Child(fn, *args, **kw)


def run_in_child(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args)`` in a child, its value returned here; a crash or hang becomes ``ChildFailed``."""
    timeout = kw.pop("timeout", None)
    return spawn(fn, *args, **kw).finish(timeout)


class Children:
    """Several children that end together: ``close(grace)`` waits, then kills, and keeps the exit codes."""

    def __init__(self) -> None:
        self.items: list[Child] = []
        self.exitcodes: dict[str, int | None] = {}
        self.crashes: dict[str, str] = {}

    def spawn(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Child:
        child = spawn(fn, *args, name=name, **kw)
        self.items.append(child)
        return child

    def close(self, grace: float) -> None:
        for c in self.items:
            c.proc.join(grace)
            self.exitcodes[c.name] = c.proc.exitcode
            why = crash_reason(c.proc.exitcode, c.stderr())
            if why:
                self.crashes[c.name] = f"{why}\n{c.stderr()}"
            c.close()
