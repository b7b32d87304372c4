"""The sharing agent on the real kube-apiserver, for the tests in ``tests/kube/``: the NVIDIA and
sharing ConfigMaps the agent reads, the Node reads the tests assert on, and ``running_agent``
(the real agent of ``app.build_agent`` under the agent's ServiceAccount, turned by the test).

Owns: the names of the ConfigMaps, their writing and deletion as admin, a ``Harness`` over one
running agent. Must not leave threads behind: ``running_agent`` stops the watches and the Event
sender it started, also after a failure.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpuguard.adapters.kube import load_api_client
from gpuguard.adapters.kube.agent import KubeSharingSource
from gpuguard.adapters.kube.events import KubeEventSink
from gpuguard.app import build_agent
from gpuguard.runtime.agent import Agent, AgentOptions, TurnReport
from rigs.controlplane import AdminRequestError, KubeCluster, put_config_map
from tests.fakes import FakeClock

SHARING_NS, SHARING_NAME = "gpuguard", "gpuguard-sharing"
NV_NS, DP_NAME, MIG_NAME = "gpu-operator", "nvidia-time-slicing-config", "nvidia-mig-config"
DP = "nvidia.com/device-plugin.config"
MIG = "nvidia.com/mig.config"
INSTANCE = "node.kubernetes.io/instance-type"
DEVICE_PLUGIN_PROFILES = {
    name: yaml.safe_dump(
        {
            "version": "v1",
            "sharing": {
                "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}
            },
        }
    )
    for name, replicas in (("slice-2", 2), ("slice-4", 4), ("slice-8", 8))
}
MIG_PARTED = yaml.safe_dump(
    {
        "version": "v1",
        "mig-configs": {
            "all-disabled": [{"devices": "all", "mig-enabled": False}],
            "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
            "all-3g.40gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}],
        },
    }
)


# -- cluster objects ---------------------------------------------------------------------------


def delete_config_map(cluster: KubeCluster, ns: str, name: str) -> None:
    try:
        cluster.admin_request("DELETE", f"/api/v1/namespaces/{ns}/configmaps/{name}")
    except AdminRequestError as e:
        if e.code != 404:
            raise


def put_sharing(cluster: KubeCluster, document: Mapping[str, Any] | str) -> None:
    text = document if isinstance(document, str) else yaml.safe_dump(dict(document))
    put_config_map(cluster, SHARING_NS, SHARING_NAME, {"sharing.yaml": text})


def node(cluster: KubeCluster, name: str) -> dict[str, Any]:
    return cluster.admin_request("GET", f"/api/v1/nodes/{name}")


def labels(cluster: KubeCluster, name: str) -> dict[str, str]:
    return dict(node(cluster, name)["metadata"].get("labels") or {})


def node_events(cluster: KubeCluster, name: str) -> list[dict[str, Any]]:
    got = cluster.admin_request(
        "GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{name}"
    )
    return [e for e in got.get("items", []) if e["involvedObject"].get("kind") == "Node"]


@dataclass
class Harness:
    agent: Agent
    source: KubeSharingSource
    events: KubeEventSink
    registry: CollectorRegistry
    clock: FakeClock
    node_name: str

    async def turn(self) -> TurnReport:
        return await self.agent.turn()

    async def until(
        self, predicate: Callable[[], bool], *, what: str, seconds: float = 20.0
    ) -> None:
        """Turn (advancing the clock past the write rate limit) until ``predicate()``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self.agent.turn()
            self.events.wait_idle(2.0)
            if predicate():
                return
            self.clock.advance(1.0)
            await asyncio.sleep(0.05)
        pytest.fail(f"timed out after {seconds}s waiting for {what}")

    async def settle(self, turns: int = 8) -> list[TurnReport]:
        """A few turns with the watch caught up between them: what the agent does when idle."""
        reports = []
        for _ in range(turns):
            reports.append(await self.agent.turn())
            self.clock.advance(1.0)
            await asyncio.sleep(0.1)
        self.events.wait_idle(2.0)
        return reports

    def metric(self, name: str, **match: str) -> float:
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in match.items()):
                    return float(sample.value)
        return 0.0


@asynccontextmanager
async def running_agent(kubeconfig: Path, node_name: str, **options: Any) -> AsyncIterator[Harness]:
    api = load_api_client(str(kubeconfig))
    clock = FakeClock(wall_now=None)  # monotonic time the test advances, real Event timestamps
    registry = CollectorRegistry()
    parts = build_agent(
        api,
        node_name=node_name,
        sharing_namespace=SHARING_NS,
        sharing_name=SHARING_NAME,
        options=AgentOptions(**options),
        clock=clock,
        registry=registry,
        watch_timeout_seconds=30,
    )
    agent, events = parts.agent, parts.events
    source = parts.source
    assert isinstance(source, KubeSharingSource)
    assert isinstance(events, KubeEventSink)
    source.start()
    events.start()
    try:
        assert source.wait_synced(20.0), source.problem()
        yield Harness(agent, source, events, registry, clock, node_name)
    finally:
        source.stop()
        events.stop()
        api.close()  # type: ignore[no-untyped-call]


def fresh(prefix: str = "gpu") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
