"""Two "hosts" on one machine, for tests that must cross a real network stack.

``NetnsPair`` makes two network namespaces joined by a veth pair, with addresses from a
private range that exists only inside them, and deletes both however the test ends (a
pytest finalizer, and an atexit guard behind it). ``Child`` runs a process inside one of
them and reads its stdout lines with deadlines, so nothing a test starts can hang it.

Run as a script, this file is one of the processes the tests start in a namespace:
``target`` (registers a buffer, prints its address and descriptor, checks what lands),
``initiator`` (scattered pages with an imm, then one large write) and ``flood`` (writes
until the peer dies or vanishes, and reports how the failure surfaced). Each sets a
SIGALRM deadline as its last resort.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

PROVIDER = "tcp;ofi_rxm"
PAGE = 16 * 1024
SRC_PAGES = 384            # initiator's page pool
DST_PAGES = 1024           # target's page pool (16 MiB)
NPAGES = 256               # pages written, scattered on both sides
POOL = DST_PAGES * PAGE
LARGE = 32 * 1024 * 1024 - 1001   # one large write, at odd offsets on both sides
LARGE_SRC_OFF = SRC_PAGES * PAGE + 7
LARGE_DST_OFF = POOL + 123
SRC_BYTES = LARGE_SRC_OFF + LARGE + 64
DST_BYTES = LARGE_DST_OFF + LARGE + 4096   # a guard tail that nothing may touch
POISON = 0xA5
IMM_PAGES, IMM_LARGE = 7, 8

_NAME = re.compile(r"^kvx-[ab]-(\d+)$")


# --------------------------------------------------------------------------------------
# the namespaces
# --------------------------------------------------------------------------------------
class NetnsDenied(RuntimeError):
    """This process may not make network namespaces (an unprivileged container)."""


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install -y iproute2"
    return None


def _ip(*args: str, timeout: float = 10.0, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        text = (p.stderr or p.stdout).strip()
        if "Operation not permitted" in text or "Permission denied" in text:
            raise NetnsDenied(f"ip {' '.join(args)}: {text}")
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {text}")
    return p


def list_netns() -> list[str]:
    """Names of the namespaces `ip netns list` shows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(name: str) -> None:
    """SIGKILL what still runs in our namespace: only processes this test started get there."""
    p = _ip("netns", "pids", name, check=False)
    for tok in p.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


