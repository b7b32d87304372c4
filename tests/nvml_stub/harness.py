"""Test harness for the NVML stand-in: build it once, write scenarios atomically.

Owns building ``tests/nvml_stub/build/libnvidia-ml.so.1`` and writing scenario files. Must not
load the library itself: callers pass ``STUB_LIB`` to ``NvmlGpuSource(library_path=...)`` or put
its directory on ``LD_LIBRARY_PATH`` of a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.prereq import require

STUB_DIR = Path(__file__).resolve().parent
STUB_LIB = STUB_DIR / "build" / "libnvidia-ml.so.1"
SCENARIO_ENV = "NVML_STUB_SCENARIO"

_build_lock = threading.Lock()


def build_stub() -> Path:
    """``make -C tests/nvml_stub`` (a no-op when up to date); skips, or fails in CI, without a
    compiler or make."""
    require(shutil.which("make") is not None, "make is not installed")
    require(shutil.which(os.environ.get("CC", "gcc")) is not None, "no C compiler (gcc)")
    with _build_lock:
        done = subprocess.run(
            ["make", "-s", "-C", str(STUB_DIR)], capture_output=True, text=True, check=False
        )
    assert done.returncode == 0, f"building the NVML stand-in failed:\n{done.stdout}{done.stderr}"
    return STUB_LIB


class Scenario:
    """The scenario file the stand-in reads; each write replaces it (new inode), so the library
    sees the change on its next call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, self.path)
