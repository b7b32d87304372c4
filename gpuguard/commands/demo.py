"""``gpuguard demo``: the real enforcer and sharing agent on simulated nodes (docs/design.md, CLI
outputs).

Owns the demo's two acts, its live view and its summary. Runs the real core, runtime and metrics
over ``gpuguard.sim``: no root, no GPU, no cluster. Act one: the enforcer on one node for
``--duration`` seconds (at least ``minimum_duration_seconds()``, from act one's script: the command
line refuses less). Act two (a few seconds): one sharing agent per Node of a simulated
cluster labels each Node from a sharing config and holds a MIG change until its Node is idle.
Exit 0 only if the scenario's expectations held: the offender was stopped within grace + 2 polls
of crossing its limit and nobody else was signalled; every Node got exactly the labels of its
first matching rule, the mig label was never written while a GPU pod was on the Node or while
mig-manager was busy, and nothing but the two sharing labels was written. With
``--metrics-port`` the enforcer's metrics and the sharing agent's (the real
``PrometheusAgentRecorder`` of one simulated Node, on the same registry) are served while the
demo runs.
"""

from __future__ import annotations

import asyncio
import math
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import structlog
from prometheus_client import CollectorRegistry
from rich.cells import cell_len
from rich.console import RenderableType

from gpuguard.adapters.metrics import PrometheusAgentRecorder
from gpuguard.app import build_telemetry
from gpuguard.core.model import (
    ContainerId,
    EnforcementPolicy,
    KillTarget,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    PodEvent,
    PodRef,
    PodUid,
    SignalReport,
    StopSignal,
)
from gpuguard.core.policy import Decision, PodUsage, UsageState
from gpuguard.core.reconcile import (
    MIG_CONFIG_STATE_LABEL,
    NodeEventReason,
    ReconcileError,
    WaitReason,
)
from gpuguard.core.sharing import DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL, SHARING_LABELS
from gpuguard.ports import AgentRecorder, Clock, MetricsRecorder, Publisher
from gpuguard.runtime.agent import Agent, AgentOptions, TurnReport
from gpuguard.runtime.clock import SystemClock
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.sim import (
    GiB,
    SimAgentRecorder,
    SimCluster,
    SimHappening,
    SimNode,
    SimNodeEventSink,
    SimProcess,
    SimSharingSource,
    ramp,
    sim_gpu,
    sim_pod,
    steady,
)

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
    from rich.live import Live

log = structlog.get_logger("gpuguard.demo")

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
    and the demo could only fail, so the command line refuses it (``cli``)."""
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
class _Scenario:
    node: SimNode
    greedy_pid: int
    protected: dict[int, str]
    """PID → who must survive (neighbour, default-limited pod, exempt pod, host process)."""

    def crossing_at(self) -> float:
        """Seconds after start when the greedy pod's usage first exceeds its limit."""
        return crossing_seconds()


