"""``kvxfer-bench cluster``: many nodes finding each other through a rendezvous store, with
a prefill instance killed and the store stopped and restarted mid-run; prints what happened.

The shape (issue 27): a store server (a real ``etcd`` or ``redis-server`` when installed, or
a directory), 2 prefill instances of TP2 (each one process holding both ranks, or with
``--per-rank`` one process per rank, as vLLM and SGLang run them), 2 decode instances. Each decoder routes requests at random over the prefill instances it lists in
the store, connecting lazily; then prefill instance ``p0`` is killed with SIGKILL (its
in-flight requests fail with ``PeerError`` within ``peer_timeout``, fenced, and are retried
on another instance); the store is killed (new lookups fail with ``RendezvousError``, the
data path goes on) and restarted (leases re-established); a third prefill instance ``p2``
joins and is discovered through the watch. Every request must end byte-exact.

``run_cluster`` is also what tests/rendezvous/test_cluster.py drives, with each node in its
own network namespace (a ``Placement`` says where each process runs and which address it
has); the command runs everything on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

NODE = "kvxfer.cli._cluster_node"


class Placement:
    """Where each process runs: ``node(name) -> (argv prefix, address)`` and the store
    server's ``(argv prefix, address)``. The default: everything on 127.0.0.1."""

    def node(self, name: str) -> tuple[list[str], str]:
        return [], "127.0.0.1"

    def store(self) -> tuple[list[str], str]:
        return [], "127.0.0.1"


def _first(procs: list["_Proc"], tag: str, timeout: float) -> Any:
    """The JSON after the first line tagged ``tag`` from any of ``procs``."""
    end = time.monotonic() + timeout
    while True:
        for x in procs:
            try:
                return x.next(tag, 0.02)
            except TimeoutError:
                if time.monotonic() > end:
                    raise


class _Proc:
    """A node process; its stdout read in lines with deadlines (nothing it does can hang us)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.err = tempfile.TemporaryFile()
        import kvxfer

        root = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop("FI_PROVIDER", None)
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env,
                                  start_new_session=True, close_fds=True)
        self.buf = b""
        self.lines: list[str] = []
        self.closed = False
        self.rc: Optional[int] = None
        self.done = 0          #: the last PROGRESS count seen

    def pump(self) -> None:
        """Read what stdout has now (PROGRESS counts update ``done``), without waiting."""
        try:
            self.next("\0", 0.001)
        except TimeoutError:
            pass

    def describe(self) -> str:
        self.err.seek(0)
        rc = self.p.poll()
        return (f"{self.name} ({'running' if rc is None else f'exit {rc}'}); stdout:\n" + "\n".join(self.lines[-20:])
                + "\nstderr:\n" + self.err.read().decode(errors="replace")[-8000:])

    def next(self, tag: str, timeout: float) -> Any:
        """The JSON after the next line tagged ``tag`` (other lines are kept)."""
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                raw, self.buf = self.buf.split(b"\n", 1)
                text = raw.decode(errors="replace")
                self.lines.append(text)
                if text.startswith("PROGRESS "):
                    self.done = json.loads(text[9:])["done"]
                if text.startswith("ERROR "):
                    raise RuntimeError(f"{self.name} failed:\n{json.loads(text[6:])}")
                if text.startswith(tag + " "):
                    return json.loads(text[len(tag) + 1:])
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {tag} from {self.describe()}")
            r, _, _ = select.select([self.p.stdout], [], [], min(left, 0.2))
            if r:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} closed stdout before {tag}: {self.describe()}")
                self.buf += chunk

    def send(self, text: str) -> None:
        try:
            self.p.stdin.write(text.encode() + b"\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self, timeout: float = 20.0) -> Optional[int]:
        """Ask it to exit, wait ``timeout`` s, then kill it; its exit status. Idempotent."""
        if self.closed:
            return self.rc
        self.closed = True
        self.send("exit")
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.err.close()
        self.rc = rc
        return rc


class _DirServer:
    """A directory as the store's 'server': stopping it moves the directory away."""

    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="kvxfer-cluster-")
        self.root = os.path.join(self.base, "store")
        os.makedirs(self.root)
        self.url = "file://" + self.root

    def start(self) -> "_DirServer":
        if os.path.isdir(self.root + ".off"):
            os.rename(self.root + ".off", self.root)
        return self

    def stop(self) -> None:
        if os.path.isdir(self.root):
            os.rename(self.root, self.root + ".off")

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def store_kinds() -> list[str]:
    """The store kinds that can run here, best first."""
    from kvxfer.rendezvous.servers import available

    out = []
    for kind, mod in (("etcd", "etcd3gw"), ("redis", "redis")):
        try:
            __import__(mod)
        except ImportError:
            continue
        if available(kind) is None:
            out.append(kind)
    return out + ["file"]


