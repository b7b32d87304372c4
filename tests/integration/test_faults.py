"""The fault suite (docs/reliability.md F2, F4, N2, N9, P2, R1, R4, R5): the real
``gpuguard enforce`` against the real kube-apiserver and etcd, real processes in real kubepods
cgroups and the NVML stand-in, with one fault injected mid-violation per test.

Every test ends in the one oracle (``tests/integration/oracle.py``): the enforcer's own record of
each signal it sent (its ``container_signalled`` lines) and what each process received, compared
with the test's ground truth (who was over its limit, who was a bystander, a host process, in a
deleted pod or on a failing GPU). Figures (recovery times, poll durations) are printed and
written as JSON under the test's temporary directory; this file never writes into the repo.

Must not signal anything but the processes it started (by PID), nor listen beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rigs.cgroups import cgroup_dir
from rigs.controlplane import KubeCluster, TcpProxy, script_output, wait_until
from rigs.node import GIB, EnforcerProcess, PodInfo, Rig, Worker
from rigs.nvml_stub import FaultScenario
from rigs.prereq import require
from rigs.processes import REAPER
from tests.integration.oracle import SIGNAL_EVENT, Oracle, Recorded, Role

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

MIB = 1 << 20
R = TypeVar("R", bound=Recorded)
RECOVERY_BOUND_SECONDS = 60.0
"""Headline figure 3: enforcement resumes within 60 s of the API server's return."""
OUTAGE_GRACE_SECONDS = 7.0
"""Longer than the rig's staleness bound (4 s) plus margin: the grace period of a violation that
starts just before an outage ends while the pod data is already stale."""


def _figure(tmp_path: Path, name: str, **values: object) -> dict[str, object]:
    """Print a measured figure and keep it as ``<tmp_path>/<name>.json``."""
    doc: dict[str, object] = {"figure": name, "machine": _machine(), **values}
    (tmp_path / f"{name}.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
    print(f"\nFIGURE {json.dumps(doc, sort_keys=True)}")
    return doc


@cache
def _machine() -> str:
    return f"{os.cpu_count()} vCPU, Linux {os.uname().release}"


def _ready(enforcer: EnforcerProcess) -> None:
    wait_until(lambda: enforcer.ready()[0], timeout=40, what="the enforcer to be ready")


def _stale(enforcer: EnforcerProcess) -> bool:
    return enforcer.ready() == (False, "not ready: pod_cache_stale")


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def _first_signal_at(worker: Worker, *, timeout: float) -> float:
    """Monotonic time at which ``worker`` was seen to have received its first signal (to
    within 20 ms)."""
    wait_until(
        lambda: bool(worker.received()),
        timeout=timeout,
        interval=0.02,
        what=f"{worker.name} to receive a signal",
    )
    return time.monotonic()


def _offender(oracle: Oracle, worker: Worker, pod: PodInfo, *, stopped: bool = True) -> Worker:
    oracle.add(worker, Role.OFFENDER, namespace=pod.namespace, pod=pod.name, expect_stopped=stopped)
    return worker


def _bystander(oracle: Oracle, rig: Rig) -> Worker:
    """The pod ``calm`` (limit 4Gi) and its worker at 3 GiB, within its limit: never stopped."""
    calm_pod = rig.add_pod("calm", limit="4Gi")
    return _as(oracle, rig.spawn(calm_pod, "calm", used_bytes=3 * GIB), Role.BYSTANDER, calm_pod)


def _no_signal_while_stale(enforcer: EnforcerProcess, offender: Worker, over_at: float) -> float:
    """With the API server out of reach since just after ``offender`` went over (at
    ``over_at``): the pod cache goes stale within the grace period and, past that period, no
    signal was sent. The seconds from going over to stale."""
    wait_until(lambda: _stale(enforcer), timeout=15, what="the pod cache to go stale")
    stale_after = time.monotonic() - over_at
    assert stale_after < OUTAGE_GRACE_SECONDS, "stale only after the grace period ended"
    _sleep_until(over_at + OUTAGE_GRACE_SECONDS + 1.5)  # the grace period is over
    assert offender.received() == [], "a signal on stale pod data"
    assert enforcer.events(SIGNAL_EVENT) == []
    return stale_after


def _as(oracle: Oracle, worker: R, role: Role, pod: PodInfo | None = None) -> R:
    oracle.add(
        worker,
        role,
        namespace=pod.namespace if pod else None,
        pod=pod.name if pod else None,
    )
    return worker


# ---------------------------------------------------------------------------------------------
# The oracle can fail


@dataclass(slots=True)
class _FakeProcess:
    name: str
    pid: int
    got: list[str] = field(default_factory=list)
    running: bool = True

    def received(self) -> list[str]:
        return list(self.got)

    def alive(self) -> bool:
        return self.running


@dataclass(slots=True)
class _FakeLog:
    lines: list[dict[str, Any]]

    def events(self, name: str, **match: object) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]


