"""A prefill ``Send`` on the pull road: the request's pages exposed to the decoder, which reads
them itself, held until it says its reads are over.

``send(request, src_pages)`` of a request the decoder asked to pull (``Request.pull``) posts
no write of the KV: it posts one EXPOSE (the request's source pages, ``num_tokens`` and the
writes this side still makes: its context, 1 where it holds the decoder's context slot) and
the Send stays ``"transferring"``, its source pages held, until the decoder's DONE: plain
(every read completed) -> ``"done"``; flagged aborted (its reads were cancelled and drained,
or never posted) -> ``"aborted"`` (``"failed"`` where this side failed it). The decoder's
death (``peer_timeout``, BYE, a teardown) fails it at once, as it fails a push Send.

The context travels as on the push road (one write with the leg's imm into the decoder's
slot, at ``finish``): the decoder counts it against the EXPOSE's count. An abort of either
side goes the push road's way (ABORT / ``Request.reject`` -> ABORTED with what was posted of
the context, so the decoder fences its slot) but does not release the pages: only the DONE
that follows, once the decoder's reads are drained, does. A Send aborted before its EXPOSE
went out holds nothing the decoder knows of and settles at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.errors import PeerError
from kvxfer.messenger import _codec as C
from kvxfer.messenger import _pullcodec as P
from kvxfer.messenger._node import FINAL
from kvxfer.messenger.send import Send

__all__ = ["PullSend"]


class PullSend(Send):
    """The Send of a pull request (``Request.pull``); the same public surface as ``Send``."""

    def __init__(self, room: Any, req: Any) -> None:
        super().__init__(room, req, None)
        self._exposed = False            # the EXPOSE was posted: the decoder owes a DONE
        self._done_flags: Any = None     # the DONE's flags, once it came
        self._aborted_sent = False

    @property
    def exposed(self) -> bool:
        """The EXPOSE went to the sender thread: the pages stay held until the decoder's DONE."""
        return self._exposed

    def expose(self, src_pages: np.ndarray) -> None:
        """Post the EXPOSE (never waits on the engine); a Send aborted meanwhile posts none."""
        req = self.request
        pg = req.peer
        with self._lock:
            self._count = 1 if req.slot >= 0 else 0
            self._posting_done = True
            if self._abort_req:
                self._finished = True
            elif self._room.peers.post(pg, C.EXPOSE, imm=req.imm, num_tokens=req.num_tokens, count=self._count,
                                       request_id=req.request_id, pages=src_pages):
                self._exposed = True
                self._state = "transferring"
            else:
                self._fail_locked(PeerError(f"could not expose to peer {pg.uid:016x}: it is {pg.state}"))
            stopped = self._abort_req
        if stopped:
            self._room.queue_reap(self)

    def finish(self, context: Any = None) -> "PullSend":
        """As ``Send.finish``: the context write, last. A no-op once the decoder said DONE."""
        if self._done_flags is not None or self._state in FINAL:
            return self
        return super().finish(context)       # type: ignore[return-value]

    def on_done(self, flags: int) -> bool:
        """The decoder's DONE: its reads are over (False: not expected here, dropped)."""
        with self._lock:
            if self._state in FINAL or not self._exposed or self._done_flags is not None:
                return False
            self._done_flags = int(flags)
            if flags & P.DONE_ABORTED:
                self._abort_req = True
                for t in self._transfers:
                    t.cancel()
            self._finished = True            # no context is written after a DONE
            now = all(t.done for t in self._transfers)
        if now:
            self.finalize()                  # settled on this thread: a BYE right after finds it final
        else:
            self._room.queue_reap(self)
        return True

    def kill(self, err: BaseException) -> None:
        """Its peer is gone. After its DONE (a BYE may follow at once) the Send settles as the
        DONE said; before it, as any Send: failed now, the pages free."""
        if self._done_flags is None:
            super().kill(err)
            return
        with self._lock:
            self._abort_req = self._finished = True
            for t in self._transfers:
                t.cancel()
            ok = not self._done_flags & P.DONE_ABORTED and self.error is None
        self._room.settle(self, "done" if ok else "failed" if self.error is not None else "aborted", None)

    def finalize(self) -> bool:
        """Reaper: every transfer (the context write) is final: answer ABORTED if owed; settle
        once the decoder's DONE came (or nothing was exposed)."""
        req = self.request
        pg = req.peer
        with self._lock:
            if self._state in FINAL:
                return True
            if not all(t.done for t in self._transfers):
                return False
            err = self.error or next((t.error for t in self._transfers if t.error is not None), None)
            if err is not None and not self._abort_req:          # the context write failed
                self.error = err
                self._abort_req = self._reply = True
                self._abort_flags |= C.ABORTED_BY_PREFILLER
            posted = sum(int(t.posted) for t in self._transfers)
            reply = self._reply and not self._aborted_sent and pg.alive and self._done_flags is None
            if reply:
                self._aborted_sent = True
            flags = self._abort_flags
            settle = self._done_flags is not None or not self._exposed
            if self.error is not None:
                state = "failed"
            elif self._done_flags is not None and not self._done_flags & P.DONE_ABORTED:
                state = "done"
            else:
                state = "aborted"
        if settle:
            self._room.settle(self, state, err)
        if reply:
            self._room.peers.post(pg, C.ABORTED, imm=req.imm, count=posted, flags=flags,
                                  reason=req.rejected if flags & C.ABORTED_REJECTED else "")
        return True

    def __repr__(self) -> str:
        return f"<PullSend {self.request.request_id!r} {'exposed' if self._exposed else 'unexposed'} {self._state}>"
