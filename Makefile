# gpuguard developer entry points. Each target bootstraps what it needs:
#   make demo   the enforcement pipeline on a simulated node (no GPU, no cluster, no root)
#   make dra-demo  DRA memory shares enforced on the real control plane, kwok and real cgroups
#               (as root; scripts/dra_demo.py)
#   make test   lint, types, import layering, the NVML stand-in, the Go-built API server and
#               Prometheus, pytest
#   make lint   ruff (lint + format check), mypy --strict, import-linter
#   make e2e-node  the chart on a real kubelet + containerd node, as root (docs/real-node.md)
#   make image  the image from the Dockerfile, with BuildKit, no Docker (as root), on the base
#               BASE_IMAGE=<ref> (default the Dockerfile's) or BASE_ARCHIVE=<OCI archive>:
#               build/gpuguard-image.oci.tar; make push-image pushes it with crane
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo dra-demo test lint fmt pytest nvml-stub podresources-stubs testbin prometheus gobins gpu-e2e image e2e-node clean help \
	mutation-check python-base push-image cluster cluster-down

help:
	@echo "make demo            the enforcement pipeline on a simulated node (no GPU, cluster or root)"
	@echo "make dra-demo        DRA memory shares enforced on a real control plane (as root)"
	@echo "make test            lint, types, layering, mutation-check, then the whole suite"
	@echo "make pytest          the suite only (PYTEST_ARGS=...)"
	@echo "make lint            ruff, mypy --strict, import-linter, hadolint (make fmt: format, fix)"
	@echo "make mutation-check  each safety rule switched off, against the tests that catch it"
	@echo "make e2e-node        the chart on a real kubelet + containerd node (as root)"
	@echo "make cluster         a local cluster to try the chart on: a control plane and one real"
	@echo "                     node with a stand-in GPU, in the background (as root; CLUSTER_DIR)"
	@echo "make cluster-down    stop it and remove everything it made"
	@echo "make image           the image with BuildKit, no Docker (as root), on the base"
	@echo "                     BASE_IMAGE=<ref> (default: the Dockerfile's, pulled) or"
	@echo "                     BASE_ARCHIVE=<OCI archive> (e.g. build/python-base.oci.tar)"
	@echo "make python-base     Debian 12's python3 as an OCI archive: build/python-base.oci.tar"
	@echo "make push-image      IMAGE_REPOSITORY=<registry/path> [IMAGE_TAG=<tag>]: push it (crane)"
	@echo "make gpu-e2e         on a GPU node: the real enforcer against real CUDA processes"
	@echo "make gobins | make nvml-stub | make testbin | make prometheus | make pack-apiserver"
	@echo "make podresources-stubs | make clean | make help (this list)"

