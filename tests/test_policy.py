"""decide(): every branch, as tables and short scripted timelines.

Covers: persistence (two fresh samples and the grace period), the graduated stop (Event →
SIGTERM → timeout → SIGKILL → re-measure → give up), audit mode, every refusal reason, limits
summed per pod per device (not across devices), neighbours and host processes never targeted,
PID reuse while NVML keeps listing, and staleness of GPU and pod data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest

from gpuguard.core.model import (
    LIMIT_ANNOTATION,
    Attribution,
    DeviceKey,
    DeviceMemory,
    DeviceSkip,
    EventReason,
    GpuDevice,
    LimitPolicy,
    LimitSource,
    LimitValue,
    ListingDue,
    Mode,
    NamespacePolicy,
    Pod,
    PodSnapshot,
    RefusalReason,
    StopSignal,
    Trigger,
)
from gpuguard.core.policy import EnforcerState, Phase, UsageState, decide
from tests.fakes import GiB, MiB, attr, gpu, mig_gpu, pod, proc, sample, snapshot, uid
from tests.policy_timeline import G0, G1, NODE, POLICY, Timeline


def greedy_timeline(**policy_overrides: Any) -> Timeline:
    return Timeline(
        devices=[G0, G1],
        pods=[pod(1, limit=10 * GiB), pod(2, limit=10 * GiB)],
        attributions={101: attr(101, pod_n=1), 201: attr(201, pod_n=2)},
        policy=replace(POLICY, **policy_overrides),
    )


def test_one_sample_over_the_limit_is_not_enough() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    d = t.step([proc(101, G0, 12 * GiB)])
    assert d.signals == ()
    assert d.usages[0].state is UsageState.OVER


def test_two_fresh_samples_within_the_grace_period_are_not_enough() -> None:
    t = greedy_timeline(grace_seconds=5.0)
    for _ in range(5):  # first over sample at +1 s; 4 s of grace elapsed after five samples
        t.step([proc(101, G0, 12 * GiB)], dt=1.0)
    assert t.signals() == []
    t.step([proc(101, G0, 12 * GiB)], dt=1.0)
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_the_same_sample_seen_twice_counts_once() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.step([proc(101, G0, 12 * GiB)])
    d = t.step([proc(101, G0, 12 * GiB)], new_sample=False)
    assert d.signals == ()


def test_full_escalation_event_term_kill_then_gives_up_once() -> None:
    t = greedy_timeline()
    over = [proc(101, G0, 12 * GiB), proc(201, G0, 5 * GiB)]
    t.step(over)
    t.step(over)
    d = t.step(over)  # 2 s after the first over sample: grace elapsed, 3 samples
    assert [(a.target.pod.name, a.signal) for a in d.signals] == [("pod-1", StopSignal.TERM)]
    assert [e.reason for e in d.events] == [EventReason.LIMIT_EXCEEDED]
    assert d.violations == (Trigger.GRACE,)
    t.step(over, dt=1.0)
    t.step(over, dt=1.0)
    assert t.signals()[-1] == ("pod-1", StopSignal.TERM)
    d = t.step(over, dt=1.0)  # 3 s after TERM
    assert [(a.target.pod.name, a.signal) for a in d.signals] == [("pod-1", StopSignal.KILL)]
    for _ in range(3):
        t.step(over, dt=1.0)
    assert t.refusals().count(RefusalReason.KILL_INEFFECTIVE) == 1
    for _ in range(5):
        t.step(over, dt=1.0)
    assert t.refusals().count(RefusalReason.KILL_INEFFECTIVE) == 1
    assert t.signals().count(("pod-1", StopSignal.KILL)) == 1
    assert all(name == "pod-1" for name, _ in t.signals())


def test_a_container_restarted_mid_escalation_gets_a_sigterm_not_a_carried_sigkill() -> None:
    """The escalation is per pod and GPU; its SIGKILL once went to whichever containers were
    charged when the termination timeout ran out, so a restarted container (new ID, new process,
    the pod still over its limit) was SIGKILLed without a SIGTERM (found by
    tests/integration/test_faults.py::test_f_...)."""
    t = Timeline(
        devices=[G0],
        pods=[pod(1, limit=10 * GiB, containers=2)],
        attributions={101: attr(101, pod_n=1, container=0), 102: attr(102, pod_n=1, container=1)},
    )
    old = [proc(101, G0, 12 * GiB)]
    for _ in range(3):
        t.step(old)
    restarted = [proc(102, G0, 12 * GiB)]  # the old container's process is gone
    for _ in range(3):
        t.step(restarted, dt=1.0)  # 3 s after SIGTERM: the timeout ran out
    for _ in range(3):
        t.step(restarted, dt=1.0)  # 3 s after the new container's SIGTERM
    sent = [(a.target.container_name, a.signal) for d in t.decisions for a in d.signals]
    assert sent == [("c0", StopSignal.TERM), ("c1", StopSignal.TERM), ("c1", StopSignal.KILL)]


def test_no_sigkill_once_usage_falls_under_the_limit_after_sigterm() -> None:
    t = greedy_timeline()
    over = [proc(101, G0, 12 * GiB)]
    for _ in range(3):
        t.step(over)
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    for _ in range(5):
        t.step([proc(101, G0, 2 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    assert t.state.tracks == {}


def test_sigkill_waits_for_a_sample_taken_after_sigterm() -> None:
    t = greedy_timeline()
    over = [proc(101, G0, 12 * GiB)]
    for _ in range(3):
        t.step(over)
    # The GPU source stalls: the same old sample, long past the timeout, must not escalate.
    d = t.step(over, dt=4.0, new_sample=False, sample_age=4.0)
    assert d.signals == ()


def test_limits_apply_per_device_not_summed_across_devices() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    for _ in range(3):
        t.step([proc(101, G0, 6 * GiB), proc(102, G1, 6 * GiB)])
    assert t.signals() == []


def test_limits_sum_every_process_of_the_pod_on_one_device() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[102] = attr(102, pod_n=1, start=2000)
    for _ in range(2):
        t.step([proc(101, G0, 6 * GiB), proc(102, G0, 6 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_the_neighbour_on_the_same_gpu_is_never_targeted() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    for _ in range(10):
        t.step([proc(101, G0, 30 * GiB), proc(201, G0, 9 * GiB)])
    assert {name for name, _ in t.signals()} == {"pod-1"}


def test_targets_every_container_of_the_pod_that_uses_the_device() -> None:
    t = Timeline(
        devices=[G0],
        pods=[pod(1, limit=10 * GiB, containers=2)],
        attributions={101: attr(101, pod_n=1, container=0), 102: attr(102, pod_n=1, container=1)},
        policy=replace(POLICY, grace_seconds=0.0),
    )
    t.step([proc(101, G0, 6 * GiB), proc(102, G0, 6 * GiB)])
    d = t.step([proc(101, G0, 6 * GiB), proc(102, G0, 6 * GiB)])
    assert sorted(a.target.container_name or "" for a in d.signals) == ["c0", "c1"]


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        pytest.param(
            lambda t: t.pods.__setitem__(0, replace(t.pods[0], namespace="platform")),
            RefusalReason.EXEMPT,
            id="exempt-namespace",
        ),
        pytest.param(
            lambda t: setattr(t, "policy", replace(t.policy, self_pod_uid=uid(1))),
            RefusalReason.EXEMPT,
            id="gpuguard-own-pod",
        ),
        pytest.param(
            lambda t: setattr(t, "policy", replace(t.policy, mode=Mode.AUDIT)),
            RefusalReason.AUDIT_MODE,
            id="audit-mode",
        ),
        pytest.param(
            lambda t: setattr(
                t,
                "policy",
                replace(
                    t.policy,
                    limits=replace(
                        t.policy.limits, namespaces={"team": NamespacePolicy(mode=Mode.AUDIT)}
                    ),
                ),
            ),
            RefusalReason.AUDIT_MODE,
            id="namespace-audit-mode",
        ),
        pytest.param(
            lambda t: t.attributions.__setitem__(
                101, replace(t.attributions[101], container_id=None, cgroup=None)
            ),
            RefusalReason.NO_CONTAINER,
            id="no-container",
        ),
    ],
)
def test_confirmed_violation_is_refused_with_a_reason(
    setup: Callable[[Timeline], object], reason: RefusalReason
) -> None:
    t = greedy_timeline(grace_seconds=0.0)
    setup(t)
    for _ in range(6):
        t.step([proc(101, t.devices[0], 12 * GiB)])
    assert t.signals() == []
    assert t.refusals() == [reason]  # once, not every poll
    assert sum(len(d.violations) for d in t.decisions) == 1


LABEL = ("gpuguard.io/exempt", "true")


@pytest.mark.parametrize(
    ("labelled", "contact_age", "signalled", "reasons"),
    [
        pytest.param(frozenset({"team"}), 1.0, False, [RefusalReason.EXEMPT], id="labelled"),
        pytest.param(frozenset({"other"}), 1.0, True, [], id="not-labelled"),
        pytest.param(None, None, False, [RefusalReason.EXEMPTION_UNKNOWN], id="not-listed-yet"),
        # Older than the staleness bound (5 s here): the label may have been set since.
        pytest.param(
            frozenset({"other"}), 6.0, False, [RefusalReason.EXEMPTION_UNKNOWN], id="stale"
        ),
    ],
)
def test_a_namespace_exempt_by_the_admins_label_is_never_stopped_and_unknown_labels_never_are(
    labelled: frozenset[str] | None,
    contact_age: float | None,
    signalled: bool,
    reasons: list[RefusalReason],
) -> None:
    """An exemption by the admin's namespace label: a labelled namespace's pod is exempt, an
    unlabelled one's is stopped, and while the labels are unknown (not listed yet, or not heard
    from within the staleness bound) the violation is refused ``exemption_unknown``: not
    knowing is never "not exempt"."""
    t = greedy_timeline(grace_seconds=0.0)
    t.policy = replace(t.policy, limits=replace(t.policy.limits, exempt_label=LABEL))
    for _ in range(6):
        pods = replace(
            snapshot(t.pods, contact=t.now + 1),
            labelled_namespaces=labelled,
            namespaces_contact_at=None if contact_age is None else t.now + 1 - contact_age,
        )
        t.step([proc(101, t.devices[0], 12 * GiB)], pods=pods)
    assert bool(t.signals()) is signalled
    assert t.refusals() == reasons


def test_a_pod_whose_mps_client_runs_where_the_admin_declared_mps_is_refused_mps() -> None:
    mps = gpu(0, mps=True)
    t = greedy_timeline(grace_seconds=0.0, mps_gpus=frozenset({str(mps.uuid)}))
    t.devices = [mps]
    for _ in range(6):
        t.step([proc(101, mps, 12 * GiB, mps=True)])
    assert t.signals() == []
    assert t.refusals() == [RefusalReason.MPS]


@pytest.mark.parametrize("declared", [frozenset(), frozenset({str(gpu(1).uuid)})], ids=str)
def test_a_tenants_own_mps_client_never_refuses_a_violation_where_mps_is_not_declared(
    declared: frozenset[str],
) -> None:
    """A tenant's MPS daemon of its own (undeclared here; declared only on another GPU): its
    100 MiB client does not spare the neighbour's 20 GiB over 10, nor the tenant's own 30 GiB
    ordinary process, nor the client itself, which is charged to its pod like any process."""
    mps = gpu(0, mps=True)
    t = greedy_timeline(grace_seconds=0.0, mps_gpus=declared)
    t.devices = [mps, G1]
    t.attributions[102] = attr(102, pod_n=1, start=2000)
    listing = [proc(101, mps, 30 * GiB), proc(102, mps, 100 * MiB, mps=True)]
    for _ in range(3):
        t.step([*listing, proc(201, mps, 20 * GiB)])
    assert sorted(t.signals()) == [("pod-1", StopSignal.TERM), ("pod-2", StopSignal.TERM)]
    assert RefusalReason.MPS not in t.refusals()
    usage = {u.pod.name: u.used_bytes for u in t.decisions[-1].usages}
    assert usage["pod-1"] == 30 * GiB + 100 * MiB


def test_on_a_declared_mps_gpu_only_the_pods_with_an_mps_client_are_spared() -> None:
    """Declared MPS spares the clients (killing one can corrupt the others), never a
    neighbour's ordinary process on the same GPU."""
    mps = gpu(0, mps=True)
    t = greedy_timeline(grace_seconds=0.0, mps_gpus=frozenset({"all"}))
    t.devices = [mps]
    for _ in range(3):
        t.step([proc(101, mps, 12 * GiB, mps=True), proc(201, mps, 20 * GiB)])
    assert t.signals() == [("pod-2", StopSignal.TERM)]
    assert t.refusals() == [RefusalReason.MPS]


