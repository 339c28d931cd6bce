# One command sets up and runs each job. `make demo` is the main job, `make test` the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench bench-check clean

$(STAMP): requirements-dev.txt pyproject.toml
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "kiln needs Python 3.11 or newer (pyproject requires-python; tomllib): make PY=python3.11 ...")'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The verify matrix prints its family x head grid first; pytest's summary closes the run. The suite runs on
# TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, one torch thread each).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/kiln verify-matrix
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=25

# Everything but the tests marked slow (spawned process groups, SIGKILL + resume, real checkpoints).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# Every workload of the results table, then benchmarks/RESULTS.md rewritten from this run (benchmarks/run_all.py).
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The benchmarks whose code differs from BASE (git merge base; working tree included) rerun; a best ratio more than
# 10% below its RESULTS.md row is marked FELL and fails the target (benchmarks/check.py). Not part of `make test`.
BASE ?= main
bench-check: $(STAMP)
	$(BIN)/python benchmarks/check.py --base $(BASE)

clean:
	rm -rf $(VENV) demo-out runs
