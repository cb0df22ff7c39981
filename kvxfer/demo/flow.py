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

Transports: ``numpy`` (the prefill node is a thread of this process; KV moves as numpy
copies that follow ``kvxfer.plan``: no fabric) and ``shm`` / ``tcp;ofi_rxm`` (the prefill
node is its own process with a ``kvxfer.Messenger``; see :mod:`kvxfer.demo.nodes`).
The messenger transports stream by default (``stream=True``): each chunk's forward pass is
scheduled with the prefill messenger and the lead TP rank's per-layer signal bumps its layer
counter, so a layer's completed pages move while the next layers compute and the "transfer
tail" (the lead rank's last layer until the decoder's receive is done) is about the last
layer's share plus the context. With ``stream=False``, and always with ``numpy``, every layer
moves after the last one is computed: the tail is the whole transfer.

A one-token prompt has nothing to prefill: the decoder takes it at once, with a zero context
(the convention), and nothing is transferred.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvxfer.demo.config import DemoConfig, Handoff
from kvxfer.demo.model import F32, ModelConfig
from kvxfer.demo.runtime import (Decoding, Generation, LocalGroup, PagePool, check_prompt, colocated,
                                 decode_pages, kv_crc, prompt_pages)
from kvxfer.demo.transport import copy_plan
from kvxfer.errors import InvalidArgumentError, KvxferError, LayoutError

__all__ = ["DemoConfig", "RequestStats", "Report", "Handoff", "make_prompts", "DecodeNode", "NumpyTransport", "run",
           "check_config"]


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
    tail: float = 0.0  #: the lead rank's last layer computed until the receive is done
    streamed: bool = False  #: its KV moved layer by layer (False: every layer after the last)
    schedule: float = 0.0  #: streaming: the prefill node's time in ``Messenger.schedule`` (inside ``prefill``)
    wait: float = 0.0  #: receive done until its first decode step starts (batch full)
    first_step: float = 0.0  #: the first decode step (the last prompt token)
    ttft: float = 0.0  #: arrival until the first token
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    identical: bool | None = None  #: None when the request failed
    node: int = -1  #: the prefill node that served it (-1: none, a one-token prompt)
    error: str = ""  #: why it failed ("" if it did not)
    failed_after: float = 0.0  #: a failed request: seconds from the prefill node's kill to the failure
    after_kill: bool = False  #: a failed request: it failed after the drill's kill had fired
    context_crc: int = 0  #: CRC-32 of the context the decoder received (compared with colocated's)
    kv_crc: int = 0  #: CRC-32 of the prompt KV in the decoder's pages once received (``runtime.kv_crc``)
    kv_identical: bool | None = None  #: that KV equals colocated's (None when the request failed)


@dataclass
class Report:
    """A run's figures. ``identical``: every request that completed generated exactly the
    colocated tokens and accepted drafts from the same context, and the KV pages it received
    held exactly colocated's prompt KV; ``mismatches``: the requests that did not
    (``kv_mismatches``: those whose received KV differed); ``failed``: requests that failed
    (a killed node); ``killed``: the kill drill's SIGKILL fired (``kill_prefiller_after``)."""

    config: dict[str, Any]
    requests: list[RequestStats]
    wall: float
    tokens_per_s: float
    identical: bool
    mismatches: list[int]
    failed: list[int] = field(default_factory=list)
    messenger: dict[str, Any] = field(default_factory=dict)  #: the decoder messenger's counters
    kv_mismatches: list[int] = field(default_factory=list)
    killed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "wall_s": self.wall, "tokens_per_s": self.tokens_per_s,
                "identical": self.identical, "mismatches": self.mismatches, "kv_mismatches": self.kv_mismatches,
                "failed": self.failed, "killed": self.killed,
                "messenger": self.messenger, "requests": [asdict(r) for r in self.requests]}


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random lengths in ``[lo, hi]``; the first and last are ``lo`` and ``hi``
    long so the edges are always covered."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    if n >= 2:
        lens[0], lens[-1] = lo, hi
    return [rng.integers(0, vocab, int(k)).tolist() for k in lens]


