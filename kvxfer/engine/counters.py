"""The engine's counters: expectations of writes carrying an imm, banked arrivals, retiring an imm.

``_Counters`` is a base of ``Engine`` holding ``expect``, ``banked`` and ``discard`` (the
counting rule, docs/architecture.md "Immediates and counters"); the ``Counter`` they return and
the callback dispatcher live in ``transfer.py``. It also holds the messenger's native arm of an
ANNOUNCE (``arm_announce``, ``AnnounceArm``; src/announce.c): an expectation the engine makes
itself, from the control message that announces it, when every write it counts has landed.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from kvxfer._check import as_int
from kvxfer.engine._args import _check_imm
from kvxfer.engine.transfer import Counter, dispatch
from kvxfer.errors import InvalidArgumentError


class AnnounceArm:
    """One decoder leg's ANNOUNCE, armed by the engine (``Engine.arm_announce``): when an
    ANNOUNCE arrives that src/announce.c's check takes (sender, receiver, a seq above the
    floor, a count within the bounds, its tag), and every write it counts has landed or a
    caller waits in ``wait``, the thread that read it makes the expectation. The messenger
    closes the arm before any other transition of the leg; ``close`` hands the ``Counter``
    (met, or pending with no callback: ``Engine.set_callback``) over once."""

    __slots__ = ("_handle", "imm")

    def __init__(self, handle: Any, imm: int) -> None:
        self._handle = handle
        self.imm = imm

    @property
    def state(self) -> str:
        """``"open"``, ``"armed"`` (its counter not yet taken) or ``"closed"``."""
        return ("open", "armed", "closed")[self._handle.state]

    @property
    def waiting(self) -> int:
        """Callers inside ``wait`` now, and holds."""
        return self._handle.waiters

    def hold(self, delta: int) -> None:
        """A caller that will ``wait`` next (a Receive's later legs, while it waits on the
        first) counts as waiting meanwhile: ``hold(1)``, then ``hold(-1)``."""
        if delta not in (1, -1):
            raise InvalidArgumentError("hold takes 1 or -1")
        self._handle.hold(delta)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until closed, or armed and its counter met (True), or ``timeout`` seconds
        pass (False). While a caller waits, an ANNOUNCE arms it before its writes have all
        landed too, and wakes no reader of ``Engine.recv``."""
        return self._handle.wait(timeout)

    def close(self, before: Optional[int] = None) -> Optional[tuple[int, int, Counter]]:
        """Nothing arms it any more. ``(count, seq, counter)`` if an ANNOUNCE had armed it
        (the first close after that), else None. With ``before``: only an ANNOUNCE of seq <=
        ``before`` is taken; a later one's arming is undone (its expectation withdrawn, every
        arrival it had been credited banked again), as is everything at ``before=0``."""
        got = self._handle.close(2**64 - 1 if before is None else before)
        if got is None:
            return None
        count, seq, handle = got
        return int(count), int(seq), Counter(handle, self.imm, int(count), None)


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
                self._start_dispatcher()
        return c

    def _start_dispatcher(self) -> None:
        """Under ``_lock``: the callback dispatcher thread, started by the first callback."""
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=dispatch, name="kvxfer-dispatch", daemon=True,
                                                args=(self._rails[0], self._lock, self._callbacks))
            self._dispatcher.start()

    def set_callback(self, counter: Counter, callback: Callable[[Counter], Any]) -> bool:
        """``callback(counter)`` on the dispatcher thread once ``counter`` is met, for one made
        without a callback (an ``AnnounceArm``'s). False, and no callback, if it was met already."""
        self._check_open()
        if not callable(callback):
            raise InvalidArgumentError("callback must be callable")
        if counter.callback is not None:
            raise InvalidArgumentError("the counter has a callback already")
        with self._lock:
            handle = counter._handle
            counter.callback = callback
            self._callbacks[handle.address] = counter
            if handle.set_callback():
                del self._callbacks[handle.address]
                counter.callback = None
                return False
            self._start_dispatcher()
        return True

    def announce_key(self, secret: Optional[bytes]) -> None:
        """The key every ANNOUNCE's tag is checked with by ``arm_announce``'s arms (the
        messenger's secret, at most 256 bytes; None: they carry none). Before any arm."""
        self._check_open()
        key = b"" if secret is None else bytes(secret)
        if len(key) > 256:
            raise InvalidArgumentError(f"an ANNOUNCE key is at most 256 bytes, got {len(key)}")
        self._rails[0].arm_key(key)

    def arm_announce(self, imm: int, src: int, dst: int, floor: int, least: int, most: int) -> AnnounceArm:
        """Arm ``imm``'s ANNOUNCE (src/announce.c): from peer uid ``src`` to ``dst`` (ours),
        with a seq above ``floor`` and a count in ``[least, most]``. One open arm per imm."""
        self._check_open()
        checked = _check_imm(imm)
        if checked is None:
            raise InvalidArgumentError("arm_announce needs an imm")
        vals = [as_int(v, name, minimum=0, maximum=2**64 - 1)
                for v, name in ((src, "src"), (dst, "dst"), (floor, "floor"), (least, "least"), (most, "most"))]
        if vals[3] > vals[4]:
            raise InvalidArgumentError(f"arm_announce: least {vals[3]} is above most {vals[4]}")
        return AnnounceArm(self._rails[0].arm_open(checked, *vals), checked)

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