def _line(sig: str, pod: str, pids: list[int]) -> dict[str, Any]:
    return {
        "event": SIGNAL_EVENT,
        "signal": sig,
        "namespace": "t",
        "pod": pod,
        "container": "main",
        "pids": pids,
    }


def test_the_oracle_passes_a_correct_record_and_flags_each_kind_of_wrong_one() -> None:
    def ground_truth() -> tuple[Oracle, _FakeProcess, _FakeProcess, _FakeProcess]:
        oracle = Oracle()
        greedy = _FakeProcess("greedy", 101, ["SIGTERM"], running=False)
        calm = _FakeProcess("calm", 102)
        host = _FakeProcess("host", 103)
        oracle.add(greedy, Role.OFFENDER, namespace="t", pod="greedy", expect_stopped=True)
        oracle.add(calm, Role.BYSTANDER, namespace="t", pod="calm")
        oracle.add(host, Role.HOST)
        return oracle, greedy, calm, host

    oracle, greedy, calm, host = ground_truth()
    assert oracle.violations([[_line("SIGTERM", "greedy", [101])]]) == []
    oracle.check([_FakeLog([_line("SIGTERM", "greedy", [101])])], settle_seconds=0)

    # A wrong kill: the bystander's container signalled, and the process got it.
    oracle, greedy, calm, host = ground_truth()
    calm.got, calm.running = ["KILL"], False
    found = oracle.violations(
        [[_line("SIGTERM", "greedy", [101]), _line("SIGKILL", "calm", [102])]]
    )
    assert any("no offender's" in p for p in found), found
    assert any("calm (PID 102, bystander) received ['KILL']" in p for p in found), found
    assert any("SIGKILL to PID 102 without a SIGTERM" in p for p in found), found
    with pytest.raises(pytest.fail.Exception, match="wrong signal"):
        oracle.check([_FakeLog([_line("SIGKILL", "calm", [102])])], settle_seconds=0)

    # An escalation carried over to a new process of the offender's container: SIGKILL first.
    oracle, greedy, calm, host = ground_truth()
    new = _FakeProcess("restarted", 104, ["KILL"], running=False)
    oracle.add(new, Role.OFFENDER, namespace="t", pod="greedy")
    found = oracle.violations(
        [[_line("SIGTERM", "greedy", [101]), _line("SIGKILL", "greedy", [104])]]
    )
    assert any("restarted" in p and "without a SIGTERM first" in p for p in found), found
    assert any("SIGKILL to PID 104 without a SIGTERM" in p for p in found), found

    # A signal the enforcer does not record, one to a process nobody started, a host process
    # signalled, and an offender never stopped.
    oracle, greedy, calm, host = ground_truth()
    greedy.got, greedy.running = [], True
    host.got = ["SIGTERM"]
    found = oracle.violations([[_line("SIGTERM", "greedy", [999])]])
    assert any("never started" in p for p in found), found
    assert any("host (PID 103, host) received ['SIGTERM']" in p for p in found), found
    assert any("no enforcer log line records" in p for p in found), found
    assert any("greedy" in p and "never stopped" in p for p in found), found

    # What the test sent itself is not held against the enforcer.
    oracle, greedy, calm, host = ground_truth()
    calm.got, calm.running = ["KILL"], False
    oracle.sent_by_test(calm, "KILL")
    assert oracle.violations([[_line("SIGTERM", "greedy", [101])]]) == []

    # SIGKILL at the SIGTERM step is right only for a process that drops SIGTERM.
    early = {**_line("SIGKILL", "greedy", [101]), "step": "SIGTERM"}
    early["sigterm_lost"] = [{"pid": 101, "fate": "dropped_by_init", "detail": "…"}]
    oracle = Oracle()
    init = _FakeProcess("init", 101, ["KILL"], running=False)
    oracle.add(init, Role.OFFENDER, namespace="t", pod="greedy", expect_stopped=True,
               drops_sigterm=True)  # fmt: skip
    assert oracle.violations([[early]]) == []
    oracle = Oracle()
    oracle.add(init, Role.OFFENDER, namespace="t", pod="greedy", expect_stopped=True)
    found = oracle.violations([[early]])
    assert any("whose SIGTERM would not have been lost" in p for p in found), found
    assert any("SIGKILLed without a SIGTERM first" in p for p in found), found


# ---------------------------------------------------------------------------------------------
# a. API server killed and restarted mid-violation


