"""What the enforcer and the agent really export, for the tests that check rules, alerts and
panels against it: the label names of every sample, and the labels a scrape adds."""

from __future__ import annotations

import asyncio
import time
from functools import cache

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.adapters.metrics import PrometheusAgentRecorder, PrometheusRecorder
from tests.enforcer_world import World
from tests.fakes import GiB, kill_target, proc

TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "node"})
"""Labels a scrape adds (a ServiceMonitor: job, instance, namespace, pod, container, service,
endpoint; a relabelling: node). Per-pod series bring their own namespace/pod/container
(``honorLabels: true``), so a test may give them either."""


@cache
def exported() -> dict[str, frozenset[str]]:
    """``{sample name: label names}`` as the enforcer and the agent really export them: a
    scrape of the real recorders after the enforcer stopped a greedy pod."""
    world = World(prometheus=True)
    world.gpu.processes = [proc(101, world.gpu.devices[0], 12 * GiB)]
    asyncio.run(world.run(12))
    agent = CollectorRegistry()
    PrometheusAgentRecorder(agent, node="node-1")
    killed = CollectorRegistry()  # the kill series, whether or not the world's run stopped one
    PrometheusRecorder(killed, hostname="node-1").count_kill(
        kill_target(1, world.gpu.devices[0]), wall_time=time.time()
    )
    names: dict[str, set[str]] = {}
    for registry in (world.registry, agent, killed):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in names.items()}