# setup.py builds the fast path's native quiet gate (gpuguard/adapters/nvml/_gate.c) in place;
# tests/test_gate.py fails when it is missing.
$(STAMP): pyproject.toml setup.py gpuguard/adapters/nvml/_gate.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo ">> installing gpuguard and its test/lint tools into $(VENV)"
	$(BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(BIN)/python -m pip install -q -e . --group test --group lint --group codegen
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuguard demo --duration 15

# As root: the real kube-apiserver, controller-manager and scheduler (built once, cached) give two
# pods DRA memory shares of one GPU; the real enforcer stops the one over its share and leaves the
# other untouched, told step by step (scripts/dra_demo.py; tests/integration/test_dra.py has more).
dra-demo: $(STAMP) nvml-stub testbin
	bash scripts/ensure-controlplane.sh >/dev/null
	$(BIN)/python -m scripts.dra_demo

lint: $(STAMP)
	$(BIN)/ruff check gpuguard rigs tests benchmarks dashboards scripts
	$(BIN)/ruff format --check gpuguard rigs tests benchmarks dashboards scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile

fmt: $(STAMP)
	$(BIN)/ruff format gpuguard rigs tests benchmarks dashboards scripts
	$(BIN)/ruff check --fix gpuguard rigs tests benchmarks dashboards scripts

nvml-stub:
	$(MAKE) -C tests/nvml_stub

# The kubelet pod-resources API's Python stubs from the committed api.proto
# (scripts/gen_podresources.py; tests/test_podresources_stubs.py fails on drift).
podresources-stubs: $(STAMP)
	$(BIN)/python -m scripts.gen_podresources

testbin:
	bash scripts/ensure-testbin.sh

# Prometheus 3.16 + promtool (tests/test_alerts.py), cached under ~/.cache/gpuguard-prometheus.
prometheus:
	bash scripts/ensure-prometheus.sh >/dev/null

# Every Go-built and fetched test tool at once (each script is cached under ~/.cache and keyed by
# version; the tests call the same scripts, so a tool not prebuilt here is still built there).
# Cold, the builds overlap their downloads and links.
GOBIN_SCRIPTS := ensure-testbin ensure-prometheus ensure-chart-tools ensure-dashboard-validator \
	ensure-alertmanager ensure-controlplane ensure-faketime ensure-node ensure-buildkit ensure-python-base \
	ensure-crane
gobins:
	@pids=(); for s in $(GOBIN_SCRIPTS); do bash scripts/$$s.sh >/dev/null & pids+=("$$s:$$!"); done; \
	 failed=0; for p in "$${pids[@]}"; do wait "$${p#*:}" || { echo "gobins: $${p%%:*} failed" >&2; failed=1; }; done; \
	 exit $$failed

pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint nvml-stub gobins mutation-check
	$(BIN)/pytest $(PYTEST_ARGS)

# Each safety rule switched off in a temporary copy, one at a time, against the tests that
# docs/safety.md says catch it (scripts/mutations.py): fails when one lets its mutation survive.
# Each mutation once, two copies at a time. As root: the kernel ones need cgroups.
mutation-check: $(STAMP) testbin
	$(BIN)/python -m scripts.mutations --claimed-only --worktree --jobs 2

# On a GPU node, as root: the real enforcer against real CUDA processes. PYTHON3 must have torch
# and gpuguard's dependencies (pip install -e . into it); see docs/gpu-e2e.md.
PYTHON3 ?= python3
gpu-e2e:
	$(PYTHON3) -m scripts.gpu_e2e --out gpuguard-e2e-out

# etcd.xz + kube-apiserver.xz (xz -9e) for a GPU machine that gets few carried bytes:
# TESTBIN_DIR=testbin/bin/packed python3 -m scripts.gpu_e2e --apiserver DIR [--dra] (docs/gpu-e2e.md).
pack-apiserver: testbin
	bash scripts/pack-apiserver.sh testbin/bin/packed

# BuildKit (scripts/ensure-buildkit.sh) and runc (scripts/ensure-node.sh) are built once and
# cached under ~/.cache; the base is BASE_IMAGE or BASE_ARCHIVE (scripts/build-image.sh --help;
# docs/install.md, "Building the image without Docker").
image:
	bash scripts/build-image.sh

# Debian 12's python3 (scripts/ensure-python-base.sh, cached under ~/.cache) as an OCI archive,
# a base for `make image BASE_ARCHIVE=build/python-base.oci.tar` (as root).
python-base:
	@set -o pipefail; dir=$$(bash scripts/ensure-python-base.sh | sed -n 's/^PYTHON_BASE=//p') \
	 && mkdir -p build && cp "$$dir/python-base.oci.tar" build/.python-base.oci.tar.tmp \
	 && mv -f build/.python-base.oci.tar.tmp build/python-base.oci.tar \
	 && echo build/python-base.oci.tar

# build/gpuguard-image.oci.tar to IMAGE_REPOSITORY:IMAGE_TAG with crane (scripts/ensure-crane.sh,
# cached under ~/.cache); prints the chart's image values (scripts/push-image.sh --help).
push-image:
	bash scripts/push-image.sh

# As root: the chart on a real kubelet + containerd + runc node (tests/node; docs/real-node.md).
# make test runs it too; this runs only it (the node parts and the image are built first).
e2e-node: $(STAMP) nvml-stub
	bash scripts/ensure-node.sh >/dev/null
	$(BIN)/pytest tests/node -q -p no:cacheprovider $(PYTEST_ARGS)

# As root: a control plane and one real kubelet + containerd node with a stand-in GPU, the image
# imported, left running for you to install the chart on (scripts/cluster.py; docs/install.md,
# "Try it locally"); make cluster-down stops it and removes everything it made.
CLUSTER_DIR ?= /tmp/gpuguard-cluster
cluster: $(STAMP) nvml-stub testbin
	$(BIN)/python -m scripts.cluster up --dir $(CLUSTER_DIR)

cluster-down: $(STAMP)
	$(BIN)/python -m scripts.cluster down --dir $(CLUSTER_DIR)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
	$(MAKE) -C tests/nvml_stub clean
