"""KVBuffer's CUDA path on a real GPU, step by step, with a PASS/FAIL/SKIP line per step.

Run by bench/gpu_check.sh (which installs libfabric and builds first); on its own:
``python bench/gpu_check.py [--json PATH] [--device cuda:0] [--mib 64]``.
Exit status: 0 nothing failed, 1 a step failed, 2 no usable GPU (everything skipped).
Steps that could crash native code (engine registration) run in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from typing import Any
from collections.abc import Callable

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests"))  # the shared child-process helper, tests/_procs.py

import numpy as np  # noqa: E402

from kvxfer._cuda import driver as _cuda  # noqa: E402
from kvxfer.buffers import KVBuffer, cuda_available  # noqa: E402
from kvxfer.errors import UnsupportedError  # noqa: E402
from kvxfer.share import recv_handles, send_handles  # noqa: E402
from _data import open_fds, pattern  # noqa: E402
from _procs import ChildSkipped, run_in_child, spawn  # noqa: E402

CHILD_TIMEOUT = 60.0
RESULTS: list[dict[str, Any]] = []


class Skip(Exception):
    """A step that cannot run here (and says why)."""


def step(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    value = None
    try:
        value = fn()
        status, detail = "PASS", "" if value is None else str(value)
    except (Skip, UnsupportedError) as e:
        status, detail = "SKIP", f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - a check reports, it does not stop
        status, detail = "FAIL", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    dt = time.monotonic() - t0
    RESULTS.append({"step": name, "status": status, "seconds": round(dt, 3), "detail": detail})
    first = detail.splitlines()[0] if detail else ""
    print(f"[{status}] {name} ({dt:.2f} s){': ' + first if first else ''}", flush=True)
    if status == "FAIL" and "\n" in detail:
        print("       " + detail.replace("\n", "\n       ").rstrip(), flush=True)
    return value if status == "PASS" else None


# ---- child processes -------------------------------------------------------------------------


def in_child(fn, *args, timeout: float = CHILD_TIMEOUT) -> Any:
    """Run fn in a spawned process; a crash (signal, or psm2's "terminated with signal" exit) or
    a hang becomes a FAIL, not a dead check; a skip in the child is a SKIP here."""
    try:
        return run_in_child(fn, *args, skip=(Skip, UnsupportedError), deadline=timeout)
    except ChildSkipped as e:
        raise Skip(str(e)) from None


def child_import_verify_write(sock: socket.socket, seed: int, new_seed: int) -> str:
    with sock:
        sock.settimeout(CHILD_TIMEOUT)
        (h,) = recv_handles(sock)
    with h, KVBuffer.import_(h) as buf:
        if buf.read() != pattern(seed, buf.nbytes):
            raise AssertionError("importer reads other bytes than the exporter wrote")
        buf.write(pattern(new_seed, buf.nbytes))
        return f"child mapped {buf.nbytes} B at 0x{buf.ptr:x} on {buf.device}"


def child_allocate_send_exit(sock: socket.socket, device: str, nbytes: int, seed: int) -> int:
    with sock, KVBuffer.allocate(nbytes, device) as buf:
        buf.write(pattern(seed, nbytes))
        with buf.export() as h:
            send_handles(sock, [h])
    return os.getpid()


def child_engine_reject(device: str) -> str:
    """A provider without FI_HMEM must refuse CUDA memory with a clear error, not crash."""
    import kvxfer

    if device == "cpu":
        raise Skip("host memory needs no FI_HMEM")
    try:
        import kvxfer._fabric  # noqa: F401
    except ImportError as e:
        raise Skip(f"native module not built: {e}") from e
    if "tcp;ofi_rxm" not in kvxfer.providers():
        raise Skip("tcp;ofi_rxm not offered by this libfabric")
    with kvxfer.Engine("tcp;ofi_rxm", node="127.0.0.1") as eng, KVBuffer.allocate(1 << 20, device) as buf:
        if eng.info["hmem"]:
            mr = eng.register(buf)
            mr.close()
            return "tcp;ofi_rxm offers FI_HMEM here: CUDA registration accepted"
        try:
            eng.register(buf)
        except UnsupportedError as e:
            return f"clear refusal: {e}"
        raise AssertionError("registering CUDA memory on an engine without FI_HMEM did not raise UnsupportedError")


def child_engine_cuda_write(provider: str, device: str, nbytes: int) -> str:
    """Register two CUDA buffers on FI_HMEM engines and write one into the other."""
    import kvxfer
    from kvxfer.errors import FabricError

    try:
        import kvxfer._fabric as fab
    except ImportError as e:
        raise Skip(f"native module not built: {e}") from e
    hmem = device != "cpu"
    try:
        a = kvxfer.Engine(provider, hmem=hmem)
    except (FabricError, UnsupportedError) as e:
        raise Skip(f"{provider} with FI_HMEM does not open (libfabric built without CUDA?): {e}") from e
    try:
        b = kvxfer.Engine(provider, hmem=hmem)
        try:
            with KVBuffer.allocate(nbytes, device) as src, KVBuffer.allocate(nbytes, device) as dst:
                src.write(pattern(11, nbytes))
                dst.write(bytes(nbytes))
                try:
                    msrc = a.register(src)
                    mdst = b.register(dst)
                except UnsupportedError as e:     # e.g. Debian's libfabric, built without CUDA
                    raise Skip(f"{provider} cannot register {device} memory here: {e}") from e
                done = b.expect(7, 1)
                peer = a.connect(b.address)
                t = a.write(msrc, 0, peer, a.remote(mdst.descriptor()), 0, nbytes, imm=7)
                t.wait(30)
                done.wait(30)
                if dst.read() != pattern(11, nbytes):
                    raise AssertionError("destination GPU buffer does not hold the written bytes")
                msrc.close()
                mdst.close()
            how = "host memory" if not hmem else "dma-buf" if fab.HAVE_DMABUF else "FI_HMEM_CUDA"
            return f"{provider}: wrote {nbytes} B {device}->{device}, registered via {how}"
        finally:
            b.close()
    finally:
        a.close()


# ---- the steps --------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run of the script itself")
    ap.add_argument("--mib", type=int, default=64, help="buffer size in MiB (plus 5 bytes)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    dev = args.device
    nbytes = args.mib * (1 << 20) + 5
    print(f"kvxfer gpu_check: device={dev} buffer={nbytes} B pid={os.getpid()}", flush=True)

    def driver() -> str:
        if dev == "cpu":
            return "dry run on host memory (--device cpu): checks the script, not CUDA"
        if not cuda_available(dev):
            try:
                _cuda.load()
            except UnsupportedError as e:
                raise Skip(str(e)) from e
            raise Skip(f"{dev} is not visible")
        drv = _cuda.drv
        o = int(dev.split(":")[1]) if ":" in dev else 0
        name = _cuda.check(drv.cuDeviceGetName(256, _cuda.device(o)), "cuDeviceGetName")
        name = name.split(b"\0")[0].decode() if isinstance(name, bytes) else str(name)
        ver = _cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion")
        attrs = {
            k: _cuda.attr(o, "CU_DEVICE_ATTRIBUTE_" + k)
            for k in (
                "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                "HANDLE_TYPE_FABRIC_SUPPORTED",
                "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
                "DMA_BUF_SUPPORTED",
            )
        }
        return f"{name}, driver API {ver}, " + ", ".join(f"{k.lower()}={v}" for k, v in attrs.items())

    if step("cuda driver and device", driver) is None:
        print("no usable GPU: nothing else to check", flush=True)
        return finish(args.json, no_gpu=True)

    state: dict[str, Any] = {}

    def allocate() -> str:
        buf = KVBuffer.allocate(nbytes, dev)
        state["buf"] = buf
        # multiprocessing's resource tracker (started by the first spawn below) keeps a pipe
        # open for good: start it before the baseline, or it reads as a leak at the end
        import multiprocessing.resource_tracker

        multiprocessing.resource_tracker.ensure_running()
        state["fds"] = open_fds()  # after the first allocation: the driver opens its own fds once
        assert buf.alloc_nbytes % buf.granularity == 0 and buf.alloc_nbytes >= nbytes
        assert buf.ptr % buf.granularity == 0
        return (
            f"ptr=0x{buf.ptr:x} alloc_nbytes={buf.alloc_nbytes} granularity={buf.granularity} "
            f"fabric_handle={buf.has_fabric_handle}"
        )

    if step("allocate (cuMemCreate, reserve, map, set access)", allocate) is None:
        return finish(args.json)
    buf: KVBuffer = state["buf"]

    def write_read() -> str:
        data = pattern(1, nbytes)
        t0 = time.monotonic()
        buf.write(data)
        back = buf.read()
        dt = time.monotonic() - t0
        assert back == data, "read-back differs from what was written"
        return f"{2 * nbytes / dt / 1e9:.2f} GB/s host<->device through the mapping (pageable)"

    step("write + read back through the mapping", write_read)

    def same_process() -> str:
        with buf.export() as h, KVBuffer.import_(h) as other:
            assert other.ptr != buf.ptr
            assert other.read(4096) == buf.read(4096)
            other.write(b"same-process import")
            assert buf.read(19) == b"same-process import"
            return f"fd={h.fd} uuid={h.device_uuid} imported at 0x{other.ptr:x}"

    step("export + import in this process", same_process)

    def second_process() -> str:
        buf.write(pattern(3, nbytes))
        mine, theirs = socket.socketpair()
        with mine:
            with buf.export() as h:
                send_handles(mine, [h])
            note = in_child(child_import_verify_write, theirs, 3, 4)
            theirs.close()
        assert buf.read() == pattern(4, nbytes), "the second process's writes are not visible here"
        return note

    step("import in a second process (SCM_RIGHTS), write there, read here", second_process)

    def exporter_first() -> str:
        mine, theirs = socket.socketpair()
        with mine:
            child = spawn(child_allocate_send_exit, theirs, dev, nbytes, 5, deadline=CHILD_TIMEOUT)
            theirs.close()
            mine.settimeout(CHILD_TIMEOUT)
            try:
                (h,) = recv_handles(mine)
            except BaseException:
                child.close()
                raise
            try:
                pid = child.finish()
            except BaseException:
                h.close()
                raise
        assert not os.path.exists(f"/proc/{pid}"), "exporter still running"
        with h, KVBuffer.import_(h) as imp:
            assert imp.read() == pattern(5, nbytes), "imported memory lost its bytes after the exporter exited"
        return f"exporter pid {pid} gone, import still valid"

    step("exporter exits first, import stays valid", exporter_first)

    def dmabuf() -> str:
        fd = buf.dmabuf_fd()
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            return f"fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}, size {size}"
        finally:
            os.close(fd)

    step("dma-buf fd (cuMemGetHandleForAddressRange)", dmabuf)

    def fabric() -> str:
        if not buf.has_fabric_handle:
            raise Skip("allocation has no FABRIC handle (device attribute 0, or no IMEX channel)")
        with buf.export(fabric=True) as h:
            assert h.fabric is not None and len(h.fabric) == 64
            with KVBuffer.import_(h) as imp:
                assert imp.read(4096) == buf.read(4096)
        return "fabric handle exported and imported"

    step("FABRIC handle", fabric)

    def torch_view() -> str:
        try:
            import torch
        except ImportError as e:
            raise Skip("torch not installed") from e
        if dev == "cpu":
            raise Skip("a dry run on host memory: torch.cuda has nothing to synchronize")
        t = buf.torch(torch.float16, (nbytes // 2,))
        t.fill_(1.5)
        torch.cuda.synchronize()
        assert buf.read(2) == np.float16(1.5).tobytes()
        assert t.data_ptr() == buf.ptr
        del t
        return "torch view shares memory"

    step("torch view", torch_view)

    step(
        "engine: device memory on a provider without FI_HMEM is refused cleanly",
        lambda: in_child(child_engine_reject, dev),
    )
    step(
        "engine: register + write between two buffers over shm (FI_HMEM for CUDA)",
        lambda: in_child(child_engine_cuda_write, "shm", dev, 8 << 20),
    )

    def close_and_leaks() -> str:
        buf.close()
        buf.close()
        state.pop("buf", None)
        import gc

        gc.collect()
        now = open_fds()
        assert now <= state["fds"], f"fd count grew: {state['fds']} after allocating -> {now} after closing"
        return f"fds {state['fds']} -> {now}"

    step("close (idempotent) and no fd leak", close_and_leaks)
    return finish(args.json)


def finish(path: str | None, no_gpu: bool = False) -> int:
    counts = {s: sum(r["status"] == s for r in RESULTS) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump({"results": RESULTS, "counts": counts, "no_gpu": no_gpu}, f, indent=1)
    if counts["FAIL"]:
        return 1
    return 2 if no_gpu else 0


if __name__ == "__main__":
    sys.exit(main())
