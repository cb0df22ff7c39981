"""Rendezvous over a store the deployment already runs: etcd, Redis, torch's TCPStore, or a
directory of one host. ``open(url)`` gives a ``Store`` (bytes under keys, leases, watches;
kvxfer/rendezvous/store.py); ``Announcement`` and ``Directory`` put the messenger's handshakes
in it and find peers there (kvxfer/rendezvous/directory.py). See docs/deploying.md.

Each store's client library is an optional extra, imported only by ``open`` of its scheme:
``import kvxfer.rendezvous`` costs nothing else.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any

from kvxfer.errors import InvalidArgumentError
from kvxfer.rendezvous.store import Lease, Store, Watch

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.rendezvous.directory import Announcement, Directory, Instance

__all__ = ["open", "Store", "Lease", "Watch", "Announcement", "Directory", "Instance", "SCHEMES"]

#: scheme -> default port
SCHEMES = {"etcd": 2379, "redis": 6379, "tcpstore": 29500, "file": None}


def open(url: str, *, op_timeout: float = 2.0) -> Store:  # noqa: A001 - the module's verb
    """Open the store ``url`` names: ``etcd://host:port/namespace`` (etcd v3),
    ``redis://host:port/namespace``, ``tcpstore://host:port/namespace`` (needs torch) or
    ``file:///absolute/dir``. ``op_timeout`` bounds each call to the server. Nothing is
    contacted yet: an unreachable server shows on the first call (``RendezvousError``)."""
    if not isinstance(url, str):
        raise InvalidArgumentError(f"a rendezvous URL is a str, got {type(url).__name__}")
    u = urllib.parse.urlsplit(url)
    scheme = u.scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidArgumentError(f"unknown rendezvous scheme in {url!r}: one of {', '.join(SCHEMES)}")
    if u.query or u.fragment:
        raise InvalidArgumentError(f"a rendezvous URL takes no query or fragment: {url!r}")
    if scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"file:// names a directory of this host, got host {u.netloc!r}")
        from kvxfer.rendezvous.file import FileStore

        return FileStore(url, urllib.parse.unquote(u.path), op_timeout)
    try:
        host, port = u.hostname, u.port
    except ValueError as exc:
        raise InvalidArgumentError(f"bad port in {url!r}: {exc}") from None
    if not host or u.username or u.password:
        raise InvalidArgumentError(f"{scheme}:// needs host[:port] and no credentials in the URL: {url!r}")
    port = SCHEMES[scheme] if port is None else port
    ns = u.path.strip("/")
    if not ns:
        raise InvalidArgumentError(f"{url!r} names no namespace: {scheme}://host:port/namespace")
    if scheme == "etcd":
        from kvxfer.rendezvous.etcd import EtcdStore

        return EtcdStore(url, host, port, ns, op_timeout)
    if scheme == "redis":
        from kvxfer.rendezvous.redis import RedisStore

        return RedisStore(url, host, port, ns, op_timeout)
    from kvxfer.rendezvous.tcpstore import TCPStoreStore

    return TCPStoreStore(url, host, port, ns, op_timeout)


def __getattr__(name: str) -> Any:
    if name in ("Announcement", "Directory", "Instance"):
        from kvxfer.rendezvous import directory

        return getattr(directory, name)
    raise AttributeError(f"module 'kvxfer.rendezvous' has no attribute {name!r}")
