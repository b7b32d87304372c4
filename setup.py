"""Builds gpuguard's one native part, the fast path's quiet gate (gpuguard/adapters/nvml/_gate.c,
docs/design.md, Fast path); everything else is in pyproject.toml.

Optional: where no C compiler is available (or on a platform without clock_nanosleep) the build
goes on without it and gpuguard reads memory in Python, at a higher idle CPU cost; ``gpuguard
enforce`` logs which one runs (``fast_path_started``), and `make test` and `make image` fail
when the gate is missing (tests/test_gate.py, scripts/build-image.sh)."""

import os

from setuptools import Extension, setup

# The eBPF allocation guard's loader (gpuguard/adapters/allocguard/_loader.c), only when
# BPF_TOOLS names scripts/ensure-bpf.sh's directory (libbpf's headers and libbpf.so.1): not
# wired into the enforcer yet, so no build needs it.
BPF_TOOLS = os.environ.get("BPF_TOOLS", "")
ALLOCGUARD = (
    [
        Extension(
            "gpuguard.adapters.allocguard._loader",
            sources=["gpuguard/adapters/allocguard/_loader.c"],
            include_dirs=[f"{BPF_TOOLS}/include"],
            library_dirs=[f"{BPF_TOOLS}/lib"],
            runtime_library_dirs=[f"{BPF_TOOLS}/lib"],
            libraries=["bpf"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        )
    ]
    if BPF_TOOLS
    else []
)

setup(
    ext_modules=[
        *ALLOCGUARD,
        Extension(
            "gpuguard.adapters.nvml._gate",
            sources=["gpuguard/adapters/nvml/_gate.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
    ]
)