def build_scenario(clock: Clock) -> _Scenario:
    """Two GPUs; a greedy pod and its neighbour on GPU 0; three more tenants on GPU 1."""
    node = SimNode(clock=clock, node_name="demo-node", gpus=[sim_gpu(0), sim_gpu(1)])
    pods = [
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
    return _Scenario(
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


@dataclass(slots=True)
class _Feed:
    """What the live view shows besides the table."""

    lines: list[str] = field(default_factory=list)

    def add(self, t: float, text: str) -> None:
        self.lines.append(f"[{t:5.2f}s] {text}")
        del self.lines[:-8]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Stop:
    """The last signal a pod's container received on one GPU, and what it used then."""

    signal: StopSignal
    at: float
    gpu_index: int
    used_bytes: int
    limit_bytes: int


@dataclass(slots=True)
class _Seen:
    """What act one has seen of each (pod, GPU): its last usage and its last stop. A pod's row
    keeps its GPU, usage, limit and source once its processes are gone (the live table), and
    the summary's ``limits`` still names a pod that was stopped before the last cycle."""

    usages: dict[tuple[str, int], PodUsage] = field(default_factory=dict)
    stops: dict[tuple[str, int], _Stop] = field(default_factory=dict)

    def update(self, decision: Decision) -> None:
        for u in decision.usages:
            self.usages[(_who(u.pod), u.device.index)] = u


def _who(pod: PodRef) -> str:
    return f"{pod.namespace}/{pod.name}"


class _DemoKiller:
    """The simulated node's killer, narrated in the live view as each signal goes out."""

    def __init__(self, node: SimNode, feed: _Feed, seen: _Seen) -> None:
        self._node = node
        self._feed = feed
        self._seen = seen

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        report = self._node.signal_container(target, signal, wait_seconds=wait_seconds)
        if report.delivered:
            who = _who(target.pod)
            at = self._node.elapsed()
            self._seen.stops[(who, target.gpu_index)] = _Stop(
                signal=signal,
                at=at,
                gpu_index=target.gpu_index,
                used_bytes=target.used_bytes,
                limit_bytes=target.limit_bytes,
            )
            self._feed.add(
                at,
                f"{signal.value} → {who} container {target.container_name} "
                f"({_gib(target.used_bytes).strip()} > {_gib(target.limit_bytes).strip()})",
            )
        return report


class _EventLog:
    """EventSink for the demo: keeps the Events and logs them as the real sink would."""

    def __init__(self, node: SimNode, feed: _Feed) -> None:
        self._node = node
        self._feed = feed

    def post(self, event: PodEvent) -> None:
        self._node.post(event)
        self._feed.add(
            self._node.elapsed(),
            f"Event {event.reason.value} on {event.pod.namespace}/{event.pod.name}",
        )
        log.info(
            "event_posted",
            reason=event.reason.value,
            namespace=event.pod.namespace,
            pod=event.pod.name,
            message=event.message,
        )


def build_enforcer(
    scenario: _Scenario,
    *,
    feed: _Feed,
    seen: _Seen,
    recorder: MetricsRecorder,
    publisher: Publisher,
    clock: Clock,
) -> Enforcer:
    """Act one's real enforcer over the scenario's node, its signals and Events narrated."""
    node = scenario.node
    return Enforcer(
        gpu=node,
        resolver=node,
        pods=node,
        killer=_DemoKiller(node, feed, seen),
        events=_EventLog(node, feed),
        recorder=recorder,
        publisher=publisher,
        clock=clock,
        policy=demo_policy(),
        poll_interval_seconds=POLL_SECONDS,
    )


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:5.1f} GiB"


def _used_of_limit(used_bytes: int | None, limit_bytes: int | None) -> str:
    """``used / limit`` in GiB (the column header names the unit), ``-`` for unknown."""
    return " / ".join("-" if n is None else f"{n / GiB:.1f}" for n in (used_bytes, limit_bytes))


def _fit_widths(columns: Sequence[Sequence[str]], available: int) -> list[int]:
    """Content widths for columns of plain-text cells (header first, then one per row) summing
    to at most ``available``: each column as wide as its longest line if they all fit; else
    narrowed one cell at a time where the table grows the fewest lines (the widest first),
    never below its longest word; only when the longest words alone do not fit, narrower."""
    widths = [
        max(1, *(cell_len(line) for cell in col for line in cell.splitlines())) for col in columns
    ]
    words = [max(1, *(cell_len(w) for cell in col for w in cell.split())) for col in columns]

    def height(widths: list[int]) -> int:
        return sum(
            max(_wrapped_lines(col[r], w) for col, w in zip(columns, widths, strict=True))
            for r in range(len(columns[0]))
        )

    def narrowed(i: int) -> list[int]:
        return [w - 1 if j == i else w for j, w in enumerate(widths)]

    while sum(widths) > available:
        narrowable = [i for i, w in enumerate(widths) if w > words[i]]
        if not narrowable:
            break
        i = min(narrowable, key=lambda i: (height(narrowed(i)), -widths[i]))
        widths = narrowed(i)
    while sum(widths) > available and max(widths) > 1:
        widths[widths.index(max(widths))] -= 1
    return widths


def _wrapped_lines(text: str, width: int) -> int:
    """How many lines ``text`` takes wrapped between words at ``width`` cells (a longer word
    folded)."""
    lines = 0
    for line in text.splitlines() or [""]:
        used = 0
        lines += 1
        for word in line.split():
            n = cell_len(word)
            if used and used + 1 + n <= width:
                used += 1 + n
                continue
            if used:
                lines += 1
            lines += (n - 1) // width
            used = (n - 1) % width + 1
    return lines


@dataclass(slots=True, kw_only=True)
class _Grid:
    """A table whose columns fit the console it is drawn on. Left to itself rich narrows the
    widest column first and cuts what no longer fits with "…": at 80 columns, pod, source and
    node names. Here no name or value is cut at 80 columns (``_fit_widths``: long cells wrap
    between words), and on a narrower console a word too long for its column folds onto the
    next line (``overflow="fold"``): nothing is ever cut."""

    title: str
    headers: tuple[str, ...]
    rows: list[tuple[str, ...]]
    """Rich markup, one cell per header."""
    right: frozenset[int] = frozenset()
    """Columns justified right."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(
            title=self.title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True
        )
        # Between two columns: a cell of padding, the separator, a cell of padding; none at the
        # edges (show_edge and pad_edge off).
        overhead = 3 * (len(self.headers) - 1)
        plain = [
            [header, *(Text.from_markup(row[i]).plain for row in self.rows)]
            for i, header in enumerate(self.headers)
        ]
        widths = _fit_widths(plain, options.max_width - overhead)
        for i, (header, width) in enumerate(zip(self.headers, widths, strict=True)):
            justify: JustifyMethod = "right" if i in self.right else "left"
            table.add_column(header, width=width, overflow="fold", justify=justify)
        for row in self.rows:
            table.add_row(*row)
        yield table


_STATE_STYLES = {
    UsageState.OK: "green",
    UsageState.OVER: "bold red",
    UsageState.STOPPING: "bold yellow",
    UsageState.EXEMPT: "cyan",
}


def _node_table(
    decision: Decision | None, elapsed: float, duration: float, feed: _Feed, seen: _Seen
) -> RenderableType:
    """Act one's live view: a row per pod and GPU, then one per GPU for memory no pod holds. A
    pod whose processes are gone keeps its row with what it used when it was stopped (or when
    last seen), never a row of "-"."""
    from rich.console import Group
    from rich.panel import Panel

    rows: list[tuple[tuple[int, str], tuple[str, ...]]] = []
    shown: set[tuple[str, int]] = set()
    for u in decision.usages if decision is not None else ():
        key = (_who(u.pod), u.device.index)
        shown.add(key)
        style = _STATE_STYLES.get(u.state)
        state = f"[{style}]{u.state.value}[/]" if style else u.state.value
        rows.append(((u.device.index, key[0]), _pod_cells(key, u, u.used_bytes, state)))
    for key in sorted({*seen.usages, *seen.stops} - shown):
        last, stop = seen.usages.get(key), seen.stops.get(key)
        if stop is not None:
            cells = _pod_cells(
                key,
                last,
                stop.used_bytes,
                f"[bold yellow]stopped ({stop.signal.value})[/]",
                limit_bytes=stop.limit_bytes,
            )
        else:
            assert last is not None
            cells = _pod_cells(key, last, last.used_bytes, "[dim]gone (last seen)[/]")
        rows.append(((key[1], key[0]), cells))
    rows.sort(key=lambda r: r[0])
    grid_rows = [cells for _, cells in rows]
    unattributed = decision.unattributed_bytes if decision is not None else {}
    devices = decision.devices if decision is not None else ()
    for device, n in sorted(unattributed.items(), key=lambda kv: kv[0].uuid):
        if n:
            idx = next((str(d.index) for d in devices if d.key == device), "?")
            grid_rows.append(
                (
                    "[dim](no pod: host or unattributed)[/]",
                    idx,
                    _used_of_limit(n, None),
                    "-",
                    "[dim]never signalled[/]",
                )
            )
    table = _Grid(
        title=f"gpuguard demo — act one: the enforcer on a simulated node, "
        f"t={elapsed:5.2f}s / {duration:g}s",
        headers=("pod", "GPU", "used / limit GiB", "source", "state"),
        rows=grid_rows,
        right=frozenset({2}),
    )
    return Group(table, Panel("\n".join(feed.lines) or "no action yet", title="actions"))


def _pod_cells(
    key: tuple[str, int],
    usage: PodUsage | None,
    used_bytes: int,
    state: str,
    *,
    limit_bytes: int | None = None,
) -> tuple[str, ...]:
    limit = usage.limit if usage is not None else None
    if limit_bytes is None and limit is not None:
        limit_bytes = limit.limit_bytes
    source = limit.source.value if limit is not None and limit.source is not None else "-"
    return (key[0], str(key[1]), _used_of_limit(used_bytes, limit_bytes), source, state)


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


@dataclass(slots=True, kw_only=True)
class _NodeAgent:
    agent: Agent
    source: SimSharingSource
    events: SimNodeEventSink
    recorder: SimAgentRecorder
    last: TurnReport | None = None


_WAITING_TEXT = {
    WaitReason.GPU_PODS: "holds {label}={value} until {pods} pod(s) holding a GPU finish",
    WaitReason.MIG_APPLYING: "waits for mig-manager to apply {label}={value} (state {state})",
    WaitReason.MIG_STATE_BUSY: "holds {label}={value} while mig-manager is busy ({state})",
    WaitReason.CORDON: "holds {label}={value} until the node is cordoned",
    WaitReason.NVIDIA_CONFIG_MISSING: (
        "holds {label}={value}: the NVIDIA ConfigMap that defines it cannot be read"
    ),
}


class _BothRecorders:
    """``ports.AgentRecorder``: the demo's ``SimAgentRecorder`` (what the checks read) and a
    real one (what ``/metrics`` shows), told the same."""

    def __init__(self, kept: SimAgentRecorder, shown: AgentRecorder) -> None:
        self._recorders: tuple[AgentRecorder, ...] = (kept, shown)

    def show_labels(
        self, *, rule: str | None, device_plugin_config: str | None, mig_config: str | None
    ) -> None:
        for r in self._recorders:
            r.show_labels(
                rule=rule, device_plugin_config=device_plugin_config, mig_config=mig_config
            )

    def count_reconcile_error(self, reason: ReconcileError) -> None:
        for r in self._recorders:
            r.count_reconcile_error(reason)

    def set_waiting(self, reason: WaitReason | None) -> None:
        for r in self._recorders:
            r.set_waiting(reason)


class SharingAct:
    """Act two: one real ``runtime.agent.Agent`` per Node of a ``SimCluster``, a turn each per
    ``tick()``, narrated; then the expectations (``checks()``) and the summary. ``metrics``:
    Node name → a real recorder told what that Node's agent records, too."""

    def __init__(
        self,
        cluster: SimCluster,
        *,
        clock: Clock,
        feed: _Feed | None = None,
        feed_time: Callable[[], float] | None = None,
        expected: dict[str, Expected] | None = None,
        waits_for_gpu_pods: str | None = A100_NODE,
        metrics: Mapping[str, AgentRecorder] | None = None,
    ) -> None:
        self.cluster = cluster
        self.feed = feed if feed is not None else _Feed()
        self._now = feed_time or cluster.elapsed
        self.started_at = self.now()
        """When the act started, on ``now()``'s clock."""
        self.expected = EXPECTED if expected is None else expected
        self._waits_for_gpu_pods = waits_for_gpu_pods
        options = AgentOptions(
            interval_seconds=AGENT_INTERVAL_SECONDS,
            min_write_interval_seconds=AGENT_WRITE_INTERVAL_SECONDS,
        )
        self.nodes: dict[str, _NodeAgent] = {}
        for name in cluster.node_names():
            source = cluster.source(name)
            events = SimNodeEventSink(node=name)
            recorder = SimAgentRecorder()
            shown = (metrics or {}).get(name)
            agent = Agent(
                source=source,
                writer=cluster.writer(name),
                events=events,
                recorder=recorder if shown is None else _BothRecorders(recorder, shown),
                clock=clock,
                options=options,
            )
            self.nodes[name] = _NodeAgent(
                agent=agent, source=source, events=events, recorder=recorder
            )
        self.narration: list[str] = []

    def now(self) -> float:
        """Seconds on the clock the narration is stamped with: ``feed_time``, in ``gpuguard
        demo`` the demo's (started with act one's node), else the cluster's."""
        return self._now()

    async def tick(self) -> None:
        """The world moves on (pods finish, mig-manager reacts), then each agent takes a turn."""
        for happening in self.cluster.step():
            self._narrate_happening(happening)
        for name, node in self.nodes.items():
            with structlog.contextvars.bound_contextvars(node=name):
                report = await node.agent.turn()
            self._narrate_turn(name, node, report)
            node.last = report

    def settled(self) -> bool:
        """Every agent's last turn wrote nothing, held nothing back and waits for nothing, and
        mig-manager is idle."""
        for name, node in self.nodes.items():
            report = node.last
            if report is None or not report.synced or report.patched or report.held:
                return False
            if report.decision is not None and report.decision.waiting is not None:
                return False
            if self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL) in ("pending", "rebooting"):
                return False
        return not self.cluster.mig_manager.busy

    # -- narration ----------------------------------------------------------------------------

    def _say(self, node: str, text: str) -> None:
        self.narration.append(text)
        at = self.now()
        self.feed.add(at, text)
        log.info("demo_narration", act="sharing", node=node, text=text, at_seconds=round(at, 3))

    def _narrate_happening(self, h: SimHappening) -> None:
        if h.kind == "pod_finished":
            self._say(h.node, f"pod {h.detail} finished on {h.node}: its GPU is free")
        elif h.kind == "mig_state":
            self._say(h.node, f"mig-manager: {h.node} {MIG_CONFIG_STATE_LABEL}={h.detail}")

    def _narrate_turn(self, name: str, node: _NodeAgent, report: TurnReport) -> None:
        if report.patched is not None:
            changes = ", ".join(f"{k}={v}" for k, v in sorted(report.patched.labels.items()))
            cordon = report.patched.cordon
            what = changes + (f", {cordon.value}" if cordon is not None else "")
            self._say(name, f"agent: {name} applied {what} (rule {report.rule})")
        before = node.last.decision.waiting if node.last and node.last.decision else None
        waiting = report.decision.waiting if report.decision else None
        if waiting is None or waiting == before or report.decision is None:
            return
        track = report.decision.state.labels.get(MIG_CONFIG_LABEL)
        text = _WAITING_TEXT[waiting].format(
            label=MIG_CONFIG_LABEL,
            value=track.value if track is not None else "?",
            pods=len(node.source.inputs().gpu_pods),
            state=self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL),
        )
        self._say(name, f"agent: {name} {text}")

    # -- the verdict --------------------------------------------------------------------------

    def final_labels(self, name: str) -> dict[str, str | None]:
        labels = self.cluster.labels(name)
        return {label: labels.get(label) for label in SHARING_LABELS}

    def checks(self) -> dict[str, bool]:
        writes = self.cluster.writes
        mig_writes = [w for w in writes if MIG_CONFIG_LABEL in w.labels]
        waited = True
        if self._waits_for_gpu_pods is not None:
            node = self.nodes[self._waits_for_gpu_pods]
            waited = WaitReason.GPU_PODS in node.recorder.waited and any(
                e.reason is NodeEventReason.MIG_CHANGE_WAITING for e in node.events.events
            )
        return {
            "agent_labels_match_first_rule": all(
                self.final_labels(name) == want.labels
                and self.nodes[name].recorder.rule == want.rule
                for name, want in self.expected.items()
            ),
            "agent_mig_label_never_written_with_gpu_pods": all(w.gpu_pods == 0 for w in mig_writes),
            "agent_mig_label_never_written_while_mig_busy": all(
                w.mig_state not in ("pending", "rebooting") for w in mig_writes
            ),
            "agent_wrote_only_the_two_labels": all(
                set(w.labels) <= set(SHARING_LABELS) for w in writes
            ),
            "agent_wrote_only_changes": all(
                w.labels_before.get(k) != v for w in writes for k, v in w.labels.items()
            ),
            "agent_waited_for_gpu_pods": waited,
            "mig_changes_succeeded": all(
                self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL) == "success"
                for name, want in self.expected.items()
                if want.labels.get(MIG_CONFIG_LABEL) is not None
            ),
        }

    def summary(self) -> dict[str, Any]:
        """The act for the demo's JSON summary. ``seconds`` and each write's ``at_seconds`` are
        on the act's own clock (0 when it started); ``started_at_seconds`` is when it started
        on ``now()``'s, the clock of the narration and of act one's ``signals``."""
        nodes = []
        for name, node in self.nodes.items():
            nodes.append(
                {
                    "name": name,
                    "rule": node.recorder.rule,
                    "labels": self.final_labels(name),
                    "mig_state": self.cluster.labels(name).get(MIG_CONFIG_STATE_LABEL),
                    "waited": [w.value for w in node.recorder.waited],
                    "writes": sum(1 for w in self.cluster.writes if w.node == name),
                }
            )
        return {
            "nodes": nodes,
            "writes": [
                {
                    "at_seconds": round(w.at, 3),
                    "node": w.node,
                    "labels": dict(w.labels),
                    "cordon": w.cordon.value if w.cordon is not None else None,
                    "gpu_pods": w.gpu_pods,
                    "mig_state": w.mig_state,
                }
                for w in self.cluster.writes
            ],
            "events": [
                f"{e.reason.value} {name}: {e.message}"
                for name, node in self.nodes.items()
                for e in node.events.events
            ],
            "seconds": round(self.cluster.elapsed(), 3),
            "started_at_seconds": round(self.started_at, 3),
            "settled": self.settled(),
        }


