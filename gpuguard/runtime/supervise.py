"""Start-up supervision of the background sources (the API server's watches, the Event sink).

Owns one rule: a permanent problem (RBAC denies a verb) before the sources are healthy stops the
process with one clear message, because the permission is missing from the start. After that a
403 is a passing state (an API server restarting with a cold RBAC cache, a binding being
replaced): the directory keeps retrying, its cache goes stale and ``decide()`` pauses
enforcement, so exiting would only lose the enforcer's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from gpuguard.errors import PermanentError
from gpuguard.ports import Lifecycle

HEALTHY_CHECKS = 2
"""Synced with no problem at this many checks in a row: started (so a list allowed but a watch
denied right after it still stops the process)."""


async def fail_on_start_problems(
    synced: Callable[[], bool],
    sources: Sequence[Lifecycle],
    stop: asyncio.Event,
    *,
    interval_seconds: float = 1.0,
) -> None:
    """Raise the first ``PermanentError`` a source reports before ``synced()`` (the enforcer:
    pods listed and the Node seen; the agent: every source read once) held and stayed healthy;
    then wait for ``stop``. ``synced`` must not block."""
    healthy = 0
    while not stop.is_set() and healthy < HEALTHY_CHECKS:
        for source in sources:
            problem = source.problem()
            if isinstance(problem, PermanentError):
                raise problem
        healthy = healthy + 1 if synced() else 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_seconds)
    await stop.wait()
