"""The engine's argument checks: offset and page arrays, imms, rails, CPUs, NICs, engine options.

Each raises the precise kvxfer.errors exception before anything is posted. Ints, timeouts and
the triples' bounds are checked by ``kvxfer._check`` (one of each for every layer); the
private names here are the ones the engine has always used, and other modules import some of
them (``_check_cpus``). A leaf of the engine package: numpy and kvxfer._check only.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from kvxfer._check import MAX_TIMEOUT, as_cpus, as_int, as_timeout
from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, OutOfBoundsError

_U32 = 2**32


def _as_index(a, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be a 1-D array of page indices, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise OutOfBoundsError(f"{name} has a negative entry ({int(arr.min())})")
    return arr


def _as_offsets(a, name: str) -> np.ndarray:
    arr = _as_index(a, name)
    if arr.size and int(arr.max()) >= 2**62:
        raise OutOfBoundsError(f"{name} has an entry beyond any region ({int(arr.max())})")
    # always a private copy: the progress thread reads it after the call returns, so the
    # caller must not be able to change what was validated
    return np.array(arr, dtype=np.uint64, copy=True)


def _concat_index(parts: list) -> np.ndarray:
    """Concatenate groups' index arrays; signed and unsigned groups mixed would promote to
    float, so integer groups are joined as int64 (values that large are refused anyway).
    Each group's dtype is checked on its own: a bool or float group joined to an int one
    would otherwise be promoted and pass as offsets."""
    for p in parts:
        a = np.asarray(p)
        if a.size and a.dtype.kind not in "iu":
            raise InvalidArgumentError(f"a group's offsets and lengths must be integer arrays, got dtype {a.dtype}")
    out = np.concatenate(parts)
    if out.dtype.kind == "f" and all(np.asarray(p).dtype.kind in "iu" for p in parts):
        out = np.concatenate([np.asarray(p).astype(np.int64) for p in parts])
    return out


def _nonneg(v, name: str, positive: bool = False) -> int:
    """A plain Python int, at least 1 with ``positive``, else at least 0 (``_check.as_int``)."""
    if type(v) is int and v >= positive:
        return v
    return as_int(v, name, minimum=1 if positive else 0)


#: Longest finite wait accepted (``_check.MAX_TIMEOUT``).
_MAX_TIMEOUT = MAX_TIMEOUT


def _timeout(t, name: str = "timeout") -> Optional[float]:
    """None (no deadline: ``None`` or ``inf``) or a finite, non-negative number of seconds
    (``_check.as_timeout``)."""
    return as_timeout(t, name)


def _check_timeout(timeout) -> float:
    """A finite, non-negative timeout (None and inf refused): for calls that must end."""
    t = as_timeout(timeout, forever=False)
    assert t is not None
    return t


def _check_imm(imm) -> Optional[int]:
    """None (no immediate data) or an int in [0, 2**32)."""
    if imm is None or (type(imm) is int and 0 <= imm < _U32):
        return imm
    return None if imm is None else as_int(imm, "imm", minimum=0, maximum=_U32 - 1)


def _check_options(progress, iov, max_write, pack_min, rails) -> None:
    """Engine options that need no provider: refused before anything is opened."""
    if progress not in ("block", "spin"):
        raise InvalidArgumentError(f"progress must be 'block' or 'spin', not {progress!r}")
    for name, v, least in (("iov", iov, 1), ("max_write", max_write, 1), ("pack_min", pack_min, 0),
                           ("rails", rails, 1)):
        if v is not None:
            as_int(v, name, minimum=least)


def _check_progress_rt(progress, priority) -> int:
    """``progress_rt_priority``: 0 (normal scheduling) or a SCHED_FIFO priority in
    sched_get_priority_min/max (1..99 on Linux); refused with ``progress="spin"``, whose
    thread never sleeps (at FIFO it would keep every lower thread off its core)."""
    lo, hi = os.sched_get_priority_min(os.SCHED_FIFO), os.sched_get_priority_max(os.SCHED_FIFO)
    v = as_int(priority, "progress_rt_priority", minimum=0, maximum=hi)
    if 0 < v < lo:
        raise InvalidArgumentError(f"progress_rt_priority must be 0 or in {lo}..{hi}, got {v}")
    if v and progress == "spin":
        raise InvalidArgumentError(
            "progress_rt_priority needs progress='block': a spinning thread at SCHED_FIFO never sleeps "
            "and keeps every lower-priority thread off its core")
    return v


def _u64(v, name: str) -> int:
    """An int in [0, 2**64) (a tag or threshold the native side keeps as uint64_t)."""
    return as_int(v, name, minimum=0, maximum=2**64 - 1)


def _check_rail(rail, n: int) -> int:
    """A local rail index in [0, n)."""
    rail = _nonneg(rail, "rail")
    if rail >= n:
        raise InvalidArgumentError(f"rail {rail} is not one of this engine's {n}")
    return rail


def _check_cpus(cpus) -> tuple:
    """The progress threads' CPUs (from the caller or a placement): ones this process may use."""
    return as_cpus(cpus)