class _Local(Handoff):
    """A hand-off that needs no transfer (a one-token prompt) or one done by a thread here."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.node = 0
        self.event = threading.Event()
        self.ctx = np.zeros(hidden, F32)

    @property
    def done(self) -> bool:
        return self.event.is_set()

    def context(self) -> np.ndarray:
        return self.ctx


class DecodeNode:
    """A decode TP group in this process (KV in memfd ``KVBuffer``s) and its page pool."""

    def __init__(self, cfg: ModelConfig, tp: int, num_pages: int) -> None:
        from kvxfer.buffers import KVBuffer

        self.cfg = cfg
        layout, sharding = cfg.layout(num_pages), cfg.sharding(tp)
        self.buffers = [[KVBuffer.allocate(n, "cpu", name=f"kvxfer-demo-dec{r}-{i}")
                         for i, n in enumerate(layout.region_sizes(sharding))] for r in range(tp)]
        self.group = LocalGroup(cfg, tp, num_pages, [[b.numpy() for b in bl] for bl in self.buffers])
        self.layout, self.sharding = layout, sharding
        self.pool = PagePool(num_pages)

    def handshake(self) -> dict[str, Any]:
        """What a prefill node needs to know (and check) before it writes here."""
        return {"model": self.cfg.fingerprint(), "layout": self.layout, "sharding": self.sharding}

    @property
    def regions(self) -> dict[int, list[np.ndarray]]:
        """Each rank's regions in the layout's order (what a messenger registers)."""
        return {r: c.regions for r, c in enumerate(self.group.caches)}

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]
        for bl in self.buffers:
            for b in bl:
                b.close()
        self.buffers = []


class NumpyTransport:
    """The fabric-free transport: the prefill node (a TP worker group) is driven by a thread
    of this process, which prefills requests one at a time, copies their KV into the
    decoder's pages as ``kvxfer.plan`` says, and hands over the context."""

    name = "numpy"

    def __init__(self, cfg: ModelConfig, dc: DemoConfig, decoder: DecodeNode, prefill_pages: int,
                 wake: threading.Event) -> None:
        from kvxfer.demo.tp import WorkerGroup

        if dc.prefill_nodes != 1 or dc.kill_prefiller_after:
            raise InvalidArgumentError("the numpy transport runs one prefill node and cannot kill it")
        self.cfg, self.decoder, self.wake = cfg, decoder, wake
        self._connect(decoder)
        self.workers = WorkerGroup(cfg, dc.prefill_tp, prefill_pages, dc.chunk)
        self.pool = PagePool(prefill_pages)
        self._q: queue.Queue[Any] = queue.Queue()
        kvxfer_plan_check(self.workers, decoder)
        self._thread = threading.Thread(target=self._serve, name="kvxfer-demo-prefill", daemon=True)
        self._thread.start()

    def _connect(self, decoder: DecodeNode) -> None:
        """Check the decoder's handshake: the same model."""
        hs = decoder.handshake()
        if hs["model"] != self.cfg.fingerprint():
            raise LayoutError(f"the decode node runs another model (config digest {hs['model']}, "
                              f"this prefill node {self.cfg.fingerprint()})")

    def submit(self, rid: int, prompt: np.ndarray, dst_pages: np.ndarray) -> Handoff:
        h = _Local(self.cfg.hidden)
        self._q.put((rid, prompt, dst_pages, h))
        return h

    def _serve(self) -> None:
        import kvxfer

        dec = self.decoder
        while True:
            item = self._q.get()
            if item is None:
                return
            rid, prompt, dst_pages, h = item
            try:
                npf = prompt_pages(self.cfg, len(prompt))
                src = self.pool.alloc(npf)
                assert src is not None  # one request at a time, pool sized for the longest
                t0 = time.monotonic()
                ctx, _ = self.workers.prefill(rid, prompt[:-1], src)
                t1 = time.monotonic()
                plan = kvxfer.plan(self.workers.layout, self.workers.sharding, dec.layout, dec.sharding,
                                   src, dst_pages[:npf], seed=rid)
                writes, nbytes = copy_plan(plan, self.workers.src_regions, [c.regions for c in dec.group.caches])
                h.ctx = ctx
                self.pool.release(src)
                h.figures = {"t_prefill_start": t0, "t_prefill_end": t1, "t_last_layer": self.workers.t_last_layer,
                             "streamed": False, "pages": npf, "bytes": nbytes, "writes": writes}
            except BaseException as e:  # the request fails; the node keeps serving
                h.error = e
            h.t_done = time.monotonic()
            h.event.set()
            self.wake.set()

    def collect_figures(self, timeout: float) -> None:
        """Figures are set before a hand-off is done: nothing to wait for."""

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(30)
        self.workers.close()


def kvxfer_plan_check(workers: Any, decoder: DecodeNode) -> None:
    """Layouts and shardings that cannot meet raise ``LayoutError`` here (an empty plan)."""
    import kvxfer

    kvxfer.plan(workers.layout, workers.sharding, decoder.layout, decoder.sharding, [], [])


def _transport(cfg: ModelConfig, dc: DemoConfig, decoder: DecodeNode, prefill_pages: int, slots: int,
               wake: threading.Event) -> Any:
    if dc.transport == "numpy":
        return NumpyTransport(cfg, dc, decoder, prefill_pages, wake)
    if dc.transport in ("shm", "tcp;ofi_rxm"):
        from kvxfer.demo.nodes import MessengerTransport

        return MessengerTransport(cfg, dc, decoder, prefill_pages, slots, wake)
    raise InvalidArgumentError(f"transport must be numpy, shm or tcp;ofi_rxm, got {dc.transport!r}")


