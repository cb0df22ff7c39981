"""The disaggregated run: a prefill node (TP worker processes) and a decode node (a scheduler
over its own paged pool), joined by a transport, checked against the colocated reference.

Life of a request (decode node's view):

1. *arrives*; the scheduler allocates every page the request will ever need
   (``decode_pages``: prompt plus generated tokens) or, when too few are free, keeps it
   queued in arrival order until pages are released. A request that could never fit (more
   pages than the whole pool, or positions beyond the model) is refused with
   ``InvalidArgumentError`` before anything is sent or written.
2. *sent* to the prefill node with its destination pages and a context slot;
3. the prefill node prefills ``prompt[:-1]`` on its TP group, moves the KV pages with the
   transport (a ``kvxfer.plan`` between the two nodes' layouts and shardings), writes the
   context (the last prefilled hidden state) into the slot, frees its source pages;
4. the request's *receive* completes; only then may the scheduler put it in the decode batch;
5. *decoding*: each step runs every request of the batch (at most ``max_batch``) one row at a
   time; after ``max_new`` tokens its pages are released.

Without layer streaming (the messenger's layer counter), every layer is moved after the last
layer is computed, so the "transfer tail" below is the whole transfer.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvxfer.demo.model import F32, ModelConfig, RankCache
from kvxfer.demo.runtime import (Decoding, Generation, LocalGroup, PagePool, check_prompt, colocated,
                                 decode_pages, prompt_pages)
from kvxfer.demo.transport import copy_plan
from kvxfer.errors import InvalidArgumentError, LayoutError

__all__ = ["DemoConfig", "RequestStats", "Report", "make_prompts", "DecodeNode", "PrefillNode", "run"]


@dataclass(frozen=True)
class DemoConfig:
    """One demo run: the workload, the deployment and the transport."""

    prompts: int = 50
    min_len: int = 1
    max_len: int = 400
    max_new: int = 32
    attention: str = "gqa"
    prefill_tp: int = 2
    decode_tp: int = 1
    chunk: int = 64  #: prefill chunk (tokens); smaller than most prompts
    max_batch: int = 8
    arrival_ms: float = 15.0  #: mean gap between arrivals (exponential), so prefills overlap decodes
    decode_pool_pages: int = 0  #: 0: enough for ``max_batch`` of the longest requests
    prefill_pool_pages: int = 0  #: 0: enough for the longest prompt
    transport: str = "numpy"
    seed: int = 0

    def model(self) -> ModelConfig:
        return ModelConfig(attention=self.attention)  # type: ignore[arg-type]


@dataclass
class RequestStats:
    """Per-request figures (seconds unless named otherwise)."""

    rid: int
    prompt_len: int
    pages: int = 0  #: pages moved (per destination rank)
    bytes: int = 0  #: bytes moved (all ranks)
    writes: int = 0  #: planner writes
    queued: float = 0.0  #: arrival until its prefill starts (pages, the prefill node's queue)
    prefill: float = 0.0  #: prefill compute on the TP group
    tail: float = 0.0  #: last layer computed until the receive is done (here: the whole transfer)
    wait: float = 0.0  #: receive done until its first decode step starts (batch full)
    first_step: float = 0.0  #: the first decode step (the last prompt token)
    ttft: float = 0.0  #: arrival until the first token
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    identical: bool | None = None


@dataclass
class Report:
    config: dict[str, Any]
    requests: list[RequestStats]
    wall: float
    tokens_per_s: float
    identical: bool
    mismatches: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "wall_s": self.wall, "tokens_per_s": self.tokens_per_s,
                "identical": self.identical, "mismatches": self.mismatches,
                "requests": [asdict(r) for r in self.requests]}


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random lengths in ``[lo, hi]``; the first and last are ``lo`` and ``hi``
    long so the edges are always covered."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    if n >= 2:
        lens[0], lens[-1] = lo, hi
    return [rng.integers(0, vocab, int(k)).tolist() for k in lens]


class _Receive:
    """The decoder's side of one request's hand-off: done when every page and the context landed."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.event.is_set()


class DecodeNode:
    """A decode TP group in this process, its page pool and its context slots."""

    def __init__(self, cfg: ModelConfig, tp: int, num_pages: int, slots: int) -> None:
        from kvxfer.buffers import KVBuffer

        self.cfg = cfg
        layout, sharding = cfg.layout(num_pages), cfg.sharding(tp)
        n = RankCache.nbytes_for(layout, sharding)
        self.buffers = [KVBuffer.allocate(n, "cpu", name=f"kvxfer-demo-dec{r}") for r in range(tp)]
        self.group = LocalGroup(cfg, tp, num_pages, [b.numpy() for b in self.buffers])
        self.pool = PagePool(num_pages)
        #: one float32 hidden state per slot: the context-slot format (see docs)
        self.contexts = np.zeros((slots, cfg.hidden), F32)
        self.free_slots = list(range(slots - 1, -1, -1))

    def handshake(self) -> dict[str, Any]:
        """What a prefill node needs to know (and check) before it writes here."""
        return {"model": self.cfg.fingerprint(), "layout": self.group.layout, "sharding": self.group.sharding}

    @property
    def dst_regions(self) -> list[list[np.ndarray]]:
        return [c.regions for c in self.group.caches]

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]
        for b in self.buffers:
            b.close()
        self.buffers = []


