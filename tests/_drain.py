"""Closing a region after a transfer from it failed because its peer died: the transfer is
``done`` for its waiters at once, but its operations stay in flight until the provider returns
them (tcp's rxm does so a little later), and until then ``MemoryRegion.close()`` refuses
(docs/reliability.md, "Dead peers"). Tests close such regions through ``close_drained``, which
retries the close until the provider has let go."""

from __future__ import annotations

from kvxfer.errors import InvalidArgumentError

from _data import until


def close_drained(region, deadline: float = 60.0) -> None:
    """``region.close()``, retried while it refuses because operations are still in flight;
    past ``deadline`` the refusal is raised."""
    def closed() -> bool:
        try:
            region.close()
            return True
        except InvalidArgumentError:
            return False

    if not until(closed, deadline):
        region.close()
