"""kvxfer's exception family: one base class, and subclasses that also subclass the
matching built-in so callers can catch either (``except TimeoutError`` works).

A leaf module: it imports nothing from kvxfer, so every layer may raise these.
"""

from __future__ import annotations

import builtins as _builtins
import errno as _errno

__all__ = [
    "KvxferError",
    "FabricError",
    "UnsupportedError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "OutOfBoundsError",
    "DescriptorError",
    "PeerError",
    "RejectedError",
    "TimeoutError",
    "ClosedError",
    "LayoutError",
    "PlanError",
    "TopologyError",
    "BufferError",
    "RendezvousError",
    "SchedulingWarning",
]


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class FabricError(KvxferError, OSError):
    """A libfabric call failed. Carries the call name, the positive errno and libfabric's text."""

    def __init__(self, call: str, err: int, text: str = "") -> None:
        err = abs(int(err))
        self.call = call
        self.fi_errno = err
        self.text = text or _errno.errorcode.get(err, "unknown error")
        OSError.__init__(self, err, f"{call}: {self.text} (errno {err})")

    def __reduce__(self) -> tuple[type[FabricError], tuple[str, int, str]]:
        return (type(self), (self.call, self.fi_errno, self.text))


class UnsupportedError(KvxferError, NotImplementedError):
    """The provider, the installed libfabric or this machine lacks a feature that was asked for."""


class InvalidArgumentError(KvxferError, ValueError):
    """An argument is malformed; nothing was posted or written."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a str timeout, a bool pointer); catchable as TypeError too."""


class OutOfBoundsError(KvxferError, IndexError):
    """A page, offset or length falls outside a registered region (local or remote); nothing was posted."""


class DescriptorError(KvxferError, ValueError):
    """An address or memory descriptor is malformed, truncated, of an unknown version or from another provider."""


class PeerError(KvxferError, ConnectionError):
    """A peer is unreachable or died with transfers pending."""


class RejectedError(KvxferError):
    """The prefiller refused the request (``Request.reject``: its KV is gone, it was
    preempted, the id is unknown; or the request itself was malformed). Not a dead peer:
    the engine recomputes (or asks again), it need not pick another peer."""


class TimeoutError(KvxferError, _builtins.TimeoutError):  # noqa: A001 - deliberately shadows the built-in
    """A wait ran out of time. Subclasses the built-in ``TimeoutError``."""


class ClosedError(KvxferError, RuntimeError):
    """The engine (or region, or buffer) was closed."""


class LayoutError(KvxferError, ValueError):
    """A KV layout or sharding is malformed, or two layouts cannot be transferred between."""


class PlanError(KvxferError, ValueError):
    """A transfer plan cannot be built from the given pages."""


class TopologyError(KvxferError, ValueError):
    """A topology XML is missing or malformed, or a placement cannot be made."""


class BufferError(KvxferError, _builtins.BufferError):  # noqa: A001
    """A KV buffer cannot be allocated, exported, imported or viewed as asked."""


class RendezvousError(KvxferError, ConnectionError):
    """A rendezvous store (etcd, Redis, TCPStore, a directory) is unreachable or refused an
    operation; established fabric connections are not affected (kvxfer.rendezvous)."""


class SchedulingWarning(RuntimeWarning):
    """A real-time scheduling request was refused (``Engine(progress_rt_priority=)`` without
    CAP_SYS_NICE or a high enough RLIMIT_RTPRIO): the engine runs, at normal scheduling;
    ``Engine.stats()`` says so. A warning, not an error (``warnings.simplefilter("error",
    SchedulingWarning)`` makes it one)."""
