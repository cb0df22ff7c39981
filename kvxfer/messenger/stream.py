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
from typing import Any, Optional

import numpy as np

from kvxfer.errors import InvalidArgumentError, KvxferError, UnsupportedError
from kvxfer.messenger._codec import MAX_PAGES

__all__ = ["LayerCounter", "Pass", "pages_completed"]

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
    npages = -(-num_tokens // page_size)
    start, end = (min(max(int(x), 0), num_tokens) for x in (start, end))     # int64-safe, same pages
    last = np.full(npages, num_tokens - 1, np.int64)        # the last page ends at the last token
    last[:-1] = np.arange(1, npages, dtype=np.int64) * page_size - 1   # the others: below num_tokens
    return np.flatnonzero((last >= start) & (last < end))


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

    def __init__(self, m: Any, base: int, end: int, sends: list) -> None:
        self._m = m
        self.id = next(_pass_ids)
        self.base = base
        self.end = end
        self.sends = sends
        self.abandoned = False

    @property
    def layers_done(self) -> int:
        """Layers of this pass the counter says are computed."""
        return max(0, min(self.end, self._m.layer_counter.value) - self.base)

    def abandon(self) -> int:
        """The model gave this pass up: disarm its writes not yet posted, abort its Sends
        with the fence (the decoders fail those requests with ``PeerError``), and skip its
        layers on the counter: raised to ``end`` now if it reached ``base``, else once it
        gets there (a pass scheduled ahead: the running pass's layers still fire only when
        computed). Returns how many armed writes were disarmed."""
        return self._m._abandon_pass(self)

    def __repr__(self) -> str:
        return f"<Pass {self.id} layers at {self.base}+1..{self.end}, {len(self.sends)} send(s)>"


class _Stream:
    """A streaming Send's progress: source pages known so far, next token, last pass."""

    __slots__ = ("src_pages", "next_token", "end", "context", "context_armed", "passes")

    def __init__(self, src_pages: Optional[np.ndarray]) -> None:
        self.src_pages = src_pages
        self.next_token = 0
        self.end: Optional[int] = None          # the last pass's end, once the last chunk is scheduled
        self.context: Optional[tuple] = None    # (data,) once finish() came
        self.context_armed = False
        self.passes: list[int] = []