def test_a_killed_api_server_mid_grace_means_no_signal_until_it_is_back_then_a_stop_within_60s(
    rig: Rig, cluster: KubeCluster, tmp_path: Path
) -> None:
    oracle = Oracle()
    greedy_pod = rig.add_pod("greedy", limit="2Gi")
    greedy = _offender(oracle, rig.spawn(greedy_pod, "greedy", used_bytes=1 * GIB), greedy_pod)
    _bystander(oracle, rig)
    _as(oracle, rig.spawn(None, "host", used_bytes=20 * GIB), Role.HOST)
    system_pod = rig.add_pod(f"system-{rig.node}", namespace="kube-system", limit="1Gi")
    system = rig.spawn(system_pod, "system", used_bytes=3 * GIB)  # over, but exempt
    _as(oracle, system, Role.EXEMPT, system_pod)
    enforcer = rig.start_enforcer(grace_seconds=OUTAGE_GRACE_SECONDS)
    _ready(enforcer)

    over_at = time.monotonic()
    rig.set_usage(greedy, 3 * GIB)  # over its limit: the grace period starts
    cluster.kill_apiserver()  # SIGKILL, mid-grace
    try:
        stale_after = _no_signal_while_stale(enforcer, greedy, over_at)
    finally:
        cluster.start_apiserver()
    back_at = time.monotonic()
    term_at = _first_signal_at(greedy, timeout=RECOVERY_BOUND_SECONDS + 30)
    wait_until(lambda: not greedy.alive(), timeout=10, what="greedy to exit")

    oracle.check([enforcer])
    assert greedy.received() == ["SIGTERM"]
    assert system.alive()
    recovery = max(0.0, term_at - back_at)
    _figure(
        tmp_path,
        "api_server_killed_recovery",
        recovery_seconds=round(recovery, 2),
        stale_after_seconds=round(stale_after, 2),
        outage_seconds=round(back_at - over_at, 2),
        definition="kube-apiserver /readyz OK again -> SIGTERM seen by the offender",
    )
    assert recovery <= RECOVERY_BOUND_SECONDS


# ---------------------------------------------------------------------------------------------
# b. etcd stopped (API server up, storage dead) mid-violation


def test_b_with_etcd_stopped_the_watch_cache_stays_authoritative_and_enforcement_goes_on(
    rig: Rig, cluster: KubeCluster, tmp_path: Path
) -> None:
    """etcd killed mid-grace, the API server up. What happens (measured, not assumed): the API
    server keeps answering the enforcer's watch from its watch cache, so the pod cache never
    goes stale, and that is right here: with the only etcd down nothing can be written, so no
    pod can be deleted, recreated or re-annotated behind the cache's back. The offender is
    stopped on time; only the Events fail (retried, then given up and counted). After etcd
    returns, a second violation is stopped and its Events are written again.

    (An HA control plane where only this API server lost etcd while others keep writing would
    make its cache stale without it saying so; one etcd cannot show that here.)"""
    oracle = Oracle()
    first_pod = rig.add_pod("greedy", limit="2Gi")
    second_pod = rig.add_pod("greedy-after", limit="2Gi")
    first = _offender(oracle, rig.spawn(first_pod, "greedy", used_bytes=1 * GIB), first_pod)
    second = rig.spawn(second_pod, "greedy-after", used_bytes=1 * GIB)
    _offender(oracle, second, second_pod)
    _bystander(oracle, rig)
    grace = 2.0
    enforcer = rig.start_enforcer(grace_seconds=grace)
    _ready(enforcer)

    over_at = time.monotonic()
    rig.set_usage(first, 3 * GIB)
    cluster.stop_etcd()  # SIGKILL, mid-grace
    try:
        delay = _first_signal_at(first, timeout=grace + 10) - over_at
        enforcer.wait_for("kube_retry", what="event", timeout=10)  # the Event cannot be written
        assert enforcer.ready()[0], "the watch cache kept the pod cache fresh"
    finally:
        cluster.start_etcd()
    back_at = time.monotonic()
    rig.set_usage(second, 3 * GIB)
    second_delay = _first_signal_at(second, timeout=RECOVERY_BOUND_SECONDS) - back_at
    wait_until(
        lambda: "GPUProcessKilled" in rig.event_reasons(second_pod),
        timeout=30,
        what="the second offender's Events written once etcd is back",
    )

    oracle.check([enforcer])
    assert first.received() == ["SIGTERM"]
    assert second.received() == ["SIGTERM"]
    assert grace <= delay <= grace + 5.0
    _figure(
        tmp_path,
        "etcd_stopped",
        sigterm_after_going_over_seconds=round(delay, 2),
        back_to_next_sigterm_seconds=round(second_delay, 2),
        grace_seconds=grace,
        definition="etcd killed mid-grace: SIGTERM on time from the watch cache; etcd back -> "
        "a new violation's SIGTERM (includes its grace period)",
    )


# ---------------------------------------------------------------------------------------------
# c. a watch that hangs half-open


