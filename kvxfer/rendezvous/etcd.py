"""The ``etcd://host:port/namespace`` rendezvous store (etcd v3), over etcd's gRPC gateway
(HTTP/JSON) with etcd3gw (``pip install kvxfer[etcd]``).

Why etcd3gw: it is kept (OpenStack, releases through 2026), pure Python over ``requests``,
and speaks etcd v3's JSON gateway that every etcd >= 3.3 serves on its client port. The gRPC
client ``etcd3`` (python-etcd3) has had no release since 2020 and its generated protobuf
code fails to import with protobuf >= 4 unless the slow pure-Python protobuf is forced; its
forks are thinly kept. Both reach the same v3 key space: entries written here are seen by
``etcdctl`` and by other v3 clients.

A key is ``namespace/key``. A lease is an etcd lease of ``ceil(ttl)`` s granted for each
published entry, kept alive with LeaseKeepAlive every ``ttl / 3`` s; when keep-alive says the
lease is gone (it expired while the store was unreachable, or the server lost it) a new
lease is granted and the value put under it again. ``Lease.close()`` revokes the lease
(which deletes its key). Every call is bounded by ``op_timeout``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from kvxfer.errors import RendezvousError, UnsupportedError
from kvxfer.rendezvous.store import Lease, Store


class EtcdStore(Store):
    """A namespace of one etcd v3 cluster (one endpoint)."""

    scheme = "etcd"

    def __init__(self, url: str, host: str, port: int, namespace: str, op_timeout: float = 2.0) -> None:
        super().__init__(url, namespace, op_timeout)
        try:
            import etcd3gw
            import etcd3gw.exceptions
            import requests
        except ImportError:
            raise UnsupportedError("etcd:// needs etcd3gw: pip install 'kvxfer[etcd]'") from None
        self._errors: tuple[type[BaseException], ...] = (etcd3gw.exceptions.Etcd3Exception,
                                                         requests.RequestException, OSError, KeyError, ValueError)
        # api_path fixed: etcd >= 3.4 serves /v3/ (discovery would cost a round trip per client)
        self._c: Any = etcd3gw.client(host=host, port=port, timeout=self.op_timeout, api_path="/v3/")

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except self._errors as exc:
            detail = getattr(exc, "detail_text", None) or exc
            raise RendezvousError(f"{self.url}: {what} failed: {type(exc).__name__}: {detail}") from exc

    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        lease = None if ttl is None else self._call("lease grant", self._c.lease, math.ceil(ttl))
        self._call("put", self._c.put, key, value, lease=lease)

    def _get(self, key: str) -> Optional[bytes]:
        vals = self._call("range", self._c.get, key)
        return vals[0] if vals else None

    def _delete(self, key: str) -> bool:
        return bool(self._call("delete range", self._c.delete, key))

    def _list(self, prefix: str) -> dict[str, bytes]:
        rows = self._call("range", self._c.get_prefix, prefix)
        out = {}
        for value, meta in rows:
            k = meta["key"]
            out[k.decode() if isinstance(k, bytes) else k] = value
        return out

    def _renew(self, lease: Lease) -> None:
        h = lease.backend
        if h is not None and self._call("lease keep-alive", h.refresh) > 0:
            return
        h = self._call("lease grant", self._c.lease, math.ceil(lease.ttl))
        self._call("put", self._c.put, lease.key, lease.value, lease=h)
        old, lease.backend = lease.backend, h
        if old is not None:
            try:
                old.revoke()
            except self._errors:
                pass

    def _release(self, lease: Lease) -> None:
        h = lease.backend
        try:
            if h is not None:
                self._call("lease revoke", h.revoke)
            else:
                self._delete(lease.key)
        except RendezvousError:
            pass

    def _close_client(self) -> None:
        try:
            self._c.session.close()
        except self._errors:
            pass
