"""The allocation guard through the real enforcer loop: ``Enforcer.run`` over the NVML
stand-in (the scenario lists what each caller allocated before the crossing), the real /proc
resolver, the real pidfd killer, the real probes on the libcuda stand-in, and real callers in
real kubelet-style pod cgroups.

A pod whose allocation would take it past its limit is frozen at the call, confirmed by the
listing the freeze calls for (``Trigger.ALLOCATION``, no grace period) and SIGTERMed while
still stopped, so the allocation never runs; a caller with a SIGTERM handler is resumed after
the SIGTERM so the handler runs; a stale headroom (the listing shows less than the count
assumed) resumes the caller at once; a neighbour pod is never frozen or signalled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.allocguard import GUARD_OBJECT, AllocGuard, BpfAllocationGuard, attach
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.metrics import MetricsRegistry, PrometheusGuardRecorder, SnapshotCollector
from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.adapters.procfs import ProcfsProcessResolver
from gpuguard.app import build_guard
from gpuguard.config.loader import load_settings
from gpuguard.config.settings import Settings
from gpuguard.core.model import (
    ContainerId,
    EnforcementPolicy,
    LimitValue,
    Mode,
    Pod,
    PodUid,
    Trigger,
)
from gpuguard.runtime.allocguard import GuardService
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.sampling import ChangeDrivenSampler
from rigs.alloc_caller import AllocCaller
from rigs.allocguard import AllocGuardBuild, build
from rigs.cgroups import CgroupTree, hierarchy_dir
from rigs.nvml_stub import Scenario
from rigs.prereq import require
from tests.fakes import (
    FakeEventSink,
    FakePodDirectory,
    FakeRecorder,
    RealClock,
)
from tests.nvml_stub.fixtures import (
    gpu,
    nvml_sources,
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.kernel, pytest.mark.nvml_stub]

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 4 * MiB
POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE,
    grace_seconds=60.0,  # only the allocation trigger can act within a test
    termination_timeout_seconds=2.0,
    staleness_seconds=30.0,
)
TENANT = PodUid("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9")
NEIGHBOUR = PodUid("1f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9")
WAIT = 5.0


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    return build()


class Node:
    """Two pods on GPU 0: ``tenant`` (4 MiB limit) and ``neighbour`` (1 GiB), one caller each."""

    def __init__(
        self,
        tree: CgroupTree,
        built: AllocGuardBuild,
        scenario: Scenario,
        source: NvmlGpuSource,
        *,
        guard: bool = True,
        policy: EnforcementPolicy = POLICY,
    ) -> None:
        """``guard``: false wires the enforcer as ``enforcement.alloc_guard = false`` or a
        guard that could not attach does (``app.build_guard`` gives ``None``)."""
        self.lib, self.scenario = built.stub_library, scenario
        self.callers: list[AllocCaller] = []
        self.used: dict[int, int] = {}
        self.clock = RealClock()
        self.registry = MetricsRegistry()
        self.recorder = FakeRecorder()
        self.events = FakeEventSink()
        pods = []
        self.cgroups = {}
        for uid, cid, limit in ((TENANT, "a" * 64, LIMIT), (NEIGHBOUR, "b" * 64, GiB)):
            self.cgroups[uid] = tree.container(
                version=2, driver="systemd", qos="burstable", pod_uid=uid, runtime="containerd",
                container_id=cid,
            )  # fmt: skip
            pods.append(
                Pod(
                    uid=uid,
                    namespace="team",
                    name=f"pod-{cid[0]}",
                    containers={ContainerId(cid): "c0"},
                    annotation_limit=LimitValue(limit_bytes=limit),
                )
            )
        self.tree = tree
        self.killer = PidfdKiller(cgroup_root=hierarchy_dir(2, "").parent, proc_root=Path("/proc"))
        resolver = ProcfsProcessResolver(Path("/proc"))
        self.service = (
            GuardService(
                guard=BpfAllocationGuard(
                    AllocGuard(object_path=built.object_path, library_path=built.stub_library),
                    cgroup_root=hierarchy_dir(2, ""),
                ),
                resolver=resolver,
                resumer=self.killer,
                recorder=PrometheusGuardRecorder(self.registry),
                clock=self.clock,
                policy=policy,
            )
            if guard
            else None
        )
        self.enforcer = Enforcer(
            sampler=ChangeDrivenSampler(
                source,
                clock=time.monotonic,
                step_bytes=64 * MiB,
                max_age_seconds=0.5,
                tick_seconds=0.05,
                gate=source.quiet_gate(),
            ),
            resolver=resolver,
            pods=FakePodDirectory(clock=self.clock, pods=pods),
            killer=self.killer,
            events=self.events,
            recorder=self.recorder,
            publisher=SnapshotCollector(hostname="node-1"),
            clock=self.clock,
            policy=policy,
            poll_interval_seconds=0.5,
            gpu_timeout_seconds=1.0,
            guard=self.service,
        )
        self.list()

    def caller(self, uid: PodUid, *, held: int) -> AllocCaller:
        """A caller in ``uid``'s container that allocated ``held`` bytes, listed with them."""
        c = AllocCaller(self.tree, self.cgroups[uid])
        self.callers.append(c)
        c.alloc(self.lib, held)
        assert c.line() == "returned 0"
        self.used[c.pid] = held
        self.list()
        return c

    def list(self) -> None:
        procs = [{"pid": pid, "used_bytes": used} for pid, used in self.used.items()]
        self.scenario.write({"devices": [gpu(0, procs=procs, total=80 * GiB)]})

    def thaws(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "gpuguard_alloc_guard_thaws_total", {"reason": reason}
        )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(self.enforcer.run(stop))
        try:
            # Two listings decided on: the headroom of every caller listed is written.
            await until(lambda: len(self.recorder.polls) >= 2)
            yield
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)

    def close(self) -> None:
        for c in self.callers:
            c.close()
        self.killer.close()


