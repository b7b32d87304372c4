"""``gpuguard enforce`` end to end: a subprocess authenticated as its ServiceAccount (RBAC from
manifests/rbac.yaml really enforced) against the real kube-apiserver, the NVML stand-in listing
real PIDs, and those real processes in real kubepods cgroups (docs/reliability.md
F1, F2, F3, F6, F8).

Every test asserts exactly which process received which signal (the workers record each signal
they catch; SIGKILL shows as the exit status) and that bystanders received nothing.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from rigs.controlplane import AdminRequestError, KubeCluster, TcpProxy, wait_until
from rigs.kubefixtures import SA_NAMESPACE, ensure_service_account
from rigs.node import GIB, Rig
from tests.integration.oracle import Oracle, Role

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def test_the_offenders_container_is_stopped_and_neighbours_and_host_processes_are_untouched(
    rig: Rig,
) -> None:
    offender = rig.add_pod("greedy", limit="1Gi")
    neighbour = rig.add_pod("modest", limit="4Gi")
    # One container, two processes: one stops on SIGTERM, one ignores it (needs SIGKILL).
    polite = rig.spawn(offender, "polite", used_bytes=1 * GIB)
    stubborn = rig.spawn(offender, "stubborn", used_bytes=2 * GIB, ignore_term=True)
    calm = rig.spawn(neighbour, "calm", used_bytes=3 * GIB)
    host = rig.spawn(None, "host", used_bytes=40 * GIB)

    enforcer = rig.start_enforcer()
    wait_until(lambda: not stubborn.alive(), timeout=30, what="the stubborn process to die")
    wait_until(lambda: not polite.alive(), timeout=5, what="the polite process to exit")

    assert polite.received() == ["SIGTERM"]
    assert polite.proc.returncode == 143, "it exited from its own SIGTERM handler"
    assert stubborn.received() == ["SIGTERM", "KILL"]
    assert calm.received() == []
    assert calm.alive()
    assert host.received() == []
    assert host.alive()

    signalled = enforcer.settled_events("container_signalled", 2)
    assert [(e["signal"], e["pod"], sorted(e["pids"])) for e in signalled] == [
        ("SIGTERM", "greedy", sorted([polite.pid, stubborn.pid])),
        ("SIGKILL", "greedy", [stubborn.pid]),
    ]
    wait_until(
        lambda: {"GPUMemoryLimitExceeded", "GPUProcessKilled"} <= set(rig.event_reasons(offender)),
        timeout=15,
        what="both Events readable through the API",
    )
    events = rig.pod_events(offender)
    assert all(e.get("type") == "Warning" for e in events)
    assert rig.pod_events(neighbour) == []
    assert enforcer.metric("gpuguard_kills_total") == 1.0
    assert enforcer.metric("gpuguard_violations_total", {"trigger": "grace"}) == 1.0
    assert enforcer.stop() == 0
    assert calm.alive(), "stopping the enforcer touches nobody"
    assert host.alive()


def test_nothing_is_signalled_before_the_pod_cache_has_synced(rig: Rig, proxy: TcpProxy) -> None:
    offender = rig.add_pod("greedy", limit="1Gi")
    worker = rig.spawn(offender, "greedy", used_bytes=2 * GIB)
    bystander = rig.spawn(rig.add_pod("modest", limit="4Gi"), "calm", used_bytes=1 * GIB)
    proxy.partition()  # this node cannot reach the API server from the start (matrix F1)
    enforcer = rig.start_enforcer(kubeconfig=rig.kubeconfig(server=proxy.url))

    enforcer.wait_for("kube_retry", timeout=20)
    time.sleep(3.0)  # > grace (1 s) + many polls: a synced enforcer would have sent SIGTERM
    assert worker.received() == []
    assert worker.alive()
    assert enforcer.events("container_signalled") == []
    assert enforcer.ready() == (False, "not ready: pod_cache_unsynced")

    proxy.heal()
    wait_until(lambda: not worker.alive(), timeout=40, what="SIGTERM once the cache synced")
    assert worker.received() == ["SIGTERM"]
    assert bystander.received() == []
    assert bystander.alive()
    assert len(enforcer.settled_events("container_signalled", 1)) == 1


def test_nothing_is_signalled_while_the_api_server_is_down_past_the_staleness_bound(
    rig: Rig, cluster: KubeCluster, proxy: TcpProxy
) -> None:
    pod = rig.add_pod("growing", limit="2Gi")
    worker = rig.spawn(pod, "growing", used_bytes=1 * GIB)
    bystander = rig.spawn(rig.add_pod("modest", limit="4Gi"), "calm", used_bytes=1 * GIB)
    enforcer = rig.start_enforcer(kubeconfig=rig.kubeconfig(server=proxy.url))
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")

    # Matrix F2. The proxy lets the enforcer back in only once the restarted API server is
    # ready: before its RBAC cache is warm it answers 403, a separate case
    # (test_a_403_after_the_cache_synced_pauses_enforcement_until_the_permission_is_back).
    proxy.partition()
    cluster.stop_apiserver()
    try:
        wait_until(
            lambda: enforcer.ready() == (False, "not ready: pod_cache_stale"),
            timeout=15,
            what="the pod cache to go stale",
        )
        rig.set_usage(worker, 3 * GIB)  # starts exceeding during the outage
        time.sleep(3.0)  # > grace + two samples
        assert worker.received() == []
        assert worker.alive()
        assert enforcer.events("container_signalled") == []
    finally:
        cluster.start_apiserver()
        proxy.heal()
    wait_until(lambda: not worker.alive(), timeout=60, what="enforcement to resume")
    assert worker.received() == ["SIGTERM"]
    assert bystander.received() == []
    assert bystander.alive()


def test_a_410_after_etcd_compaction_causes_no_duplicate_action(
    cluster_without_watch_cache: KubeCluster, rig: Rig, proxy: TcpProxy
) -> None:
    cluster = cluster_without_watch_cache
    offender = rig.add_pod("greedy", limit="1Gi")
    # Ignores SIGTERM, and the SIGKILL step is far away: the violation stays open (TERM sent)
    # across the relist, the moment a forgetful enforcer would start over and TERM again.
    worker = rig.spawn(offender, "greedy", used_bytes=2 * GIB, ignore_term=True)
    enforcer = rig.start_enforcer(
        kubeconfig=rig.kubeconfig(server=proxy.url), termination_timeout_seconds=60.0
    )
    wait_until(lambda: worker.signals() == ["SIGTERM"], timeout=30, what="the first SIGTERM")

    proxy.partition()
    cluster.patch_pod(rig.namespace, "greedy", {"metadata": {"labels": {"touched": "yes"}}})
    for i in range(5):  # churn elsewhere, so the compaction point is past anything seen
        cluster.create_pod(rig.namespace, f"noise-{i}", node=rig.node + "-other")
    cluster.compact_etcd()
    proxy.heal()

    enforcer.wait_for("kube_watch_gone", timeout=40)
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="ready after the relist")
    time.sleep(3.0)  # > grace + several polls after the relist
    assert worker.signals() == ["SIGTERM"], "exactly one SIGTERM"
    assert worker.alive()
    assert len(enforcer.events("container_signalled")) == 1
    assert rig.event_reasons(offender).count("GPUMemoryLimitExceeded") == 1


def test_a_pod_recreated_with_the_same_name_is_never_confused_with_the_old_one(
    rig: Rig, cluster: KubeCluster
) -> None:
    old = rig.add_pod("web", limit="8Gi")
    lingering = rig.spawn(old, "old-web", used_bytes=2 * GIB)
    enforcer = rig.start_enforcer()
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")

    cluster.delete_pod(rig.namespace, "web")  # matrix F8: same name, new UID, tighter limit
    new = rig.add_pod("web", limit="1Gi")
    assert new.uid != old.uid
    fresh = rig.spawn(new, "new-web", used_bytes=512 * 2**20)
    enforcer.wait_for("memory_not_enforced", reason="pod_unknown", pid=lingering.pid)
    time.sleep(2.5)  # the old process's 2 GiB must never count against the new pod's 1 GiB
    assert lingering.received() == []
    assert fresh.received() == []
    assert enforcer.events("container_signalled") == []

    rig.set_usage(fresh, 2 * GIB)  # now the new pod itself exceeds its limit
    wait_until(lambda: not fresh.alive(), timeout=30, what="the new pod to be stopped")
    assert fresh.received() == ["SIGTERM"]
    assert lingering.received() == []
    assert lingering.alive()
    assert rig.pod_events(old) == []


def test_missing_permissions_exit_non_zero_naming_the_verb_and_resource(
    rig: Rig, cluster: KubeCluster
) -> None:
    sa = "gpuguard-unbound"
    ensure_service_account(cluster, SA_NAMESPACE, sa)
    worker = rig.spawn(rig.add_pod("greedy", limit="1Gi"), "greedy", used_bytes=2 * GIB)
    enforcer = rig.start_enforcer(kubeconfig=cluster.kubeconfig_for_sa(SA_NAMESPACE, sa))
    try:
        enforcer.proc.wait(timeout=30)
    except Exception:
        pytest.fail(f"the enforcer kept running without RBAC:\n{enforcer.text()[-4000:]}")
    assert enforcer.proc.returncode == 1
    final = [ln for ln in enforcer.text().splitlines() if ln.startswith("gpuguard: ")]
    assert len(final) == 1, enforcer.text()[-4000:]
    message = final[0]
    assert "'list'" in message, message
    # The account may list neither pods nor its Node: whichever list the API server denies
    # first is named (both reflectors start together).
    assert "'pods'" in message or "'nodes'" in message, message
    assert "rbac" in message.lower()
    assert worker.received() == []
    assert worker.alive()


def test_a_403_after_the_cache_synced_pauses_enforcement_until_the_permission_is_back(
    rig: Rig, cluster: KubeCluster, gpuguard_rbac: str
) -> None:
    """RBAC lost mid-run (a binding replaced; also what a restarting API server answers before
    its RBAC cache is warm): no exit, no signal on the stale cache, enforcement resumes on the
    directory's ordinary backoff once the permission is back (matrix F2, F6)."""
    sa = "gpuguard-revocable"
    ensure_service_account(cluster, SA_NAMESPACE, sa)
    binding_name = f"{sa}-{rig.node}"
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": binding_name},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "gpuguard-enforcer",
        },
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": SA_NAMESPACE}],
    }
    bindings = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
    cluster.admin_request("POST", bindings, binding)
    try:
        pod = rig.add_pod("growing", limit="2Gi")
        worker = rig.spawn(pod, "growing", used_bytes=1 * GIB)
        enforcer = rig.start_enforcer(kubeconfig=cluster.kubeconfig_for_sa(SA_NAMESPACE, sa))
        wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
        time.sleep(2.5)  # past the start-up window in which a 403 is fatal

        cluster.admin_request("DELETE", f"{bindings}/{binding_name}")
        enforcer.wait_for("kube_problem", timeout=20)
        wait_until(
            lambda: enforcer.ready() == (False, "not ready: pod_cache_stale"),
            timeout=15,
            what="the pod cache to go stale",
        )
        rig.set_usage(worker, 3 * GIB)  # starts exceeding while the cache cannot be trusted
        time.sleep(2.5)  # > grace + two samples
        assert enforcer.proc.poll() is None, "a 403 after start must not stop the enforcer"
        assert worker.received() == []
        assert worker.alive()

        cluster.admin_request("POST", bindings, binding)
        wait_until(lambda: not worker.alive(), timeout=30, what="enforcement to resume after RBAC")
        assert worker.received() == ["SIGTERM"]
    finally:
        with contextlib.suppress(AdminRequestError):
            cluster.admin_request("DELETE", f"{bindings}/{binding_name}")


