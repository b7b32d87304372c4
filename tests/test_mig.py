"""runtime.mig over fakes: NVML is released while mig-manager reconfigures, and only then."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from gpuguard.core.mig import nvml_released_during
from gpuguard.core.model import GpuSample, NodeFacts
from gpuguard.errors import GpuSourceUnavailable
from gpuguard.ports import GpuRelease, NodeState
from gpuguard.runtime.mig import follow_mig_state


@pytest.mark.parametrize(
    ("state", "released"),
    [("pending", True), ("rebooting", True), ("success", False), ("failed", False),
     (None, False), ("", False), ("Pending", False)],
)  # fmt: skip
def test_nvml_is_released_only_while_mig_manager_reconfigures(
    state: str | None, released: bool
) -> None:
    assert nvml_released_during(state) is released


@dataclass
class _Node:
    state: str | None = None

    def node(self) -> NodeFacts:
        return NodeFacts(name="n", mig_config_state=self.state)


@dataclass
class _Gpu:
    released: bool = False
    calls: list[str] = field(default_factory=list)
    fail_acquire: int = 0

    def sample(self) -> GpuSample:
        raise AssertionError("not sampled here")

    def release(self) -> None:
        self.calls.append("release")
        self.released = True

    def acquire(self) -> None:
        self.calls.append("acquire")
        if self.fail_acquire:
            self.fail_acquire -= 1
            raise GpuSourceUnavailable("driver not back yet")
        self.released = False


_: NodeState = _Node()
__: GpuRelease = _Gpu()


async def test_release_during_reconfiguration_and_acquire_after_retrying_a_failed_init() -> None:
    node, gpu, stop = _Node("success"), _Gpu(fail_acquire=1), asyncio.Event()
    task = asyncio.create_task(follow_mig_state(node, gpu, stop, interval_seconds=0.01))
    await asyncio.sleep(0.05)
    assert gpu.calls == []
    node.state = "pending"
    await asyncio.sleep(0.05)
    assert gpu.calls == ["release"]
    node.state = "rebooting"
    await asyncio.sleep(0.05)
    assert gpu.calls == ["release"]
    node.state = "success"
    await asyncio.sleep(0.1)
    assert gpu.calls == ["release", "acquire", "acquire"]  # the first re-init failed: retried
    assert not gpu.released
    stop.set()
    await asyncio.wait_for(task, timeout=1)
