"""The sharing agent against a real kube-apiserver (docs/design.md, Sharing config).

Real parts: the API server and etcd, gpuguard's RBAC (the agent runs with its own
ServiceAccount's token, ``gpuguard-agent``), the real ``KubeSharingSource`` (list + watch of the
Node, pods and three ConfigMaps), ``KubeNodeWriter`` (conditional merge patches, the Eviction
API), ``KubeEventSink`` (Node Events) and the runtime ``Agent``. Only time is driven by the
test (a ``FakeClock``) where the agent's timers matter (the write settle window, mig-manager's
pick-up); mig-manager's state label is written by the test, as mig-manager would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube.agent import KubeNodeWriter
from gpuguard.adapters.kube.client import load_api_client
from gpuguard.core.agent import EvictionOutcome, NodePatch
from gpuguard.core.reconcile import CordonAction
from gpuguard.errors import WriteConflict
from tests.apiserver import KubeCluster
from tests.kube.agent_cluster import (
    DEVICE_PLUGIN_PROFILES,
    DP,
    DP_NAME,
    INSTANCE,
    MIG,
    MIG_NAME,
    MIG_PARTED,
    NV_NS,
    SHARING_NAME,
    SHARING_NS,
    Harness,
    delete_config_map,
    fresh,
    labels,
    node,
    node_events,
    put_config_map,
    put_sharing,
    running_agent,
)
from tests.kubefixtures import AGENT_SA_NAME, SA_NAMESPACE, ensure_namespace

pytestmark = pytest.mark.apiserver

STATE = "nvidia.com/mig.config.state"
CORDONED_BY = "gpuguard.io/cordoned-by"
PRODUCT = "nvidia.com/gpu.product"


def sharing(rules: list[dict[str, Any]], policy: str = "WhenIdle", **extra: Any) -> dict[str, Any]:
    return {
        "version": "v1",
        "devicePluginConfig": {"namespace": NV_NS, "name": DP_NAME},
        "migConfig": {"namespace": NV_NS, "name": MIG_NAME, "key": "config.yaml"},
        "migChangePolicy": policy,
        "rules": rules,
        **extra,
    }


# -- cluster objects ---------------------------------------------------------------------------


def reasons(cluster: KubeCluster, name: str) -> list[str]:
    return [e["reason"] for e in node_events(cluster, name)]


def gpu_pod(cluster: KubeCluster, ns: str, name: str, node_name: str) -> dict[str, Any]:
    return cluster.admin_request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {
                "nodeName": node_name,
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.invalid/cuda:1",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }
                ],
            },
        },
    )


def run_pod(cluster: KubeCluster, ns: str, name: str) -> None:
    """What the kubelet reports for a started pod: Running and Ready (a Pending pod may be
    evicted whatever its PodDisruptionBudget says)."""
    cluster.admin_request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{name}/status",
        {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
        content_type="application/merge-patch+json",
    )


@pytest.fixture
def nvidia_configs(cluster: KubeCluster, gpuguard_rbac: str) -> Iterator[None]:
    """NVIDIA's two ConfigMaps in gpu-operator; the sharing ConfigMap removed after the test."""
    ensure_namespace(cluster, NV_NS)
    put_config_map(cluster, NV_NS, DP_NAME, DEVICE_PLUGIN_PROFILES)
    put_config_map(cluster, NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})
    delete_config_map(cluster, SHARING_NS, SHARING_NAME)
    yield
    delete_config_map(cluster, SHARING_NS, SHARING_NAME)


# -- rule matching -----------------------------------------------------------------------------