def test_c_a_half_open_connection_mid_grace_means_no_signal_on_stale_data_and_a_stop_once_healed(
    rig: Rig, proxy: TcpProxy, tmp_path: Path
) -> None:
    oracle = Oracle()
    greedy_pod = rig.add_pod("greedy", limit="2Gi")
    greedy = _offender(oracle, rig.spawn(greedy_pod, "greedy", used_bytes=1 * GIB), greedy_pod)
    _bystander(oracle, rig)
    enforcer = rig.start_enforcer(
        kubeconfig=rig.kubeconfig(server=proxy.url), grace_seconds=OUTAGE_GRACE_SECONDS
    )
    _ready(enforcer)

    over_at = time.monotonic()
    rig.set_usage(greedy, 3 * GIB)
    proxy.freeze()  # connections stay open, nothing is forwarded (matrix F4)
    try:
        stale_after = _no_signal_while_stale(enforcer, greedy, over_at)
    finally:
        proxy.heal()
    healed_at = time.monotonic()
    term_at = _first_signal_at(greedy, timeout=RECOVERY_BOUND_SECONDS + 30)
    wait_until(lambda: not greedy.alive(), timeout=10, what="greedy to exit")

    oracle.check([enforcer])
    assert greedy.received() == ["SIGTERM"]
    recovery = term_at - healed_at
    _figure(
        tmp_path,
        "half_open_watch_recovery",
        recovery_seconds=round(recovery, 2),
        stale_after_seconds=round(stale_after, 2),
        definition="proxy healed -> SIGTERM seen by the offender",
    )
    assert recovery <= RECOVERY_BOUND_SECONDS


# ---------------------------------------------------------------------------------------------
# d. NVML failing or hanging on one of two GPUs


@pytest.mark.parametrize("fault", ["fails", "hangs"])
def test_d_nvml_failing_on_one_gpu_stops_the_offender_on_the_other_and_signals_nothing_on_it(
    rig: Rig, fault: str
) -> None:
    scenario = FaultScenario(rig.scenario.path)
    rig.scenario = scenario
    oracle = Oracle()
    healthy_pod = rig.add_pod("greedy-gpu0", limit="2Gi")
    sick_pod = rig.add_pod("greedy-gpu1", limit="2Gi")
    calm_pod = rig.add_pod("calm-gpu0", limit="4Gi")
    healthy = _offender(
        oracle, rig.spawn(healthy_pod, "greedy-gpu0", used_bytes=1 * GIB), healthy_pod
    )
    sick = rig.spawn(sick_pod, "greedy-gpu1", used_bytes=1 * GIB, gpu=1)
    _as(oracle, sick, Role.UNVERIFIABLE, sick_pod)
    _as(oracle, rig.spawn(calm_pod, "calm-gpu0", used_bytes=3 * GIB), Role.BYSTANDER, calm_pod)
    grace = 3.0
    enforcer = rig.start_enforcer(grace_seconds=grace)
    _ready(enforcer)

    # GPU 1's pod goes over and the enforcer sees it; mid-grace its GPU starts failing.
    over_at = time.monotonic()
    rig.set_usage(sick, 3 * GIB)
    wait_until(
        lambda: (
            enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", {"pod": sick_pod.name}) == 3 * GIB
        ),
        timeout=10,
        interval=0.05,
        what="the enforcer to see GPU 1's pod over its limit",
    )
    assert time.monotonic() - over_at < grace, "seen only after its grace period"
    rule = {"call": "*", "device": 1, "after": 0, "times": -1}
    if fault == "fails":
        scenario.set_faults(errors=[{**rule, "code": "UNKNOWN"}])
    else:
        scenario.set_faults(delays=[{**rule, "ms": 3000}])
    rig.set_usage(healthy, 3 * GIB)

    _first_signal_at(healthy, timeout=30)
    wait_until(lambda: not healthy.alive(), timeout=10, what="GPU 0's offender to exit")
    _sleep_until(over_at + grace + 2.0)  # GPU 1's pod is past its grace period too
    oracle.check([enforcer])
    assert healthy.received() == ["SIGTERM"]
    assert sick.received() == []
    assert sick.alive()
    [line] = enforcer.events(SIGNAL_EVENT)
    assert (line["pod"], line["gpu"]) == (healthy_pod.name, 0)
    assert enforcer.events("gpu_sample_bug") == []
    skipped = enforcer.wait_for("gpu_skipped", gpu=1, timeout=5)
    assert ("twice in a row" in skipped["reason"]) == (fault == "hangs"), skipped
    if fault == "hangs":
        # Every call hangs now, one of them is in flight when the enforcer is told to stop:
        # it exits 0 without waiting on NVML (it used to die in nvmlShutdown, exit 1).
        stuck = len(enforcer.events("gpu_sample_failed"))
        scenario.set_faults(delays=[{"call": "*", "ms": 3000, "times": -1}])
        wait_until(
            lambda: any(
                str(e["error"]).startswith("timed out")
                for e in enforcer.events("gpu_sample_failed")[stuck:]
            ),
            timeout=10,
            interval=0.05,
            what="an NVML call stuck in flight",
        )
    assert enforcer.stop() == 0


# ---------------------------------------------------------------------------------------------
# e. a pod deleted between the decision and the signal