class PrefillNode:
    """The prefill node: a TP worker group, its source page pool, and a service thread that
    prefills queued requests one at a time and pushes their KV to the decoder."""

    def __init__(self, cfg: ModelConfig, tp: int, num_pages: int, chunk: int) -> None:
        from kvxfer.demo.tp import WorkerGroup

        self.cfg = cfg
        self.workers = WorkerGroup(cfg, tp, num_pages, chunk)
        self.pool = PagePool(num_pages)
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-demo-prefill", daemon=True)
        self._peer: DecodeNode | None = None

    def connect(self, decoder: DecodeNode) -> None:
        """Check the decoder's handshake: same model, layouts and shardings that can meet."""
        import kvxfer

        hs = decoder.handshake()
        if hs["model"] != self.cfg.fingerprint():
            raise LayoutError(f"the decode node runs another model (config digest {hs['model']}, "
                              f"this prefill node {self.cfg.fingerprint()})")
        kvxfer.plan(self.workers.layout, self.workers.sharding, hs["layout"], hs["sharding"], [], [])
        self._peer = decoder
        self._thread.start()

    def submit(self, st: RequestStats, prompt: np.ndarray, dst_pages: np.ndarray, slot: int, rx: _Receive) -> None:
        self._q.put((st, prompt, dst_pages, slot, rx))

    def _serve(self) -> None:
        import kvxfer

        dec = self._peer
        assert dec is not None
        while True:
            item = self._q.get()
            if item is None:
                return
            st, prompt, dst_pages, slot, rx = item
            try:
                npf = prompt_pages(self.cfg, len(prompt))
                src = self.pool.alloc(npf)
                assert src is not None  # one request at a time, pool sized for the longest
                t0 = time.perf_counter()
                st.queued = float(t0 - st._arrival)  # type: ignore[attr-defined]
                ctx, _ = self.workers.prefill(st.rid, prompt[:-1], src)
                t1 = time.perf_counter()
                plan = kvxfer.plan(self.workers.layout, self.workers.sharding, dec.group.layout, dec.group.sharding,
                                   src, dst_pages[:npf], seed=st.rid)
                st.writes, st.bytes = copy_plan(plan, self.workers.src_regions, dec.dst_regions)
                dec.contexts[slot] = ctx
                self.pool.release(src)
                t2 = time.perf_counter()
                st.pages, st.prefill, st.tail = npf, t1 - t0, t2 - t1
                st._done = t2  # type: ignore[attr-defined]
            except BaseException as e:  # the request fails; the node keeps serving
                rx.error = e
            rx.event.set()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(30)
        self.workers.close()


