"""The engine's control messages: ``send`` and ``recv`` of small byte strings over FI_MSG.

``_Messages`` is a base of ``Engine``. A control message is at most ``_fabric.MSG_MAX`` (64 KiB)
bytes, sent on the first rail to a connected ``Peer`` and received in arrival order from any
peer; the messenger's protocol (kvxfer/messenger/) rides on it. A message refused by a full
provider queue is retried natively until ``timeout``.
"""

from __future__ import annotations

import errno as _errno
from typing import Optional

from kvxfer.engine._args import _timeout
from kvxfer.engine.rails import Peer, _fabric
from kvxfer.errors import InvalidArgumentError, PeerError, TimeoutError

__all__: list[str] = []


class _Messages:
    """The control-message calls of ``Engine``."""

    def send(self, peer: Peer, data: bytes, timeout: Optional[float] = 30.0) -> None:
        """A small control message (at most 64 KiB) over FI_MSG, for protocol coordination.
        Raises TimeoutError if the provider's queue stays full for ``timeout`` seconds."""
        self._check_open()
        timeout = _timeout(timeout)
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise InvalidArgumentError("peer must come from this engine's connect()")
        if peer.closed:
            raise PeerError(_errno.ENOTCONN, "peer was disconnected")
        if type(data) is not bytes:        # bytes go as they are (the native send copies them)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise InvalidArgumentError(f"a control message is bytes, not {type(data).__name__}")
            data = bytes(data)             # a snapshot the caller cannot change meanwhile
        if len(data) > _fabric.MSG_MAX:
            raise InvalidArgumentError(f"control message of {len(data)} bytes exceeds {_fabric.MSG_MAX}")
        if not self._rails[0].send(peer.fi_addrs[0], peer.gens[0], data, timeout):
            raise TimeoutError(f"control message not accepted by the provider within {timeout} s")

    def recv(self, timeout: Optional[float] = None) -> bytes:
        """The next control message received; TimeoutError if none within ``timeout`` s."""
        self._check_open()
        m = self._rails[0].recv(_timeout(timeout))
        if m is None:
            raise TimeoutError(f"no control message within {timeout} s")
        return m
