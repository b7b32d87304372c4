"""The enforcer's one loop over fakes: read → list → attribute → decide → act → publish, turned
one step at a time on a fake clock (``Enforcer.step``) or run (``Enforcer.run``).

Covers: a greedy pod is stopped and its Events posted, in order; the neighbour and host
processes are never passed to the killer; killer refusals are counted, never retried in a storm;
an NVML failure or hang never produces a signal and surfaces as stale data; the host-PID
self-check failing turns every signal into a refusal; metrics see each cycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Collection, Mapping
from typing import NoReturn

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.metrics import PrometheusRecorder
from gpuguard.core.model import (
    DeviceKey,
    DeviceMemory,
    DeviceSkip,
    EventReason,
    GpuSample,
    Mode,
    ProcessIdentity,
    RefusalReason,
    SampleIssue,
    SigtermFate,
    StopSignal,
)
from gpuguard.core.policy import Refusal
from gpuguard.errors import GpuSourceError
from tests.enforcer_world import G0, POLICY, World
from tests.fakes import (
    FakeNodeLock,
    GiB,
    attr,
    cid,
    gpu,
    pod,
    proc,
)


async def test_greedy_pod_is_stopped_with_events_and_nobody_else() -> None:
    w = World()
    w.gpu.processes = [proc(101, G0, 12 * GiB), proc(201, G0, 9 * GiB), proc(301, G0, 30 * GiB)]
    await w.run(12)
    assert [(t.pod.name, s) for t, s in w.killer.calls] == [
        ("pod-1", StopSignal.TERM),
        ("pod-1", StopSignal.KILL),
    ]
    reasons = [e.reason for e in w.events.events]
    assert reasons[:2] == [EventReason.LIMIT_EXCEEDED, EventReason.PROCESS_KILLED]
    assert w.recorder.kills == 1
    assert w.recorder.violations == 1
    assert RefusalReason.NOT_A_POD in w.recorder.refusals  # the host process, reported once
    assert w.recorder.refusals.count(RefusalReason.NOT_A_POD) == 1


async def test_killer_refusals_are_counted_once_per_attempt_not_retried_in_a_storm() -> None:
    w = World()
    w.killer.refuse = RefusalReason.PERMISSION_DENIED
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    await w.run(30)
    assert len(w.killer.calls) == 2  # one SIGTERM, one SIGKILL, then gave up
    assert w.recorder.kills == 0
    assert w.recorder.refusals.count(RefusalReason.PERMISSION_DENIED) == 2


async def test_nvml_errors_never_produce_a_signal_and_surface_as_stale() -> None:
    w = World()
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    await w.run(1)
    w.gpu.error = GpuSourceError("GPU is lost")
    await w.run(20)
    assert w.killer.calls == []
    assert w.collector.ready == (False, RefusalReason.DATA_STALE.value)


async def test_a_hung_nvml_call_is_abandoned_after_its_timeout() -> None:
    """The loop goes on while an NVML call hangs: past its timeout the read is reported
    (once), the node is not ready for stale data, and nothing is signalled."""
    release = threading.Event()

    class HungGpu:
        def hang(self) -> NoReturn:
            release.wait(5)
            raise GpuSourceError("released")

        def sample(self) -> GpuSample:
            self.hang()

        def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
            self.hang()

        def read_memory(self) -> Mapping[DeviceKey, DeviceMemory]:
            self.hang()

    w = World(gpu=HungGpu(), gpu_timeout_seconds=0.05)
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    stop = asyncio.Event()
    task = asyncio.create_task(w.enforcer.run(stop))
    try:
        with capture_logs() as logs:
            for _ in range(30):  # 3 s on the enforcer's clock, in about 1.5 s
                w.clock.advance(0.1)
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, timeout=2)
    finally:
        release.set()
    failed = [e for e in logs if e["event"] == "gpu_sample_failed"]
    assert [e["error"].startswith("timed out: an NVML call") for e in failed] == [True], failed
    assert w.collector.ready == (False, RefusalReason.DATA_STALE.value)
    assert w.killer.calls == []


async def test_outside_the_host_pid_namespace_every_signal_is_refused() -> None:
    """The self-check's failure is an input of decide(): the violation is refused once with
    its own reason, never counted as permission_denied twice and then kill_ineffective for
    signals that were never sent."""
    blocked = Refusal(reason=RefusalReason.NOT_HOST_PID_NAMESPACE, detail="NSpid has 2 fields")
    w = World(blocked=blocked)
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    await w.run(20)
    assert w.killer.calls == []
    assert w.events.events == []
    assert w.recorder.refusals == [RefusalReason.NOT_HOST_PID_NAMESPACE]
    assert w.recorder.violations == 1
    assert w.collector.ready == (False, "not_host_pid_namespace: NSpid has 2 fields")


async def test_without_cap_kill_every_violation_is_refused_and_it_is_not_ready() -> None:
    """The privilege self-check's failure: the enforcer runs, but every violation
    is refused ``cannot_signal`` once, nothing reaches the killer, and ``/readyz`` and
    ``gpuguard_enforcement_active`` say why instead of "ready" and ``reason=""``."""
    detail = "CapEff 0000000000000000 (uid 65534) lacks CAP_KILL (bit 5)"
    w = World(prometheus=True, blocked=Refusal(reason=RefusalReason.CANNOT_SIGNAL, detail=detail))
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    with capture_logs() as logs:
        await w.run(20)
    assert w.killer.calls == []
    assert w.events.events == []
    get = w.registry.get_sample_value
    assert get("gpuguard_refusals_total", {"reason": "cannot_signal"}) == 1.0
    assert get("gpuguard_kills_total") == 0.0
    assert w.collector.ready == (False, f"cannot_signal: {detail}")
    assert get("gpuguard_enforcement_active", {"reason": f"cannot_signal: {detail}"}) == 0.0
    refused = [e for e in logs if e["event"] == "violation_refused"]
    assert [(e["reason"], e["detail"]) for e in refused] == [("cannot_signal", detail)]


@pytest.mark.parametrize("mode", [Mode.ENFORCE, Mode.AUDIT], ids=str)
async def test_a_standby_enforcer_acts_posts_and_counts_nothing_until_the_node_lock_is_free(
    mode: Mode,
) -> None:
    """Reliability R3: another enforcer on the node holds the lock. This one signals nothing,
    posts no Event (not even InvalidGPUMemoryLimit, which the holder posts), counts no
    violation, logs no would-be stop, is not ready, and says once who holds the lock; once the
    lock is free it takes it and enforces from a fresh start (two listings, then the grace)."""
    lock = FakeNodeLock(holder_pid=4242)
    w = World(policy=dataclasses.replace(POLICY, mode=mode), lock=lock)
    w.pods.pods.append(pod(3, error="8GB: not a Kubernetes quantity"))
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    with capture_logs() as logs:
        await w.run(20)
    assert w.killer.calls == []
    assert w.events.events == []
    assert w.recorder.violations == 0
    assert w.recorder.refusals == [RefusalReason.LOCK_HELD]  # the pause itself, once
    assert w.collector.ready == (False, f"lock_held: {lock.path} is held by PID 4242")
    standby = [e for e in logs if e["event"] == "enforcement_standby"]
    assert len(standby) == 1
    assert (standby[0]["lock_file"], standby[0]["holder_pid"]) == (lock.path, 4242)
    assert not [e for e in logs if e["event"] == "would_stop_container"]
    assert lock.tries == 20, "tried again at every cycle more than a poll interval apart"

    lock.holder_pid = None  # the holder exited
    with capture_logs() as logs:
        await w.run(1)
        assert w.killer.calls == []  # one listing so far: not confirmed yet
        await w.run(4)
    assert [e["event"] for e in logs if e["event"].startswith("enforcement_")] == [
        "enforcement_lock_acquired"
    ]
    assert w.collector.ready == (True, "")
    reasons = [e.reason for e in w.events.events]
    assert EventReason.INVALID_LIMIT in reasons
    if mode is Mode.ENFORCE:
        assert [(t.pod.name, s) for t, s in w.killer.calls] == [("pod-1", StopSignal.TERM)]
        assert EventReason.LIMIT_EXCEEDED in reasons
    else:
        assert w.killer.calls == []
        assert RefusalReason.AUDIT_MODE in w.recorder.refusals
    assert w.recorder.violations == 1


async def test_the_lock_holder_rechecks_it_once_per_poll_interval_and_stands_by_if_lost() -> None:
    """The holder re-checks its lock (the adapter re-verifies the file at the path) at most
    once per poll interval, not every cycle; if another process holds the lock at a re-check
    (its file was replaced), this one stops acting at once."""
    lock = FakeNodeLock()
    w = World(lock=lock)
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    for _ in range(16):  # 2 s: past the 1 s grace, before the 2 s termination timeout
        await w.enforcer.step()
        w.clock.advance(0.125)
    assert lock.tries == 8, "16 cycles, one try per 0.25 s poll interval"
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM]
    lock.holder_pid = 777
    await w.run(20)
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM], "no SIGKILL while standing by"
    assert w.collector.ready == (False, f"lock_held: {lock.path} is held by PID 777")


async def test_published_metrics_follow_each_cycle() -> None:
    w = World()
    w.enforcer._recorder = PrometheusRecorder(w.registry)
    w.gpu.processes = [proc(101, G0, 12 * GiB), proc(301, G0, 3 * GiB)]
    await w.run(8)
    get = w.registry.get_sample_value
    labels = {
        "namespace": "team",
        "pod": "pod-1",
        "pod_uid": str(pod(1).uid),
        "container": "c0",
        "gpu": "0",
        "UUID": G0.uuid,
        "GPU_I_ID": "",
        "hostname": "node-1",
        # No DRA share on the GPU: dcgm-exporter's DRA labels are empty (absent in PromQL).
        "dra_claim_name": "",
        "dra_claim_namespace": "",
        "dra_driver_name": "",
        "dra_pool_name": "",
        "dra_device_name": "",
    }
    assert get("gpuguard_pod_gpu_memory_used_bytes", labels) == 12 * GiB
    assert get("gpuguard_pod_gpu_memory_limit_bytes", labels) == 10 * GiB
    assert (
        get(
            "gpuguard_gpu_memory_unattributed_bytes",
            {"gpu": "0", "UUID": G0.uuid, "GPU_I_ID": "", "hostname": "node-1"},
        )
        == 3 * GiB
    )
    assert get("gpuguard_kills_total") == 1
    assert get("gpuguard_violations_total", {"trigger": "grace"}) == 1
    assert get("gpuguard_violations_total", {"trigger": "pressure"}) == 0
    assert (
        get(
            "gpuguard_gpu_last_listing_timestamp_seconds",
            {"gpu": "0", "UUID": G0.uuid, "GPU_I_ID": "", "hostname": "node-1"},
        )
        is not None
    )
    assert get("gpuguard_refusals_total", {"reason": "not_a_pod"}) == 1
    assert get("gpuguard_poll_duration_seconds_count") == 8
    assert get("gpuguard_enforcement_active", {"reason": ""}) == 1
    # Self-health counters exist from the start (docs/design.md, Metrics), every drop reason at 0.
    for reason in ("rate_limit", "buffer_full", "api_error"):
        assert get("gpuguard_events_dropped_total", {"reason": reason}) == 0
    # The pod's processes are gone: its series disappear at the next scrape.
    w.gpu.processes = []
    await w.run(1)
    assert get("gpuguard_pod_gpu_memory_used_bytes", labels) is None


async def test_run_stops_promptly_when_asked() -> None:
    w = World()
    stop = asyncio.Event()
    task = asyncio.create_task(w.enforcer.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, timeout=2)


async def test_a_kill_is_counted_once_even_when_only_sigkill_reaches_the_container() -> None:
    w = World()
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    w.killer.refuse = RefusalReason.PERMISSION_DENIED  # SIGTERM reaches nobody
    await w.run(4)
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM]
    w.killer.refuse = None
    await w.run(10)
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM, StopSignal.KILL]
    assert w.recorder.kills == 1


DROPPED_ALONE = (
    "PID 1 of its PID namespace with no SIGTERM handler: SIGTERM would be dropped, and no "
    "process of the container catches SIGTERM, so none would use the termination timeout"
)


def pid_1_without_a_handler_beside(sibling: SigtermFate) -> World:
    """Container c0 holding 12 GiB of G0 through PID 101, its PID 1 with no SIGTERM handler
    (SIGTERM would be dropped), beside PID 102, whose SIGTERM fate is ``sibling``."""
    w = World()
    w.killer.members[cid(10)] = [
        ProcessIdentity(pid=101, start_ticks=1000),
        ProcessIdentity(pid=102, start_ticks=1000),
    ]
    w.killer.fates = {101: SigtermFate.DROPPED_BY_INIT, 102: sibling}
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    return w


async def test_the_event_and_log_say_which_signal_went_to_which_process_and_why() -> None:
    """At the SIGTERM step a PID 1 without a SIGTERM handler gets SIGKILL at once
    when nothing in its container catches SIGTERM. ``GPUProcessKilled`` names each PID with its
    signal and the reason; ``container_signalled`` is one line per signal actually sent (its
    ``signal`` and ``pids`` exact), with the escalation ``step`` and ``sigterm_lost``."""
    w = pid_1_without_a_handler_beside(SigtermFate.TERMINATES)
    with capture_logs() as logs:
        await w.run(5)
    assert [s for _, s in w.killer.calls] == [StopSignal.TERM]
    killed = [e for e in w.events.events if e.reason is EventReason.PROCESS_KILLED]
    assert len(killed) == 1
    assert killed[0].message.startswith(
        f"sent SIGKILL to PID 101 ({DROPPED_ALONE}) and SIGTERM to PID 102 of container c0: "
        "GPU memory 12884901888 bytes on GPU 0"
    )
    lines = [(x["signal"], x["step"], x["pids"], x["sigterm_lost"]) for x in logs
             if x["event"] == "container_signalled"]  # fmt: skip
    assert lines == [
        ("SIGKILL", "SIGTERM", [101], [
            {"pid": 101, "fate": "dropped_by_init", "detail": DROPPED_ALONE}
        ]),
        ("SIGTERM", "SIGTERM", [102], None),
    ]  # fmt: skip
    assert w.recorder.kills == 1


async def test_a_pid_1_that_drops_sigterm_waits_when_another_member_catches_it() -> None:
    w = pid_1_without_a_handler_beside(SigtermFate.CAUGHT)
    await w.run(5)
    [killed] = [e for e in w.events.events if e.reason is EventReason.PROCESS_KILLED]
    assert killed.message.startswith(
        "sent SIGTERM to PID 101 (PID 1 of its PID namespace with no SIGTERM handler: SIGTERM "
        "would be dropped; SIGKILL follows after the termination timeout, as PID 102 catches "
        "SIGTERM (a SIGKILL to it would end every process of its PID namespace)) and SIGTERM "
        "to PID 102 of container c0"
    )


async def test_a_skipped_gpu_is_logged_when_its_state_changes_not_every_poll() -> None:
    """With ``nvml.fail_on_init_error = false`` a broken GPU logged ``gpu_skipped`` on every
    poll (four times a second) for as long as it stayed broken."""
    import structlog

    w = World()
    broken = DeviceSkip(uuid=None, index=1, reason="GPU is lost")
    with structlog.testing.capture_logs() as logs:
        w.gpu.skipped = (broken,)
        await w.run(8)
        w.gpu.skipped = ()
        await w.run(3)
        w.gpu.skipped = (broken,)
        await w.run(3)

    seen = [(e["event"], e.get("gpu")) for e in logs if e["event"].startswith("gpu_")]
    assert seen == [("gpu_skipped", 1), ("gpu_recovered", 1), ("gpu_skipped", 1)]


async def test_a_value_nvml_returned_and_gpuguard_refused_is_logged_once_while_it_persists() -> (
    None
):
    """docs/reliability.md N7: a value refused as untrustworthy (a process above the GPU's
    memory, a list that grew between count and fetch) reached no log line, only the resulting
    ``usage_unknown`` refusal, so an operator could not tell why memory was not enforced."""
    import structlog

    w = World()
    bogus = SampleIssue(
        uuid=G0.uuid, gpu_instance_id=None, pid=101, reason="memory_above_total", detail="a"
    )
    grew = SampleIssue(uuid=G0.uuid, gpu_instance_id=None, pid=None, reason="list_grew", detail="")
    with structlog.testing.capture_logs() as logs:
        w.gpu.issues = (bogus,)
        await w.run(6)
        w.gpu.issues = (dataclasses.replace(bogus, detail="another value"), grew)
        await w.run(2)
        w.gpu.issues = ()
        await w.run(2)
        w.gpu.issues = (bogus,)
        await w.run(2)

    seen = [
        (e["log_level"], e["reason"], e["pid"], e["uuid"])
        for e in logs
        if e["event"] == "gpu_value_refused"
    ]
    assert seen == [
        ("warning", "memory_above_total", 101, G0.uuid),
        ("info", "list_grew", None, G0.uuid),
        ("warning", "memory_above_total", 101, G0.uuid),
    ]


# ---------------------------------------------------------------------------------------------
# Every refusal code reaches gpuguard_refusals_total{reason} (docs/design.md, Safety invariants,
# "nothing silently lost")


def _greedy(w: World, *, holds_gpu: bool | None = True) -> None:
    """Pod 1's process 101 at 12 GiB of its 10 GiB limit."""
    w.gpu.processes = [proc(101, G0, 12 * GiB)]
    w.resolver.attributions[101] = attr(101, pod_n=1, holds_gpu=holds_gpu)