def _cluster_table(act: SharingAct) -> RenderableType:
    """Act two's live view: a row per Node. Its title's time is the actions' own clock
    (``SharingAct.now()``, the demo's), not the act's: "t= 3.3s" above actions stamped 15 s
    told two stories."""
    from rich.console import Group
    from rich.panel import Panel

    rows: list[tuple[str, ...]] = []
    for name, node in act.nodes.items():
        labels = act.cluster.labels(name)
        report = node.last
        waiting = report.decision.waiting if report and report.decision else None
        if waiting is not None:
            agent = f"[bold yellow]waiting: {waiting.value}[/]"
        elif report is not None and report.patched is not None:
            agent = "[cyan]writing[/]"
        else:
            agent = "[green]in sync[/]"
        mig, state = labels.get(MIG_CONFIG_LABEL, "-"), labels.get(MIG_CONFIG_STATE_LABEL)
        rows.append(
            (
                name,
                (report.rule or "-") if report is not None else "-",
                labels.get(DEVICE_PLUGIN_CONFIG_LABEL, "-"),
                mig if state is None else f"{mig} ({state})",
                str(len(act.cluster.gpu_pods(name))),
                agent,
            )
        )
    table = _Grid(
        title=f"gpuguard demo — act two: the sharing agent on {len(act.nodes)} simulated "
        f"nodes, t={act.now():5.2f}s",
        headers=("node", "rule", "device-plugin config", "mig config (state)", "GPU pods", "agent"),
        rows=rows,
    )
    return Group(table, Panel("\n".join(act.feed.lines) or "no action yet", title="actions"))


