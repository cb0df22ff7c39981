"""The ``tcpstore://host:port/namespace`` rendezvous store, over torch's c10d ``TCPStore``
(only where torch is importable: ``pip install kvxfer[torch]``; every vLLM and SGLang process
has one).

This process is a client of a TCPStore server someone else runs (the serving engine's, or
``torch.distributed.TCPStore(host, port, is_master=True)``). TCPStore has neither expiry nor
prefix listing, so values carry the entry envelope of ``kvxfer.rendezvous.file`` (an expiry on
the writer's wall clock: keep the hosts' clocks in step, NTP-close is plenty against TTLs of
seconds) and each namespace keeps an index key ``namespace/.index`` to which a key's name is
appended (``TCPStore.append``) when it is first put, or put back after the server restarted
empty. ``list`` reads the index and then only the keys that exist (``check`` before ``get``:
``get`` of a missing key would block). A deleted key stays in the index (TCPStore cannot
remove a line) and is skipped.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

from kvxfer.errors import RendezvousError, UnsupportedError
from kvxfer.rendezvous.file import pack_entry, unpack_entry
from kvxfer.rendezvous.store import Lease, Store


class TCPStoreStore(Store):
    """A namespace of one torch TCPStore server."""

    scheme = "tcpstore"

    def __init__(self, url: str, host: str, port: int, namespace: str, op_timeout: float = 2.0) -> None:
        super().__init__(url, namespace, op_timeout)
        try:
            from torch.distributed import TCPStore
        except ImportError:
            raise UnsupportedError("tcpstore:// needs torch (torch.distributed): pip install 'kvxfer[torch]'") from None
        self._index = self._full(".index")
        try:
            self._s: Any = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.op_timeout),
                                    wait_for_workers=False)
        except (RuntimeError, OSError, ValueError) as exc:
            raise RendezvousError(f"{url}: cannot reach the TCPStore: {exc}") from exc

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, OSError, ValueError) as exc:   # torch raises DistStoreError (a RuntimeError)
            raise RendezvousError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        known = self._call("check", self._s.check, [key])
        self._call("set", self._s.set, key, pack_entry(value, ttl))
        if not known:
            self._call("append", self._s.append, self._index, (key + "\n").encode())

    def _get(self, key: str) -> Optional[bytes]:
        if not self._call("check", self._s.check, [key]):
            return None
        return unpack_entry(bytes(self._call("get", self._s.get, key)))

    def _delete(self, key: str) -> bool:
        live = self._get(key) is not None
        return bool(self._call("delete_key", self._s.delete_key, key)) and live

    def _list(self, prefix: str) -> dict[str, bytes]:
        if not self._call("check", self._s.check, [self._index]):
            return {}
        names = bytes(self._call("get", self._s.get, self._index)).decode(errors="replace").split("\n")
        out = {}
        for k in sorted(set(n for n in names if n.startswith(prefix))):
            v = self._get(k)
            if v is not None:
                out[k] = v
        return out

    def _renew(self, lease: Lease) -> None:
        self._put(lease.key, lease.value, lease.ttl)
