# Two commands for a fresh machine (Python 3.10+ with venv):
#   make demo   the example project on an embedded Redis (no service needed)
#   make test   lint (ruff), types (mypy --strict on the package) and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

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

bench: $(STAMP)
	$(PY) benchmarks/bench_lease.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
