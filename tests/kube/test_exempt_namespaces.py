"""Exemptions against a real kube-apiserver, as gpuguard's enforcer ServiceAccount (its RBAC from
manifests/rbac.yaml): a namespace a tenant creates exempts nothing, one the admin labels does,
and the enforcer's start check names the exempt names no Namespace has.

Until the default list was cut to ``kube-system``, ``nvidia-device-plugin`` (and
``gpu-operator``, ``nvidia-gpu-operator``) were exempt by name: wherever tenants may create
namespaces (``oc new-project``, Capsule, HNC), a tenant created one and its GPU pods were never
stopped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.kube import KubePodDirectory, load_api_client
from gpuguard.adapters.kube.errors import translate_error
from gpuguard.config import LimitsSettings, Settings
from gpuguard.core.limits import is_exempt
from gpuguard.core.model import PodUid
from gpuguard.errors import KubeForbidden
from rigs.controlplane import KubeCluster, wait_until
from rigs.kubefixtures import ensure_namespace, service_account_with_rules

pytestmark = pytest.mark.apiserver

FORMER_DEFAULTS = ("nvidia-device-plugin", "gpu-operator", "nvidia-gpu-operator")


@contextmanager
def synced_directory(kubeconfig: Path, node: str, **kwargs: Any) -> Iterator[KubePodDirectory]:
    api = load_api_client(str(kubeconfig))
    directory = KubePodDirectory(api, node_name=node, **kwargs)
    directory.start()
    try:
        assert directory.wait_synced(20), directory.problem()
        yield directory
    finally:
        directory.stop()
        api.close()  # type: ignore[no-untyped-call]


def _tenant_api(cluster: KubeCluster) -> Any:
    """A self-service tenant: may create namespaces (as ``oc new-project``, Capsule or HNC let
    it), and nothing more on them."""
    name = f"tenant-{uuid.uuid4().hex[:8]}"
    service_account_with_rules(
        cluster,
        "default",
        name,
        [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["create"]}],
    )
    return load_api_client(str(cluster.kubeconfig_for_sa("default", name)))


def _create_namespace_as(api: Any, name: str) -> None:
    from kubernetes import client as k8s

    try:
        core: Any = k8s.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": name}})
    except k8s.ApiException as exc:
        if exc.status != 409:  # made by an earlier test of this session: it is the tenant's too
            raise


def _label_namespace(cluster: KubeCluster, name: str, labels: dict[str, str | None]) -> None:
    cluster.admin_request(
        "PATCH",
        f"/api/v1/namespaces/{name}",
        {"metadata": {"labels": labels}},
        content_type="application/merge-patch+json",
    )


def test_a_tenant_made_nvidia_device_plugin_namespace_is_not_exempt_and_an_admin_labelled_one_is(
    cluster: KubeCluster,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
) -> None:
    key = f"test.gpuguard.io/exempt-{uuid.uuid4().hex[:8]}"
    settings = Settings(limits=LimitsSettings(exempt_namespace_label=f"{key}=true"))
    policy = settings.limit_policy()
    tenant = _tenant_api(cluster)
    for name in FORMER_DEFAULTS:
        _create_namespace_as(tenant, name)
    # The tenant cannot put the admin's label on its namespace (no patch of namespaces: the
    # admin's part of the bargain, docs/design.md, Exemptions).
    from kubernetes import client as k8s

    with pytest.raises(k8s.ApiException) as refused:
        k8s.CoreV1Api(tenant).patch_namespace(
            "nvidia-device-plugin", {"metadata": {"labels": {key: "true"}}}
        )
    assert isinstance(
        translate_error(refused.value, verb="patch", resource="namespaces", scope="x"),
        KubeForbidden,
    )
    admin_ns = f"gpu-ops-{uuid.uuid4().hex[:8]}"
    ensure_namespace(cluster, admin_ns)
    _label_namespace(cluster, admin_ns, {key: "true"})
    later_ns = f"gpu-later-{uuid.uuid4().hex[:8]}"
    ensure_namespace(cluster, later_ns)
    pods = {
        ns: cluster.create_pod(ns, f"gpu-{uuid.uuid4().hex[:6]}", node=node_name)["metadata"]
        for ns in (*FORMER_DEFAULTS, admin_ns, later_ns)
    }

    def exempt(directory: KubePodDirectory, ns: str) -> bool | None:
        snap = directory.snapshot()
        pod = snap.lookup(PodUid(pods[ns]["uid"]))
        assert pod is not None
        return is_exempt(pod.namespace, policy, snap.labelled_namespaces)

    with synced_directory(
        gpuguard_kubeconfig(), node_name, exempt_label=policy.exempt_label
    ) as directory:
        wait_until(
            lambda: directory.snapshot().labelled_namespaces is not None,
            timeout=20,
            what="the labelled namespaces to be listed",
        )
        assert directory.problem() is None
        assert directory.snapshot().namespaces_contact_at is not None
        for name in FORMER_DEFAULTS:
            assert exempt(directory, name) is False, name
        assert exempt(directory, admin_ns) is True
        assert exempt(directory, later_ns) is False
        # The admin labels a namespace, then takes a label off: the watch follows both.
        _label_namespace(cluster, later_ns, {key: "true"})
        wait_until(lambda: exempt(directory, later_ns), timeout=20, what="the new label")
        _label_namespace(cluster, admin_ns, {key: None})
        wait_until(
            lambda: exempt(directory, admin_ns) is False, timeout=20, what="the label removed"
        )
        assert directory.snapshot().labelled_namespaces == frozenset({later_ns})
    tenant.close()


def test_without_a_label_configured_the_directory_watches_no_namespaces(
    cluster: KubeCluster, node_name: str, gpuguard_kubeconfig: Callable[..., Path]
) -> None:
    with synced_directory(gpuguard_kubeconfig(), node_name) as directory:
        snap = directory.snapshot()
        assert snap.labelled_namespaces is None
        assert [r.name for r in directory._reflectors] == ["pods", "node"]


def test_the_enforcers_start_check_names_the_exempt_names_no_namespace_has(
    cluster: KubeCluster, node_name: str, gpuguard_kubeconfig: Callable[..., Path]
) -> None:
    missing = f"nvidia-device-plugin-{uuid.uuid4().hex[:6]}"
    with capture_logs() as logs:
        api = load_api_client(str(gpuguard_kubeconfig()))
        directory = KubePodDirectory(
            api, node_name=node_name, check_exempt_names=["kube-system", "gpuguard", missing]
        )
        directory.start()
        try:
            wait_until(
                lambda: any(e["event"].startswith("exempt_namespaces_") for e in logs),
                timeout=20,
                what="the start check",
            )
        finally:
            directory.stop()
            api.close()  # type: ignore[no-untyped-call]
    found = [e for e in logs if e["event"].startswith("exempt_namespaces_")]
    assert [(e["event"], e["log_level"], e["names"]) for e in found] == [
        ("exempt_namespaces_missing", "warning", [missing])
    ], found
    assert "limits.exempt_namespace_label" in found[0]["detail"]
