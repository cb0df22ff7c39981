"""The two processes of a benchmark: the target that checks what lands, the initiator that
writes and times, and the control channel between them.

Control messages are small JSON objects over ``Engine.send``/``recv`` (never the data
path). Per iteration of a ``bw`` case the target sends two: ``landed`` as soon as its
counter for the iteration's imm completes, stamped with its clock (on one host that stamp
ends the measurement; across hosts the ack's arrival does), and ``ready`` after it has
checked and re-poisoned the destination (so the next write cannot race the check).
Everything that waits has a deadline, so a vanished peer ends a process instead of
hanging it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import kvxfer
from kvxfer.cli._cases import Case, Checker, dst_pages, parse_case, pattern
from kvxfer.errors import KvxferError, PeerError, TimeoutError
from kvxfer.wire import Address, count_writes, split_write

__all__ = ["Channel", "RemoteFailure", "serve", "TargetProcess", "Initiator", "CaseResult", "LatResult",
           "machine_info", "ADDR_PREFIX"]

#: The line a target prints on stdout with its address (hex of ``Engine.address``).
ADDR_PREFIX = "KVXFER-ADDR "
_SLICE = 1.0  # seconds: waits block in slices so a dead parent or peer is noticed


class RemoteFailure(KvxferError):
    """The other process failed; carries its traceback text."""


def machine_info() -> dict:
    import platform

    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "node": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kvxfer": kvxfer.__version__,
        "boot_id": _boot_id(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Channel:
    """Tagged JSON messages to one peer. Messages of other kinds than the one awaited are
    kept for later, so the protocol does not depend on delivery order."""

    def __init__(self, eng: "kvxfer.Engine", alive: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.eng = eng
        self.peer: Optional[kvxfer.Peer] = None
        self._held: list[dict] = []
        self._alive = alive  # returns a reason string when the other side is known dead

    def send(self, kind: str, **fields: Any) -> None:
        fields["t"] = kind
        data = json.dumps(fields, separators=(",", ":")).encode()
        self.eng.send(self.peer, data)

    def recv(self, kinds: str | tuple[str, ...], timeout: Optional[float], i: Optional[int] = None) -> dict:
        """The next message of ``kinds`` (and iteration ``i``); RemoteFailure if the peer
        reported an error, TimeoutError after ``timeout`` s (None: wait forever)."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for n, m in enumerate(self._held):
                if m.get("t") == "error":
                    raise RemoteFailure(m.get("trace") or m.get("error", "peer failed"))
                if m.get("t") in kinds and (i is None or m.get("i") == i):
                    return self._held.pop(n)
            left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no {'/'.join(kinds)} message within {timeout} s")
            try:
                raw = self.eng.recv(left)
            except TimeoutError:
                if self._alive is not None:
                    why = self._alive()
                    if why:
                        raise PeerError(why) from None
                continue
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # not ours
            if isinstance(msg, dict):
                self._held.append(msg)


