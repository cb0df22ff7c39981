"""``SharedHandle``: what crosses a process boundary so that another process can map a ``KVBuffer`` again."""

from __future__ import annotations

import dataclasses
import mmap as _mmap
import os
import re
import warnings
from typing import Any, Literal

from kvxfer._check import is_int
from kvxfer.errors import ClosedError, DescriptorError, InvalidArgumentError

__all__ = ["SharedHandle", "Kind", "PAGE_SIZE", "parse_device"]

#: the two kinds of shareable KV memory: a memfd on the host, or cuMem on a GPU
Kind = Literal["host", "cuda"]

PAGE_SIZE = _mmap.PAGESIZE


def parse_device(device: str | int) -> tuple[Kind, int | None]:
    """('host', None) for 'cpu'; ('cuda', N) for 'cuda:N', 'cuda' or an ordinal N."""
    if is_int(device):
        device = int(device)
        if device < 0:
            raise InvalidArgumentError(f"CUDA device ordinal must be >= 0, got {device}")
        return "cuda", device
    if not isinstance(device, str):
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    if device == "cpu":
        return "host", None
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    return "cuda", int(m.group(1) or 0)


@dataclasses.dataclass(eq=False)
class SharedHandle:
    """What crosses a process boundary to map a ``KVBuffer`` again: a description plus an fd.

    Owns ``fd`` (closes it on ``close()`` or at GC with a ``ResourceWarning``). Send it with
    ``kvxfer.share.send_handles`` (SCM_RIGHTS); it does not pickle, since an fd number means
    nothing in another process.
    """

    kind: Kind
    nbytes: int  # bytes the user asked for
    alloc_nbytes: int  # bytes mapped: rounded to the page, huge page or CUDA granularity
    device: str  # 'cpu' or 'cuda:N' as the exporter saw it
    fd: int = -1  # memfd (host) or cuMem POSIX fd (cuda); -1 when only a fabric handle travels
    fabric: bytes | None = None  # CU_MEM_HANDLE_TYPE_FABRIC handle, 64 bytes
    granularity: int = PAGE_SIZE  # mapping alignment
    huge_pages: bool = False
    device_uuid: str | None = None  # CUDA device UUID, hex: ordinals differ under CUDA_VISIBLE_DEVICES
    name: str = "kvxfer"

    def __post_init__(self) -> None:
        if self.kind not in ("host", "cuda"):
            raise InvalidArgumentError(f"SharedHandle kind must be 'host' or 'cuda', got {self.kind!r}")
        for field in ("nbytes", "alloc_nbytes", "fd", "granularity"):
            if not is_int(getattr(self, field)):
                raise InvalidArgumentError(f"SharedHandle {field} must be an int, got {getattr(self, field)!r}")
        # the mapping alignment reaches cuMemAddressReserve on a CUDA import: a page-sized
        # power of two or more, as every kind makes it
        g = self.granularity
        if g < PAGE_SIZE or g & (g - 1):
            raise InvalidArgumentError(f"SharedHandle granularity must be a power of two >= {PAGE_SIZE}, got {g}")
        if self.alloc_nbytes % g:
            raise InvalidArgumentError(
                f"SharedHandle alloc_nbytes={self.alloc_nbytes} is not a multiple of its granularity {g}"
            )
        if self.nbytes <= 0 or self.alloc_nbytes < self.nbytes:
            raise InvalidArgumentError(
                f"SharedHandle sizes are inconsistent: nbytes={self.nbytes}, alloc_nbytes={self.alloc_nbytes}"
            )
        if self.fd < 0 and self.fabric is None:
            raise InvalidArgumentError("SharedHandle needs an fd or a fabric handle")
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The owned fd (still owned by this handle)."""
        if self._closed:
            raise ClosedError("SharedHandle is closed")
        return self.fd

    def detach(self) -> int:
        """Give up ownership of the fd and return it; the caller closes it."""
        if self._closed:
            raise ClosedError("SharedHandle is closed")
        fd, self.fd = self.fd, -1
        self._closed = True
        return fd

    def close(self) -> None:
        """Close the fd. Idempotent; the memory lives on in every mapping made from it."""
        if self._closed:
            return
        self._closed = True
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        """The handle without its fd, as plain JSON-able data (the wire header of kvxfer.share)."""
        return {
            "kind": self.kind,
            "nbytes": self.nbytes,
            "alloc_nbytes": self.alloc_nbytes,
            "device": self.device,
            "has_fd": self.fd >= 0,
            "fabric": self.fabric.hex() if self.fabric is not None else None,
            "granularity": self.granularity,
            "huge_pages": self.huge_pages,
            "device_uuid": self.device_uuid,
            "name": self.name,
        }

    @classmethod
    def from_description(cls, d: dict[str, Any], fd: int = -1) -> SharedHandle:
        """Rebuild a handle from ``describe()`` plus an fd it now owns (on success only).

        A description that is not one (a missing field, a wrong type) raises
        ``DescriptorError``; inconsistent values ``InvalidArgumentError``."""
        try:
            fabric = d.get("fabric")
            fields = dict(
                kind=d["kind"],
                nbytes=int(d["nbytes"]),
                alloc_nbytes=int(d["alloc_nbytes"]),
                device=str(d["device"]),
                fabric=bytes.fromhex(fabric) if fabric else None,
                granularity=int(d.get("granularity", PAGE_SIZE)),
                huge_pages=bool(d.get("huge_pages", False)),
                device_uuid=d.get("device_uuid"),
                name=str(d.get("name", "kvxfer")),
            )
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise DescriptorError(f"malformed handle description: {type(e).__name__}: {e}") from e
        return cls(fd=fd, **fields)

    def __enter__(self) -> SharedHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a SharedHandle holds an fd and cannot be pickled; send it with kvxfer.share.send_handles")

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()