async def until(done: Callable[[], bool], seconds: float = WAIT) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture
def make_node(
    cgroup_tree: CgroupTree, built: AllocGuardBuild, scenario: Scenario, stub_lib: Path
) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []
    with nvml_sources(stub_lib) as make:

        def node(**kw: object) -> Node:
            made.append(Node(cgroup_tree, built, scenario, make(), **kw))  # type: ignore[arg-type]
            return made[-1]

        try:
            yield node
        finally:
            for n in made:
                n.close()


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node()


def gone(c: AllocCaller) -> bool:
    return c.proc.poll() is not None


async def test_a_crossing_is_frozen_at_the_call_sigtermed_while_stopped_and_never_runs(
    node: Node,
) -> None:
    tenant = node.caller(TENANT, held=2 * MiB)
    neighbour = node.caller(NEIGHBOUR, held=2 * MiB)
    async with node.running():
        # Off the event loop: the enforcer runs on it while the caller is waited on.
        await asyncio.to_thread(tenant.alloc, node.lib, 3 * MiB)  # 2 + 3 MiB > 4 MiB
        await until(lambda: gone(tenant))
    assert tenant.proc.returncode == -signal.SIGTERM
    # Killed before the call ran: it never returned, so the stand-in never held the 3 MiB.
    assert tenant.proc.stdout is not None
    assert tenant.proc.stdout.read() == b""
    assert node.recorder.triggers == [Trigger.ALLOCATION]
    # The neighbour was neither frozen nor signalled, and still allocates.
    assert neighbour.state() != "T"
    assert not gone(neighbour)
    neighbour.alloc(node.lib, MiB)
    assert neighbour.line() == "returned 0"
    assert neighbour.held(node.lib) == 3 * MiB


async def test_a_caller_with_a_sigterm_handler_is_resumed_after_the_sigterm_and_killed_later(
    node: Node,
) -> None:
    tenant = node.caller(TENANT, held=2 * MiB)
    tenant.trap_term()
    async with node.running():
        await asyncio.to_thread(tenant.alloc, node.lib, 3 * MiB)
        # From here NVML may list the 3 MiB: the call can run once resumed (a listing before
        # that sees 5 + 3 MiB frozen, over all the same); the pod stays over until SIGKILL.
        node.used[tenant.pid] = 5 * MiB
        node.list()
        # Resumed after the SIGTERM: its handler runs (Python runs it as the frozen call
        # returns, before the caller's next line) and the call completes.
        got = {await asyncio.to_thread(tenant.line), await asyncio.to_thread(tenant.line)}
        assert got == {"term", "returned 0"}
        await until(lambda: gone(tenant), seconds=POLICY.termination_timeout_seconds + WAIT)
    assert tenant.proc.returncode == -signal.SIGKILL
    assert node.thaws("signalled") == 1


