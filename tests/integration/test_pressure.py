"""Device pressure end to end: ``gpuguard enforce`` over the NVML stand-in, real
processes in real kubepods cgroups and the real kube-apiserver. When a GPU is nearly full, a
pod over its limit on it is stopped without waiting out the grace period (two fresh listings
still), and the Event, the log line and ``gpuguard_violations_total{trigger}`` say ``pressure``;
with room on the GPU the same pod waits out its grace. Neighbours under their limits are never
touched, however full the GPU.
"""

from __future__ import annotations

import time

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, EnforcerProcess, PodInfo, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

GRACE = 30.0  # far longer than any test waits: only pressure can stop the pod in time


def _enforcer_seeing(rig: Rig, greedy: PodInfo) -> tuple[EnforcerProcess, dict[str, str]]:
    """An enforcer with pressure at 5 % free, once its metrics show ``greedy`` at 1 GiB; and the
    labels of ``greedy``'s samples."""
    enforcer = rig.start_enforcer(grace_seconds=GRACE, pressure_free_fraction=0.05)
    labels = {"namespace": greedy.namespace, "pod": "greedy"}
    wait_until(
        lambda: enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", labels) == 1 * GIB,
        timeout=20,
        what="the greedy pod's usage in the metrics",
    )
    return enforcer, labels


def test_a_pod_over_its_limit_on_a_nearly_full_gpu_is_stopped_without_the_grace_period(
    rig: Rig,
) -> None:
    greedy = rig.add_pod("greedy", limit="2Gi")
    big = rig.add_pod("big", limit="76Gi")
    modest = rig.add_pod("modest", limit="4Gi")
    g = rig.spawn(greedy, "greedy", used_bytes=1 * GIB)
    b = rig.spawn(big, "big", used_bytes=73 * GIB)  # within its own limit
    m = rig.spawn(modest, "modest", used_bytes=3 * GIB)
    host = rig.spawn(None, "host", used_bytes=1 * GIB)
    # 78 of 80 GiB used: 2.5 % free, under pressure, and nobody over a limit yet.
    enforcer, _ = _enforcer_seeing(rig, greedy)
    time.sleep(0.5)  # many fast reads and listings of a full GPU: nobody is over a limit
    assert [w.received() for w in (g, b, m, host)] == [[], [], [], []]

    crossed = time.monotonic()
    rig.set_usage(g, 3 * GIB)  # past its 2 GiB limit; the GPU is now completely full
    wait_until(lambda: g.received() == ["SIGTERM"], timeout=10, what="SIGTERM under pressure")
    took = time.monotonic() - crossed
    assert took < GRACE / 3, f"took {took:.1f} s: the grace period was not skipped"

    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["trigger"], signalled["pids"]) == (
        "greedy",
        "pressure",
        [g.pid],
    )
    assert enforcer.metric("gpuguard_violations_total", {"trigger": "pressure"}) == 1.0
    assert enforcer.metric("gpuguard_violations_total", {"trigger": "grace"}) == 0.0
    wait_until(
        lambda: any(
            "memory pressure" in (e.get("message") or e.get("note") or "")
            for e in rig.pod_events(greedy)
        ),
        timeout=20,
        what="a GPUMemoryLimitExceeded Event that says pressure",
    )
    for bystander in (b, m, host):
        assert bystander.received() == []
        assert bystander.alive()


def test_with_room_on_the_gpu_the_same_pod_waits_out_its_grace_period(rig: Rig) -> None:
    greedy = rig.add_pod("greedy", limit="2Gi")
    g = rig.spawn(greedy, "greedy", used_bytes=1 * GIB)
    enforcer, labels = _enforcer_seeing(rig, greedy)
    rig.set_usage(g, 3 * GIB)  # over its limit, with 77 GiB free
    wait_until(
        lambda: enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", labels) == 3 * GIB,
        timeout=10,
        what="the crossing to be listed",
    )
    time.sleep(3.0)  # dozens of fast reads and several listings, all over the limit
    assert g.received() == []
    assert enforcer.events("container_signalled") == []
    assert enforcer.metric("gpuguard_violations_total", {"trigger": "pressure"}) == 0.0
