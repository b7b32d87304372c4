# gpuguard: one image, one CLI (`gpuguard enforce`, `gpuguard agent`, `inspect`, `explain`, ...).
# NVML comes from the host through the NVIDIA container toolkit; nothing NVIDIA is installed here.
# Dependencies come from requirements.lock (exact versions and hashes); the base image is pinned
# to a patch release. tests/test_dockerfile.py keeps both in step with pyproject.toml.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The fast path's quiet gate (gpuguard/adapters/nvml/_gate.c, built by setup.py) needs a C compiler
# and Python's headers, in this stage only: the final stage copies /install, never the compiler.
# The official python image has its headers under sysconfig's include path; a Debian python3 base
# (scripts/ensure-python-base.sh) gets them from libpython3.X-dev. Versions not pinned (DL3008):
# they follow the pinned base's Debian release, whose point releases drop superseded versions.
# The rest are the shared libraries scripts/ensure-bpf.sh's unpacked clang and bpftool load from
# the system (its header: Debian 12 base or near-base packages, absent from the slim image).
# hadolint ignore=DL3008
RUN headers=$(python3 -c 'import os, sys, sysconfig; \
      has = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")); \
      print("" if has else "libpython%d.%d-dev" % sys.version_info[:2])') \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      gcc libc6-dev ${headers:+"$headers"} \
      libcap2 libedit2 libelf1 libffi8 libstdc++6 libxml2 libz3-4 zlib1g \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements.lock ./
RUN pip install --no-cache-dir --require-hashes --prefix=/install -r requirements.lock
# The allocation guard's build tools (clang, bpftool, libbpf's headers and libbpf.so.1: Debian 12's
# packages, pinned by version in the script, unpacked under /opt/bpf), in this stage only.
# BPF_TOOLS (setup.py) names them: the build below makes the guard's loader and object or fails.
COPY scripts/ensure-bpf.sh scripts/ensure-lib.sh ./scripts/
RUN BPF_CACHE=/opt/bpf bash scripts/ensure-bpf.sh && rm -rf /var/lib/apt/lists/*
ENV BPF_TOOLS=/opt/bpf/current
COPY pyproject.toml setup.py README.md ./
COPY gpuguard ./gpuguard
# setup.py builds the gate as optional (a machine without gcc still installs gpuguard, in pure
# Python); here a missing or broken gate fails the build, so no image ships without it. python3 -P
# imports the installed package under /install, not /src's gpuguard/ (no gate built there).
# With BPF_TOOLS it also builds the allocation guard's loader and its BPF object (CO-RE: the
# kernel types of the machine that builds; the node's kernel relocates them), or fails; the first
# check imports the loader and finds the object where the enforcer loads it (GUARD_OBJECT).
RUN pip install --no-cache-dir --no-deps --prefix=/install . \
 && python3 -P -c 'import sys, sysconfig; \
      paths = {"base": "/install", "platbase": "/install"}; \
      sys.path.insert(0, sysconfig.get_path("platlib", vars=paths)); \
      from gpuguard.adapters.allocguard import GUARD_OBJECT, loader_built; \
      loader_built() or sys.exit("the allocation guard loader was not built: BPF_TOOLS unset?"); \
      GUARD_OBJECT.is_file() or sys.exit(f"no allocation guard object at {GUARD_OBJECT}"); \
      print("allocation guard built:", GUARD_OBJECT)' \
 && python3 -P -c 'import importlib.util, sys, sysconfig; \
      paths = {"base": "/install", "platbase": "/install"}; \
      sys.path.insert(0, sysconfig.get_path("platlib", vars=paths)); \
      importlib.util.find_spec("gpuguard.adapters.nvml._gate") or sys.exit( \
        "the quiet gate was not built (setup.py skips it without a compiler): pip install -v ."); \
      import gpuguard.adapters.nvml._gate as gate; print("quiet gate built:", gate.__file__)'

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpuguard" \
      org.opencontainers.image.description="Kubernetes node agent that makes time-sliced NVIDIA GPUs safe to share" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gpuguard/gpuguard"
# The allocation guard's loader links libbpf.so.1 (and through it libelf.so.1): Debian 12's, the
# version scripts/ensure-bpf.sh builds against. Not pinned (DL3008), as the build stage's.
# apt-get clean: a base without Debian's docker-clean hook (make python-base) kept 80 MB of apt's
# caches (pkgcache.bin, srcpkgcache.bin) and the .debs in this layer.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libbpf1 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /install /usr/local
# The enforcer runs as root with only CAP_KILL (plus CAP_BPF and CAP_PERFMON with the allocation
# guard on), the agent as 65534 with no capabilities (the DaemonSet sets both); nothing here needs
# a shell or a writable root filesystem.
ENTRYPOINT ["gpuguard"]
CMD ["--help"]