def _usage_unknown(w: World) -> None:
    w.gpu.processes = [proc(101, G0, 12 * GiB), proc(102, G0, None)]
    w.resolver.attributions[102] = attr(102, pod_n=1)


def _mps(w: World) -> None:
    mps = gpu(0, mps=True)
    w.gpu.devices = [mps]
    w.gpu.processes = [proc(101, mps, 12 * GiB, mps=True)]


def _no_container(w: World) -> None:
    _greedy(w)
    w.resolver.attributions[101] = dataclasses.replace(
        attr(101, pod_n=1), container_id=None, cgroup=None
    )


def _exempt(w: World) -> None:
    w.pods.pods.append(pod(6, namespace="kube-system", limit=GiB))
    w.gpu.processes = [proc(601, G0, 2 * GiB)]
    w.resolver.attributions[601] = attr(601, pod_n=6)


def _stale_pods(w: World) -> None:
    _greedy(w)
    w.pods.api_up = False


def _kill_ineffective(w: World) -> None:
    _greedy(w)
    w.killer.members[cid(10)] = [ProcessIdentity(pid=101, start_ticks=1000)]


def _device_unavailable(w: World) -> None:
    """Over its limit, then the GPU becomes unreadable mid-violation."""
    _greedy(w)

    real = w.gpu.sample

    def flaky() -> GpuSample:
        got = real()
        if got.seq > 3:
            w.gpu.skipped = (DeviceSkip(uuid=G0.uuid, index=0, reason="GPU is lost"),)
            return dataclasses.replace(got, devices=(), processes=(), skipped=w.gpu.skipped)
        return got

    w.gpu.sample = flaky  # type: ignore[method-assign]


