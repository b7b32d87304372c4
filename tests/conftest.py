"""Suite-wide fixtures: leaked-task detection, structlog isolation, and the shared fixtures of
the helper modules (the session API server's, the dashboard checker's), registered once here.

The no-silent-skip rule lives in ``rigs.prereq.require``: a missing prerequisite (root, a
writable cgroup hierarchy, a built binary) skips locally and fails in CI (``CI=true``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _structlog_isolated() -> Iterator[None]:
    """Each test starts from structlog's defaults; nothing cached across tests."""
    structlog.reset_defaults()
    structlog.configure(cache_logger_on_first_use=False)
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
async def _no_leaked_asyncio_tasks() -> object:
    """Fail a test that leaves asyncio tasks running (kopf's ``_no_asyncio_pending_tasks``)."""
    before = asyncio.all_tasks()
    yield
    leaked = [
        t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()
    ]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test leaked asyncio tasks: {[t.get_name() for t in leaked]}"


# Fixtures of the helper modules, defined once here: one session cluster (etcd + kube-apiserver)
# for every folder that needs it, never re-imported by a sub-folder's conftest (that would start a
# second cluster); the dashboard's Go checker, built once per module that asks for it.
from rigs.kubefixtures import (  # noqa: E402, F401
    agent_kubeconfig,
    cluster,
    cluster_without_watch_cache,
    gpuguard_kubeconfig,
    gpuguard_rbac,
    kube_cluster,
    namespace,
    node_name,
    proxy,
)
from tests.dashboard_validator import validator  # noqa: E402, F401