async def _act_two(
    act: SharingAct, *, clock: Clock, on_tick: Callable[[], None] | None = None
) -> None:
    """Turn the agents until they settle, at most ``ACT_TWO_MAX_SECONDS``."""
    t_end = clock.monotonic() + ACT_TWO_MAX_SECONDS
    while clock.monotonic() < t_end:
        started = clock.monotonic()
        await act.tick()
        if on_tick is not None:
            on_tick()
        if act.settled():
            return
        await asyncio.sleep(max(0.0, AGENT_INTERVAL_SECONDS - (clock.monotonic() - started)))


async def _run(duration: float, *, live: bool, metrics_port: int | None, out: TextIO) -> int:
    clock = SystemClock()
    scenario = build_scenario(clock)
    node = scenario.node
    feed = _Feed()
    telemetry = build_telemetry(hostname="demo-node")
    recorder, collector = telemetry.recorder, telemetry.collector
    # The A100 node's agent metrics on the same registry, from the start (every reason of the
    # error counter and the waiting gauge at 0), so a scrape sees gpuguard_sharing_* change.
    agent_metrics = PrometheusAgentRecorder(telemetry.registry, node=A100_NODE)
    server = None
    if metrics_port is not None:
        server = telemetry.server(host="127.0.0.1", port=metrics_port)
        server.start()
        log.info("metrics_serving", url=f"http://127.0.0.1:{server.port}/metrics")
    seen = _Seen()
    enforcer = build_enforcer(
        scenario, feed=feed, seen=seen, recorder=recorder, publisher=collector, clock=clock
    )
    log.info(
        "demo_started",
        duration_seconds=duration,
        poll_seconds=POLL_SECONDS,
        grace_seconds=GRACE_SECONDS,
        gpus=2,
        pods=len(node.pods()),
    )
    decision: Decision | None = None
    act: SharingAct | None = None
    view = _live_view(out) if live else None
    try:
        # On the node's clock, as the live view's title and every action are: act one ends
        # at --duration of it, not that long after the setup above.
        while node.elapsed() < duration:
            started = clock.monotonic()
            decision = await enforcer.cycle()
            seen.update(decision)
            if view is not None:
                view.update(_node_table(decision, node.elapsed(), duration, feed, seen))
            await asyncio.sleep(max(0.0, POLL_SECONDS - (clock.monotonic() - started)))
        if view is not None:
            view.stop()  # act one's last table stays on screen; act two gets its own
            view.console.line()
            view = _live_view(out)
        act = SharingAct(
            build_cluster(clock),
            clock=clock,
            feed=feed,
            feed_time=node.elapsed,
            metrics={A100_NODE: agent_metrics},
        )
        log.info(
            "demo_sharing_started",
            at_seconds=round(act.started_at, 3),
            nodes=len(act.nodes),
            agent_interval_seconds=AGENT_INTERVAL_SECONDS,
            mig_change_policy="WhenIdle",
        )
        shown = view
        await _act_two(
            act,
            clock=clock,
            on_tick=None if shown is None else lambda: shown.update(_cluster_table(act)),
        )
    finally:
        if view is not None:
            view.stop()
        if server is not None:
            server.stop()
    assert act is not None
    return _summarize(scenario, act, seen, telemetry.registry, live=live, out=out)


