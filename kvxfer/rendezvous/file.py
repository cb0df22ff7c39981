"""The ``file:///dir`` rendezvous store: one file per key in a directory of one host (tests,
single-machine clusters).

A key ``a/b/c`` is the file ``dir/a/b/c.kvr``, written whole to a temporary name and renamed
(readers never see half a value). Its bytes are the entry envelope shared with stores that
have no TTL of their own (``pack_entry``): ``b"KXR1"``, the expiry as a float64 of
``time.time()`` (0: none), then the value. An expired entry is neither read nor listed (it is not
removed by readers: that would race with its publisher's renewal); a lease renews by
rewriting it with a later expiry.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
from typing import Optional

from kvxfer.errors import InvalidArgumentError, RendezvousError
from kvxfer.rendezvous.store import Store

_MAGIC = b"KXR1"
_HEAD = struct.Struct("<4sd")
_SUFFIX = ".kvr"


def pack_entry(value: bytes, ttl: Optional[float]) -> bytes:
    """An entry: magic, expiry (wall clock, 0 for none), value."""
    return _HEAD.pack(_MAGIC, 0.0 if ttl is None else time.time() + ttl) + value


def unpack_entry(raw: Optional[bytes]) -> Optional[bytes]:
    """The value of an entry, or None when absent, expired or not an entry."""
    if raw is None or len(raw) < _HEAD.size:
        return None
    magic, expiry = _HEAD.unpack_from(raw)
    if magic != _MAGIC or (expiry and expiry < time.time()):
        return None
    return raw[_HEAD.size:]


class FileStore(Store):
    """Entries as files under ``root`` (created if missing)."""

    scheme = "file"

    def __init__(self, url: str, root: str, op_timeout: float = 2.0) -> None:
        super().__init__(url, "", op_timeout)
        if not root or not os.path.isabs(root):
            raise InvalidArgumentError(f"file:// needs an absolute directory, got {url!r}")
        self.root = root
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise RendezvousError(f"{url}: cannot create {root}: {exc}") from exc

    def _path(self, key: str) -> str:
        if not os.path.isdir(self.root):      # the store's directory is gone (unmounted, removed)
            raise RendezvousError(f"{self.url}: directory {self.root} is gone")
        return os.path.join(self.root, *key.split("/")) + _SUFFIX

    def _read(self, path: str) -> Optional[bytes]:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RendezvousError(f"{self.url}: cannot read {path}: {exc}") from exc

    def _put(self, key: str, value: bytes, ttl: Optional[float]) -> None:
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(pack_entry(value, ttl))
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            raise RendezvousError(f"{self.url}: cannot write {key!r}: {exc}") from exc

    def _get(self, key: str) -> Optional[bytes]:
        return unpack_entry(self._read(self._path(key)))

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise RendezvousError(f"{self.url}: cannot delete {path}: {exc}") from exc

    def _delete(self, key: str) -> bool:
        path = self._path(key)
        live = unpack_entry(self._read(path)) is not None
        return self._unlink(path) and live

    def _list(self, prefix: str) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        # walk only the deepest directory the prefix names
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *head.split("/")) if head else self.root
        if not os.path.isdir(self.root):
            raise RendezvousError(f"{self.url}: directory {self.root} is gone")
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if not name.endswith(_SUFFIX) or name.startswith("."):
                    continue
                path = os.path.join(dirpath, name)
                key = os.path.relpath(path, self.root)[: -len(_SUFFIX)].replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                v = unpack_entry(self._read(path))
                if v is not None:
                    out[key] = v
        # a directory that went away during the walk gave a partial (or empty) list: an
        # unreachable store is not an empty one
        if not os.path.isdir(self.root):
            raise RendezvousError(f"{self.url}: directory {self.root} is gone")
        return out
