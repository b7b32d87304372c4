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
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube.agent import KubeNodeWriter
from gpuguard.adapters.kube.client import load_api_client
from gpuguard.core.agent import EvictionOutcome, NodePatch
from gpuguard.core.reconcile import DRAIN_DEADLINE_SECONDS, CordonAction
from gpuguard.errors import WriteConflict
from rigs.controlplane import AdminRequestError, KubeCluster, put_config_map
from rigs.kubefixtures import AGENT_SA_NAME, SA_NAMESPACE, ensure_namespace
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
    put_sharing,
    running_agent,
)

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
    # Rules over a label sharing itself writes select on their own output: the label would flip.
    "selects_own_label": sharing(
        [
            {
                "name": "on",
                "nodeSelector": {"matchLabels": {DP: "slice-4"}},
                "timeSlicing": "slice-8",
            },
            {**RULES[0], "timeSlicing": "slice-4"},
        ]
    ),
    "selects_mig_manager_label": sharing(
        [
            {
                "name": "after-mig",
                "nodeSelector": {"matchExpressions": [{"key": STATE, "operator": "DoesNotExist"}]},
                "timeSlicing": "slice-8",
            }
        ]
    ),
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


async def test_a_config_whose_rules_select_on_their_own_labels_is_rejected_and_says_why(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    """Two rules over the label they set flipped every node between them, a Node write and an
    Event each turn (29 flips in 30 turns); the agent adopted such a config as valid. It is
    rejected whole now: the node keeps the last good config's value, and the Event names the
    rule, the label, why and the fix."""
    name = fresh()
    cluster.create_node(name, {INSTANCE: "g4dn.12xlarge"})
    put_sharing(cluster, sharing(RULES))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-4", what="labelled")
        flipping = [
            {
                "name": "up",
                "nodeSelector": {"matchLabels": {DP: "slice-4"}},
                "timeSlicing": "slice-8",
            },
            {
                "name": "down",
                "nodeSelector": {"matchLabels": {DP: "slice-8"}},
                "timeSlicing": "slice-4",
            },
        ]
        put_sharing(cluster, sharing(flipping))
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 1.0
            ),
            what="the rejection",
        )
        values = []
        for report in await h.settle(10):
            values.append(labels(cluster, name).get(DP))
            assert report.patched is None
        assert set(values) == {"slice-4"}, "no flip"
        (invalid,) = [
            e for e in node_events(cluster, name) if e["reason"] == "SharingConfigInvalid"
        ]
        message = invalid["message"]
        assert "rule 'up' selects on nvidia.com/device-plugin.config" in message
        assert "own output" in message
        assert "(selects_own_output)" in message
        assert "last good config stays in force" in message


async def test_a_rule_chain_validation_cannot_see_stops_flipping_and_is_reported(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], nvidia_configs: None
) -> None:
    """Rules over the product name, which feature discovery rewrites from the agent's own label
    (``-SHARED`` under time-slicing): valid with a warning, yet the label flipped every turn. The
    agent now changes it at most 4 times in 10 minutes, then leaves it and says so."""
    name = fresh()
    product = "Tesla-T4"
    cluster.create_node(name, {PRODUCT: product})
    chain = [
        {
            "name": "plain",
            "nodeSelector": {"matchLabels": {PRODUCT: product}},
            "timeSlicing": "slice-4",
        },
        {
            "name": "shared",
            "nodeSelector": {"matchLabels": {PRODUCT: f"{product}-SHARED"}},
            "timeSlicing": "slice-2",
        },
    ]
    put_sharing(cluster, sharing(chain))
    async with running_agent(agent_kubeconfig(), name) as h:
        seen: list[str | None] = []
        for _ in range(30):
            await h.turn()
            value = labels(cluster, name).get(DP)
            if not seen or seen[-1] != value:
                seen.append(value)
            # Feature discovery, after the device plugin took its new config.
            rewritten = f"{product}-SHARED" if value == "slice-4" else product
            if labels(cluster, name).get(PRODUCT) != rewritten:
                cluster.label_node(name, {PRODUCT: rewritten})
                await _seen(h, functools.partial(_shows_product, want=rewritten))
            h.clock.advance(1.0)
        assert seen == ["slice-4", "slice-2", "slice-4", "slice-2"], "4 changes, then held"
        h.events.wait_idle(2.0)
        held = [e for e in node_events(cluster, name) if e["reason"] == "SharingLabelConflict"]
        assert len(held) == 1
        assert held[0]["type"] == "Warning"
        assert "written 4 times within 600s" in held[0]["message"]
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="label_flapping") == 1
        # The admin's fix (rules over a label nothing rewrites) applies at once.
        put_sharing(cluster, sharing([*RULES[:1], {**chain[0], "timeSlicing": "slice-8"}]))
        await h.until(lambda: labels(cluster, name).get(DP) == "slice-8", what="the fix")


