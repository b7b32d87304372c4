"""``runtime.fence.FenceGate``: the agent's turns wait for its admission fence (a fake probe
above the port; the real probe and process run on the real API server in
tests/kube/test_agent_fence_check.py and tests/kube/test_admission_fence.py)."""

from __future__ import annotations

import asyncio

from gpuguard.errors import FenceMissing, KubeError
from gpuguard.runtime.fence import FenceGate


class FakeFenceProbe:
    """Raises each of ``answers`` in turn (``None``: the fence refused the dry run), then
    ``None`` for ever."""

    def __init__(self, *answers: Exception | None) -> None:
        self.answers = list(answers)
        self.checks = 0

    def check_fence(self) -> None:
        self.checks += 1
        if self.answers:
            answer = self.answers.pop(0)
            if answer is not None:
                raise answer


def test_the_gate_opens_only_once_the_fence_refuses_and_says_why_until_then() -> None:
    probe = FakeFenceProbe(FenceMissing("allowed: not in force"), KubeError("503"), None)
    gate = FenceGate(probe, first_retry_seconds=0.01, max_retry_seconds=0.02)
    assert gate.ready() == (
        False,
        "checking that the admission fence is in force before the first write",
    )
    seen: list[tuple[bool, str]] = []

    async def main() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(gate.wait(stop))
        while not task.done():
            seen.append(gate.ready())
            await asyncio.sleep(0.001)
        return await task

    assert asyncio.run(main()) is True
    assert probe.checks == 3
    assert (False, "allowed: not in force") in seen
    assert (False, "cannot check that the admission fence is in force: 503") in seen
    assert gate.passed
    assert gate.ready() == (True, "")


def test_a_stopped_gate_returns_false_without_opening() -> None:
    probe = FakeFenceProbe(*[FenceMissing("no")] * 100)
    gate = FenceGate(probe, first_retry_seconds=0.01, max_retry_seconds=0.01)

    async def main() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(gate.wait(stop))
        await asyncio.sleep(0.05)
        stop.set()
        return await task

    assert asyncio.run(main()) is False
    assert not gate.passed
    assert 2 <= probe.checks < 100