def test_audit_mode_reports_what_enforce_would_send() -> None:
    t = greedy_timeline(grace_seconds=0.0, mode=Mode.AUDIT)
    t.step([proc(101, G0, 12 * GiB)])
    d = t.step([proc(101, G0, 12 * GiB)])
    assert d.signals == ()
    assert d.events == ()
    assert [(a.target.pod.name, a.signal) for a in d.would_signal] == [("pod-1", StopSignal.TERM)]


def test_unknown_usage_in_the_pod_blocks_any_signal() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[102] = attr(102, pod_n=1, start=5)
    for _ in range(5):
        t.step([proc(101, G0, 12 * GiB), proc(102, G0, None)])
    assert t.signals() == []
    assert t.refusals() == [RefusalReason.USAGE_UNKNOWN]
    assert t.decisions[-1].usages[0].state is UsageState.UNKNOWN


@pytest.mark.parametrize(
    ("attribution", "reason"),
    [
        pytest.param(attr(101, pod_n=None), RefusalReason.NOT_A_POD, id="host-process"),
        pytest.param(attr(101, pod_n=None, ghost=True), RefusalReason.GHOST, id="ghost"),
        pytest.param(attr(101, pod_n=7), RefusalReason.POD_UNKNOWN, id="pod-not-on-node"),
        pytest.param(
            attr(101, pod_n=1, holds_gpu=False),
            RefusalReason.IDENTITY_CHANGED,
            id="occupant-without-gpu-open",
        ),
    ],
)
def test_memory_no_pod_can_be_charged_for_is_reported_never_signalled(
    attribution: Attribution, reason: RefusalReason
) -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[101] = attribution
    for _ in range(5):
        d = t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []
    assert d.unattributed_bytes[G0.key] == 50 * GiB
    assert t.refusals() == [reason]