def sweep_stale() -> list[str]:
    """Delete kvx-a-/kvx-b- namespaces left by a run that was itself killed (its pid is gone)."""
    gone = []
    for name in list_netns():
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class NetnsPair:
    """Namespaces ``kvx-a-<pid>`` and ``kvx-b-<pid>`` joined by veth ``veth-a`` <-> ``veth-b``.

    The veth is created inside A with its peer placed straight into B, so nothing appears in
    the host's namespace, and 10.213.<x>.1/.2 route only between the two. ``destroy`` is
    idempotent; deleting A also removes the veth pair.
    """

    def __init__(self, tag: Optional[int] = None) -> None:
        tag = os.getpid() if tag is None else tag
        self.a, self.b = f"kvx-a-{tag}", f"kvx-b-{tag}"
        x = tag % 254 + 1
        self.addr_a, self.addr_b = f"10.213.{x}.1", f"10.213.{x}.2"
        self.dev_a, self.dev_b = "veth-a", "veth-b"
        self._made: list[str] = []
        self._guard = False

    def create(self) -> "NetnsPair":
        if not self._guard:
            atexit.register(self.destroy)
            guard_sigterm(self.destroy)
            self._guard = True
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                self._made.append(ns)
            # `ip netns exec` also remounts /sys, which some containers refuse even to root
            _ip("netns", "exec", self.a, sys.executable, "-c", "pass")
            _ip("-n", self.a, "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b, "netns", self.b)
            _ip("-n", self.a, "addr", "add", f"{self.addr_a}/24", "dev", self.dev_a)
            _ip("-n", self.b, "addr", "add", f"{self.addr_b}/24", "dev", self.dev_b)
            for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
            self.wait_carrier()
        except BaseException:
            self.destroy()
            raise
        return self

    def wait_carrier(self, timeout: float = 5.0) -> None:
        """Both ends report LOWER_UP (a veth comes up when both its ends are up)."""
        end = time.monotonic() + timeout
        while True:
            states = [_ip("-n", ns, "-o", "link", "show", dev).stdout for ns, dev in
                      ((self.a, self.dev_a), (self.b, self.dev_b))]
            if all("LOWER_UP" in s for s in states):
                return
            if time.monotonic() > end:
                raise RuntimeError(f"veth did not come up within {timeout} s: {states}")
            time.sleep(0.05)

    def set_link(self, up: bool) -> None:
        """Take B's end of the veth down (the wire is cut, no RST) or bring it back."""
        _ip("-n", self.b, "link", "set", self.dev_b, "up" if up else "down")
        if up:
            self.wait_carrier()

    def argv(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def destroy(self) -> None:
        for ns in reversed(self._made):
            _kill_inside(ns)
        for ns in reversed(self._made):
            try:
                _ip("netns", "del", ns, check=False)
            except subprocess.TimeoutExpired:
                pass
        self._made = [ns for ns in self._made if ns in list_netns()]


def guard_sigterm(cleanup) -> None:
    """Run ``cleanup`` on SIGTERM before the previous disposition (atexit alone misses a
    SIGTERM, which is how CI runners usually stop a job)."""
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        try:
            cleanup()
        finally:
            if callable(prev):
                prev(signum, frame)
            else:
                signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: the finalizer and atexit still stand
        pass


# --------------------------------------------------------------------------------------
# a process inside a namespace
# --------------------------------------------------------------------------------------
def child_env() -> dict:
    """The environment of a child: kvxfer importable from this checkout, no stray provider."""
    import kvxfer

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("FI_PROVIDER", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A process started with ``Popen``; stdout read line by line with deadlines, stderr kept
    in a file and shown when something fails."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self._err = tempfile.TemporaryFile(mode="w+b")
        self._buf = b""
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     env=child_env(), close_fds=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self, limit: int = 6000) -> str:
        try:
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-limit:]
        except (OSError, ValueError):
            return ""

    def describe(self) -> str:
        rc = self.proc.poll()
        state = "running" if rc is None else f"exited {rc}"
        return (f"{self.name} ({state})\n--- stdout ---\n" + "\n".join(self.lines)
                + f"\n--- stderr ---\n{self.stderr()}")

    def line(self, prefix: str, timeout: float) -> str:
        """The rest of the next stdout line starting with ``prefix``; AssertionError (with the
        child's output) if none comes within ``timeout`` s or the child exits first."""
        end = time.monotonic() + timeout
        out = self.proc.stdout
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                text = raw.decode(errors="replace")
                self.lines.append(text)
                if text.startswith(prefix):
                    return text[len(prefix):].strip()
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} line within {timeout} s from {self.describe()}")
            r, _, _ = select.select([out], [], [], min(left, 0.2))
            if r:
                chunk = os.read(out.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"{self.name} closed stdout before a {prefix!r} line: {self.describe()}")
                self._buf += chunk

    def result(self, timeout: float) -> dict:
        return json.loads(self.line("RESULT ", timeout))

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float) -> int:
        """The exit status; AssertionError (after a SIGKILL) if it does not exit in time."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout} s: {self.describe()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._err.close()


def role(pair: NetnsPair, ns: str, name: str, *args: str) -> Child:
    """Start this file as role ``name`` inside namespace ``ns``."""
    argv = pair.argv(ns, [sys.executable, os.path.abspath(__file__), name, *args])
    return Child(argv, f"{name} in {ns}")


# --------------------------------------------------------------------------------------
# the data both sides derive from one seed
# --------------------------------------------------------------------------------------
def source(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SRC_BYTES, dtype=np.uint8)


def page_map(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Scattered source and destination pages, with one run contiguous on both sides (so
    the engine merges some pages into one write and the count is not just NPAGES)."""
    rng = np.random.default_rng(seed + 1)
    src = rng.choice(SRC_PAGES, NPAGES, replace=False)
    dst = rng.choice(DST_PAGES, NPAGES, replace=False)
    src[:16] = np.arange(100, 116)
    dst[:16] = np.arange(700, 716)
    keep = np.ones(NPAGES, bool)
    for i in range(16, NPAGES):  # no duplicates after forcing the run
        keep[i] = not (100 <= src[i] < 116) and not (700 <= dst[i] < 716)
    return src[keep].astype(np.int64), dst[keep].astype(np.int64)


def expected_image(seed: int) -> np.ndarray:
    src = source(seed)
    sp, dp = page_map(seed)
    img = np.full(DST_BYTES, POISON, dtype=np.uint8)
    pages = img[:POOL].reshape(DST_PAGES, PAGE)
    pages[dp] = src[: SRC_PAGES * PAGE].reshape(SRC_PAGES, PAGE)[sp]
    img[LARGE_DST_OFF : LARGE_DST_OFF + LARGE] = src[LARGE_SRC_OFF : LARGE_SRC_OFF + LARGE]
    return img


# --------------------------------------------------------------------------------------
# the roles (run inside a namespace)
# --------------------------------------------------------------------------------------
def _emit(tag: str, payload) -> None:
    print(f"{tag} {payload if isinstance(payload, str) else json.dumps(payload)}", flush=True)