def _check_nics(nics) -> Optional[list[str]]:
    if nics is None:
        return None
    # one string is one NIC's name, not a list of one-letter names
    if isinstance(nics, (str, bytes)):
        raise ArgumentTypeError(f"nics must be a list of NIC (libfabric domain) names, got the string {nics!r}")
    try:
        nics = list(nics)
    except TypeError:
        raise ArgumentTypeError(f"nics must be a list of NIC names, got {type(nics).__name__}") from None
    if not all(isinstance(n, str) and n for n in nics):
        raise ArgumentTypeError(f"each NIC must be a non-empty string, got {nics!r}")
    if not nics:
        raise InvalidArgumentError("nics must name at least one NIC (libfabric domain)")
    return nics


def _page_triples(page_bytes, near: tuple, far: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The triples of a page-list call (``write_pages``, ``read_pages``): page i moves
    ``page_bytes`` between ``offset + pages[i] * stride`` on each side, as ``(near offsets,
    far offsets, lengths)``. ``near``/``far``: ``(name, side, region, pages, offset, stride,
    region bytes)``, ``name`` the arguments' prefix (``src``, ``local``…), ``side`` and
    ``region`` the words of the bounds error. Every argument is checked, then the bounds, before
    anything is returned."""
    (nn, nside, nreg, np_, noff, nst, nsize), (fn, fside, freg, fp, foff, fst, fsize) = near, far
    np_ = _as_index(np_, f"{nn}_pages")
    fp = _as_index(fp, f"{fn}_pages")
    if len(np_) != len(fp):
        raise InvalidArgumentError(f"{nn}_pages has {len(np_)} pages, {fn}_pages {len(fp)}")
    page_bytes = _nonneg(page_bytes, "page_bytes", positive=True)
    noff = _nonneg(noff, f"{nn}_offset")
    foff = _nonneg(foff, f"{fn}_offset")
    nst = page_bytes if nst is None else _nonneg(nst, f"{nn}_stride", positive=True)
    fst = page_bytes if fst is None else _nonneg(fst, f"{fn}_stride", positive=True)
    sides = ((nside, nreg, np_, noff, nst, nsize), (fside, freg, fp, foff, fst, fsize))
    if len(np_):
        for side, region, pages, off, stride, size in sides:
            top = int(pages.max())
            if off + top * stride + page_bytes > size:
                raise OutOfBoundsError(f"{side} page {top} ends at byte {off + top * stride + page_bytes}, "
                                       f"beyond the {size}-byte {region}")
    no, fo = (pages.astype(np.uint64) * np.uint64(stride) + np.uint64(off) for _, _, pages, off, stride, _ in sides)
    return no, fo, np.full(len(np_), page_bytes, dtype=np.uint64)
