"""The provenance header every raw output of a benchmark or GPU script starts with: the commit
that ran and whether its tree was dirty, the machine (CPU model and count, memory, kernel, OS;
not its host name, which names a lent machine no reader can find), the GPU driver, the command
and the time in UTC. A figure copied into a doc is traced through it to the code that printed it.

Standard library only at import (``pynvml`` is imported when the driver is read): the GPU
scripts run on a node with only their own dependencies.

Must not: change anything (it only reads ``git``, ``/proc``, ``/etc/os-release`` and NVML), or
fail: a fact it cannot read is ``unknown``, never an exception.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMIT_VARIABLES = ("GPUGUARD_COMMIT", "GPU_E2E_COMMIT")
"""Where a tree without ``.git`` (the GPU machine gets a copy of the working tree, or a ``git
archive``) is told which commit it is; the copy's maker sets one of them."""


def _git(*args: str, repo: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def commit(repo: Path = REPO) -> tuple[str, str]:
    """The commit that runs and whether its tree was dirty (``yes``, ``no`` or why it is not
    known): ``$GPUGUARD_COMMIT`` or ``$GPU_E2E_COMMIT`` when the copy's maker set one (a copy of
    a working tree can carry a ``.git`` of another commit: the GPU machine's did, naming a
    commit a session older), else ``git rev-parse HEAD`` and ``git status --porcelain`` (any
    line, untracked files included: an untracked module runs too) in a checkout."""
    for name in COMMIT_VARIABLES:
        if named := os.environ.get(name, "").strip():
            return named, f"unknown (${name} names the tree; a copy's .git is not read)"
    if (repo / ".git").exists() and (head := _git("rev-parse", "HEAD", repo=repo)):
        status = _git("status", "--porcelain", repo=repo)
        dirty = "unknown" if status is None else "yes" if status.strip() else "no"
        return head.strip(), dirty
    return "unknown", "unknown (no .git, no $GPUGUARD_COMMIT)"


def _first(path: str, key: str) -> str | None:
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        name, sep, value = line.partition(":" if ":" in line else "=")
        if sep and name.strip() == key:
            return value.strip().strip('"')
    return None


def machine() -> str:
    """CPU model and count, memory, kernel and OS, in one line."""
    model = _first("/proc/cpuinfo", "model name") or platform.processor() or "unknown CPU"
    memory = _first("/proc/meminfo", "MemTotal")
    gib = f"{int(memory.split()[0]) / (1 << 20):.1f} GiB memory" if memory else "memory unknown"
    system = _first("/etc/os-release", "PRETTY_NAME") or "OS unknown"
    return (
        f"{model}, {os.cpu_count()} logical CPUs, {gib}, kernel {platform.release()} "
        f"{platform.machine()}, {system}"
    )


def gpu_driver() -> str:
    """The driver's version and the GPUs NVML sees, or ``none`` (no NVML library, or no GPU)."""
    try:
        import pynvml
    except ImportError:
        return "none (no nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no libnvidia-ml, no driver: no GPU here
        return f"none ({type(exc).__name__})"
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    except pynvml.NVMLError as exc:
        return f"unknown ({type(exc).__name__})"
    finally:
        pynvml.nvmlShutdown()
    if not names:
        return f"none (driver {version}, no GPU)"
    return f"{version}, {len(names)} × {', '.join(sorted(set(map(str, names))))}"


def command() -> str:
    """The command line as run: the interpreter, ``-m`` and the module when it was run as one,
    and ``sys.argv``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return shlex.join([sys.executable, *program])


def header_lines(*, prefix: str = "# ", repo: Path = REPO) -> list[str]:
    """The provenance header: one ``<prefix>key: value`` line per fact, in a fixed order."""
    head, dirty = commit(repo)
    facts = {
        "commit": head,
        "dirty": dirty,
        "machine": machine(),
        "gpu driver": gpu_driver(),
        "command": command(),
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    return [f"{prefix}{key}: {value}" for key, value in facts.items()]


def header() -> dict[str, str]:
    """The header as a mapping, for a JSON raw output's ``provenance`` key."""
    return dict(line.removeprefix("# ").split(": ", 1) for line in header_lines())
