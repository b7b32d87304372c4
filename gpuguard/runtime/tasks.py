"""Named, guarded asyncio tasks: if one fails or exits, all stop and the error surfaces.

Owns ``run_all``. The only place (with per-item isolation in the enforcer) where a broad
``except Exception`` is allowed: it logs with the task's name and re-raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import structlog

log = structlog.get_logger(__name__)


async def guarded(name: str, factory: Callable[[], Awaitable[None]]) -> None:
    """Run one eternal task; log its failure by name and re-raise."""
    try:
        await factory()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("task_failed", task=name)
        raise
    log.info("task_exited", task=name)


async def run_all(tasks: Mapping[str, Callable[[], Awaitable[None]]], stop: asyncio.Event) -> None:
    """Run every task until ``stop`` is set or one of them ends; then cancel the rest.

    Raises the first task's exception, if any failed.
    """
    async with asyncio.TaskGroup() as group:
        running = [group.create_task(guarded(n, f), name=n) for n, f in tasks.items()]
        waiter = group.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([*running, waiter], return_when=asyncio.FIRST_COMPLETED)
        for task in [*running, waiter]:
            if task not in done:
                task.cancel()
