"""What one benchmark case measured, and its summary as plain JSON-able data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvxfer.cli._cases import Case

__all__ = ["CaseResult", "LatResult"]


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


@dataclass
class CaseResult:
    """One case's numbers, in seconds from the write call: ``landed`` when the target's
    counter completed (read off the target's clock when both share one, else = ``acked``),
    ``acked`` when the target's ack of it reached the initiator, ``local`` sender-side
    completion, ``post`` the write call itself."""

    case: Case
    iterations: int = 0
    warmup: int = 0
    num_writes: int = 0
    clock: str = "ack"
    landed: list = field(default_factory=list)
    acked: list = field(default_factory=list)
    local: list = field(default_factory=list)
    post: list = field(default_factory=list)
    bad_iterations: int = 0
    problems: list = field(default_factory=list)
    direct: Optional[bool] = None      # kvxfer: the writes were direct writes (shm, memfd target)

    @property
    def ok(self) -> bool:
        return self.bad_iterations == 0 and not self.problems

    def summary(self) -> dict:
        c = self.case
        t = np.asarray(self.landed)
        p50 = _pct(t, 50)
        out = {
            "case": c.spec, "letter": c.letter, "label": c.label, "kind": c.kind,
            "bytes": c.nbytes, "pages": c.pages, "page_bytes": c.page_bytes,
            "writes": self.num_writes, "iterations": self.iterations, "warmup": self.warmup,
            "timing": "local copy" if c.kind == "memmove" else self.clock,
            "p50_s": p50, "p99_s": _pct(t, 99), "min_s": float(t.min()) if len(t) else None,
            "mean_s": float(t.mean()) if len(t) else None,
            "gbps": c.nbytes / p50 / 1e9 if p50 > 0 else None,
            "gbps_mean": c.nbytes / float(t.mean()) / 1e9 if len(t) else None,
            "writes_per_s": self.num_writes / p50 if p50 > 0 and self.num_writes else None,
            "check": "ok" if self.ok else "FAIL", "bad_iterations": self.bad_iterations,
            "problems": self.problems, "direct": self.direct,
        }
        for name in ("acked", "local", "post"):
            v = getattr(self, name)
            if v:
                out[f"{name}_p50_s"] = _pct(np.asarray(v), 50)
                out[f"{name}_p99_s"] = _pct(np.asarray(v), 99)
        if self.post:
            out["post_per_page_s"] = out["post_p50_s"] / c.pages
        out["samples_us"] = [round(v * 1e6, 2) for v in self.landed]
        return out


@dataclass
class LatResult:
    """One ``lat`` size: round-trip times of a write echoed back by the target, in seconds."""

    size: int
    iterations: int
    warmup: int
    rtt: list
    bad: int = 0

    def summary(self) -> dict:
        t = np.asarray(self.rtt)
        return {
            "size": self.size, "iterations": self.iterations, "warmup": self.warmup,
            "p50_us": _pct(t, 50) * 1e6, "p99_us": _pct(t, 99) * 1e6,
            "min_us": float(t.min()) * 1e6 if len(t) else None, "mean_us": float(t.mean()) * 1e6 if len(t) else None,
            "check": "ok" if self.bad == 0 else "FAIL", "bad": self.bad,
            "samples_us": [round(v * 1e6, 2) for v in self.rtt],
        }