def test_e_a_pod_deleted_mid_grace_or_mid_escalation_is_never_signalled_once_gone(
    rig: Rig, cluster: KubeCluster
) -> None:
    """Three pods over their limits, each deleted at another moment while its process keeps
    running (a slow kubelet teardown):

    - ``terminating``: deleted gracefully mid-grace. Without a kubelet the object stays, with
      ``deletionTimestamp`` set: it is still a pod of this node, and the enforcer stops it.
    - ``vanished``: removed from the API mid-grace (grace 0). Its process now belongs to no
      known pod (``pod_unknown``): never signalled, its memory reported as nobody's.
    - ``removed-after-term``: ignores SIGTERM and is removed from the API between the SIGTERM
      and the SIGKILL: the escalation ends with the pod, no SIGKILL follows, the process keeps
      running (reported, not acted on).
    """
    oracle = Oracle()
    term_pod = rig.add_pod("terminating", limit="1Gi")
    gone_pod = rig.add_pod("vanished", limit="1Gi")
    late_pod = rig.add_pod("removed-after-term", limit="1Gi")
    terminating = _offender(oracle, rig.spawn(term_pod, "terminating", used_bytes=1), term_pod)
    vanished = _as(
        oracle, rig.spawn(gone_pod, "vanished", used_bytes=1), Role.UNVERIFIABLE, gone_pod
    )
    stubborn = rig.spawn(late_pod, "removed-after-term", used_bytes=1, ignore_term=True)
    _offender(oracle, stubborn, late_pod, stopped=False)
    calm = _bystander(oracle, rig)
    grace, timeout = 3.0, 3.0
    enforcer = rig.start_enforcer(grace_seconds=grace, termination_timeout_seconds=timeout)
    _ready(enforcer)

    for w in (terminating, vanished, stubborn):
        rig.set_usage(w, 2 * GIB)
    time.sleep(grace / 3)
    ns = rig.namespace
    cluster.admin_request("DELETE", f"/api/v1/namespaces/{ns}/pods/terminating")
    cluster.delete_pod(ns, "vanished")
    assert cluster.admin_request("GET", f"/api/v1/namespaces/{ns}/pods/terminating")["metadata"][
        "deletionTimestamp"
    ]

    _first_signal_at(stubborn, timeout=30)
    cluster.delete_pod(ns, "removed-after-term")  # after its SIGTERM, before its SIGKILL
    enforcer.wait_for("memory_not_enforced", reason="pod_unknown", pid=vanished.pid, timeout=10)
    wait_until(lambda: not terminating.alive(), timeout=10, what="the terminating pod to stop")
    _sleep_until(time.monotonic() + timeout + 2.0)  # well past when the SIGKILL was due

    oracle.check([enforcer])
    assert terminating.received() == ["SIGTERM"]
    assert vanished.received() == []
    assert vanished.alive()
    assert stubborn.received() == ["SIGTERM"], "no SIGKILL once its pod is gone"
    assert stubborn.alive()
    assert calm.received() == []
    assert [(e["signal"], e["pod"]) for e in enforcer.events(SIGNAL_EVENT)] in (
        [("SIGTERM", "terminating"), ("SIGTERM", "removed-after-term")],
        [("SIGTERM", "removed-after-term"), ("SIGTERM", "terminating")],
    )
    enforcer.wait_for("memory_not_enforced", reason="pod_unknown", pid=stubborn.pid, timeout=10)
    wait_until(
        lambda: enforcer.metric("gpuguard_gpu_memory_unattributed_bytes", {"gpu": "0"}) == 4 * GIB,
        timeout=10,
        what="the deleted pods' 4 GiB reported as nobody's",
    )


# ---------------------------------------------------------------------------------------------
# f. a container restarting mid-escalation


def test_f_a_container_restarted_mid_escalation_gets_a_fresh_sigterm_never_the_old_sigkill(
    rig: Rig, cluster: KubeCluster
) -> None:
    oracle = Oracle()
    pod = rig.add_pod("restarting", limit="1Gi")
    old = _offender(oracle, rig.spawn(pod, "old", used_bytes=2 * GIB, ignore_term=True), pod)
    calm = _bystander(oracle, rig)
    timeout = 3.0  # time for the "kubelet" below to restart the container before the SIGKILL
    enforcer = rig.start_enforcer(termination_timeout_seconds=timeout)
    term_at = _first_signal_at(old, timeout=30)
    assert old.received() == ["SIGTERM"]

    # The restart as the enforcer sees it: a new container (new ID, new cgroup) with a new
    # process, still over the limit, reported in the pod's status; the old process is gone.
    # The new one starts before the old one is reaped, so the pod's violation never lapses.
    restarted = PodInfo(
        namespace=pod.namespace,
        name=pod.name,
        uid=pod.uid,
        container_id=uuid.uuid4().hex + uuid.uuid4().hex,
    )
    new = rig.spawn(restarted, "new", used_bytes=2 * GIB, ignore_term=True)
    _offender(oracle, new, pod)
    cluster.set_container_statuses(
        pod.namespace,
        pod.name,
        [{"name": "main", "containerID": f"containerd://{restarted.container_id}",
          "restartCount": 1}],
    )  # fmt: skip
    oracle.sent_by_test(old, "KILL")
    old.proc.kill()
    old.proc.wait()
    assert time.monotonic() - term_at < timeout, "the restart came after the SIGKILL was due"

    wait_until(lambda: not new.alive(), timeout=30, what="the new container's process to stop")
    oracle.check([enforcer])
    assert new.received() == ["SIGTERM", "KILL"], "a fresh SIGTERM, then the SIGKILL"
    assert calm.received() == []
    signals = [(e["signal"], e["pids"]) for e in enforcer.events(SIGNAL_EVENT)]
    assert signals == [("SIGTERM", [old.pid]), ("SIGTERM", [new.pid]), ("SIGKILL", [new.pid])]