async def test_a_stale_headroom_resumes_the_caller_at_once_and_counts_it(node: Node) -> None:
    tenant = node.caller(TENANT, held=2 * MiB)
    async with node.running():
        # The pod freed its 2 MiB by a path the probe does not see: the headroom written
        # (2 MiB) is stale, the next listing shows 0 + 3 MiB, within the 4 MiB limit.
        node.used[tenant.pid] = 0
        node.list()
        await asyncio.to_thread(tenant.alloc, node.lib, 3 * MiB)
        assert await asyncio.to_thread(tenant.line) == "returned 0"
    assert node.thaws("not_over") == 1
    assert not gone(tenant)
    assert node.recorder.triggers == []
    assert node.recorder.kills == 0


async def test_guard_off_nothing_is_frozen_and_the_crossing_pod_is_stopped_after_its_grace(
    make_node: Callable[..., Node],
) -> None:
    node = make_node(guard=False, policy=replace(POLICY, grace_seconds=1.0))
    tenant = node.caller(TENANT, held=2 * MiB)
    async with node.running():
        await asyncio.to_thread(tenant.alloc, node.lib, 3 * MiB)
        assert await asyncio.to_thread(tenant.line) == "returned 0"  # no probe: the call ran
        node.used[tenant.pid] = 5 * MiB
        node.list()
        await until(lambda: gone(tenant), seconds=1.0 + WAIT)
    assert tenant.proc.returncode == -signal.SIGTERM
    assert node.recorder.triggers == [Trigger.GRACE]
    assert node.thaws("not_over") is None


def test_guard_off_attaches_nothing(tmp_path: Path) -> None:
    registry = MetricsRegistry()
    settings = load_settings(environ={})
    assert not settings.enforcement.alloc_guard
    got = _build(settings, registry)
    assert got is None
    assert registry.get_sample_value("gpuguard_alloc_guard_active", {"reason": ""}) is None


def test_a_guard_that_cannot_attach_is_logged_once_and_shown_by_its_gauge(tmp_path: Path) -> None:
    registry = MetricsRegistry()
    base = load_settings(environ={})
    settings = replace(
        base,
        enforcement=replace(
            base.enforcement, alloc_guard=True, alloc_guard_library=tmp_path / "libcuda.so.1"
        ),
    )
    with capture_logs() as logs:
        got = _build(settings, registry)
    assert got is None
    (line,) = [e for e in logs if e["event"] == "alloc_guard_unavailable"]
    # The first thing missing: the compiled object where no image build made it, else the file.
    reason = "no_library" if GUARD_OBJECT.is_file() else "no_object"
    assert line["reason"].startswith(reason)
    assert registry.get_sample_value("gpuguard_alloc_guard_active", {"reason": reason}) == 0


def test_a_library_without_the_entry_points_cannot_be_attached(
    built: AllocGuardBuild, stub_lib: Path
) -> None:
    root = hierarchy_dir(2, "")
    got = attach(object_path=built.object_path, library_path=stub_lib, cgroup_root=root)
    assert isinstance(got, str)
    assert got.startswith("attach_failed")  # libnvidia-ml: no cuMemAlloc_v2 to probe
    gone_file = stub_lib.parent / "missing.so"
    got = attach(object_path=built.object_path, library_path=gone_file, cgroup_root=root)
    assert isinstance(got, str)
    assert got.startswith("no_library")


def _build(settings: Settings, registry: MetricsRegistry) -> GuardService | None:
    killer = PidfdKiller(cgroup_root=hierarchy_dir(2, "").parent, proc_root=Path("/proc"))
    try:
        return build_guard(
            settings,
            resolver=ProcfsProcessResolver(Path("/proc")),
            resumer=killer,
            recorder=PrometheusGuardRecorder(registry),
            clock=RealClock(),
            policy=POLICY,
        )
    finally:
        killer.close()
