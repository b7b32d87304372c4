"""Per-container declarations where people read them: ``check-pod`` over every workload kind
carrying KAI's per-container keys, ``inspect``'s ``container_limits`` and the binding
declaration, the ``GPUProcessKilled`` Event and log of a container stopped alone, and the
examples table of docs/schedulers.md (Per-container declarations), row by row."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.check_pod import run_check_pod
from gpuguard.commands.inspect import inspect_node, render_inspect
from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import (
    EnforcementPolicy,
    KillTarget,
    LimitPolicy,
    LimitValue,
    PodRef,
    ProcessIdentity,
    SignalReport,
    StopSignal,
    Trigger,
)
from gpuguard.core.policy import SignalAction
from gpuguard.core.units import format_bytes
from gpuguard.kubemodel.translate import pod_from_json
from gpuguard.runtime.enforcer import _killed_event
from tests.fakes import (
    FakeClock,
    FakeGpuSource,
    FakePodDirectory,
    FakeResolver,
    GiB,
    attr,
    cgroup_of,
    cid,
    gpu,
    pod,
    proc,
    uid,
)

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "Deployment": "spec:\n  replicas: 2\n  template:\n{template}",
    "StatefulSet": "spec:\n  serviceName: web\n  template:\n{template}",
    "DaemonSet": "spec:\n  template:\n{template}",
    "ReplicaSet": "spec:\n  template:\n{template}",
    "ReplicationController": "spec:\n  template:\n{template}",
    "Job": "spec:\n  template:\n{template}",
    "CronJob": "spec:\n  jobTemplate:\n    spec:\n      template:\n{template}",
    "PodTemplate": "template:\n{template}",
}
"""Every workload kind ``check-pod`` reads a pod template from, and where the template sits."""


def run(manifest: Path, config: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """``check-pod --json`` on one file for an 80 GiB GPU: exit code and entries by name."""
    out = io.StringIO()
    code = run_check_pod(
        files=[str(manifest)], config_path=config, gpu_memory="80Gi", as_json=True,
        stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    return code, {p["name"]: p for p in json.loads(out.getvalue())["pods"]}


KAI_CONFIG = 'version = 1\n[limits]\nsources = ["gpuguard", "kai"]\n'
TEMPLATE = """\
metadata:
  annotations:
    nvidia.com/container.train.gpu-memory.request: 2Gi
    nvidia.com/container.train.gpu-memory.limit: 6Gi
    nvidia.com/container.ghost.gpu-memory.limit: 70Gi
spec:
  containers:
    - name: train
      image: pytorch/pytorch
    - name: sidecar
      image: busybox
