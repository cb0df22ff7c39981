"""Benchmark cases for ``kvxfer-bench bw``: what each one writes, and how the target checks it.

Pure numpy, shared by both processes. Nothing large crosses the control channel: the
source pattern and each iteration's scattered destination pages are regenerated from a
seed on both sides, so the target knows exactly which bytes must sit where.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvxfer.errors import InvalidArgumentError

__all__ = ["Case", "parse_case", "parse_size", "fmt_size", "ALIASES", "DEFAULT_CASES",
           "pattern", "dst_pages", "Checker", "GUARD_BYTES", "TARGET_MEMORY"]

#: The cases docs/benchmarks.md quotes, by letter.
ALIASES = {
    "a": "write:64M",        # (a) one 64 MiB write
    "b": "pages:16Kx4096",   # (b) 4096 pages of 16 KiB, scattered
    "c": "pages:2Kx32768",   # (c) 32768 pages of 2 KiB, scattered
    "memmove": "memmove:64M",
}
_LETTER = {v: k for k, v in ALIASES.items() if len(k) == 1}

#: ``kvxfer-bench bw`` with no --case: small to large single writes, (a), (b), (c) and the
#: memmove baseline (a) is judged against.
DEFAULT_CASES = ("write:4K", "write:64K", "write:1M", "a", "b", "c", "memmove")

#: What the target's destination buffer is (``--target-memory``): a host ``KVBuffer`` (a
#: sealed memfd, as kvxfer's KV buffers are; on shm a kvxfer sender then writes directly,
#: src/direct.c), or anonymous numpy memory. The first is the default. NIXL's target gets
#: the same kind, so a comparison holds the destination memory equal.
TARGET_MEMORY = ("memfd", "anon", "memfd-huge")

#: Bytes after the written range that must stay untouched (catches overruns).
GUARD_BYTES = 4096
GUARD_VALUE = 0xA5
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"16K"`` → 16384. Binary units (K, M, G, optionally KiB/KB); a plain number is bytes."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidArgumentError(f"not a size: {text!r} (e.g. 4096, 16K, 64M)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n <= 0:
        raise InvalidArgumentError(f"size must be positive: {text!r}")
    return n


def fmt_size(n: int) -> str:
    """16384 → ``"16K"``; exact binary multiples only, else bytes."""
    for unit, f in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


@dataclass(frozen=True)
class Case:
    """One benchmark case. ``kind``: "write" (one contiguous write of ``page_bytes``),
    "pages" (``pages`` pages of ``page_bytes`` into a random permutation of as many
    destination pages) or "memmove" (local numpy copy of ``page_bytes``, the baseline)."""

    kind: str
    page_bytes: int
    pages: int = 1

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.pages

    @property
    def spec(self) -> str:
        """Canonical spec, parseable by ``parse_case`` (the form sent to the target)."""
        if self.kind == "pages":
            return f"pages:{fmt_size(self.page_bytes)}x{self.pages}"
        return f"{self.kind}:{fmt_size(self.page_bytes)}"

    @property
    def letter(self) -> Optional[str]:
        return _LETTER.get(self.spec)

    @property
    def label(self) -> str:
        if self.kind == "pages":
            base = f"pages {fmt_size(self.page_bytes)} x {self.pages}"
        else:
            base = f"{self.kind} {fmt_size(self.page_bytes)}"
        return f"{base} ({self.letter})" if self.letter else base

    @property
    def remote(self) -> bool:
        return self.kind != "memmove"


def parse_case(text: str) -> Case:
    """``a``/``b``/``c``/``memmove``, ``write:SIZE``, ``pages:PAGExCOUNT`` or ``memmove:SIZE``."""
    spec = ALIASES.get(text.strip().lower(), text.strip())
    kind, _, arg = spec.partition(":")
    kind = kind.lower()
    if kind in ("write", "memmove") and arg:
        return Case(kind, parse_size(arg))
    if kind == "pages" and arg:
        page, sep, count = arg.lower().partition("x")
        if sep and count.strip().isdigit() and int(count) > 0:
            return Case("pages", parse_size(page), int(count))
    raise InvalidArgumentError(
        f"unknown case {text!r}: use a, b, c, memmove, write:SIZE, pages:PAGExCOUNT or memmove:SIZE"
    )


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The source bytes of a case: deterministic, random (so no page equals another or the
    poison), and writable (so it can be registered)."""
    out = np.empty(nbytes, dtype=np.uint8)
    out[:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    return out


def dst_pages(seed: int, iteration: int, count: int) -> np.ndarray:
    """Iteration ``iteration``'s destination page for each source page: a fresh random
    permutation, as scattered as a real KV cache's free list after a while."""
    return np.random.default_rng([seed, iteration]).permutation(count).astype(np.int64)


class Checker:
    """The target's side of a case: the destination buffer, and the check after each write.

    The destination holds ``case.nbytes`` of poison (zeros) followed by a guard. After each
    iteration every page must equal its source page, the guard must be intact, and then
    the written range is poisoned again, so a write that does not land next time is caught
    rather than passing on stale data. ``memory``: one of ``TARGET_MEMORY``; ``close()``
    releases a memfd (the view ``buf`` stays valid).
    """

    def __init__(self, case: Case, seed: int, memory: str = "anon") -> None:
        if memory not in TARGET_MEMORY:
            raise InvalidArgumentError(f"target memory must be one of {TARGET_MEMORY}, not {memory!r}")
        self.case = case
        self.seed = seed
        self.memory = memory
        self.expected = pattern(seed, case.nbytes)
        self._kv = None
        if memory in ("memfd", "memfd-huge"):
            from kvxfer.buffers import KVBuffer

            self._kv = KVBuffer.allocate(case.nbytes + GUARD_BYTES, "cpu", name="kvxfer-bench",
                                         huge_pages=memory == "memfd-huge")
            self.buf = self._kv.numpy()[: case.nbytes + GUARD_BYTES]      # starts zeroed
        else:
            self.buf = np.zeros(case.nbytes + GUARD_BYTES, dtype=np.uint8)
        self.buf[case.nbytes:] = GUARD_VALUE

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    def __enter__(self) -> "Checker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def mapping(self, iteration: int) -> Optional[np.ndarray]:
        if self.case.kind != "pages":
            return None
        return dst_pages(self.seed, iteration, self.case.pages)

    def check(self, iteration: int) -> tuple[int, bool]:
        """(pages that differ from the source, guard intact); then re-poison."""
        bad, guard_ok = self.verify(iteration)
        self.poison()
        return bad, guard_ok

    def poison(self) -> None:
        """Zero the written range and restore the guard, for the next iteration."""
        self.buf[: self.case.nbytes].fill(0)
        self.buf[self.case.nbytes:] = GUARD_VALUE

    def verify(self, iteration: int) -> tuple[int, bool]:
        """``check`` without the re-poisoning: a target that cannot tell when a write landed
        (``--vs mooncake``) verifies until the bytes are all there, then ``poison``s."""
        c = self.case
        data = self.buf[: c.nbytes]
        guard_ok = bool((self.buf[c.nbytes:] == GUARD_VALUE).all())
        if c.kind == "pages":
            perm = self.mapping(iteration)
            got = data.reshape(c.pages, c.page_bytes)[perm]
            exp = self.expected.reshape(c.pages, c.page_bytes)
            if np.array_equal(_words(got), _words(exp)):
                bad = 0
            else:
                bad = int((got != exp).any(axis=1).sum())
        else:
            bad = 0 if np.array_equal(_words(data), _words(self.expected)) else 1
        return bad, guard_ok


def _words(a: np.ndarray) -> np.ndarray:
    """A uint64 view when the size allows (a 3x faster compare), else the bytes."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(np.uint64) if a.nbytes % 8 == 0 else a
