# One entry point for people and CI: `make test`, `make check`, `make demo`, `make bench`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Extra pytest arguments for `make test` and `make check`, e.g. PYTEST_ARGS="-x".
PYTEST_ARGS ?=
# `make check` spreads its tests over two pytest-xdist processes (tests that need a resource
# alone share an xdist_group); `make check XDIST=` runs them in one. `make test` (CI) stays in
# one process: spread over two it was faster on this 2-core machine (12.8 against about 18
# min) but once failed 33 Qwen3-VL video tests that depend on the order tests run in (a
# cached processor some test changes). Fix that, then spread it.
XDIST   ?= -n 2 --dist loadgroup

.PHONY: venv test check lint demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch + torchvision first and pinned: pip takes both from this machine's disk (a CUDA
	# build that runs on the CPU); torchvision is the fast image-processor backend.
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check mmstore tests benchmarks scripts
	$(BIN)/ruff format --check mmstore tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

# The whole suite: what CI runs (.ci/run).
test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# The fast tier for an edit-test loop: lint and every test not marked slow (each under a
# second here; slow marks kill loops, Ray, notebooks, subprocesses, hypothesis-heavy tests).
check: lint
	$(BIN)/pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/mmstore demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
