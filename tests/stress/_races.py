"""The races of issue 12, as a script: one process runs N iterations of one race and prints
one JSON line per iteration; tests/stress/harness.py runs it, restarts it after a crash or a
hang, and counts. A crash must never be hidden by a provider's signal handler, so the parent
judges a child by its exit status *and* its stderr.

    python tests/stress/_races.py RACE PROVIDER N        # iterations, JSON lines on stdout
    python tests/stress/_races.py serve PROVIDER          # a target process, driven on stdin

Races (same = both engines in this process; cross = the target is a `serve` process):
  close_target_{same,cross}     the target closes while the initiator floods it
  close_initiator_{same,cross}  the initiator closes while flooding; the target must live on
  post_closed_{same,cross}      the target closed; then write, write_pages and send to it
  sigkill                       the target process is SIGKILLed mid-flood (cross only)
  cancel_first_same             the first transfer to a new peer is cancelled at once (shm's
                                connection handshake left half-way), then both engines close
Each iteration records: ok, the error type the initiator saw, seconds from the event to a
PeerError (peer_s), seconds each close took (close_s), threads left over (threads_left).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 64 * 1024
PAGES = 64                       # 4 MiB per transfer
NBYTES = PAGE * PAGES
PEER_DEADLINE = float(os.environ.get("KVXFER_STRESS_PEER_S", "0.5"))   # engines' peer_timeout (s)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _engine(provider):
    import kvxfer

    try:
        return kvxfer.Engine(provider, "127.0.0.1", peer_timeout=PEER_DEADLINE)
    except TypeError:      # an engine without the option (to reproduce on older trees)
        return kvxfer.Engine(provider, "127.0.0.1")


def _timed_close(eng) -> float:
    t0 = time.monotonic()
    eng.close()
    return time.monotonic() - t0


class Flood:
    """Keep up to `depth` paged transfers of 4 MiB in flight from `eng` to (peer, rr)."""

    def __init__(self, eng, src_mr, peer, rr, depth=4):
        self.eng, self.mr, self.peer, self.rr, self.depth = eng, src_mr, peer, rr, depth
        self.pending = []
        self.rng = np.random.default_rng()

    def pump(self):
        from kvxfer import errors

        self.pending = [t for t in self.pending if not t.done]
        while len(self.pending) < self.depth:
            try:
                self.pending.append(self.eng.write_pages(self.mr, np.arange(PAGES), self.peer, self.rr,
                                                         self.rng.permutation(PAGES), PAGE, imm=5))
            except (errors.PeerError, errors.ClosedError):
                return False
        return True

    def settle(self, timeout):
        """Wait for every pending transfer; the first error type seen (None: all succeeded)."""
        from kvxfer import errors

        seen = None
        deadline = time.monotonic() + timeout
        for t in self.pending:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except errors.KvxferError as exc:
                seen = seen or type(exc).__name__
        return seen


# -- the target process ------------------------------------------------------------------

def serve(provider: str) -> None:
    """Commands on stdin, one per line: open | close | exit. Answers on stdout."""
    import kvxfer  # noqa: F401

    eng = None
    buf = np.zeros(NBYTES, np.uint8)
    out = sys.stdout
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "open":
            eng = _engine(provider)
            mr = eng.register(buf)
            out.write(f"ready {eng.address.hex()} {mr.descriptor().hex()}\n")
        elif cmd[0] == "close":
            delay = float(cmd[1]) if len(cmd) > 1 else 0.0
            time.sleep(delay)
            dt = _timed_close(eng) if eng is not None else 0.0
            parked = int(bool(eng is not None and eng._parked))
            eng = None
            out.write(f"closed {dt:.6f} {_threads()} {parked}\n")
        elif cmd[0] == "exit":
            if eng is not None:
                eng.close()
            out.write("bye\n")
            out.flush()
            return
        out.flush()


class Server:
    """A `serve` child. Its death by a signal, or a crash line on its stderr, is a crash."""

    def __init__(self, provider):
        gdb = os.environ.get("KVXFER_STRESS_GDB")     # a file: the target runs under gdb, backtraces go there
        pre = ["gdb", "-q", "-batch", "-ex", f"set logging file {gdb}", "-ex", "set logging overwrite off",
               "-ex", "set logging redirect on", "-ex", "set logging enabled on", "-ex", "handle SIGPIPE nostop noprint",
               "-ex", "run", "-ex", "thread apply all bt 12", "-ex", "info registers", "-ex", "x/8i $pc-16", "--args"] if gdb else []
        self.p = subprocess.Popen(pre + [sys.executable, os.path.join(HERE, "_races.py"), "serve", provider],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)

    def ask(self, line, timeout=10.0):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.answer(timeout)

    def answer(self, timeout=10.0):
        import select

        deadline = time.monotonic() + timeout
        while True:      # lines other than answers (a debugger's) are skipped
            r, _, _ = select.select([self.p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise TimeoutError("target did not answer")
            line = self.p.stdout.readline()
            if not line:       # its status and the end of its stderr say why
                self.p.wait(10)
                err = self.p.stderr.read() if self.p.stderr else ""
                raise EOFError(f"target died (status {self.p.returncode}): {err[-1500:]}")
            if line.split() and line.split()[0] in ("ready", "closed", "bye"):
                return line.split()

    def open(self):
        _, addr, desc = self.ask("open")
        return bytes.fromhex(addr), bytes.fromhex(desc)

    def crashed(self) -> str | None:
        """Why the target counts as crashed (None if it did not)."""
        rc = self.p.poll()
        if rc is None:
            return None
        err = self.p.stderr.read() if self.p.stderr else ""
        if rc < 0 and rc != -signal.SIGKILL:
            return f"target killed by signal {-rc}: {err[-500:]}"
        if rc != 0 or "terminated with signal" in err or "Segmentation" in err:
            return f"target exit {rc}: {err[-500:]}"
        return None

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            try:
                f.close()
            except OSError:
                pass
        # a killed shm endpoint leaves its region behind, named after the pid
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"{self.p.pid}:"):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass


# -- iterations -----------------------------------------------------------------------------

def _pair_same(provider, first_write=True):
    a, b = _engine(provider), _engine(provider)
    src = np.ones(NBYTES, np.uint8)
    dst = np.zeros(NBYTES, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer, rr = a.connect(b.address), a.remote(md.descriptor())
    # one message first: shm maps a peer lazily (docs/architecture.md, known limits)
    if first_write:
        a.write(ms, 0, peer, rr, 0, 8, imm=1).wait(10)
    return a, b, ms, peer, rr, (src, dst, md)     # md held: a dropped region is deregistered


def _initiator(provider, addr, desc):
    a = _engine(provider)
    try:
        src = np.ones(NBYTES, np.uint8)
        ms = a.register(src)
        peer, rr = a.connect(addr), a.remote(desc)
        a.write(ms, 0, peer, rr, 0, 8, imm=1).wait(10)
    except BaseException:
        a.close()
        raise
    return a, ms, peer, rr, src


def _post_all(a, ms, peer, rr):
    """write, write_pages and send to a peer that is gone: each must end with a kvxfer error
    or success within the peer deadline, never crash or hang. Returns (first error, seconds)."""
    from kvxfer import errors

    seen = None
    t0 = time.monotonic()
    for kind in ("write", "pages", "send"):
        try:
            if kind == "write":
                a.write(ms, 0, peer, rr, 0, 65536, imm=2).wait(PEER_DEADLINE * 3)
            elif kind == "pages":
                a.write_pages(ms, np.arange(16), peer, rr, np.arange(16), 4096, imm=2).wait(PEER_DEADLINE * 3)
            else:
                a.send(peer, b"are you there", timeout=PEER_DEADLINE * 3)
        except errors.KvxferError as exc:
            seen = seen or type(exc).__name__
    return seen, time.monotonic() - t0


def iteration(race, provider, state, rng):
    rec = {"race": race}
    base = _threads()
    if race.endswith("_same"):
        a, b, ms, peer, rr, keep = _pair_same(provider, first_write=race != "cancel_first_same")
        if race == "cancel_first_same":
            from kvxfer import errors

            n = NBYTES // 1024         # small pages: more posts queued behind the handshake
            t = a.write_pages(ms, np.arange(n), peer, rr, np.random.default_rng(rng.getrandbits(32)).permutation(n), 1024, imm=3)
            t.cancel()
            try:
                t.wait(PEER_DEADLINE * 3)
            except errors.PeerError as exc:          # cancelled before all was posted
                rec["error"] = type(exc).__name__
            if t.posted:           # the fence: every posted write must still land
                c = b.expect(3, t.posted)
                try:
                    c.wait(PEER_DEADLINE * 3)
                except errors.TimeoutError:
                    rec["fence_lost"] = f"{c.arrived}/{t.posted}"
            rec["close_s"] = [_timed_close(a), _timed_close(b)]
        elif race == "close_target_same":
            fl = Flood(a, ms, peer, rr)
            fl.pump()
            time.sleep(rng.uniform(0, 0.02))
            fl.pump()
            rec["close_s"] = [_timed_close(b)]
            rec["parked"] = b._parked
            t0 = time.monotonic()
            rec["error"] = fl.settle(PEER_DEADLINE * 3)
            rec["peer_s"] = time.monotonic() - t0
            rec["close_s"].append(_timed_close(a))
        elif race == "close_initiator_same":
            fl = Flood(a, ms, peer, rr)
            fl.pump()
            time.sleep(rng.uniform(0, 0.02))
            rec["close_s"] = [_timed_close(a)]
            # the target lives on: it still takes writes from a fresh engine
            from kvxfer import errors

            c = None
            region = b.register(keep[1])     # held: a dropped region is deregistered at once
            try:
                c, cs, cp, crr, ckeep = _initiator(provider, b.address, region.descriptor())
            except errors.KvxferError as exc:
                rec["target_broken"] = type(exc).__name__
            rec["close_s"] += ([_timed_close(c)] if c is not None else []) + [_timed_close(b)]
        else:  # post_closed_same
            rec["close_s"] = [_timed_close(b)]
            rec["error"], rec["peer_s"] = _post_all(a, ms, peer, rr)
            rec["close_s"].append(_timed_close(a))
    else:
        srv = state.get("server")
        if srv is None or srv.p.poll() is not None:
            srv = state["server"] = Server(provider)
        addr, desc = srv.open()
        a, ms, peer, rr, keep = _initiator(provider, addr, desc)
        if race in ("close_target_cross", "sigkill"):
            fl = Flood(a, ms, peer, rr)
            fl.pump()
            if race == "sigkill":
                t_end = time.monotonic() + rng.uniform(0, 0.05)
                while time.monotonic() < t_end and fl.pump():
                    time.sleep(0.0005)
                t0 = time.monotonic()
                srv.kill()
                state.pop("server")
            else:
                srv.p.stdin.write(f"close {rng.uniform(0, 0.02):.4f}\n")
                srv.p.stdin.flush()
                t0 = time.monotonic()
            # keep it busy through the event: until the target said it closed (+20 ms)
            import select

            until = t0 + (0.05 if race == "sigkill" else 2.0)
            while time.monotonic() < until:
                if not fl.pump():
                    break
                if race != "sigkill" and select.select([srv.p.stdout], [], [], 0)[0]:
                    until = min(until, time.monotonic() + 0.02)
                time.sleep(0.0005)
            rec["error"] = fl.settle(PEER_DEADLINE * 3)
            rec["peer_s"] = time.monotonic() - t0
            if race == "close_target_cross":
                try:
                    ans = srv.answer(10)
                    rec["close_s"] = [float(ans[1])]
                    rec["parked"] = ans[3] == "1"
                except EOFError:
                    srv.p.wait(10)
                    rec["crash"] = srv.crashed() or f"target died (exit {srv.p.returncode})"
                    srv.kill()
                    state.pop("server", None)
            rec.setdefault("close_s", []).append(_timed_close(a))
        elif race == "close_initiator_cross":
            fl = Flood(a, ms, peer, rr)
            fl.pump()
            time.sleep(rng.uniform(0, 0.02))
            rec["close_s"] = [_timed_close(a)]
            try:
                ans = srv.ask("close")
                rec["close_s"].append(float(ans[1]))
                rec["parked"] = ans[3] == "1"
            except EOFError:
                srv.p.wait(10)
                rec["crash"] = srv.crashed() or f"target died (exit {srv.p.returncode})"
                srv.kill()
                state.pop("server", None)
        else:  # post_closed_cross
            ans = srv.ask("close")
            rec["close_s"] = [float(ans[1])]
            rec["parked"] = ans[3] == "1"
            rec["error"], rec["peer_s"] = _post_all(a, ms, peer, rr)
            rec["close_s"].append(_timed_close(a))
        if race != "sigkill":
            why = srv.crashed()
            if why:
                rec["crash"] = why
                srv.kill()                   # reaps it and removes its /dev/shm region
                state.pop("server", None)
            elif rec.get("parked"):      # a parked endpoint holds tens of MiB: start afresh
                try:
                    srv.ask("exit", 5)
                except (TimeoutError, EOFError, OSError):
                    pass
                srv.kill()
                state.pop("server", None)
    time.sleep(0.01)   # let exiting threads leave /proc
    rec["threads_left"] = max(0, _threads() - base)
    rec["ok"] = "crash" not in rec and max(rec.get("close_s", [0])) <= 1.0 and rec["threads_left"] == 0
    return rec


def main(argv):
    if argv[1] == "serve":
        return serve(argv[2])
    race, provider, n = argv[1], argv[2], int(argv[3])
    rng = random.Random(int(argv[4]) if len(argv) > 4 else None)
    state = {}
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    try:
        for i in range(n):
            signal.alarm(60)         # an iteration that hangs this long dies by SIGALRM: a hang
            rec = iteration(race, provider, state, rng)
            rec["i"] = i
            print(json.dumps(rec), flush=True)
        signal.alarm(0)
    finally:
        srv = state.get("server")
        if srv is not None:
            try:
                srv.ask("exit", 5)
            except (TimeoutError, EOFError, OSError):
                pass
            srv.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
