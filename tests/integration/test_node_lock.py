"""Two real ``gpuguard enforce`` processes on one node (docs/reliability.md R3): the same pods in
the real API server, the same NVML stand-in, the same real kubepods cgroups and processes, and
one node lock file. Only the lock's holder acts; the other serves metrics, is not ready, and
signals, posts and counts nothing until the holder is gone, even by SIGKILL.
"""

from __future__ import annotations

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def test_a_second_enforcer_stands_by_until_the_first_is_sigkilled_then_stops_an_offender(
    rig: Rig,
) -> None:
    lock_file = str(rig.dir / "enforcer.lock")
    calm = rig.spawn(rig.add_pod("modest", limit="4Gi"), "calm", used_bytes=1 * GIB)
    first = rig.start_enforcer()
    wait_until(lambda: first.ready()[0], timeout=30, what="the first enforcer to be ready")
    second = rig.start_enforcer()

    standby = second.wait_for("enforcement_standby", timeout=30)
    assert (standby["lock_file"], standby["holder_pid"]) == (lock_file, first.proc.pid)
    held_by_first = f"not ready: lock_held: {lock_file} is held by PID {first.proc.pid}"
    wait_until(lambda: second.ready() == (False, held_by_first), timeout=10, what="not ready")
    assert second.metric("gpuguard_refusals_total", {"reason": "lock_held"}) == 1.0

    # While the first runs, an offender is stopped once, by the first alone.
    greedy = rig.add_pod("greedy", limit="1Gi")
    worker = rig.spawn(greedy, "greedy", used_bytes=2 * GIB)
    wait_until(lambda: not worker.alive(), timeout=30, what="the first to stop the offender")
    assert worker.received() == ["SIGTERM"]
    assert len(first.settled_events("container_signalled", 1)) == 1
    assert second.events("container_signalled") == []
    assert second.events("would_stop_container") == []
    assert second.events("violation_refused") == []
    assert second.metric("gpuguard_violations_total", {"trigger": "grace"}) == 0.0
    assert second.metric("gpuguard_kills_total") == 0.0
    assert second.ready() == (False, held_by_first)
    assert first.metric("gpuguard_kills_total") == 1.0

    # The holder is SIGKILLed (by its PID, ours): the kernel frees the lock and the second
    # takes over without a restart.
    first.proc.kill()
    first.proc.wait()
    second.wait_for("enforcement_lock_acquired", timeout=20)
    wait_until(lambda: second.ready() == (True, "ok"), timeout=20, what="the second ready")

    late = rig.add_pod("greedy-late", limit="1Gi")
    offender = rig.spawn(late, "greedy-late", used_bytes=2 * GIB)
    wait_until(lambda: not offender.alive(), timeout=30, what="the second to stop the offender")
    assert offender.received() == ["SIGTERM"]
    signalled = second.settled_events("container_signalled", 1)
    assert [(e["signal"], e["pod"]) for e in signalled] == [("SIGTERM", "greedy-late")]
    assert calm.received() == []
    assert calm.alive()
    assert second.stop() == 0
