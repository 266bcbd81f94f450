# Two commands on a fresh machine: `make run` (the main job) and `make test` (the whole suite).
# Each creates .venv and installs kiln into it on first use, and reuses it after.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run test test-gpu lint format install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kiln run $(ARGS)

# The whole CPU suite (Triton kernels run through the interpreter); GPU tests skip themselves.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

# On a CUDA machine: only the tests marked gpu.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