RULES = [
    {
        "name": "t4",
        "nodeSelector": {"matchLabels": {INSTANCE: "g4dn.12xlarge"}},
        "timeSlicing": "slice-4",
    },
    {
        "name": "a100",
        "nodeSelector": {
            "matchExpressions": [
                {"key": PRODUCT, "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]},
                {"key": "pool", "operator": "NotIn", "values": ["batch"]},
            ]
        },
        "timeSlicing": "slice-2",
    },
    {
        "name": "labelled",
        "nodeSelector": {"matchExpressions": [{"key": "shared", "operator": "Exists"}]},
        "timeSlicing": "slice-8",
    },
]


def expected_profile(node_labels: Mapping[str, str]) -> str | None:
    """The first rule of ``RULES`` that matches, written out independently of the code."""
    if node_labels.get(INSTANCE) == "g4dn.12xlarge":
        return "slice-4"
    if node_labels.get(PRODUCT) == "NVIDIA-A100-SXM4-80GB" and node_labels.get("pool") != "batch":
        return "slice-2"
    if "shared" in node_labels:
        return "slice-8"
    return None


NODE_KINDS: list[dict[str, str]] = [
    {INSTANCE: "g4dn.12xlarge"},
    {INSTANCE: "g4dn.12xlarge", "shared": "yes"},
    {INSTANCE: "g6.xlarge"},
    {PRODUCT: "NVIDIA-A100-SXM4-80GB"},
    {PRODUCT: "NVIDIA-A100-SXM4-80GB", "pool": "batch"},
    {PRODUCT: "NVIDIA-A100-SXM4-80GB", "pool": "batch", "shared": ""},
    {"shared": "no"},
    {},
    {PRODUCT: "NVIDIA-H100-80GB-HBM3"},
    {INSTANCE: "g4dn.12xlarge", PRODUCT: "NVIDIA-A100-SXM4-80GB", "pool": "batch"},
]


async def test_many_nodes_each_get_the_labels_of_their_first_matching_rule_and_follow_label_changes(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    put_sharing(cluster, sharing(RULES))
    names = []
    for kind in NODE_KINDS:
        name = fresh()
        cluster.create_node(name, kind)
        names.append(name)
    kubeconfig = agent_kubeconfig()
    async with _agents(kubeconfig, names) as harnesses:
        for h in harnesses:
            await h.settle(3)
        for name, kind in zip(names, NODE_KINDS, strict=True):
            got = labels(cluster, name)
            assert got.get(DP) == expected_profile(kind), (kind, got)
            assert MIG not in got
            # Only the label the rule sets was added: nothing else changed.
            assert {k: v for k, v in got.items() if k != DP} == kind
        # A label change moves a node to another rule; a node no rule matches keeps its label.
        cluster.label_node(names[2], {INSTANCE: "g4dn.12xlarge"})  # g6 → t4 pool
        cluster.label_node(names[4], {"pool": None})  # batch A100 → a100 rule
        cluster.label_node(names[0], {INSTANCE: "p5.48xlarge"})  # leaves every rule
        for h in harnesses:
            await h.settle(3)
        assert labels(cluster, names[2])[DP] == "slice-4"
        assert labels(cluster, names[4])[DP] == "slice-2"
        assert labels(cluster, names[0])[DP] == "slice-4", "no rule matches: left alone"
        assert (
            harnesses[2].metric(
                "gpuguard_sharing_labels_info", rule="t4", device_plugin_config="slice-4"
            )
            == 1.0
        )
        assert "SharingLabelsApplied" in reasons(cluster, names[2])


@asynccontextmanager
async def _agents(kubeconfig: Path, names: list[str]) -> AsyncIterator[list[Harness]]:
    harnesses: list[Harness] = []
    managers = [running_agent(kubeconfig, name) for name in names]
    try:
        for manager in managers:
            harnesses.append(await manager.__aenter__())
        yield harnesses
    finally:
        for manager in reversed(managers[: len(harnesses)]):
            await manager.__aexit__(None, None, None)


async def test_a_new_node_of_a_known_pool_is_labelled_at_once(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    put_sharing(cluster, sharing(RULES))
    name = fresh()
    async with running_agent(agent_kubeconfig(), name) as h:
        report = await h.turn()
        assert report.synced
        assert report.rule is None  # the Node does not exist yet
        cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")


async def test_a_node_deleted_and_registered_again_gets_its_labels_again(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        for _ in range(3):  # as often as would count as 3 reverts of one label
            await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")
            await h.settle(2)
            cluster.admin_request("DELETE", f"/api/v1/nodes/{name}")
            await _seen_gone(h)
            await h.settle(1)
            cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="re-registered")
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="label_conflict") == 0


async def _seen_gone(h: Harness, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if h.source.inputs().node is None:
            return
        await asyncio.sleep(0.02)
    pytest.fail("the agent's watch did not show the Node deleted")


# -- invalid configs: rejected whole, the last good one stays ------------------------------------

INVALID: dict[str, Mapping[str, Any] | str] = {
    "unknown_version": {**sharing(RULES[:1]), "version": "v2"},
    "unknown_key": {**sharing(RULES[:1]), "migchangepolicy": "Force"},
    "unknown_rule_key": sharing([{**RULES[0], "timeslicing": "slice-2"}]),
    "duplicate_rule_name": sharing([RULES[0], {**RULES[2], "name": "t4"}]),
    "missing_rule_name": sharing([{k: v for k, v in RULES[0].items() if k != "name"}]),
    "both_selectors": sharing([{**RULES[0], "nodeNames": ["a"]}]),
    "neither_selector": sharing([{"name": "x", "timeSlicing": "slice-2"}]),
    "invalid_operator": sharing(
        [
            {
                "name": "x",
                "nodeSelector": {"matchExpressions": [{"key": "a", "operator": "Like"}]},
                "timeSlicing": "slice-2",
            }
        ]
    ),
    "unknown_time_slicing_profile": sharing([{**RULES[0], "timeSlicing": "slice-16"}]),
    "unknown_mig_profile": sharing([{**RULES[0], "mig": "all-7g.80gb"}]),
    "invalid_label_value": sharing([{**RULES[0], "timeSlicing": "slice 4!"}]),
    "unknown_policy": sharing(RULES[:1], policy="Sometimes"),
    "not_yaml": "rules: [unclosed\n",
}


@pytest.mark.parametrize("case", sorted(INVALID))
async def test_an_invalid_config_is_rejected_whole_and_the_last_good_one_stays(
    case: str,
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge", PRODUCT: "NVIDIA-A100-SXM4-80GB"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="first config")
        # The invalid config would move the node (the t4 rule is gone or changed in most cases).
        put_sharing(cluster, INVALID[case])
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 1.0
            ),
            what="the rejection",
        )
        await h.settle(4)
        assert labels(cluster, name).get(DP) == "slice-4"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 1.0
        invalid = [e for e in node_events(cluster, name) if e["reason"] == "SharingConfigInvalid"]
        assert len(invalid) == 1
        assert invalid[0]["type"] == "Warning"
        assert "last good config stays in force" in invalid[0]["message"]


async def test_a_deleted_config_changes_nothing_and_a_recreated_one_applies(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")
        delete_config_map(cluster, SHARING_NS, SHARING_NAME)
        await h.until(lambda: h.source.inputs().document is None, what="the deletion seen")
        await h.settle(3)
        assert labels(cluster, name).get(DP) == "slice-4"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_missing") == 1
        deleted = [e for e in node_events(cluster, name) if "was deleted" in e["message"]]
        assert len(deleted) == 1
        assert deleted[0]["type"] == "Warning"
        put_sharing(cluster, sharing([{**RULES[0], "timeSlicing": "slice-8"}]))
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-8", what="recreated")
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 0.0


async def test_an_nvidia_config_losing_a_profile_or_deleted_keeps_the_last_good_config(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")
        put_config_map(
            cluster,
            NV_NS,
            DP_NAME,
            {k: v for k, v in DEVICE_PLUGIN_PROFILES.items() if k != "slice-4"},
        )
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 1.0
            ),
            what="the profile loss rejected",
        )
        delete_config_map(cluster, NV_NS, MIG_NAME)
        put_config_map(cluster, NV_NS, DP_NAME, DEVICE_PLUGIN_PROFILES)
        # The mig-parted config is gone: the rule's mig profile cannot be checked, so that label
        # is held (reported), not the whole config rejected.
        put_sharing(
            cluster, sharing([{**RULES[0], "timeSlicing": "slice-8", "mig": "all-1g.10gb"}])
        )
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="nvidia_config_missing")
                == 1.0
            ),
            what="the missing mig config reported",
        )
        await h.settle(3)
        got = labels(cluster, name)
        assert got.get(DP) == "slice-8", "the label that can be checked applies"
        assert MIG not in got
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 1.0
        messages = " ".join(e["message"] for e in node_events(cluster, name))
        assert "config_map_missing" in messages
        assert "unknown_profile" in messages
        put_config_map(cluster, NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})
        await h.until(lambda: labels(cluster, name).get(MIG) == "all-1g.10gb", what="applied")


