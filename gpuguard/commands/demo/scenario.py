"""The demo's script: who is on the simulated node and cluster, what each does when, and what
must come of it. Data only: the acts (``enforcer_act``, ``sharing_act``) play it, the verdict
checks it.

Act one: two GPUs; a greedy pod that grows past its limit (``GREEDY_RAMP``) and five tenants and a
host process that must survive. Act two: two T4 nodes and an A100 node whose MIG change must wait
for its training pod. ``minimum_duration_seconds()`` follows from act one's timing: the command
line refuses a ``--duration`` shorter than it (``gpuguard.commands.demo_args``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpuguard.core.model import (
    ContainerId,
    EnforcementPolicy,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    Pod,
    PodRef,
    PodUid,
)
from gpuguard.core.reconcile import MIG_CONFIG_STATE_LABEL
from gpuguard.core.sharing import DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL
from gpuguard.ports import Clock
from gpuguard.sim.cluster import SimCluster
from gpuguard.sim.node import GiB, SimNode, SimProcess, ramp, sim_gpu, sim_pod, steady

# -- act one: the enforcer on a simulated node (docs/design.md, Enforcement cycle) -----------------

POLL_SECONDS = 0.25
GRACE_SECONDS = 2.0
TERM_TIMEOUT_SECONDS = 3.0
STALENESS_SECONDS = 5.0
# Scheduling slack on top of "grace + 2 polls": a loaded CI machine delays a cycle a little.
SLACK_SECONDS = 0.25

GREEDY_LIMIT = 20 * GiB
GREEDY_FROM, GREEDY_TO = 8 * GiB, 30 * GiB
GREEDY_RAMP = (3.0, 9.0)
GREEDY_CONTAINER = ContainerId("a" * 64)
GREEDY_UID = "0b6a4f0e-1c2d-4e3f-8a9b-0c1d2e3f4a5b"


def crossing_seconds() -> float:
    """Seconds into act one when the greedy pod's usage first exceeds its limit (its ramp)."""
    start, end = GREEDY_RAMP
    frac = (GREEDY_LIMIT - GREEDY_FROM) / (GREEDY_TO - GREEDY_FROM)
    return start + (end - start) * frac


def minimum_duration_seconds() -> float:
    """The shortest ``--duration`` that can show the kill, from act one's script: the offender
    crosses its limit, is signalled within grace + 2 polls (+ slack, what the verdict allows),
    and one more poll must start before act one ends; rounded up to a whole second. Any shorter
    and the demo could only fail, so the command line refuses it (``demo_args``)."""
    budget = GRACE_SECONDS + 2 * POLL_SECONDS + SLACK_SECONDS
    return float(math.ceil(crossing_seconds() + budget + POLL_SECONDS))


def minimum_duration_reason() -> str:
    """Why ``minimum_duration_seconds()``, in words, for the usage error."""
    return (
        f"act one's offender crosses its limit {crossing_seconds():.2f} s in; stopping it may take "
        f"grace {GRACE_SECONDS:g} s + 2 polls of {POLL_SECONDS:g} s + {SLACK_SECONDS:g} s slack, "
        "and one more poll must start before the act ends"
    )


@dataclass(slots=True, kw_only=True)
class Scenario:
    """Act one's node, set up: whom the enforcer must stop and whom it must leave alone."""

    node: SimNode
    greedy_pid: int
    protected: dict[int, str]
    """PID → who must survive (neighbour, default-limited pod, exempt pod, host process)."""

    def crossing_at(self) -> float:
        """Seconds after start when the greedy pod's usage first exceeds its limit."""
        return crossing_seconds()