def _shows_product(view: Any, *, want: str) -> bool:
    return bool(view.labels.get(PRODUCT) == want)


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
    from rigs.kubefixtures import REPO, apply_manifest

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


# -- whose cordon it is: an admin's uncordon and cordon during a change -------------------------


def admin_cordon(cluster: KubeCluster, name: str, unschedulable: bool) -> None:
    """``kubectl cordon`` / ``kubectl uncordon``: a merge patch of ``spec.unschedulable`` under
    kubectl's field managers (annotations left as they are)."""
    manager = "kubectl-cordon" if unschedulable else "kubectl-uncordon"
    cluster.admin_request(
        "PATCH",
        f"/api/v1/nodes/{name}?fieldManager={manager}",
        {"spec": {"unschedulable": True if unschedulable else None}},
        content_type="application/merge-patch+json",
    )


async def _applied_under_the_agents_cordon(h: Harness, cluster: KubeCluster, name: str) -> None:
    """Cordon: the agent cordons, writes the mig label, mig-manager starts (pending)."""
    await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
    assert cordoned(cluster, name)
    assert marked_cordoned_by_agent(cluster, name)
    cluster.label_node(name, {STATE: "pending"})
    await h.settle(3)


@pytest.mark.parametrize("seen_schedulable", [True, False])
async def test_an_admin_cordon_after_an_uncordon_mid_change_is_never_lifted(
    seen_schedulable: bool,
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
) -> None:
    """The admin lifts the agent's cordon while mig-manager applies the change, then cordons for
    maintenance (with or without an agent turn in between): the agent's marker goes, and when
    mig-manager reports success the admin's cordon stays."""
    name = mig_node(cluster, "success")
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await _applied_under_the_agents_cordon(h, cluster, name)
        admin_cordon(cluster, name, False)
        if seen_schedulable:
            await h.until(lambda: not marked_cordoned_by_agent(cluster, name), what="marker gone")
            assert not cordoned(cluster, name), "not cordoned again once mig-manager works"
            lifted = [
                e["message"] for e in node_events(cluster, name) if "was lifted" in e["message"]
            ]
            assert len(lifted) == 1, node_events(cluster, name)
        admin_cordon(cluster, name, True)
        await h.settle(3)
        assert not marked_cordoned_by_agent(cluster, name), "the admin's cordon is not the agent's"
        cluster.label_node(name, {STATE: "success"})
        await h.settle(6)
        assert cordoned(cluster, name), "the admin's maintenance cordon stays"
        assert not marked_cordoned_by_agent(cluster, name)


