"""A sharing config whose NVIDIA ConfigMaps are not all there, on the real API
server: the agent applies what it can check and holds, per rule, only the labels that need a
missing ConfigMap (reported on the Node and in metrics), and ``check-sharing --kubeconfig``
reads the same ConfigMaps the same way and says so per rule.

Each test fails on the code before the fix: the agent rejected the whole config ("configmap …
not found") and labelled nothing, and ``check-sharing`` had no ``--kubeconfig`` and called an
unchecked config plainly "valid".
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.commands.check_sharing import check_sharing
from rigs.cli_run import run_gpuguard
from rigs.controlplane import KubeCluster, put_config_map
from rigs.kubefixtures import ensure_namespace
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
    delete_config_map,
    fresh,
    labels,
    node_events,
    put_sharing,
    running_agent,
)

pytestmark = pytest.mark.apiserver

ROOT = Path(__file__).resolve().parents[2]
HELD = "nvidia_config_missing"


def readme_sharing_examples() -> list[dict[str, Any]]:
    """The sharing configs of README's "Sharing profiles": time-slicing alone, then with MIG."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Sharing profiles", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    examples = [yaml.safe_load(b) for b in blocks if b.startswith("version: v1")]
    assert len(examples) == 2, "README: a time-slicing example, then the one with MIG"
    return examples


@pytest.fixture
def device_plugin_only(cluster: KubeCluster, gpuguard_rbac: str) -> Iterator[None]:
    """A cluster with the device plugin's ConfigMap and no mig-parted one (no GPU operator
    mig-manager); the sharing ConfigMap removed around the test."""
    ensure_namespace(cluster, NV_NS)
    put_config_map(cluster, NV_NS, DP_NAME, DEVICE_PLUGIN_PROFILES)
    delete_config_map(cluster, NV_NS, MIG_NAME)
    delete_config_map(cluster, SHARING_NS, SHARING_NAME)
    yield
    delete_config_map(cluster, SHARING_NS, SHARING_NAME)
    put_config_map(cluster, NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})


# -- the agent ---------------------------------------------------------------------------------


async def test_the_readme_examples_label_nodes_on_a_cluster_with_only_the_device_plugin(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], device_plugin_only: None
) -> None:
    """The README's time-slicing example labels its node; so does the MIG one, for every rule
    and label that does not need the missing mig-parted ConfigMap."""
    time_slicing, with_mig = readme_sharing_examples()
    assert "migConfig" not in time_slicing
    assert with_mig["migConfig"]["name"] == MIG_NAME
    t4, a100 = fresh("t4"), fresh("a100")
    cluster.create_node(t4, {INSTANCE: "g4dn.12xlarge"})
    cluster.create_node(a100, {})
    with_mig["rules"][1]["nodeNames"] = [a100]  # the README's names, made unique to this test
    put_sharing(cluster, time_slicing)
    async with running_agent(agent_kubeconfig(), t4) as t4_agent:
        await t4_agent.until(lambda: labels(cluster, t4).get(DP) == "slice-4", what="labelled")
        put_sharing(cluster, with_mig)
        async with running_agent(agent_kubeconfig(), a100) as h:
            await h.until(lambda: labels(cluster, a100).get(DP) == "slice-2", what="a100 dp")
            await h.settle(3)
            await t4_agent.settle(3)
            assert labels(cluster, t4).get(DP) == "slice-4"
            assert MIG not in labels(cluster, t4)
            assert MIG not in labels(cluster, a100), "never an unchecked value"
            # The t4 node's rule needs no mig-parted ConfigMap: nothing to report there.
            assert "SharingConfigInvalid" not in [e["reason"] for e in node_events(cluster, t4)]
            for metric in ("gpuguard_sharing_reconcile_errors_total", "gpuguard_sharing_waiting"):
                assert t4_agent.metric(metric, reason=HELD) == 0.0
                assert h.metric(metric, reason=HELD) == 1.0


async def test_a_mig_rule_without_its_config_map_is_reported_and_its_time_slicing_applies(
    cluster: KubeCluster, agent_kubeconfig: Callable[..., Path], device_plugin_only: None
) -> None:
    name = fresh("a100")
    cluster.create_node(name, {MIG: "all-disabled"})
    document = readme_sharing_examples()[1]
    document["migChangePolicy"] = "Force"
    document["rules"][1]["nodeNames"] = [name]
    put_sharing(cluster, document)
    async with running_agent(agent_kubeconfig(), name) as h:
        await h.until(
            lambda: (
                h.metric("gpuguard_sharing_reconcile_errors_total", reason=HELD) == 1.0
                and labels(cluster, name).get(DP) == "slice-2"
            ),
            what="the time-slicing label and the report",
        )
        await h.settle(4)
        assert labels(cluster, name)[MIG] == "all-disabled", "left as it is"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason=HELD) == 1.0, "once"
        assert h.metric("gpuguard_sharing_reconcile_errors_total", reason="config_invalid") == 0
        assert h.metric("gpuguard_sharing_waiting", reason=HELD) == 1.0
        (event,) = [e for e in node_events(cluster, name) if e["reason"] == "SharingConfigInvalid"]
        assert event["type"] == "Warning"
        assert (
            f"configmap {NV_NS}/{MIG_NAME} is not found (config_map_missing)" in (event["message"])
        )
        assert "rule 'a100-mig' sets mig 'all-1g.10gb'" in event["message"]
        # The GPU operator's mig-manager arrives: the held label is checked and applied.
        put_config_map(cluster, NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})
        await h.until(lambda: labels(cluster, name).get(MIG) == "all-1g.10gb", what="mig")
        assert h.metric("gpuguard_sharing_waiting", reason=HELD) == 0.0


