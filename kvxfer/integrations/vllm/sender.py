"""The prefiller's writes: one TP rank's held blocks of finished requests, written when a
decoder's REQUEST for them comes (``on_request``, the messenger's callback thread), or exposed
for the decoder to read when it asks by pull (``Messenger.send`` either way; a pull request is
never streamed: it is exposed once its prompt is computed), refused
with ``Request.reject`` (the decoder's ``RejectedError``: recompute) when they are gone or
were never here, and handed back to vLLM once every decoder rank that has to ask was served
(``Messenger.poll()`` reports the Sends final)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.loader import remember
from kvxfer.integrations.vllm.stats import KvxferConnectorStats
# the id's wire encoding, which the replica seed hashes (the messenger has no public name for it)
from kvxfer.planner import writing_ranks

log = logging.getLogger("kvxfer.integrations.vllm")


class _Held:
    """A finished request's blocks, held for its decoder's ranks."""

    __slots__ = ("blocks", "finished", "rid", "sending", "served", "since", "want")

    def __init__(self, rid: str, blocks: list[int], since: float, finished: bool = True) -> None:
        self.rid = rid                     # P's vLLM request id (what finished_sending names)
        self.blocks = blocks
        self.finished = finished           # vLLM finished the request (a streamed one: not yet)
        self.since = since                 # held since, or last served at
        self.want: Optional[set] = None    # the decoder ranks whose REQUEST this rank serves
        self.served: set = set()           # decoder ranks whose REQUEST came (sent or given up)
        self.sending = 0                   # Sends not final yet


class Sender:
    """The sends of one prefill rank (``messenger`` holds its rank only; see the module
    docstring). ``on_request`` is the messenger's callback; ``step`` runs every engine step."""

    def __init__(self, messenger: Any, rank: int, options: Any, stats: KvxferConnectorStats) -> None:
        self.messenger = messenger
        self.rank = rank
        self.options = options
        self.stats = stats
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}            # transfer key -> held blocks
        self._asked: dict[str, list[Any]] = {}       # transfer key -> REQUESTs before its blocks
        self._asked_since: dict[str, float] = {}
        self._sends: dict[Any, str] = {}             # Send -> transfer key
        self._gone: dict[str, str] = {}              # keys sent or expired -> why (rejected at once)
        self._done: set[str] = set()                 # vLLM request ids whose blocks are free
        self.recent_sends: dict[str, list[int]] = {}
        self._open: dict[str, list[Any]] = {}        # transfer key -> (Request, Send) streamed, last chunk to come
        self._pass: Any = None                       # the forward pass streaming now
        self._pass_sends: list[Any] = []
        self._layer = 0                              # layers of the pass bumped
        self._seen: set[int] = set()                 # layers of the pass computed
        self.num_layers = messenger.layout.num_layers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._housekeeping, name="kvxfer-vllm-asked", daemon=True)
        messenger.poll()                             # reporting on (the first call returns [])
        self._thread.start()

    # -- the decoder's REQUEST (callback thread) ---------------------------------------------
    def on_request(self, req: Any) -> None:
        key = str(req.request_id)
        with self._lock:
            held = self._held.get(key)
            gone = self._gone.get(key) if held is None else None
            if held is not None and not held.finished:
                held = None                          # streaming now: served once it finished
            if held is None and gone is None:        # before its prefill ended (D first), or unknown
                self._asked.setdefault(key, []).append(req)
                self._asked_since.setdefault(key, time.monotonic())
                return
            if held is not None:
                held.sending += 1
        if gone is not None:
            self._reject(req, f"request {key!r} {gone}")
        else:
            self._send(key, req, held)

    def _want(self, req: Any) -> set:
        """The decoder ranks whose REQUESTs this rank serves for ``req``'s key: those the
        decoder's owner draw (``writing_ranks`` with the request's replica
        seed, over the decoder's pages) has this rank write to; every rank of a node decoder."""
        pg, m = req.peer, self.messenger
        n = len(req.dst_pages)          # equal block sizes: the decoder draws over its page list
        seed = req.replica_seed
        return {d for d in range(pg.sharding.tp_size)
                if self.rank in writing_ranks(m.layout, m.sharding, pg.layout, pg.sharding, [d], n, seed=seed)}

    def _send(self, key: str, req: Any, held: _Held) -> None:
        bs = self.messenger.layout.page_size
        n = -(-int(req.num_tokens) // bs)
        s = None
        try:
            if n > len(held.blocks) or n <= 0:
                raise KvxferError(f"decoder asks for {req.num_tokens} tokens of {key!r}, which holds "
                                  f"{len(held.blocks)} blocks of {bs}")
            want = self._want(req)
            src = held.blocks[:n]
            s = self.messenger.send(req, src, context=None)
            remember(self.recent_sends, key, src)
        except KvxferError as exc:
            log.warning("kvxfer: cannot write %s: %s", key, exc)
            want = None
            self._reject(req, str(exc))
        with self._lock:
            held.sending -= 1
            if want is not None and held.want is None:
                held.want = want
            if s is not None:
                held.sending += 1
                self._sends[s] = key
            else:
                held.served.update(req.peer.ranks)
            held.since = time.monotonic()

    def _reject(self, req: Any, reason: str) -> None:
        try:
            req.reject(reason)
            self.stats.record_send("rejected")
        except KvxferError as exc:                   # final meanwhile, or the messenger closed
            log.warning("kvxfer: cannot reject %r: %s", req.request_id, exc)

    # -- every step ----------------------------------------------------------------------------
    def step(self, sends: dict[str, tuple[str, list[int]]]) -> None:
        """``sends``: requests that finished this step with their blocks held (vLLM id ->
        (transfer key, blocks)); write those a decoder already asked for."""
        now = time.monotonic()
        ready = []
        with self._lock:
            for rid, (key, blocks) in sends.items():
                held = self._held.get(key)
                if held is not None and not held.finished and held.rid == rid:
                    held.finished, held.since = True, now      # streamed while it computed
                else:
                    held = self._held[key] = _Held(rid, list(blocks), now)
                    self._gone.pop(key, None)
                for req in self._asked.pop(key, ()):
                    ready.append((key, req, held))
                    held.sending += 1
                self._asked_since.pop(key, None)
        for key, req, held in ready:
            if req.aborted or not req.peer.alive:
                with self._lock:
                    held.sending -= 1
                continue
            self._send(key, req, held)

    def finished(self, wait: float = 0.0) -> set[str]:
        """vLLM request ids whose held blocks are free since the last call: every decoder rank
        that had to ask was served (or gave up), or nobody asked within ``unclaimed_timeout``.
        With blocks held, waits up to ``wait`` seconds for a Send to end (a REQUEST that comes
        meanwhile is served on the callback thread, not by this step)."""
        with self._lock:
            busy = bool(self._held or self._sends) and not self._done
        final = self.messenger.poll(wait if busy else 0.0)
        now = time.monotonic()
        with self._lock:
            for s in final:
                key = self._sends.pop(s, None)
                held = self._held.get(key) if key is not None else None
                self.stats.record_send("done" if s.state == "done" else "failed")
                if held is None:
                    continue
                held.sending -= 1
                held.served.update(s.request.peer.ranks)
                held.since = now
            for key, held in list(self._held.items()):
                if not held.finished:                    # streamed, vLLM still has the request
                    continue
                served = held.sending == 0 and held.want is not None and held.want <= held.served
                expired = held.sending == 0 and now - held.since > self.options.unclaimed_timeout
                if served or expired:
                    del self._held[key]
                    self._done.add(held.rid)
                    self._gone[key] = "was sent" if served else "expired unclaimed"
                    while len(self._gone) > 4096:
                        del self._gone[next(iter(self._gone))]
                    if expired and not held.served:
                        self.stats.record_send("unclaimed")
            out, self._done = self._done, set()
        return out

    # -- layer streaming (D first: the REQUEST came before the prefill) --------------------------
    def begin_pass(self, streams: dict[str, Any]) -> None:
        """Before a forward pass: each D-first prompt it computes, whole or a chunk
        (``streams``: id -> ``params.Stream``), whose decoder's REQUEST is here gets a streamed
        Send at its first such pass, and each pass schedules the chunk it computes
        (``Messenger.schedule``): layer l's writes are posted once the model has computed it
        (``layer_done``), while layer l + 1 computes. A chunk moves the whole blocks it
        completes (a block split by the chunk's end goes with the next chunk: the CPU cache's K
        is transposed per block); the last chunk ends at the block end the decoder named."""
        if not streams:
            return
        now = time.monotonic()
        todo, fresh = [], []
        with self._lock:
            for rid, st in streams.items():
                open_ = self._open.get(st.key)
                if open_ is not None:                # a later chunk of a stream begun before
                    held = self._held.get(st.key)
                    if held is not None:
                        held.blocks = list(st.blocks)
                    todo += [(st, req, snd) for req, snd in open_ if not snd.stopped]
                    continue
                live = [q for q in self._asked.get(st.key, ()) if not q.aborted and q.peer.alive]
                # a pull request is exposed whole once the prompt is computed (step()), never
                # streamed: it waits on in _asked
                reqs = [q for q in live if not q.pull]
                if not reqs:
                    continue
                pulls = [q for q in live if q.pull]
                if pulls:
                    self._asked[st.key] = pulls
                else:
                    self._asked.pop(st.key, None)
                    self._asked_since.pop(st.key, None)
                held = self._held[st.key] = _Held(rid, list(st.blocks), now, finished=False)
                self._gone.pop(st.key, None)
                held.sending += len(reqs)
                fresh += [(st, q, held) for q in reqs]
        bs = self.messenger.layout.page_size
        self.messenger.layer_counter                 # made (with its watcher) before the pass
        made = []
        for st, req, held in fresh:
            n = -(-int(req.num_tokens) // bs)
            try:
                if n > -(-st.num_tokens // bs) or n <= 0:
                    raise KvxferError(f"decoder asks for {req.num_tokens} tokens of {st.key!r}, whose prompt "
                                      f"has {st.num_tokens} tokens in blocks of {bs}")
                snd = self.messenger.stream(req, st.blocks[:n])
            except KvxferError as exc:
                log.warning("kvxfer: cannot stream %s: %s", st.key, exc)
                self._reject(req, str(exc))
                with self._lock:
                    held.sending -= 1
                    held.served.update(req.peer.ranks)
                continue
            made.append((st, req, snd, held))
            todo.append((st, req, snd))
        chunks, used = [], []
        for st, req, snd in todo:
            n = -(-int(req.num_tokens) // bs)
            last = st.end >= st.num_tokens
            end = int(req.num_tokens) if last else min(st.end // bs * bs, int(req.num_tokens))
            start = snd.next_token
            if end <= start:                         # no whole block completed this pass
                continue
            chunks.append((snd, start, end, st.blocks[:n]))
            used.append((st, req, snd, last))
        if made:
            with self._lock:
                for st, req, snd, held in made:
                    if held.want is None:
                        held.want = self._want(req)
                    self._sends[snd] = st.key
                    self._open.setdefault(st.key, []).append((req, snd))
        try:
            p = self.messenger.schedule(chunks) if chunks else None
        except KvxferError as exc:                   # nothing armed: give these streams up
            log.warning("kvxfer: cannot schedule the streamed writes: %s", exc)
            for st, _req, snd, _last in used:
                with self._lock:
                    self._open.pop(st.key, None)
                snd.abort(timeout=0)
            return
        for _st, _req, snd, _held in made:
            snd.finish(None)                         # no context: the count is the layers' writes
        for st, req, snd, last in used:
            remember(self.recent_sends, st.key, st.blocks[:-(-int(req.num_tokens) // bs)])
            if last:
                with self._lock:
                    self._open.pop(st.key, None)
        if p is not None:
            self._pass, self._pass_sends, self._layer, self._seen = p, [u[2] for u in used], 0, set()
        self.stats.data["sends_streamed"] += len(made)
        self.stats.data["stream_chunks"] += len(used)

    def end_streams(self, ends: dict[str, bool]) -> None:
        """Give up the streams of prompts that stopped before their last chunk (their Sends
        aborted: the decoder fences and its policy recomputes). ``ends[rid]``: True where vLLM
        holds the blocks until this rank reports the id finished sending (an abort), False
        where the request goes on in other blocks (preempted and resumed; not sent again)."""
        now = time.monotonic()
        stop = []
        with self._lock:
            for rid, held_by_vllm in ends.items():
                key = next((k for k, h in self._held.items() if h.rid == rid and not h.finished), None)
                if key is None:                      # nothing streamed yet
                    if held_by_vllm:
                        self._done.add(rid)
                    continue
                stop += [snd for _req, snd in self._open.pop(key, ())]
                held = self._held[key]
                if held_by_vllm:                     # freed by finished() once its Sends are final
                    held.finished, held.since = True, now
                    if held.want is None:
                        held.want = set()
                else:
                    del self._held[key]
                    self._gone[key] = "was given up (its prefill was preempted)"
        for snd in stop:
            snd.abort(timeout=0)

    def layer_done(self, index: Optional[int]) -> None:
        """The model computed layer ``index`` of the layout (vLLM's ``save_kv_layer``; on CPU
        the attention op is synchronous, so the layer's KV is in the cache now). The counter
        is bumped through every layer below the lowest not yet computed: a layer seen again
        in the pass (a draft model's later proposing steps) or not in the layout (None)
        bumps nothing."""
        if self._pass is None or index is None or index in self._seen:
            return
        self._seen.add(index)
        while self._layer in self._seen:
            self._layer += 1
            if self._layer == self.num_layers:
                # streaming visible: the writes already posted before the last layer is released
                posted = sum(snd.count_entries("posted", "failed") for snd in self._pass_sends)
                self.stats.data["stream_entries"] += sum(snd.count_entries() for snd in self._pass_sends)
                self.stats.data["stream_entries_early"] += posted
            self.messenger.layer_counter.bump()

    def end_pass(self) -> None:
        """vLLM's ``wait_for_save``: the pass is over; one that did not see every layer (not
        expected from vLLM) is abandoned with the fence."""
        p, self._pass = self._pass, None
        if p is not None and self._layer != self.num_layers:
            log.warning("kvxfer: a streamed pass saw %d of %d layers; abandoned", self._layer, self.num_layers)
            p.abandon()
        self._pass_sends = []

    def _housekeeping(self) -> None:
        """REQUESTs wait outside vLLM's steps (the engine may be idle): forget those the decoder
        aborted or whose decoder died, reject those for an id not finished here in time."""
        while not self._stop.wait(0.5):
            now = time.monotonic()
            stale = []
            with self._lock:
                for key in list(self._asked):
                    reqs = [q for q in self._asked[key] if not q.aborted and q.peer.alive]
                    if not reqs:
                        del self._asked[key]
                        self._asked_since.pop(key, None)
                    elif now - self._asked_since[key] > self.options.unclaimed_timeout:
                        stale += reqs
                        del self._asked[key]
                        del self._asked_since[key]
                    else:
                        self._asked[key] = reqs
            for req in stale:
                self._reject(req, f"request {req.request_id!r} did not finish here within "
                                  f"{self.options.unclaimed_timeout} s")

    def busy(self) -> bool:
        with self._lock:
            return bool(self._held or self._sends)

    def held(self) -> dict[str, list[int]]:
        with self._lock:
            return {k: list(h.blocks) for k, h in self._held.items()}

    def asked(self) -> list[str]:
        with self._lock:
            return sorted(self._asked)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
