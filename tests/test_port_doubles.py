"""The two worlds of doubles keep the ports' promises alike: ``tests.fakes`` (unit tests) and
``gpuguard.sim`` (the demo's simulated node) run the same checks through the enforcer's ports.

The type checker holds each double to its port's signatures (``tests/fakes.py`` and the end of
``gpuguard/sim/node.py``); these hold them to its behaviour, as the enforcer relies on it and the
real adapters do it: a sample is stamped with the clock and names only devices it lists; a
container's process is attributed exactly as the kernel's ``/proc/<pid>/cgroup`` line for its
cgroup reads (``core.cgroup``, what ``ProcfsResolver`` parses); a PID nobody knows is an answer,
never an exception; the pod directory is synced and in contact now; a signal reaches the target
container's members and nobody else's; Events are kept in the order posted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from gpuguard import ports
from gpuguard.core.cgroup import parse_cgroup
from gpuguard.core.model import (
    EventReason,
    GpuDevice,
    PodEvent,
    PodRef,
    ProcessIdentity,
    Runtime,
    StopSignal,
)
from gpuguard.sim.node import SimNode, SimProcess, steady
from tests.fakes import (
    FakeClock,
    FakeEventSink,
    FakeGpuSource,
    FakeKiller,
    FakePodDirectory,
    FakeResolver,
    GiB,
    attr,
    cid,
    gpu,
    kill_target,
    pod,
    proc,
    uid,
)

USED = {101: 5 * GiB, 201: 3 * GiB, 301: 1 * GiB}
"""Pod 1's container 10 runs PID 101, pod 2's container 20 PID 201; 301 is a host process."""
CONTAINERS = {101: (1, 10), 201: (2, 20)}


@dataclass(frozen=True)
class Node:
    """One world's doubles of the enforcer's node ports, read through the ports only."""

    clock: FakeClock
    device: GpuDevice
    gpu: ports.GpuSource
    resolver: ports.ProcessResolver
    directory: ports.NodeDirectory
    killer: ports.Killer
    events: ports.EventSink
    posted: Callable[[], list[PodEvent]]


def fake_node() -> Node:
    clock, g0 = FakeClock(), gpu(0)
    events = FakeEventSink()
    return Node(
        clock=clock,
        device=g0,
        gpu=FakeGpuSource(
            clock=clock, devices=[g0], processes=[proc(p, g0, used) for p, used in USED.items()]
        ),
        resolver=FakeResolver(
            {
                **{p: attr(p, pod_n=n) for p, (n, _) in CONTAINERS.items()},
                301: attr(301, pod_n=None),
            }
        ),
        directory=FakePodDirectory(clock=clock, pods=[pod(1), pod(2)]),
        killer=FakeKiller(
            members={
                cid(c): [ProcessIdentity(pid=p, start_ticks=1000)]
                for p, (_, c) in CONTAINERS.items()
            }
        ),
        events=events,
        posted=lambda: events.events,
    )


def sim_node() -> Node:
    clock, g0 = FakeClock(), gpu(0)
    node = SimNode(clock=clock, node_name="node-1", gpus=[g0])
    for p in (pod(1), pod(2)):
        node.add_pod(p)
    for pid, used in USED.items():
        n, c = CONTAINERS.get(pid, (None, None))
        node.add_process(
            SimProcess(
                pid=pid,
                start_ticks=1000,
                gpu=0,
                usage=steady(used),
                pod_uid=uid(n) if n is not None else None,
                container_id=cid(c) if c is not None else None,
            )
        )
    return Node(
        clock=clock,
        device=g0,
        gpu=node,
        resolver=node,
        directory=node,
        killer=node,
        events=node,
        posted=lambda: node.events,
    )


@pytest.fixture(params=[fake_node, sim_node], ids=["fakes", "sim"])
def node(request: pytest.FixtureRequest) -> Node:
    build: Callable[[], Node] = request.param
    return build()


def test_a_sample_is_stamped_with_the_clock_and_names_only_listed_devices(node: Node) -> None:
    first = node.gpu.sample()
    node.clock.advance(1.5)
    second = node.gpu.sample()
    assert second.seq > first.seq
    assert second.taken_at == node.clock.monotonic()
    assert second.devices == (node.device,)
    assert {p.device for p in second.processes} <= {d.key for d in second.devices}
    assert {p.pid: p.used_bytes for p in second.processes} == USED


@pytest.mark.parametrize("pid", sorted(CONTAINERS))
def test_a_container_process_is_attributed_as_its_kernel_cgroup_line_reads(
    node: Node, pid: int
) -> None:
    n, c = CONTAINERS[pid]
    got = node.resolver.attribute(pid)
    assert got.identity == ProcessIdentity(pid=pid, start_ticks=1000)
    assert (got.pod_uid, got.container_id, got.runtime) == (uid(n), cid(c), Runtime.CONTAINERD)
    assert got.cgroup is not None
    assert got.reason is None
    read = parse_cgroup(f"0::{got.cgroup.path}\n")
    assert (read.pod_uid, read.container_id, read.runtime, read.cgroup, read.cgroup_version) == (
        got.pod_uid,
        got.container_id,
        got.runtime,
        got.cgroup,
        got.cgroup_version,
    )


@pytest.mark.parametrize("pid", [301, 99999], ids=["host-process", "unknown-pid"])
def test_a_process_of_no_pod_is_an_answer_with_a_reason(node: Node, pid: int) -> None:
    got = node.resolver.attribute(pid)
    assert got.pid == pid
    assert (got.pod_uid, got.container_id, got.cgroup) == (None, None, None)
    assert got.reason


def test_the_pod_directory_is_synced_and_in_contact_now(node: Node) -> None:
    node.clock.advance(2.0)
    snapshot = node.directory.snapshot()
    assert snapshot.synced
    assert snapshot.last_contact_at == node.clock.monotonic()
    assert set(snapshot.pods) == {uid(1), uid(2)}
    assert all(snapshot.pods[key].uid == key for key in snapshot.pods)
    assert node.directory.node().name == "node-1"


@pytest.mark.parametrize("signal", [StopSignal.TERM, StopSignal.KILL])
def test_a_signal_reaches_the_target_containers_members_and_nobody_else(
    node: Node, signal: StopSignal
) -> None:
    report = node.killer.signal_container(kill_target(1, node.device), signal)
    assert report.signal is signal
    assert report.delivered == (ProcessIdentity(pid=101, start_ticks=1000),)
    assert report.refused == ()
    assert report.signal_of(101) is signal


def test_events_are_kept_in_the_order_posted(node: Node) -> None:
    posted = [
        PodEvent(
            pod=PodRef(uid=uid(n), namespace="team", name=f"pod-{n}"),
            reason=reason,
            message=f"{reason.value} on pod-{n}",
        )
        for n, reason in ((1, EventReason.LIMIT_EXCEEDED), (1, EventReason.PROCESS_KILLED))
    ]
    for event in posted:
        node.events.post(event)
    assert node.posted() == posted
