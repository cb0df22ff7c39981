"""Closing a region after a transfer from it failed because its peer died: the transfer is
``done`` for its waiters at once, but its operations stay in flight until the provider returns
them (tcp's rxm does so a little later), and until then ``MemoryRegion.close()`` refuses
(docs/reliability.md, "Dead peers"). Tests close such regions
through ``close_drained``, which retries the close until the provider has let go."""

from __future__ import annotations

import time

from kvxfer.errors import InvalidArgumentError


def close_drained(region, deadline: float = 60.0) -> None:
    """``region.close()``, retried while it refuses because operations are still in flight."""
    t0 = time.monotonic()
    while True:
        try:
            region.close()
            return
        except InvalidArgumentError:
            if time.monotonic() - t0 > deadline:
                raise
            time.sleep(0.01)
