"""KVBuffer on CUDA (cuMem): allocate, export, import in another process, dma-buf, views.

Skips without cuda-python or a GPU. bench/gpu_check.sh runs the same checks as a script.
"""

from __future__ import annotations

import gc
import multiprocessing.resource_tracker
import os
import socket

import pytest

from kvxfer import KVBuffer
from kvxfer.buffers import cuda_available
from kvxfer.errors import BufferError, ClosedError, InvalidArgumentError, UnsupportedError
from kvxfer.share import recv_handles, send_handles
from _data import open_fds, pattern
from _procs import spawn

pytestmark = pytest.mark.skipif(not cuda_available("cuda:0"), reason="needs cuda-python and a CUDA GPU")

DEADLINE = 120.0  # the first CUDA context in a fresh process can take seconds
MiB = 1 << 20


@pytest.fixture
def no_fd_leaks():
    multiprocessing.resource_tracker.ensure_running()
    KVBuffer.allocate(1, "cuda:0").close()  # the driver opens its own fds once per process
    gc.collect()
    before = open_fds()
    yield
    gc.collect()
    assert open_fds() == before, f"fd leak: {before} -> {open_fds()}"


def test_allocate_rounds_to_granularity(no_fd_leaks):
    with KVBuffer.allocate(3 * MiB + 5, "cuda:0") as buf:
        assert buf.kind == "cuda" and buf.device == "cuda:0" and buf.device_ordinal == 0
        assert buf.nbytes == 3 * MiB + 5
        assert buf.alloc_nbytes % buf.granularity == 0 and buf.alloc_nbytes >= buf.nbytes
        assert buf.ptr % buf.granularity == 0
        cai = buf.__cuda_array_interface__
        assert cai["data"] == (buf.ptr, False) and cai["shape"] == (buf.nbytes,)
        with pytest.raises(BufferError):
            buf.numpy()
        with pytest.raises(InvalidArgumentError):
            KVBuffer.allocate(MiB, "cuda:0", huge_pages=True)


def test_write_read_roundtrip(no_fd_leaks):
    data = pattern(1, 2 * MiB)
    with KVBuffer.allocate(2 * MiB, "cuda:0") as buf:
        buf.write(data)
        assert buf.read() == data
        buf.write(b"tail", offset=2 * MiB - 4)
        assert buf.read(4, 2 * MiB - 4) == b"tail"


def test_export_import_same_process(no_fd_leaks):
    data = pattern(2, MiB)
    with KVBuffer.allocate(MiB, "cuda:0") as a:
        a.write(data)
        with a.export() as h:
            assert h.kind == "cuda" and h.fd >= 0 and h.device_uuid and h.granularity == a.granularity
            b = KVBuffer.import_(h)
        with b:
            assert b.imported and b.ptr != a.ptr and b.device_ordinal == 0
            assert b.read() == data
            b.write(b"imported")
            assert a.read(8) == b"imported"


def test_dmabuf_fd(no_fd_leaks):
    with KVBuffer.allocate(4 * MiB, "cuda:0") as buf:
        try:
            fd = buf.dmabuf_fd()
        except UnsupportedError as e:
            pytest.skip(f"no dma-buf export here: {e}")
        try:
            assert "dmabuf" in os.readlink(f"/proc/self/fd/{fd}")
            assert os.lseek(fd, 0, os.SEEK_END) == buf.alloc_nbytes  # a dma-buf's size
        finally:
            os.close(fd)


def test_fabric_handle_if_supported(no_fd_leaks):
    with KVBuffer.allocate(MiB, "cuda:0") as buf:
        if not buf.has_fabric_handle:
            with pytest.raises(UnsupportedError):
                buf.export(fabric=True)
            pytest.skip("no FABRIC handle on this device (or no IMEX channel)")
        with buf.export(fabric=True) as h:
            assert h.fd == -1 and h.fabric is not None and len(h.fabric) == 64
            buf.write(b"fabric")
            try:
                imp = KVBuffer.import_(h)
            except UnsupportedError as e:
                pytest.skip(f"FABRIC import refused here: {e}")
            with imp:
                assert imp.read(6) == b"fabric"


def test_torch_view_keeps_memory_alive(no_fd_leaks):
    torch = pytest.importorskip("torch")
    buf = KVBuffer.allocate(MiB, "cuda:0")
    t = buf.torch(torch.float16, (2, 256, 1024))
    assert t.device == torch.device("cuda:0") and t.data_ptr() == buf.ptr
    t.fill_(1.0)
    torch.cuda.synchronize()
    assert buf.read(2) == b"\x00\x3c"  # fp16 1.0
    buf.close()
    with pytest.raises(ClosedError):
        _ = buf.ptr
    t.add_(1.0)  # still mapped: the tensor holds the mapping
    torch.cuda.synchronize()
    assert float(t[1, 255, 1023]) == 2.0
    del t
    gc.collect()


# ---- two processes --------------------------------------------------------------------------


def import_check_write(sock, nbytes: int) -> str:
    with sock:
        sock.settimeout(DEADLINE)
        (h,) = recv_handles(sock)
    with h, KVBuffer.import_(h) as buf:
        assert buf.read() == pattern(3, nbytes), "importer sees other bytes than the exporter wrote"
        buf.write(pattern(4, nbytes))
    return "ok"


def allocate_send_exit(sock, nbytes: int) -> int:
    with sock, KVBuffer.allocate(nbytes, "cuda:0") as buf:
        buf.write(pattern(5, nbytes))
        with buf.export() as h:
            send_handles(sock, [h])
    return os.getpid()


def test_import_in_second_process(no_fd_leaks):
    nbytes = 8 * MiB + 3
    mine, theirs = socket.socketpair()
    child = spawn(import_check_write, theirs, nbytes, deadline=DEADLINE)
    theirs.close()
    with mine, KVBuffer.allocate(nbytes, "cuda:0") as buf:
        buf.write(pattern(3, nbytes))
        with buf.export() as h:
            send_handles(mine, [h])
        assert child.finish() == "ok"
        assert buf.read() == pattern(4, nbytes)


def test_exporter_exits_first(no_fd_leaks):
    nbytes = 4 * MiB
    mine, theirs = socket.socketpair()
    child = spawn(allocate_send_exit, theirs, nbytes, deadline=DEADLINE)
    theirs.close()
    with mine:
        mine.settimeout(DEADLINE)
        (h,) = recv_handles(mine)
    pid = child.finish()
    assert not os.path.exists(f"/proc/{pid}")
    with h, KVBuffer.import_(h) as buf:
        assert buf.read() == pattern(5, nbytes)
