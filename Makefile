# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two stamps: the project and its own dependencies (what `make demo` needs: ~80 MB to
# download), then the test and lmcache extras and LMCache on top (`make test`: ~1.4 GB).
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
# The bench extra (matplotlib) on top, for the benchmarks that plot.
BENCH_STAMP := $(VENV)/.installed-bench
# The LMCache MP server the plugin loads into (plugin/lmcache/ is written for it).
# --no-deps: its declared dependencies include CUDA-only packages; the CPU stack it imports
# is the `lmcache` extra in pyproject.toml (torch pinned there).
LMCACHE_VERSION := 0.5.6
COMMA := ,
# LMCache's next release beside it, for tests/e2e/test_lmcache057.py (the same LMCache tests on
# it): its own target directory, put first on PYTHONPATH by plugin.harness.lmcache_process. Its CPU
# stack is the same `lmcache` extra (same declared dependencies as 0.5.6; torch stays pinned).
LMCACHE_057_VERSION := 0.5.7rc2
LMCACHE_057_DIR := .lmcache-0.5.7
LMCACHE_057_STAMP := $(LMCACHE_057_DIR)/.installed

.PHONY: demo demo-lmcache demo-cluster lmcache-057 test test-fast bench bench-local bench-store bench-coordinator bench-directory bench-directory-memory bench-cluster bench-unified bench-popular bench-lmcache bench-rag bench-routing bench-granularity bench-lookup-forms bench-bounded bench-hostile bench-memory soak clean

# Each step says what it installs and, once done, how long it took (pip itself is quiet).
STEP = t=$$(date +%s); echo "$(VENV)/: $(1)"; $(2) && echo "    done in $$(( $$(date +%s) - t )) s"

$(BASE_STAMP): pyproject.toml Makefile
	@echo "Setting up $(VENV)/ (first use, or pyproject.toml/Makefile changed): the project and its own dependencies (numpy, numba, aiohttp, httpx, ...: about 80 MB to download)."
	@test -x $(PY) || { $(call STEP,[1/2] creating the virtual environment,$(PYTHON) -m venv $(VENV)); }
	@$(call STEP,[2/2] installing the project (-e .),$(PY) -m pip install --quiet -e .)
	@touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	@echo "Adding to $(VENV)/ what the tests use: the test extras and LMCache $(LMCACHE_VERSION)'s CPU stack, about 1.4 GB to download; minutes on a fresh machine, mostly torch."
	@$(call STEP,[1/3] upgrading pip,$(PY) -m pip install --quiet --upgrade pip)
	@$(call STEP,[2/3] installing the test and lmcache extras (pytest / hypothesis / nats / torch CPU / ...: the long step),$(PY) -m pip install --quiet -e '.[test$(COMMA)lmcache]')
	@$(call STEP,[3/3] installing lmcache==$(LMCACHE_VERSION) (--no-deps),$(PY) -m pip install --quiet --no-deps lmcache==$(LMCACHE_VERSION))
	@touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	@$(call STEP,installing the bench extra (matplotlib),$(PY) -m pip install --quiet -e '.[bench]')
	@touch $(BENCH_STAMP)

$(LMCACHE_057_STAMP): Makefile | $(STAMP)
	@rm -rf $(LMCACHE_057_DIR)
	@t=$$(date +%s); echo "$(LMCACHE_057_DIR)/: installing lmcache==$(LMCACHE_057_VERSION) beside $(LMCACHE_VERSION) (--no-deps, 18 MB)"; $(PY) -m pip install --quiet --no-deps --target $(LMCACHE_057_DIR) lmcache==$(LMCACHE_057_VERSION) && echo "    done in $$(( $$(date +%s) - t )) s"
	@touch $(LMCACHE_057_STAMP)

lmcache-057: $(LMCACHE_057_STAMP)

demo: $(BASE_STAMP)
	$(PY) examples/fleet_demo.py

demo-lmcache: $(STAMP)
	$(PY) examples/lmcache_demo.py $(ARGS)

# The same demo on two coordinator replicas over a 3-node NATS JetStream cluster.
demo-cluster: $(STAMP)
	$(PY) examples/fleet_demo.py --cluster