def _prepare(dc: DemoConfig, prompts: list[list[int]] | None) -> tuple[ModelConfig, list[list[int]], int, int]:
    """Check the configuration and the prompts (``InvalidArgumentError`` before anything
    starts); return the model, the prompts, and the decoder's and prefill node's pool pages."""
    if dc.max_new < 1 or dc.max_batch < 1 or dc.chunk < 1 or dc.prefill_nodes < 1:
        raise InvalidArgumentError("max_new, max_batch, chunk and prefill_nodes must be >= 1")
    if dc.kill_prefiller_after and dc.prefill_nodes < 2:
        raise InvalidArgumentError("killing a prefill node needs a second one to keep serving (prefill_nodes=2)")
    if dc.transport not in ("numpy", "shm", "tcp;ofi_rxm"):
        raise InvalidArgumentError(f"transport must be numpy, shm or tcp;ofi_rxm, got {dc.transport!r}")
    if dc.transport == "numpy" and (dc.prefill_nodes != 1 or dc.kill_prefiller_after):
        raise InvalidArgumentError("the numpy transport runs one prefill node and cannot kill it")
    cfg = dc.model()
    cfg.check_tp(dc.prefill_tp)
    cfg.check_tp(dc.decode_tp)
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
    for p in prompts:
        check_prompt(cfg, p, dc.max_new)
        if decode_pages(cfg, len(p), dc.max_new) > dec_pages:
            raise InvalidArgumentError(f"a {len(p)}-token prompt needs more pages than the decoder's "
                                       f"{dec_pages}: refused before anything is sent")
    return cfg, prompts, dec_pages, pre_pages


def check_config(dc: DemoConfig, prompts: list[list[int]] | None = None) -> None:
    """Raise ``InvalidArgumentError`` for what ``run`` would refuse before starting anything
    (a bad command line, for the CLI)."""
    _prepare(dc, prompts)


