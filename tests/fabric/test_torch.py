"""CPU torch tensors register and transfer directly (runs where torch is installed).

torch is an optional extra: on this project's Python 3.12 machines only a multi-GB CUDA build
would install, so CI skips this module; it was run with the CPU wheel on Python 3.11.
"""

import numpy as np
import pytest

import kvxfer
from kvxfer import errors

torch = pytest.importorskip("torch")


def test_cpu_tensor_pages_land(provider):
    with kvxfer.Engine(provider, "127.0.0.1") as a, kvxfer.Engine(provider, "127.0.0.1") as b:
        src = torch.arange(64 * 1024, dtype=torch.int32)
        dst = torch.zeros(128 * 1024, dtype=torch.int32)
        ms, md = a.register(src), b.register(dst)
        assert ms.ptr == src.data_ptr() and ms.nbytes == src.numel() * src.element_size()
        t = a.write_pages(ms, np.arange(64), a.connect(b.address), a.remote(md.descriptor()), np.arange(64) * 2,
                          4096, imm=1)
        b.expect(1, t.num_writes).wait(10)
        t.wait(10)
        assert torch.equal(dst.view(-1, 1024)[::2][:64].reshape(-1), src)


def test_non_contiguous_tensor_refused(engine):
    with pytest.raises(errors.InvalidArgumentError):
        engine.register(torch.zeros(8, 8)[:, ::2])