# -- check-sharing --kubeconfig ----------------------------------------------------------------


def test_check_sharing_reads_the_live_config_maps_and_reports_a_missing_one_per_rule(
    cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    a100 = fresh("a100")
    cluster.create_node(a100, {})
    document = readme_sharing_examples()[1]
    for reference in ("devicePluginConfig", "migConfig"):
        document[reference]["namespace"] = namespace  # ConfigMaps of this test's own
    document["rules"][1]["nodeNames"] = [a100]
    path = tmp_path / "sharing.yaml"
    path.write_text(yaml.safe_dump(document))
    put_config_map(cluster, namespace, DP_NAME, DEVICE_PLUGIN_PROFILES)
    kubeconfig = str(cluster.admin_kubeconfig)

    def check(**extra: Any) -> dict[str, Any]:
        return check_sharing(
            sharing_path=str(path),
            device_plugin_path=None,
            mig_path=None,
            node_paths=[],
            kubeconfig=kubeconfig,
            **extra,
        )

    result = check(cluster_nodes=True)
    assert result["valid"] is True, result["errors"]
    assert result["references"] == {"devicePluginConfig": "cluster", "migConfig": "missing"}
    assert [w.rsplit("(", 1)[1] for w in result["warnings"]] == ["config_map_missing)"]
    assert "rules[1].mig: rule 'a100-mig' sets mig 'all-1g.10gb'" in result["warnings"][0]
    assert f"configmap {namespace}/{MIG_NAME} is not found" in result["warnings"][0]
    (mine,) = [n for n in result["nodes"] if n["name"] == a100]
    assert mine["rule"] == "a100-mig"
    assert mine["labels"] == {DP: "slice-2", MIG: None}
    assert list(mine["held"]) == [MIG]

    # The live device-plugin ConfigMap is what the profiles are checked against.
    put_config_map(cluster, namespace, DP_NAME, {"slice-4": DEVICE_PLUGIN_PROFILES["slice-4"]})
    result = check()
    assert result["valid"] is False
    assert ["rules[1].timeSlicing" in e and "unknown_profile" in e for e in result["errors"]] == [
        True
    ]

    # Both there: checked, nothing held.
    put_config_map(cluster, namespace, DP_NAME, DEVICE_PLUGIN_PROFILES)
    put_config_map(cluster, namespace, MIG_NAME, {"config.yaml": MIG_PARTED})
    result = check(cluster_nodes=True)
    assert (result["valid"], result["warnings"]) == (True, [])
    assert result["references"] == {"devicePluginConfig": "cluster", "migConfig": "cluster"}
    (mine,) = [n for n in result["nodes"] if n["name"] == a100]
    assert mine["labels"] == {DP: "slice-2", MIG: "all-1g.10gb"}
    assert mine["held"] == {}


def test_check_sharing_with_the_agents_token_sees_what_the_agent_sees(
    cluster: KubeCluster,
    agent_kubeconfig: Callable[..., Path],
    device_plugin_only: None,
    tmp_path: Path,
) -> None:
    """The agent's RBAC grants NVIDIA's ConfigMaps by name: with its token, a missing one is
    missing (held per rule), and a name RBAC does not grant is not checked (said so)."""
    path = tmp_path / "sharing.yaml"
    document = readme_sharing_examples()[1]
    path.write_text(yaml.safe_dump(document))
    result = cli(path, "--kubeconfig", agent_kubeconfig(), "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["references"] == {"devicePluginConfig": "cluster", "migConfig": "missing"}
    assert [w.rsplit("(", 1)[1] for w in found["warnings"]] == ["config_map_missing)"]
    document["devicePluginConfig"]["name"] = "nvidia-time-slicing-cfg"  # a typo
    path.write_text(yaml.safe_dump(document))
    result = cli(path, "--kubeconfig", agent_kubeconfig())
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.endswith(": valid (devicePluginConfig: unreadable, migConfig: missing)")
    assert "may not read it" in result.stdout
    assert "(config_map_unreadable)" in result.stdout


def test_check_sharing_against_a_cluster_it_cannot_reach_is_a_usage_error(
    cluster: KubeCluster, tmp_path: Path
) -> None:
    path = tmp_path / "sharing.yaml"
    path.write_text(yaml.safe_dump(readme_sharing_examples()[0]))
    unreachable = cluster.kubeconfig_for_token(
        "x", name="unreachable", server="https://127.0.0.1:1"
    )
    result = cli(path, "--kubeconfig", unreachable, "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(
        f"gpuguard check-sharing: --kubeconfig: cannot read configmap {NV_NS}/{DP_NAME}: "
    )
    assert len(result.stderr.splitlines()) == 1


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``gpuguard check-sharing ARGS`` against the test API server (60 s)."""
    return run_gpuguard("check-sharing", *args, timeout=60, memory_bytes=None)