"""


def workload(kind: str) -> str:
    body = WORKLOADS[kind]
    key_line = body.split("{template}")[0].splitlines()[-1]
    indent = " " * (len(key_line) - len(key_line.lstrip()) + 2)
    template = "".join(indent + line + "\n" for line in TEMPLATE.splitlines())
    return f"apiVersion: v1\nkind: {kind}\nmetadata:\n  name: web\n  namespace: team-a\n" + (
        body.format(template=template)
    )


@pytest.mark.parametrize("kind", [*sorted(WORKLOADS), "Pod"])
def test_check_pod_shows_each_containers_own_limit_in_every_workload_kind(
    tmp_path: Path, kind: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(KAI_CONFIG)
    manifest = tmp_path / "workload.yaml"
    if kind == "Pod":
        text = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  namespace: team-a\n"
        text += TEMPLATE.replace("metadata:\n", "", 1)
        manifest.write_text(text)
    else:
        manifest.write_text(workload(kind))
    code, entries = run(manifest, config)
    entry = entries["web"]
    assert code == 1  # the key for a container the pod lacks is an error
    assert (entry["limit_bytes"], entry["source"]) == (6 * GiB, "kai")
    assert entry["container_limits"] == [
        {
            "container": "train",
            "limit_bytes": 6 * GiB,
            "what": "kai declaration of container train "
            "(annotation nvidia.com/container.train.gpu-memory.limit)",
            "value": "6Gi",
        }
    ]
    (declared,) = entry["declarations"]
    assert (declared["container"], declared["bound"]) == ("train", True)
    assert any("no container ghost" in e for e in entry["errors"])


def test_check_pods_table_names_the_containers_own_limit(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(KAI_CONFIG)
    manifest = tmp_path / "workload.yaml"
    manifest.write_text(workload("Deployment"))
    out = io.StringIO()
    run_check_pod(
        files=[str(manifest)], config_path=config, gpu_memory="80Gi", as_json=False,
        stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    assert "own limit of container train: 6Gi" in out.getvalue()


def test_inspect_names_each_containers_own_limit_and_the_declaration_that_binds() -> None:
    clock = FakeClock()
    g0 = gpu(0, total=80 * GiB)
    kai = pod_from_json(
        {
            "metadata": {
                "uid": uid(1), "name": "pod-1", "namespace": "team",
                "annotations": {"nvidia.com/container.c0.gpu-memory.limit": "4Gi",
                                "gpuguard.io/gpu-memory-limit": "10Gi"},
            },
            "spec": {"containers": [{"name": "c0"}, {"name": "c1"}]},
            "status": {"containerStatuses": [
                {"name": "c0", "containerID": f"containerd://{cid(10)}"},
                {"name": "c1", "containerID": f"containerd://{cid(11)}"},
            ]},
        }
    )  # fmt: skip
    assert kai is not None
    source = FakeGpuSource(
        clock=clock, devices=[g0], processes=[proc(100, g0, 5 * GiB), proc(101, g0, 1 * GiB)]
    )
    resolver = FakeResolver(
        {100: attr(100, pod_n=1, container=0), 101: attr(101, pod_n=1, container=1)}
    )
    policy = EnforcementPolicy(limits=LimitPolicy(sources=("gpuguard", "kai")))
    report = inspect_node(source, resolver, FakePodDirectory(clock=clock, pods=[kai]), policy)
    rows = {p["pid"]: p for p in report["processes"]}
    assert rows[100]["container_limits"] == [
        {
            "container": "c0",
            "limit_bytes": 4 * GiB,
            "what": "kai declaration of container c0 "
            "(annotation nvidia.com/container.c0.gpu-memory.limit)",
            "value": "4Gi",
        }
    ]
    assert rows[100]["verdict"] == "over limit"
    bound = [d for d in rows[100]["limit_declarations"] if d["bound"]]
    assert [(d["source"], d["container"]) for d in bound] == [("kai", "c0")]
    text = io.StringIO()
    render_inspect(report, text, width=200)
    assert (
        "team/pod-1 container c0 on GPU 0: own limit 4Gi (kai declaration of container c0 "
        "(annotation nvidia.com/container.c0.gpu-memory.limit))" in text.getvalue()
    )


def test_the_killed_event_and_log_say_the_container_was_stopped_for_its_own_limit() -> None:
    from gpuguard.core.model import ContainerLimit

    p = pod(1, containers=2)
    own = ContainerLimit(
        container="c0", limit_bytes=4 * GiB, what="kai declaration of container c0", value="4Gi"
    )
    target = KillTarget(
        pod=PodRef(uid=p.uid, namespace=p.namespace, name=p.name),
        container_id=cid(10),
        container_name="c0",
        cgroup=cgroup_of(p.uid, cid(10)),
        device=gpu(0).key,
        gpu_index=0,
        used_bytes=5 * GiB,
        limit_bytes=4 * GiB,
        own_limit=own,
    )
    action = SignalAction(target=target, signal=StopSignal.TERM, trigger=Trigger.GRACE)
    report = SignalReport(
        signal=StopSignal.TERM, delivered=(ProcessIdentity(pid=100, start_ticks=1),)
    )
    message = _killed_event(action, report).message
    assert "container c0" in message
    assert "over its own limit 4294967296 bytes (kai declaration of container c0)" in message
    assert "other containers were left running" in message


# --- docs/schedulers.md's examples, row by row ---------------------------------------------


def _example_rows() -> list[tuple[dict[str, str], str, str, str]]:
    text = (ROOT / "docs" / "schedulers.md").read_text(encoding="utf-8")
    section = text.split("## Per-container declarations", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        annotations = {}
        for item in re.findall(r"`([^`]+)`", cells[0]):
            key, value = item.split(": ", 1)
            annotations[key] = value.strip('"')
        rows.append((annotations, cells[1], cells[2], cells[3]))
    return rows


EXAMPLES = _example_rows()


def test_the_docs_examples_table_is_read() -> None:
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize(("annotations", "pod_limit", "own_limit", "why"), EXAMPLES)
def test_each_example_in_the_docs_resolves_as_written(
    annotations: dict[str, Any], pod_limit: str, own_limit: str, why: str
) -> None:
    made = pod_from_json(
        {
            "metadata": {"uid": "u", "name": "p", "namespace": "team", "annotations": annotations},
            "spec": {"containers": [{"name": "main"}, {"name": "side"}]},
        }
    )
    assert made is not None
    r = resolve_limit(
        pod=made,
        device_total_bytes=80 * GiB,
        policy=LimitPolicy(sources=("gpuguard", "kai")),
        replicas=None,
        device=gpu(0, total=80 * GiB),
    )
    shown = "none" if r.limit_bytes is None else format_bytes(r.limit_bytes)
    assert shown == pod_limit, why
    main = {c.container: format_bytes(c.limit_bytes) for c in r.containers}.get("main", "none")
    assert main == own_limit, why
    if "(an error)" in why:
        assert r.errors, why
    if "(warned)" in why:
        assert r.warnings, why
    # With a cluster default, a rejected value is never "unlimited".
    defaulted = resolve_limit(
        pod=made, device_total_bytes=80 * GiB, replicas=None,
        policy=LimitPolicy(sources=("gpuguard", "kai"),
                           cluster_default=LimitValue(limit_bytes=8 * GiB)),
    )  # fmt: skip
    assert defaulted.limit_bytes is not None


def test_of_several_declarations_of_one_scheduler_only_the_smallest_is_marked_bound() -> None:
    from gpuguard.commands.explain import declarations_json

    made = pod_from_json(
        {
            "metadata": {"uid": "u", "name": "p", "namespace": "team", "annotations": {
                "gpu-memory": "6000",
                "nvidia.com/container.main.gpu-memory.limit": "8Gi",
                "nvidia.com/container.side.gpu-memory.limit": "5Gi",
            }},
            "spec": {"containers": [{"name": "main"}, {"name": "side"}]},
        }
    )  # fmt: skip
    assert made is not None
    r = resolve_limit(
        pod=made, device_total_bytes=80 * GiB, policy=LimitPolicy(sources=("gpuguard", "kai")),
        replicas=None,
    )  # fmt: skip
    assert r.limit_bytes == 5 * GiB
    marked = [(d["container"], d["limit_bytes"]) for d in declarations_json(r) if d["bound"]]
    assert marked == [("side", 5 * GiB)]
