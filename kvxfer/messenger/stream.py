"""Layer-by-layer streaming: the layer counter, forward passes and the chunk rule.

The model increments one monotonic 64-bit counter once per layer (``LayerCounter.bump`` on a
CPU model; ``bump_on(stream)`` enqueues the increment on a CUDA stream, capturable in a CUDA
graph). Before each forward pass the scheduler calls ``Messenger.schedule(chunks)``, which
returns a ``Pass``:

* **Counter semantics.** Every scheduled pass consumes exactly ``num_layers`` increments, in
  the order passes were scheduled. A pass's ``base`` is ``max(value at schedule time, end
  of the previously scheduled pass)``, its ``end`` is ``base + num_layers``; layer ``l`` of
  the pass is computed once the counter reaches ``base + l + 1``. 64 bits never wrap.
* **Abandon.** ``Pass.abandon()`` (the model will not finish the pass): every still-armed
  write of the pass is disarmed, the Sends in it are aborted with the fence (the decoder is
  told exactly what was posted), and the counter skips the pass's layers so later passes
  keep their bases: raised to ``end`` at once when the counter already reached ``base``
  (the pass was running, or is next: call it only once the model stopped bumping for it),
  else **deferred**: a pass scheduled ahead is skipped when the counter reaches its
  ``base`` (the passes before it finished), by adding ``num_layers`` then. The writes of
  the passes before it still fire at their own layers, never early; a later pass's writes
  may fire late by the time it takes to apply the skip (at once in ``bump()``, within about
  a millisecond on the messenger thread for a counter bumped by a kernel).
* **The chunk rule.** A chunk ``(send, start_token, end_token)`` writes, at every layer, the
  pages whose last token lies in ``[start_token, end_token)``; the request's last, partial
  page goes in its last chunk (``end_token == num_tokens``, ``Send.last_chunk``). So every
  page travels once per layer however the prompt was chunked, and a chunk boundary inside a
  page is safe (the page goes with the chunk that completes it).
* **Count and context.** When the last chunk is scheduled every write of the request is
  known: the prefiller ANNOUNCEs the exact count then (the decoder's counting rule is
  unchanged). The context (``Send.finish``, which may come before the last layer) is armed
  at the last pass's ``end``, after that layer's writes.

The watcher thread (``Engine.watcher``, native) posts the armed writes; no Python runs per
layer on the model's side.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Optional

import numpy as np

from kvxfer.errors import ClosedError, InvalidArgumentError, KvxferError, PlanError, UnsupportedError
from kvxfer.messenger import _args, prefix
from kvxfer.messenger._codec import MAX_PAGES
from kvxfer.messenger._node import Node
from kvxfer.messenger.prefill import Prefiller
from kvxfer.messenger.send import Request, Send, StreamState

__all__ = ["LayerCounter", "Pass", "Streamer", "pages_completed"]

_pass_ids = itertools.count(1)


def pages_completed(num_tokens: int, page_size: int, start: int, end: int) -> np.ndarray:
    """Indices of the request's pages written by chunk ``[start, end)``: those whose last
    token (``min((p + 1) * page_size, num_tokens) - 1``) lies in the chunk."""
    for name, v in (("num_tokens", num_tokens), ("page_size", page_size), ("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"{name} must be an int, got {v!r}")
    num_tokens, page_size = int(num_tokens), int(page_size)
    if not 1 <= page_size < 2**63 or not 0 <= num_tokens < 2**63 or -(-num_tokens // page_size) > MAX_PAGES:
        raise InvalidArgumentError(f"{num_tokens} tokens in pages of {page_size} are not a request's "
                                   f"(at most {MAX_PAGES} pages)")
    return _pages_completed(num_tokens, page_size, int(start), int(end))


def _pages_completed(num_tokens: int, page_size: int, start: int, end: int) -> np.ndarray:
    """``pages_completed`` of values already checked (ints; a request's tokens and pages)."""
    npages = -(-num_tokens // page_size)
    start, end = min(max(start, 0), num_tokens), min(max(end, 0), num_tokens)     # int64-safe, same pages
    # the first page whose last token is at or after t (last tokens ascend with the page)
    a = npages if start >= num_tokens else min(-(-(start + 1) // page_size) - 1, npages - 1)
    b = npages if end >= num_tokens else min(-(-(end + 1) // page_size) - 1, npages - 1)
    return np.arange(a, max(a, b), dtype=np.int64)


class LayerCounter:
    """The counter a model bumps once per layer; a native watcher thread acts on it.

    ``value``: the counter now. ``bump(n=1)``: add ``n`` from the CPU (wakes the watcher at
    once). ``ptr``: the address a kernel increments (device-visible when the messenger was
    given ``counter_device``). ``bump_on(stream)``: enqueue ``+1`` on a CUDA stream (torch
    stream or a raw ``CUstream``), capturable in a CUDA graph. See the module docstring for
    what a pass's base and end are."""

    def __init__(self, watcher: Any, num_layers: int, device_ptr: Optional[int] = None,
                 device: Optional[int] = None) -> None:
        self._w = watcher
        self.num_layers = int(num_layers)
        self._dptr = device_ptr
        self.device = device
        self._next_base = 0            # end of the last scheduled pass
        self._lock = threading.Lock()
        self._skips: list[tuple[int, int]] = []   # (base, end) of passes abandoned ahead, by base
        self._kernel: Any = None
        self._kernel_error: Optional[KvxferError] = None
        if device_ptr is not None:
            # now, not at the first bump_on: that one is usually inside a CUDA graph capture,
            # where the driver refuses to load a module ("operation not permitted when stream
            # is capturing"). A counter a caller's own kernel bumps needs no NVRTC: keep why.
            from kvxfer.messenger import _cudabump

            try:
                self._kernel = _cudabump.Kernel(int(device))
            except KvxferError as exc:
                self._kernel_error = exc

    @property
    def value(self) -> int:
        return self._w.value

    def bump(self, n: int = 1) -> int:
        """Add ``n`` (a CPU model, after each layer); returns the new value."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n < 2**63:
            raise InvalidArgumentError(f"bump takes a positive int below 2**63, got {n!r}")
        v = self._w.bump(int(n))
        if self._skips:
            v = self._apply_skips()
        return v

    @property
    def ptr(self) -> int:
        """The counter's address for a kernel: the device pointer of the mapped host word
        with ``counter_device``, else the host address."""
        return self._dptr if self._dptr is not None else self._w.ptr

    @property
    def host_ptr(self) -> int:
        return self._w.ptr

    def bump_on(self, stream: Any) -> None:
        """Enqueue ``counter += 1`` on a CUDA stream (a ``torch.cuda.Stream``, or anything
        with ``cuda_stream``, or an int handle); capturable in a CUDA graph."""
        if self._dptr is None:
            raise UnsupportedError("bump_on needs a messenger made with counter_device= (a CUDA device)")
        from kvxfer.messenger import _cudabump

        handle = getattr(stream, "cuda_stream", stream)
        if self._kernel is None:
            if self._kernel_error is not None:
                raise self._kernel_error
            self._kernel = _cudabump.Kernel(self.device)
        self._kernel.launch(int(handle), self._dptr)

    @property
    def next_base(self) -> int:
        """The base the next scheduled pass gets (if the counter is not already past it)."""
        return max(self._next_base, self.value)

    def _take_pass(self) -> tuple[int, int]:
        with self._lock:
            base = max(self._next_base, self._apply_locked())
            self._next_base = base + self.num_layers
            return base, base + self.num_layers

    @property
    def pending_skips(self) -> list[tuple[int, int]]:
        """``(base, end)`` of abandoned passes whose layers are skipped once the counter
        reaches ``base`` (``Pass.abandon`` of a pass scheduled ahead)."""
        with self._lock:
            return list(self._skips)

    def _skip_pass(self, base: int, end: int) -> int:
        """Skip an abandoned pass's layers: at once when the counter reached ``base`` (then
        the model computed none of the passes after it), else when it gets there; never
        before, so the passes before it post only what the model computed."""
        with self._lock:
            if self._apply_locked() >= base:
                self._w.advance(end)
            else:
                self._skips.append((base, end))
                self._skips.sort()
            return self._apply_locked()

    def _apply_skips(self) -> int:
        """Apply the skips whose base the counter reached (any thread; each exactly once)."""
        with self._lock:
            return self._apply_locked()

    def _apply_locked(self) -> int:
        # adding, not raising to ``end``: increments the model made for the next pass
        # meanwhile are kept, so that pass's writes fire late by the delay, never early
        v = self._w.value
        while self._skips and v >= self._skips[0][0]:
            base, end = self._skips.pop(0)
            v = self._w.bump(end - base)
        return v

    def latencies(self) -> tuple[list[int], list[int]]:
        """CPU bump -> first post (ns) since the last call: to the native post call, to its return."""
        return self._w.latencies()

    def stats(self) -> dict:
        """The watcher thread's counters: armed entries, fired entries, wake-ups, tid."""
        return self._w.stats()

    def __repr__(self) -> str:
        return f"<LayerCounter {self.value} ({self.num_layers} layers per pass)>"


class Pass:
    """One scheduled forward pass: layer ``l`` is done when the counter reaches
    ``base + l + 1``; ``end = base + num_layers``."""

    def __init__(self, streamer: "Streamer", base: int, end: int, sends: list) -> None:
        self._streamer = streamer
        self.id = next(_pass_ids)
        self.base = base
        self.end = end
        self.sends = sends
        self.abandoned = False

    @property
    def layers_done(self) -> int:
        """Layers of this pass the counter says are computed."""
        return max(0, min(self.end, self._streamer.counter().value) - self.base)

    def abandon(self) -> int:
        """The model gave this pass up: disarm its writes not yet posted, abort its Sends
        with the fence (the decoders fail those requests with ``PeerError``), and skip its
        layers on the counter: raised to ``end`` now if it reached ``base``, else once it
        gets there (a pass scheduled ahead: the running pass's layers still fire only when
        computed). Returns how many armed writes were disarmed."""
        return self._streamer.abandon(self)

    def __repr__(self) -> str:
        return f"<Pass {self.id} layers at {self.base}+1..{self.end}, {len(self.sends)} send(s)>"


class Streamer:
    """One messenger's streaming room: its layer counter and watcher (made on first use),
    streaming Sends, ``schedule`` (every chunk checked before anything is armed) and
    ``Pass.abandon``."""

    def __init__(self, node: Node, prefill: Prefiller, num_layers: int, page_size: int, num_pages: int,
                 device: Optional[int], poll_us: float, cpus: Optional[tuple], rt_priority: int) -> None:
        self.node = node
        self.prefill = prefill
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_pages = num_pages
        self._opts = (device, poll_us, cpus, rt_priority)
        self._counter: Optional[LayerCounter] = None
        self.watcher: Any = None
        self._release: Optional[Callable[[], None]] = None

    def counter(self) -> LayerCounter:
        """The layer counter (made, with its native watcher thread, on first use)."""
        with self.node.lock:
            if self._counter is None:
                if self.node.closed:
                    raise ClosedError("messenger is closed")
                device, poll_us, cpus, rt = self._opts
                word, dptr = 0, None
                if device is not None:
                    from kvxfer.messenger import _cudabump

                    word, dptr, self._release = _cudabump.alloc_mapped_word(device)
                self.watcher = self.node.engine.watcher(word=word, poll_us=poll_us, cpus=cpus, keep=None,
                                                        rt_priority=rt)
                self._counter = LayerCounter(self.watcher, self.num_layers, dptr, device)
            return self._counter

    @property
    def skipping(self) -> bool:
        """Abandoned passes wait for the counter to reach their base (the messenger thread
        polls faster and applies them)."""
        lc = self._counter
        return lc is not None and bool(lc._skips)

    def tick(self) -> None:
        """Messenger thread: apply the skips a kernel's bumps made due."""
        lc = self._counter
        if lc is not None and lc._skips:
            try:
                lc._apply_skips()
            except KvxferError:
                pass

    def stream(self, request: Any, src_pages: Any) -> Send:
        if not isinstance(request, Request):
            raise InvalidArgumentError("request must come from this messenger's requests()")
        n_src = prefix.src_page_count(request.num_tokens, self.page_size)
        sp = None if src_pages is None else _args.src_prefix(src_pages, n_src, self.num_pages)
        self.counter()                          # the watcher exists before anything is armed
        return self.prefill.attach(request, StreamState(sp, self.watcher))

    def schedule(self, chunks: Iterable[Any]) -> Pass:
        try:
            chunks = list(chunks)
        except TypeError:
            raise InvalidArgumentError(f"chunks must be an iterable of chunks, got {type(chunks).__name__}") from None
        lc = self.counter()
        work = []
        seen: set[int] = set()
        for ch in chunks:
            if not isinstance(ch, tuple) or len(ch) not in (3, 4):
                raise InvalidArgumentError(f"a chunk is (send, start_token, end_token[, src_pages]), got {ch!r}")
            send, start, end = ch[:3]
            if not isinstance(send, Send) or send.request.room is not self.prefill or not send.streaming:
                raise InvalidArgumentError("a chunk's send must come from this messenger's stream()")
            if id(send) in seen:
                raise InvalidArgumentError(f"request {send.request.request_id!r} has two chunks in one pass")
            seen.add(id(send))
            for name, v in (("start_token", start), ("end_token", end)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise InvalidArgumentError(f"{name} must be an int, got {v!r}")
            start, end = int(start), int(end)
            req = send.request
            if send.stopped:
                continue                       # left between passes (aborted, failed)
            if send.last_chunk:
                raise InvalidArgumentError(f"request {req.request_id!r}'s last chunk was already scheduled")
            if start != send.next_token or not start < end <= req.num_tokens:
                raise InvalidArgumentError(f"chunk [{start}, {end}) of request {req.request_id!r} must start at "
                                           f"{send.next_token} and end after it, at most at {req.num_tokens}")
            sp = send.src_pages
            # where the two sides' page sizes differ a chunk moves its own tokens (the planner's
            # token path), each side's pages in its own size; else the pages it completes
            differ = req.peer.layout.page_size != self.page_size or req.first_token > 0
            n_src = prefix.src_page_count(req.num_tokens, self.page_size)
            if len(ch) == 4:
                new = _args.src_prefix(ch[3], n_src, self.num_pages)
                if sp is not None and not np.array_equal(new[:len(sp)], sp[:len(new)]):
                    raise PlanError(f"request {req.request_id!r}'s source pages changed between chunks")
                if sp is None or len(new) > len(sp):
                    sp = new
            if differ:
                need = -(-end // self.page_size)
                if sp is None or len(sp) < need:
                    raise PlanError(f"chunk [{start}, {end}) of request {req.request_id!r} needs {need} source "
                                    f"pages but only {0 if sp is None else len(sp)} are known")
                layers = self.prefill.token_arm_batches(req.peer, req, sp, start, end)
                work.append((send, end, sp, layers))
                continue
            idx = _pages_completed(req.num_tokens, self.page_size, start, end)
            n = len(idx)
            if n and (sp is None or int(idx[-1]) >= len(sp)):
                raise PlanError(f"chunk [{start}, {end}) of request {req.request_id!r} completes page "
                                f"{int(idx[-1])} but only {0 if sp is None else len(sp)} source pages are known")
            # idx ascends by one from idx[0]: all of sp when it has as many pages
            layers = None if not n else self.prefill.arm_batches(req.peer, req, idx, sp if n == len(sp) else sp[idx])
            work.append((send, end, sp, layers))
        base, end_ = lc._take_pass()
        p = Pass(self, base, end_, [w[0] for w in work])
        for send, end, sp, layers in work:
            send.arm_chunk(p.id, p.end, end, sp, lambda s=send, layers=layers: self._arm(p, s, layers))
        return p

    def _arm(self, p: Pass, s: Send, batches: Optional[list]) -> list:
        """The watch entries of one chunk, one ``WatchBatch`` per region pair: one native
        arming loop each, its layers as groups (``Prefiller.arm_batches``; under the Send's
        lock, from ``Send.arm_chunk``)."""
        if not batches:
            return []
        pf, pg, w = self.prefill, s.request.peer, self.watcher
        nrails = self.node.engine.rails
        out: list = []
        for src, dst, sr, dr, lay, so, do, ln, starts in batches:
            out.append(w.arm_groups(lay, pf.local[src][sr], pg.peer, pg.remote[dst][dr], so, do, ln, starts,
                                    base=p.base + 1, imm=s.request.imm, tag=p.id,
                                    rail=pf.rails.get(src, src % nrails)))
        return out

    def abandon(self, p: Pass) -> int:
        if p.abandoned:
            return 0
        p.abandoned = True
        n = 0
        for s in p.sends:                   # aborting first: the reaper never sees them "done"
            n += s.armed_in(p.base, p.end)
            if not s.done:
                s.request_abort(by_prefiller=True)
        self.watcher.disarm_tag(p.id)
        # skip the pass's layers on the counter, but never before it reached p.base: a pass
        # scheduled ahead is abandoned while the one before it still runs, whose remaining
        # layers must fire when computed (LayerCounter._skip_pass)
        self._counter._skip_pass(p.base, p.end)
        return n

    def close(self, timeout: float) -> None:
        """Armed writes never post after this."""
        if self.watcher is not None:
            self.watcher.close(max(0.1, timeout))
            if self._release is not None:
                self._release()
                self._release = None