# Two workers (pytest-xdist), a test file each at a time (--dist loadfile: a file's module
# fixtures, its servers, start once): most tests wait on child processes, so the suite
# takes ~3/5 of its serial time on 2 cores. The few tests marked `alone` bound a latency,
# which the other worker's load on the second core upsets: they run after, by themselves.
# `pytest` run by hand stays serial.
PYTEST_WORKERS := -n 2 --dist loadfile

test: $(STAMP) $(LMCACHE_057_STAMP)
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m "not alone"
	$(PY) -m pytest -q -m alone

# The unit lane alone (in-process tests: no child process, no NATS, no LMCache); the lanes
# are the markers in tests/conftest.py.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m unit $(PYTEST_WORKERS)

bench-local: $(STAMP)
	$(PY) -m benchmarks.bench_local_matcher $(ARGS)

bench-store: $(STAMP)
	$(PY) -m benchmarks.bench_store_path $(ARGS)

bench-coordinator: $(STAMP)
	$(PY) -m benchmarks.bench_coordinator $(ARGS)

# The key directory applying mixed STORE batches, in process; ARGS="--against main" for A/B.
bench-directory: $(STAMP)
	$(PY) -m benchmarks.bench_directory_batches $(ARGS)

# What one stored chunk costs the directory's memory, by structure, at chunk 256 / 64 / 32.
bench-directory-memory: $(STAMP)
	$(PY) -m benchmarks.bench_directory_memory $(ARGS)

bench-cluster: $(STAMP)
	$(PY) -m benchmarks.bench_cluster $(ARGS)

bench-unified: $(STAMP)
	$(PY) -m benchmarks.bench_unified_lookup $(ARGS)

bench-popular: $(STAMP)
	$(PY) -m benchmarks.bench_popular_documents $(ARGS)

# Routing by blend score vs round-robin vs prefix-only on MuSiQue (data: as bench-rag's).
bench-routing: $(BENCH_STAMP)
	$(PY) -m benchmarks.bench_routing $(ARGS)

bench-lmcache: $(STAMP)
	$(PY) -m benchmarks.bench_lmcache_lookup $(ARGS)

# Reuse on CacheBlend's MuSiQue prompts, shipped in benchmarks/data/musique/ (its README:
# source, licence, rebuilding the token file); other data: ARGS="--data DIR".
bench-rag: $(STAMP)
	$(PY) -m benchmarks.bench_rag $(ARGS)

# Reuse against chunk size (256..16) on MuSiQue and what each size costs (ours and LMCache's
# server); writes docs/chunk-size.png. A few minutes; ARGS="--quick" for a smoke run.
bench-granularity: $(BENCH_STAMP)
	$(PY) -m benchmarks.bench_granularity $(ARGS)

# The blend-lookup reply forms (default, candidates as objects, as columns) at chunk 256
# and 32 side by side, one coordinator per size, passes interleaved.
bench-lookup-forms: $(STAMP)
	$(PY) -m benchmarks.bench_lookup_forms $(ARGS)

# One request's work bounded: the repeated-token score, reply and a small lookup's wait; one
# score of 64 instances against one candidates lookup (docs/WIRE.md, "Limits").
bench-bounded: $(BENCH_STAMP)
	$(PY) -m benchmarks.bench_bounded_work $(ARGS)

# ~19k hostile sockets from two processes: needs `ulimit -n` of about 10k or more.
bench-hostile: $(STAMP)
	$(PY) -m benchmarks.bench_hostile_sockets $(ARGS)

# The coordinator's RSS through bursts of large /events bodies: peak and what comes back.
bench-memory: $(STAMP)
	$(PY) -m benchmarks.bench_memory_burst $(ARGS)

# 10 minutes of constant live set against the coordinator: RSS slope and latency per interval.
soak: $(STAMP)
	$(PY) -m benchmarks.soak $(ARGS)

bench: bench-local bench-coordinator bench-unified bench-popular bench-lmcache bench-rag

clean:
	rm -rf $(VENV) $(LMCACHE_057_DIR) build *.egg-info .pytest_cache .hypothesis