async def test_an_nvidia_config_the_agent_may_not_read_holds_its_label_not_the_agent(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    """Review finding: a name RBAC does not grant (a typo) used to leave the agent unsynced for
    ever (no turn, no Event) and, at start, exit on the 403. It holds the label whose profile it
    cannot check (per rule, like a missing ConfigMap), and says why."""
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")
        typo = sharing([{**RULES[0], "timeSlicing": "slice-8"}])
        typo["devicePluginConfig"] = {"namespace": NV_NS, "name": "nvidia-time-slicing-cfg"}
        put_sharing(cluster, typo)
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="nvidia_config_missing")
                == 1.0
            ),
            what="the held label reported",
        )
        await h.settle(3)
        assert labels(cluster, name)[DP] == "slice-4", "never an unchecked value"
        assert h.metric("gpuguard_sharing_waiting", reason="nvidia_config_missing") == 1.0
        assert h.source.problem() is None
        assert h.agent.ready() == (True, "")
        messages = " ".join(e["message"] for e in node_events(cluster, name))
        assert "config_map_unreadable" in messages
        put_sharing(cluster, sharing([{**RULES[0], "timeSlicing": "slice-8"}]))  # fixed
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-8", what="fixed config")


# -- concurrent writers ---------------------------------------------------------------------------