def run_cluster(kind: str, *, placement: Optional[Placement] = None, requests: int = 150,
                provider: str = "tcp;ofi_rxm", peer_timeout: float = 10.0, ttl: float = 2.0, grace: float = 2.0,
                deadline: float = 240.0, say: Callable[[str], Any] = lambda s: None,
                procs: Optional[list] = None, mode: str = "node") -> dict:
    """Run the shape once over a ``kind`` store (``etcd``, ``redis`` or ``file``); returns the
    report (``checks``: name -> (ok, detail); ``events``; each decoder's result). ``procs``,
    when given, collects every process started (for a caller's own cleanup)."""
    from kvxfer.rendezvous.servers import Server

    if mode not in ("node", "per-rank"):
        raise ValueError(f"mode is 'node' or 'per-rank', got {mode!r}")
    shape = "one process, both ranks" if mode == "node" else "one process per rank"
    placement = placement or Placement()
    started: list[Any] = [] if procs is None else procs
    t0 = time.monotonic()
    events: list[tuple[float, str]] = []

    def event(text: str) -> None:
        events.append((round(time.monotonic() - t0, 3), text))
        say(f"[{time.monotonic() - t0:6.2f} s] {text}")

    if kind == "file":
        srv: Any = _DirServer()
    else:
        prefix, host = placement.store()
        srv = Server(kind, host=host, prefix=prefix).start()
    started.append(srv)
    event(f"{kind} store up: {srv.url}")
    common = ["--store", srv.url, "--provider", provider, "--peer-timeout", str(peer_timeout), "--ttl", str(ttl),
              "--grace", str(grace), "--deadline", str(int(deadline)), "--secret-hex", os.urandom(16).hex()]

    def node(role: str, name: str, *extra: str) -> _Proc:
        prefix, addr = placement.node(name)     # an instance's rank processes share its host
        argv = [*prefix, sys.executable, "-m", NODE, role, "--instance", name, "--node", addr, *common, *extra]
        p = _Proc(name + (f"r{extra[-1]}" if extra else ""), argv)
        started.append(p)
        return p

    def instance(name: str) -> list[_Proc]:
        """A prefill instance: one process holding both TP ranks, or one per rank."""
        procs = [node("prefill", name)] if mode == "node" else [node("prefill", name, "--rank", str(r))
                                                                   for r in (0, 1)]
        for p in procs:
            p.next("READY", 60)
        return procs

    report: dict[str, Any] = {"store": kind, "mode": mode, "url": srv.url, "events": events, "checks": {}}
    checks = report["checks"]
    try:
        pre = {n: instance(n) for n in ("p0", "p1")}
        event(f"prefill instances p0, p1 published (TP2: {shape})")
        dec = {n: node("decode", n) for n in ("d0", "d1")}
        for d in dec.values():
            info = d.next("READY", 60)
            event(f"{d.name} lists prefill instances {info['prefill']}")
        for d in dec.values():
            d.send(f"run {requests} {deadline / 2}")
        def progress(more: int, timeout: float = 60.0) -> None:
            """Wait until the decoders together completed ``more`` requests (a decoder whose
            only reachable instance was declared dead may make none until p2 joins)."""
            base = sum(d.done for d in dec.values())
            end = time.monotonic() + timeout
            while sum(d.done for d in dec.values()) < base + more:
                if time.monotonic() > end:
                    raise TimeoutError(f"the decoders completed fewer than {more} requests in {timeout} s")
                for d in dec.values():
                    d.pump()
                time.sleep(0.02)

        progress(40)
        # the kill must find requests in flight on p0: p0 stops serving new requests and the
        # kill comes once one reached it. Per rank, the ranks read "hold" at different moments:
        # a request may be served by rank 0 and held by rank 1 (in flight all the same), and a
        # decoder waiting on it in order sends rank 0 nothing new, so any rank's HELD counts.
        for p in pre["p0"]:
            p.send("hold")
        held = _first(pre["p0"], "HELD", 60)
        event(f"p0 holds request {held['request']} unserved")
        for p in pre["p0"]:
            p.kill()
        t_kill = time.time()
        event("p0 killed (SIGKILL) mid-run")
        progress(40)
        srv.stop()
        event(f"{kind} store stopped")
        look = dec["d0"]
        look.send("lookup p9")
        lk = look.next("LOOKUP", 30)
        event(f"lookup of a new instance while the store is down: {lk.get('error')}: {lk.get('message', '')[:90]}")
        checks["lookup fails clearly while the store is down"] = (
            not lk["ok"] and lk["error"] == "RendezvousError" and lk["connection_error"], lk)
        progress(40)
        event("requests went on while the store was down")
        srv.start()
        event(f"{kind} store restarted")
        pre["p2"] = instance("p2")
        event("p2 joined")
        time.sleep(max(1.5, ttl))
        progress(40)
        for d in dec.values():
            d.send("stop")
        results = {n: d.next("RESULT", deadline) for n, d in dec.items()}
        event("decoders finished")
        end = time.monotonic() + 3 * ttl + grace
        listed: Any = None
        while time.monotonic() < end:       # bounded: p0's expired entries gone, the others back
            dec["d0"].send("list")          # asked from a node: the store may sit in another namespace
            ls = dec["d0"].next("LIST", 10)
            listed = ls.get("instances", ls)
            if listed == ["d0", "d1", "p1", "p2"]:
                break
            time.sleep(0.1)
        for d in dec.values():
            d.send("stats")
        stats = {n: d.next("STATS", 30) for n, d in dec.items()}
        pstats = {}
        for p in [*pre["p1"], *pre["p2"]]:
            p.send("stats")
            pstats[p.name] = p.next("STATS", 30)
        report.update(results=results, listed=listed, stats=stats, prefill_stats=pstats, t_kill=t_kill)
        total = sum(r["requests"] for r in results.values())
        done = sum(r["done"] for r in results.values())
        fails = [f for r in results.values() for f in r["failures"]]
        checks["every request done, none lost"] = (
            done == total and all(not r["lost"] for r in results.values()), f"{done}/{total}")
        checks["every request byte-exact"] = (all(not r["bad"] for r in results.values()),
                                             sum(r["bytes_checked"] for r in results.values()))
        checks["every failure a fenced PeerError, retried"] = (
            all(f["error"] == "PeerError" and f["fenced"] for f in fails), f"{len(fails)} failed and retried")
        # a live instance declared dead by a decoder (heartbeat silence right after p0's kill:
        # docs/reliability.md) is a finding, reported apart from the checks
        report["false_deaths"] = sorted({(f["instance"], n) for n, r in results.items() for f in r["failures"]
                                         if f["instance"] != "p0"})
        late = max((f["at"] - t_kill for f in fails if f["instance"] == "p0"), default=0.0)
        # a deadline, not a speed goal: the messenger thread's tick may be late by the
        # seconds a send to the dead peer blocks it (docs/reliability.md)
        checks["in-flight requests of p0 failed within peer_timeout (+5 s)"] = (
            late <= peer_timeout + 5.0, f"last failure {late:.2f} s after the kill (peer_timeout {peer_timeout} s)")
        checks["p2 discovered and used"] = (any(r["by_instance"].get("p2") for r in results.values()),
                                            {n: r["by_instance"] for n, r in results.items()})
        checks["leases re-established after the restart"] = (
            listed == ["d0", "d1", "p1", "p2"] and all(s["lease"] == "held" for s in [*stats.values(), *pstats.values()]),
            listed)
        for n, d in dec.items():
            rc = d.close()
            checks[f"{n} exited cleanly"] = (rc == 0, rc)
        for p in [*pre["p1"], *pre["p2"]]:
            rc = p.close()
            checks[f"{p.name} exited cleanly"] = (rc == 0, rc)
        event("all nodes closed")
        report["ok"] = all(v[0] for v in checks.values())
        return report
    except (RuntimeError, TimeoutError) as exc:     # say what every node was doing
        for x in started:
            if isinstance(x, _Proc) and x.p.poll() is None:
                try:
                    os.kill(x.p.pid, signal.SIGUSR1)    # faulthandler: every thread's stack
                except ProcessLookupError:
                    pass
        time.sleep(1.0)
        for x in started:
            if isinstance(x, _Proc) and x.p.poll() is None and x.name.startswith("d"):
                x.send("stats")
                try:
                    x.lines.append(f"(asked) STATS {json.dumps(x.next('STATS', 10))}")
                except (RuntimeError, TimeoutError):
                    pass
        others = "\n\n".join(x.describe() for x in started if isinstance(x, _Proc) and not x.closed)
        raise RuntimeError(f"{exc}\n\n--- the nodes ---\n{others}") from exc
    finally:
        for x in started:          # every node, then the server: bounded closes, kills behind them
            if isinstance(x, _Proc):
                x.close(timeout=5)
        srv.close()


