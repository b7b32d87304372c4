"""The allocation guard's runtime side on this kernel: the real probes on the libcuda stand-in
(tests/cuda_stub), real processes in real kubelet-style cgroups, the real /proc resolver and
the real pidfd killer's ``resume``, driven through ``runtime.allocguard.GuardService`` with the
cycle's pod usage given as ``decide()`` reports it.

A frozen caller whose pod is not over with the allocation counted is resumed at once and the
thaw counted; a tenant's own stopped process is never resumed, and a process not as read when
it was frozen is refused; the headroom is written per container cgroup from the listing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.adapters.allocguard import AllocGuard, BpfAllocationGuard, cgroup_id
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.metrics import MetricsRegistry, PrometheusGuardRecorder
from gpuguard.adapters.procfs import ProcfsProcessResolver, read_state
from gpuguard.core.freeze import FrozenAllocation
from gpuguard.core.model import (
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
from rigs.allocguard import AllocGuardBuild, build
from rigs.cgroups import CgroupTree, cgroup_dir, hierarchy_dir
from rigs.prereq import require
from tests.fakes import FakeClock, gpu

pytestmark = pytest.mark.kernel

MiB = 1 << 20
UID = PodUid("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9")
POLICY = EnforcementPolicy(mode=Mode.ENFORCE)
G0 = gpu(0)

# "calling" just before the entry point runs; "returned" once it has.
CALLER = r"""
import ctypes, sys
cu = ctypes.CDLL(sys.argv[1])
out = ctypes.c_ulonglong()
print("ready", flush=True)
for line in sys.stdin:
    print("calling", flush=True)
    rc = cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(int(line)))
    print("returned", rc, flush=True)