def _unassigned_device(w: World) -> None:
    """Pod 3's gpushare declaration is pinned to GPU 1; it holds 4 GiB on GPU 0: reported
    once, and (nothing else applying) held to its own declaration there."""
    from gpuguard.core.model import Declaration, LimitSource

    declared = {
        LimitSource.GPUSHARE: Declaration(amount=2, where="limits", pinned=frozenset({"index:1"}))
    }
    w.pods.pods.append(dataclasses.replace(pod(3), declared=declared))
    w.gpu.processes = [proc(301, G0, 4 * GiB)]
    w.resolver.attributions[301] = attr(301, pod_n=3)


def _host_process(w: World) -> None:
    w.gpu.processes = [proc(301, G0, GiB)]


def _ghost(w: World) -> None:
    w.gpu.processes = [proc(999, G0, GiB)]


def _nvml_down(w: World) -> None:
    w.gpu.error = GpuSourceError("driver gone")


def _unsynced(w: World) -> None:
    w.pods.synced = False


def _unknown_pod(w: World) -> None:
    w.gpu.processes = [proc(501, G0, GiB)]
    w.resolver.attributions[501] = attr(501, pod_n=5)


def _reused_pid(w: World) -> None:
    _greedy(w, holds_gpu=False)


def _killer_refuses(reason: RefusalReason) -> Callable[[World], None]:
    def scenario(w: World) -> None:
        _greedy(w)
        w.killer.refuse = reason

    return scenario


