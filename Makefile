# The README's two commands. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: run test bench setup clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m dew_lib.demo

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/train_lm.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/load_checkpoint.py
	$(BIN)/python bench/load_data.py
	$(BIN)/python bench/store.py
	$(BIN)/python bench/native_server.py

clean:
	rm -rf $(VENV) runs .pytest_cache