"""


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
    for proc in world.procs:  # the tree kills the processes
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    world.killer.close()


class World:
    def __init__(self, tree: CgroupTree, port: BpfAllocationGuard, lib: Path) -> None:
        self.tree, self.lib = tree, lib
        self.procs: list[subprocess.Popen[bytes]] = []
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

    def spawn(self, cg: ContainerCgroup | None = None) -> subprocess.Popen[bytes]:
        proc = self.tree.spawn(
            [sys.executable, "-c", CALLER, str(self.lib)],
            cgroups=[cg or self.cg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        return proc

    def thaws(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "gpuguard_alloc_guard_thaws_total", {"reason": reason}
        )

    def cycle(
        self, pids: list[int], *, used: int, limit: int, state: UsageState
    ) -> tuple[Decision, GpuSample, dict[int, object]]:
        """The cycle's output as ``decide()`` gives it: the pod's usage on GPU 0 at a fresh
        listing of it, its processes attributed by the real resolver."""
        resolver = ProcfsProcessResolver(Path("/proc"))
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


def stopped(pid: int, timeout_seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if read_state(Path("/proc"), pid) == "T":
            return True
        time.sleep(0.001)
    return False


async def test_a_frozen_caller_whose_pod_is_not_over_is_resumed_at_once_and_counted(
    w: World, port: BpfAllocationGuard
) -> None:
    proc = w.spawn()
    pid = proc.pid
    # The listing: 1 MiB used of a 2 MiB limit → 1 MiB headroom written for the container.
    decision, sample, attributions = w.cycle(
        [pid], used=1 * MiB, limit=2 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]

    proc.stdin.write(b"%d\n" % (2 * MiB))
    assert proc.stdout.readline().strip() == b"calling"
    assert stopped(pid), "the allocation past the headroom did not freeze its caller"
    w.service.take_in(port.stops(1.0))
    (frozen,) = w.service.frozen()
    assert (frozen.tgid, frozen.size_bytes, frozen.attribution.pod_uid) == (pid, 2 * MiB, UID)

    # The headroom was stale (the pod freed memory since): not over with the call counted.
    decision, sample, attributions = w.cycle([pid], used=0, limit=4 * MiB, state=UsageState.OK)
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]
    assert proc.stdout.readline().strip() == b"returned 0"
    assert read_state(Path("/proc"), pid) != "T"
    assert w.thaws("not_over") == 1
    assert w.service.frozen() == []


async def test_a_caller_kept_frozen_while_its_pod_is_over_is_resumed_at_the_bound(
    w: World, port: BpfAllocationGuard
) -> None:
    proc = w.spawn()
    pid = proc.pid
    decision, sample, attributions = w.cycle(
        [pid], used=1 * MiB, limit=2 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]
    proc.stdin.write(b"%d\n" % (2 * MiB))
    assert proc.stdout.readline().strip() == b"calling"
    assert stopped(pid)
    w.service.take_in(port.stops(1.0))

    over, sample, attributions = w.cycle([pid], used=3 * MiB, limit=2 * MiB, state=UsageState.OVER)
    await w.service.after_cycle(over, sample, attributions)  # type: ignore[arg-type]
    assert read_state(Path("/proc"), pid) == "T"  # kept: the violation waits for its listing
    w.clock.advance(0.25)  # past core.freeze.FREEZE_BOUND_SECONDS
    await w.service.after_cycle(over, sample, attributions)  # type: ignore[arg-type]
    assert proc.stdout.readline().strip() == b"returned 0"
    assert w.thaws("bound") == 1


async def test_a_tenants_own_stopped_process_is_never_resumed(
    w: World, port: BpfAllocationGuard
) -> None:
    frozen_proc, own = w.spawn(), w.spawn()
    fpid, opid = frozen_proc.pid, own.pid
    own.send_signal(signal.SIGSTOP)  # the tenant's own stop
    assert stopped(opid)
    decision, sample, attributions = w.cycle(
        [fpid, opid], used=1 * MiB, limit=3 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]
    frozen_proc.stdin.write(b"%d\n" % (2 * MiB))
    assert stopped(fpid)
    w.service.take_in(port.stops(1.0))
    decision, sample, attributions = w.cycle(
        [fpid, opid], used=0, limit=8 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]
    assert read_state(Path("/proc"), fpid) != "T"
    assert read_state(Path("/proc"), opid) == "T"  # untouched
    own.send_signal(signal.SIGCONT)


def test_resume_refuses_a_stopped_process_not_as_read_when_frozen(
    w: World, port: BpfAllocationGuard
) -> None:
    own = w.spawn()
    pid = own.pid
    own.send_signal(signal.SIGSTOP)
    assert stopped(pid)
    now = ProcfsProcessResolver(Path("/proc")).attribute(pid)
    assert now.identity is not None
    reused = replace(
        now, identity=ProcessIdentity(pid=pid, start_ticks=now.identity.start_ticks - 1)
    )
    got = w.killer.resume(
        FrozenAllocation(tgid=pid, device_index=0, size_bytes=1, frozen_at=0.0, attribution=reused)
    )
    assert isinstance(got, SignalRefusal)
    assert read_state(Path("/proc"), pid) == "T"
    own.send_signal(signal.SIGCONT)


async def test_the_pods_headroom_is_split_between_its_containers_on_the_device(
    w: World, port: BpfAllocationGuard
) -> None:
    other = w.tree.container(
        version=2, driver="systemd", qos="burstable", pod_uid=UID, runtime="containerd",
        container_id="b" * 64,
    )  # fmt: skip
    a, b = w.spawn(), w.spawn(other)
    decision, sample, attributions = w.cycle(
        [a.pid, b.pid], used=1 * MiB, limit=6 * MiB, state=UsageState.OK
    )
    await w.service.after_cycle(decision, sample, attributions)  # type: ignore[arg-type]
    # 4 MiB of headroom, 2 MiB each: 3 MiB in one container freezes it.
    b.stdin.write(b"%d\n" % (3 * MiB))
    assert stopped(b.pid)
    assert [s.cgroup_id for s in port.stops(1.0)] == [cgroup_id(cgroup_dir(other))]
    b.send_signal(signal.SIGCONT)
