# gpuguard developer entry points. Each target bootstraps what it needs:
#   make demo   the enforcement pipeline on a simulated node (no GPU, no cluster, no root)
#   make test   lint, types, import layering, the NVML stand-in, the Go-built API server, pytest
#   make lint   ruff (lint + format check), mypy --strict, import-linter
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint fmt pytest nvml-stub testbin gpu-e2e clean help

help:
	@echo "make demo | make test | make lint | make fmt | make clean"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo ">> installing gpuguard and its test/lint tools into $(VENV)"
	$(BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(BIN)/python -m pip install -q -e . --group test --group lint
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuguard demo --duration 15

lint: $(STAMP)
	$(BIN)/ruff check gpuguard tests benchmarks
	$(BIN)/ruff format --check gpuguard tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile

fmt: $(STAMP)
	$(BIN)/ruff format gpuguard tests benchmarks
	$(BIN)/ruff check --fix gpuguard tests benchmarks

nvml-stub:
	$(MAKE) -C tests/nvml_stub

testbin:
	bash scripts/ensure-testbin.sh


pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint nvml-stub testbin
	$(BIN)/pytest $(PYTEST_ARGS)

# On a GPU node, as root: the real enforcer against real CUDA processes. PYTHON3 must have torch
# and gpuguard's dependencies (pip install -e . into it); see docs/gpu-e2e.md.
PYTHON3 ?= python3
gpu-e2e:
	$(PYTHON3) scripts/gpu_e2e.py --out gpuguard-e2e-out

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
	$(MAKE) -C tests/nvml_stub clean
