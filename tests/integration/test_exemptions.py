"""Exemptions end to end: ``gpuguard enforce`` as its ServiceAccount (RBAC from
manifests/rbac.yaml) against the real kube-apiserver, real processes in kubepods cgroups and
the NVML stand-in.

A namespace name a tenant may create exempts nothing: ``nvidia-device-plugin``, exempt by name
until the default list was cut to ``kube-system``, is a namespace like any other when a tenant
made it. A namespace the admin labelled with ``limits.exempt_namespace_label`` is exempt, and
the enforcer says at start which names of ``limits.exempt_namespaces`` no Namespace has.
"""

from __future__ import annotations

import time
import uuid

import pytest

from rigs.controlplane import wait_until
from rigs.kubefixtures import ensure_namespace
from rigs.node import GIB, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def test_a_tenant_made_nvidia_device_plugin_namespace_is_stopped_an_admin_labelled_one_is_not(
    rig: Rig,
) -> None:
    key = f"test.gpuguard.io/exempt-{uuid.uuid4().hex[:8]}"
    ensure_namespace(rig.cluster, "nvidia-device-plugin")  # no label: anyone's namespace
    operands = f"gpu-ops-{uuid.uuid4().hex[:8]}"
    ensure_namespace(rig.cluster, operands)
    rig.cluster.admin_request(
        "PATCH",
        f"/api/v1/namespaces/{operands}",
        {"metadata": {"labels": {key: "true"}}},
        content_type="application/merge-patch+json",
    )
    tenant_pod = rig.add_pod(f"greedy-{rig.node}", namespace="nvidia-device-plugin", limit="1Gi")
    operand_pod = rig.add_pod("validator", namespace=operands, limit="1Gi")
    tenant = rig.spawn(tenant_pod, "greedy", used_bytes=3 * GIB)
    operand = rig.spawn(operand_pod, "validator", used_bytes=3 * GIB)
    missing = f"nvidia-gpu-operator-{uuid.uuid4().hex[:6]}"

    enforcer = rig.start_enforcer(
        exempt_namespaces=["kube-system", missing], exempt_namespace_label=f"{key}=true"
    )
    warned = enforcer.wait_for("exempt_namespaces_missing", timeout=30)
    assert warned["names"] == [missing]
    wait_until(lambda: not tenant.alive(), timeout=30, what="the tenant's process to be stopped")
    assert tenant.received() == ["SIGTERM"]
    wait_until(
        lambda: enforcer.metric("gpuguard_refusals_total", {"reason": "exempt"}) == 1.0,
        timeout=15,
        what="the operand's violation refused exempt",
    )
    time.sleep(1.5)  # > grace (1 s) + polls: an operand not exempt would have been signalled
    assert operand.received() == []
    assert operand.alive()
    signalled = enforcer.events("container_signalled")
    assert {e["namespace"] for e in signalled} == {"nvidia-device-plugin"}, signalled
    assert enforcer.metric("gpuguard_refusals_total", {"reason": "exemption_unknown"}) == 0.0
    assert enforcer.stop() == 0
