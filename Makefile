# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-local bench-coordinator bench-unified bench-popular clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/fleet_demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench-local: $(STAMP)
	$(PY) -m benchmarks.bench_local_matcher $(ARGS)

bench-coordinator: $(STAMP)
	$(PY) -m benchmarks.bench_coordinator $(ARGS)

bench-unified: $(STAMP)
	$(PY) -m benchmarks.bench_unified_lookup $(ARGS)

bench-popular: $(STAMP)
	$(PY) -m benchmarks.bench_popular_documents $(ARGS)

bench: bench-local bench-coordinator bench-unified bench-popular

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
