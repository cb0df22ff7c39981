"""The engine's permit table for shm direct copies: a slot issued per shared region, given back at its close.

``_Permits`` is a base of ``Engine``. A region that is a shared memfd mapping travels with a
host share naming one word of this engine's permit table (``_fabric.PermitTable``, made at
the first such region); peers check the word before they copy into the region and stop when
``MemoryRegion.close()`` revokes it (``regions._PermitSlot``). A slot whose revocation could
not be waited out is never reused (stuck).
"""

from __future__ import annotations

import os
from typing import Optional

from kvxfer import wire
from kvxfer.engine.rails import _fabric
from kvxfer.engine.regions import PERMIT_SLOTS, _PermitSlot
from kvxfer.errors import KvxferError

__all__: list[str] = []


class _Permits:
    """The permit-table calls of ``Engine`` (private: regions use them)."""

    def _permit_take(self, share: wire.HostShare, nbytes: int) -> Optional[_PermitSlot]:
        """A slot of this engine's permit table for a region that offers ``share`` (the table
        is made at the first; the slot records the share's memfd and range, which peers check
        before they map it), or None: no memfd, or every slot taken (the region's share then
        goes without a permit, and peers write into it over RMA)."""
        with self._lock:
            if self._closed:
                return None
            if self._permit is None:
                try:
                    table = _fabric.PermitTable(PERMIT_SLOTS, wire.owner_digest(self.address))
                    st = os.fstat(table.fd)
                except (KvxferError, OSError):
                    return None
                self._permit, self._permit_file = table, (st.st_dev, st.st_ino)
            try:
                slot = self._permit_free.pop()
            except IndexError:
                if self._permit_next >= self._permit.slots:
                    return None
                slot, self._permit_next = self._permit_next, self._permit_next + 1
            table = self._permit
            gen = table.issue(slot, share.dev, share.inode, share.offset, nbytes)
        return _PermitSlot(self, table, slot, gen, *self._permit_file)

    def _permit_give(self, slot: int, reusable: bool) -> None:
        # without self._lock: a region's release runs under it (register's undo after a
        # racing close()) and from finalizers, which a collection may start in any thread
        # while it holds the lock (connect, register and disconnect allocate under it); a
        # deque's append and pop are atomic
        if reusable:
            self._permit_free.append(slot)
        else:
            self._permit_stuck.append(slot)
