# One entry point for people and CI: `make test`, `make check`, `make demo`, `make bench`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Extra pytest arguments for `make test` and `make check`, e.g. PYTEST_ARGS="-x".
PYTEST_ARGS ?=
# `make check` spreads its tests over two pytest-xdist processes (tests that need a resource
# alone share an xdist_group); `make check XDIST=` runs them in one. `make test` (CI) stays in
# one process, where a failure is the simplest to read. (33 Qwen3-VL video tests that once
# failed spread over two were transformers 5.25's new layout, not the order: fixed.)
XDIST   ?= -n 2 --dist loadgroup
# `make demo` on a machine without .venv: a venv of the `torch` extra only (no dev tools).
DEMO_VENV := .venv-demo

.PHONY: venv lock test check lint demo bench clean

# constraints.txt: the versions the suite last passed with, so a package released since cannot
# turn CI red (PyAV 18.1.1 once did); `make lock` rewrites it from .venv.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch + torchvision first and pinned (the versions the tests ran with; torchvision is
	# the fast image-processor backend). pip takes them from its index: PyPI's are CUDA
	# builds that also run on a CPU; a CPU-only machine saves 3 GB with
	# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (README).
	$(BIN)/pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

# After upgrading a package in .venv and passing `make test` with it.
lock:
	{ sed -n '1,3p' constraints.txt; $(BIN)/pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

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

# The demo needs the `torch` extra only: the dev venv if there is one, else a small one.
demo:
	@if [ -f $(STAMP) ]; then $(BIN)/mmstore demo; else \
		test -x $(DEMO_VENV)/bin/mmstore || { $(PY) -m venv $(DEMO_VENV) && \
		$(DEMO_VENV)/bin/pip install -q -e ".[torch]"; } && $(DEMO_VENV)/bin/mmstore demo; fi

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
