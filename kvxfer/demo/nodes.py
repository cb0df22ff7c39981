"""The messenger transports: prefill nodes as processes, joined to the decoder by kvxfer.

A prefill node is one process running a ``kvxfer.Messenger`` over an ``Engine`` on
127.0.0.1, plus its TP worker processes (:class:`kvxfer.demo.tp.WorkerGroup`), whose per-region
memfd KV buffers it imported with ``kvxfer.messenger.collect`` and registered once. The
decode node (the demo's main process) runs the other messenger over its own pool.

Who says what:

* router → prefill node (a pipe; in a deployment, the request router): ``("prompt", rid,
  tokens)``, the tokens the prefill node will compute;
* decoder messenger → prefill messenger: ``receive(peer, rid, dst_pages, num_tokens)`` (the
  REQUEST, with the destination pages);
* the prefill node, once it has both: allocates source pages and, **streaming** (the
  default), opens ``stream(request, src_pages)`` and calls ``schedule([(send, start, end)])``
  before each chunk's forward pass; the lead TP rank posts a semaphore after each layer's
  attention all-reduce and the node's relay thread (``kvxfer-demo-layers``) bumps
  ``Messenger.layer_counter``, so the watcher posts layer ``l``'s completed pages while
  layer ``l + 1`` computes; ``finish(context)`` (the last prefilled hidden state, ``hidden x
  float32`` bytes, into the decoder's context slot) is written after the last layer. With
  ``stream=False`` (``--no-stream``) it prefills everything, then ``send(request,
  src_pages)`` posts every layer at once. The source pages go back to its pool in the
  ``Send``'s done callback;
* prefill node → router: ``("prefilled", rid, figures)`` (its clock is the machine's
  monotonic clock, so the decoder can compute the transfer tail from ``t_last_layer``, when
  the lead rank finished the last layer).

The cross-process hop costs the streaming path one semaphore wake-up of the relay thread per
layer (a futex wake and a GIL acquire in the node process) before the native watcher sees
the bump; the model's ranks never wait for it. The alternative, a watcher polling a word the
lead rank writes in shared memory, needs a messenger that takes a caller's counter word,
which the streaming API does not offer.

The decoder checks the prefill node's model digest before ``connect``; the messenger's own
handshake then checks layouts, shardings and engine parameters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.demo.config import DemoConfig, Handoff
from kvxfer.demo.model import F32, ModelConfig
from kvxfer.demo.runtime import PagePool, prompt_pages
from kvxfer.errors import ClosedError, LayoutError, PeerError
from kvxfer.errors import TimeoutError as KvxTimeoutError

if TYPE_CHECKING:
    from kvxfer.demo.flow import DecodeNode

__all__ = ["MessengerTransport", "prefill_node_main", "python_signals"]

_CTX = mp.get_context("spawn")
START_TIMEOUT = 90.0


def python_signals() -> None:
    """Give SIGINT and SIGTERM back to Python after the first ``Engine``.

    libfabric 1.17 (Debian's build: a handler inside libfabric.so.1, installed when the
    providers load) replaces the SIGINT and SIGTERM handlers with one that exits with status 1:
    Ctrl-C then skips every ``finally`` and ``close()``. Measured: ``SigCgt`` goes from 0x2 to
    0x1_0000_446a on the first ``Engine``, and the process exits with status 1 on SIGINT without a
    ``KeyboardInterrupt``. Reinstalling Python's handlers once is enough (a second Engine
    does not replace them again). SIGSEGV keeps libfabric's handler.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def prefill_node_main(spec: dict[str, Any], conn: Any) -> None:
    """A prefill node process: TP workers, a messenger, and the serve loop (see module doc)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import kvxfer
    from kvxfer.demo._blas import limit_blas_threads
    from kvxfer.demo.tp import WorkerGroup

    limit_blas_threads(1)
    eng = workers = m = None
    try:
        cfg = ModelConfig(**spec["model"])
        eng = kvxfer.Engine(spec["provider"], "127.0.0.1")
        python_signals()
        workers = WorkerGroup(cfg, spec["tp"], spec["num_pages"], spec["chunk"], layer_signal=spec["stream"])
        # the relay's CPU bump wakes the watcher at once; the messenger's default for a CPU
        # counter is no poll at all (a poll while writes are armed would take a core from the ranks)
        m = kvxfer.Messenger(eng, workers.layout, workers.sharding,
                             {r: c.regions for r, c in enumerate(workers.caches)}, peer_timeout=spec["peer_timeout"])
        conn.send(("ready", m.handshake(), cfg.fingerprint(), os.getpid(), workers.pids))
        _serve(cfg, m, workers, conn, PagePool(spec["num_pages"]), spec["stream"])
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if m is not None:
            m.close()
        if workers is not None:
            workers.close()
        if eng is not None:
            eng.close()


def _relay_layers(workers: Any, m: Any, stop: threading.Event) -> None:
    """The lead rank's per-layer signal -> ``m.layer_counter.bump`` (blocks; never spins)."""
    lc = m.layer_counter
    while not stop.is_set():
        n = workers.wait_layers(0.1)
        if n:
            try:
                lc.bump(n)
            except ClosedError:
                return