def test_a_process_that_closed_its_gpu_files_is_charged_once_nvml_keeps_listing_it() -> None:
    # An escape seen on an H200: a process closed every /dev/nvidia<N> file and kept its
    # 100 GiB. The enforcer starts after the close (a restart: nothing seen before), so the fd
    # check never said True: once NVML has kept listing the PID with the same live process
    # behind it for longer than the driver keeps a dead process's entry, it is charged.
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=3.0)
    t.attributions[101] = replace(attr(101, pod_n=1, holds_gpu=False), started_at=50.0)
    first = t.step([proc(101, G0, 50 * GiB)])
    assert first.unattributed_bytes[G0.key] == 50 * GiB  # not yet: it may be a reused PID
    (why,) = first.refusals
    assert why.reason is RefusalReason.IDENTITY_CHANGED
    assert "holds no GPU device file" in why.detail
    assert "once NVML has kept listing it for 3 s" in why.detail
    for _ in range(5):
        t.step([proc(101, G0, 50 * GiB)], dt=1.0)
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    assert t.decisions[-1].unattributed_bytes[G0.key] == 0


def test_a_process_without_gpu_files_is_not_charged_before_its_listing_settles() -> None:
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=3.0)
    t.attributions[101] = attr(101, pod_n=1, holds_gpu=False)
    for _ in range(3):  # listed at +1, +2, +3 s: 2 s < 3 s
        d = t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []
    assert d.unattributed_bytes[G0.key] == 50 * GiB
    t.step([])  # NVML dropped it (a dead predecessor's entry): the clock starts again
    for _ in range(3):
        d = t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []
    assert d.unattributed_bytes[G0.key] == 50 * GiB


def test_a_pid_whose_occupant_started_after_its_first_listing_is_never_charged() -> None:
    # The first listing showed a dead process's memory (a forked child keeps it listed), and
    # the kernel handed the PID to a pod-2 process before the enforcer first read /proc: the
    # identity never changed in the enforcer's eyes, but the occupant started after the
    # listing, so it cannot own what the listing showed, however long it stays listed.
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=3.0)
    late = t.now + 1.01  # listed at +1 s, started 10 ms later
    t.attributions[101] = replace(attr(101, pod_n=2, holds_gpu=False), started_at=late)
    for _ in range(10):
        d = t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []
    assert 101 in t.state.tainted
    assert d.unattributed_bytes[G0.key] == 50 * GiB
    assert RefusalReason.IDENTITY_CHANGED in t.refusals()


def test_an_occupant_with_a_gpu_file_open_that_started_after_the_listing_is_not_charged() -> None:
    # The start-time rule holds whatever the fd check says: a new process can open the GPU too.
    t = greedy_timeline(grace_seconds=0.0)
    late = t.now + 1.01  # listed at +1 s, started 10 ms later
    t.attributions[101] = replace(attr(101, pod_n=2), started_at=late)
    for _ in range(5):
        t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []


def test_a_pid_reused_while_nvml_keeps_listing_it_is_never_charged() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[101] = attr(101, pod_n=None, ghost=True)  # owner died; NVML still lists it
    t.step([proc(101, G0, 50 * GiB)])
    t.attributions[101] = attr(101, pod_n=2, start=99999)  # the PID now belongs to pod-2
    for _ in range(6):
        d = t.step([proc(101, G0, 50 * GiB)])
    assert t.signals() == []
    assert RefusalReason.IDENTITY_CHANGED in t.refusals()
    assert d.unattributed_bytes[G0.key] == 50 * GiB
    # Once NVML stops listing the PID, the taint is forgotten.
    t.step([])
    assert 101 not in t.state.tainted


def test_a_pid_whose_starttime_changed_between_samples_is_tainted() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.step([proc(101, G0, 50 * GiB)])
    t.attributions[101] = attr(101, pod_n=1, start=424242)
    for _ in range(4):
        t.step([proc(101, G0, 50 * GiB)])
    # pod-1's first sample started a violation, but the charged PID changed hands: no signal.
    assert t.signals() == []


@pytest.mark.parametrize(
    ("pods", "reason"),
    [
        pytest.param(
            lambda now: snapshot([pod(1, limit=GiB)], synced=False, contact=now),
            RefusalReason.POD_CACHE_UNSYNCED,
            id="unsynced",
        ),
        pytest.param(
            lambda now: snapshot([pod(1, limit=GiB)], contact=now - 6.0),
            RefusalReason.POD_CACHE_STALE,
            id="api-silent-past-bound",
        ),
        pytest.param(
            lambda now: snapshot([pod(1, limit=GiB)], contact=None),
            RefusalReason.POD_CACHE_STALE,
            id="never-contacted",
        ),
    ],
)
def test_no_signal_without_a_synced_fresh_pod_cache(
    pods: Callable[[float], PodSnapshot], reason: RefusalReason
) -> None:
    t = greedy_timeline(grace_seconds=0.0)
    for _ in range(5):
        d = t.step([proc(101, G0, 12 * GiB)], pods=pods(t.now + 1.0))
    assert t.signals() == []
    assert d.inactive_reason is reason
    assert not d.enforcement_active
    assert t.refusals() == [reason]


def test_no_signal_on_a_gpu_sample_older_than_the_bound() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    for _ in range(5):
        d = t.step([proc(101, G0, 12 * GiB)], sample_age=5.5)
    assert t.signals() == []
    assert d.inactive_reason is RefusalReason.DATA_STALE


def test_a_sample_in_which_no_gpu_could_be_read_is_not_active_enforcement() -> None:
    # nvml.fail_on_init_error = false: while NVML cannot start, the null source's sample lists
    # no device and says why. It used to read as "no GPU, nothing to do": active and ready.
    null = replace(
        sample(1, 100.0, [], []),
        skipped=(DeviceSkip(uuid=None, index=None, reason="nvml_unavailable: not found"),),
    )
    d = decide(
        sample=null,
        attributions={},
        pods=snapshot([], contact=100.0),
        node=NODE,
        policy=POLICY,
        state=EnforcerState(),
        now=100.0,
    )
    assert not d.enforcement_active
    assert d.inactive_reason is RefusalReason.DATA_STALE
    # A node with GPUs and no GPU process is active: nothing was skipped.
    healthy = decide(
        sample=sample(1, 100.0, [G0], []),
        attributions={},
        pods=snapshot([], contact=100.0),
        node=NODE,
        policy=POLICY,
        state=EnforcerState(),
        now=100.0,
    )
    assert healthy.enforcement_active


def test_no_sample_at_all_is_stale_data() -> None:
    d = decide(
        sample=None,
        attributions={},
        pods=snapshot([]),
        node=NODE,
        policy=POLICY,
        state=EnforcerState(),
        now=1.0,
    )
    assert d.inactive_reason is RefusalReason.DATA_STALE
    assert d.signals == ()


def test_open_violations_are_refused_when_enforcement_pauses() -> None:
    t = greedy_timeline(grace_seconds=10.0)
    t.step([proc(101, G0, 12 * GiB)])
    t.step([proc(101, G0, 12 * GiB)], pods=snapshot(t.pods, synced=False))
    assert t.refusals() == [RefusalReason.POD_CACHE_UNSYNCED]


