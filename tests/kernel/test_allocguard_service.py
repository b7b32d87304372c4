"""The allocation guard's runtime side on this kernel: the real probes on the libcuda stand-in
(tests/cuda_stub), real processes in real kubelet-style cgroups, the real /proc resolver and
the real pidfd killer's ``resume``, driven through ``runtime.allocguard.GuardService`` with the
cycle's pod usage given as ``decide()`` reports it.

A frozen caller is taken over from the thawer as it is taken in (the thawer's 200 ms bound
does not resume it mid-decision) and kept until a listing taken after the freeze is decided
on: resumed at once when its pod is not over with the allocation counted, at the enforcer's
own bound when no decision comes; a tenant's own stopped process is never resumed, and a
process not as read when it was frozen is refused; the headroom is written per container
cgroup from the listing.

Every read of a caller's output has a timeout (``AllocCaller.line``): a caller left stopped
fails its test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.adapters.allocguard import AllocGuard, BpfAllocationGuard, cgroup_id
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.metrics import MetricsRegistry, PrometheusGuardRecorder
from gpuguard.adapters.procfs import ProcfsProcessResolver, read_state
from gpuguard.core.freeze import FREEZE_BOUND_SECONDS, FrozenAllocation
from gpuguard.core.model import (
    Attribution,
    ContainerCgroup,
    EnforcementPolicy,
    GpuProcess,
    GpuSample,
    LimitSource,
    Listing,
    Mode,
    PodRef,
    PodUid,
    ProcessIdentity,
    ResolvedLimit,
    SignalRefusal,
)
from gpuguard.core.policy import Decision, EnforcerState, PodUsage, UsageState
from gpuguard.runtime.allocguard import GuardService
from rigs.alloc_caller import AllocCaller, wait_state
from rigs.allocguard import AllocGuardBuild, build
from rigs.cgroups import CgroupTree, cgroup_dir, hierarchy_dir
from rigs.prereq import require
from tests.fakes import FakeClock, gpu

pytestmark = pytest.mark.kernel

MiB = 1 << 20
UID = PodUid("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9")
POLICY = EnforcementPolicy(mode=Mode.ENFORCE)
G0 = gpu(0)


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    return build()


@pytest.fixture
def port(built: AllocGuardBuild) -> Iterator[BpfAllocationGuard]:
    g = BpfAllocationGuard(
        AllocGuard(object_path=built.object_path, library_path=built.stub_library),
        cgroup_root=hierarchy_dir(2, ""),
    )
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def w(cgroup_tree: CgroupTree, port: BpfAllocationGuard, built: AllocGuardBuild) -> Iterator[World]:
    world = World(cgroup_tree, port, built.stub_library)
    yield world
    for caller in world.procs:  # the tree kills the processes
        caller.close()
    world.killer.close()


class World:
    def __init__(self, tree: CgroupTree, port: BpfAllocationGuard, lib: Path) -> None:
        self.tree, self.lib = tree, lib
        self.procs: list[AllocCaller] = []
        self.registry = MetricsRegistry()
        self.killer = PidfdKiller(cgroup_root=hierarchy_dir(2, "").parent, proc_root=Path("/proc"))
        self.clock = FakeClock()
        self.service = GuardService(
            guard=port,
            resolver=ProcfsProcessResolver(Path("/proc")),
            resumer=self.killer,
            recorder=PrometheusGuardRecorder(self.registry),
            clock=self.clock,
            policy=POLICY,
        )
        self.cg = tree.container(
            version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
            container_id="a" * 64,
        )  # fmt: skip

    def spawn(self, cg: ContainerCgroup | None = None) -> AllocCaller:
        caller = AllocCaller(self.tree, cg or self.cg)
        self.procs.append(caller)
        return caller

    def freeze(self, caller: AllocCaller, size_bytes: int) -> None:
        """Start an allocation that crosses the headroom; see its caller stopped at the call."""
        caller.alloc(self.lib, size_bytes)
        assert wait_state(caller.stopped, 5.0) is not None, "the crossing did not freeze"

    def thaws(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "gpuguard_alloc_guard_thaws_total", {"reason": reason}
        )

    def listed(
        self, pids: list[int], *, used: int, limit: int, state: UsageState
    ) -> tuple[Decision, GpuSample, dict[int, Attribution]]:
        """The cycle's output as ``decide()`` gives it: the pod's usage on GPU 0 at a fresh
        listing of it, its processes attributed by the real resolver."""
        resolver = ProcfsProcessResolver(Path("/proc"))
        self.clock.advance(0.001)  # a listing taken after every freeze taken in so far
        sample = GpuSample(
            seq=1,
            taken_at=self.clock.monotonic(),
            devices=(G0,),
            processes=tuple(GpuProcess(pid=p, device=G0.key, used_bytes=used) for p in pids),
            listings={G0.key: Listing(seq=1, taken_at=self.clock.monotonic())},
        )
        usage = PodUsage(
            pod=PodRef(uid=UID, namespace="team", name="p"),
            container=None,
            device=G0,
            used_bytes=used * len(pids),
            unknown_processes=0,
            limit=ResolvedLimit(limit_bytes=limit, source=LimitSource.ANNOTATION),
            state=state,
        )
        attributions = {p: resolver.attribute(p) for p in pids}
        return Decision(state=EnforcerState(), usages=(usage,)), sample, attributions


def state(pid: int) -> str | None:
    return read_state(Path("/proc"), pid)


async def test_a_frozen_caller_whose_pod_is_not_over_is_resumed_at_once_and_counted(
    w: World, port: BpfAllocationGuard
) -> None:
    caller = w.spawn()
    pid = caller.pid
    # The listing: 1 MiB used of a 2 MiB limit → 1 MiB headroom written for the container.
    await w.service.after_cycle(*w.listed([pid], used=1 * MiB, limit=2 * MiB, state=UsageState.OK))
    w.freeze(caller, 2 * MiB)
    w.service.take_in(port.stops(1.0))
    (frozen,) = w.service.frozen()
    assert (frozen.tgid, frozen.size_bytes, frozen.attribution.pod_uid) == (pid, 2 * MiB, UID)

    # The headroom was stale (the pod freed memory since): not over with the call counted.
    await w.service.after_cycle(*w.listed([pid], used=0, limit=4 * MiB, state=UsageState.OK))
    assert caller.line() == "returned 0"
    assert state(pid) != "T"
    assert w.thaws("not_over") == 1
    assert w.service.frozen() == []


async def test_a_caller_is_kept_frozen_until_a_listing_after_its_freeze_then_the_bound(
    w: World, port: BpfAllocationGuard
) -> None:
    caller = w.spawn()
    pid = caller.pid
    decision, sample, attributions = w.listed(
        [pid], used=1 * MiB, limit=2 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)
    w.freeze(caller, 2 * MiB)
    w.service.take_in(port.stops(1.0))
    w.service.frozen()
    # The listing decided on was taken before the freeze: it says nothing of the allocation.
    await w.service.after_cycle(decision, sample, attributions)
    w.service.expire()
    assert state(pid) == "T"
    assert caller.line(timeout_seconds=0.3) is None
    # Taken over from the thawer at take_in: its 200 ms bound does not resume it.
    await asyncio.sleep(FREEZE_BOUND_SECONDS + 0.2)
    assert state(pid) == "T", "the thawer resumed a stop the enforcer had taken over"
    # No decision within the bound: the enforcer resumes it itself.
    w.clock.advance(FREEZE_BOUND_SECONDS)
    w.service.expire()
    assert caller.line() == "returned 0"
    assert w.thaws("bound") == 1
    assert w.service.frozen() == []


async def test_a_tenants_own_stopped_process_is_never_resumed(
    w: World, port: BpfAllocationGuard
) -> None:
    frozen_caller, own = w.spawn(), w.spawn()
    fpid, opid = frozen_caller.pid, own.pid
    own.send("stopself")  # the tenant's own stop
    assert own.line() == "stopping"
    assert wait_state(own.stopped, 5.0) is not None
    await w.service.after_cycle(
        *w.listed([fpid, opid], used=1 * MiB, limit=3 * MiB, state=UsageState.OK)
    )
    w.freeze(frozen_caller, 2 * MiB)
    w.service.take_in(port.stops(1.0))
    w.service.frozen()
    await w.service.after_cycle(*w.listed([fpid, opid], used=0, limit=8 * MiB, state=UsageState.OK))
    assert frozen_caller.line() == "returned 0"
    assert state(opid) == "T"  # untouched
    assert own.line(timeout_seconds=0.3) is None
    own.proc.send_signal(signal.SIGCONT)  # this test's own process
    assert own.line() == "continued"


def test_resume_refuses_a_stopped_process_not_as_read_when_frozen(
    w: World, port: BpfAllocationGuard
) -> None:
    own = w.spawn()
    pid = own.pid
    own.send("stopself")
    assert own.line() == "stopping"
    assert wait_state(own.stopped, 5.0) is not None
    now = ProcfsProcessResolver(Path("/proc")).attribute(pid)
    assert now.identity is not None
    reused = replace(
        now, identity=ProcessIdentity(pid=pid, start_ticks=now.identity.start_ticks - 1)
    )
    got = w.killer.resume(
        FrozenAllocation(tgid=pid, device_index=0, size_bytes=1, frozen_at=0.0, attribution=reused)
    )
    assert isinstance(got, SignalRefusal)
    assert state(pid) == "T"
    own.proc.send_signal(signal.SIGCONT)


async def test_the_pods_headroom_is_split_between_its_containers_on_the_device(
    w: World, port: BpfAllocationGuard
) -> None:
    other = w.tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
        container_id="b" * 64,
    )  # fmt: skip
    a, b = w.spawn(), w.spawn(other)
    await w.service.after_cycle(
        *w.listed([a.pid, b.pid], used=1 * MiB, limit=6 * MiB, state=UsageState.OK)
    )
    # 4 MiB of headroom, 2 MiB each: 3 MiB in one container freezes it.
    w.freeze(b, 3 * MiB)
    assert [s.cgroup_id for s in port.stops(1.0)] == [cgroup_id(cgroup_dir(other))]
    b.proc.send_signal(signal.SIGCONT)
    assert b.line() == "returned 0"


def node_cgroup_root() -> Path:
    """``node.cgroup_root`` as a node's settings name it: the cgroup mount itself, where the v2
    tree sits at ``<root>/unified`` on a hybrid host such as this VM's."""
    v2 = hierarchy_dir(2, "")
    return v2.parent if v2.name == "unified" else v2


