# The README's two commands. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Three test workers on CI's two cores: with two, the cores sat idle 8% of the suite (a worker
# waiting on a process it started, a server, a kill); a third fills most of it (2-3%). On clean
# 2-core clones the tests took 1,390.6 and 1,494.5 s with three, 1,467.6 and 1,499.6 s with two:
# the third worker's extra switching eats much of what the idle time gave back.
PYTEST_WORKERS ?= 3
# Prefect's telemetry off in everything a target starts: its server's heartbeat logs "Failed to
# send telemetry" every 10 minutes offline, and its SDK's analytics. Set them to opt back in.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: run test bench bench-gpu setup clean sandbox-tools browser-tools ui

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m flows

# A local Prefect server (http://127.0.0.1:4200) with the pipeline, image pipeline and retraining deployments.
ui: $(STAMP)
	$(BIN)/python deployments/ui.py

# bubblewrap, which dew_lib.sandbox.NamespaceRunner runs: installed with apt-get when missing and
# this is root on a Debian-like system, a no-op when present; otherwise a note, and the tests that
# need it skip saying why.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap (Debian package) for the namespace sandbox"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; } || \
	      echo "warning: could not install bubblewrap; NamespaceRunner tests will skip"; \
	  else \
	    echo "note: bwrap is missing (Debian/Ubuntu: apt-get install bubblewrap); NamespaceRunner tests will skip"; \
	  fi; }

# chromium, which tests/test_prefect_ui.py drives headless to look at the Prefect UI: installed the
# same way (Debian's package, no browser download); without it that test skips saying why.
browser-tools:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (Debian package) for the Prefect UI test"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
	      echo "warning: could not install chromium; the Prefect UI test will skip"; \
	  else \
	    echo "note: chromium is missing (Debian/Ubuntu: apt-get install chromium); the Prefect UI test will skip"; \
	  fi; }

# Lint, then the type checker against its baseline (tools/typecheck.py), then the tests: a lint or
# a new type error fails `make test` in seconds, before the suite's minutes.
test: $(STAMP) sandbox-tools browser-tools
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --durations=30 $(PYTEST_ARGS)

bench: $(STAMP) sandbox-tools
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/train_lm.py
	$(BIN)/python bench/attention.py --one-core
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/load_checkpoint.py
	$(BIN)/python bench/load_data.py
	$(BIN)/python bench/store.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/native_server.py
	$(BIN)/python bench/lora.py
	$(BIN)/python bench/moe.py
	$(BIN)/python bench/distill.py

# bench/gpu.py: Qwen3-0.6B-shaped SFT and GRPO tokens/s and MFU on one GPU, and the SFT as a
# two-process job. Where nvidia-smi runs it first installs JAX's CUDA plugin matching the installed
# jax (JAX_CUDA=cuda13 for a CUDA 13 driver); BENCH_GPU_ARGS passes flags (e.g. --remat). Without
# a GPU the script stops and says so; `$(BIN)/python bench/gpu.py --dry-run` checks every part on
# the CPU with a tiny model.
JAX_CUDA ?= cuda12
bench-gpu: $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install --quiet "jax[$(JAX_CUDA)]==$$($(BIN)/python -c 'import jax; print(jax.__version__)')"; \
	else \
	  echo "note: no nvidia-smi on PATH; bench/gpu.py runs on whatever device JAX finds"; \
	fi
	$(BIN)/python bench/gpu.py $(BENCH_GPU_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
