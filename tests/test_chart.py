"""The Helm chart (helm/gpuguard; docs/design.md, Helm values) rendered by the real helm: lint, the
schema, each value's effect, the security properties of docs/reliability.md S1-S3, and no drift from
the hand-written manifests/ (RBAC rules, the admission fence's CEL) that tests/kube/ prove against a
real kube-apiserver.

helm is the Go-built binary in testbin (scripts/ensure-testbin.sh); missing, it skips locally and
fails in CI (rigs/prereq.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

import gpuguard
from gpuguard.config import load_settings
from gpuguard.core.model import Mode
from gpuguard.core.sharing import parse_sharing
from gpuguard.errors import ConfigError
from rigs import controlplane
from rigs.controlplane import KubeCluster
from rigs.kubefixtures import ensure_namespace
from rigs.prereq import require
from tests.chart_release import NAMESPACE, RELEASE
from tests.config_cases import BAD_CONFIGS, BadConfig

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "gpuguard"
MANIFESTS = REPO / "manifests"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"

Doc = dict[str, Any]

SHARING = {
    "version": "v1",
    "devicePluginConfig": {"namespace": "nvidia", "name": "time-slicing"},
    "migConfig": {"namespace": "mig", "name": "mig-parted", "key": "config.yaml"},
    "migChangePolicy": "Drain",
    "rules": [
        {
            "name": "t4-shared",
            "nodeSelector": {"matchLabels": {"node.kubernetes.io/instance-type": "g4dn.12xlarge"}},
            "timeSlicing": "slice-4",
        },
        {"name": "a100-mig", "nodeNames": ["gpu-a100-1"], "mig": "all-1g.5gb"},
    ],
}


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The helm binary and an environment whose helm state lives in a temporary directory."""
    binary = controlplane.testbin_dir() / "helm"
    require(os.access(binary, os.X_OK), f"missing {binary}: run scripts/ensure-testbin.sh")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    return binary, env


