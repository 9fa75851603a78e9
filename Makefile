# The two commands a new user needs: `make run` and `make test`.
# Each does its own set-up (a .venv with the project installed) on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck pytest bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/agent-backend run-example

lint: $(STAMP)
	$(BIN)/ruff check agent_backend tests bench
	$(BIN)/ruff format --check agent_backend tests bench

typecheck: $(STAMP)
	$(BIN)/mypy agent_backend

system-deps:
	bash scripts/ensure-system-deps.sh

pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest -W error -q

test: lint typecheck pytest

# Benchmarks print figures side by side with their baselines; they are not part of `make test`.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/validator_bench.py
	$(BIN)/python bench/schema_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