def add_parser(sub: Any) -> None:
    from kvxfer.cli._args import positive_float, positive_int, writable_file

    p = sub.add_parser("cluster", help="2 prefill + 2 decode instances over a rendezvous store, with a kill "
                                       "and a store restart mid-run",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--store", choices=("auto", "etcd", "redis", "file"), default="auto",
                   help="which store server to start here (auto: every one that can run)")
    p.add_argument("--requests", type=positive_int, default=150, help="requests per decoder, at least")
    p.add_argument("--per-rank", action="store_true", help="each prefill instance as one process per TP rank")
    p.add_argument("--provider", default="tcp;ofi_rxm")
    p.add_argument("--peer-timeout", type=positive_float, default=10.0,
                   help="seconds of silence before a peer is declared dead (the messenger's default)")
    p.add_argument("--json", type=writable_file, help="write the reports to this file")
    p.set_defaults(func=run_cmd)


def run_cmd(args: Any) -> int:
    kinds = store_kinds() if args.store == "auto" else [args.store]
    ok = True
    reports = []
    for kind in kinds:
        print(f"== {kind} ==")
        rep = run_cluster(kind, requests=args.requests, provider=args.provider, peer_timeout=args.peer_timeout,
                          say=print, mode="per-rank" if args.per_rank else "node")
        reports.append(rep)
        for name, (good, detail) in rep["checks"].items():
            print(f"  {'ok  ' if good else 'FAIL'} {name}: {detail}")
        for n, st in [*rep.get("stats", {}).items(), *rep.get("prefill_stats", {}).items()]:
            print(f"  {n}: longest silence of a live peer {st.get('silence')}")
        for inst, dname in rep.get("false_deaths", []):
            print(f"  FINDING {dname} declared live instance {inst} dead (heartbeat silence after p0's kill); "
                  "its requests were retried elsewhere")
        for n, r in rep.get("results", {}).items():
            print(f"  {n}: {r['done']} requests done ({r['by_instance']}), {len(r['failures'])} failed and retried")
        ok = ok and rep["ok"]
    if args.json:
        from kvxfer.cli._args import write_json

        ok = write_json(args.json, {"reports": reports}, "kvxfer-bench cluster") and ok
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvxfer-bench")
    add_parser(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)])
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
