"""A write target in its own process, driven over a pipe, for two-process tests.

The child owns an engine and a destination buffer; the test (the initiator) drives it with
small commands. A child's exception comes back as its traceback, so a failure in the other
process reads like a local one. Every wait has a deadline.
"""

from __future__ import annotations

import glob
import os
import signal
import time
import traceback

import numpy as np

from _procs import spawn


def _memory(kind: str, nbytes: int):
    """(what to register, a uint8 view of it): ``numpy`` (anonymous memory), ``memfd`` (a host
    KVBuffer: a sealed memfd, what shm peers write directly) or ``memfd-unsealed`` (a memfd
    mapped without seals, which a peer must not map: it could shrink under the mapping)."""
    if kind == "numpy":
        buf = np.zeros(nbytes, dtype=np.uint8)
        return buf, buf
    if kind == "memfd":
        from kvxfer import KVBuffer

        kv = KVBuffer.allocate(nbytes, "cpu")
        return kv, kv.numpy()[:nbytes]
    if kind == "memfd-unsealed":
        import mmap

        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        buf = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
        return buf, buf                   # fd stays open: the region's host share names it
    raise ValueError(f"unknown memory kind {kind!r}")


def _serve(conn, provider: str, nbytes: int, memory: str = "numpy", options: dict | None = None,
           readable: bool = False) -> None:
    import kvxfer

    try:
        eng = kvxfer.Engine(provider, "127.0.0.1", **(options or {}))
        obj, buf = _memory(memory, nbytes)
        mr = eng.register(obj, readable=readable)
        conn.send(("ready", eng.address, mr.descriptor(), os.getpid()))
        counters = {}
        while True:
            cmd, *args = conn.recv()
            if cmd == "expect":
                imm, count = args
                counters[imm] = eng.expect(imm, count)
                conn.send(("ok", None))
            elif cmd == "wait":
                imm, timeout = args
                c = counters.pop(imm)
                try:
                    c.wait(timeout)
                    conn.send(("ok", c.arrived))
                except kvxfer.errors.TimeoutError:
                    conn.send(("timeout", c.arrived))
            elif cmd == "read":
                off, n = args
                conn.send(("ok", bytes(buf[off : off + n])))
            elif cmd == "digest":
                conn.send(("ok", buf.copy()))
            elif cmd == "fill":
                buf[:] = args[0]
                conn.send(("ok", None))
            elif cmd == "count":          # the receiver's own count of writes into its region
                so, do, ln = args
                conn.send(("ok", eng.count_writes(so, do, ln, region=mr)))
            elif cmd == "banked":
                conn.send(("ok", eng.banked(args[0])))
            elif cmd == "discard":
                conn.send(("ok", eng.discard(args[0])))
            elif cmd == "stats":
                conn.send(("ok", eng.stats()))
            elif cmd == "recv":
                conn.send(("ok", eng.recv(args[0])))
            elif cmd == "connect":             # a peer of ours (it then hears of our regions' closes)
                eng.connect(args[0])
                conn.send(("ok", None))
            elif cmd == "close":               # deregister; the memory stays, mapped and live
                mr.close()
                conn.send(("ok", None))
            elif cmd == "close_engine":
                eng.close()
                conn.send(("ok", None))
            elif cmd == "register":            # the same memory as a new region
                mr = eng.register(obj)
                conn.send(("ok", mr.descriptor()))
            elif cmd == "close_fill_watch":
                # deregister under the initiator's writes; once close() returns none may land
                mr.close()
                buf[:] = 0
                time.sleep(args[0])
                conn.send(("ok", int(np.count_nonzero(buf))))
            elif cmd == "exit":
                if not eng.closed:
                    if not mr.closed:
                        mr.close()
                    eng.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass


class RemoteError(AssertionError):
    """An exception in the target process, with its traceback."""


class Target:
    """Start a target process; ``address``/``descriptor`` come from its engine. ``memory``:
    what its destination is (see ``_memory``); ``options``: its ``Engine`` keywords;
    ``readable``: peers may read its region too."""

    def __init__(self, provider: str, nbytes: int, timeout: float = 30.0, *, memory: str = "numpy",
                 options: dict | None = None, readable: bool = False) -> None:
        self.child = spawn(_serve, provider, nbytes, memory, options, readable, name="target", with_conn=True,
                           deadline=timeout)
        self.parent, self.proc = self.child.conn, self.child.proc
        self.timeout = timeout
        status, *rest = self._recv()
        if status != "ready":
            raise RemoteError(rest[0] if rest else status)
        self.address, self.descriptor, self.pid = rest

    def _recv(self):
        if not self.parent.poll(self.timeout):
            self.kill()
            raise RemoteError(self.child.describe(f"no answer within {self.timeout} s"))
        try:
            msg = self.parent.recv()
        except EOFError:  # died: a crash shows in its exit status and stderr
            raise RemoteError(self.child.describe("died without an answer")) from None
        if msg[0] == "error":
            raise RemoteError("in the target process:\n" + msg[1])
        return msg

    def call(self, *cmd):
        self.parent.send(cmd)
        status, value = self._recv()
        if status != "ok":
            raise RemoteError(f"{cmd[0]}: {status} ({value})")
        return value

    def expect(self, imm: int, count: int) -> None:
        self.call("expect", imm, count)

    def wait(self, imm: int, timeout: float = 20.0):
        self.parent.send(("wait", imm, timeout))
        return self._recv()

    def memory(self) -> np.ndarray:
        return self.call("digest")

    def kill(self) -> None:
        if self.parent.closed:
            return
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        # a killed shm endpoint leaves its region behind, named after the pid
        for leftover in glob.glob(f"/dev/shm/{self.pid if hasattr(self, 'pid') else self.proc.pid}:*"):
            try:
                os.unlink(leftover)
            except OSError:
                pass

    def close(self) -> None:
        if self.parent.closed:
            return
        if self.proc.is_alive():
            try:
                self.parent.send(("exit",))
                if self.parent.poll(10):
                    self.parent.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(10)
        self.kill()
        self.child.close(keep_process=True)  # tests read proc.exitcode after close

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
