"""Named, guarded asyncio tasks: if one fails or exits, all stop and the error surfaces.

Owns ``run_all``. The only place (with per-item isolation in the enforcer) where a broad
``except Exception`` is allowed: it logs with the task's name and re-raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import structlog

from gpuguard.errors import TaskEnded

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

    A task's exception reaches the caller as itself (not wrapped in an ``ExceptionGroup``, so a
    ``PermanentError`` exits with its own message). The tasks are eternal: one that returns
    while ``stop`` is not set is an error (``TaskEnded``), never a quiet exit 0.
    """
    running = {asyncio.create_task(guarded(n, f), name=n): n for n, f in tasks.items()}
    waiter = asyncio.create_task(stop.wait(), name="stop")
    try:
        done, _ = await asyncio.wait([*running, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in [*running, waiter]:
            task.cancel()
        await asyncio.gather(*running, waiter, return_exceptions=True)
    for task, name in running.items():
        if task in done and not task.cancelled():
            error = task.exception()
            if error is not None:
                raise error
            if not stop.is_set():
                raise TaskEnded(f"task {name} ended on its own; it must run until stopped")
