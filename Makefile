# One command sets up and runs each job. `make demo` is the main job, `make test` the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-fast bench bench-chart bench-check clean gguf-peer

$(STAMP): requirements-dev.txt pyproject.toml
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "kiln needs Python 3.11 or newer (pyproject requires-python; tomllib): make PY=python3.11 ...")'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The linter and the type checker (their rules and the strict seams: pyproject.toml's [tool.ruff] and [tool.mypy]).
# Any finding fails the target, and so `make test` before a test runs. mypy keeps its cache in .mypy_cache.
LINT_PATHS := kiln tests benchmarks examples
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy

# The verify matrix prints its family x head grid first; pytest's summary closes the run. The suite runs on
# TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, one torch thread each).
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(GGUF_FROM_CACHE)
	$(BIN)/kiln verify-matrix
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=25

# llama.cpp for the GGUF tests (tests/interop/test_gguf_llama_cpp.py, skipped without it): llama-cpp-python has
# no CPU wheel on PyPI, so `make gguf-peer` builds one from its source distribution ONCE (portable x86-64: AVX2,
# no -march=native, so one wheel serves Intel and AMD CI machines) into $(WHEELS) and installs it. `make test`
# installs it from that cache when it is there (seconds) and never builds it (a build takes many minutes on 2 cores).
LLAMA_CPP := llama-cpp-python==0.3.36
WHEELS ?= $(HOME)/.cache/kiln/wheels
GGUF_FROM_CACHE = @if ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then \
	$(BIN)/pip install -q --disable-pip-version-check --no-index --find-links $(WHEELS) --no-deps $(LLAMA_CPP) \
	&& $(BIN)/pip install -q --disable-pip-version-check -c requirements-dev.txt diskcache jinja2 numpy typing-extensions; \
	else echo "llama-cpp-python wheel not cached in $(WHEELS): the GGUF llama.cpp tests skip (make gguf-peer builds it)"; fi
gguf-peer: $(STAMP)
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || CMAKE_ARGS="-DGGML_NATIVE=OFF" \
		$(BIN)/pip wheel --no-deps --no-binary llama-cpp-python -w $(WHEELS) $(LLAMA_CPP)
	$(GGUF_FROM_CACHE)

# Everything but the tests marked slow (spawned process groups, SIGKILL + resume, real checkpoints).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile

# Every workload of the results table, then benchmarks/RESULTS.md rewritten from this run (benchmarks/run_all.py).
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# benchmarks/ratios.png redrawn from the table in benchmarks/RESULTS.md (rows added by hand included); runs nothing.
bench-chart: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --chart-only

# The benchmarks whose code differs from BASE (git merge base; working tree included) rerun; a best ratio more than
# 10% below its RESULTS.md row is marked FELL and fails the target (benchmarks/check.py). Not part of `make test`.
# ONLY=bench_trainer.py,bench_grpo.py reruns only the touched ones whose file name contains one of those.
BASE ?= main
ONLY ?=
bench-check: $(STAMP)
	$(BIN)/python benchmarks/check.py --base $(BASE) $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) demo-out runs