def _tenants() -> list[Pod]:
    """Act one's pods: the greedy one first, then those that must survive."""
    return [
        sim_pod(
            GREEDY_UID,
            "ml-team",
            "trainer-greedy",
            containers={GREEDY_CONTAINER: "trainer"},
            limit="20Gi",
        ),
        sim_pod(
            "1c7b5f1f-2d3e-4f40-9bac-1d2e3f4a5b6c",
            "ml-team",
            "notebook-neighbour",
            containers={"b" * 64: "jupyter"},
            limit="16Gi",
        ),
        sim_pod(
            "2d8c6020-3e4f-4051-acbd-2e3f4a5b6c7d",
            "research",
            "inference-default",
            containers={"c" * 64: "server"},
        ),
        sim_pod(
            "3e9d7131-4f50-4162-bdce-3f4a5b6c7d8e",
            "platform",
            "exempt-benchmark",
            containers={"d" * 64: "bench"},
            limit="4Gi",
        ),
        # Declared the way KAI-Scheduler and HAMi users declare GPU memory, and enforced
        # because the demo's limits.sources lists both (docs/design.md, Limit sources).
        sim_pod(
            "4fae8242-5061-4273-8edf-4a5b6c7d8e9f",
            "ml-team",
            "kai-finetune",
            containers={"e" * 64: "finetune"},
            annotations={"gpu-memory": "12288"},
        ),
        sim_pod(
            "50bf9353-6172-4384-9fe0-5b6c7d8e9fa0",
            "ml-team",
            "hami-embedder",
            containers={"f" * 64: "embedder"},
            resource_limits={"embedder": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 6144}},
        ),
    ]


def build_scenario(clock: Clock) -> Scenario:
    """Two GPUs; a greedy pod and its neighbour on GPU 0; four more tenants and a host process
    on GPU 1."""
    node = SimNode(clock=clock, node_name="demo-node", gpus=[sim_gpu(0), sim_gpu(1)])
    pods = _tenants()
    for pod in pods:
        node.add_pod(pod)
    greedy_usage = ramp(GREEDY_FROM, GREEDY_TO, from_s=GREEDY_RAMP[0], to_s=GREEDY_RAMP[1])
    # One process per pod: (GPU, the pod's first container, its memory over time).
    placements = [
        (0, greedy_usage),
        (0, steady(10 * GiB)),
        (1, steady(12 * GiB)),
        (1, steady(12 * GiB)),
        (1, steady(9 * GiB)),
        (1, steady(5 * GiB)),
    ]
    for n, (pod, (gpu, usage)) in enumerate(zip(pods, placements, strict=True)):
        node.add_process(
            SimProcess(
                pid=41001 + n,
                start_ticks=9001 + n,
                gpu=gpu,
                pod_uid=pod.uid,
                container_id=next(iter(pod.containers)),
                usage=usage,
            )
        )
    node.add_process(SimProcess(pid=2187, start_ticks=120, gpu=1, usage=steady(6 * GiB)))
    return Scenario(
        node=node,
        greedy_pid=41001,
        protected={
            41002: "ml-team/notebook-neighbour (within its limit)",
            41003: "research/inference-default (namespace default)",
            41004: "platform/exempt-benchmark (exempt namespace)",
            41005: "ml-team/kai-finetune (within its KAI gpu-memory)",
            41006: "ml-team/hami-embedder (within its HAMi nvidia.com/gpumem)",
            2187: "host process without a pod",
        },
    )


def demo_policy() -> EnforcementPolicy:
    """Enforce mode; ``research`` has a namespace default; ``platform`` is exempt; KAI's and
    HAMi's declarations are limit sources after the annotation."""
    return EnforcementPolicy(
        mode=Mode.ENFORCE,
        grace_seconds=GRACE_SECONDS,
        termination_timeout_seconds=TERM_TIMEOUT_SECONDS,
        staleness_seconds=STALENESS_SECONDS,
        limits=LimitPolicy(
            namespaces={
                "research": NamespacePolicy(default_limit=LimitValue(limit_bytes=24 * GiB))
            },
            exempt_namespaces=frozenset({"kube-system", "platform"}),
            sources=("gpuguard", "kai", "hami"),
        ),
    )


# -- act two: the sharing agent on a simulated cluster (docs/design.md, Sharing config) ------------

AGENT_INTERVAL_SECONDS = 0.25
AGENT_WRITE_INTERVAL_SECONDS = 0.5
TRAINING_SECONDS = 2.0
"""The A100 node's training pod finishes this long into act two: until then its MIG change
waits (``WhenIdle``)."""
MIG_APPLY_SECONDS = 1.0
"""How long the simulated mig-manager stays ``pending`` before ``success``."""
ACT_TWO_MAX_SECONDS = 8.0
"""Act two ends once every agent has nothing left to do or wait for, at the latest after this."""