def run(dc: DemoConfig, *, progress: Callable[[str], None] | None = None,
        prompts: list[list[int]] | None = None, reference: list[Generation] | None = None) -> Report:
    """Run the workload (``prompts``, else ``dc.prompts`` random ones) disaggregated, then
    (unless given) the colocated reference, and compare tokens and accepted drafts."""
    if dc.transport != "numpy":
        raise InvalidArgumentError(f"transport {dc.transport!r} is not available (have: numpy)")
    if dc.max_new < 1 or dc.max_batch < 1 or dc.chunk < 1:
        raise InvalidArgumentError("max_new, max_batch and chunk must be >= 1")
    cfg = dc.model()
    if prompts is None:
        if not 1 <= dc.min_len <= dc.max_len or dc.prompts < 1:
            raise InvalidArgumentError(f"need prompts >= 1 and 1 <= min_len <= max_len, got {dc.prompts}, "
                                       f"{dc.min_len}, {dc.max_len}")
        prompts = make_prompts(dc.prompts, dc.min_len, dc.max_len, cfg.vocab, dc.seed)
    if not prompts:
        raise InvalidArgumentError("no prompts")
    longest = max(len(p) for p in prompts)
    dec_pages = dc.decode_pool_pages or dc.max_batch * decode_pages(cfg, longest, dc.max_new)
    pre_pages = dc.prefill_pool_pages or max(prompt_pages(cfg, longest), 1)
    rng = np.random.default_rng(dc.seed + 1)
    arrivals = np.cumsum(rng.exponential(dc.arrival_ms / 1000.0, len(prompts)))
    arrivals -= arrivals[0]
    for p in prompts:
        check_prompt(cfg, p, dc.max_new)
        if decode_pages(cfg, len(p), dc.max_new) > dec_pages:
            raise InvalidArgumentError(f"a {len(p)}-token prompt needs more pages than the decoder's "
                                       f"{dec_pages}: refused before anything is sent")

    decoder = DecodeNode(cfg, dc.decode_tp, dec_pages, slots=len(prompts))
    prefiller = PrefillNode(cfg, dc.prefill_tp, pre_pages, dc.chunk)
    stats = [RequestStats(i, len(p)) for i, p in enumerate(prompts)]
    try:
        prefiller.connect(decoder)
        pending = deque(range(len(prompts)))  # not yet admitted (arrival order)
        receiving: dict[int, tuple[_Receive, np.ndarray, int]] = {}
        ready: deque[int] = deque()  # received, waiting for a batch slot
        active: dict[int, Decoding] = {}
        finished = 0
        t_start = time.perf_counter()
        last_shown = 0.0
        while finished < len(prompts):
            now = time.perf_counter()
            # admit arrived requests while pages last (in order: no overtaking)
            while pending and t_start + arrivals[pending[0]] <= now:
                i = pending[0]
                pages = decoder.pool.alloc(decode_pages(cfg, len(prompts[i]), dc.max_new))
                if pages is None:
                    break
                pending.popleft()
                slot = decoder.free_slots.pop()
                rx = _Receive()
                stats[i]._arrival = float(t_start + arrivals[i])  # type: ignore[attr-defined]
                receiving[i] = (rx, pages, slot)
                prefiller.submit(stats[i], np.asarray(prompts[i], np.int64), pages, slot, rx)
            for i in [i for i, (rx, _, _) in receiving.items() if rx.done]:
                rx, pages, slot = receiving.pop(i)
                if rx.error is not None:
                    raise rx.error
                d = Decoding(len(prompts[i]), int(prompts[i][-1]), pages, dc.max_new)
                d.start(decoder.group, decoder.contexts[slot])
                decoder.free_slots.append(slot)
                ready.append(i)
                stats[i]._dec = d  # type: ignore[attr-defined]
            while ready and len(active) < dc.max_batch:
                i = ready.popleft()
                active[i] = stats[i]._dec  # type: ignore[attr-defined]
            if not active:
                # nothing to decode: wait for a receive or the next arrival
                nxt = t_start + arrivals[pending[0]] - time.perf_counter() if pending else 0.05
                waits = [rx for rx, _, _ in receiving.values()]
                if waits:
                    waits[0].event.wait(max(min(nxt, 0.05), 0.0005))
                elif pending:
                    time.sleep(max(min(nxt, 0.05), 0.0))
                continue
            for i, d in list(active.items()):
                st = stats[i]
                first = not d.tokens
                t0 = time.perf_counter()
                d.step(decoder.group)
                if first:
                    t1 = time.perf_counter()
                    st.wait = t0 - st._done  # type: ignore[attr-defined]
                    st.first_step = t1 - t0
                    st.ttft = float(t1 - st._arrival)  # type: ignore[attr-defined]
                if d.finished:
                    st.tokens, st.accepted = list(d.tokens), d.accepted
                    decoder.pool.release(d.pages)
                    del active[i]
                    finished += 1
            if progress is not None and time.perf_counter() - last_shown > 0.2:
                last_shown = time.perf_counter()
                progress(f"arrived {sum(1 for a in arrivals if t_start + a <= last_shown):>3}  "
                         f"prefill/transfer {len(receiving):>2}  decoding {len(active):>2}  "
                         f"waiting {len(ready):>2}  done {finished:>3}/{len(prompts)}  "
                         f"free pages {decoder.pool.free}")
        wall = time.perf_counter() - t_start
    finally:
        prefiller.close()
        decoder.close()
    if progress is not None:
        progress(f"done {len(prompts)}/{len(prompts)} in {wall:.1f} s; running the colocated reference")
    ref = reference if reference is not None else colocated(cfg, prompts, max_new=dc.max_new, chunk=dc.chunk)
    mismatches = []
    for st, g in zip(stats, ref):
        st.identical = tuple(st.tokens) == g.tokens and st.accepted == g.accepted
        if not st.identical:
            mismatches.append(st.rid)
        for k in ("_arrival", "_done", "_dec"):
            st.__dict__.pop(k, None)
    total = sum(len(s.tokens) for s in stats)
    return Report(config=asdict(dc), requests=stats, wall=wall, tokens_per_s=total / wall,
                  identical=not mismatches, mismatches=mismatches)


def _stderr(line: str) -> None:
    sys.stderr.write("\r\x1b[2K" + line)
    sys.stderr.flush()
