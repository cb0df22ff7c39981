"""The engine's counters: expectations of writes carrying an imm, banked arrivals, retiring an imm.

``_Counters`` is a base of ``Engine`` holding ``expect``, ``banked`` and ``discard`` (the
counting rule, docs/architecture.md "Immediates and counters"); the ``Counter`` they return and
the callback dispatcher live in ``transfer.py``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from kvxfer._check import as_int
from kvxfer.engine._args import _check_imm
from kvxfer.engine.transfer import Counter, dispatch
from kvxfer.errors import InvalidArgumentError


class _Counters:
    """``Engine``'s counter calls (a base class: they use its first rail, lock and dispatcher)."""

    def expect(self, imm: int, count: int, callback: Optional[Callable[[Counter], Any]] = None) -> Counter:
        """Expect ``count`` writes carrying ``imm``. Arrivals already banked are credited.

        ``callback(counter)`` runs once, on the engine's dispatcher thread, when all arrived.
        """
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("expect needs an imm")
        imm = checked
        count = as_int(count, "count", minimum=1)
        if callback is not None and not callable(callback):
            raise InvalidArgumentError("callback must be callable")
        if count >= 2**63:
            raise InvalidArgumentError(f"count {count} is beyond any transfer")
        # the lock orders registration before the dispatcher can pop a counter that
        # completes at once from banked arrivals
        with self._lock:
            try:
                handle = self._rails[0].expect(imm, int(count), callback is not None)
            except InvalidArgumentError:
                raise InvalidArgumentError(f"imm {imm} already has an unfinished expectation") from None
            c = Counter(handle, imm, int(count), callback)
            if callback is not None:
                self._callbacks[handle.address] = c
                if self._dispatcher is None:
                    self._dispatcher = threading.Thread(target=dispatch, name="kvxfer-dispatch", daemon=True,
                                                        args=(self._rails[0], self._lock, self._callbacks))
                    self._dispatcher.start()
        return c

    def banked(self, imm: int) -> int:
        """Arrivals of ``imm`` received and not yet consumed by an expectation."""
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("banked needs an imm")
        return self._rails[0].banked(checked)

    def discard(self, imm: int) -> int:
        """Retire ``imm``: withdraw its unfinished expectation (its ``Counter`` ends with
        ``state == "discarded"``, ``wait`` raises ``ClosedError``, no callback runs), drop
        its banked arrivals, and return how many arrivals were dropped (banked ones plus
        those credited to the withdrawn expectation).

        Only arrivals received before the call are retired: a write of ``imm`` arriving
        later is banked as new and credits the next ``expect(imm, ...)``. So retire an imm
        only once every write that can carry it has arrived, or never use it again. The
        fence, knowing the sender's final ``Transfer.posted`` = P: ``d = discard(imm)``; if
        ``d < P``: ``expect(imm, P - d).wait(...)``, then ``discard(imm)`` again."""
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("discard needs an imm")
        with self._lock:
            dropped, addr = self._rails[0].discard(checked)
            if addr:
                self._callbacks.pop(addr, None)
        return int(dropped)