INSTANCE_TYPE = "node.kubernetes.io/instance-type"
GPU_PRODUCT = "nvidia.com/gpu.product"
GPU_PRESENT = "nvidia.com/gpu.present"
A100_NODE = "gpu-a100-1"
TRAINING_POD = PodRef(
    uid=PodUid("4fae8242-5a61-4b72-8cdf-4a5b6c7d8e9f"), namespace="ml-team", name="train-a100"
)
NOTEBOOK_POD = PodRef(
    uid=PodUid("5abf9353-6b72-4c83-9de0-5b6c7d8e9fa0"), namespace="ml-team", name="notebook-t4"
)
DEVICE_PLUGIN_PROFILES = frozenset({"default", "slice-2", "slice-4"})
"""The device plugin ConfigMap's data keys (the time-slicing profiles the config may name)."""
MIG_PROFILES = frozenset({"all-disabled", "all-1g.10gb", "all-3g.40gb"})
"""mig-parted's ``mig-configs`` names."""


def sharing_config(policy: str = "WhenIdle") -> dict[str, Any]:
    """The ``gpuguard-sharing`` document of act two (docs/design.md, Sharing config). The last rule
    matches every GPU node: each node must get its *first* matching rule's labels, never that
    one's."""
    return {
        "version": "v1",
        "devicePluginConfig": {"namespace": "gpu-operator", "name": "nvidia-time-slicing-config"},
        "migConfig": {"namespace": "gpu-operator", "name": "nvidia-mig-config"},
        "migChangePolicy": policy,
        "rules": [
            {
                "name": "t4-shared",
                "nodeSelector": {"matchLabels": {INSTANCE_TYPE: "g4dn.12xlarge"}},
                "timeSlicing": "slice-4",
            },
            {
                "name": "a100-mig",
                "nodeNames": [A100_NODE],
                "mig": "all-1g.10gb",
                "timeSlicing": "slice-2",
            },
            {
                "name": "other-gpus",
                "nodeSelector": {"matchLabels": {GPU_PRESENT: "true"}},
                "timeSlicing": "default",
            },
        ],
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Expected:
    """What a Node must end with: its first matching rule and exactly that rule's labels."""

    rule: str | None
    labels: dict[str, str | None]
    """Both sharing labels; ``None``: absent."""


EXPECTED = {
    "gpu-t4-1": Expected(
        rule="t4-shared", labels={DEVICE_PLUGIN_CONFIG_LABEL: "slice-4", MIG_CONFIG_LABEL: None}
    ),
    "gpu-t4-2": Expected(
        rule="t4-shared", labels={DEVICE_PLUGIN_CONFIG_LABEL: "slice-4", MIG_CONFIG_LABEL: None}
    ),
    A100_NODE: Expected(
        rule="a100-mig",
        labels={DEVICE_PLUGIN_CONFIG_LABEL: "slice-2", MIG_CONFIG_LABEL: "all-1g.10gb"},
    ),
}


def build_cluster(
    clock: Clock, *, training_seconds: float | None = TRAINING_SECONDS, policy: str = "WhenIdle"
) -> SimCluster:
    """Two T4 nodes (``g4dn.12xlarge``; the second already labelled, the first running a
    notebook on its GPU) and an A100 node with MIG disabled, training until
    ``training_seconds`` (``None``: it never finishes)."""
    cluster = SimCluster(
        clock=clock,
        sharing=sharing_config(policy),
        device_plugin_profiles=DEVICE_PLUGIN_PROFILES,
        mig_profiles=MIG_PROFILES,
        mig_apply_seconds=MIG_APPLY_SECONDS,
    )
    t4 = {INSTANCE_TYPE: "g4dn.12xlarge", GPU_PRODUCT: "Tesla-T4", GPU_PRESENT: "true"}
    cluster.add_node("gpu-t4-1", t4)
    cluster.add_node("gpu-t4-2", {**t4, DEVICE_PLUGIN_CONFIG_LABEL: "slice-4"})
    cluster.add_node(
        A100_NODE,
        {
            INSTANCE_TYPE: "p4de.24xlarge",
            GPU_PRODUCT: "NVIDIA-A100-SXM4-80GB",
            GPU_PRESENT: "true",
            MIG_CONFIG_LABEL: "all-disabled",
            MIG_CONFIG_STATE_LABEL: "success",
        },
    )
    cluster.add_gpu_pod("gpu-t4-1", NOTEBOOK_POD)
    cluster.add_gpu_pod(A100_NODE, TRAINING_POD, finishes_at=training_seconds)
    return cluster