def _live_view(out: TextIO) -> Live:
    from rich.console import Console
    from rich.live import Live

    view = Live(console=Console(file=out), refresh_per_second=8, transient=False)
    view.start()
    return view


def _summarize(
    scenario: _Scenario,
    act: SharingAct,
    seen: _Seen,
    registry: CollectorRegistry,
    *,
    live: bool,
    out: TextIO,
) -> int:
    node = scenario.node
    greedy = node.process(scenario.greedy_pid)
    first_signal = next((s for s in node.signals if s.pid == scenario.greedy_pid), None)
    wrong = [s for s in node.signals if s.container_id != GREEDY_CONTAINER]
    crossing = scenario.crossing_at()
    budget = GRACE_SECONDS + 2 * POLL_SECONDS
    latency = None if first_signal is None else first_signal.at - crossing
    kills = int(registry.get_sample_value("gpuguard_kills_total") or 0)
    survivors_ok = all(node.process(pid).alive for pid in scenario.protected)
    checks = {
        "offender_stopped": first_signal is not None and not greedy.alive,
        "within_grace_plus_two_polls": latency is not None and latency <= budget + SLACK_SECONDS,
        "nobody_else_signalled": not wrong,
        "protected_processes_alive": survivors_ok,
        **act.checks(),
    }
    ok = all(checks.values())
    summary = {
        "kills": kills,
        "wrong_kills": len(wrong),
        "signals": [
            {"pid": s.pid, "signal": s.signal.value, "at_seconds": round(s.at, 3)}
            for s in node.signals
        ],
        "crossing_at_seconds": round(crossing, 3),
        "first_signal_at_seconds": None if first_signal is None else round(first_signal.at, 3),
        "crossing_to_signal_seconds": None if latency is None else round(latency, 3),
        "budget_seconds": budget,
        "events": [f"{e.reason.value} {e.pod.namespace}/{e.pod.name}" for e in node.events],
        # Every pod act one saw, the stopped one too (its last cycle is before the last one).
        "limits": {
            who: {
                "limit_bytes": u.limit.limit_bytes,
                "source": None if u.limit.source is None else u.limit.source.value,
            }
            for (who, _), u in seen.usages.items()
        },
        "agent": act.summary(),
        "checks": checks,
        "passed": ok,
    }
    if live:
        verdict = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
        from rich.console import Console

        console = Console(file=out)
        console.print(f"\n{verdict}  kills={kills} wrong_kills={len(wrong)}")
        if latency is not None:
            console.print(
                f"offender crossed its limit at {crossing:.2f}s, first SIGTERM "
                f"{latency:.2f}s later (budget: grace {GRACE_SECONDS}s + 2 polls = "
                f"{budget:.2f}s)"
            )
        for pid, who in scenario.protected.items():
            alive = node.process(pid).alive
            console.print(f"  {'✓' if alive else '✗'} {who}: {'alive' if alive else 'KILLED'}")
        for name in act.nodes:
            labels = ", ".join(f"{k}={v}" for k, v in act.final_labels(name).items() if v)
            console.print(f"  {name}: {labels or 'no sharing labels'}")
        for name, passed in checks.items():
            console.print(f"  {'✓' if passed else '✗'} {name}")
    log.info("demo_summary", **summary)
    return 0 if ok else 1


def run_demo(
    *, duration: float, as_json: bool, metrics_port: int | None, out: TextIO | None = None
) -> int:
    """Entry point for ``gpuguard demo``. Returns the exit code."""
    from gpuguard import logs

    stream = out if out is not None else sys.stdout
    if as_json:
        logs.configure(level="info", json=True, stream=stream)
    else:
        logs.configure(level="error", json=False, stream=sys.stderr)
    if metrics_port is not None and metrics_port != 0:
        _check_port(metrics_port)
    live = not as_json
    return asyncio.run(_run(duration, live=live, metrics_port=metrics_port, out=stream))


def _check_port(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            from gpuguard.errors import PermanentError

            raise PermanentError(
                f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror}); "
                "pick a free port or 0 for any"
            ) from exc


__all__ = [
    "EXPECTED",
    "SharingAct",
    "build_cluster",
    "build_enforcer",
    "build_scenario",
    "crossing_seconds",
    "minimum_duration_reason",
    "minimum_duration_seconds",
    "run_demo",
    "sharing_config",
]