# ---------------------------------------------------------------------------------------------
# g. the enforcer restarted mid-escalation


def test_g_an_enforcer_killed_mid_escalation_restarts_without_blind_sigkills_or_a_lost_violation(
    rig: Rig,
) -> None:
    oracle = Oracle()
    pod = rig.add_pod("stubborn", limit="1Gi")
    stubborn = _offender(
        oracle, rig.spawn(pod, "stubborn", used_bytes=2 * GIB, ignore_term=True), pod
    )
    calm = _bystander(oracle, rig)
    first = rig.start_enforcer(termination_timeout_seconds=30.0)
    _first_signal_at(stubborn, timeout=30)
    # The enforcer logs the signal only once its kill call has returned: wait for that line
    # before killing it, or the kill can land in between. Its SIGKILL is 30 s away, so the
    # kill below still falls between its SIGTERM and its SIGKILL (matrix R1).
    first.wait_for(SIGNAL_EVENT, signal="SIGTERM", timeout=20)
    first.proc.kill()
    first.proc.wait()
    assert stubborn.received() == ["SIGTERM"]

    # A process the first enforcer never saw joins the container before the second starts.
    late = _offender(oracle, rig.spawn(pod, "late", used_bytes=512 * MIB, ignore_term=True), pod)
    second = rig.start_enforcer(termination_timeout_seconds=1.0)
    wait_until(lambda: not stubborn.alive(), timeout=40, what="the stubborn process to be killed")
    wait_until(lambda: not late.alive(), timeout=10, what="the late process to be killed")

    oracle.check([first, second])
    assert stubborn.received() == ["SIGTERM", "SIGTERM", "KILL"], "at most one extra SIGTERM"
    assert late.received() == ["SIGTERM", "KILL"]
    assert calm.received() == []
    assert [e["signal"] for e in first.events(SIGNAL_EVENT)] == ["SIGTERM"]
    assert [(e["signal"], sorted(e["pids"])) for e in second.events(SIGNAL_EVENT)] == [
        ("SIGTERM", sorted([stubborn.pid, late.pid])),
        ("SIGKILL", sorted([stubborn.pid, late.pid])),
    ]


# ---------------------------------------------------------------------------------------------
# h. wall-clock jumps


@cache
def _faketime_dir() -> tuple[Path | None, str]:
    """``scripts/ensure-faketime.sh``'s directory (fetched once, cached), or ``(None, why)``."""
    script = "scripts/ensure-faketime.sh"
    lines, why = script_output(script, runner=["bash"], timeout=600)
    if lines is None:
        return None, why or script
    directory = Path(lines[-1])
    if not (directory / "libfaketimeMT.so.1").is_file():
        return None, f"{script} printed no directory holding libfaketimeMT.so.1"
    return directory, ""


def _set_wall_offset(clock_file: Path, spec: str) -> None:
    tmp = clock_file.with_suffix(".tmp")
    tmp.write_text(spec + "\n")
    os.replace(tmp, clock_file)


def _enforcer_wall_offset(enforcer: EnforcerProcess) -> float | None:
    """The enforcer's wall clock minus ours, from its last poll's timestamp (≈ 0.1 s lag)."""
    stamp = enforcer.metric("gpuguard_last_poll_timestamp_seconds")
    return None if stamp is None else stamp - time.time()


