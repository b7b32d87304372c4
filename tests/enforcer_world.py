"""The real ``Enforcer`` wired to the fakes of ``tests.fakes``: one GPU, two pods with a 10 GiB
limit, their containers' processes 101 and 201, and host process 301.

Owns the wiring only; a test sets the fakes' state (``world.gpu.processes``,
``world.killer.refuse``...) and turns the enforcer's one loop with ``run`` (``Enforcer.step``,
poll-only: every device listed at each turn, the clock advanced between turns). Used by the
enforcer's unit tests and by the alert rules' tests (a scrape of the real recorders after a stop).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpuguard.adapters.metrics import PrometheusRecorder, SnapshotCollector
from gpuguard.core.model import EnforcementPolicy, Mode, ProcessIdentity
from gpuguard.ports import FastGpuSource
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.sampling import ChangeDrivenSampler
from tests.fakes import (
    FakeClock,
    FakeEventSink,
    FakeGpuSource,
    FakeKiller,
    FakePodDirectory,
    FakeRecorder,
    FakeResolver,
    GiB,
    attr,
    cid,
    gpu,
    pod,
)

G0 = gpu(0)
POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE, grace_seconds=1.0, termination_timeout_seconds=2.0, staleness_seconds=5.0
)


class World:
    def __init__(
        self,
        *,
        policy: EnforcementPolicy = POLICY,
        prometheus: bool = False,
        gpu: FastGpuSource | None = None,
        **enforcer_kw: object,
    ) -> None:
        """``prometheus``: count into a real ``PrometheusRecorder`` on ``registry`` instead of
        a ``FakeRecorder`` (to read ``gpuguard_*_total`` as a scrape would)."""
        self.clock = FakeClock()
        self.gpu = FakeGpuSource(clock=self.clock, devices=[G0])
        self.resolver = FakeResolver()
        self.pods = FakePodDirectory(
            clock=self.clock, pods=[pod(1, limit=10 * GiB), pod(2, limit=10 * GiB)]
        )
        self.killer = FakeKiller(
            members={
                cid(10): [ProcessIdentity(pid=101, start_ticks=1000)],
                cid(20): [ProcessIdentity(pid=201, start_ticks=1000)],
            }
        )
        self.events = FakeEventSink()
        self.registry = CollectorRegistry()
        self.recorder = FakeRecorder()
        recorder: FakeRecorder | PrometheusRecorder = (
            PrometheusRecorder(self.registry) if prometheus else self.recorder
        )
        self.collector = SnapshotCollector(hostname="node-1")
        self.registry.register(self.collector)
        self.resolver.attributions.update(
            {101: attr(101, pod_n=1), 201: attr(201, pod_n=2), 301: attr(301, pod_n=None)}
        )
        self.enforcer = Enforcer(
            sampler=ChangeDrivenSampler.polling(
                gpu or self.gpu, clock=self.clock.monotonic, poll_seconds=0.25
            ),
            resolver=self.resolver,
            pods=self.pods,
            killer=self.killer,
            events=self.events,
            recorder=recorder,
            publisher=self.collector,
            clock=self.clock,
            policy=policy,
            poll_interval_seconds=0.25,
            **enforcer_kw,  # type: ignore[arg-type]
        )

    async def run(self, cycles: int, dt: float = 0.5) -> None:
        for _ in range(cycles):
            await self.enforcer.step()
            self.clock.advance(dt)
