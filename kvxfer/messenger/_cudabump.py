"""The layer counter on a GPU: a word of pinned host memory mapped into the device, and a
one-thread kernel that increments it, launched on the model's stream (capturable in a CUDA
graph). Compiled once per process with NVRTC (cuda-python); nothing here imports without
being used, and every failure is an ``UnsupportedError`` with the reason.
"""

from __future__ import annotations

from typing import Any

from kvxfer._cuda import driver, nvrtc_module
from kvxfer.errors import KvxferError, UnsupportedError

_SRC = rb"""
extern "C" __global__ void kx_layer_bump(unsigned long long *word)
{
    /* one thread of one block: launches on one stream are ordered, so a plain
     * read-modify-write is enough; the fence publishes it to the host's watcher */
    volatile unsigned long long *w = word;
    *w = *w + 1ULL;
    __threadfence_system();
}
"""


def alloc_mapped_word(device: int) -> tuple[int, int, Any]:
    """8 bytes (64 allocated) of pinned host memory mapped into ``device``: (host ptr,
    device ptr, a release function)."""
    d = driver
    drv = d.load()
    d.make_current(device)
    flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
    host = d.check(drv.cuMemHostAlloc(64, flags), "cuMemHostAlloc")
    host_ptr = int(host)
    dev = d.check(drv.cuMemHostGetDevicePointer(host_ptr, 0), "cuMemHostGetDevicePointer")
    import ctypes

    ctypes.memset(host_ptr, 0, 64)

    def release() -> None:
        try:
            drv.cuMemFreeHost(host_ptr)
        except Exception:
            pass

    return host_ptr, int(dev), release


class Kernel:
    """The compiled increment kernel, loaded into ``device``'s primary context."""

    def __init__(self, device: int) -> None:
        nvrtc = nvrtc_module()
        if nvrtc is None:
            raise UnsupportedError("bump_on needs cuda-python's nvrtc")
        d = driver
        drv = d.load()
        d.make_current(device)
        major = d.attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = d.attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        # a cubin for this GPU first (the driver need not JIT PTX of a newer NVRTC than it
        # knows), PTX for its compute capability where that cannot be built or loaded
        errors = []
        self._module = None
        for arch, get_size, get in ((f"sm_{major}{minor}", "nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
                                    (f"compute_{major}{minor}", "nvrtcGetPTXSize", "nvrtcGetPTX")):
            if not hasattr(nvrtc, get):
                continue
            try:
                image = self._compile(nvrtc, arch, getattr(nvrtc, get_size), getattr(nvrtc, get))
                self._module = d.check(drv.cuModuleLoadData(image), "cuModuleLoadData")
                break
            except KvxferError as exc:
                errors.append(f"{arch}: {exc}")
        if self._module is None:
            raise UnsupportedError("the bump kernel could not be built and loaded: " + "; ".join(errors))
        self._fn = d.check(drv.cuModuleGetFunction(self._module, b"kx_layer_bump"), "cuModuleGetFunction")
        self._d = d
        self._drv = drv

    @classmethod
    def _compile(cls, nvrtc: Any, arch: str, get_size: Any, get: Any) -> bytes:
        """The kernel compiled by NVRTC for ``arch`` (``sm_XY``: a cubin; ``compute_XY``: PTX)."""
        err, prog = nvrtc.nvrtcCreateProgram(_SRC, b"kx_layer_bump.cu", 0, [], [])
        cls._nv_check(nvrtc, err, "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}".encode()]
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                _, n = nvrtc.nvrtcGetProgramLogSize(prog)
                log = b" " * n
                nvrtc.nvrtcGetProgramLog(prog, log)
                raise UnsupportedError(f"nvrtc could not compile the bump kernel: {log.decode(errors='replace')}")
            err, n = get_size(prog)
            cls._nv_check(nvrtc, err, f"{arch}: size of the image")
            image = b" " * n
            (err,) = get(prog, image)
            cls._nv_check(nvrtc, err, f"{arch}: the image")
            return image
        finally:
            try:
                nvrtc.nvrtcDestroyProgram(prog)
            except Exception:        # a leaked program costs a few KiB; its image is ours
                pass

    @staticmethod
    def _nv_check(nvrtc: Any, err: Any, call: str) -> None:
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise UnsupportedError(f"{call} failed: {err}")

    def launch(self, stream: int, word_dptr: int) -> None:
        """Enqueue one increment of the word at ``word_dptr`` on ``stream``."""
        import ctypes

        import numpy as np

        drv = self._drv
        arg = np.array([word_dptr], dtype=np.uint64)
        args = np.array([arg.ctypes.data], dtype=np.uint64)
        (err,) = drv.cuLaunchKernel(self._fn, 1, 1, 1, 1, 1, 1, 0, drv.CUstream(stream), args.ctypes.data, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise UnsupportedError(f"cuLaunchKernel failed: {err}")
        del ctypes
