"""A TP group whose ranks are separate worker processes (the prefill node's TP=2).

Each worker allocates its KV shard as memfd ``kvxfer.KVBuffer``s (one per region of the
layout) and hands them to the node process with ``kvxfer.messenger.publish``; the node
imports them with ``collect`` (that is the memory its messenger registers and reads). The TP
all-reduce is shared memory plus a barrier:

* every rank writes its units' partials into slot ``[unit]`` of a scratch area,
* ``barrier.wait()``,
* every rank sums all slots in unit order (the same ``reduce_units`` a TP=1 run uses).

Two scratch areas alternate, so one barrier per all-reduce suffices: a rank that reaches
all-reduce ``k + 2`` has passed barrier ``k + 1``, which every rank reaches only after it has
read area ``k % 2``. Barriers block (semaphores), never spin. The lead rank bumps a shared
64-bit layer counter after each layer's attention all-reduce (``RankModel.on_layer``) and,
with ``layer_signal=True``, also posts a semaphore per layer: the node process waits on it
(``wait_layers``) and bumps its messenger's layer counter (the messenger's watcher polls a
word of its own process, so the layer crosses processes here; see :mod:`kvxfer.demo.nodes`).

The node drives the chunks: ``prefill`` sends one command per chunk to every rank and waits
for all of them; ``before_chunk(start, end)`` runs before each pass is sent (pass ``k + 1``'s
while pass ``k`` computes), where a streaming node schedules the pass with its messenger.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.demo.model import F32, ModelConfig, RankCache, RankModel, reduce_units
from kvxfer.demo.runtime import prefill_chunks
from kvxfer.errors import InvalidArgumentError, PeerError
from kvxfer.errors import TimeoutError as KvxTimeoutError

__all__ = ["WorkerGroup"]

_CTX = mp.get_context("spawn")
BARRIER_TIMEOUT = 60.0


def _worker(rank: int, tp: int, cfg_dict: dict[str, Any], num_pages: int, chunk: int, conn: Any,
            path: str, barrier: Any, scratch: Any, counter: Any, signal: Any) -> None:
    """A TP rank: allocate and publish the KV shard, then serve ``chunk`` commands."""
    from kvxfer.buffers import KVBuffer
    from kvxfer.messenger.workers import publish

    bufs: list[Any] = []
    try:
        cfg = ModelConfig(**cfg_dict)
        layout, sharding = cfg.layout(num_pages), cfg.sharding(tp)
        for i, n in enumerate(layout.region_sizes(sharding)):
            bufs.append(KVBuffer.allocate(n, "cpu", name=f"kvxfer-demo-tp{rank}-r{i}"))
        publish(path, rank, bufs, timeout=60)
        area = np.frombuffer(scratch, F32).reshape(2, cfg.units, chunk, cfg.hidden)
        bumps = np.frombuffer(counter, np.uint64)
        t_layer = [0.0]

        def bump(layer: int) -> None:
            bumps[0] += 1
            if signal is not None:
                signal.release()
            t_layer[0] = time.monotonic()

        cache = RankCache(layout, sharding, [b.numpy() for b in bufs])
        model = RankModel(cfg, rank, tp, cache, on_layer=bump if rank == 0 else None)
        units = list(model.units)
        k = 0

        def allreduce(parts: list[np.ndarray]) -> np.ndarray:
            nonlocal k
            m = parts[0].shape[0]
            slot = area[k % 2]
            k += 1
            for u, p in zip(units, parts):
                slot[u, :m] = p
            barrier.wait(BARRIER_TIMEOUT)
            return reduce_units([slot[u, :m] for u in range(cfg.units)])

        conn.send(("ready", rank))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, rid, tokens, start, pages, last = msg
            t0 = time.perf_counter()
            g = model.forward(np.asarray(tokens, np.int64), start, pages)
            try:
                parts = g.send(None)
                while True:
                    parts = g.send(allreduce(parts))
            except StopIteration as e:
                h_last = e.value
            ctx = np.array(h_last[-1], F32) if last and rank == 0 else None
            conn.send(("done", rid, ctx, time.perf_counter() - t0, t_layer[0]))
    except BaseException:
        try:
            barrier.abort()
            conn.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
    finally:
        for b in bufs:
            b.close()


class WorkerGroup:
    """Start ``tp`` worker processes, import their KV shards, and run prefills on them.

    ``prefill(rid, tokens, pages)`` blocks until every rank is done and returns the context
    (the lead's last hidden state; zeros for an empty prefill) and the compute time;
    ``t_last_layer`` is then when the lead finished the last layer (monotonic clock).
    ``caches[r]`` are the node's views of rank r's shard (``RankCache``), what a transport
    reads; ``layer_counter`` is the lead rank's per-layer bump count. ``layer_signal=True``:
    the lead also posts a semaphore per layer, which ``wait_layers`` takes (someone must, or
    the count grows).
    """

    def __init__(self, cfg: ModelConfig, tp: int, num_pages: int, chunk: int, *, start_timeout: float = 60.0,
                 layer_signal: bool = False) -> None:
        from kvxfer.messenger.workers import collect

        cfg.check_tp(tp)
        self.cfg, self.tp, self.chunk, self.num_pages = cfg, tp, chunk, num_pages
        self.layout, self.sharding = cfg.layout(num_pages), cfg.sharding(tp)
        self._barrier = _CTX.Barrier(tp)
        self._scratch = _CTX.RawArray("f", 2 * cfg.units * chunk * cfg.hidden)
        self._counter = _CTX.RawArray("Q", 1)
        self.layer_counter = np.frombuffer(self._counter, np.uint64)
        self._signal = _CTX.Semaphore(0) if layer_signal else None
        self.t_last_layer = 0.0
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self.broken = ""  #: why the group stopped working ('' while it works)
        self._buffers: list[Any] = []
        self._tmp = ""
        self.caches: list[RankCache] = []
        env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # spawned children read these before numpy loads BLAS
        try:
            self._tmp = tempfile.mkdtemp(prefix="kvxfer-demo-")
            path = os.path.join(self._tmp, "kv.sock")
            for r in range(tp):
                parent, child = _CTX.Pipe()
                p = _CTX.Process(target=_worker, name=f"kvxfer-demo-tp{r}", daemon=True,
                                 args=(r, tp, cfg.to_dict(), num_pages, chunk, child, path, self._barrier,
                                       self._scratch, self._counter, self._signal))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            try:
                shards = collect(path, range(tp), timeout=start_timeout, check=self._check_workers)
            except PeerError:                # _check_workers: a worker is gone, said already
                raise
            except Exception as e:
                self._fail_start(f"a TP worker did not hand over its KV buffers: {e!r}")
            self._buffers = [b for r in range(tp) for b in shards[r]]
            self.caches = [RankCache(self.layout, self.sharding, [b.numpy() for b in shards[r]]) for r in range(tp)]
            self._gather("ready", start_timeout)
        except BaseException:
            self.close()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _check_workers(self) -> None:
        """While the buffers are collected: a worker that exited before it handed its buffers
        over fails the start at once (``PeerError`` naming the rank, its exit code and its
        error), not after the collection's timeout."""
        for r, p in enumerate(self._procs):
            if not p.is_alive():             # (is_alive reaps it: the exit code is known)
                self._fail_start(f"TP rank {r} exited (code {p.exitcode}) before handing over its KV buffers")

    def _fail_start(self, why: str) -> None:
        for c in self._conns:
            try:
                if c.poll(0.5):
                    msg = c.recv()
                    if msg[0] == "error":
                        why += f"\n--- rank {msg[1]} ---\n{msg[2]}"
            except (EOFError, OSError):  # a worker that died without a word: nothing to add
                pass
        raise PeerError(why)

    def _gather(self, kind: str, timeout: float) -> list[tuple]:
        """One reply per rank. A rank that dies or reports an error breaks the group: the
        barrier is aborted so the other ranks stop waiting, and PeerError carries the
        worker's traceback."""
        from multiprocessing.connection import wait

        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        by_obj = {**{c: r for r, c in enumerate(self._conns)}, **{p.sentinel: r for r, p in enumerate(self._procs)}}
        while len(got) < self.tp:
            left = deadline - time.monotonic()
            ready = wait([o for o, r in by_obj.items() if r not in got], max(left, 0)) if left > 0 else []
            if not ready:
                self._break(f"no {kind!r} from every TP rank within {timeout} s")
                raise KvxTimeoutError(f"TP ranks {sorted(set(range(self.tp)) - set(got))} gave no {kind!r} "
                                      f"within {timeout} s")
            for o in ready:
                r = by_obj[o]
                conn = self._conns[r]
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        self._procs[r].join(0.5)
                        msg = ("error", r, f"the worker closed its pipe (exit code {self._procs[r].exitcode})")
                else:  # the sentinel fired: the process is gone
                    self._procs[r].join(1.0)  # (the code comes with the reaping)
                    code = self._procs[r].exitcode
                    msg = ("error", r, f"the worker process exited (code {code})")
                if msg[0] == "error":
                    self._break(f"TP rank {msg[1]} failed")
                    raise PeerError(f"TP rank {msg[1]} failed:\n{msg[2]}")
                if msg[0] != kind:
                    self._break(f"unexpected {msg[0]!r}")
                    raise PeerError(f"TP rank {r} sent {msg[0]!r}, expected {kind!r}")
                got[r] = msg
        return [got[r] for r in range(self.tp)]

    def _break(self, why: str) -> None:
        self.broken = why
        try:
            self._barrier.abort()
        except Exception:
            pass

    def wait_layers(self, timeout: float) -> int:
        """Block (up to ``timeout``) until the lead rank finished a layer; return how many
        layers it finished since the last call (0 on timeout). Needs ``layer_signal=True``."""
        if self._signal is None:
            raise InvalidArgumentError("this group was made without layer_signal=True")
        if not self._signal.acquire(timeout=timeout):
            return 0
        n = 1
        while self._signal.acquire(block=False):
            n += 1
        return n

    def prefill(self, rid: Any, tokens: np.ndarray, pages: np.ndarray, timeout: float = 120.0,
                before_chunk: Callable[[int, int], None] | None = None) -> tuple[np.ndarray, float]:
        """Prefill ``tokens`` (the prompt less its last token) into ``pages`` on every rank,
        one forward pass per chunk; ``before_chunk(start, end)`` runs before each pass is
        sent to the ranks, the first before anything is sent and pass ``k + 1``'s while the
        ranks compute pass ``k`` (a streaming node schedules the pass there: planning is then
        off the critical path). So when it runs for pass ``k``, every layer of passes
        ``< k - 1`` is done and none of pass ``k``."""
        tokens = np.asarray(tokens, np.int64)
        pages = np.asarray(pages)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"pages must be a 1-D integer array, got {pages.dtype} {pages.shape}")
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise InvalidArgumentError(f"pages must lie in [0, {self.num_pages}), got {pages.min()}..{pages.max()}")
        if pages.size and len(np.unique(pages)) != pages.size:
            raise InvalidArgumentError("pages repeat a page")
        if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab)):
            raise InvalidArgumentError(f"tokens must be a 1-D list of ids in [0, {self.cfg.vocab})")
        if tokens.size and self.cfg.pages_for(len(tokens)) > len(pages):
            raise InvalidArgumentError(f"{len(tokens)} tokens need {self.cfg.pages_for(len(tokens))} pages, got {len(pages)}")
        if not tokens.size:
            return np.zeros(self.cfg.hidden, F32), 0.0
        if self.broken:
            raise PeerError(f"this TP group is broken ({self.broken}); close it and start another")
        pages = np.asarray(pages, np.int64)
        chunks = prefill_chunks(len(tokens), self.chunk)
        ctx, dt = None, 0.0
        if before_chunk is not None:
            before_chunk(*chunks[0])
        for k, (a, b) in enumerate(chunks):
            last = b == len(tokens)
            for r, c in enumerate(self._conns):
                try:
                    c.send(("chunk", rid, tokens[a:b], a, pages, last))
                except OSError as e:
                    self._break(f"TP rank {r} is gone")
                    raise PeerError(f"TP rank {r} is gone (its pipe: {e})") from e
            if before_chunk is not None and not last:
                before_chunk(*chunks[k + 1])  # while pass k computes: off the critical path
            results = self._gather("done", timeout)
            dt += results[0][3]
            self.t_last_layer = results[0][4]
            if last:
                ctx = results[0][2]
        assert ctx is not None
        return ctx, dt

    @property
    def src_regions(self) -> list[list[np.ndarray]]:
        return [c.regions for c in self.caches]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (join with a deadline, then kill) and unmap their shards."""
        for c in self._conns:
            try:
                c.send(("stop",))
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []
        self.caches = []
        for b in self._buffers:
            b.close()
        self._buffers = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = ""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
