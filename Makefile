# Two commands for a fresh machine (Python 3.10+ with venv):
#   make demo   the example project on an embedded Redis (no service needed)
#   make test   lint (ruff), types (mypy --strict on the package), the docs site (mkdocs --strict)
#               and the test suite
#   make docs   the docs site alone, into site/ (open site/index.html)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test docs bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# only what the demo needs (embedded Redis, Flask); prints the URL to open, Ctrl-C stops it all
$(DEMO_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) example_project/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/pytest

# offline: no plugin fetches anything; any warning (a broken link, a missing sample) fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

# every benchmark, each comparing against the alternatives in the same run, each writing its own
# section of docs/benchmarks.md (about 30 minutes)
bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_lease.py --callgrind --write-docs
	$(PY) benchmarks/bench_progress.py --write-docs
	$(PY) benchmarks/bench_queue.py --write-docs
	$(PY) benchmarks/bench_throughput.py --callgrind --write-docs
	$(PY) benchmarks/bench_contended.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_time_policies.py --write-docs
	$(PY) benchmarks/bench_cluster.py --write-docs
	$(PY) benchmarks/bench_policies.py --write-docs

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site