def run(dc: DemoConfig, *, progress: Callable[[str], None] | None = None,
        prompts: list[list[int]] | None = None, reference: list[Generation] | None = None) -> Report:
    """Run the workload (``prompts``, else ``dc.prompts`` random ones) disaggregated, then
    (unless given) the colocated reference, and compare tokens, accepted drafts, the
    context bytes (CRC-32) each request started from and the prompt KV its pages held when
    its receive completed (CRC-32 of positions ``[0, len - 1)``, ``runtime.kv_crc``)."""
    cfg, prompts, dec_pages, pre_pages = _prepare(dc, prompts)
    rng = np.random.default_rng(dc.seed + 1)
    arrivals = np.cumsum(rng.exponential(dc.arrival_ms / 1000.0, len(prompts)))
    arrivals -= arrivals[0]

    wake = threading.Event()
    decoder = DecodeNode(cfg, dc.decode_tp, dec_pages)
    transport = None
    stats = [RequestStats(i, len(p)) for i, p in enumerate(prompts)]
    try:
        transport = _transport(cfg, dc, decoder, pre_pages, len(prompts), wake)
        pending = deque(range(len(prompts)))  # not yet admitted (arrival order)
        receiving: dict[int, tuple[Handoff, np.ndarray]] = {}
        quarantined: list[tuple[Handoff, np.ndarray]] = []  # failed: pages wait for the fence
        handoffs: dict[int, Handoff] = {}
        ready: deque[tuple[int, Decoding]] = deque()  # received, waiting for a batch slot
        active: dict[int, Decoding] = {}
        t_arrival: dict[int, float] = {}
        t_done: dict[int, float] = {}
        finished = 0
        t_start = time.monotonic()
        last_shown = 0.0
        while finished < len(prompts):
            now = time.monotonic()
            # admit arrived requests while pages last (in order: no overtaking)
            while pending and t_start + arrivals[pending[0]] <= now:
                i = pending[0]
                pages = decoder.pool.alloc(decode_pages(cfg, len(prompts[i]), dc.max_new))
                if pages is None:
                    break
                pending.popleft()
                t_arrival[i] = float(t_start + arrivals[i])
                prompt = np.asarray(prompts[i], np.int64)
                if len(prompt) == 1:
                    h: Handoff = _Local(cfg.hidden)
                    h.node = -1
                    h.t_done = time.monotonic()
                    h.figures = {"t_prefill_start": h.t_done, "t_prefill_end": h.t_done}
                    h.event.set()  # type: ignore[attr-defined]
                else:
                    try:
                        h = transport.submit(i, prompt, pages)
                    except KvxferError as e:  # no live prefill node, a dead peer: this request fails
                        h = _Local(cfg.hidden)
                        h.node = -1  # no node took it: not the killed node's failure
                        h.error, h.t_done = e, time.monotonic()
                        h.event.set()  # type: ignore[attr-defined]
                handoffs[i] = h
                receiving[i] = (h, pages)
            for i in [i for i, (h, _) in receiving.items() if h.done]:
                h, pages = receiving.pop(i)
                stats[i].node = h.node
                if h.error is not None:
                    stats[i].error = f"{type(h.error).__name__}: {h.error}"
                    killed = getattr(transport, "t_killed", None)  # inf: the kill is due, not yet done
                    if killed is not None and killed != float("inf") and h.t_done is not None:
                        stats[i].failed_after = h.t_done - killed
                        stats[i].after_kill = h.t_done >= killed
                    quarantined.append((h, pages))
                    finished += 1
                    continue
                t_done[i] = h.t_done if h.t_done is not None else time.monotonic()
                d = Decoding(len(prompts[i]), int(prompts[i][-1]), pages, dc.max_new)
                ctx = h.context()
                stats[i].context_crc = zlib.crc32(ctx.tobytes())
                # what landed in the pages, before any decode step writes them: the prompt's
                # positions [0, len - 1), compared with colocated's below
                stats[i].kv_crc = kv_crc(cfg, decoder.group.caches, pages, len(prompts[i]) - 1)
                d.start(decoder.group, ctx)
                h.release()
                ready.append((i, d))
            for h, pages in [q for q in quarantined if q[0].fenced]:
                decoder.pool.release(pages)
                quarantined.remove((h, pages))
            while ready and len(active) < dc.max_batch:
                i, d = ready.popleft()
                active[i] = d
            if not active:
                # nothing to decode: wait for a receive or the next arrival
                nxt = t_start + arrivals[pending[0]] - time.monotonic() if pending else 0.05
                wake.wait(max(min(nxt, 0.05), 0.0005))
                wake.clear()
                continue
            for i, d in list(active.items()):
                st = stats[i]
                first = not d.tokens
                t0 = time.monotonic()
                d.step(decoder.group)
                if first:
                    t1 = time.monotonic()
                    st.wait = t0 - t_done[i]
                    st.first_step = t1 - t0
                    st.ttft = t1 - t_arrival[i]
                if d.finished:
                    st.tokens, st.accepted = list(d.tokens), d.accepted
                    decoder.pool.release(d.pages)
                    del active[i]
                    finished += 1
            if progress is not None and time.monotonic() - last_shown > 0.2:
                last_shown = time.monotonic()
                progress(f"arrived {sum(1 for a in arrivals if t_start + a <= last_shown):>3}  "
                         f"prefill/transfer {len(receiving):>2}  decoding {len(active):>2}  "
                         f"waiting {len(ready):>2}  done {finished:>3}/{len(prompts)}  "
                         f"free pages {decoder.pool.free}")
        wall = time.monotonic() - t_start
        transport.collect_figures(timeout=5.0)
        counters = transport.stats() if hasattr(transport, "stats") else {}
        t_killed = getattr(transport, "t_killed", None)
        killed = t_killed is not None and t_killed != float("inf")
        for i, h in handoffs.items():
            f, st = h.figures, stats[i]
            st.pages, st.bytes, st.writes = f.get("pages", 0), f.get("bytes", 0), f.get("writes", 0)
            if "t_prefill_start" in f:
                st.queued = f["t_prefill_start"] - t_arrival[i]
                st.prefill = f["t_prefill_end"] - f["t_prefill_start"]
                st.streamed = bool(f.get("streamed", False))
                st.schedule = float(f.get("schedule_s", 0.0))
                if i in t_done:
                    st.tail = t_done[i] - f.get("t_last_layer", f["t_prefill_end"])
    finally:
        if transport is not None:
            transport.close()
        decoder.close()
    if progress is not None:
        progress(f"done {len(prompts)}/{len(prompts)} in {wall:.1f} s; running the colocated reference")
    ref = reference if reference is not None else colocated(cfg, prompts, max_new=dc.max_new, chunk=dc.chunk)
    mismatches, kv_mismatches, failed = [], [], []
    for st, g in zip(stats, ref):
        if st.error:
            failed.append(st.rid)
            continue
        st.kv_identical = g.kv_crc is not None and st.kv_crc == g.kv_crc
        st.identical = (tuple(st.tokens) == g.tokens and st.accepted == g.accepted
                        and st.context_crc == zlib.crc32(g.context) and st.kv_identical)
        if not st.kv_identical:
            kv_mismatches.append(st.rid)
        if not st.identical:
            mismatches.append(st.rid)
    total = sum(len(s.tokens) for s in stats)
    return Report(config=asdict(dc), requests=stats, wall=wall, tokens_per_s=total / wall,
                  identical=not mismatches, mismatches=mismatches, failed=failed, messenger=counters,
                  kv_mismatches=kv_mismatches, killed=killed)