SCENARIOS: dict[RefusalReason, Callable[[World], None]] = {
    RefusalReason.USAGE_UNKNOWN: _usage_unknown,
    RefusalReason.NOT_A_POD: _host_process,
    RefusalReason.GHOST: _ghost,
    RefusalReason.EXEMPT: _exempt,
    # The admin exempts by a namespace label the fake directory never lists: unknown.
    RefusalReason.EXEMPTION_UNKNOWN: _greedy,
    RefusalReason.DATA_STALE: _nvml_down,
    RefusalReason.POD_CACHE_UNSYNCED: _unsynced,
    RefusalReason.POD_CACHE_STALE: _stale_pods,
    RefusalReason.POD_UNKNOWN: _unknown_pod,
    RefusalReason.IDENTITY_CHANGED: _reused_pid,
    RefusalReason.AUDIT_MODE: _greedy,
    RefusalReason.MPS: _mps,
    RefusalReason.NO_CONTAINER: _no_container,
    RefusalReason.PERMISSION_DENIED: _killer_refuses(RefusalReason.PERMISSION_DENIED),
    RefusalReason.SIGNAL_FAILED: _killer_refuses(RefusalReason.SIGNAL_FAILED),
    RefusalReason.KILL_INEFFECTIVE: _kill_ineffective,
    RefusalReason.NOT_HOST_PID_NAMESPACE: _greedy,
    RefusalReason.LOCK_HELD: _greedy,
    RefusalReason.CANNOT_SIGNAL: _greedy,
    RefusalReason.DEVICE_UNAVAILABLE: _device_unavailable,
    RefusalReason.UNASSIGNED_DEVICE: _unassigned_device,
}


