"""runtime.tasks.run_all: errors reach the caller as themselves; eternal tasks must not end."""

from __future__ import annotations

import asyncio

import pytest

from gpuguard.errors import KubeForbidden, PermanentError, TaskEnded
from gpuguard.runtime.tasks import run_all


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_a_tasks_permanent_error_reaches_the_caller_as_itself() -> None:
    """A TaskGroup wrapped it in an ExceptionGroup, so the CLI's ``except PermanentError``
    never saw it."""
    denied = KubeForbidden("list pods: forbidden")

    async def fails() -> None:
        await asyncio.sleep(0)
        raise denied

    with pytest.raises(PermanentError) as raised:
        await run_all({"watch": fails, "enforce": _forever}, asyncio.Event())
    assert raised.value is denied


async def test_an_eternal_task_that_returns_is_an_error_naming_it() -> None:
    async def returns() -> None:
        await asyncio.sleep(0)

    with pytest.raises(TaskEnded, match="task mig ended on its own"):
        await run_all({"mig": returns, "enforce": _forever}, asyncio.Event())


async def test_stop_ends_every_task_quietly() -> None:
    stop = asyncio.Event()
    cancelled: list[str] = []

    async def worker() -> None:
        try:
            await _forever()
        except asyncio.CancelledError:
            cancelled.append("worker")
            raise

    async def stopper() -> None:
        await asyncio.sleep(0.01)
        stop.set()
        await _forever()

    await run_all({"worker": worker, "stopper": stopper}, stop)
    assert cancelled == ["worker"]