async def test_an_uncordon_before_the_change_is_written_is_reported_and_cordoned_again(
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    """Cordon policy, a GPU pod still running: the admin uncordons. The change is not written
    yet, so the agent cordons again (the policy changes MIG only on a cordoned node) and says
    so, once; it then lifts its own cordon after mig-manager's success as usual."""
    name = mig_node(cluster, "success")
    gpu_pod(cluster, namespace, "train", name)
    put_sharing(cluster, sharing(mig_rules(name), policy="Cordon"))
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        await h.settle(2)
        admin_cordon(cluster, name, False)
        await h.until(lambda: cordoned(cluster, name), what="cordoned again")
        assert marked_cordoned_by_agent(cluster, name)
        again = [e for e in node_events(cluster, name) if "cordoning again" in e["message"]]
        assert len(again) == 1
        assert labels(cluster, name)[MIG] == "all-disabled"
        cluster.delete_pod(namespace, "train")
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        await _mig_manager(h, cluster, name, "success")
        await h.until(lambda: not cordoned(cluster, name), what="the agent's own cordon lifted")


# -- what a drain never evicts, and how long it goes on -----------------------------------------


def owned_gpu_pod(
    cluster: KubeCluster,
    ns: str,
    name: str,
    node_name: str,
    *,
    owner: Mapping[str, Any] | None = None,
    annotations: Mapping[str, str] | None = None,
    gpus: str = "1",
) -> dict[str, Any]:
    """A pod bound to ``node_name`` asking for ``gpus`` ``nvidia.com/gpu``, with a controller
    reference to ``owner`` (an object created as admin) and ``annotations``."""
    meta: dict[str, Any] = {"name": name, "labels": {"app": name}}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    if annotations:
        meta["annotations"] = dict(annotations)
    return cluster.admin_request(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "nodeName": node_name,
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.invalid/cuda:1",
                        "resources": {"limits": {"nvidia.com/gpu": gpus}},
                    }
                ],
            },
        },
    )


def daemon_set(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    labels_ = {"app": name}
    return cluster.admin_request(
        "POST",
        f"/apis/apps/v1/namespaces/{ns}/daemonsets",
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": labels_},
                "template": {
                    "metadata": {"labels": labels_},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/dcgm:1"}]},
                },
            },
        },
    )


def replica_set(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    labels_ = {"app": name}
    return cluster.admin_request(
        "POST",
        f"/apis/apps/v1/namespaces/{ns}/replicasets",
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": labels_},
                "template": {
                    "metadata": {"labels": labels_},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]},
                },
            },
        },
    )


