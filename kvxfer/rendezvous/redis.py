"""The ``redis://host:port/namespace`` rendezvous store, over redis-py (``pip install
kvxfer[redis]``).

A key is the Redis key ``namespace/key``; a lease is Redis's own expiry (``SET ... PX``),
renewed by setting the value again with a fresh expiry, which also puts it back after the
server lost it (a restart without persistence). ``list`` is ``SCAN MATCH namespace/prefix*``
then one ``MGET``. Every call is bounded by ``op_timeout`` (socket connect and read).
"""

from __future__ import annotations

from typing import Any, Optional

from kvxfer.errors import RendezvousError, UnsupportedError
from kvxfer.rendezvous.store import Store

_SCAN_ROUNDS = 10_000     # bounds the SCAN cursor loop (COUNT 1000 each)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore(Store):
    """A namespace of one Redis server."""

    scheme = "redis"

    def __init__(self, url: str, host: str, port: int, namespace: str, op_timeout: float = 2.0,
                 db: int = 0) -> None:
        super().__init__(url, namespace, op_timeout)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise UnsupportedError("redis:// needs redis-py: pip install 'kvxfer[redis]'") from None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._r: Any = redis.Redis(host=host, port=port, db=db, socket_timeout=self.op_timeout,
                                   socket_connect_timeout=self.op_timeout,
                                   retry=Retry(NoBackoff(), 0))   # retries are the lease thread's, bounded

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except self._errors as exc:
            raise RendezvousError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        px = None if ttl is None else max(1, int(ttl * 1000))
        self._call("SET", self._r.set, key, value, px=px)

    def _get(self, key: str) -> Optional[bytes]:
        return self._call("GET", self._r.get, key)

    def _delete(self, key: str) -> bool:
        return bool(self._call("DEL", self._r.delete, key))

    def _list(self, prefix: str) -> dict[str, bytes]:
        keys: list[bytes] = []
        cursor = 0
        for _ in range(_SCAN_ROUNDS):
            cursor, batch = self._call("SCAN", self._r.scan, cursor, match=_glob_escape(prefix) + "*", count=1000)
            keys.extend(batch)
            if not cursor:
                break
        else:
            raise RendezvousError(f"{self.url}: SCAN did not finish in {_SCAN_ROUNDS} rounds")
        if not keys:
            return {}
        keys = sorted(set(keys))
        values = self._call("MGET", self._r.mget, keys)
        return {k.decode(): v for k, v in zip(keys, values) if v is not None}

    def _close_client(self) -> None:
        try:
            self._r.close()
        except self._errors:
            pass