def _target(node: str, seed: int, timeout: float) -> int:
    import kvxfer

    with kvxfer.Engine(PROVIDER, node=node) as eng:
        buf = np.full(DST_BYTES, POISON, dtype=np.uint8)
        mr = eng.register(buf)
        _emit("READY", f"{eng.address.hex()} {mr.descriptor().hex()}")
        r, _, _ = select.select([sys.stdin], [], [], timeout)
        if not r:
            _emit("RESULT", {"ok": False, "why": f"no EXPECT line within {timeout} s"})
            return 1
        words = sys.stdin.readline().split()   # EXPECT <page writes> <large writes>
        if len(words) != 3 or words[0] != "EXPECT":
            _emit("RESULT", {"ok": False, "why": f"expected 'EXPECT <n> <n>' on stdin, got {words}"})
            return 1
        told = {IMM_PAGES: int(words[1]), IMM_LARGE: int(words[2])}
        # the target's own count, by the engine's merging rule, must agree with the initiator's
        sp, dp = page_map(seed)
        own = {
            IMM_PAGES: eng.count_writes((sp * PAGE).astype(np.uint64), (dp * PAGE).astype(np.uint64),
                                        np.full(len(sp), PAGE, np.uint64), region=mr),
            IMM_LARGE: eng.count_writes([LARGE_SRC_OFF], [LARGE_DST_OFF], [LARGE], region=mr),
        }
        arrived = {}
        for imm, n in told.items():
            c = eng.expect(imm, n)
            try:
                c.wait(timeout)
            except kvxfer.errors.TimeoutError:
                pass
            arrived[imm] = c.arrived
        time.sleep(0.2)   # a stray extra write would show up as banked
        banked = {imm: eng.banked(imm) for imm in told}
        exp = expected_image(seed)
        diff = np.flatnonzero(buf != exp)
        bad_pages = int(np.count_nonzero((buf[:POOL] != exp[:POOL]).reshape(DST_PAGES, PAGE).any(axis=1)))
        result = {
            "told": told, "own": own, "arrived": arrived, "banked": banked,
            "bytes_differ": int(diff.size), "first_diff": int(diff[0]) if diff.size else None,
            "bad_pages": bad_pages,
            "guard_ok": bool((buf[LARGE_DST_OFF + LARGE :] == POISON).all()),
        }
        result["ok"] = (diff.size == 0 and own == told and arrived == told and not any(banked.values()))
        _emit("RESULT", result)
        mr.close()
    return 0


def _initiator(node: str, addr: str, desc: str, seed: int, timeout: float) -> int:
    import kvxfer

    with kvxfer.Engine(PROVIDER, node=node) as eng:
        src = source(seed)
        mr = eng.register(src)
        peer = eng.connect(bytes.fromhex(addr))
        rr = eng.remote(bytes.fromhex(desc))
        sp, dp = page_map(seed)
        t0 = time.perf_counter()
        t = eng.write_pages(mr, sp, peer, rr, dp, PAGE, imm=IMM_PAGES)
        t.wait(timeout)
        t1 = time.perf_counter()
        big = eng.write(mr, LARGE_SRC_OFF, peer, rr, LARGE_DST_OFF, LARGE, imm=IMM_LARGE)
        big.wait(timeout)
        t2 = time.perf_counter()
        _emit("RESULT", {"pages_writes": t.num_writes, "pages": len(sp), "large_writes": big.num_writes,
                         "pages_s": t1 - t0, "large_s": t2 - t1, "large_bytes": LARGE})
        mr.close()
    return 0


def _flood(node: str, addr: str, desc: str, chunk: int, timeout: float, budget: float) -> int:
    """Write ``chunk`` bytes again and again; print FLOWING once writes complete, then
    report how the first failure surfaced: its class, and how long that wait took."""
    import kvxfer

    t_start = time.monotonic()
    eng = kvxfer.Engine(PROVIDER, node=node)
    try:
        src = np.ones(chunk, dtype=np.uint8)
        mr = eng.register(src)
        peer = eng.connect(bytes.fromhex(addr))
        rr = eng.remote(bytes.fromhex(desc))
        done = 0
        outcome = None
        while time.monotonic() - t_start < budget:
            t = eng.write(mr, 0, peer, rr, 0, min(chunk, rr.nbytes), imm=1)
            w0 = time.monotonic()
            try:
                t.wait(timeout)
            except kvxfer.errors.KvxferError as exc:
                outcome = {"error": type(exc).__name__, "message": str(exc),
                           "is_connection_error": isinstance(exc, ConnectionError),
                           "is_timeout_error": isinstance(exc, TimeoutError),
                           "wait_s": time.monotonic() - w0, "writes_before": done}
                break
            done += 1
            if done == 2:
                _emit("FLOWING", str(done))
        if outcome is None:
            outcome = {"error": None, "writes_before": done}
        _emit("FAILED", json.dumps(outcome))   # before close, in case close is what hangs
    finally:
        c0 = time.monotonic()
        eng.close()
    outcome["close_s"] = time.monotonic() - c0
    _emit("RESULT", outcome)
    return 0


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="_netns.py")
    p.add_argument("role", choices=("target", "initiator", "flood"))
    p.add_argument("--node", required=True)
    p.add_argument("--addr")
    p.add_argument("--desc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for any one wait")
    p.add_argument("--deadline", type=float, default=30.0, help="SIGALRM ends the process after this")
    p.add_argument("--chunk", type=int, default=8 << 20)
    p.add_argument("--budget", type=float, default=15.0)
    a = p.parse_args(argv)
    signal.alarm(max(1, int(a.deadline)))
    if a.role == "target":
        return _target(a.node, a.seed, a.timeout)
    if a.role == "initiator":
        return _initiator(a.node, a.addr, a.desc, a.seed, a.timeout)
    return _flood(a.node, a.addr, a.desc, a.chunk, a.timeout, a.budget)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