async def test_a_patch_on_a_stale_resource_version_is_a_conflict_and_the_agent_converges(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    api = load_api_client(str(agent_kubeconfig()))
    writer = KubeNodeWriter(api, node_name=name)
    stale = node(cluster, name)["metadata"]["resourceVersion"]
    cluster.label_node(name, {"team": "a"})  # another writer moves the Node on
    with pytest.raises(WriteConflict):
        writer.patch_node(NodePatch(resource_version=stale, labels={DP: "slice-2"}))
    assert DP not in labels(cluster, name)
    api.close()  # type: ignore[no-untyped-call]
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        # Another writer keeps touching other labels while the agent works: every 409 is
        # decided again from the fresh Node, and the agent's label lands.
        conflicts = 0
        for i in range(30):
            cluster.label_node(name, {"churn": str(i)})
            report = await h.turn()
            conflicts += report.held == "conflict"
            if labels(cluster, name).get(DP) == "slice-4":
                break
            h.clock.advance(1.0)
            await asyncio.sleep(0.02)
        assert labels(cluster, name).get(DP) == "slice-4"
        assert labels(cluster, name)["team"] == "a", "the other writer's label survives"


async def test_a_writer_that_keeps_reverting_the_label_is_left_alone_after_three_reverts(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        writes = 0
        for _ in range(3):
            await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="written")
            writes += 1
            await h.settle(2)  # the agent sees its write…
            cluster.label_node(name, {DP: "other"})  # …and the other writer reverts it
            await _seen(h, lambda v: v.labels.get(DP) == "other")
        await h.settle(6)
        assert labels(cluster, name)[DP] == "other", "left alone after 3 reverts"
        assert writes == 3
        assert reasons(cluster, name).count("SharingLabelConflict") == 1
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="label_conflict") == 1


