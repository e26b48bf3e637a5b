# One entry point for people and CI: `make test`, `make demo`, `make bench`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv test lint demo bench clean

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

test: lint
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/mmstore demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
