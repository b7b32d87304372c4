"""``gpuguard explain PID`` online: the pod directory from the real API server (as gpuguard's
ServiceAccount), limits from the pod's annotation or the admin config, usage from the NVML
stand-in, and what the kubelet allocated the pod from a real pod-resources gRPC server; the
``/proc`` facts stay as offline.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rigs.kubefixtures import SA_NAMESPACE, ensure_service_account
from rigs.node import GIB, GPU_UUIDS, Rig
from rigs.podresources import answer, container, kubelet, pod, socket_path

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def explain(rig: Rig, *argv: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    return rig.run_cli("explain", *argv, config=config)


def test_explain_shows_the_pod_its_limit_and_source_and_the_gpu_usage(rig: Rig) -> None:
    pod = rig.add_pod("trainer", limit="6Gi")
    worker = rig.spawn(pod, "trainer", used_bytes=2 * GIB)
    done = explain(rig, str(worker.pid), "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert d["is_pod"] is True
    assert d["pod_uid"] == pod.uid
    assert d["container_id"] == pod.container_id
    assert d["holds_gpu"] is True
    assert d["pod_found"] is True
    assert d["pod_namespace"] == rig.namespace
    assert d["pod_name"] == "trainer"
    assert d["container_name"] == "main"
    assert d["limit_bytes"] == 6 * GIB
    assert d["limit_source"] == "annotation"
    assert d["gpu_used_bytes"] == 2 * GIB
    assert d["exempt"] is False
    assert d["verdict"].startswith("within its limit")

    rig.set_usage(worker, 7 * GIB)
    human = explain(rig, str(worker.pid))
    assert human.returncode == 0, human.stderr
    assert f"pod:             {rig.namespace}/trainer" in human.stdout
    assert f"limit:           {6 * GIB} bytes (annotation)" in human.stdout
    assert f"GPU memory used: {7 * GIB} bytes" in human.stdout
    assert "over its limit" in human.stdout
    assert worker.received() == []


def test_explain_without_nvml_still_shows_the_pod_and_a_null_usage(rig: Rig) -> None:
    pod = rig.add_pod("trainer")
    worker = rig.spawn(pod, "trainer", used_bytes=2 * GIB)
    cfg = rig.config(kubeconfig=rig.kubeconfig(), metrics_port=1)
    missing = rig.dir / "no-such-dir" / "libnvidia-ml.so.1"  # also on a machine with a GPU
    text = cfg.read_text().replace(
        f'library_path = "{rig.stub_lib}"', f'library_path = "{missing}"'
    )
    text = text.replace("[limits]\n", '[limits]\ndefault = "10%"\n')
    cfg.write_text(text)
    done = explain(rig, str(worker.pid), "--json", config=cfg)
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert d["pod_found"] is True
    assert d["pod_name"] == "trainer"
    assert d["limit_source"] == "default"
    assert d["limit_bytes"] is None, "10% of an unknown device size is unknown"
    assert d["gpu_used_bytes"] is None


def test_explain_for_a_pod_the_api_server_does_not_know_says_so(rig: Rig) -> None:
    pod = rig.add_pod("gone")
    worker = rig.spawn(pod, "gone", used_bytes=GIB)
    rig.cluster.delete_pod(rig.namespace, "gone")
    done = explain(rig, str(worker.pid), "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert d["is_pod"] is True
    assert d["pod_found"] is False
    assert d["pod_name"] is None


def test_explain_names_the_missing_permission_and_still_prints_the_proc_facts(
    rig: Rig,
) -> None:
    worker = rig.spawn(rig.add_pod("trainer"), "trainer", used_bytes=GIB)
    sa = "gpuguard-unbound"
    ensure_service_account(rig.cluster, SA_NAMESPACE, sa)
    done = rig.run_cli(
        "explain",
        str(worker.pid),
        "--json",
        kubeconfig=rig.cluster.kubeconfig_for_sa(SA_NAMESPACE, sa),
    )
    assert done.returncode == 1
    d = json.loads(done.stdout)
    assert d["is_pod"] is True
    assert d["pod_uid"] is not None
    assert d["pod_found"] is None
    assert "'list'" in d["pod_lookup_error"]
    assert "'pods'" in d["pod_lookup_error"]


def test_explain_charges_a_static_pods_processes_to_it(rig: Rig) -> None:
    """A static pod's cgroups carry its hash, not its mirror pod's UID: explain compared the two
    and said the pod "uses at most 0 bytes" while it was over its limit."""
    config_hash = "00112233445566778899aabbccddeeff"
    static = rig.add_pod(
        f"static-{rig.node}",
        limit="1Gi",
        annotations={
            "kubernetes.io/config.hash": config_hash,
            "kubernetes.io/config.mirror": config_hash,
        },
        cgroup_uid=config_hash,
    )
    worker = rig.spawn(static, "static", used_bytes=2 * GIB)
    done = explain(rig, str(worker.pid), "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert (d["pod_uid"], d["pod_name"]) == (config_hash, f"static-{rig.node}")
    assert d["gpu_used_bytes"] == 2 * GIB
    assert d["verdict"].startswith(f"over its limit: the pod uses {2 * GIB} bytes"), d["verdict"]


def test_explain_shows_gpu_use_the_kubelets_answer_does_not_allocate(rig: Rig) -> None:
    """The pod was allocated GPU 1 (a time-sliced replica of it); its process uses GPU 0: read
    once from the kubelet's socket, explain says GPU 0 is not allocated and what was."""
    trainer = rig.add_pod("trainer")
    worker = rig.spawn(trainer, "trainer", used_bytes=2 * GIB)
    other = f"{GPU_UUIDS[1]}::1"
    with socket_path() as sock, kubelet(sock) as server:
        server.answer = answer(
            pod(rig.namespace, "trainer", [container("main", [("nvidia.com/gpu", [other])])])
        )
        done = rig.run_cli("explain", str(worker.pid), "--json", pod_resources_socket=sock)
        human = rig.run_cli("explain", str(worker.pid), pod_resources_socket=sock)
    assert done.returncode == 0, done.stderr
    allocated = f"nvidia.com/gpu {other} (container main)"
    assert json.loads(done.stdout)["allocation"] == [
        {"gpu": 0, "gpu_instance_id": None, "allocation": "not_allocated", "allocated": allocated}
    ]
    assert human.returncode == 0, human.stderr
    assert (
        f"allocation:      GPU 0: NOT allocated: GPU use without an allocation ({allocated})"
        in human.stdout
    )
    assert worker.received() == []