async def _seen(h: Harness, predicate: Callable[[Any], bool], seconds: float = 10.0) -> None:
    """Wait (without a turn) until the agent's watch shows a Node for which ``predicate``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        view = h.source.inputs().node
        if view is not None and predicate(view):
            return
        await asyncio.sleep(0.02)
    pytest.fail("the agent's watch did not show the change")


# -- MIG changes under each policy ----------------------------------------------------------------


def mig_rules(name: str) -> list[dict[str, Any]]:
    return [{"name": "a100", "nodeNames": [name], "mig": "all-1g.10gb", "timeSlicing": "slice-2"}]


def mig_node(cluster: KubeCluster, state: str) -> str:
    """A fresh Node with MIG disabled and mig-manager's state ``state``; its name."""
    name = fresh()
    cluster.create_node(name, {MIG: "all-disabled", STATE: state})
    return name


def cordoned(cluster: KubeCluster, name: str) -> bool:
    return node(cluster, name)["spec"].get("unschedulable") is True


def marked_cordoned_by_agent(cluster: KubeCluster, name: str) -> bool:
    return CORDONED_BY in (node(cluster, name)["metadata"].get("annotations") or {})


async def _mig_manager(h: Harness, cluster: KubeCluster, name: str, outcome: str) -> None:
    """What mig-manager does on a label change: pending, then ``outcome``."""
    cluster.label_node(name, {STATE: "pending"})
    await h.settle(3)
    node_now = node(cluster, name)
    assert node_now["metadata"]["labels"][MIG] == "all-1g.10gb"
    cluster.label_node(name, {STATE: outcome})