def test_every_refusal_code_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(RefusalReason)


@pytest.mark.parametrize("reason", list(RefusalReason), ids=str)
async def test_each_refusal_code_reaches_the_refusals_metric(reason: RefusalReason) -> None:
    """Driven end to end through the runtime (decide, the killer's reports, the recorder) and
    read from a real registry: a refusal no series shows is a violation silently lost."""
    blocked: Refusal | None = None
    policy = POLICY
    if reason is RefusalReason.AUDIT_MODE:
        policy = dataclasses.replace(POLICY, mode=Mode.AUDIT)
    if reason is RefusalReason.NOT_HOST_PID_NAMESPACE:
        blocked = Refusal(reason=reason, detail="NSpid has 2 fields")
    if reason is RefusalReason.CANNOT_SIGNAL:
        blocked = Refusal(reason=reason, detail="CapEff 0000000000000000 lacks CAP_KILL")
    if reason is RefusalReason.MPS:
        policy = dataclasses.replace(POLICY, mps_gpus=frozenset({"all"}))
    if reason is RefusalReason.EXEMPTION_UNKNOWN:
        label = ("gpuguard.io/exempt", "true")
        policy = dataclasses.replace(
            POLICY, limits=dataclasses.replace(POLICY.limits, exempt_label=label)
        )
    lock = FakeNodeLock(holder_pid=4242) if reason is RefusalReason.LOCK_HELD else None
    if reason is RefusalReason.UNASSIGNED_DEVICE:
        from gpuguard.core.model import LimitPolicy

        policy = dataclasses.replace(POLICY, limits=LimitPolicy(sources=("gpuguard", "gpushare")))
    w = World(policy=policy, prometheus=True, blocked=blocked, lock=lock)
    SCENARIOS[reason](w)
    await w.run(30)
    got = w.registry.get_sample_value("gpuguard_refusals_total", {"reason": reason.value})
    assert got is not None
    assert got >= 1, f"{reason} never counted"
    if reason is RefusalReason.UNASSIGNED_DEVICE:
        # Not a refusal to act: a pin (tenant-writable) never lifts a limit.
        assert {(t.pod.name, t.gpu_index, t.limit_bytes) for t, _ in w.killer.calls} == {
            ("pod-3", 0, 2 * GiB)
        }
        assert [e.reason for e in w.events.events].count(EventReason.UNASSIGNED_DEVICE) == 1


