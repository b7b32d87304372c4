"""This checkout run in a subprocess of a test (or of ``rigs.pid_reuse``), from the repository
root: gpuguard's command line as a user runs it (``python -m gpuguard.cli``), bounded in time
and, by default, in address space (an input that would exhaust memory or hang fails the test,
not the machine); and a Python script under a wrapper (``unshare``, ``setpriv``) that prints
its findings as JSON.

Owns the argv, the working directory, ``PYTHONPATH`` and the bounds. Must not hide a failure:
``run_gpuguard`` leaves the exit status to the caller (``check=False``), ``run_python_json``
raises on a non-zero one, and a run past its timeout raises.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def run_python_json(*args: str, wrapper: Sequence[str] = (), timeout: float = 60) -> Any:
    """``WRAPPER python ARGS`` (``-c SCRIPT …`` or ``-m MODULE …``) with this checkout first on
    ``PYTHONPATH`` and no bytecode written; its stdout read as JSON. Raises ``RuntimeError`` with
    the tail of its stderr when it exits non-zero."""
    out = subprocess.run(
        [*wrapper, sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{[*wrapper, *args][:4]} exited {out.returncode}:\n{out.stderr[-4000:]}"
        )
    return json.loads(out.stdout)
