"""A benchmark of this checkout run as docs/ tell a user to: ``python -m benchmarks.<name>``
from the repository root, in a subprocess of the test, bounded in time; and what the kernel
benchmarks need before they start.

Owns the argv, the working directory, the bound and the failure report (the exit status and
the tails of both outputs). Must not judge a run: the caller checks the exit status
(``check=False``) and reads the results.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rigs.cgroups import require_kernel
from rigs.nvml_stub import build_stub

REPO = Path(__file__).resolve().parents[2]


def require_cgroup_v2_and_stub() -> None:
    """``require`` root and a writable cgroup v2 hierarchy, then build the NVML stand-in: what
    the benchmarks that start workloads in cgroups over the stand-in need."""
    require_kernel(((2, ""),))
    build_stub()


def benchmark_argv(name: str, *args: str | Path) -> list[str]:
    """``python -m benchmarks.<name> ARGS``, to run from ``REPO``."""
    return [sys.executable, "-m", f"benchmarks.{name}", *map(str, args)]


def run_benchmark(
    name: str, *args: str | Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m benchmarks.<name> ARGS`` to its end (``env=None`` passes this process's
    environment); a run past ``timeout`` seconds raises."""
    return subprocess.run(
        benchmark_argv(name, *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else dict(env),
    )


def run_report(done: subprocess.CompletedProcess[str]) -> str:
    """The exit status and the last 6000 and 4000 characters of its output and errors: the
    message of an assertion about the run."""
    return f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
