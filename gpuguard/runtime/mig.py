"""Follows the node's MIG config state and releases or re-acquires NVML (``core.mig``'s rule).

Owns the loop only: reads ``NodeState`` (non-blocking) once a second, calls the GPU source's
blocking ``release``/``acquire`` off the event loop. A failed toggle is logged and tried again on
the next turn, never fatal: a stuck sample or a driver that is not back yet is expected during a
reconfiguration.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from gpuguard.core.mig import nvml_released_during
from gpuguard.errors import GpuguardError
from gpuguard.ports import GpuRelease, NodeState

log = structlog.get_logger(__name__)


async def follow_mig_state(
    node: NodeState, gpu: GpuRelease, stop: asyncio.Event, *, interval_seconds: float = 1.0
) -> None:
    """Until ``stop``: release NVML while mig-manager reconfigures, acquire it again after."""
    while not stop.is_set():
        state = node.node().mig_config_state
        release = nvml_released_during(state)
        try:
            if release and not gpu.released:
                log.warning("mig_reconfiguration_pause", state=state)
                await asyncio.to_thread(gpu.release)
            elif not release and gpu.released:
                log.info("mig_reconfiguration_resume", state=state)
                await asyncio.to_thread(gpu.acquire)
        except GpuguardError as exc:  # a stuck sample or a failed re-init: next turn
            log.warning("mig_pause_toggle_failed", state=state, error=str(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_seconds)
