"""Reads that hang or crawl, and a real-time enforcer over them (rows R6 and N9 of
``docs/reliability.md``): a ``/proc`` read of a D-state process that never returns, an NVML call
stuck in the driver, reads slower than the watchdog's timeout.

Shared by ``tests/test_fault_rows.py`` and the script it runs in an interpreter of its own (an
enforcer that must exit while a read is stuck), which imports it by name. Must not hold a read
past 30 s: every hang waits on a ``release`` event with that bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Mapping

from gpuguard.adapters.metrics import SnapshotCollector
from gpuguard.core.model import (
    Attribution,
    DeviceKey,
    DeviceMemory,
    EnforcementPolicy,
    GpuSample,
    Mode,
    ProcessIdentity,
)
from gpuguard.ports import FastGpuSource
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.sampling import ChangeDrivenSampler
from tests.fakes import (
    FakeEventSink,
    FakeGpuSource,
    FakeKiller,
    FakePodDirectory,
    FakeRecorder,
    FakeResolver,
    GiB,
    RealClock,
    cid,
    gpu,
    pod,
    proc,
)

_G0 = gpu(0)


class HangingResolver(FakeResolver):
    """Attributes normally for the first ``good_calls`` calls, then blocks (a read of a D-state
    process's ``/proc`` entry that never returns) until ``release``."""

    def __init__(self, attributions: dict[int, Attribution], *, good_calls: int) -> None:
        super().__init__(attributions=attributions)
        self.good_calls = good_calls
        self.calls = 0
        self.release = threading.Event()

    def attribute(self, pid: int) -> Attribution:
        self.calls += 1
        if self.calls > self.good_calls:
            self.release.wait(timeout=30)
        return super().attribute(pid)


class SlowResolver(FakeResolver):
    """Every attribution takes ``delay`` seconds, then answers (a loaded node's /proc)."""

    def __init__(self, attributions: dict[int, Attribution], *, delay: float) -> None:
        super().__init__(attributions=attributions)
        self.delay = delay

    def attribute(self, pid: int) -> Attribution:
        time.sleep(self.delay)
        return super().attribute(pid)


class SlowGpu:
    """``FakeGpuSource`` whose listings (``sample``, ``sample_devices``) take ``delay`` seconds,
    and after ``good_calls`` listings block until ``release`` (an NVML call stuck in the
    driver); its memory reads answer at once."""

    def __init__(self, source: FakeGpuSource, *, delay: float = 0.0, good_calls: int) -> None:
        self.source = source
        self.delay = delay
        self.good_calls = good_calls
        self.calls = 0
        self.release = threading.Event()

    def sample(self) -> GpuSample:
        self.calls += 1
        if self.calls > self.good_calls:
            self.release.wait(timeout=30)
        time.sleep(self.delay)
        return self.source.sample()

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        return self.sample()

    def read_memory(self) -> Mapping[DeviceKey, DeviceMemory]:
        return self.source.read_memory()


def real_time_enforcer(
    resolver: FakeResolver,
    *,
    fast: bool = True,
    staleness: float = 1.0,
    termination_timeout: float = 30.0,
    poll_interval: float = 0.25,
    gpu: Callable[[FakeGpuSource], FastGpuSource] | None = None,
) -> tuple[Enforcer, FakeKiller, FakeGpuSource]:
    """An enforcer in real time over one pod 2 GiB over its limit (PID 101 on GPU 0), with the
    fast path (``fast``), or poll-only (``enforcement.fast_interval_seconds = 0``: the same loop,
    every device listed every ``poll_interval``); ``gpu`` wraps the source. No grace: the second
    fresh listing alone stops the pod."""
    clock = RealClock()
    source = FakeGpuSource(clock=clock, devices=[_G0], processes=[proc(101, _G0, 12 * GiB)])
    killer = FakeKiller(members={cid(10): [ProcessIdentity(pid=101, start_ticks=1000)]})
    read = source if gpu is None else gpu(source)
    enforcer = Enforcer(
        sampler=ChangeDrivenSampler(
            read,
            clock=time.monotonic,
            step_bytes=64 * 2**20,
            max_age_seconds=0.25,
            tick_seconds=0.05,
        )
        if fast
        else ChangeDrivenSampler.polling(read, clock=time.monotonic, poll_seconds=poll_interval),
        resolver=resolver,
        pods=FakePodDirectory(clock=clock, pods=[pod(1, limit=10 * GiB)]),
        killer=killer,
        events=FakeEventSink(),
        recorder=FakeRecorder(),
        publisher=SnapshotCollector(hostname="node-1"),
        clock=clock,
        policy=EnforcementPolicy(
            mode=Mode.ENFORCE,
            grace_seconds=0.0,  # the second fresh listing alone would stop the pod
            termination_timeout_seconds=termination_timeout,
            staleness_seconds=staleness,
        ),
        poll_interval_seconds=poll_interval,
        gpu_timeout_seconds=0.5,
    )
    return enforcer, killer, source


async def run_for(enforcer: Enforcer, seconds: float) -> None:
    """Run ``enforcer`` for ``seconds``, then stop it (as SIGTERM does) and wait for it."""
    stop = asyncio.Event()
    task = asyncio.create_task(enforcer.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, timeout=5)
