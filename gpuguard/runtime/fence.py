"""The agent's start: its admission fence checked before it writes anything.

Owns ``FenceGate``: until a dry-run write the fence must refuse is refused (``ports.FenceProbe``),
the agent does not start its turns (no Node patch, no eviction, no Event), ``/readyz`` says why,
and the check is tried again with backoff (1, 2, 4 … ``FENCE_RETRY_MAX_SECONDS``). This closes the
seconds after an install when Helm has created the DaemonSets but the ValidatingAdmissionPolicy
is not yet there or not yet active, and a cluster where it never is. Must not write anything.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from gpuguard.errors import FenceMissing, GpuguardError
from gpuguard.ports import FenceProbe

log = structlog.get_logger(__name__)

FENCE_RETRY_FIRST_SECONDS = 1.0
FENCE_RETRY_MAX_SECONDS = 30.0


class FenceGate:
    """``wait(stop)`` returns ``True`` once the fence is in force (``False`` if stopped first);
    ``ready()`` is ``/readyz`` until then."""

    def __init__(
        self,
        probe: FenceProbe,
        *,
        first_retry_seconds: float = FENCE_RETRY_FIRST_SECONDS,
        max_retry_seconds: float = FENCE_RETRY_MAX_SECONDS,
    ) -> None:
        self._probe = probe
        self._first = first_retry_seconds
        self._max = max_retry_seconds
        self._passed = False
        self._why = "checking that the admission fence is in force before the first write"

    @property
    def passed(self) -> bool:
        return self._passed

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self._passed else (False, self._why)

    async def wait(self, stop: asyncio.Event) -> bool:
        delay = self._first
        while not stop.is_set():
            try:
                await asyncio.to_thread(self._probe.check_fence)
            except FenceMissing as exc:
                self._why = str(exc)
                log.error("agent_fence_missing", detail=str(exc), retry_seconds=delay)
            except GpuguardError as exc:
                self._why = f"cannot check that the admission fence is in force: {exc}"
                log.warning("agent_fence_check_failed", error=str(exc), retry_seconds=delay)
            else:
                self._passed = True
                log.info("agent_fence_in_force")
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            delay = min(delay * 2, self._max)
        return False