def test_headroom_is_written_under_the_v2_mount_of_the_nodes_cgroup_root(
    w: World, built: AllocGuardBuild
) -> None:
    port = BpfAllocationGuard(
        AllocGuard(object_path=built.object_path, library_path=built.stub_library),
        cgroup_root=node_cgroup_root(),
    )
    try:
        caller = w.spawn()
        port.write({(w.cg, 0): 1 * MiB}, devices={0})
        caller.alloc(built.stub_library, 2 * MiB)
        assert wait_state(caller.stopped, 5.0) is not None, "no headroom was written"
    finally:
        port.close()  # resumes the stop


def test_a_cgroup_path_with_dot_dot_is_never_given_headroom(
    w: World, port: BpfAllocationGuard, built: AllocGuardBuild
) -> None:
    # As another cgroup namespace shows a path: joined to the host's mount it still names a
    # real cgroup (here the caller's own), which is exactly why it must not be trusted.
    first = w.cg.path.strip("/").split("/")[0]
    hostile = replace(w.cg, path=f"/{first}/..{w.cg.path}")
    assert (hierarchy_dir(2, "") / hostile.path.lstrip("/")).is_dir()
    caller = w.spawn()
    port.write({(hostile, 0): 1 * MiB}, devices={0})
    caller.alloc(built.stub_library, 2 * MiB)
    # Not stopped at all (the thawer would resume a stop at its bound: the stop is what counts).
    assert caller.line(timeout_seconds=5.0) == "returned 0"
    assert port.stops(0.5) == []
