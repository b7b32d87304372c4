"""The dashboard's Go checker (``dashboards/validate``): the ``validator`` fixture builds it once
(``scripts/ensure-dashboard-validator.sh``, cached under ``~/.cache``) and ``validate`` runs it.

Registered for every test through ``tests/conftest.py``. Without Go the fixture skips locally
and fails in CI (``rigs.prereq.require``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rigs.prereq import require

ENSURE = Path(__file__).resolve().parents[1] / "scripts" / "ensure-dashboard-validator.sh"


@pytest.fixture(scope="module")
def validator() -> Path:
    """The checker's binary, built on demand (once per module; the script caches it)."""
    have_go = shutil.which("go") is not None or Path("/usr/local/go/bin/go").exists()
    require(have_go, "go not found: cannot build the dashboard validator (dashboards/validate)")
    run = subprocess.run(
        ["bash", str(ENSURE)], capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, f"ensure-dashboard-validator.sh failed:\n{run.stderr}"
    binary = Path(run.stdout.strip().splitlines()[-1])
    assert binary.is_file(), binary
    return binary


def validate(validator: Path, path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run the checker on the dashboard at ``path`` with ``flags`` (``-queries`` lists them)."""
    return subprocess.run(
        [str(validator), *flags, str(path)], capture_output=True, text=True, timeout=60, check=False
    )