def test_h_wall_clock_jumps_mid_grace_neither_hasten_nor_stall_a_stop(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libfaketime steps the enforcer's CLOCK_REALTIME (and only it: CLOCK_MONOTONIC is left
    alone, as by a real NTP step) by +1 h during one violation's grace period and back by 1 h
    during another's: neither SIGTERM comes before its grace period, nor late."""
    directory, why = _faketime_dir()
    require(directory is not None, why)
    assert directory is not None
    clock_file = tmp_path / "faketime"
    _set_wall_offset(clock_file, "+0")
    preload = f"{directory / 'libmonotonic_sleep.so'} {directory / 'libfaketimeMT.so.1'}"
    faked = {
        "LD_PRELOAD": " ".join(p for p in (preload, os.environ.get("LD_PRELOAD", "")) if p),
        "FAKETIME_TIMESTAMP_FILE": str(clock_file),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    plain_env = rig.env
    monkeypatch.setattr(rig, "env", lambda: {**plain_env(), **faked})

    oracle = Oracle()
    ahead_pod = rig.add_pod("ahead", limit="2Gi")
    behind_pod = rig.add_pod("behind", limit="2Gi")
    ahead = _offender(oracle, rig.spawn(ahead_pod, "ahead", used_bytes=1 * GIB), ahead_pod)
    behind = _offender(oracle, rig.spawn(behind_pod, "behind", used_bytes=1 * GIB), behind_pod)
    _bystander(oracle, rig)
    grace = 4.0
    enforcer = rig.start_enforcer(grace_seconds=grace)
    _ready(enforcer)
    offset = _enforcer_wall_offset(enforcer)
    assert offset is not None
    assert abs(offset) < 30, offset

    delays: dict[str, float] = {}
    for worker, spec, expected in ((ahead, "+1h", 3600.0), (behind, "+0", 0.0)):
        over_at = time.monotonic()
        rig.set_usage(worker, 3 * GIB)
        time.sleep(grace / 4)
        _set_wall_offset(clock_file, spec)  # the step, mid-grace
        wait_until(
            lambda e=expected: abs((_enforcer_wall_offset(enforcer) or 1e9) - e) < 30,
            timeout=grace / 2,
            interval=0.05,
            what=f"the enforcer's wall clock to step to {spec}",
        )
        assert worker.received() == [], f"signalled right after the {spec} step"
        delays[spec] = _first_signal_at(worker, timeout=grace + 20) - over_at
        wait_until(lambda w=worker: not w.alive(), timeout=10, what=f"{worker.name} to exit")

    oracle.check([enforcer])
    for spec, delay in delays.items():
        assert delay >= grace - 0.05, f"SIGTERM {delay:.2f}s after going over with a {spec} step"
        assert delay <= grace + 5.0, f"SIGTERM only {delay:.2f}s after going over ({spec} step)"
    _figure(
        tmp_path,
        "wall_clock_jumps",
        grace_seconds=grace,
        sigterm_after_seconds={k: round(v, 2) for k, v in delays.items()},
    )


# ---------------------------------------------------------------------------------------------
# i. a node with 1000 GPU processes

SWARM = (
    r"""
import gc, json, os, signal, sys
spec = json.load(open(sys.argv[1]))
gpu_fd = os.open(sys.argv[2], os.O_PATH)  # inherited by every child: chr 195:0 in their fds
record, exits = spec["record"], spec["exits"]

def append(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, text.encode())
    os.close(fd)

def on_exit(pid, code):
    append(exits, f"{pid} {code}\n")

def note(signum, frame):
    append(record, f"{os.getpid()} {signal.Signals(signum).name}\n")
    if signum == signal.SIGTERM:
        os._exit(143)

"""
    + REAPER
    + r"""
signal.signal(signal.SIGCHLD, reap)
gc.freeze()  # children share the parent's pages instead of copying them on the first GC
pids = []
for procs in spec["cgroups"]:
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for s in CAUGHT:
            signal.signal(s, note)
        while True:
            signal.pause()
    with open(procs, "w") as f:  # into its pod's container cgroup before anyone looks
        f.write(str(pid))
    pids.append(pid)
append(spec["ready"] + ".tmp", json.dumps(pids))
os.rename(spec["ready"] + ".tmp", spec["ready"])
while True:
    signal.pause()
"""
)


class _Swarm:
    """Processes forked by one parent into many pods' container cgroups; they record the
    signals they catch in one file, the parent records their exits in another."""

    def __init__(self, directory: Path) -> None:
        self.record = directory / "swarm.signals"
        self.exits = directory / "swarm.exits"
        self._cache: tuple[float, dict[int, list[str]], dict[int, int]] | None = None

    def _read(self) -> tuple[dict[int, list[str]], dict[int, int]]:
        now = time.monotonic()
        if self._cache is not None and now - self._cache[0] < 0.1:
            return self._cache[1], self._cache[2]
        got: dict[int, list[str]] = {}
        exits: dict[int, int] = {}
        for path, into in ((self.record, "signals"), (self.exits, "exits")):
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            for row in text.splitlines():
                pid, _, value = row.partition(" ")
                if into == "signals":
                    got.setdefault(int(pid), []).append(value)
                else:
                    exits[int(pid)] = int(value)
        self._cache = (now, got, exits)
        return got, exits

    def received(self, pid: int) -> list[str]:
        got, exits = self._read()
        return got.get(pid, []) + (["KILL"] if exits.get(pid) == -9 else [])

    def alive(self, pid: int) -> bool:
        return pid not in self._read()[1]


@dataclass(frozen=True, slots=True)
class _SwarmChild:
    swarm: _Swarm
    name: str
    pid: int

    def received(self) -> list[str]:
        return self.swarm.received(self.pid)

    def alive(self) -> bool:
        return self.swarm.alive(self.pid)


def _histogram(text: str, name: str) -> tuple[dict[float, float], float, float]:
    """(cumulative buckets by upper bound, sum, count) of one unlabelled histogram."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum "):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count "):
            count = float(line.rsplit(" ", 1)[1])
    return buckets, total, count


def _quantile_bound(
    before: Mapping[float, float], after: Mapping[float, float], q: float
) -> float | None:
    """The smallest bucket bound holding the ``q`` quantile of the observations in between."""
    delta = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    n = delta.get(float("inf"), 0.0)
    if n <= 0:
        return None
    for le, cumulative in delta.items():
        if cumulative >= q * n:
            return le
    return None


def test_i_one_offender_among_1000_gpu_processes_in_100_pods_is_the_only_one_stopped(
    rig: Rig, tmp_path: Path
) -> None:
    pods_of_swarm, per_pod = 99, 10
    scenario = FaultScenario(rig.scenario.path)
    rig.scenario = scenario
    oracle = Oracle()
    swarm = _Swarm(tmp_path)
    placed: list[tuple[PodInfo, int]] = []
    procs_files: list[str] = []
    for i in range(pods_of_swarm):
        pod = rig.add_pod(f"calm-{i:02d}", limit="4Gi")
        cg = rig.tree.container(
            version=2, driver="systemd", qos="burstable", pod_uid=pod.uid,
            runtime="containerd", container_id=pod.container_id,
        )  # fmt: skip
        placed += [(pod, i % 2)] * per_pod  # half the pods on each GPU
        procs_files += [str(cgroup_dir(cg) / "cgroup.procs")] * per_pod
    spec = tmp_path / "swarm.json"
    ready = tmp_path / "swarm.ready"
    spec.write_text(
        json.dumps(
            {
                "record": str(swarm.record),
                "exits": str(swarm.exits),
                "ready": str(ready),
                "cgroups": procs_files,
            }
        )
    )
    parent = rig.tree.spawn(
        [sys.executable, "-c", SWARM, str(spec), str(rig.device_node)],
        cgroups=[rig.tree.make(2, "system.slice/gpu-swarm.service")],
    )
    wait_until(ready.exists, timeout=120, interval=0.1, what="1000 processes forked")
    pids: list[int] = json.loads(ready.read_text())
    extra: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for pid, (pod, gpu) in zip(pids, placed, strict=True):
        extra[gpu].append({"pid": pid, "used_bytes": 100 * MIB})
        child = _SwarmChild(swarm, f"{pod.name}/{pid}", pid)
        _as(oracle, child, Role.BYSTANDER, pod)
    scenario.set_extra_processes(extra)

    greedy_pod = rig.add_pod("greedy", limit="1Gi")
    greedy = [
        _offender(oracle, rig.spawn(greedy_pod, f"greedy-{n}", used_bytes=50 * MIB), greedy_pod)
        for n in range(per_pod)
    ]
    assert len(pids) + len(greedy) == 1000
    enforcer = rig.start_enforcer()
    _ready(enforcer)
    time.sleep(2.0)  # polls over 1000 processes, nobody over a limit
    assert enforcer.events(SIGNAL_EVENT) == []
    poll = "gpuguard_poll_duration_seconds"
    before, sum0, count0 = _histogram(enforcer.http("/metrics")[1], poll)
    time.sleep(5.0)
    after, sum1, count1 = _histogram(enforcer.http("/metrics")[1], poll)

    for w in greedy:
        rig.set_usage(w, 200 * MIB)  # 2 GiB in all, over the pod's 1Gi
    for w in greedy:
        wait_until(lambda w=w: not w.alive(), timeout=30, what=f"{w.name} to stop")
    time.sleep(2.0)  # more polls: nothing else may be touched

    oracle.check([enforcer])
    assert [(e["signal"], e["pod"], len(e["pids"])) for e in enforcer.events(SIGNAL_EVENT)] == [
        ("SIGTERM", "greedy", per_pod)
    ]
    assert all(swarm.alive(pid) for pid in pids), "a swarm process died"
    assert parent.poll() is None
    polls = count1 - count0
    assert polls > 0
    _figure(
        tmp_path,
        "poll_duration_1000_processes",
        processes=1000,
        pods=pods_of_swarm + 1,
        polls=int(polls),
        mean_seconds=round((sum1 - sum0) / polls, 4),
        p50_bucket_seconds=_quantile_bound(before, after, 0.5),
        p99_bucket_seconds=_quantile_bound(before, after, 0.99),
        window_seconds=5.0,
        measures="gpuguard_poll_duration_seconds: decide + act + publish of one cycle",
    )