def test_enforcement_resumes_after_the_pod_cache_recovers() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    for _ in range(3):
        t.step([proc(101, G0, 12 * GiB)], pods=snapshot(t.pods, contact=None))
    assert t.signals() == []
    t.step([proc(101, G0, 12 * GiB)])
    assert t.signals() == []  # paused samples never count: two fresh ones are needed again
    t.step([proc(101, G0, 12 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_invalid_annotation_falls_back_to_the_default_with_one_event() -> None:
    t = Timeline(
        devices=[G0],
        pods=[pod(1, error="'8GB' is not a quantity")],
        attributions={101: attr(101, pod_n=1)},
        policy=replace(
            POLICY,
            grace_seconds=0.0,
            limits=LimitPolicy(cluster_default=LimitValue(limit_bytes=4 * GiB)),
        ),
    )
    for _ in range(3):
        t.step([proc(101, G0, 6 * GiB)])
    events = [e.reason for d in t.decisions for e in d.events]
    assert events.count(EventReason.INVALID_LIMIT) == 1
    assert t.decisions[-1].usages[0].limit.source is LimitSource.DEFAULT
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_invalid_annotation_without_default_never_means_kill() -> None:
    t = Timeline(
        devices=[G0],
        pods=[pod(1, error="bad")],
        attributions={101: attr(101, pod_n=1)},
        policy=replace(POLICY, grace_seconds=0.0),
    )
    for _ in range(4):
        t.step([proc(101, G0, 70 * GiB)])
    assert t.signals() == []
    assert t.decisions[-1].usages[0].state is UsageState.UNLIMITED


def test_mig_instances_are_separate_enforcement_units() -> None:
    a, b = mig_gpu(0, 1), mig_gpu(0, 2)
    t = Timeline(
        devices=[a, b],
        pods=[pod(1, limit=4 * GiB)],
        attributions={101: attr(101, pod_n=1), 102: attr(102, pod_n=1, start=7)},
        policy=replace(POLICY, grace_seconds=0.0),
    )
    for _ in range(3):
        t.step([proc(101, a, 3 * GiB), proc(102, b, 3 * GiB)])
    assert t.signals() == []
    t.step([proc(101, a, 5 * GiB), proc(102, b, 3 * GiB)])
    d = t.step([proc(101, a, 5 * GiB), proc(102, b, 3 * GiB)])
    assert [(s.target.device.gpu_instance_id, s.signal) for s in d.signals] == [
        (1, StopSignal.TERM)
    ]


def test_a_refused_violation_is_reconsidered_when_the_reason_goes_away() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[102] = attr(102, pod_n=1, start=5)
    for _ in range(3):
        t.step([proc(101, G0, 12 * GiB), proc(102, G0, None)])
    assert t.state.tracks[(uid(1), G0.key)].phase is Phase.REFUSED
    for _ in range(2):
        t.step([proc(101, G0, 12 * GiB), proc(102, G0, GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_memory_a_forked_child_holds_after_its_parent_died_stays_charged_to_the_container() -> None:
    """NVML lists the dead parent's PID while the child holds the memory (docs/design.md,
    Attribution and process ownership): the PID's last attribution carries over, so the container is
    still stopped."""
    t = greedy_timeline(grace_seconds=0.0)
    t.step([proc(101, G0, 6 * GiB)])
    t.attributions[101] = attr(101, pod_n=None, ghost=True)  # parent exited, child holds on
    t.step([proc(101, G0, 12 * GiB)])
    d = t.step([proc(101, G0, 12 * GiB)])
    assert [(a.target.pod.name, a.signal) for a in d.signals] == [("pod-1", StopSignal.TERM)]
    assert d.unattributed_bytes[G0.key] == 0


def test_a_ghost_never_seen_alive_is_never_charged() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.attributions[101] = attr(101, pod_n=None, ghost=True)
    for _ in range(4):
        t.step([proc(101, G0, 12 * GiB)])
    assert t.signals() == []


def test_a_remembered_ghost_pid_reused_by_another_pod_is_tainted() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    t.step([proc(101, G0, 6 * GiB)])
    t.attributions[101] = attr(101, pod_n=None, ghost=True)
    t.step([proc(101, G0, 6 * GiB)])
    t.attributions[101] = attr(101, pod_n=2, start=5555)
    for _ in range(4):
        t.step([proc(101, G0, 12 * GiB)])
    assert t.signals() == []
    assert 101 not in t.state.remembered


def test_a_ghost_of_a_process_that_hid_its_gpu_files_is_charged_to_its_pod_once_settled() -> None:
    """A process whose GPU files no fd check saw (a thread with its own file table) forks a
    child that keeps its context and exits within the settle time: its PID is a ghost nobody
    holds, so once it has been listed for the settle time it is charged to the pod it was last
    attributed to, never left unattributed for good."""
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=5.0)
    t.attributions[101] = replace(attr(101, pod_n=1, holds_gpu=False), started_at=50.0)
    for _ in range(2):
        t.step([proc(101, G0, 20 * GiB)])
    t.attributions[101] = attr(101, pod_n=None, ghost=True)  # exited; its child holds on
    d = t.step([proc(101, G0, 20 * GiB)])
    assert d.signals == ()
    assert d.unattributed_bytes[G0.key] == 20 * GiB
    assert [r.reason for r in d.refusals] == []  # its identity_changed refusal was reported once
    for _ in range(4):
        d = t.step([proc(101, G0, 20 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    assert d.unattributed_bytes[G0.key] == 0


def test_a_pod_rotating_short_lived_processes_without_gpu_files_is_charged() -> None:
    """Four 5 GiB processes, each alive 4 s (under the 5 s settle), started one a second: no
    PID ever settles, but the pod has been listed for the settle time, so its processes are
    charged and the pod is stopped (before: 20 GiB held against 10 GiB with nothing charged)."""
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=5.0)
    alive: dict[int, float] = {}
    for second in range(12):
        pid = 1000 + second
        t.attributions[pid] = replace(
            attr(pid, pod_n=1, start=pid, holds_gpu=False), started_at=t.now + 0.5
        )
        alive[pid] = t.now + 4.5
        alive = {p: end for p, end in alive.items() if end > t.now + 1.0}
        t.step([proc(p, G0, 5 * GiB) for p in sorted(alive)])
    assert ("pod-1", StopSignal.TERM) in t.signals()
    assert {name for name, _ in t.signals()} == {"pod-1"}


def test_a_settled_pod_never_makes_a_late_occupant_of_a_listed_pid_its_own() -> None:
    """pod-2 has been a GPU user for long (its pod run is settled): a pod-2 process handed a
    PID after NVML first listed it (a dead process's memory) is still never charged for it."""
    t = greedy_timeline(grace_seconds=0.0, owner_settle_seconds=3.0)
    t.attributions[201] = attr(201, pod_n=2)
    late = t.now + 1.01
    t.attributions[301] = replace(attr(301, pod_n=2, start=9, holds_gpu=False), started_at=late)
    for _ in range(10):
        t.step([proc(201, G0, 1 * GiB), proc(301, G0, 50 * GiB)])
    assert t.signals() == []
    assert 301 in t.state.tainted


def test_invalid_annotation_event_also_for_pods_not_using_a_gpu_and_again_on_a_new_value() -> None:
    t = Timeline(devices=[G0], pods=[pod(1, error="'8GB' is not a quantity")], attributions={})
    t.pods[0] = replace(t.pods[0], annotations={LIMIT_ANNOTATION: "8GB"})
    for _ in range(3):
        t.step([])
    t.pods[0] = replace(t.pods[0], annotations={LIMIT_ANNOTATION: "8 Gi"})
    t.step([])
    events = [e for d in t.decisions for e in d.events]
    assert [e.reason for e in events] == [EventReason.INVALID_LIMIT] * 2
    assert "no limit applies" in events[0].message


def test_a_pod_rewriting_its_invalid_annotation_keeps_one_note_and_each_new_value_one_event() -> (
    None
):
    """A live pod rewriting its limit annotation to a new invalid value each time used to add a
    note per value, kept until the pod was gone (4000 values: 4000 notes, ``decide()`` 25x
    slower). One note per pod and source: each new value is reported once, seeing it again is
    not, and the notes stay one however many values the pod went through."""
    t = Timeline(devices=[G0], pods=[pod(1, error="not a quantity")], attributions={})
    posted = 0
    for n in range(4000):
        t.pods[0] = replace(t.pods[0], annotations={LIMIT_ANNOTATION: f"{n}GB"})
        first = t.step([])
        again = t.step([])
        new = [e for e in first.events if e.reason is EventReason.INVALID_LIMIT]
        assert len(new) == 1, f"value {n}GB: {new}"
        assert not [e for e in again.events if e.reason is EventReason.INVALID_LIMIT]
        posted += len(new)
        assert len(t.state.reported_once) == 1, sorted(t.state.reported_once)[:3]
    assert posted == 4000
    t.pods[0] = replace(t.pods[0], annotations={LIMIT_ANNOTATION: "8Gi"}, annotation_error=None)
    t.step([])
    assert t.state.reported_once == frozenset()


def test_limit_raised_during_escalation_aborts_it_before_sigkill() -> None:
    """docs/reliability.md I8: every signal is re-decided on fresh data and the current limit."""
    t = greedy_timeline()
    over = [proc(101, G0, 12 * GiB)]
    for _ in range(3):
        t.step(over)
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    t.pods[0] = pod(1, limit=16 * GiB)  # the owner raised the annotation
    for _ in range(6):
        t.step(over)
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    assert t.state.tracks == {}


def test_grace_running_out_while_the_gpu_source_stalls_does_not_confirm() -> None:
    t = greedy_timeline(grace_seconds=3.0)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over)
    t.step(over)
    for _ in range(4):  # NVML stalls: the runtime keeps deciding on its last sample
        t.step(over, new_sample=False)
    assert t.signals() == []
    t.step(over)  # a new sample, still over, grace long gone: now it is confirmed
    assert t.signals() == [("pod-1", StopSignal.TERM)]


# ---------------------------------------------------------------------------------------------
# Change-driven sampling (per-device listings) and device pressure

TOTAL = G0.total_bytes


def mem(free_fraction: float, device: GpuDevice = G0) -> dict[DeviceKey, DeviceMemory]:
    free = int(device.total_bytes * free_fraction)
    return {
        device.key: DeviceMemory(
            total_bytes=device.total_bytes, used_bytes=device.total_bytes - free, free_bytes=free
        )
    }


PRESSED = mem(0.01)  # 1 % free: below the 5 % default
ROOMY = mem(0.5)


@pytest.mark.parametrize(
    ("memory", "fraction", "signalled", "trigger"),
    [
        pytest.param(PRESSED, 0.05, True, Trigger.PRESSURE, id="1% free under 5%: no grace"),
        pytest.param(mem(0.049), 0.05, True, Trigger.PRESSURE, id="4.9% free under 5%"),
        pytest.param(mem(0.05), 0.05, False, None, id="exactly 5% free is not pressure"),
        pytest.param(ROOMY, 0.05, False, None, id="half free: grace applies"),
        pytest.param(PRESSED, 0.0, False, None, id="pressure off (fraction 0)"),
        pytest.param({}, 0.05, False, None, id="memory not read: grace applies"),
        pytest.param(mem(0.01, G1), 0.05, False, None, id="pressure on another device"),
    ],
)
def test_pressure_skips_the_grace_period_at_the_second_fresh_listing(
    memory: Mapping[DeviceKey, DeviceMemory],
    fraction: float,
    signalled: bool,
    trigger: Trigger | None,
) -> None:
    t = greedy_timeline(grace_seconds=10.0, pressure_free_fraction=fraction)
    over = [proc(101, G0, 12 * GiB), proc(201, G0, 5 * GiB)]
    first = t.step(over, dt=0.05, memory=memory)
    assert first.signals == ()
    d = t.step(over, dt=0.05, memory=memory)
    if not signalled:
        assert d.signals == ()
        assert d.violations == ()
        return
    assert [(a.target.pod.name, a.signal, a.trigger) for a in d.signals] == [
        ("pod-1", StopSignal.TERM, trigger)
    ]
    assert d.violations == (trigger,)
    (event,) = d.events
    assert event.reason is EventReason.LIMIT_EXCEEDED
    assert "memory pressure" in event.message
    assert "grace period skipped" in event.message


def test_under_pressure_one_listing_is_never_enough_however_full_the_device() -> None:
    t = greedy_timeline(grace_seconds=10.0)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over, memory=mem(0.0))
    # The device fills completely; the fast read runs every tick but the listing is carried.
    for _ in range(5):
        d = t.step(over, dt=0.05, memory=mem(0.0), carried=(G0,))
        assert d.signals == ()
        due = d.urgent[G0.key]
        assert due.at > t.now, "the grace period has not run out"
        assert due.now_due(t.now, mem(0.0)[G0.key]), "the device must be listed at the next tick"
    t.step(over, dt=0.05, memory=mem(0.0))
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_a_violation_in_progress_asks_for_a_listing_when_it_can_move_on_until_it_ends() -> None:
    t = greedy_timeline(grace_seconds=1.0, termination_timeout_seconds=1.5, mode=Mode.ENFORCE)
    over = [proc(101, G0, 12 * GiB)]
    first = t.step(over, dt=0.25, memory=ROOMY)
    # Its grace period runs out 1 s after the listing that first showed it over; pressure (free
    # memory under 5 % of the total) would confirm it earlier. G1 has no violation.
    assert first.urgent == {
        G0.key: ListingDue(at=t.now + 1.0, free_below_bytes=0.05 * G0.total_bytes)
    }
    assert t.step(over, dt=0.5, memory=ROOMY).urgent == first.urgent  # still in its grace
    d = t.step(over, dt=0.5, memory=ROOMY)
    assert d.signals  # SIGTERM, when it was due
    termed_at = t.now
    assert d.urgent == {G0.key: ListingDue(at=termed_at + 1.5)}  # its timeout; no pressure
    assert t.step(over, dt=0.25).urgent == {G0.key: ListingDue(at=termed_at + 1.5)}
    assert t.step([proc(101, G0, 1 * GiB)], dt=0.25).urgent == {}  # back under


def test_two_violations_on_one_device_ask_for_the_earlier_listing() -> None:
    t = greedy_timeline(grace_seconds=2.0, termination_timeout_seconds=3.0)
    t.step([proc(101, G0, 12 * GiB)], memory=ROOMY)
    first_at = t.now
    d = t.step([proc(101, G0, 12 * GiB), proc(201, G0, 11 * GiB)], dt=0.5, memory=ROOMY)
    assert d.urgent == {
        G0.key: ListingDue(at=first_at + 2.0, free_below_bytes=0.05 * G0.total_bytes)
    }


def test_a_listing_taken_when_urgent_says_moves_the_violation_on_and_none_earlier_does() -> None:
    """``urgent`` is a promise to change-driven sampling: a listing before its time moves
    nothing on (so skipping it loses nothing), the first one at its time does."""
    t = greedy_timeline(grace_seconds=2.0, termination_timeout_seconds=3.0)
    over = [proc(101, G0, 12 * GiB)]
    due = t.step(over, memory=ROOMY).urgent[G0.key]
    while t.now + 0.25 < due.at:
        assert t.step(over, dt=0.25, memory=ROOMY).signals == ()
    d = t.step(over, dt=due.at - t.now, memory=ROOMY)
    assert [a.signal for a in d.signals] == [StopSignal.TERM]
    due = d.urgent[G0.key]
    while t.now + 0.25 < due.at:
        assert t.step(over, dt=0.25).signals == ()
    assert [a.signal for a in t.step(over, dt=due.at - t.now).signals] == [StopSignal.KILL]


def test_a_refused_violation_does_not_keep_its_device_listed_fast() -> None:
    t = greedy_timeline(grace_seconds=0.0, mode=Mode.AUDIT)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over)
    d = t.step(over)
    assert d.would_signal
    assert d.urgent == {}


def test_under_pressure_a_pod_under_its_limit_is_never_signalled() -> None:
    t = greedy_timeline(grace_seconds=0.0)
    # pod-2 at its limit and pod-1 below it, on a device with nothing free.
    within = [proc(101, G0, 9 * GiB), proc(201, G0, 10 * GiB)]
    for _ in range(6):
        d = t.step(within, dt=0.05, memory=mem(0.0))
        assert d.violations == ()
        assert d.urgent == {}
    assert t.signals() == []


def test_a_replayed_sample_under_pressure_does_not_confirm() -> None:
    t = greedy_timeline(grace_seconds=10.0)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over, memory=PRESSED)
    d = t.step(over, dt=0.05, memory=PRESSED, new_sample=False)
    assert d.signals == ()


def test_a_carried_listing_neither_confirms_after_grace_nor_escalates() -> None:
    t = greedy_timeline(grace_seconds=1.0, termination_timeout_seconds=1.0)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over)
    # Grace ran out, but only G1 was listed again: G0's data is as old as its listing.
    d = t.step(over, dt=2.0, carried=(G0,))
    assert d.signals == ()
    d = t.step(over, dt=0.25)
    assert [a.signal for a in d.signals] == [StopSignal.TERM]
    assert d.violations == (Trigger.GRACE,)
    # The termination timeout passes; G0 not listed since SIGTERM: no SIGKILL on old data.
    d = t.step(over, dt=2.0, carried=(G0,))
    assert d.signals == ()
    d = t.step(over, dt=0.25)
    assert [(a.signal, a.trigger) for a in d.signals] == [(StopSignal.KILL, Trigger.GRACE)]


def test_the_oldest_carried_listing_decides_staleness() -> None:
    t = greedy_timeline(grace_seconds=0.0, staleness_seconds=5.0)
    over = [proc(101, G0, 12 * GiB)]
    t.step(over)
    d = t.step(over, dt=6.0, carried=(G0,))  # G1 listed now, G0's listing is 6 s old
    assert d.signals == ()
    assert d.inactive_reason is RefusalReason.DATA_STALE
    assert d.listing_ages[G0.key] == pytest.approx(6.0)


def test_listing_ages_follow_each_devices_listing() -> None:
    t = greedy_timeline()
    t.step([])
    d = t.step([], dt=0.2, carried=(G1,))
    assert d.listing_ages == {G0.key: 0.0, G1.key: pytest.approx(0.2)}


# ---------------------------------------------------------------------------------------------
# Other schedulers' declarations


@pytest.mark.parametrize(
    ("sources", "events", "limit_source"),
    [
        (("gpuguard", "kai"), 1, LimitSource.DEFAULT),
        (("gpuguard",), 0, LimitSource.DEFAULT),
    ],
)
def test_an_invalid_declaration_of_a_listed_source_gets_one_event_and_the_default(
    sources: tuple[str, ...], events: int, limit_source: LimitSource
) -> None:
    from gpuguard.core.model import Declaration

    declared = {LimitSource.KAI: Declaration(where="annotation gpu-memory", error="'0' is zero")}
    t = Timeline(
        devices=[G0],
        pods=[replace(pod(1), declared=declared)],
        attributions={101: attr(101, pod_n=1)},
        policy=replace(
            POLICY,
            grace_seconds=0.0,
            limits=LimitPolicy(cluster_default=LimitValue(limit_bytes=4 * GiB), sources=sources),
        ),
    )
    for _ in range(3):
        t.step([proc(101, G0, 6 * GiB)])
    posted = [e for d in t.decisions for e in d.events if e.reason is EventReason.INVALID_LIMIT]
    assert len(posted) == events
    if posted:
        assert "kai declaration (annotation gpu-memory) rejected: '0' is zero" in posted[0].message
        assert "default limit 4Gi applies instead" in posted[0].message
    assert t.decisions[-1].usages[0].limit.source is limit_source
    assert t.signals() == [("pod-1", StopSignal.TERM)], "the default applies, never unlimited"


def test_a_valid_declaration_of_a_listed_source_is_enforced_and_named() -> None:
    from gpuguard.core.model import Declaration

    declared = {LimitSource.HAMI: Declaration(amount=3000, where="limits nvidia.com/gpumem")}
    t = Timeline(
        devices=[G0],
        pods=[replace(pod(1), declared=declared)],
        attributions={101: attr(101, pod_n=1)},
        policy=replace(POLICY, grace_seconds=0.0, limits=LimitPolicy(sources=("gpuguard", "hami"))),
    )
    t.step([proc(101, G0, 4 * GiB)])
    d = t.step([proc(101, G0, 4 * GiB)])
    assert d.usages[0].limit.source is LimitSource.HAMI
    assert d.usages[0].limit.limit_bytes == 3000 * 2**20
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    (exceeded,) = [e for e in d.events if e.reason is EventReason.LIMIT_EXCEEDED]
    assert "(from hami)" in exceeded.message


def _pinned_to(source: LimitSource, pinned: frozenset[str], gib: int) -> Pod:
    from gpuguard.core.model import Declaration

    amount = gib if source is LimitSource.GPUSHARE else gib * 1024
    return replace(
        pod(1), declared={source: Declaration(amount=amount, where="limits", pinned=pinned)}
    )


PINS = [
    pytest.param(LimitSource.GPUSHARE, frozenset({"index:0"}), id="gpushare"),
    pytest.param(LimitSource.HAMI, frozenset({G0.uuid}), id="hami"),
]


@pytest.mark.parametrize(("source", "pinned"), PINS)
@pytest.mark.parametrize(
    ("limits", "held", "assigned"),
    [
        pytest.param({"cluster_default": LimitValue(limit_bytes=4 * GiB)}, 4 * GiB, 30 * GiB,
                     id="the-cluster-default"),
        pytest.param({"namespaces": {"team": NamespacePolicy(max_limit=LimitValue(
                     limit_bytes=5 * GiB))}}, 5 * GiB, 5 * GiB, id="the-namespace-max"),
        pytest.param({}, 30 * GiB, 30 * GiB, id="its-own-declaration-when-nothing-else-applies"),
    ],
)  # fmt: skip
def test_memory_on_a_gpu_the_scheduler_did_not_assign_is_reported_and_held_to_a_limit(
    source: LimitSource, pinned: frozenset[str], limits: dict[str, Any], held: int, assigned: int
) -> None:
    # An escape through a self-written pin: the pod names GPU 0 (a forged pin, or a GPU it reached
    # that its scheduler did not give it) and uses 40 GiB on GPU 1: never "unlimited" there.
    t = Timeline(
        devices=[G0, G1],
        pods=[_pinned_to(source, pinned, 30), pod(2, limit=10 * GiB)],
        attributions={101: attr(101, pod_n=1), 102: attr(102, pod_n=1), 201: attr(201, pod_n=2)},
        policy=replace(
            POLICY,
            grace_seconds=0.0,
            limits=LimitPolicy(sources=("gpuguard", source.value), **limits),
        ),
    )
    over_elsewhere = [proc(101, G0, 1 * GiB), proc(102, G1, 40 * GiB), proc(201, G1, 2 * GiB)]
    for _ in range(3):
        d = t.step(over_elsewhere)
    assert t.signals() == [("pod-1", StopSignal.TERM)], "held to a limit, stopped over it"
    (usage,) = [u for u in d.usages if u.pod.name == "pod-1" and u.device == G1]
    assert usage.limit.limit_bytes == held
    (target,) = [a.target for a in t.decisions[1].signals]
    assert (target.gpu_index, target.limit_bytes) == (1, held)
    findings = [
        e for d in t.decisions for e in d.events if e.reason is EventReason.UNASSIGNED_DEVICE
    ]
    assert len(findings) == 1, "reported once per pod and GPU"
    assert f"GPU 1 ({G1.uuid}), which {source} did not assign the pod" in findings[0].message
    assert f"held here to {held // GiB}Gi" in findings[0].message
    assert t.refusals().count(RefusalReason.UNASSIGNED_DEVICE) == 1
    # On the GPU it was assigned, its declaration (capped by the max) is its limit.
    (on_g0,) = [u for u in d.usages if u.pod.name == "pod-1" and u.device == G0]
    assert (on_g0.limit.limit_bytes, on_g0.limit.source) == (assigned, source)


@pytest.mark.parametrize(("source", "pinned"), PINS)
def test_a_pod_within_its_limit_on_an_unassigned_gpu_is_reported_not_stopped(
    source: LimitSource, pinned: frozenset[str]
) -> None:
    t = Timeline(
        devices=[G0, G1],
        pods=[_pinned_to(source, pinned, 2)],
        attributions={101: attr(101, pod_n=1), 102: attr(102, pod_n=1)},
        policy=replace(
            POLICY,
            grace_seconds=0.0,
            limits=LimitPolicy(
                sources=("gpuguard", source.value), cluster_default=LimitValue(limit_bytes=8 * GiB)
            ),
        ),
    )
    for _ in range(4):
        t.step([proc(101, G0, 1 * GiB), proc(102, G1, 1 * GiB)])
    assert t.signals() == []
    assert [e.reason for d in t.decisions for e in d.events] == [EventReason.UNASSIGNED_DEVICE]
    # Over its declaration on the GPU it was assigned: stopped as usual.
    t.step([proc(101, G0, 3 * GiB), proc(102, G1, 1 * GiB)])
    t.step([proc(101, G0, 3 * GiB), proc(102, G1, 1 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]