def _prefill_streaming(m: Any, workers: Any, req: Any, tokens: np.ndarray,
                       src: np.ndarray) -> tuple[Any, np.ndarray, float]:
    """Prefill ``tokens`` chunk by chunk, scheduling each pass with the messenger before it
    runs; the context is handed to ``finish`` after the last pass. A failed prefill abandons
    the passes it scheduled (their Sends abort with the fence) and re-raises. Returns the
    Send, the context and the seconds spent in ``schedule``."""
    s = m.stream(req, src)
    passes: list[Any] = []
    spent = [0.0]

    def before_chunk(a: int, b: int) -> None:
        t = time.perf_counter()
        passes.append(m.schedule([(s, a, b)]))
        spent[0] += time.perf_counter() - t

    try:
        ctx, _ = workers.prefill(req.request_id, tokens, src, before_chunk=before_chunk)
    except BaseException:
        for p in passes:
            if p.layers_done < p.end - p.base:
                p.abandon()
        raise
    return s, ctx, spent[0]


def _serve(cfg: ModelConfig, m: Any, workers: Any, conn: Any, pool: PagePool, stream: bool) -> None:
    stop = threading.Event()
    lock = threading.Lock()
    freed = threading.Condition(lock)
    prompts: dict[Any, np.ndarray] = {}
    send_lock = threading.Lock()

    def tell(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    def reader() -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if msg[0] == "prompt":
                    with lock:
                        prompts[msg[1]] = np.asarray(msg[2], np.int64)
        except (EOFError, OSError):
            pass  # the router is gone: stop
        stop.set()

    threading.Thread(target=reader, name="kvxfer-demo-router", daemon=True).start()
    relay = None
    if stream:
        relay = threading.Thread(target=_relay_layers, args=(workers, m, stop), name="kvxfer-demo-layers",
                                 daemon=True)
        relay.start()
    try:
        _serve_loop(m, workers, pool, stream, stop, lock, freed, prompts, tell)
    finally:  # the relay stops before the messenger closes (it waits 0.1 s at a time)
        stop.set()
        if relay is not None:
            relay.join(2.0)


def _serve_loop(m: Any, workers: Any, pool: PagePool, stream: bool, stop: threading.Event, lock: Any,
                freed: threading.Condition, prompts: dict[Any, np.ndarray], tell: Any) -> None:
    import kvxfer

    waiting: deque[Any] = deque()
    while not stop.is_set():
        try:
            waiting.extend(m.requests(timeout=0.02))
        except ClosedError:
            break
        while waiting and not stop.is_set():
            req = waiting[0]
            with lock:
                tokens = prompts.get(req.request_id)
            if tokens is None:
                break  # its prompt is still on the way (FIFO: wait for it)
            waiting.popleft()
            if req.aborted:
                continue
            with freed:
                while (src := pool.alloc(len(req.dst_pages))) is None and not stop.is_set():
                    freed.wait(0.1)
            if src is None:
                break
            t0 = time.monotonic()
            streamed = stream and len(tokens) > 1  # nothing to prefill: no pass to schedule
            sched = 0.0
            if streamed:
                s, ctx, sched = _prefill_streaming(m, workers, req, tokens[:-1], src)
            else:
                ctx, _ = workers.prefill(req.request_id, tokens[:-1], src)
            t1 = time.monotonic()
            t_last = workers.t_last_layer if len(tokens) > 1 else t1
            if not streamed:
                s = m.send(req, src)

            def release(_s: Any, src: np.ndarray = src) -> None:
                with freed:
                    pool.release(src)
                    freed.notify_all()

            s.add_done_callback(release)
            s.finish(np.ascontiguousarray(ctx, F32))
            t2 = time.monotonic()
            plan = kvxfer.plan(workers.layout, workers.sharding, req.peer.layout, req.peer.sharding, src,
                               req.dst_pages)
            with lock:
                prompts.pop(req.request_id, None)
            tell(("prefilled", req.request_id, {"t_prefill_start": t0, "t_prefill_end": t1, "t_posted": t2,
                                                "t_last_layer": t_last, "streamed": streamed,
                                                "schedule_s": sched,
                                                "pages": len(src), "bytes": plan.num_bytes,
                                                "writes": s.num_writes}))


class _Remote(Handoff):
    """A hand-off through the messenger: a ``Receive`` plus the prefill node's figures."""

    def __init__(self, rx: Any, node: int) -> None:
        super().__init__()
        self.rx, self.node = rx, node

    @property
    def done(self) -> bool:
        if not self.rx.done:
            return False
        if self.rx.state != "done" and self.error is None:
            self.error = self.rx.error or PeerError(f"request {self.rx.request_id!r} {self.rx.state}")
        self.t_done = self.rx.t_done
        return True

    @property
    def fenced(self) -> bool:
        return bool(self.rx.fenced)

    def context(self) -> np.ndarray:
        view = self.rx.context
        if view is None:
            raise PeerError(f"request {self.rx.request_id!r} has no context")
        return np.frombuffer(view, F32).copy()

    def release(self) -> None:
        self.rx.release()


class _Node:
    def __init__(self, index: int, proc: Any, conn: Any) -> None:
        self.index, self.proc, self.conn = index, proc, conn
        self.blob = b""
        self.pids: list[int] = []
        self.peer: Any = None
        self.alive = True
        self.prefilled = 0
        self.routed = 0
        self.lock = threading.Lock()


class MessengerTransport:
    """Prefill nodes as processes, a messenger on each side, ``provider`` on 127.0.0.1."""

    def __init__(self, cfg: ModelConfig, dc: DemoConfig, decoder: DecodeNode, prefill_pages: int, slots: int,
                 wake: threading.Event) -> None:
        import kvxfer

        self.name = dc.transport
        self.cfg, self.dc, self.decoder, self.wake = cfg, dc, decoder, wake
        self.nodes: list[_Node] = []
        self._handoffs: dict[int, _Remote] = {}
        self._figures: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        self.t_killed: float | None = None
        self._error = ""
        self.eng = self.m = None
        try:
            spec = {"model": cfg.to_dict(), "provider": dc.transport, "tp": dc.prefill_tp, "num_pages": prefill_pages,
                    "chunk": dc.chunk, "peer_timeout": dc.peer_timeout, "stream": dc.stream}
            env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                for k in range(dc.prefill_nodes):
                    parent, child = _CTX.Pipe()
                    p = _CTX.Process(target=prefill_node_main, args=(spec, child), name=f"kvxfer-demo-prefill{k}",
                                     daemon=False)
                    p.start()
                    child.close()
                    self.nodes.append(_Node(k, p, parent))
            finally:
                for key, v in saved.items():
                    if v is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = v
            self.eng = kvxfer.Engine(dc.transport, "127.0.0.1")
            python_signals()
            self.m = kvxfer.Messenger(self.eng, decoder.layout, decoder.sharding, decoder.regions,
                                      context_slots=slots, context_bytes=cfg.hidden * 4, peer_timeout=dc.peer_timeout)
            for n in self.nodes:
                if not n.conn.poll(START_TIMEOUT):
                    raise KvxTimeoutError(f"prefill node {n.index} did not start within {START_TIMEOUT} s")
                msg = n.conn.recv()
                if msg[0] != "ready":
                    raise PeerError(f"prefill node {n.index} failed to start:\n{msg[1]}")
                _, n.blob, digest, pid, n.pids = msg
                if digest != decoder.cfg.fingerprint():
                    raise LayoutError(f"prefill node {n.index} runs another model (config digest {digest}, "
                                      f"this decode node {decoder.cfg.fingerprint()})")
                n.peer = self.m.connect(n.blob, timeout=30)
                threading.Thread(target=self._listen, args=(n,), name=f"kvxfer-demo-node{n.index}",
                                 daemon=True).start()
        except BaseException:
            self.close()
            raise

    def _listen(self, n: _Node) -> None:
        """The prefill node's reports: figures per request; a traceback if it failed."""
        try:
            while True:
                msg = n.conn.recv()
                if msg[0] == "prefilled":
                    with self._lock:
                        self._figures[msg[1]] = msg[2]
                        h = self._handoffs.get(msg[1])
                        if h is not None:
                            h.figures = msg[2]
                    n.prefilled += 1
                    self._maybe_kill(n)
                elif msg[0] == "error":
                    n.alive = False
                    self._error = msg[1]
                    return
        except (EOFError, OSError):
            n.alive = False

    def kill(self, index: int) -> None:
        """SIGKILL prefill node ``index`` and its TP workers (the kill-the-prefiller drill:
        ``kill_prefiller_after=k`` kills node 0 once it has prefilled ``k`` requests and
        has been handed another, so at least one request is in flight on it)."""
        n = self.nodes[index]
        n.alive = False
        with self._lock:
            self.t_killed = time.monotonic()
        for pid in [n.proc.pid, *n.pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def submit(self, rid: int, prompt: np.ndarray, dst_pages: np.ndarray) -> Handoff:
        alive = [n for n in self.nodes if n.alive]
        if not alive:
            raise PeerError("no prefill node is alive")
        n = alive[self._next % len(alive)]
        self._next += 1
        npf = prompt_pages(self.cfg, len(prompt))
        with n.lock:
            n.conn.send(("prompt", rid, prompt))
        rx = self.m.receive(n.peer, rid, dst_pages[:npf], len(prompt) - 1)
        h = _Remote(rx, n.index)
        with self._lock:
            self._handoffs[rid] = h
            if rid in self._figures:
                h.figures = self._figures[rid]
        rx.add_done_callback(lambda _r: self.wake.set())
        n.routed += 1
        self._maybe_kill(n)
        return h

    def _maybe_kill(self, n: _Node) -> None:
        """The drill: once node 0 has prefilled ``kill_prefiller_after`` requests and holds
        another (routed, not yet prefilled), kill it a moment later, while that one is most
        likely being prefilled. Checked on every report and every routing, so it fires."""
        k = self.dc.kill_prefiller_after
        with self._lock:
            if not k or n.index != 0 or self.t_killed is not None or n.prefilled < k or n.routed <= n.prefilled:
                return
            self.t_killed = float("inf")
        threading.Timer(0.05, self.kill, args=(0,)).start()

    def collect_figures(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the figures of every request that completed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                missing = [r for r, h in self._handoffs.items() if h.rx.state == "done" and not h.figures]
            if not missing:
                return
            time.sleep(0.01)

    def stats(self) -> dict[str, Any]:
        """The decoder messenger's counters (messages by type, drops, failed sends)."""
        return self.m.stats() if self.m is not None else {}

    def close(self, timeout: float = 20.0) -> None:
        """Stop the prefill nodes (stop message, join with a deadline, then kill), then the
        decoder's messenger and engine."""
        if self._closed:
            return
        self._closed = True
        for n in self.nodes:
            if n.alive:
                try:
                    with n.lock:
                        n.conn.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            n.proc.join(max(deadline - time.monotonic(), 0.1))
            if n.proc.is_alive():
                n.proc.kill()
                n.proc.join(2)
            for pid in n.pids:  # workers of a killed node die on EOF; make sure
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            n.conn.close()
        if self.m is not None:
            self.m.close()
        if self.eng is not None:
            self.eng.close()
