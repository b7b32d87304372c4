"""gpuguard's command line run as a user runs it (``python -m gpuguard.cli``), in a subprocess of
the test, from the repository root, bounded in time and, by default, in address space: an input
that would exhaust memory or hang fails the test, not the machine.

Owns the argv, the working directory and the bounds. Must not hide a failure: the exit status is
the caller's to check (``check=False``), and a run past its timeout raises.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MEMORY_BYTES = 1 << 30
"""The address space a run gets unless told otherwise (1 GiB: Python and the CLI need ~100 MiB)."""


def run_gpuguard(
    *args: str | Path,
    stdin: str | None = None,
    timeout: float = 30,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``gpuguard ARGS`` (text in and out); ``memory_bytes=None`` leaves the address space
    unbounded, ``env=None`` passes this process's environment."""

    def limit_memory() -> None:
        if memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return subprocess.run(
        [sys.executable, "-m", "gpuguard.cli", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=False,
        env=None if env is None else dict(env),
        preexec_fn=limit_memory,
    )
