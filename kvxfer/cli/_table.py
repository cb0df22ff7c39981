"""``kvxfer-bench``'s output: the progress bar on stderr and the result tables' rows.

``Bar`` draws one line on a terminal only; ``bw_row`` and ``lat_row`` format one result of
``bw`` and ``lat`` under ``_header`` (columns and widths fixed here, docs/benchmarks.md
"What each column means").
"""

from __future__ import annotations

import math
import sys
import time
from typing import Optional, Sequence, TextIO

from kvxfer.cli._cases import fmt_size

__all__ = ["Bar", "bw_row", "lat_row"]


class Bar:
    """A one-line text progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.enabled = enabled and stream.isatty()
        self._last = 0.0
        self._shown = False

    def update(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 28
        fill = int(width * done / max(1, total))
        line = f"\r{label[:44]:<44} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}"
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()
            self._shown = False


def _t(s: Optional[float]) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us" if s < 1e-4 else f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _rate(v: Optional[float]) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= f:
            return f"{v / f:.2f}{unit}"
    return f"{v:.0f}"


BW_COLUMNS = (("provider", "<"), ("case", "<"), ("bytes", ">"), ("writes", ">"), ("GB/s", ">"),
              ("x memmove", ">"), ("writes/s", ">"), ("p50", ">"), ("p99", ">"), ("acked p50", ">"),
              ("sender p50", ">"), ("post/page", ">"), ("iters", ">"), ("check", "<"))
BW_WIDTHS = (11, 25, 5, 6, 6, 9, 8, 9, 9, 9, 10, 9, 5, 5)
LAT_COLUMNS = (("provider", "<"), ("bytes", ">"), ("p50 rtt", ">"), ("p99 rtt", ">"), ("min", ">"),
               ("mean", ">"), ("one-way p50", ">"), ("floor p50", ">"), ("x floor", ">"), ("iters", ">"),
               ("check", "<"))
LAT_WIDTHS = (12, 6, 9, 9, 9, 9, 11, 9, 7, 6, 5)


def _row(cells: Sequence[str], cols, widths) -> str:
    return "  ".join(f"{c:{a}{w}}" for c, (_, a), w in zip(cells, cols, widths)).rstrip()


def _header(cols, widths) -> str:
    h = _row([c for c, _ in cols], cols, widths)
    return h + "\n" + "-" * len(h)


def bw_row(provider: str, s: dict, memmove_gbps: Optional[float]) -> str:
    ratio = "-"
    if memmove_gbps and s.get("gbps") and s["kind"] != "memmove":
        ratio = f"{s['gbps'] / memmove_gbps:.2f}"
    post = s.get("post_per_page_s")
    cells = [provider, s["label"], fmt_size(s["bytes"]),
             str(s["writes"]) if s["kind"] != "memmove" else "-",
             f"{s['gbps']:.2f}" if s.get("gbps") else "-", ratio,
             _rate(s.get("writes_per_s")), _t(s["p50_s"]), _t(s["p99_s"]), _t(s.get("acked_p50_s")),
             _t(s.get("local_p50_s")), _t(post), str(s["iterations"]), s["check"]]
    return _row(cells, BW_COLUMNS, BW_WIDTHS)


def lat_row(provider: str, s: dict, floor: Optional[dict] = None) -> str:
    """One provider's round trip; ``floor``: bench/fi_pingpong.c's result in the same run."""
    us = lambda v: "-" if v is None or not math.isfinite(v) else f"{v:.1f} us"  # noqa: E731
    fp50 = floor.get("p50_us") if floor else None
    ratio = f"{s['p50_us'] / fp50:.1f}" if fp50 else "-"
    cells = [provider, str(s["size"]), us(s["p50_us"]), us(s["p99_us"]), us(s["min_us"]), us(s["mean_us"]),
             us(s["p50_us"] / 2), us(fp50), ratio, str(s["iterations"]), s["check"]]
    return _row(cells, LAT_COLUMNS, LAT_WIDTHS)