def _wait_counter(c: "kvxfer.Counter", timeout: float, alive: Optional[Callable[[], Optional[str]]]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            c.wait(max(0.001, min(_SLICE, left)))
            return
        except TimeoutError:
            if left <= _SLICE:
                raise TimeoutError(f"imm {c.imm}: {c.arrived}/{c.count} writes arrived after {timeout} s") from None
            why = alive() if alive else None
            if why:
                raise PeerError(why) from None


# --------------------------------------------------------------------------------------
# target
# --------------------------------------------------------------------------------------
def serve(eng: "kvxfer.Engine", *, parent_pid: Optional[int] = None, idle_timeout: float = 60.0,
          first_timeout: Optional[float] = None) -> int:
    """Answer one initiator's requests until it says ``bye``. Returns an exit status."""

    def alive() -> Optional[str]:
        if parent_pid is not None and os.getppid() != parent_pid:
            return "the initiator process exited"
        return None

    ch = Channel(eng, alive)
    try:
        hello = ch.recv("hello", first_timeout)
    except (TimeoutError, PeerError) as exc:
        print(f"kvxfer-bench target: no initiator: {exc}", file=sys.stderr)
        return 3
    ch.peer = eng.connect(bytes.fromhex(hello["addr"]))
    ch.send("hello", info=eng.info, machine=machine_info(), pid=os.getpid())
    try:
        while True:
            req = ch.recv(("bw", "lat", "bye"), idle_timeout)
            if req["t"] == "bye":
                return 0
            if req["t"] == "bw":
                _serve_bw(eng, ch, req, alive)
            else:
                _serve_lat(eng, ch, req, alive)
    except (TimeoutError, PeerError, RemoteFailure) as exc:
        print(f"kvxfer-bench target: giving up: {exc}", file=sys.stderr)
        return 3
    except BaseException as exc:
        trace = traceback.format_exc()
        print(trace, file=sys.stderr)
        try:
            ch.send("error", error=str(exc), trace=trace[-8000:])
        except Exception:
            pass
        return 1


def _serve_bw(eng, ch: Channel, req: dict, alive) -> None:
    case = parse_case(req["case"])
    seed, base, timeout = int(req["seed"]), int(req["imm_base"]), float(req["timeout"])
    iov, max_write, pack_min = int(req["iov"]), int(req["max_write"]), int(req.get("pack_min", 0))
    rails = int(req.get("rails", 1))
    chk = Checker(case, seed)
    with eng.register(chk.buf) as mr:
        ch.send("desc", desc=mr.descriptor().hex())
        total = int(req["warmup"])
        i = 0
        measuring = False
        bad_iters = 0
        while True:
            if i == total:
                if measuring:
                    break
                total += int(ch.recv("measure", timeout)["n"])
                measuring = True
                continue
            perm = chk.mapping(i)
            if perm is None:      # Engine.write: one range per rail of the initiator
                so, do, ln = split_write(0, 0, case.nbytes, rails)
            else:
                so = np.arange(case.pages, dtype=np.uint64) * np.uint64(case.page_bytes)
                do = perm.astype(np.uint64) * np.uint64(case.page_bytes)
                ln = np.full(case.pages, case.page_bytes, np.uint64)
            n = count_writes(so, do, ln, iov, max_write, pack_min, rails=rails)
            c = eng.expect(base + i, n)
            _wait_counter(c, timeout, alive)
            ch.send("landed", i=i, clock=time.perf_counter())
            bad, guard = chk.check(i)
            bad_iters += bool(bad or not guard)
            ch.send("ready", i=i, bad=bad, guard=guard, writes=n)
            i += 1
        ch.send("done", bad_iters=bad_iters)


def _serve_lat(eng, ch: Channel, req: dict, alive) -> None:
    size, base, total, timeout = int(req["size"]), int(req["imm_base"]), int(req["total"]), float(req["timeout"])
    buf = np.zeros(max(size, 8), dtype=np.uint8)
    word = buf[:8].view(np.uint64)
    with eng.register(buf) as mr:
        peer_rr = eng.remote(bytes.fromhex(req["desc"]))
        ch.send("desc", desc=mr.descriptor().hex())
        bad = 0
        for i in range(total):
            _wait_counter(eng.expect(base + i, 1), timeout, alive)
            bad += int(word[0]) != i
            # echo what landed straight back: the initiator's clock stops when it arrives
            eng.write(mr, 0, ch.peer, peer_rr, 0, size, imm=base + i)
        ch.send("done", bad=bad)


def target_main(provider: str, node: Optional[str], *, progress: str, parent_pid: Optional[int],
                idle_timeout: float, deadline: Optional[float], listen: bool = False, rails: int = 1,
                listen_timeout: Optional[float] = None) -> int:
    """Entry of ``kvxfer-bench _target`` (spawned) and ``--listen`` (by hand)."""
    if deadline:
        signal.alarm(max(1, int(deadline)))  # the last resort: SIGALRM ends the process
    with kvxfer.Engine(provider, node=node, progress=progress, rails=rails) as eng:
        addr = eng.address.hex()
        if listen:
            print(f"kvxfer-bench: target on {eng.provider} is listening; on the other host run\n"
                  f"  kvxfer-bench {listen} --connect {addr}", file=sys.stderr, flush=True)
        print(ADDR_PREFIX + addr, flush=True)
        return serve(eng, parent_pid=parent_pid, idle_timeout=idle_timeout,
                     first_timeout=listen_timeout if listen else idle_timeout)


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
        p = self.proc
        if p.poll() is None:
            if kill:
                p.kill()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p.stdout:
            p.stdout.close()
        return p.returncode

    def close(self) -> None:
        self.stop(kill=True, timeout=5)
        self._err.close()


# --------------------------------------------------------------------------------------
# initiator
# --------------------------------------------------------------------------------------
def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


@dataclass
class CaseResult:
    """One case's numbers, in seconds from the write call: ``landed`` when the target's
    counter completed (read off the target's clock when both share one, else = ``acked``),
    ``acked`` when the target's ack of it reached the initiator, ``local`` sender-side
    completion, ``post`` the write call itself."""

    case: Case
    iterations: int = 0
    warmup: int = 0
    num_writes: int = 0
    clock: str = "ack"
    landed: list = field(default_factory=list)
    acked: list = field(default_factory=list)
    local: list = field(default_factory=list)
    post: list = field(default_factory=list)
    bad_iterations: int = 0
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_iterations == 0 and not self.problems

    def summary(self) -> dict:
        c = self.case
        t = np.asarray(self.landed)
        p50 = _pct(t, 50)
        out = {
            "case": c.spec, "letter": c.letter, "label": c.label, "kind": c.kind,
            "bytes": c.nbytes, "pages": c.pages, "page_bytes": c.page_bytes,
            "writes": self.num_writes, "iterations": self.iterations, "warmup": self.warmup,
            "timing": "local copy" if c.kind == "memmove" else self.clock,
            "p50_s": p50, "p99_s": _pct(t, 99), "min_s": float(t.min()) if len(t) else None,
            "mean_s": float(t.mean()) if len(t) else None,
            "gbps": c.nbytes / p50 / 1e9 if p50 > 0 else None,
            "gbps_mean": c.nbytes / float(t.mean()) / 1e9 if len(t) else None,
            "writes_per_s": self.num_writes / p50 if p50 > 0 and self.num_writes else None,
            "check": "ok" if self.ok else "FAIL", "bad_iterations": self.bad_iterations,
            "problems": self.problems,
        }
        for name in ("acked", "local", "post"):
            v = getattr(self, name)
            if v:
                out[f"{name}_p50_s"] = _pct(np.asarray(v), 50)
                out[f"{name}_p99_s"] = _pct(np.asarray(v), 99)
        if self.post:
            out["post_per_page_s"] = out["post_p50_s"] / c.pages
        out["samples_us"] = [round(v * 1e6, 2) for v in self.landed]
        return out


@dataclass
class LatResult:
    size: int
    iterations: int
    warmup: int
    rtt: list
    bad: int = 0

    def summary(self) -> dict:
        t = np.asarray(self.rtt)
        return {
            "size": self.size, "iterations": self.iterations, "warmup": self.warmup,
            "p50_us": _pct(t, 50) * 1e6, "p99_us": _pct(t, 99) * 1e6,
            "min_us": float(t.min()) * 1e6 if len(t) else None, "mean_us": float(t.mean()) * 1e6 if len(t) else None,
            "check": "ok" if self.bad == 0 else "FAIL", "bad": self.bad,
            "samples_us": [round(v * 1e6, 2) for v in self.rtt],
        }


class Initiator:
    """This process's engine, connected to one target, running cases one after another."""

    def __init__(self, eng: "kvxfer.Engine", target_addr: bytes, *, timeout: float,
                 alive: Optional[Callable[[], Optional[str]]] = None) -> None:
        a = Address.decode(target_addr)
        if a.provider != eng.provider:
            raise PeerError(f"the target runs {a.provider!r}, this engine {eng.provider!r}")
        self.eng = eng
        self.timeout = timeout
        self.ch = Channel(eng, alive)
        self.ch.peer = eng.connect(target_addr)
        self.next_imm = 1
        self.ch.send("hello", addr=eng.address.hex())
        h = self.ch.recv("hello", timeout)
        self.target_info: dict = h["info"]
        self.target_machine: dict = h["machine"]
        mine = machine_info()
        #: Both processes read the same CLOCK_MONOTONIC (one kernel), so the target's
        #: timestamp of its counter completing can end the measurement directly.
        self.shared_clock = bool(mine["boot_id"]) and mine["boot_id"] == self.target_machine.get("boot_id")

    def bye(self) -> None:
        try:
            self.ch.send("bye")
        except KvxferError:
            pass

    # -- bw ------------------------------------------------------------------------------
    def bw(self, case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float,
           min_iters: int, max_iters: int, progress: Callable[[int, int], None]) -> CaseResult:
        if case.kind == "memmove":
            return _memmove(case, seed, warmup=warmup, iters=iters, budget=budget, min_iters=min_iters,
                            max_iters=max_iters, progress=progress)
        eng, ch, timeout = self.eng, self.ch, self.timeout
        shared = self.shared_clock
        res = CaseResult(case, warmup=warmup, clock="target clock" if shared else "ack")
        src = pattern(seed, case.nbytes)
        base = self.next_imm
        with eng.register(src) as mr:
            ch.send("bw", case=case.spec, seed=seed, warmup=warmup, imm_base=base, iov=eng.iov,
                    max_write=eng.max_write, pack_min=eng.pack_min, rails=eng.rails, timeout=timeout)
            rr = eng.remote(bytes.fromhex(ch.recv("desc", timeout)["desc"]))
            src_pages = np.arange(case.pages, dtype=np.int64)

            def one(i: int, keep: bool) -> float:
                t_start = time.perf_counter()
                if case.kind == "pages":
                    perm = dst_pages(seed, i, case.pages)
                    t0 = time.perf_counter()
                    t = eng.write_pages(mr, src_pages, ch.peer, rr, perm, case.page_bytes, imm=base + i)
                else:
                    t0 = time.perf_counter()
                    t = eng.write(mr, 0, ch.peer, rr, 0, case.nbytes, imm=base + i)
                t1 = time.perf_counter()
                t.wait(timeout)
                t2 = time.perf_counter()
                msg = ch.recv("landed", timeout, i)
                t3 = time.perf_counter()
                r = ch.recv("ready", timeout, i)
                if r["writes"] != t.num_writes:
                    res.problems.append(f"iteration {i}: posted {t.num_writes} writes, target expected {r['writes']}")
                if r["bad"] or not r["guard"]:
                    res.bad_iterations += 1
                    if len(res.problems) < 5:
                        what = f"{r['bad']} pages differ" if r["bad"] else "guard bytes overwritten"
                        res.problems.append(f"iteration {i}: {what}")
                if keep:
                    res.landed.append((msg["clock"] if shared else t3) - t0)
                    res.acked.append(t3 - t0)
                    res.local.append(t2 - t0)
                    res.post.append(t1 - t0)
                res.num_writes = t.num_writes
                return time.perf_counter() - t_start

            wall = 0.0
            for i in range(warmup):
                wall = one(i, False)
            n = iters if iters is not None else _iterations(budget, wall, min_iters, max_iters)
            ch.send("measure", n=n)
            for k in range(n):
                one(warmup + k, True)
                progress(k + 1, n)
            done = ch.recv("done", timeout)
            res.iterations = n
            if done["bad_iters"] != res.bad_iterations:
                res.problems.append(f"target counted {done['bad_iters']} bad iterations")
        self.next_imm = base + warmup + n
        return res

    # -- lat -----------------------------------------------------------------------------
    def lat(self, size: int, *, warmup: int, iters: int, progress: Callable[[int, int], None],
            gap: float = 0.0) -> LatResult:
        eng, ch, timeout = self.eng, self.ch, self.timeout
        sbuf = np.zeros(max(size, 8), dtype=np.uint8)
        rbuf = np.zeros(max(size, 8), dtype=np.uint8)
        sword = sbuf[:8].view(np.uint64)
        rword = rbuf[:8].view(np.uint64)
        base, total = self.next_imm, warmup + iters
        rtt = np.empty(iters, dtype=np.float64)
        bad = 0
        step = max(1, iters // 200)
        with eng.register(sbuf) as smr, eng.register(rbuf) as rmr:
            ch.send("lat", size=size, imm_base=base, total=total, timeout=timeout, desc=rmr.descriptor().hex())
            rr = eng.remote(bytes.fromhex(ch.recv("desc", timeout)["desc"]))
            alive = ch._alive
            for i in range(total):
                if gap:
                    time.sleep(gap)
                sword[0] = i
                c = eng.expect(base + i, 1)
                t0 = time.perf_counter()
                eng.write(smr, 0, ch.peer, rr, 0, size, imm=base + i)
                try:
                    c.wait(timeout)
                except TimeoutError:
                    why = alive() if alive else None
                    if why:
                        raise PeerError(why) from None
                    raise TimeoutError(f"no echo of write {i} within {timeout} s") from None
                t1 = time.perf_counter()
                bad += int(rword[0]) != i
                if i >= warmup:
                    rtt[i - warmup] = t1 - t0
                    if (i - warmup + 1) % step == 0:
                        progress(i - warmup + 1, iters)
            bad += int(ch.recv("done", timeout)["bad"])
        self.next_imm = base + total
        return LatResult(size, iters, warmup, rtt.tolist(), bad)


def _iterations(budget: float, wall: float, lo: int, hi: int) -> int:
    if wall <= 0:
        return lo
    return int(max(lo, min(hi, budget / wall)))


def _memmove(case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float, min_iters: int,
             max_iters: int, progress: Callable[[int, int], None]) -> CaseResult:
    """The baseline: one process copying between two preallocated, prefaulted arrays."""
    res = CaseResult(case, warmup=warmup, num_writes=0)
    a = pattern(seed, case.nbytes)
    b = np.zeros_like(a)
    wall = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        np.copyto(b, a)
        wall = time.perf_counter() - t0
    n = iters if iters is not None else _iterations(budget, wall, min_iters, max_iters)
    for k in range(n):
        t0 = time.perf_counter()
        np.copyto(b, a)
        res.landed.append(time.perf_counter() - t0)
        progress(k + 1, n)
    res.iterations = n
    if not np.array_equal(a, b):
        res.bad_iterations = 1
        res.problems.append("copy differs from the source")
    return res
