"""Fixtures for kernel tests: a ``cgroup_tree`` that is always torn down, even on failure.

Owns fixtures only; the tree itself is ``rigs.cgroups.CgroupTree``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rigs.cgroups import CgroupTree, require_kernel


@pytest.fixture
def cgroup_tree() -> Iterator[CgroupTree]:
    """A fresh tree under a unique root in v1 ``pids`` and v2 ``unified``; skips (fails in CI)
    when not root or the hierarchies are not writable."""
    require_kernel()
    tree = CgroupTree()
    try:
        yield tree
    finally:
        tree.close()
