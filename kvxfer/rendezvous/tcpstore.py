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
        self._TCPStore = TCPStore
        self._host, self._port = host, port
        self._index = self._full(".index")
        self._s: Any = None
        self._client()                              # fail now, at open(), if nothing answers

    def _client(self) -> Any:
        """The TCPStore client, made again after a failure: a client whose server went away
        keeps its broken socket for good, so a restarted server would never be seen again."""
        if self._s is None:
            try:
                self._s = self._TCPStore(self._host, self._port, is_master=False,
                                         timeout=datetime.timedelta(seconds=self.op_timeout), wait_for_workers=False)
            except (RuntimeError, OSError, ValueError) as exc:
                raise RendezvousError(f"{self.url}: cannot reach the TCPStore: {exc}") from exc
        return self._s

    def _call(self, what: str, *args: Any) -> Any:
        try:
            return getattr(self._client(), what)(*args)
        except RendezvousError:
            raise
        except (RuntimeError, OSError, ValueError) as exc:   # torch raises DistStoreError (a RuntimeError)
            self._s = None                                    # reconnect at the next call
            raise RendezvousError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        known = self._call("check", [key])
        self._call("set", key, pack_entry(value, ttl))
        if not known:
            self._call("append", self._index, (key + "\n").encode())

    def _get(self, key: str) -> Optional[bytes]:
        if not self._call("check", [key]):
            return None
        return unpack_entry(bytes(self._call("get", key)))

    def _delete(self, key: str) -> bool:
        live = self._get(key) is not None
        return bool(self._call("delete_key", key)) and live

    def _list(self, prefix: str) -> dict[str, bytes]:
        if not self._call("check", [self._index]):
            return {}
        names = bytes(self._call("get", self._index)).decode(errors="replace").split("\n")
        out = {}
        for k in sorted(set(n for n in names if n.startswith(prefix))):
            v = self._get(k)
            if v is not None:
                out[k] = v
        return out

    def _renew(self, lease: Lease) -> None:
        self._put(lease.key, lease.value, lease.ttl)
