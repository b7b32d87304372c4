"""``gpuguard agent`` checks its admission fence before it writes anything (docs/install.md,
the admission fences): the real agent process, with the token the kubelet would project for its
pod and the shipped RBAC, on a real kube-apiserver where the fence is not there yet (Helm
creates the DaemonSets before the ValidatingAdmissionPolicy, and a policy takes a moment to
become active). Until a dry-run patch the fence refuses is refused, the agent writes nothing,
says why in its log and on ``/readyz``, and tries again with backoff; once the shipped policy
is applied it labels its Node.

This module starts its own cluster: the session cluster's tests must not see the policy come
and go.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.adapters.kube.client import load_api_client
from gpuguard.adapters.kube.fence import FENCE_PROBE_LABEL, KubeFenceProbe
from gpuguard.errors import FenceMissing
from rigs.controlplane import (
    AdminRequestError,
    KubeCluster,
    put_config_map,
    start_cluster,
    wait_until,
)
from rigs.kubefixtures import FENCE_MANIFEST, RBAC_MANIFEST, apply_manifest, pod_bound_token
from tests.helpers.environment import environ_without_gpuguard_settings
from tests.kube.agent_cluster import (
    DEVICE_PLUGIN_PROFILES,
    DP,
    DP_NAME,
    MIG_NAME,
    MIG_PARTED,
    NV_NS,
    SHARING_NS,
    labels,
    put_sharing,
)

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
NODE = "gpu-fence-check"
PROCESS_NODE = "gpu-process"
AGENT_SA = "gpuguard-agent"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    c = start_cluster(tmp_path_factory.mktemp("fence-check"))
    try:
        for ns in (SHARING_NS, NV_NS):
            c.admin_request(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
        apply_manifest(c, RBAC_MANIFEST)
        put_config_map(c, NV_NS, DP_NAME, DEVICE_PLUGIN_PROFILES)
        put_config_map(c, NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})
        c.create_node(NODE, {"kubernetes.io/hostname": NODE})
        put_sharing(
            c,
            {
                "version": "v1",
                "devicePluginConfig": {"namespace": NV_NS, "name": DP_NAME},
                "migConfig": {"namespace": NV_NS, "name": MIG_NAME, "key": "config.yaml"},
                "rules": [
                    {"name": "all", "nodeNames": [NODE, PROCESS_NODE], "timeSlicing": "slice-4"}
                ],
            },
        )
        yield c
    finally:
        c.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@contextmanager
def running_agent(cluster: KubeCluster, node: str, log: Path) -> Iterator[int]:
    """``gpuguard agent`` for ``node`` with its pod's token (JSON log to ``log``); yields its
    metrics port. Stopped with SIGTERM, which it must answer with exit code 0."""
    token = pod_bound_token(cluster, SHARING_NS, AGENT_SA, node)
    kubeconfig = cluster.kubeconfig_for_token(token, name=f"agent-{node}")
    port = _free_port()
    env = {
        **environ_without_gpuguard_settings(),
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "error",
        "GPUGUARD_AGENT_INTERVAL_SECONDS": "0.2",
    }
    env.pop("NODE_NAME", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard.cli", "agent", "--node-name", node,
             "--kubeconfig", str(kubeconfig), "--metrics-address", f"127.0.0.1:{port}",
             "--log-format", "json"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0, log.read_text()[-4000:]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _fence_in_force(cluster: KubeCluster, node: str, in_force: bool) -> bool:
    """What the agent's own start-up check says now, with a token of its pod on ``node``."""
    token = pod_bound_token(cluster, SHARING_NS, AGENT_SA, node)
    api = load_api_client(str(cluster.kubeconfig_for_token(token, name=f"probe-{node}")))
    try:
        KubeFenceProbe(api, node_name=node).check_fence()
    except FenceMissing:
        return not in_force
    finally:
        api.close()  # type: ignore[no-untyped-call]
    return in_force


def test_the_agent_writes_nothing_until_its_fence_is_in_force(
    cluster: KubeCluster, tmp_path: Path
) -> None:
    _remove_fence(cluster)
    wait_until(
        lambda: _fence_in_force(cluster, NODE, in_force=False),
        timeout=30,
        what="no fence in force",
    )
    log = tmp_path / "agent.log"
    with running_agent(cluster, NODE, log) as port:
        wait_until(
            lambda: any(e.get("event") == "agent_fence_missing" for e in _events(log)),
            timeout=30,
            what="the agent to report its missing fence",
        )
        # It has read everything it needs (the sharing rule wants slice-4) and still writes
        # nothing: a few turns' worth of time, and its backoff's second check.
        wait_until(
            lambda: sum(e.get("event") == "agent_fence_missing" for e in _events(log)) >= 2,
            timeout=30,
            what="the agent to check its fence again",
        )
        assert DP not in labels(cluster, NODE)
        assert FENCE_PROBE_LABEL not in labels(cluster, NODE)  # a dry run stores nothing
        code, text = _get(port, "/readyz")
        assert code == 503, (code, text)
        assert "the admission fence" in text, text
        assert "is not in force" in text, text
        missing = next(e for e in _events(log) if e.get("event") == "agent_fence_missing")
        assert missing["level"] == "error"
        assert FENCE_PROBE_LABEL in missing["detail"]

        apply_manifest(cluster, FENCE_MANIFEST)
        wait_until(
            lambda: labels(cluster, NODE).get(DP) == "slice-4",
            timeout=60,
            what="the agent to label its Node once the fence is in force",
        )
        assert any(e.get("event") == "agent_fence_in_force" for e in _events(log))
        wait_until(lambda: _get(port, "/readyz")[0] == 200, timeout=30, what="/readyz 200")
        assert FENCE_PROBE_LABEL not in labels(cluster, NODE)


def test_gpuguard_agent_process_labels_its_node_serves_metrics_and_stops_on_sigterm(
    cluster: KubeCluster, tmp_path: Path
) -> None:
    node = PROCESS_NODE
    cluster.create_node(node, {"kubernetes.io/hostname": node})
    apply_manifest(cluster, FENCE_MANIFEST)
    log = tmp_path / "agent.log"
    with running_agent(cluster, node, log) as port:
        wait_until(
            lambda: labels(cluster, node).get(DP) == "slice-4", timeout=60, what="the labels"
        )
        wait_until(lambda: _get(port, "/readyz")[0] == 200, timeout=30, what="ready")
        status, text = _get(port, "/metrics")
        assert status == 200
        assert (
            f'gpuguard_sharing_labels_info{{device_plugin_config="slice-4",mig_config="",'
            f'node="{node}",rule="all"}} 1.0' in text
        )
        assert 'gpuguard_sharing_reconcile_errors_total{reason="config_invalid"} 0.0' in text
        assert 'gpuguard_events_dropped_total{reason="rate_limit"} 0.0' in text
        assert "gpuguard_violations_total" not in text, "the enforcer's metrics are its own"
        assert _get(port, "/healthz")[0] == 200
    started = [e["event"] for e in _events(log) if e["event"].startswith("agent_st")]
    assert started == ["agent_started", "agent_stopped"]


def _remove_fence(cluster: KubeCluster) -> None:
    for doc in yaml.safe_load_all(FENCE_MANIFEST.read_text()):
        if not doc:
            continue
        plural = {
            "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
            "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
        }[doc["kind"]]
        try:
            cluster.admin_request(
                "DELETE",
                f"/apis/admissionregistration.k8s.io/v1/{plural}/{doc['metadata']['name']}",
            )
        except AdminRequestError as e:
            if e.code != 404:
                raise