@pytest.mark.parametrize("pods", [0, 1])
async def test_when_idle_waits_for_gpu_pods_and_never_writes_while_mig_manager_is_busy(
    pods: int,
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "rebooting")
    for i in range(pods):
        gpu_pod(cluster, namespace, f"train-{i}", name)
    put_sharing(cluster, sharing(mig_rules(name), policy="WhenIdle"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.settle(4)
        assert labels(cluster, name)[MIG] == "all-disabled", "never while rebooting"
        assert labels(cluster, name)[DP] == "slice-2", "time-slicing is not held back"
        assert h.metric("gpuguard_sharing_waiting", reason="mig_state_busy") == 1.0
        cluster.label_node(name, {STATE: "success"})
        await h.settle(4)
        if pods:
            assert labels(cluster, name)[MIG] == "all-disabled", "held while a GPU pod runs"
            assert h.metric("gpuguard_sharing_waiting", reason="gpu_pods") == 1.0
            waiting = [e for e in node_events(cluster, name) if e["reason"] == "MigChangeWaiting"]
            assert any("pod(s) holding a GPU" in e["message"] for e in waiting)
            cluster.delete_pod(namespace, "train-0")
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        assert not cordoned(cluster, name), "WhenIdle never cordons"


@pytest.mark.parametrize("outcome", ["success", "failed"])
async def test_cordon_cordons_waits_applies_and_uncordons_after_mig_manager_reports(
    outcome: str,
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "success")
    gpu_pod(cluster, namespace, "train", name)
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        assert node(cluster, name)["metadata"]["annotations"][CORDONED_BY] == "agent"
        await h.settle(3)
        assert labels(cluster, name)[MIG] == "all-disabled", "cordoned, but a GPU pod remains"
        assert cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/train")
        cluster.delete_pod(namespace, "train")
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        await h.settle(2)
        assert cordoned(cluster, name), "still cordoned"
        await _mig_manager(h, cluster, name, outcome)
        await h.until(lambda: not cordoned(cluster, name), what="uncordon")
        assert not marked_cordoned_by_agent(cluster, name)
        if outcome == "failed":
            assert "MigChangeFailed" in reasons(cluster, name)
            assert (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="mig_change_failed") == 1
            )


async def test_a_failed_change_keeps_the_agents_cordon_when_configured(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = mig_node(cluster, "success")
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    async with running_agent(agent_kubeconfig(), name, keep_cordon_on_failure=True) as h:
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        await _mig_manager(h, cluster, name, "failed")
        await h.settle(6)
        assert cordoned(cluster, name)
        assert "MigChangeFailed" in reasons(cluster, name)


async def test_the_agent_never_lifts_a_cordon_it_did_not_set(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    name = mig_node(cluster, "success")
    cluster.admin_request(
        "PATCH",
        f"/api/v1/nodes/{name}",
        {"spec": {"unschedulable": True}},
        content_type="application/merge-patch+json",
    )
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        await _mig_manager(h, cluster, name, "success")
        await h.settle(6)
        assert cordoned(cluster, name), "the admin's cordon"
        assert not marked_cordoned_by_agent(cluster, name)


def _pdb(cluster: KubeCluster, namespace: str, app: str) -> None:
    """A PodDisruptionBudget that allows no disruption (no controller computes its status: the
    Eviction API refuses with 429 either way, as it does for a budget at its minimum)."""
    cluster.admin_request(
        "POST",
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": f"{app}-pdb"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
        },
    )


@pytest.fixture
def eviction_kubeconfig(cluster: KubeCluster, gpuguard_rbac: str) -> Iterator[Callable[[], Path]]:
    """The agent's ServiceAccount with manifests/agent-eviction-rbac.yaml applied (and removed
    after the test)."""
    from tests.kubefixtures import REPO, apply_manifest

    created = apply_manifest(cluster, REPO / "manifests" / "agent-eviction-rbac.yaml")
    try:
        yield lambda: cluster.kubeconfig_for_sa(SA_NAMESPACE, AGENT_SA_NAME)
    finally:
        for obj in created:
            kind = obj["kind"]
            base = "/apis/rbac.authorization.k8s.io/v1"
            plural = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings"}
            if kind in plural:
                cluster.admin_request("DELETE", f"{base}/{plural[kind]}/{obj['metadata']['name']}")


async def test_drain_evicts_through_the_eviction_api_and_a_pdb_blocks_it(
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "success")
    for pod in ("free", "guarded"):
        gpu_pod(cluster, namespace, pod, name)
        run_pod(cluster, namespace, pod)
    _pdb(cluster, namespace, "guarded")
    put_sharing(cluster, sharing(mig_rules(name), policy="Drain"))
    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        outcomes: dict[str, EvictionOutcome] = {}
        for _ in range(20):
            report = await h.turn()
            outcomes.update(report.evictions)
            if len(outcomes) == 2:
                break
            h.clock.advance(1.0)
            await asyncio.sleep(0.05)
        assert outcomes == {
            f"{namespace}/free": EvictionOutcome.EVICTED,
            f"{namespace}/guarded": EvictionOutcome.BLOCKED,
        }
        free = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/free")
        assert free["metadata"].get("deletionTimestamp"), "evicted: being deleted"
        guarded = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/guarded")
        assert not guarded["metadata"].get("deletionTimestamp"), "the PDB held"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="eviction_blocked") == 1
        await h.settle(3)
        assert labels(cluster, name)[MIG] == "all-disabled", "pods remain: not applied"
        cluster.delete_pod(namespace, "free")  # the kubelet's part: the evicted pod is gone
        cluster.delete_pod(namespace, "guarded")  # the owner gives in
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")


async def test_drain_without_allow_eviction_only_waits(
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "success")
    gpu_pod(cluster, namespace, "train", name)
    put_sharing(cluster, sharing(mig_rules(name), policy="Drain"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        reports = await h.settle(5)
        assert all(not r.evictions for r in reports)
        pod = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/train")
        assert not pod["metadata"].get("deletionTimestamp")
        assert (
            h.metric("gpuguard_sharing_reconcile_errors_total", reason="eviction_not_allowed") == 1
        )


async def test_force_applies_at_once_with_gpu_pods_but_not_while_mig_manager_is_busy(
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "pending")
    gpu_pod(cluster, namespace, "train", name)
    put_sharing(cluster, sharing(mig_rules(name), policy="Force"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.settle(4)
        assert labels(cluster, name)[MIG] == "all-disabled"
        cluster.label_node(name, {STATE: "success"})
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="forced")
        assert not cordoned(cluster, name)


async def test_an_agent_restarted_mid_change_resumes_without_a_second_cordon_or_a_stale_one(
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "success")
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    kubeconfig = agent_kubeconfig()
    async with running_agent(kubeconfig, name) as h:
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
    # Killed after writing the label, before mig-manager picked it up. mig-manager starts.
    cluster.label_node(name, {STATE: "pending"})
    cordon_patches = 0
    async with running_agent(kubeconfig, name) as h2:
        reports = await h2.settle(5)
        cordon_patches += sum(
            1 for r in reports if r.patched is not None and r.patched.cordon is CordonAction.CORDON
        )
        assert cordoned(cluster, name), "kept while pending"
        cluster.label_node(name, {STATE: "success"})
        await h2.until(lambda: not cordoned(cluster, name), what="uncordon")
        assert not marked_cordoned_by_agent(cluster, name)
    assert cordon_patches == 0, "the restarted agent did not cordon again"
    assert labels(cluster, name)[MIG] == "all-1g.10gb"


# -- the process: tests/kube/test_agent_fence_check.py (the real process writes only once its
# admission fence is in force, which this module's cluster does not have) -----------------------


# -- every policy × GPU pods present or absent × mig-manager's outcome ---------------------------


@pytest.mark.parametrize("outcome", ["success", "failed"])
@pytest.mark.parametrize("pods", [0, 1])
@pytest.mark.parametrize("policy", ["WhenIdle", "Cordon", "Drain", "Force"])
async def test_each_policy_with_and_without_gpu_pods_through_pending_to_each_outcome(
    policy: str,
    pods: int,
    outcome: str,
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    name = mig_node(cluster, "success")
    for i in range(pods):
        gpu_pod(cluster, namespace, f"train-{i}", name)
        run_pod(cluster, namespace, f"train-{i}")
    put_sharing(cluster, sharing(mig_rules(name), policy=policy))
    cordons = policy in ("Cordon", "Drain")

    def pods_left() -> int:
        got = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods")
        return len(got["items"])

    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        written_with_pods = False
        evicted = False
        for _ in range(60):
            await h.turn()
            h.clock.advance(1.0)
            current = node(cluster, name)
            if current["metadata"]["labels"].get(MIG) == "all-1g.10gb":
                written_with_pods = pods_left() > 0
                break
            if pods_left() and h.metric("gpuguard_sharing_waiting", reason="gpu_pods") == 1.0:
                assert not cordons or current["spec"].get("unschedulable") is True
                train = cluster.admin_request("GET", f"/api/v1/namespaces/{namespace}/pods/train-0")
                evicted = bool(train["metadata"].get("deletionTimestamp"))
                if policy != "Drain" or evicted:
                    cluster.delete_pod(namespace, "train-0")  # it finishes / the kubelet's part
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the mig label was never written")
        assert written_with_pods is (pods > 0 and policy == "Force")
        assert evicted is (pods > 0 and policy == "Drain")
        assert (cordoned(cluster, name)) is cordons
        cluster.label_node(name, {STATE: "pending"})
        await h.settle(3)
        assert (cordoned(cluster, name)) is cordons
        cluster.label_node(name, {STATE: outcome})
        await h.settle(4)
        final = node(cluster, name)
        assert not final["spec"].get("unschedulable"), "the agent's cordon is lifted"
        assert CORDONED_BY not in (final["metadata"].get("annotations") or {})
        assert final["metadata"]["labels"][MIG] == "all-1g.10gb"
        failed = [e for e in node_events(cluster, name) if e["reason"] == "MigChangeFailed"]
        assert len(failed) == (outcome == "failed")
        assert h.metric(
            "gpuguard_sharing_reconcile_errors_total", reason="mig_change_failed"
        ) == float(outcome == "failed")
