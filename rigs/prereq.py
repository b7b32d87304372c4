"""The no-silent-skip rule, importable without pytest's conftest machinery (scripts use it too).

``require(condition, why)`` skips a test whose prerequisite (root, a writable cgroup hierarchy,
a built binary) is missing, except in CI (``CI=true``), where a missing prerequisite fails the
test: CI must run everything.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, why: str) -> None:
    """Skip (locally) or fail (in CI) when a test's prerequisite is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing in CI (skips are failures there): {why}")
    pytest.skip(why)