def test_a_pid_1_that_drops_sigterm_is_freed_at_the_sigterm_step_not_after_the_timeout(
    rig: Rig,
) -> None:
    """Each offender runs as its container's does, PID 1 of its own PID namespace.
    ``train`` installs no SIGTERM handler (``python train.py``): the kernel drops SIGTERM to it,
    so it gets SIGKILL at the SIGTERM step and its memory is back long before the 30 s
    termination timeout; the Event and the log say which signal went to which PID and why.
    ``saver`` has a handler: it gets SIGTERM as before and exits from it. The neighbour is
    untouched."""
    train_pod = rig.add_pod("train", limit="1Gi")
    saver_pod = rig.add_pod("saver", limit="1Gi")
    calm_pod = rig.add_pod("calm", limit="4Gi")
    train = rig.spawn(train_pod, "train", used_bytes=1 * GIB, sigterm_handler=False, pid1=True)
    saver = rig.spawn(saver_pod, "saver", used_bytes=1 * GIB, pid1=True)
    calm = rig.spawn(calm_pod, "calm", used_bytes=3 * GIB, pid1=True)
    oracle = Oracle()
    oracle.add(train, Role.OFFENDER, namespace=rig.namespace, pod="train", expect_stopped=True,
               drops_sigterm=True)  # fmt: skip
    oracle.add(saver, Role.OFFENDER, namespace=rig.namespace, pod="saver", expect_stopped=True)
    oracle.add(calm, Role.BYSTANDER, namespace=rig.namespace, pod="calm")
    enforcer = rig.start_enforcer(termination_timeout_seconds=30.0)
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")

    crossed = time.monotonic()
    rig.set_usage(train, 2 * GIB)
    rig.set_usage(saver, 2 * GIB)
    wait_until(lambda: not train.alive(), timeout=15, what="train (PID 1, no handler) to die")
    freed_after = time.monotonic() - crossed
    wait_until(lambda: not saver.alive(), timeout=10, what="saver to exit on its SIGTERM")

    assert freed_after < 10.0, f"{freed_after:.1f} s: it waited for the termination timeout"
    assert train.received() == ["KILL"]
    assert saver.received() == ["SIGTERM"]
    assert saver.proc.returncode == 143, "it exited from its own SIGTERM handler"
    assert calm.alive()
    assert calm.received() == []
    signalled = enforcer.settled_events("container_signalled", 2)
    by_pod = {e["pod"]: e for e in signalled}
    assert (by_pod["train"]["signal"], by_pod["train"]["step"]) == ("SIGKILL", "SIGTERM")
    assert by_pod["train"]["pids"] == [train.pid]
    [lost] = by_pod["train"]["sigterm_lost"]
    assert (lost["pid"], lost["fate"]) == (train.pid, "dropped_by_init")
    assert (by_pod["saver"]["signal"], by_pod["saver"]["pids"]) == ("SIGTERM", [saver.pid])
    assert by_pod["saver"]["sigterm_lost"] is None
    oracle.check([enforcer])
    wait_until(
        lambda: "GPUProcessKilled" in rig.event_reasons(train_pod),
        timeout=15,
        what="GPUProcessKilled on the train pod",
    )
    [killed] = [e for e in rig.pod_events(train_pod) if e.get("reason") == "GPUProcessKilled"]
    message = killed.get("message") or killed.get("note") or ""
    assert message.startswith(
        f"sent SIGKILL to PID {train.pid} (PID 1 of its PID namespace with no SIGTERM handler: "
        "SIGTERM would be dropped, and no process of the container catches SIGTERM"
    ), message
    assert rig.pod_events(calm_pod) == []
    assert enforcer.stop() == 0
    assert calm.alive()
