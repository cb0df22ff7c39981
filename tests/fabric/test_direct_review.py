"""Review of direct writes (src/direct.c, 2026-12-01): each test failed before its fix."""

import errno
import os

import pytest

from kvxfer import KVBuffer, _fabric
from kvxfer.errors import FabricError


def _memfd_maps(inode: int) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.split()[4:5] == [str(inode)])


@pytest.mark.parametrize("offset, nbytes", [
    (4096, 2**64 - 4096),          # offset + nbytes wraps to 0: passed the file-size check
    (2**63, 2**63),                # wraps to 0 as well
    (2**63 - 4096, 2**63 + 8192),  # nbytes past INT64_MAX: INT64_MAX - nbytes wrapped
    (2**64 - 4096, 8192),
])
def test_a_wrapping_range_is_refused_before_anything_is_mapped(offset, nbytes):
    """kx_direct_open's range check wrapped: these reached mmap, which refused only because
    the length came out larger than the address space (ENOMEM). Now EINVAL, up front."""
    with KVBuffer.allocate(1 << 16) as kv:
        st = os.fstat(kv.fileno())
        before = _memfd_maps(st.st_ino)
        with pytest.raises(FabricError) as e:
            _fabric.DirectMap(f"/proc/self/fd/{kv.fileno()}", st.st_dev, st.st_ino, offset, nbytes)
        assert e.value.errno == errno.EINVAL
        assert _memfd_maps(st.st_ino) == before