def pod_state(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return cluster.admin_request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    except AdminRequestError as e:
        if e.code == 404:
            return None
        raise


async def test_drain_never_evicts_a_daemon_sets_pod_or_a_mirror_pod_and_names_them(
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    """A DaemonSet's GPU pod (which comes back at once under a new UID) and a mirror pod (the
    kubelet's copy of a static pod) are never evicted, as ``kubectl drain`` refuses them; the
    change reports them, naming the DaemonSet, and waits. A plain GPU pod is evicted."""
    name = mig_node(cluster, "success")
    ds = daemon_set(cluster, namespace, "dcgm")
    owned_gpu_pod(cluster, namespace, "dcgm-x1", name, owner=ds)
    owned_gpu_pod(
        cluster, namespace, "static", name, annotations={"kubernetes.io/config.mirror": "abc"}
    )
    gpu_pod(cluster, namespace, "train", name)
    for pod in ("dcgm-x1", "static", "train"):
        run_pod(cluster, namespace, pod)
    put_sharing(cluster, sharing(mig_rules(name), policy="Drain"))
    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        outcomes: dict[str, EvictionOutcome] = {}
        for _ in range(30):
            report = await h.turn()
            outcomes.update(report.evictions)
            h.clock.advance(5.0)
            await asyncio.sleep(0.05)
        h.events.wait_idle(2.0)
        assert outcomes == {f"{namespace}/train": EvictionOutcome.EVICTED}
        for pod in ("dcgm-x1", "static"):
            got = pod_state(cluster, namespace, pod)
            assert got is not None, pod
            assert not got["metadata"].get("deletionTimestamp"), pod
        waiting = [
            e["message"] for e in node_events(cluster, name) if "never evicts" in e["message"]
        ]
        assert len(waiting) == 1, node_events(cluster, name)
        assert f"DaemonSet {namespace}/dcgm (pod {namespace}/dcgm-x1)" in waiting[0]
        assert f"mirror pod {namespace}/static" in waiting[0]
        assert h.metric("gpuguard_sharing_waiting", reason="gpu_pods") == 1.0
        assert labels(cluster, name)[MIG] == "all-disabled"
        for pod in ("dcgm-x1", "static", "train"):
            cluster.delete_pod(namespace, pod)  # the admin moves the DaemonSet off the node
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")


async def test_drain_evicts_a_controller_that_keeps_putting_pods_back_at_a_bounded_rate(
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    """A controller that binds a new GPU pod (a new UID) to the cordoned node as soon as its
    last one is evicted (the test plays it, and the kubelet that finishes the deletion): at
    most 5 of its pods are evicted per minute, reported once, naming it."""
    name = mig_node(cluster, "success")
    rs = replica_set(cluster, namespace, "pinned")
    put_sharing(cluster, sharing(mig_rules(name), policy="Drain"))
    created = 0

    def controller() -> None:
        nonlocal created
        current = pod_state(cluster, namespace, f"pinned-{created}")
        if current is not None and not current["metadata"].get("deletionTimestamp"):
            return
        if current is not None:
            cluster.delete_pod(namespace, f"pinned-{created}")
        created += 1
        owned_gpu_pod(cluster, namespace, f"pinned-{created}", name, owner=rs)
        run_pod(cluster, namespace, f"pinned-{created}")

    controller()
    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        evicted = 0
        for _ in range(60):  # one minute of the agent's clock
            await _seen(h, lambda _: True)
            report = await h.turn()
            evicted += sum(1 for o in report.evictions.values() if o is EvictionOutcome.EVICTED)
            controller()
            await asyncio.sleep(0.15)  # the pods watch shows the new pod
            h.clock.advance(1.0)
        h.events.wait_idle(2.0)
        assert 1 <= evicted <= 5, evicted
        held = [e["message"] for e in node_events(cluster, name) if "keeps putting" in e["message"]]
        assert len(held) == 1
        assert f"ReplicaSet {namespace}/pinned" in held[0]


async def test_a_drain_stops_evicting_at_its_deadline_and_says_so(
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    """A PodDisruptionBudget that never allows the eviction: retried until the drain deadline,
    then no more evictions for this change, reported once (``drain_timeout``); the change
    waits, cordoned, and applies once the pod is gone."""
    name = mig_node(cluster, "success")
    gpu_pod(cluster, namespace, "guarded", name)
    run_pod(cluster, namespace, "guarded")
    _pdb(cluster, namespace, "guarded")
    put_sharing(cluster, sharing(mig_rules(name), policy="Drain"))
    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        await h.until(lambda: cordoned(cluster, name), what="cordon")
        tries = 0
        for _ in range(4):
            report = await h.turn()
            tries += len(report.evictions)
            h.clock.advance(10.0)
        assert tries >= 1, "evicting before the deadline"
        h.clock.advance(DRAIN_DEADLINE_SECONDS)
        late = 0
        for _ in range(6):
            report = await h.turn()
            late += len(report.evictions)
            h.clock.advance(20.0)
            await asyncio.sleep(0.05)
        h.events.wait_idle(2.0)
        assert late == 0, "no eviction past the deadline"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="drain_timeout") == 1
        stopped = [e for e in node_events(cluster, name) if "no more evictions" in e["message"]]
        assert len(stopped) == 1
        assert cordoned(cluster, name)
        cluster.delete_pod(namespace, "guarded")
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")


# -- a pod that asks for no GPU -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["WhenIdle", "Cordon", "Drain"])
async def test_a_pod_asking_for_zero_gpus_neither_holds_up_a_change_nor_is_evicted(
    policy: str,
    cluster: KubeCluster,
    eviction_kubeconfig: Callable[[], Path],
    nvidia_configs: None,
    namespace: str,
) -> None:
    """``nvidia.com/gpu: 0`` (and ``"0.0"`` in requests) holds no GPU: the change applies with
    the pod running, and Drain leaves it alone."""
    name = mig_node(cluster, "success")
    owned_gpu_pod(cluster, namespace, "cpu-only", name, gpus="0")
    run_pod(cluster, namespace, "cpu-only")
    put_sharing(cluster, sharing(mig_rules(name), policy=policy))
    async with running_agent(eviction_kubeconfig(), name, allow_eviction=True) as h:
        await h.until(lambda: labels(cluster, name)[MIG] == "all-1g.10gb", what="applied")
        pod = pod_state(cluster, namespace, "cpu-only")
        assert pod is not None
        assert not pod["metadata"].get("deletionTimestamp")
        assert h.metric("gpuguard_sharing_waiting", reason="gpu_pods") == 0.0
