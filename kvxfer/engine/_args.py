"""The engine's argument checks: offsets and page arrays, ints, timeouts, imms, engine options.

Each raises the precise kvxfer.errors exception before anything is posted. A leaf of the
engine package: numpy, kvxfer.errors and kvxfer._maps only.
"""

from __future__ import annotations

import operator
import os
from typing import Optional

import numpy as np

from kvxfer import _maps
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
    """A plain Python int from an int or numpy integer scalar (numpy scalars wrap around in
    arithmetic, which would defeat the bounds checks)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, got {v!r}")
    v = operator.index(v)
    if v < (1 if positive else 0):
        raise InvalidArgumentError(f"{name} must be {'positive' if positive else 'non-negative'}, got {v}")
    return v


#: Longest finite wait accepted (about 31 years); beyond it the native deadline would overflow.
_MAX_TIMEOUT = 1e9


def _timeout(t, name: str = "timeout") -> Optional[float]:
    """None (wait forever) or a finite, non-negative number of seconds as a float."""
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name} must be a number of seconds or None, got {type(t).__name__}")
    v = float(t) if not isinstance(t, (int, np.integer)) or abs(int(t)) < 2**63 else float("inf")
    if v != v:
        raise InvalidArgumentError(f"{name} must be a number of seconds, got NaN")
    if v < 0:
        raise InvalidArgumentError(f"{name} must be non-negative, got {t!r}")
    if v > _MAX_TIMEOUT:
        raise InvalidArgumentError(f"{name} {t!r} is too long; pass None to wait without a deadline")
    return v


def _check_timeout(timeout) -> float:
    """A finite, non-negative timeout (None refused): for calls that must end."""
    if timeout is None:
        raise ArgumentTypeError("timeout must be a number of seconds, got None")
    return _timeout(timeout)


def _check_imm(imm) -> Optional[int]:
    if imm is None:
        return None
    if isinstance(imm, (bool, np.bool_)) or not isinstance(imm, (int, np.integer)):
        raise ArgumentTypeError(f"imm must be an int in [0, 2**32), got {type(imm).__name__}")
    imm = int(imm)
    if not 0 <= imm < _U32:
        raise InvalidArgumentError(f"imm must be in [0, 2**32), got {imm}")
    return imm


def _check_options(progress, iov, max_write, pack_min, rails) -> None:
    """Engine options that need no provider: refused before anything is opened."""
    if progress not in ("block", "spin"):
        raise InvalidArgumentError(f"progress must be 'block' or 'spin', not {progress!r}")
    for name, v in (("iov", iov), ("max_write", max_write)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if pack_min is not None and (isinstance(pack_min, bool) or not isinstance(pack_min, (int, np.integer))
                                 or pack_min < 0):
        raise InvalidArgumentError(f"pack_min must be a non-negative int, got {pack_min!r}")
    if rails is not None and (isinstance(rails, bool) or not isinstance(rails, (int, np.integer)) or rails < 1):
        raise InvalidArgumentError(f"rails must be a positive int, got {rails!r}")



MAX_POLL_US = 1e9


def _check_watch(poll_us, rt_priority, prefix: str = "") -> None:
    """A watcher's poll interval (µs, positive, at most ``MAX_POLL_US``) and SCHED_FIFO
    priority (0..99); ``prefix`` names them as the caller's options do (the messenger's
    ``watch_``)."""
    if isinstance(poll_us, bool) or not isinstance(poll_us, (int, float)) or not 0 < poll_us <= MAX_POLL_US:
        raise InvalidArgumentError(f"{prefix}poll_us must be a positive number up to {MAX_POLL_US:g}, "
                                   f"got {poll_us!r}")
    if isinstance(rt_priority, bool) or not isinstance(rt_priority, int) or not 0 <= rt_priority <= 99:
        raise InvalidArgumentError(f"{prefix}rt_priority must be an int in 0..99, got {rt_priority!r}")


def _u64(v, name: str) -> int:
    """An int in [0, 2**64) (a tag or threshold the native side keeps as uint64_t)."""
    v = _nonneg(v, name)
    if v >= 2**64:
        raise InvalidArgumentError(f"{name} must be below 2**64, got {v}")
    return v


def _check_rail(rail, n: int) -> int:
    """A local rail index in [0, n)."""
    rail = _nonneg(rail, "rail")
    if rail >= n:
        raise InvalidArgumentError(f"rail {rail} is not one of this engine's {n}")
    return rail


def _check_word(word) -> int:
    """A watcher's counter address: 0 (it allocates one) or an 8-byte-aligned u64 that is
    mapped writable in this process (the thread reads it natively; a wild one would crash)."""
    word = _nonneg(word, "word")
    if word:
        if word % 8 or word >= 2**64 - 8:
            raise InvalidArgumentError(f"word {word:#x} is not the address of an aligned 64-bit counter")
        _maps.check_writable(word, 8)
    return word


def _check_cpus(cpus) -> tuple:
    """The progress threads' CPUs (from the caller or a placement): ones this process may use."""
    if cpus is None:
        return ()
    try:
        cpus = tuple(cpus)
    except TypeError:
        raise InvalidArgumentError(f"cpus must list CPU numbers, got {cpus!r}") from None
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c not in allowed]
    if bad:
        raise InvalidArgumentError(f"cpus {bad} are not CPUs this process may run on {sorted(allowed)}")
    return tuple(int(c) for c in cpus)


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