def run_helm(helm: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    binary, env = helm
    return subprocess.run(
        [str(binary), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def values_args(values: dict[str, Any] | None, tmp: Path) -> list[str]:
    if values is None:
        return []
    path = tmp / f"values-{len(list(tmp.glob('values-*')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def render(
    helm: tuple[Path, dict[str, str]],
    tmp: Path,
    values: dict[str, Any] | None = None,
    *,
    api_versions: Sequence[str] = (),
    chart: Path = CHART,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> list[Doc]:
    """``helm template`` of the chart: the rendered objects."""
    args = ["template", release, str(chart), "--namespace", namespace]
    for api in api_versions:
        args += ["--api-versions", api]
    done = run_helm(helm, *args, *values_args(values, tmp))
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def render_error(helm: tuple[Path, dict[str, str]], tmp: Path, values: dict[str, Any]) -> str:
    done = run_helm(
        helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *values_args(values, tmp)
    )
    assert done.returncode != 0, "helm rendered values the chart must reject"
    return done.stderr


def set_json_error(helm: tuple[Path, dict[str, str]], values: dict[str, Any]) -> str:
    """``render_error`` with each top-level value given as ``--set-json``: JSON, unlike YAML,
    cannot read the string "1e6" or "on" as a number or a boolean."""
    args = [
        a for key, value in values.items() for a in ("--set-json", f"{key}={json.dumps(value)}")
    ]
    done = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *args)
    assert done.returncode != 0, "helm rendered values the chart must reject"
    return done.stderr


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


ENFORCER_DS = "gpuguard"
AGENT_DS = "gpuguard-agent"
AGENT_SA = "gpuguard-agent"


def pod_spec(docs: list[Doc], daemonset: str = ENFORCER_DS) -> Doc:
    spec: Doc = one(docs, "DaemonSet", daemonset)["spec"]["template"]["spec"]
    return spec


def containers(docs: list[Doc]) -> dict[str, Doc]:
    """Every container of the release's DaemonSets (the enforcer's and the agent's), by name."""
    found = [
        c for d in find(docs, "DaemonSet") for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert len({c["name"] for c in found}) == len(found), found
    return {c["name"]: c for c in found}


def config_toml(docs: list[Doc]) -> str:
    text: str = one(docs, "ConfigMap", "gpuguard-config")["data"]["config.toml"]
    return text


def load_rendered_settings(docs: list[Doc], tmp: Path) -> Any:
    path = tmp / "config.toml"
    path.write_text(config_toml(docs))
    return load_settings(config_path=path, environ={})


def manifest_docs(name: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def rules_by_role(docs: list[Doc]) -> dict[tuple[str, str, str | None], list[Doc]]:
    """Each (Cluster)Role's rules, keyed by kind, name and namespace."""
    return {
        (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): d["rules"]
        for d in docs
        if d["kind"] in ("ClusterRole", "Role")
    }


def bindings(docs: list[Doc]) -> dict[tuple[str, str, str | None], tuple[Doc, list[Doc]]]:
    return {
        (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): (
            d["roleRef"],
            d["subjects"],
        )
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
    }


# ---------------------------------------------------------------------------------------------
# The chart as a whole


def test_chart_app_version_is_the_packages_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "gpuguard"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == gpuguard.__version__


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint_passes(helm: tuple[Path, dict[str, str]], strict: bool) -> None:
    done = run_helm(helm, "lint", str(CHART), *(["--strict"] if strict else []))
    assert done.returncode == 0, done.stdout + done.stderr


def test_helm_lint_passes_with_every_optional_object_rendered(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "sharing": SHARING,
                "agent": {"enabled": True, "allowEviction": True},
                "enforcement": {"mode": "enforce"},
                "prometheusRule": {"unboundedGPUMemory": {"thresholdBytes": 0}},
            }
        )
    )
    done = run_helm(helm, "lint", str(CHART), "--strict", "-f", str(values))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_object_carries_the_standard_labels(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(
        helm,
        tmp_path,
        {"sharing": SHARING, "agent": {"enabled": True, "allowEviction": True}},
        api_versions=[SERVICE_MONITOR_API, PROMETHEUS_RULE_API],
    )
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "gpuguard", doc["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == gpuguard.__version__


def test_default_render_names_objects_as_the_manifests_do(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    def keys(docs: list[Doc]) -> set[tuple[str, str, str | None]]:
        return {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs}

    shipped = keys(
        manifest_docs("rbac.yaml")
        + manifest_docs("daemonset.yaml")
        + manifest_docs("agent-admission-policy.yaml")
    )
    rendered = keys(render(helm, tmp_path))
    assert shipped <= rendered, shipped - rendered


# ---------------------------------------------------------------------------------------------
# Security (docs/reliability.md S3) and scheduling


def test_enforcer_runs_in_the_host_pid_namespace_with_only_cap_kill(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    pod = pod_spec(docs)
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork")
    assert not pod.get("hostIPC")
    assert pod["serviceAccountName"] == "gpuguard"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    enforcer = containers(docs)["enforcer"]
    assert enforcer["args"][0] == "enforce"
    security = enforcer["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    env = {e["name"]: e for e in enforcer["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    resources = enforcer["resources"]
    assert resources["requests"]["cpu"]
    assert resources["limits"]["memory"]


def test_the_host_paths_are_the_cgroup_tree_read_only_and_the_node_lock_directory(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    pod = pod_spec(docs)
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "cgroup": {"path": "/sys/fs/cgroup", "type": "Directory"},
        # Reliability R3: every enforcer on the node (a second release too) meets at one lock.
        "lock": {"path": "/run/gpuguard", "type": "DirectoryOrCreate"},
        "pod-resources": {"path": "/var/lib/kubelet/pod-resources", "type": "DirectoryOrCreate"},
    }
    assert [v["name"] for v in pod_spec(docs, AGENT_DS)["volumes"]] == ["config"]
    for container in containers(docs).values():
        for mount in container["volumeMounts"]:
            if (container["name"], mount["name"]) != ("enforcer", "lock"):
                assert mount["readOnly"] is True, (container["name"], mount)
    mounts = {m["name"]: m for m in containers(docs)["enforcer"]["volumeMounts"]}
    assert not mounts["lock"].get("readOnly"), "the lock's holder writes its PID into it"
    # Read-only all the way down: on a cgroup v1 node every controller is a submount of the
    # tree, which a plain read-only bind leaves writable (found on the real node).
    assert mounts["cgroup"]["recursiveReadOnly"] == "IfPossible", mounts["cgroup"]
    # config.toml points where the chart mounts the host's cgroup tree and lock directory.
    settings = load_rendered_settings(docs, tmp_path)
    assert str(settings.node.cgroup_root) == mounts["cgroup"]["mountPath"]
    assert str(settings.node.proc_root) == "/proc"  # hostPID
    assert settings.enforcement.lock_file.parent == Path(mounts["lock"]["mountPath"])


POD_RESOURCES_MOUNT = "/var/lib/kubelet/pod-resources"


def test_the_kubelets_pod_resources_directory_reaches_the_enforcer_only_read_only(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    default = render(helm, tmp_path)
    moved = render(helm, tmp_path, {"kubelet": {"podResourcesDir": "/var/lib/k0s/kubelet/pr"}})
    for docs, host in ((default, POD_RESOURCES_MOUNT), (moved, "/var/lib/k0s/kubelet/pr")):
        volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
        # OrCreate: a node whose kubelet keeps it elsewhere still starts the enforcer.
        assert volumes["pod-resources"]["hostPath"] == {"path": host, "type": "DirectoryOrCreate"}
        mounts = {m["name"]: m for m in containers(docs)["enforcer"]["volumeMounts"]}
        assert mounts["pod-resources"] == {
            "name": "pod-resources",
            "mountPath": POD_RESOURCES_MOUNT,
            "readOnly": True,
        }
        assert "pod-resources" not in {v["name"] for v in pod_spec(docs, AGENT_DS)["volumes"]}
        assert all(
            m["mountPath"] != POD_RESOURCES_MOUNT for m in containers(docs)["agent"]["volumeMounts"]
        )
        # config.toml reads the socket where the chart mounts the directory.
        socket = load_rendered_settings(docs, tmp_path).node.pod_resources_socket
        assert socket == Path(POD_RESOURCES_MOUNT) / "kubelet.sock"
    # Reading the socket asks nothing more of the enforcer: the same securityContext (UID 0,
    # which owns the kubelet's socket, and CAP_KILL only).
    assert containers(moved)["enforcer"]["securityContext"] == {
        "runAsUser": 0,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": {"drop": ["ALL"], "add": ["KILL"]},
    }


def test_an_empty_pod_resources_dir_mounts_nothing_and_turns_the_reads_off(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, {"kubelet": {"podResourcesDir": ""}})
    assert "pod-resources" not in {v["name"] for v in pod_spec(docs)["volumes"]}
    assert "pod-resources" not in {m["name"] for m in containers(docs)["enforcer"]["volumeMounts"]}
    assert load_rendered_settings(docs, tmp_path).node.pod_resources_socket is None


def test_the_allocation_guard_adds_bpf_perfmon_and_the_driver_directory_only_when_on(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Off (default): the enforcer is as without the value, and gpuguard's loader reads the guard
    off. On: CAP_BPF and CAP_PERFMON besides CAP_KILL, the host directory read-only, and the
    library gpuguard loads from config.toml is libcuda.so.1 in that mount, on another host
    directory too (NVIDIA's GPU operator keeps the driver under /run/nvidia/driver)."""
    off = render(helm, tmp_path)
    assert load_rendered_settings(off, tmp_path).enforcement.alloc_guard is False
    assert containers(off)["enforcer"]["securityContext"]["capabilities"]["add"] == ["KILL"]
    assert "driver-lib" not in {v["name"] for v in pod_spec(off)["volumes"]}
    for host in ("/usr/lib/x86_64-linux-gnu", "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"):
        docs = render(
            helm, tmp_path, {"enforcement": {"allocGuard": {"enabled": True, "libraryDir": host}}}
        )
        enforcer = containers(docs)["enforcer"]
        assert enforcer["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["KILL", "BPF", "PERFMON"],
        }
        assert enforcer["securityContext"]["privileged"] is False
        volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
        assert volumes["driver-lib"]["hostPath"] == {"path": host, "type": "DirectoryOrCreate"}
        mounts = {m["name"]: m for m in enforcer["volumeMounts"]}
        assert mounts["driver-lib"]["readOnly"] is True
        settings = load_rendered_settings(docs, tmp_path)
        assert settings.enforcement.alloc_guard is True
        library = settings.enforcement.alloc_guard_library
        assert library == Path(mounts["driver-lib"]["mountPath"]) / "libcuda.so.1"
        # The agent gets neither.
        assert containers(docs)["agent"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "driver-lib" not in {v["name"] for v in pod_spec(docs, AGENT_DS)["volumes"]}
        # Nothing else of the enforcer's pod changes.
        for pod in (pod_spec(docs), pod_spec(off)):
            pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "driver-lib"]
            enforcer_of = next(c for c in pod["containers"] if c["name"] == "enforcer")
            enforcer_of["volumeMounts"] = [
                m for m in enforcer_of["volumeMounts"] if m["name"] != "driver-lib"
            ]
            enforcer_of["securityContext"]["capabilities"]["add"] = ["KILL"]
        assert pod_spec(docs) == pod_spec(off)


@pytest.mark.parametrize("directory", ["var/lib/kubelet/pod-resources", 7])
def test_schema_rejects_a_pod_resources_dir_that_is_not_absolute(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, directory: object
) -> None:
    assert "values don't meet the specifications of the schema" in render_error(
        helm, tmp_path, {"kubelet": {"podResourcesDir": directory}}
    )


def test_agent_runs_non_root_without_capabilities(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    assert [c["name"] for c in pod_spec(docs)["containers"]] == ["enforcer"]
    pod = pod_spec(docs, AGENT_DS)
    # Its own pod: its own ServiceAccount, no host PID namespace, no GPU
    # runtime; the enforcer's pod keeps its account.
    assert pod["serviceAccountName"] == AGENT_SA
    assert pod_spec(docs)["serviceAccountName"] == "gpuguard"
    for host in ("hostPID", "hostNetwork", "hostIPC", "runtimeClassName"):
        assert host not in pod, host
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (agent,) = pod["containers"]
    assert agent["name"] == "agent"
    assert agent["args"][0] == "agent"
    security = agent["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent["resources"]["limits"]["memory"]


def test_probes_and_the_metrics_service_use_the_configured_ports(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    settings = load_rendered_settings(docs, tmp_path)
    ports = {
        "enforcer": int(settings.metrics.address.rsplit(":", 1)[1]),
        "agent": int(settings.agent.metrics_address.rsplit(":", 1)[1]),
    }
    assert ports == {"enforcer": 9410, "agent": 9411}
    for name, container in containers(docs).items():
        (port,) = container["ports"]
        assert port["containerPort"] == ports[name]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    service = one(docs, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "enforcer-metrics": 9410,
        "agent-metrics": 9411,
    }
    for ds in find(docs, "DaemonSet"):
        pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), ds["metadata"]["name"]


def test_the_two_daemonsets_never_select_each_others_pods(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A DaemonSet adopts an orphan that its selector matches and deletes all but the oldest of
    its pods on a node: the enforcer's selector (immutable since the first install) must not
    match the agent's pods, nor the agent's the enforcer's."""
    docs = render(helm, tmp_path)
    enforcer, agent = one(docs, "DaemonSet", ENFORCER_DS), one(docs, "DaemonSet", AGENT_DS)
    assert enforcer["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "gpuguard", "app.kubernetes.io/instance": RELEASE}
    }

    def selects(ds: Doc, pod_of: Doc) -> bool:
        labels = pod_of["spec"]["template"]["metadata"]["labels"]
        return bool(ds["spec"]["selector"]["matchLabels"].items() <= labels.items())

    assert selects(enforcer, enforcer)
    assert selects(agent, agent)
    assert not selects(enforcer, agent)
    assert not selects(agent, enforcer)
    components = {
        ds["metadata"]["name"]: ds["spec"]["template"]["metadata"]["labels"][
            "app.kubernetes.io/component"
        ]
        for ds in (enforcer, agent)
    }
    assert components == {ENFORCER_DS: "enforcer", AGENT_DS: "agent"}


def test_runs_on_gpu_nodes_tolerating_the_gpu_taint_as_node_critical(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    for name in (ENFORCER_DS, AGENT_DS):
        pod = pod_spec(docs, name)
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert pod["priorityClassName"] == "system-node-critical"


def test_scheduling_image_and_resources_follow_the_values(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(
        helm,
        tmp_path,
        {
            # Helm merges maps: null removes the default's key.
            "nodeSelector": {"gpu": "yes", "nvidia.com/gpu.present": None},
            "tolerations": [],
            "priorityClassName": "",
            "runtimeClassName": "",
            "image": {"repository": "registry.example/gg", "tag": "dev", "pullPolicy": "Always"},
            "resources": {"enforcer": {"limits": {"memory": "1Gi"}}, "agent": None},
        },
    )
    for name in (ENFORCER_DS, AGENT_DS):
        pod = pod_spec(docs, name)
        assert pod["nodeSelector"] == {"gpu": "yes"}
        assert "tolerations" not in pod
        assert "priorityClassName" not in pod
        assert "runtimeClassName" not in pod
    by_name = containers(docs)
    for container in by_name.values():
        assert container["image"] == "registry.example/gg:dev"
        assert container["imagePullPolicy"] == "Always"
    assert by_name["enforcer"]["resources"] == {
        "requests": {"cpu": "20m", "memory": "96Mi"},
        "limits": {"memory": "1Gi"},
    }
    assert "resources" not in by_name["agent"]


def test_image_tag_defaults_to_the_app_version(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    for container in containers(render(helm, tmp_path)).values():
        assert container["image"] == f"ghcr.io/gpuguard/gpuguard:{gpuguard.__version__}"


# ---------------------------------------------------------------------------------------------
# The schema


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"bogus": 1}, "bogus"),
        ({"agent": {"enabled": True, "allowEviction": False, "evict": True}}, "evict"),
        ({"serviceMonitor": {"enabled": True, "release": "x"}}, "release"),
        ({"config": {"unknown_section": {}}}, "unknown_section"),
        ({"config": {"limits": {"defualt": "8Gi"}}}, "defualt"),
        ({"config": {"limits": {"namespaces": {"team": {"maximum": "8Gi"}}}}}, "maximum"),
        ({"sharing": {"version": "v1", "rule": []}}, "rule"),
        ({"sharing": {"version": "v1", "rules": [{"name": "a", "nodes": []}]}}, "nodes"),
    ],
    ids=[
        "top-level",
        "agent",
        "serviceMonitor",
        "config-section",
        "config-key",
        "config-namespace-key",
        "sharing",
        "sharing-rule",
    ],
)
def test_schema_rejects_unknown_keys(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, values: dict[str, Any], complaint: str
) -> None:
    assert complaint in render_error(helm, tmp_path, values)


@pytest.mark.parametrize(
    "values",
    [
        {"enforcement": {"mode": "bogus"}},
        {"config": {"limits": {"namespaces": {"team": {"mode": "bogus"}}}}},
        {"sharing": {"version": "v1", "migChangePolicy": "Sometimes"}},
        {"agent": {"enabled": "yes", "allowEviction": False}},
        {"serviceMonitor": {"honorLabels": "true"}},
        {"nodeSelector": {"nvidia.com/gpu.present": True}},
        # A surge pod waits for the node lock the old pod holds: never ready, a stalled rollout.
        {"updateStrategy": {"rollingUpdate": {"maxSurge": 1}}},
    ],
    ids=[
        "mode",
        "namespace-mode",
        "mig-change-policy",
        "agent-enabled",
        "honor-labels",
        "label",
        "max-surge",
    ],
)
def test_schema_rejects_wrong_values(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, values: dict[str, Any]
) -> None:
    assert "values don't meet the specifications of the schema" in render_error(
        helm, tmp_path, values
    )


@pytest.mark.parametrize(
    "values",
    [
        {"config": {"version": 1}},
        {"config": {"node": {"cgroup_root": "/sys/fs/cgroup"}}},
        {"config": {"enforcement": {"mode": "enforce"}}},
        {"config": {"enforcement": {"lock_file": "/tmp/enforcer.lock"}}},
        {"config": {"agent": {"allow_eviction": True}}},
        {"config": {"agent": {"sharing_name": "other"}}},
        {"config": {"metrics": {"address": "127.0.0.1:9410"}}},
    ],
    ids=[
        "version",
        "node",
        "mode",
        "lock-file",
        "allow-eviction",
        "sharing-name",
        "metrics-address",
    ],
)
def test_config_keys_the_chart_owns_fail_naming_what_sets_them(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, values: dict[str, Any]
) -> None:
    """Refused by the schema (``helm lint`` fails too), in words that say what sets each, not
    only "additional properties 'mode' not allowed"."""
    error = render_error(helm, tmp_path, values)
    (owned,) = [k for k in CHART_OWNED if f"at '/config/{k.replace('.', '/')}'" in error]
    assert "value must be 'not in config, the chart sets it (" in error, error
    hint = {
        "enforcement.mode": "the value enforcement.mode; --set enforcement.mode=enforce",
        "agent.allow_eviction": "the value agent.allowEviction; --set agent.allowEviction=true",
        "agent.sharing_name": "the value sharing",
    }.get(owned)
    if hint is not None:
        assert hint in error, error


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--set", "enforcement.grace_seconds=5"],
            "at '/enforcement/grace_seconds': value must be 'not here: this is "
            "config.enforcement.grace_seconds (--set config.enforcement.grace_seconds=…)'",
        ),
        (
            ["--set", "agent.interval_seconds=2"],
            "at '/agent/interval_seconds': value must be 'not here: this is "
            "config.agent.interval_seconds",
        ),
        (
            ["--set-string", "limits.default=16Gi"],
            "at '/limits': value must be 'not here: the [limits] settings go under config, as "
            "config.limits",
        ),
        (
            ["--set", "config.enforcement.mode=enforce"],
            "at '/config/enforcement/mode': value must be 'not in config, the chart sets it (the "
            "value enforcement.mode; --set enforcement.mode=enforce)'",
        ),
    ],
    ids=["grace-at-top-level", "agent-interval", "limits-at-top-level", "mode-in-config"],
)
def test_a_value_under_the_wrong_key_fails_naming_the_right_one(
    helm: tuple[Path, dict[str, str]], args: list[str], says: str
) -> None:
    """``helm template`` and ``helm lint`` alike (lint fails on the schema only)."""
    for command in (["template", RELEASE], ["lint"]):
        done = run_helm(helm, *command, str(CHART), "-n", NAMESPACE, *args)
        assert done.returncode != 0, done.stdout
        assert says in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("value", "suggested", "fixed"),
    [
        ("config.limits.default=16", "config.limits.default=16Gi", "config.limits.default=16Gi"),
        (
            "config.enforcement.fast_step_bytes=0",
            "config.enforcement.fast_step_bytes=64Mi",
            "config.enforcement.fast_step_bytes=0",
        ),
        (
            "config.limits.namespaces.team-a.max=17179869184",
            "config.limits.namespaces.<namespace>.max=16Gi",
            "config.limits.namespaces.team-a.max=17179869184",
        ),
    ],
    ids=["cluster-default", "fast-step", "namespace-max"],
)
def test_a_bare_number_for_a_quantity_fails_with_a_set_string_hint(
    helm: tuple[Path, dict[str, str]], value: str, suggested: str, fixed: str
) -> None:
    """``--set config.limits.default=16`` gives the number 16, which the schema only called
    "got number, want string"; it now says what to write instead, and that renders."""
    done = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", value)
    assert done.returncode != 0, done.stdout
    assert "got number, want string" in done.stderr, done.stderr
    assert (
        f"value must be 'a quantity string: --set-string {suggested}, or quote it in the values "
        "file"
    ) in done.stderr, done.stderr
    done = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--set-string", fixed)
    assert done.returncode == 0, done.stderr


CHART_OWNED = {
    "version",
    "node",
    "metrics",
    "enforcement.mode",
    "enforcement.lock_file",
    "enforcement.alloc_guard",
    "enforcement.alloc_guard_library",
    "agent.allow_eviction",
    "agent.sharing_namespace",
    "agent.sharing_name",
    "agent.metrics_address",
}


def test_schema_config_keys_are_config_example_tomls_minus_the_charts() -> None:
    """A key added to gpuguard's config must be added to the schema (or to CHART_OWNED)."""
    example = tomllib.loads((REPO / "config.example.toml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]

    def settable(table: dict[str, Any], prefix: str) -> set[str]:
        keys = set()
        for key, value in table.items():
            dotted = prefix + key
            if dotted in CHART_OWNED or dotted == "limits.namespaces":
                continue
            if isinstance(value, dict):
                keys |= settable(value, dotted + ".")
            else:
                keys.add(dotted)
        return keys

    def in_schema(node: dict[str, Any], prefix: str) -> set[str]:
        keys = set()
        for key, sub in node.get("properties", {}).items():
            dotted = prefix + key
            if dotted == "limits.namespaces" or dotted in CHART_OWNED:
                assert dotted == "limits.namespaces" or "type" not in sub, dotted
                continue
            assert "additionalProperties" in sub or sub.get("type") != "object", dotted
            if sub.get("type") == "object":
                keys |= in_schema(sub, dotted + ".")
            else:
                keys.add(dotted)
        return keys

    assert config["additionalProperties"] is False
    assert in_schema(config, "") == settable(example, "")
    per_namespace = config["properties"]["limits"]["properties"]["namespaces"]
    assert set(per_namespace["additionalProperties"]["properties"]) == set(
        example["limits"]["namespaces"]["team-onboarding"]
    )


def test_schema_closes_every_object_it_defines() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_on_purpose = {"global", "affinity"}  # Helm's, and Kubernetes' own Affinity type

    def walk(node: dict[str, Any], where: str) -> None:
        if node.get("type") == "object" and where not in open_on_purpose:
            assert "additionalProperties" in node, where
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{where}.{key}" if where else key)
        additional = node.get("additionalProperties")
        if isinstance(additional, dict):
            walk(additional, where + ".*")
        items = node.get("items")
        if isinstance(items, dict):
            walk(items, where + "[]")

    walk(schema, "")


# ---------------------------------------------------------------------------------------------
# The value `config`, checked as gpuguard checks it: values.schema.json's `config` and
# files/config-rules.json (templates/_config_check.tpl) are generated from gpuguard/config/rules.py


GENERATOR = "scripts.gen_values_schema"
CHART_VALUES = {
    "enforcement.mode": "enforcement.mode",
    "agent.allow_eviction": "agent.allowEviction",
}
"""Chart-owned config keys a chart value sets: the schema checks that value."""


def test_the_config_schema_and_rules_are_what_the_loader_generates() -> None:
    done = subprocess.run(
        [sys.executable, "-m", GENERATOR, "--check"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_issues_example_fails_helm_with_gpuguards_reason(
    helm: tuple[Path, dict[str, str]],
) -> None:
    """``--set config.limits.default=16GB`` rendered, and every enforcer then exited 2. (``helm
    lint`` only logs a template's ``fail`` at INFO, by design: its schema errors fail it.)"""
    for command in ("template", "install --dry-run=client"):
        args = [*command.split(), RELEASE, str(CHART), "--namespace", NAMESPACE]
        done = run_helm(helm, *args, "--set", "config.limits.default=16GB")
        assert done.returncode != 0, done.stdout
        assert (
            'config.limits.default = "16GB": has an unknown unit (did you mean 16Gi or 16G?): '
            "use a positive Kubernetes quantity"
        ) in done.stdout + done.stderr


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[case.id for case in BAD_CONFIGS])
def test_helm_refuses_every_value_gpuguard_refuses(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, case: BadConfig
) -> None:
    """The same list tests/test_config.py gives the loader; helm names the value's place and
    says what is wrong: gpuguard's words, or the schema's for a wrong type or closed set."""
    owned = next((k for k in CHART_OWNED if f"{case.key}.".startswith(f"{k}.")), None)
    if any(isinstance(v, float) and not math.isfinite(v) for v in leaves(case.config)):
        # YAML's .nan and .inf: helm refuses the values file itself (no JSON for them).
        assert "unsupported value" in render_error(helm, tmp_path, {"config": case.config})
    elif owned is not None:
        # Not a Helm value: the chart sets it (the schema says what does). Where a chart value
        # does, the schema checks it.
        error = set_json_error(helm, {"config": case.config})
        assert f"at '/config/{owned.replace('.', '/')}': value must be 'not in config" in error
        if owned in CHART_VALUES:
            path = CHART_VALUES[owned].split(".")
            values: dict[str, Any] = {path[0]: {path[1]: leaves(case.config)[0]}}
            error = set_json_error(helm, values)
            assert f"at '/{'/'.join(path)}'" in error, error
    elif case.chart is not None:
        error = set_json_error(helm, {"config": case.config})
        assert f"at '/config/{case.key.replace('.', '/')}" in error, error
        assert case.chart in error, error
    else:
        error = set_json_error(helm, {"config": case.config})
        named = re.match(r"\[?([\w.-]+)", case.names)
        assert named is not None
        assert "gpuguard would refuse this config" in error, error
        assert f"config.{named.group(1)}" in error, error
        assert case.reason in error, error


def leaves(table: object) -> list[object]:
    if isinstance(table, dict):
        return [leaf for value in table.values() for leaf in leaves(value)]
    return [table]


def example_values(path: Path) -> dict[str, Any]:
    """A config file as the Helm value ``config``: the chart's own keys left out, quantities as
    strings (Helm renders a YAML number as a TOML float, which a quantity key refuses)."""
    rules = json.loads((CHART / "files" / "config-rules.json").read_text())["fields"]
    config: dict[str, Any] = {}
    for section, table in tomllib.loads(path.read_text()).items():
        if section not in rules:
            continue
        for key, value in table.items():
            if f"{section}.{key}" in CHART_OWNED:
                continue
            quantity = rules[section][key]["kind"] == "quantity"
            config.setdefault(section, {})[key] = str(value) if quantity else value
    return config


@pytest.mark.parametrize(
    "path",
    [REPO / "config.example.toml", REPO / "tests" / "fixtures" / "config" / "production.toml"],
    ids=["config.example.toml", "production.toml"],
)
def test_a_valid_config_renders_and_loads_as_gpuguard_loads_it(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, path: Path
) -> None:
    docs = render(helm, tmp_path, {"config": example_values(path)})
    rendered = load_rendered_settings(docs, tmp_path).to_dict()
    direct = load_settings(config_path=path, environ={}).to_dict()
    for dotted in CHART_OWNED - {"version"}:
        section, _, key = dotted.partition(".")
        for settings in (rendered, direct):
            if key:
                del settings[section][key]
            else:
                del settings[section]
    assert rendered == direct


QUANTITIES = [
    "16GB", "8gb", "8 GB", "8Gi", "0", "-0", "0Mi", "1Mi", "1023Ki", "1024Ki", "1048575",
    "1048576", "1048575.5", "16", "1.5Gi", ".5Gi", "5.", "5.Gi", "1e6", "1e7", "1E", "1e", "1ki",
    "1ke3", "1.2.3", "1Gi3", "+1Gi", "-1Gi", "-0.5", " 1Gi", "1 Gi", "1Gi ", "1\u00a0Gi", "１Gi",
    "1_000", "NaN", "Infinity", "0.001Gi", "0.0009765625Gi", "1.048576M", "1m", "1n", "1u",
    "1K", "1e-3Ti", "1Ei", "9Ei", "1e400", "1e-400", "1e1000000000000000000",
    "1e999999999999999999", "100e999999999999999999", "0e1000000000000000000",
    "0.0e1000000000000000000", "1e-1999999999999999997", "1e-1999999999999999998",
    "100%", "101%", "100.0%", "100.0001%", "0100%", "0%", "-0%", "-5%", "+5%", "5 %", "%",
    "25%%", "0.0001%", "0.00009%", "0.0000953674316406%", "0.00009536743164062%",
    "0.000095367431640625%", "0.00009536743164063%", "", "1" + "0" * 63, "1" + "0" * 64,
]  # fmt: skip
"""Quantity texts at the edges of gpuguard's rules: grammar, suffixes, zero, sign, the 1Mi and
the percentage bounds, Decimal's exponent range, the length bound."""


def quantity_corpus() -> list[str]:
    rng = random.Random(25)
    alphabet = "0123456789.eEinumkKMGTP+-% "
    noise = ["".join(rng.choices(alphabet, k=rng.randint(1, 8))) for _ in range(300)]
    return QUANTITIES + noise


@pytest.mark.parametrize("table", ["default", "max"])
def test_the_chart_judges_every_limit_as_gpuguard_does(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, table: str
) -> None:
    """One namespace table per text, so one render judges them all; each verdict and message
    is the loader's (the quoted value gpuguard puts before "is longer than" aside)."""
    texts = quantity_corpus()
    namespaces = {f"n{i}": {table: text} for i, text in enumerate(texts)}
    error = set_json_error(helm, {"config": {"limits": {"namespaces": namespaces}}})
    refused = dict(
        re.findall(rf"^  - config\.limits\.namespaces\.(n\d+)\.{table} = .*?\": (.*)$", error, re.M)
    )
    for i, text in enumerate(texts):
        expected = loader_problem(tmp_path, f"[limits.namespaces.n]\n{table} = {json.dumps(text)}")
        assert refused.get(f"n{i}") == expected, (text, error)


@pytest.mark.parametrize("key", ["enforcement.fast_step_bytes", "limits.replicas_reserve_bytes"])
def test_the_chart_judges_every_size_as_gpuguard_does(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, key: str
) -> None:
    section, _, name = key.partition(".")
    for text in QUANTITIES:
        done = run_helm(
            helm, "template", RELEASE, str(CHART), "--set-json",
            f"config={json.dumps({section: {name: text}})}",
        )  # fmt: skip
        found = re.search(rf"^  - config\.{re.escape(key)} = .*?\": (.*)$", done.stderr, re.M)
        expected = loader_problem(tmp_path, f"[{section}]\n{name} = {json.dumps(text)}")
        assert (found.group(1) if found else None) == expected, (text, done.stderr)
        assert (done.returncode == 0) == (expected is None), (text, done.stderr)


def loader_problem(tmp: Path, toml: str) -> str | None:
    """What the loader says of the file's one value, after "<key> = <value>: "; None if valid.
    The "too long" message starts with the value, shortened: kept from "is longer"."""
    path = tmp / "one.toml"
    path.write_text(f"version = 1\n{toml}\n")
    try:
        load_settings(config_path=path, environ={})
    except ConfigError as error:
        (problem,) = error.problems
        reason = problem.split('": ', 1)[1]
        return reason[reason.index("is longer") :] if "is longer than" in reason else reason
    return None


def test_the_chart_judges_every_number_at_its_bounds_as_gpuguard_does(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Each number key at, just inside and just outside its bounds, all keys in one render."""
    rules = json.loads((CHART / "files" / "config-rules.json").read_text())["fields"]
    numbers = {
        (section, key): rule
        for section, table in rules.items()
        for key, rule in table.items()
        if rule["kind"] == "number"
    }
    probes: list[Any] = [lambda r: r["minimum"], lambda r: r["minimum"] - 0.001,
                         lambda r: r["minimum"] + 0.001, lambda r: r["maximum"] or 1e9,
                         lambda r: (r["maximum"] or 1e9) + 0.001]  # fmt: skip
    for probe in probes:
        config: dict[str, Any] = {}
        for (section, key), rule in numbers.items():
            config.setdefault(section, {})[key] = probe(rule)
        done = run_helm(
            helm, "template", RELEASE, str(CHART), "--set-json", f"config={json.dumps(config)}"
        )
        for (section, key), rule in numbers.items():
            value = config[section][key]
            own = f"{section}.{key} = {json.dumps(value)}: {rule['allowed']}"
            path = tmp_path / "n.toml"
            path.write_text(f"version = 1\n[{section}]\n{key} = {value!r}\n")
            try:
                load_settings(config_path=path, environ={})
                problems = []
            except ConfigError as error:
                problems = error.problems
            refused = f"{path}: {section}.{key} = {value!r}: {rule['allowed']}" in problems
            assert (f"  - config.{own}" in done.stderr) == refused, (own, done.stderr)


# ---------------------------------------------------------------------------------------------
# config.toml


def test_config_loads_with_gpuguards_loader_in_audit_mode_by_default(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path)
    settings = load_rendered_settings(docs, tmp_path)
    assert settings.enforcement.mode is Mode.AUDIT
    assert settings.agent.allow_eviction is False
    assert settings.agent.sharing_namespace == NAMESPACE
    assert settings.agent.sharing_name == "gpuguard-sharing"


def test_enforcement_mode_enforce_reaches_the_config(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, {"enforcement": {"mode": "enforce"}})
    assert load_rendered_settings(docs, tmp_path).enforcement.mode is Mode.ENFORCE


def test_config_values_reach_the_config_and_roll_the_pods(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    config = {
        "enforcement": {"grace_seconds": 3, "poll_interval_seconds": 0.5},
        "limits": {
            "default": "16Gi",
            "replicas_reserve_bytes": "2Gi",
            "exempt_namespaces": ["kube-system"],
            "namespaces": {"team-a": {"default": "8Gi", "max": "40Gi", "mode": "audit"}},
        },
        "agent": {"interval_seconds": 2},
        "logging": {"level": "debug", "format": "json"},
    }
    default = render(helm, tmp_path)
    docs = render(helm, tmp_path, {"config": config, "enforcement": {"mode": "enforce"}})
    settings = load_rendered_settings(docs, tmp_path)
    assert settings.enforcement.grace_seconds == 3
    assert settings.enforcement.mode is Mode.ENFORCE  # the chart's key beside the user's
    assert settings.limits.replicas_reserve_bytes == 2 * 2**30
    assert settings.limits.exempt_namespaces == frozenset({"kube-system"})
    assert set(settings.limits.namespaces) == {"team-a"}
    assert settings.agent.interval_seconds == 2
    assert settings.logging.level.value == "debug"

    def checksum(rendered: list[Doc], daemonset: str) -> str:
        template = one(rendered, "DaemonSet", daemonset)["spec"]["template"]
        value: str = template["metadata"]["annotations"]["checksum/config"]
        return value

    for name in (ENFORCER_DS, AGENT_DS):
        assert checksum(docs, name) != checksum(default, name)


# ---------------------------------------------------------------------------------------------
# RBAC (docs/reliability.md S1) and the admission fence (docs/design.md, Sharing config)


def test_rbac_rules_equal_the_manifests(helm: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """Drift test: the rules tests/kube/ prove against a real API server are the chart's."""
    docs = render(helm, tmp_path)
    assert rules_by_role(docs) == rules_by_role(manifest_docs("rbac.yaml"))
    assert bindings(docs) == bindings(manifest_docs("rbac.yaml"))
    accounts = {d["metadata"]["name"] for d in find(docs, "ServiceAccount")}
    assert accounts == {"gpuguard", AGENT_SA}
    shipped = {d["metadata"]["name"] for d in find(manifest_docs("rbac.yaml"), "ServiceAccount")}
    assert shipped == accounts


# What each ServiceAccount may do with default values, as
# {(namespace or None for cluster-wide): [rules]}: the enforcer reads pods and its Node (for
# mig.config.state and the time-slicing replicas) and writes Events on pods anywhere; the agent
# alone patches Nodes (under the fence), reads its node's pods, the sharing ConfigMap and
# NVIDIA's two by name, and writes Events on its Node (namespace default). The enforcer also
# reads DRA claims and its node's ResourceSlices (DRA_READ).
# Events: create only, core/v1 only (KubeEventSink posts a new Event each time); what each
# account may create is fenced (the Event fences).
EVENTS_RULES = [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
PODS_READ = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
# The enforcer's DRA reads (limit source "dra"), granted with default values too (rbac.yaml says
# why): its pods' claims by name, its node's ResourceSlices.
DRA_READ = [
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list", "watch"]},
]
NODE_CONDITION_WRITE: Doc = {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}
ACCOUNT_RULES: dict[str, dict[str | None, list[Doc]]] = {
    "gpuguard": {
        None: [
            PODS_READ,
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            # The GPUMemoryEnforced condition of its own Node (the condition fence holds it to
            # that): patch alone, on nodes/status alone.
            NODE_CONDITION_WRITE,
            # Which namespaces carry the admin's exempt label; which exempt names exist.
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
            *EVENTS_RULES,
            *DRA_READ,
        ]
    },
    AGENT_SA: {
        None: [
            {
                "apiGroups": [""],
                "resources": ["nodes"],
                "verbs": ["get", "list", "watch", "patch"],
            },
            PODS_READ,
        ],
        "default": EVENTS_RULES,
        NAMESPACE: [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": ["gpuguard-sharing"],
                "verbs": ["get", "list", "watch"],
            }
        ],
        "gpu-operator": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": ["nvidia-time-slicing-config", "nvidia-mig-config"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    },
}


def rules_by_account(docs: list[Doc]) -> dict[str, dict[str | None, list[Doc]]]:
    """Each ServiceAccount's rules, through the bindings: {account: {namespace: rules}}
    (``None``: a ClusterRoleBinding, cluster-wide)."""
    roles = rules_by_role(docs)
    got: dict[str, dict[str | None, list[Doc]]] = {}
    for (kind, _, namespace), (ref, subjects) in bindings(docs).items():
        role_namespace = namespace if ref["kind"] == "Role" else None
        rules = roles[(ref["kind"], ref["name"], role_namespace)]
        for subject in subjects:
            assert subject["kind"] == "ServiceAccount", subject
            assert subject["namespace"] == NAMESPACE, subject
            scope = None if kind == "ClusterRoleBinding" else namespace
            got.setdefault(subject["name"], {}).setdefault(scope, []).extend(rules)
    for scopes in got.values():  # in a stable order: which binding renders first is no rule
        for scope, rules in scopes.items():
            scopes[scope] = sorted(rules, key=lambda r: json.dumps(r, sort_keys=True))
    return got


def sorted_rules(accounts: dict[str, dict[str | None, list[Doc]]]) -> Any:
    return {
        account: {
            scope: sorted(rules, key=lambda r: json.dumps(r, sort_keys=True))
            for scope, rules in scopes.items()
        }
        for account, scopes in accounts.items()
    }


def test_each_service_account_holds_exactly_its_components_rules(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The enforcer's account may not patch Nodes (nor read the agent's ConfigMaps); only the
    agent's may, under the fence. Also as shipped in manifests/rbac.yaml."""
    expected = sorted_rules(ACCOUNT_RULES)
    assert rules_by_account(render(helm, tmp_path)) == expected
    assert rules_by_account(manifest_docs("rbac.yaml")) == expected
    without_agent = render(helm, tmp_path, {"agent": {"enabled": False, "allowEviction": False}})
    assert rules_by_account(without_agent) == {"gpuguard": expected["gpuguard"]}
    with_eviction = rules_by_account(
        render(helm, tmp_path, {"agent": {"enabled": True, "allowEviction": True}})
    )
    eviction = {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}
    assert with_eviction == sorted_rules(
        {
            **ACCOUNT_RULES,
            AGENT_SA: {**ACCOUNT_RULES[AGENT_SA], None: [*ACCOUNT_RULES[AGENT_SA][None], eviction]},
        }
    )


def test_eviction_rbac_and_config_key_only_with_allow_eviction(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    without = render(helm, tmp_path)
    assert not any("pods/eviction" in json.dumps(d) for d in without)
    assert load_rendered_settings(without, tmp_path).agent.allow_eviction is False

    docs = render(helm, tmp_path, {"agent": {"enabled": True, "allowEviction": True}})
    assert load_rendered_settings(docs, tmp_path).agent.allow_eviction is True
    eviction = manifest_docs("agent-eviction-rbac.yaml")
    added_roles = {k: v for k, v in rules_by_role(docs).items() if k not in rules_by_role(without)}
    assert added_roles == rules_by_role(eviction)
    added_bindings = {k: v for k, v in bindings(docs).items() if k not in bindings(without)}
    assert added_bindings == bindings(eviction)


def test_rbac_has_no_wildcards_and_no_dangerous_grants(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(
        helm, tmp_path, {"sharing": SHARING, "agent": {"enabled": True, "allowEviction": True}}
    )
    forbidden_resources = {"secrets", "pods/exec", "nodes/status", "nodes/proxy"}
    forbidden_verbs = {"delete", "deletecollection", "update", "escalate", "bind", "impersonate"}
    for role, rules in rules_by_role(docs).items():
        for rule in rules:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), rule
            if role == ("ClusterRole", "gpuguard-enforcer", None) and rule == NODE_CONDITION_WRITE:
                continue  # its Node condition, behind the condition fence
            assert not set(rule["resources"]) & forbidden_resources, rule
            assert not set(rule["verbs"]) & forbidden_verbs, rule


def test_nvidia_config_reader_follows_the_configmaps_sharing_names(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, {"sharing": SHARING})
    roles = {
        d["metadata"]["namespace"]: d["rules"]
        for d in find(docs, "Role", "gpuguard-nvidia-config-reader")
    }
    assert roles == {
        "nvidia": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": ["time-slicing"],
                "verbs": ["get", "list", "watch"],
            }
        ],
        "mig": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": ["mig-parted"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    bound = {
        d["metadata"]["namespace"]: d["subjects"]
        for d in find(docs, "RoleBinding", "gpuguard-nvidia-config-reader")
    }
    assert set(bound) == {"nvidia", "mig"}
    for subjects in bound.values():
        assert subjects == [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": NAMESPACE}]


def fence_spec(doc: Doc) -> Doc:
    spec: Doc = json.loads(json.dumps(doc["spec"]))
    (condition,) = spec["matchConditions"]
    condition["expression"] = "<username>"
    return spec


def test_admission_fence_is_the_manifests_cel_bound_to_the_agents_service_account(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    shipped = manifest_docs("agent-admission-policy.yaml")
    shipped_policy = one(shipped, "ValidatingAdmissionPolicy", "gpuguard-agent-node-fence")
    for release, namespace, user in [
        (RELEASE, NAMESPACE, "system:serviceaccount:gpuguard:gpuguard-agent"),
        ("prod", "gpu-system", "system:serviceaccount:gpu-system:prod-gpuguard-agent"),
    ]:
        docs = render(helm, tmp_path, release=release, namespace=namespace)
        fullname = "gpuguard" if release == RELEASE else f"{release}-gpuguard"
        policy = one(docs, "ValidatingAdmissionPolicy", f"{fullname}-agent-node-fence")
        # The Event fences: the enforcer's account and the agent's, each by its username.
        for who, account in (("enforcer", fullname), ("agent", f"{fullname}-agent")):
            name = f"{fullname}-{who}-event-fence"
            events = one(docs, "ValidatingAdmissionPolicy", name)
            assert events["spec"]["failurePolicy"] == "Fail"
            (matched,) = events["spec"]["matchConditions"]
            expected = f"system:serviceaccount:{namespace}:{account}"
            assert matched["expression"] == f"request.userInfo.username == '{expected}'"
            shipped_events = one(
                shipped, "ValidatingAdmissionPolicy", f"gpuguard-{who}-event-fence"
            )
            assert fence_spec(events) == fence_spec(shipped_events)
            assert one(docs, "ValidatingAdmissionPolicyBinding", name)["spec"] == {
                "policyName": name,
                "validationActions": ["Deny"],
            }
        assert fence_spec(policy) == fence_spec(shipped_policy)
        (condition,) = policy["spec"]["matchConditions"]
        assert condition["expression"] == f"request.userInfo.username == '{user}'"
        # The agent's pods run as the fenced account; the enforcer's do not (and may not patch).
        (agent_ds,) = [
            d
            for d in find(docs, "DaemonSet")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
        ]
        sa_name = agent_ds["spec"]["template"]["spec"]["serviceAccountName"]
        (sa,) = [d["metadata"] for d in find(docs, "ServiceAccount", sa_name)]
        assert f"system:serviceaccount:{sa['namespace']}:{sa['name']}" == user
        (enforcer_ds,) = [d for d in find(docs, "DaemonSet") if d is not agent_ds]
        enforcer_sa = enforcer_ds["spec"]["template"]["spec"]["serviceAccountName"]
        assert enforcer_sa != sa_name
        binding = one(docs, "ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
        assert binding["spec"] == {
            "policyName": policy["metadata"]["name"],
            "validationActions": ["Deny"],
        }
    (condition,) = shipped_policy["spec"]["matchConditions"]
    shipped_user = "system:serviceaccount:gpuguard:gpuguard-agent"
    assert condition["expression"] == f"request.userInfo.username == '{shipped_user}'"


def test_condition_fence_is_the_manifests_cel_bound_to_the_enforcers_service_account(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The enforcer's one write (patch of nodes/status) is fenced for its account, whatever the
    release and namespace: the same CEL as manifests/ (proved on a real kube-apiserver by
    tests/kube/test_condition_fence.py), failing closed."""
    shipped = manifest_docs("agent-admission-policy.yaml")
    name = "gpuguard-enforcer-node-condition-fence"
    shipped_policy = one(shipped, "ValidatingAdmissionPolicy", name)
    for release, namespace in [(RELEASE, NAMESPACE), ("prod", "gpu-system")]:
        docs = render(helm, tmp_path, release=release, namespace=namespace)
        fullname = "gpuguard" if release == RELEASE else f"{release}-gpuguard"
        policy = one(docs, "ValidatingAdmissionPolicy", f"{fullname}-enforcer-node-condition-fence")
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert fence_spec(policy) == fence_spec(shipped_policy)
        rules = policy["spec"]["matchConstraints"]["resourceRules"]
        assert rules == [
            {
                "apiGroups": [""],
                "apiVersions": ["*"],
                "operations": ["UPDATE"],
                "resources": ["nodes", "nodes/status"],
            }
        ]
        enforcer_sa = pod_spec(docs, fullname)["serviceAccountName"]
        (matched,) = policy["spec"]["matchConditions"]
        user = f"system:serviceaccount:{namespace}:{enforcer_sa}"
        assert matched["expression"] == f"request.userInfo.username == '{user}'"
        binding = one(docs, "ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
        assert binding["spec"] == {
            "policyName": policy["metadata"]["name"],
            "validationActions": ["Deny"],
        }
        (role,) = [
            r
            for (kind, role_name, _), r in rules_by_role(docs).items()
            if (kind, role_name) == ("ClusterRole", f"{fullname}-enforcer")
        ]
        assert [r for r in role if any("nodes" in x for x in r["resources"])] == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            NODE_CONDITION_WRITE,
        ]


def test_agent_disabled_removes_its_container_rbac_and_fence(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(
        helm,
        tmp_path,
        {"agent": {"enabled": False, "allowEviction": True}, "sharing": SHARING},
        api_versions=[SERVICE_MONITOR_API],
    )
    assert set(containers(docs)) == {"enforcer"}
    assert [d["metadata"]["name"] for d in find(docs, "DaemonSet")] == [ENFORCER_DS]
    assert [d["metadata"]["name"] for d in find(docs, "ServiceAccount")] == ["gpuguard"]
    assert set(rules_by_role(docs)) == {("ClusterRole", "gpuguard-enforcer", None)}
    assert set(bindings(docs)) == {("ClusterRoleBinding", "gpuguard-enforcer", None)}
    # The enforcer's fences stay; the agent's go.
    policies = ["gpuguard-enforcer-node-condition-fence", "gpuguard-enforcer-event-fence"]
    assert [d["metadata"]["name"] for d in find(docs, "ValidatingAdmissionPolicy")] == policies
    assert [
        d["metadata"]["name"] for d in find(docs, "ValidatingAdmissionPolicyBinding")
    ] == policies
    assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["enforcer-metrics"]
    endpoints = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["enforcer-metrics"]
    assert load_rendered_settings(docs, tmp_path).agent.allow_eviction is False


# ---------------------------------------------------------------------------------------------
# The sharing ConfigMap


def test_empty_sharing_renders_no_sharing_configmap(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    assert not find(render(helm, tmp_path), "ConfigMap", "gpuguard-sharing")
    assert not find(render(helm, tmp_path, {"sharing": {}}), "ConfigMap", "gpuguard-sharing")


def test_sharing_renders_a_configmap_gpuguard_parses(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, {"sharing": SHARING})
    configmap = one(docs, "ConfigMap", "gpuguard-sharing")
    assert configmap["metadata"]["namespace"] == NAMESPACE
    document = yaml.safe_load(configmap["data"]["sharing.yaml"])
    assert document == SHARING
    validation = parse_sharing(document)
    assert validation.valid, validation.errors
    # The agent reads it where the chart put it, and RBAC lets it read exactly that one.
    settings = load_rendered_settings(docs, tmp_path)
    assert (settings.agent.sharing_namespace, settings.agent.sharing_name) == (
        NAMESPACE,
        "gpuguard-sharing",
    )
    reader = one(docs, "Role", "gpuguard-sharing-reader")
    assert reader["rules"][0]["resourceNames"] == ["gpuguard-sharing"]


# ---------------------------------------------------------------------------------------------
# Prometheus Operator objects and the dashboard


@pytest.mark.parametrize("served", [False, True], ids=["crd-absent", "crd-served"])
@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "enabled"])
def test_service_monitor_needs_its_crd_and_enabled(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, served: bool, enabled: bool
) -> None:
    docs = render(
        helm,
        tmp_path,
        {"serviceMonitor": {"enabled": enabled}},
        api_versions=[SERVICE_MONITOR_API] if served else [],
    )
    assert len(find(docs, "ServiceMonitor")) == (1 if served and enabled else 0)


def test_service_monitor_honors_labels_by_default_and_carries_user_labels(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    docs = render(helm, tmp_path, api_versions=[SERVICE_MONITOR_API])
    monitor = one(docs, "ServiceMonitor")
    assert [(e["port"], e["honorLabels"]) for e in monitor["spec"]["endpoints"]] == [
        ("enforcer-metrics", True),
        ("agent-metrics", True),
    ]
    service = one(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )

    docs = render(
        helm,
        tmp_path,
        {
            "serviceMonitor": {
                "honorLabels": False,
                "labels": {"release": "kube-prometheus-stack"},
                "interval": "30s",
            }
        },
        api_versions=[SERVICE_MONITOR_API],
    )
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["honorLabels"] is False
        assert endpoint["interval"] == "30s"


@pytest.mark.parametrize("served", [False, True], ids=["crd-absent", "crd-served"])
@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "enabled"])
def test_prometheus_rule_needs_its_crd_and_enabled(
    helm: tuple[Path, dict[str, str]],
    tmp_path: Path,
    served: bool,
    enabled: bool,
) -> None:
    chart = chart_copy(tmp_path, alerts=True, dashboard=False)
    docs = render(
        helm,
        tmp_path,
        {"prometheusRule": {"enabled": enabled}},
        api_versions=[PROMETHEUS_RULE_API] if served else [],
        chart=chart,
    )
    assert len(find(docs, "PrometheusRule")) == (1 if served and enabled else 0)


def test_prometheus_rule_embeds_the_alert_files_groups_with_user_labels(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    chart = chart_copy(tmp_path, alerts=True, dashboard=False)
    docs = render(
        helm,
        tmp_path,
        {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}},
        api_versions=[PROMETHEUS_RULE_API],
        chart=chart,
    )
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    alerts = yaml.safe_load((chart / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == {"groups": alerts["groups"]}


def test_dashboard_configmap_carries_the_sidecar_label_configurably(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    chart = chart_copy(tmp_path, alerts=False, dashboard=True)
    docs = render(helm, tmp_path, chart=chart)
    dashboard = one(docs, "ConfigMap", "gpuguard-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    assert json.loads(text) == json.loads((chart / "files" / "dashboard.json").read_text())

    docs = render(
        helm,
        tmp_path,
        {
            "dashboards": {
                "label": "grafana.example/dashboard",
                "labelValue": "gpu",
                "labels": {"team": "ml"},
                "annotations": {"grafana_folder": "GPU"},
            }
        },
        chart=chart,
    )
    dashboard = one(docs, "ConfigMap", "gpuguard-dashboard")
    labels = dashboard["metadata"]["labels"]
    assert labels["grafana.example/dashboard"] == "gpu"
    assert labels["team"] == "ml"
    assert "grafana_dashboard" not in labels
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "GPU"}

    docs = render(helm, tmp_path, {"dashboards": {"enabled": False}}, chart=chart)
    assert not find(docs, "ConfigMap", "gpuguard-dashboard")


def test_chart_renders_without_the_alert_and_dashboard_files(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    chart = chart_copy(tmp_path, alerts=False, dashboard=False)
    docs = render(helm, tmp_path, api_versions=[PROMETHEUS_RULE_API], chart=chart)
    assert not find(docs, "PrometheusRule")
    assert not find(docs, "ConfigMap", "gpuguard-dashboard")
    assert find(docs, "DaemonSet")


def chart_copy(tmp: Path, *, alerts: bool, dashboard: bool) -> Path:
    """A copy of the shipped chart, with or without files/alerts.yaml and files/dashboard.json.

    Both files ship with the chart (their generators' output, committed): one missing from the
    chart fails here, never replaced by a stand-in, since the chart would render without it.
    """
    chart = tmp / "chart" / "gpuguard"
    if chart.exists():
        shutil.rmtree(chart)
    shutil.copytree(CHART, chart)
    for name, keep in (("alerts.yaml", alerts), ("dashboard.json", dashboard)):
        copied = chart / "files" / name
        assert copied.is_file(), f"{CHART / 'files' / name} is missing: the chart ships it"
        if not keep:
            copied.unlink()
    return chart


_PLURALS = {
    "ConfigMap": "configmaps",
    "DaemonSet": "daemonsets",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
}


@pytest.mark.apiserver
def test_rendered_objects_pass_server_side_validation(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, kube_cluster: KubeCluster
) -> None:
    """Every object the chart renders (but the Prometheus Operator's) is accepted by a real
    kube-apiserver: schema with strict field validation, defaulting, the fence's CEL compiled."""
    import uuid

    fresh = uuid.uuid4().hex[:8]  # the session cluster may hold a real install's objects
    docs = render(
        helm,
        tmp_path,
        {"sharing": SHARING, "agent": {"enabled": True, "allowEviction": True}},
        chart=chart_copy(tmp_path, alerts=False, dashboard=True),
        release=f"gg-{fresh}",
        namespace=f"t-{fresh}",
    )
    assert set(_PLURALS) == {d["kind"] for d in docs}
    for namespace in {d["metadata"].get("namespace") for d in docs} - {None}:
        ensure_namespace(kube_cluster, str(namespace))
    for doc in docs:
        group_version = doc["apiVersion"]
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        namespace = doc["metadata"].get("namespace")
        scope = f"/namespaces/{namespace}" if namespace else ""
        path = f"{base}{scope}/{_PLURALS[doc['kind']]}?dryRun=All&fieldValidation=Strict"
        created = kube_cluster.admin_request("POST", path, doc)
        assert created["metadata"]["name"] == doc["metadata"]["name"]


def test_notes_say_audit_first_and_where_refusals_show(
    helm: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    done = run_helm(helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "would_stop_container" in notes
    assert 'gpuguard_refusals_total{reason="audit_mode"}' in notes
    assert "enforcement.mode=enforce" in notes
    assert "gpuguard check-sharing" in notes
    assert "kubectl describe node" in notes


@pytest.mark.apiserver
def test_the_value_sharing_over_a_kubectl_made_configmap_fails_naming_both_ways(
    helm: tuple[Path, dict[str, str]], tmp_path: Path, kube_cluster: KubeCluster
) -> None:
    """README's ``kubectl create configmap gpuguard-sharing`` and the value ``sharing`` cannot
    both own the ConfigMap: Helm's own refusal ("invalid ownership metadata") named neither way.
    A real API server answers the chart's lookup (``helm install --dry-run=server``)."""
    import uuid

    namespace = f"t-{uuid.uuid4().hex[:8]}"
    ensure_namespace(kube_cluster, namespace)
    kube_cluster.admin_request(
        "POST",
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpuguard-sharing"},
         "data": {"sharing.yaml": "version: v1\nrules: []\n"}},
    )  # fmt: skip
    kubeconfig = str(kube_cluster.admin_kubeconfig)
    # A release name of its own: the API server is shared with other tests' releases, whose
    # cluster-scoped objects (ClusterRole gpuguard-enforcer...) a server-side dry run of a
    # second "gpuguard" release would collide with.
    release = f"gpuguard-{namespace}"
    args = ["install", release, str(CHART), "-n", namespace, "--dry-run=server",
            "--kubeconfig", kubeconfig, "--set", "runtimeClassName="]  # fmt: skip
    done = run_helm(
        helm, *args, *values_args({"sharing": {"version": "v1", "rules": []}}, tmp_path)
    )
    assert done.returncode != 0, done.stdout
    assert (
        f"ConfigMap {namespace}/gpuguard-sharing already exists and is not this release's"
    ) in done.stderr
    assert "keep that ConfigMap and leave sharing empty" in done.stderr
    assert f"kubectl -n {namespace} delete configmap gpuguard-sharing" in done.stderr
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stderr
    assert "values.sharing is empty and that ConfigMap exists outside this release" in done.stdout
