"""The layer counter on a GPU: ``bump_on`` captured in a CUDA graph, replayed; the native
watcher sees every increment (each armed layer write fires, in order, exactly once).

Skips without cuda-python, a GPU, or shm. bench/gpu_check.sh runs this file.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.buffers import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available("cuda:0"), reason="needs cuda-python and a CUDA GPU")

L = 8
REPLAYS = 5


def _drv():
    from kvxfer._cuda import driver

    d = driver
    drv = d.load()
    d.make_current(0)
    return d, drv


def _messenger(eng):
    layout = KVLayout.vllm(L, 1, 8, 4, 4, "float16")
    kv = [np.zeros(s, np.uint8) for s in layout.region_sizes(Sharding(1))]
    return kvxfer.Messenger(eng, layout, Sharding(1), {0: kv}, counter_device=0)


def test_bump_on_captured_in_a_graph_is_seen_by_the_watcher():
    d, drv = _drv()
    try:
        a = kvxfer.Engine("shm")
        b = kvxfer.Engine("shm")
    except kvxfer.errors.KvxferError as exc:
        pytest.skip(f"shm: {exc}")
    m = None
    try:
        m = _messenger(a)
        lc = m.layer_counter
        assert lc.ptr != lc.host_ptr or lc.ptr            # a device pointer for kernels
        # one armed 8-byte write per increment the graph will make, to b's buffer
        src = np.arange(L * REPLAYS * 8, dtype=np.uint8)
        dst = np.zeros_like(src)
        ms, md = a.register(src), b.register(dst)
        peer = a.connect(b.address)
        a.send(peer, b"hi")
        assert b.recv(10) == b"hi"
        rd = a.remote(md.descriptor())
        w = m._watcher
        entries = [w.arm(v + 1, ms, peer, rd, [8 * v], [8 * v], [8], imm=9) for v in range(L * REPLAYS)]
        stream = d.check(drv.cuStreamCreate(1), "cuStreamCreate")    # non-blocking: capturable
        d.check(drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
                "cuStreamBeginCapture")
        try:
            # "the model": one bump per layer; the first bump_on of the process is inside the
            # capture, as in a model's captured forward (the kernel was loaded beforehand)
            for _ in range(L):
                lc.bump_on(int(stream))
        finally:                                                      # never leave a capture open
            graph = d.check(drv.cuStreamEndCapture(stream), "cuStreamEndCapture")
        exe = d.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        assert lc.value == 0                                          # capture does not run it
        c = b.expect(9, L * REPLAYS)
        for k in range(REPLAYS):
            d.check(drv.cuGraphLaunch(exe, stream), "cuGraphLaunch")
            d.check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
            assert lc.value == L * (k + 1)
        c.wait(30)
        for e in entries:
            e.wait(30)
        assert [e.state for e in entries] == ["posted"] * len(entries)
        fired = [e.fired_ns for e in entries]
        assert fired == sorted(fired)
        assert np.array_equal(dst, src)
        time.sleep(0.05)
        assert b.banked(9) == 0                                       # exactly once each
    finally:
        if m is not None:
            m.close()
        a.close()
        b.close()


def test_bump_on_torch_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    try:
        eng = kvxfer.Engine("shm")
    except kvxfer.errors.KvxferError as exc:       # no engine built, or no shm here
        pytest.skip(f"shm: {exc}")
    try:
        m = _messenger(eng)
        lc = m.layer_counter
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(L):
                lc.bump_on(torch.cuda.current_stream())
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert lc.value == 3 * L
        m.close()
    finally:
        eng.close()
