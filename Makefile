# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The LMCache MP server the plugin loads into (plugin/lmcache_adapter.py is written for it).
# --no-deps: its declared dependencies include CUDA-only packages; the CPU stack it imports
# is the `lmcache` extra in pyproject.toml (torch pinned there).
LMCACHE_VERSION := 0.5.6

.PHONY: demo demo-lmcache demo-cluster test bench bench-local bench-coordinator bench-cluster bench-unified bench-popular bench-lmcache bench-rag bench-hostile soak clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lmcache]'
	$(PY) -m pip install --quiet --no-deps lmcache==$(LMCACHE_VERSION)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/fleet_demo.py

demo-lmcache: $(STAMP)
	$(PY) examples/lmcache_demo.py

# The same demo on two coordinator replicas over a 3-node NATS JetStream cluster.
demo-cluster: $(STAMP)
	$(PY) examples/fleet_demo.py --cluster

test: $(STAMP)
	$(PY) -m pytest -q

bench-local: $(STAMP)
	$(PY) -m benchmarks.bench_local_matcher $(ARGS)

bench-coordinator: $(STAMP)
	$(PY) -m benchmarks.bench_coordinator $(ARGS)

bench-cluster: $(STAMP)
	$(PY) -m benchmarks.bench_cluster $(ARGS)

bench-unified: $(STAMP)
	$(PY) -m benchmarks.bench_unified_lookup $(ARGS)

bench-popular: $(STAMP)
	$(PY) -m benchmarks.bench_popular_documents $(ARGS)

bench-lmcache: $(STAMP)
	$(PY) -m benchmarks.bench_lmcache_lookup $(ARGS)

# Reuse on CacheBlend's MuSiQue prompts (../shared/data/musique; elsewhere: ARGS="--data DIR").
bench-rag: $(STAMP)
	$(PY) -m benchmarks.bench_rag $(ARGS)

# ~19k hostile sockets from two processes: needs `ulimit -n` of about 10k or more.
bench-hostile: $(STAMP)
	$(PY) -m benchmarks.bench_hostile_sockets $(ARGS)

# 10 minutes of constant live set against the coordinator: RSS slope and latency per interval.
soak: $(STAMP)
	$(PY) -m benchmarks.soak $(ARGS)

bench: bench-local bench-coordinator bench-unified bench-popular bench-lmcache bench-rag

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
