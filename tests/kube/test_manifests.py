"""The shipped manifests are the chart rendered with its default values (a drift fails), are
accepted by a real API server (schema, defaulting, admission), and the DaemonSet carries what the
enforcer's safety depends on."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs.controlplane import KubeCluster
from rigs.kubefixtures import ensure_namespace

pytestmark = pytest.mark.apiserver

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
_PATHS = {"ConfigMap": "configmaps", "DaemonSet": "daemonsets", "Service": "services"}


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / "daemonset.yaml").read_text()) if d]


def _daemonset(name: str) -> dict[str, Any]:
    (ds,) = [d for d in _docs() if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name]
    return ds


def test_manifests_are_the_chart_rendered_with_its_default_values() -> None:
    import subprocess
    import sys

    from rigs.controlplane import testbin_dir
    from rigs.prereq import require

    helm = testbin_dir() / "helm"
    require(helm.exists(), f"missing {helm}: run scripts/ensure-testbin.sh")
    done = subprocess.run(
        [sys.executable, "-m", "scripts.render_manifests", "--check", "--helm", str(helm)],
        cwd=MANIFESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", ["daemonset.yaml", "dashboard.yaml"])
def test_daemonset_manifest_passes_server_side_validation(
    kube_cluster: KubeCluster, name: str
) -> None:
    ensure_namespace(kube_cluster, "gpuguard")
    docs = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    assert docs
    for doc in docs:
        group_version = doc["apiVersion"]
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{base}/namespaces/gpuguard/{_PATHS[doc['kind']]}?dryRun=All&fieldValidation=Strict"
        created = kube_cluster.admin_request("POST", path, doc)
        assert created["metadata"]["name"] == doc["metadata"]["name"]


def test_daemonset_runs_in_the_host_pid_namespace_with_only_cap_kill() -> None:
    pod = _daemonset("gpuguard")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    enforcer = next(c for c in pod["containers"] if c["name"] == "enforcer")
    caps = enforcer["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["KILL"]}
    env = {e["name"]: e for e in enforcer["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_daemonset_config_loads_with_gpuguards_own_loader(tmp_path: Path) -> None:
    from gpuguard.config import load_settings

    cm = next(d for d in _docs() if d["kind"] == "ConfigMap")
    path = tmp_path / "config.toml"
    path.write_text(cm["data"]["config.toml"])
    tomllib.loads(cm["data"]["config.toml"])
    settings = load_settings(config_path=path, environ={})
    assert settings.enforcement.mode.value == "audit"


def test_the_agents_daemonset_runs_the_agent_non_root_without_capabilities() -> None:
    """The agent runs in a DaemonSet of its own, under its own ServiceAccount (the only one the
    admission fence lets patch a Node); the enforcer's pod runs the enforcer alone."""
    from gpuguard.cli import build_parser

    daemonsets = [d["metadata"]["name"] for d in _docs() if d["kind"] == "DaemonSet"]
    assert sorted(daemonsets) == ["gpuguard", "gpuguard-agent"]
    enforcer_pod = _daemonset("gpuguard")["spec"]["template"]["spec"]
    agent_pod = _daemonset("gpuguard-agent")["spec"]["template"]["spec"]
    assert [c["name"] for c in enforcer_pod["containers"]] == ["enforcer"]
    assert enforcer_pod["serviceAccountName"] == "gpuguard"
    assert agent_pod["serviceAccountName"] == "gpuguard-agent"
    assert "hostPID" not in agent_pod
    containers = {c["name"]: c for c in enforcer_pod["containers"] + agent_pod["containers"]}
    agent = containers["agent"]
    args = build_parser().parse_args(agent["args"])
    assert args.command == "agent"
    security = agent["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The agent's port is the config's default agent.metrics_address, beside the enforcer's.
    from gpuguard.config import load_settings

    settings = load_settings(config_path=None, environ={})
    port = int(settings.agent.metrics_address.rsplit(":", 1)[1])
    assert [p["containerPort"] for p in agent["ports"]] == [port]
    assert [p["containerPort"] for p in containers["enforcer"]["ports"]] != [port]
