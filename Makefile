# Two commands for a fresh machine (Python 3.10+ with venv):
#   make demo   the example project on an embedded Redis (no service needed)
#   make test   lint (ruff), types (mypy --strict on the package) and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) example_project/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

# every benchmark, each comparing against the alternatives in the same run (about 8 minutes)
bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_lease.py
	$(PY) benchmarks/bench_progress.py
	$(PY) benchmarks/bench_queue.py
	$(PY) benchmarks/bench_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
