"""The no-silent-skip rule, importable without pytest's conftest machinery (the rigs, the
benchmarks and the scripts use it too).

``require(condition, why)`` skips a test whose prerequisite (root, a writable cgroup hierarchy,
a built binary) is missing, except in CI (``CI=true``), where a missing prerequisite fails the
test: CI must run everything. pytest is imported only when a prerequisite is missing, so a rig
that calls ``require`` imports on a machine without pytest (a GPU node running a benchmark).
"""

from __future__ import annotations

import os

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, why: str) -> None:
    """Skip (locally) or fail (in CI) when a test's prerequisite is missing."""
    if condition:
        return
    import pytest

    if IN_CI:
        pytest.fail(f"prerequisite missing in CI (skips are failures there): {why}")
    pytest.skip(why)
