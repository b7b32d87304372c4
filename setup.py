"""Builds gpuguard's one native part, the fast path's quiet gate (gpuguard/adapters/nvml/_gate.c,
docs/design.md, Fast path); everything else is in pyproject.toml.

Optional: where no C compiler is available (or on a platform without clock_nanosleep) the build
goes on without it and gpuguard reads memory in Python, at a higher idle CPU cost; ``gpuguard
enforce`` logs which one runs (``fast_path_started``), and `make test` and `make image` fail
when the gate is missing (tests/test_gate.py, scripts/build-image.sh)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gpuguard.adapters.nvml._gate",
            sources=["gpuguard/adapters/nvml/_gate.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        )
    ]
)