async def test_a_violation_of_a_dra_share_asks_the_pod_directory_to_read_its_claims_again() -> None:
    from gpuguard.core.model import Declaration, DraShare, LimitPolicy, LimitSource

    share = DraShare(
        claim_namespace="team", claim_name="c1", request="gpu", driver="gpu.nvidia.com",
        pool="node-1", device="gpu-0", share_id="s1", memory_bytes=4 * GiB, uuid=G0.uuid,
    )  # fmt: skip
    policy = dataclasses.replace(POLICY, limits=LimitPolicy(sources=("gpuguard", "dra")))
    w = World(policy=policy)
    declared = {LimitSource.DRA: Declaration(where="claims", shares=(share,), read_at=-1.0)}
    w.pods.pods = [dataclasses.replace(pod(1), declared=declared)]
    w.gpu.processes = [proc(101, G0, 6 * GiB)]
    await w.run(8)
    assert w.killer.calls == [], "never on a claim read before the violation was due"
    asked = {uid for r in w.pods.rereads for uid in r}
    assert asked == {pod(1).uid}
    moment = w.pods.rereads[0][pod(1).uid]
    assert all(r == {pod(1).uid: moment} for r in w.pods.rereads), "one moment, asked again"

    w.pods.pods = [dataclasses.replace(pod(1), declared={LimitSource.DRA: dataclasses.replace(
        declared[LimitSource.DRA], read_at=moment + 0.01)})]  # fmt: skip
    await w.run(2)
    assert [(t.pod.name, s) for t, s in w.killer.calls] == [("pod-1", StopSignal.TERM)]
