"""What the enforcer counts for a stop, read from a real registry: nothing counted twice.

Covers: a group of pods holding a DRA claim together, stopped through SIGKILL, counts one kill per
container in ``gpuguard_kills_total`` (the group's violation is tracked under the group's key,
not under the pods it stops); a killer call past its timeout is counted once, as the
``signal_failed`` refusal at its timeout, whatever its late report says (delivered, refused,
raised): the report is logged and its Event posted, never counted again
(docs/design.md, Safety invariants: every stop attempt ends as exactly one of acted, refused or
error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from structlog.testing import capture_logs

from gpuguard.core.model import (
    Declaration,
    DraShare,
    EventReason,
    KillTarget,
    LimitPolicy,
    LimitSource,
    Pod,
    ProcessIdentity,
    RefusalReason,
    SignalRefusal,
    SignalReport,
    StopSignal,
)
from tests.enforcer_world import G0, POLICY, World
from tests.fakes import GiB, attr, cid, pod, proc

SHARED = DraShare(
    claim_namespace="team", claim_name="shared", request="gpu", driver="gpu.nvidia.com",
    pool="node-1", device="gpu-0", share_id="s1", memory_bytes=4 * GiB, uuid=G0.uuid,
)  # fmt: skip
"""One 4Gi share of G0 that one claim reserves for several pods."""


def sharer(n: int) -> Pod:
    """Pod ``n`` holding ``SHARED`` (its claims read long after any violation is due)."""
    declared = {LimitSource.DRA: Declaration(where="claims", shares=(SHARED,), read_at=1e9)}
    return dataclasses.replace(pod(n), declared=declared)


async def test_a_shared_claims_group_stopped_through_sigkill_counts_one_kill_per_container() -> (
    None
):
    # 3 + 3 + 2 GiB over the 4Gi they share, each within it alone: pod-1 and pod-2 (the largest,
    # ties by name) are stopped until what is left fits. They ignore SIGTERM: SIGKILL follows.
    policy = dataclasses.replace(POLICY, limits=LimitPolicy(sources=("gpuguard", "dra")))
    w = World(policy=policy, prometheus=True)
    w.pods.pods = [sharer(n) for n in (1, 2, 3)]
    w.resolver.attributions[301] = attr(301, pod_n=3)
    w.killer.members[cid(30)] = [ProcessIdentity(pid=301, start_ticks=1000)]
    w.gpu.processes = [proc(101, G0, 3 * GiB), proc(201, G0, 3 * GiB), proc(301, G0, 2 * GiB)]
    await w.run(16)
    assert sorted((t.pod.name, s.value) for t, s in w.killer.calls) == [
        ("pod-1", "SIGKILL"), ("pod-1", "SIGTERM"), ("pod-2", "SIGKILL"), ("pod-2", "SIGTERM"),
    ]  # fmt: skip
    assert all(t.shared is not None for t, _ in w.killer.calls), "the group's stop"
    get = w.registry.get_sample_value
    assert get("gpuguard_kills_total") == 2.0, "one per container, SIGTERM and SIGKILL alike"
    assert get("gpuguard_violations_total", {"trigger": "grace"}) == 1.0


LATE_EVENT = {
    "delivered": "container_signalled",
    "refused": "signal_refused",
    "raised": "signal_failed",
}
"""The log line that says the late call's report was handled, by what it says."""


@pytest.mark.parametrize("late", list(LATE_EVENT))
async def test_a_killer_call_past_its_timeout_is_counted_once_whatever_its_late_report_says(
    late: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(prometheus=True, gpu_timeout_seconds=0.3, kill_wait_seconds=0.0)
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    release = threading.Event()
    real = w.killer.signal_container

    def signal_container(
        target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        if w.killer.calls:  # every call after the first returns at once
            return real(target, signal, wait_seconds=wait_seconds)
        report = real(target, signal, wait_seconds=wait_seconds)
        release.wait(30)
        if late == "raised":
            raise OSError("pidfd_send_signal: the call failed after its timeout")
        if late == "refused":
            refusal = SignalRefusal(pid=101, reason=RefusalReason.PERMISSION_DENIED)
            return SignalReport(signal=signal, refused=(refusal,))
        return report

    monkeypatch.setattr(w.killer, "signal_container", signal_container)
    get = w.registry.get_sample_value

    def refused(reason: RefusalReason) -> float | None:
        return get("gpuguard_refusals_total", {"reason": reason.value})

    try:
        with capture_logs() as logs:
            await asyncio.wait_for(w.run(4), timeout=10)  # the SIGTERM step, at the third
            assert [s for _, s in w.killer.calls] == [StopSignal.TERM]
            assert [e["event"] for e in logs if e["event"] == "signal_timeout"] == [
                "signal_timeout"
            ]
            assert refused(RefusalReason.SIGNAL_FAILED) == 1.0
            release.set()
            for _ in range(250):
                if any(e["event"] == LATE_EVENT[late] for e in logs):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the late call's report was never handled")
    finally:
        release.set()
    # The attempt was counted once, at its timeout: its late report is logged, not counted.
    assert refused(RefusalReason.SIGNAL_FAILED) == 1.0
    assert refused(RefusalReason.PERMISSION_DENIED) == 0.0
    assert get("gpuguard_kills_total") == 0.0
    assert [e["pod"] for e in logs if e["event"] == "signal_ended_late"] == ["pod-1"]
    killed = [e for e in w.events.events if e.reason is EventReason.PROCESS_KILLED]
    assert len(killed) == (1 if late == "delivered" else 0), "the tenant is told what it got"

    # The SIGKILL step, in time: the container's stop is counted by the step that acted in time.
    await w.run(6)
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM, StopSignal.KILL]
    assert get("gpuguard_kills_total") == 1.0
    assert refused(RefusalReason.SIGNAL_FAILED) == 1.0
    assert refused(RefusalReason.PERMISSION_DENIED) == 0.0
