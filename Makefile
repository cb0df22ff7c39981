# The commands of the README: `make bench`, `make test` and `make demo`. Everything else is set-up.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
# the first Python >= 3.12 found: PATH, then pyenv's versions
PYTHON ?= $(shell for p in python3.13 python3.12 python3 $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3; do \
	  c=$$(command -v $$p 2>/dev/null) || continue; \
	  $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$c; break; }; done)

.PHONY: all sysdeps venv build test ctest bench demo clean

all: build

sysdeps:
	@if ! pkg-config --exists libfabric 2>/dev/null || ! command -v fi_info >/dev/null || ! command -v gcc >/dev/null; then \
	  echo "installing libfabric-dev libfabric-bin gcc"; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libfabric-dev libfabric-bin pkg-config iproute2 gcc; \
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

bench: build
	$(VENV)/bin/kvxfer-bench bw

demo: build
	$(VENV)/bin/kvxfer-demo

clean:
	rm -rf build kvxfer/_fabric.c kvxfer/_fabric*.so *.egg-info
	$(MAKE) -C tests/native clean
