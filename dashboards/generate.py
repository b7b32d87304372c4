"""gpuguard's Grafana dashboard, built with Grafana Labs' typed builders (grafana-foundation-sdk,
pinned in pyproject.toml) and written to ``helm/gpuguard/files/dashboard.json``.

Owns the panels and their PromQL. It must not hand-write dashboard JSON, and must stay
deterministic: the committed JSON is compared with this module's output (tests/test_dashboard.py,
``--check``), and the Go checker in ``dashboards/validate`` reads it with the SDK's Go types.

Labels, per ``gpuguard/adapters/metrics/collectors.py`` (docs/design.md, Metrics):

* per-pod series (``gpuguard_pod_gpu_memory_{used,limit}_bytes``) carry the workload's
  ``namespace``/``pod``/``container``, ``gpu``, ``UUID``, ``GPU_I_ID`` and ``hostname``, and
  dcgm-exporter's ``dra_*`` labels naming the DRA claim of a share on that GPU (empty, so absent,
  otherwise: the tables show them as columns only for such pods);
  ``gpuguard_gpu_memory_unattributed_bytes`` carries ``gpu``, ``UUID``, ``GPU_I_ID`` and
  ``hostname`` and exists for every GPU of every poll that had a GPU sample (0 when all is owned);
  ``gpuguard_gpu_memory_bound_bytes`` carries the same labels and ``bound_by``, every value
  present at 0;
* the counters, the poll histogram and the node gauges carry no pod and no host label (only
  ``reason`` where noted): a scrape adds the target's ``job``/``instance`` (on a ServiceMonitor
  also gpuguard's *own* ``namespace``/``pod``), so they are grouped by ``job, instance`` and
  named by joining that target with its unattributed-memory series, which carry ``hostname``;
* the agent's ``gpuguard_sharing_labels_info`` names its ``node``; its other series do not.

dcgm-exporter's per-GPU series are joined on ``UUID`` only, never on its host label
(``Hostname`` before 4.6, ``hostname`` since).

Usage: ``python dashboards/generate.py`` writes the JSON; ``--check`` exits 1 when the
committed file differs; ``--stdout`` prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Final

with warnings.catch_warnings():
    # grafana-foundation-sdk 0.0.21 warns, when its v1 dashboard model is imported, that
    # dashboardv2 is preferred. The v1 JSON model (schemaVersion 42) is what Grafana's file
    # provisioning and kube-prometheus-stack's dashboard sidecar load, so it stays.
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import (
        bargauge,
        common,
        prometheus,
        stat,
        statetimeline,
        table,
        timeseries,
    )
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as common_models
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as prometheus_models
    from grafana_foundation_sdk.models.common import DataSourceRef

ROOT: Final = Path(__file__).resolve().parent.parent
OUTPUT: Final = ROOT / "helm" / "gpuguard" / "files" / "dashboard.json"

UID: Final = "gpuguard"
DATASOURCE: Final = DataSourceRef(type_val="prometheus", uid="${datasource}")

# -- selectors ------------------------------------------------------------------------------------

POD_SEL: Final = 'hostname=~"$hostname", namespace=~"$namespace"'
"""The workload's series: filtered by both variables."""
HOST_SEL: Final = 'hostname=~"$hostname"'

USED: Final = f"gpuguard_pod_gpu_memory_used_bytes{{{POD_SEL}}}"
LIMIT: Final = f"gpuguard_pod_gpu_memory_limit_bytes{{{POD_SEL}}}"
UNATTRIBUTED: Final = f"gpuguard_gpu_memory_unattributed_bytes{{{HOST_SEL}}}"
BOUND: Final = f"gpuguard_gpu_memory_bound_bytes{{{HOST_SEL}}}"
"""Each GPU's memory by ``bound_by``, every value present at 0."""

_TARGET_HOSTS: Final = f"group by (job, instance, hostname) ({UNATTRIBUTED})"
"""Each enforcer target of the selected hosts, with its ``hostname``."""


def on_host(expr: str) -> str:
    """``expr`` (series of enforcer targets, no host label) with each target's ``hostname``,
    only for the selected hosts; a target with no GPU series (no GPU sample yet, NVML failing)
    is always kept, by ``instance``, so a broken enforcer never disappears from the view."""
    return (
        f"(({expr}) * on (job, instance) group_left (hostname) {_TARGET_HOSTS})"
        f" or (({expr}) unless on (job, instance) gpuguard_gpu_memory_unattributed_bytes)"
    )


def on_agent_node(expr: str) -> str:
    """``expr`` (series of agent targets) with the agent's ``node``, only for the selected hosts;
    an agent that has shown no labels yet is always kept, by ``instance``."""
    nodes = 'group by (job, instance, node) (gpuguard_sharing_labels_info{node=~"$hostname"})'
    return (
        f"(({expr}) * on (job, instance) group_left (node) {nodes})"
        f" or (({expr}) unless on (job, instance) gpuguard_sharing_labels_info)"
    )


DCGM_FB_USED_BYTES: Final = (
    # MiB per GPU, or per MIG instance (GPU_I_ID); with pod mapping dcgm-exporter may repeat a
    # GPU's series once per pod, so take one value per instance before adding them up.
    "sum by (UUID) (max by (UUID, GPU_I_ID) (DCGM_FI_DEV_FB_USED)) * 1048576"
)
DCGM_FB_TOTAL_BYTES: Final = (
    "sum by (UUID) (max by (UUID, GPU_I_ID) (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)) * 1048576"
)
_GPU_HOSTS: Final = f"group by (UUID, hostname) ({UNATTRIBUTED})"
"""Each GPU (by ``UUID``) of the selected hosts, with its ``hostname`` from gpuguard."""

POD_LEGEND: Final = "{{namespace}}/{{pod}} · GPU {{gpu}}{{GPU_I_ID}} · {{hostname}}"
NODE_LEGEND: Final = "{{hostname}} ({{instance}})"


PanelBuilder = bargauge.Panel | stat.Panel | statetimeline.Panel | table.Panel | timeseries.Panel
"""The panel builders this dashboard uses (each a ``Builder[dashboard.Panel]`` with ``id()``)."""

Section = list[tuple[db.Row, list[PanelBuilder]]]

# -- builders -------------------------------------------------------------------------------------


def query(
    expr: str, legend: str, ref_id: str = "A", *, instant: bool = False
) -> prometheus.Dataquery:
    q = (
        prometheus.Dataquery()
        .datasource(DATASOURCE)
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref_id)
    )
    if instant:
        q = q.instant().format(prometheus_models.PromQueryFormat.TABLE)
    return q


def by_reason(counts: str) -> prometheus.Dataquery:
    """``counts`` (a counter's increase, with a ``reason`` label) summed per reason, only the
    reasons that happened: every reason is pre-created at 0."""
    return query(f"sum by (reason) ({counts}) > 0", "{{reason}}")


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in steps])
    )


def legend_table() -> common.VizLegendOptions:
    return (
        common.VizLegendOptions()
        .display_mode(common_models.LegendDisplayMode.TABLE)
        .placement(common_models.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def tooltip_all() -> common.VizTooltipOptions:
    return (
        common.VizTooltipOptions()
        .mode(common_models.TooltipDisplayMode.MULTI)
        .sort(common_models.SortOrder.DESCENDING)
    )


def series(
    title: str, description: str, unit: str, *queries: prometheus.Dataquery
) -> timeseries.Panel:
    return (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(list(queries))
        .unit(unit)
        .legend(legend_table())
        .tooltip(tooltip_all())
        .fill_opacity(10)
        .line_width(1)
    )


def bars(title: str, description: str, *queries: prometheus.Dataquery) -> timeseries.Panel:
    """Counts per interval (increase over ``$__rate_interval``), drawn as stacked bars."""
    return (
        series(title, description, "short", *queries)
        .draw_style(common_models.GraphDrawStyle.BARS)
        .fill_opacity(80)
        .stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
        .decimals(0)
    )


def row(title: str) -> db.Row:
    return db.Row(title).datasource(DATASOURCE)


def section(title: str, *panels: PanelBuilder) -> Section:
    """One row titled ``title`` and the panels under it, in order."""
    return [(row(title), list(panels))]


def states(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    *values: tuple[str, str, str],
) -> statetimeline.Panel:
    """A state timeline of ``target``, each ``(value, text, color)`` of ``values`` shown as its
    text in its color; the values themselves are not drawn."""
    return (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(target)
        .mappings(
            [
                dm.ValueMap(
                    options={
                        value: dm.ValueMappingResult(text=text, color=color, index=index)
                        for index, (value, text, color) in enumerate(values)
                    }
                )
            ]
        )
        .show_value(common_models.VisibilityMode.NEVER)
    )


def instant_table(
    title: str, description: str, target: prometheus.Dataquery, organize: dict[str, object]
) -> table.Panel:
    """A table of ``target`` now (an instant query), its columns arranged by Grafana's
    ``organize`` transformation with ``organize`` as its options."""
    return (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(target)
        .with_transformation(dm.DataTransformerConfig(id_val="organize", options=organize))
    )


# -- panels ---------------------------------------------------------------------------------------


def pod_rows() -> Section:
    used_vs_limit = series(
        "GPU memory used vs limit per pod",
        "Each pod's GPU memory on each GPU (or MIG instance), as gpuguard charges it, and its "
        "effective limit (dashed). A pod with no limit has no limit series. "
        "Filtered by $hostname and $namespace.",
        "bytes",
        query(USED, f"used · {POD_LEGEND}", "A"),
        query(LIMIT, f"limit · {POD_LEGEND}", "B"),
    ).override_by_regexp(
        "^limit · .*",
        [
            dm.DynamicConfigValue(
                id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
            ),
            dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        ],
    )
    share = (
        bargauge.Panel()
        .title("Share of limit used")
        .description(
            "used / limit for each pod and GPU now. Orange from 90 % (the "
            "GPUGuardPodNearGPUMemoryLimit alert fires after 5 minutes there), red at 100 % "
            "(a violation: in enforce mode gpuguard stops the container)."
        )
        .datasource(DATASOURCE)
        .with_target(query(f"{USED} / {LIMIT}", POD_LEGEND))
        .unit("percentunit")
        .min(0)
        .max(1.2)
        .thresholds(thresholds((None, "green"), (0.9, "orange"), (1, "red")))
        .display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
        .orientation(common_models.VizOrientation.HORIZONTAL)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    headroom = f"clamp_min({LIMIT} - {USED}, 0)"
    growth = f"(deriv(gpuguard_pod_gpu_memory_used_bytes{{{POD_SEL}}}[10m]) > 0)"
    time_to_limit = series(
        "Time to limit (estimate)",
        "How long until each pod reaches its limit if its memory keeps growing as it did over "
        "the last 10 minutes: the headroom (limit − used) divided by the used bytes' per-second "
        "slope, a least-squares fit over 10 minutes (PromQL `deriv`). Only pods whose memory "
        "grows are shown; a flat or shrinking pod has no estimate. Allocators grow in steps, so "
        "read it as an order of magnitude, not a countdown: 0 means at or over the limit.",
        "s",
        query(f"{headroom} / {growth}", POD_LEGEND),
    ).min(0)
    return section(
        "Pods: GPU memory",
        used_vs_limit.span(16).height(9),
        share.span(8).height(9),
        time_to_limit.span(24).height(8),
    )


def enforcement_rows() -> Section:
    kills_and_violations = bars(
        "Kills and violations per node",
        "Confirmed limit violations and containers stopped (first signal delivered), per "
        "enforcer, per interval. These counters carry no pod label (one series per pod would "
        "grow without bound: docs/design.md#metrics); the table beside names the pods.",
        query(
            on_host("sum by (job, instance) (increase(gpuguard_kills_total[$__rate_interval]))"),
            f"kills · {NODE_LEGEND}",
            "A",
        ),
        query(
            on_host(
                "sum by (job, instance) (increase(gpuguard_violations_total[$__rate_interval]))"
            ),
            f"violations · {NODE_LEGEND}",
            "B",
        ),
    )
    killed_pods = instant_table(
        "Containers stopped",
        "Every container gpuguard stopped in the dashboard's time range, by pod, container, "
        "GPU and node, with the time of the stop (gpuguard_pod_last_kill_timestamp_seconds: "
        "a series per stop, kept 15 minutes after it, so a stop between two scrapes is "
        "named too). What was signalled and why: the pod's GPUProcessKilled Event.",
        query(
            "max_over_time(gpuguard_pod_last_kill_timestamp_seconds"
            f"{{{POD_SEL}}}[$__range]) * 1000",
            POD_LEGEND,
            instant=True,
        ),
        {
            "excludeByName": {"Time": True, "__name__": True, "job": True},
            "renameByName": {"Value": "stopped at"},
        },
    ).unit("dateTimeAsIso")
    refusals = bars(
        "Refusals by reason",
        "Decisions not to act, by reason code (every code is pre-created at 0, so only the "
        "ones that happened show). In audit mode the violations that would have been acted on "
        "show here. Reasons: see `gpuguard explain`.",
        by_reason(on_host("increase(gpuguard_refusals_total[$__rate_interval])")),
    )
    return section(
        "Enforcement: kills, violations, refusals",
        kills_and_violations.span(12).height(8),
        killed_pods.span(12).height(8),
        refusals.span(24).height(8),
    )


def node_rows() -> Section:
    state = states(
        "Enforcement state per node",
        "1 (active) when the enforcer can act; 0 (inactive) with the reason it cannot "
        "(data_stale, pod_cache_unsynced, pod_cache_stale, a failed self-check, lock_held: "
        "another enforcer on the node holds the node lock and acts, starting). "
        "The GPUGuardEnforcementInactive alert fires after 10 minutes inactive.",
        query(on_host("gpuguard_enforcement_active"), "{{hostname}} ({{instance}}) {{reason}}"),
        ("0", "inactive", "red"),
        ("1", "active", "green"),
    ).thresholds(thresholds((None, "red"), (1, "green")))
    poll_age = (
        stat.Panel()
        .title("Seconds since the last poll")
        .description(
            "Age of each enforcer's last finished poll. It should stay near the poll interval; "
            "a growing age means the enforcement loop is stuck (the enforcer also turns "
            "inactive with data_stale)."
        )
        .datasource(DATASOURCE)
        .with_target(
            query(f"time() - ({on_host('gpuguard_last_poll_timestamp_seconds')})", NODE_LEGEND)
        )
        .unit("s")
        .decimals(1)
        .thresholds(thresholds((None, "green"), (10, "orange"), (60, "red")))
        .color_mode(common_models.BigValueColorMode.BACKGROUND)
        .graph_mode(common_models.BigValueGraphMode.NONE)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    unattributed = series(
        "Unattributed GPU memory",
        "GPU memory held by processes no pod owns (host processes, ghosts of exited processes, "
        "reused PIDs): never charged to a pod and never stopped, so no limit covers it. The "
        "GPUGuardUnattributedGPUMemoryHigh alert fires above 1 GiB for 15 minutes.",
        "bytes",
        query(UNATTRIBUTED, "{{hostname}} · GPU {{gpu}}{{GPU_I_ID}} ({{UUID}})"),
    )
    bound = (
        series(
            "GPU memory by what bounds it",
            "Each GPU's known memory split by the declaration that bounds its pod's limit there "
            "(gpuguard_gpu_memory_bound_bytes{bound_by}), stacked: annotation, default (cluster "
            "or namespace default), namespace_max, kai, hami, gpushare, volcano, dra, replicas; "
            "none for pods nothing bounds (no limit, a limit above the device's memory, or "
            "exempt: no label tells those apart, gpuguard inspect does); unattributed for memory "
            "of no pod. Only the parts above 0 are drawn; select one host to see its GPUs. The "
            "opt-in GPUGuardUnboundedGPUMemory alert (prometheusRule.unboundedGPUMemory) fires "
            "on none above its threshold.",
            "bytes",
            query(
                f"{BOUND} > 0",
                "{{bound_by}} · {{hostname}} · GPU {{gpu}}{{GPU_I_ID}} ({{UUID}})",
            ),
        )
        .fill_opacity(60)
        .stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
    )
    buckets = on_host("rate(gpuguard_poll_duration_seconds_bucket[$__rate_interval])")
    poll = series(
        "Poll duration",
        "Duration of one enforcement poll (gather, attribute, decide, act), the 50th and 99th "
        "percentiles per node, from the gpuguard_poll_duration_seconds histogram.",
        "s",
        query(
            f"histogram_quantile(0.5, sum by (le, hostname, instance) ({buckets}))",
            f"p50 · {NODE_LEGEND}",
            "A",
        ),
        query(
            f"histogram_quantile(0.99, sum by (le, hostname, instance) ({buckets}))",
            f"p99 · {NODE_LEGEND}",
            "B",
        ),
    )
    return section(
        "Nodes: enforcer state, unattributed and unbounded memory, poll latency",
        state.span(16).height(8),
        poll_age.span(8).height(8),
        unattributed.span(8).height(8),
        bound.span(8).height(8),
        poll.span(8).height(8),
    )


def agent_rows() -> Section:
    labels_now = instant_table(
        "Sharing labels per node",
        "The sharing rule that matches each node and the label values the agent sets "
        "(nvidia.com/device-plugin.config, nvidia.com/mig.config); empty: no rule matches, "
        "or the label is left alone.",
        query('gpuguard_sharing_labels_info{node=~"$hostname"} == 1', "{{node}}", instant=True),
        {
            "excludeByName": {"Time": True, "Value": True, "__name__": True},
            "indexByName": {"node": 0, "rule": 1, "device_plugin_config": 2, "mig_config": 3},
        },
    )
    label_changes = states(
        "Label changes",
        "When each node's sharing labels held which values: a new row starts at each "
        "change (the info series is replaced whole, so an old value set ends where the "
        "new one begins).",
        query(
            'gpuguard_sharing_labels_info{node=~"$hostname"}',
            "{{node}}: rule={{rule}} device-plugin={{device_plugin_config}} mig={{mig_config}}",
        ),
        ("1", "set", "blue"),
    )
    waiting = states(
        "Agent waiting",
        "1 while the agent waits before or during a MIG change, with the reason (e.g. GPU "
        "pods still running under the Wait policy). An alert fires when the agent waits "
        "for longer than an hour.",
        query(
            on_agent_node("max by (job, instance, reason) (gpuguard_sharing_waiting)"),
            "{{node}}{{instance}} · {{reason}}",
        ),
        ("0", "no", "transparent"),
        ("1", "waiting", "orange"),
    )
    errors = bars(
        "Reconcile errors by reason",
        "Sharing reconcile errors (counted once per episode), by reason, per interval.",
        by_reason(
            on_agent_node("increase(gpuguard_sharing_reconcile_errors_total[$__rate_interval])")
        ),
    )
    return section(
        "Sharing agent: labels and reconcile",
        labels_now.span(12).height(7),
        label_changes.span(12).height(7),
        waiting.span(12).height(7),
        errors.span(12).height(7),
    )


def dcgm_rows() -> Section:
    memory = series(
        "GPU memory: dcgm-exporter vs gpuguard",
        "Per GPU (joined on UUID): the framebuffer dcgm-exporter reports used "
        "(DCGM_FI_DEV_FB_USED, MiB, summed over MIG instances), the part gpuguard charges to "
        "pods and the part it attributes to nobody. The gap is the driver's own reservation "
        "and contexts. Needs dcgm-exporter scraped by the same Prometheus; joined on UUID, "
        "never on its host label (Hostname before 4.6, hostname since).",
        "bytes",
        query(
            f"({DCGM_FB_USED_BYTES}) * on (UUID) group_left (hostname) {_GPU_HOSTS}",
            "dcgm used · {{hostname}} {{UUID}}",
            "A",
        ),
        query(
            f"sum by (UUID, hostname) ({USED})",
            "pods (gpuguard) · {{hostname}} {{UUID}}",
            "B",
        ),
        query(
            f"sum by (UUID, hostname) ({UNATTRIBUTED})",
            "unattributed (gpuguard) · {{hostname}} {{UUID}}",
            "C",
        ),
    )
    pods_on_gpu = f"group by (namespace, pod, gpu, GPU_I_ID, UUID, hostname) ({USED})"
    utilisation = series(
        "GPU utilisation of each pod's GPU",
        "dcgm-exporter's DCGM_FI_DEV_GPU_UTIL of the GPU each pod uses, joined on UUID. "
        "Time-sliced pods share it: the value is the whole GPU's, not the pod's.",
        "percent",
        query(
            f"{pods_on_gpu} * on (UUID) group_left () max by (UUID) (DCGM_FI_DEV_GPU_UTIL)",
            POD_LEGEND,
        ),
    ).max(100)
    share_of_gpu = series(
        "Pod's share of its GPU's memory",
        "Each pod's GPU memory as a fraction of its GPU's framebuffer (dcgm-exporter's "
        "DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE, joined on UUID).",
        "percentunit",
        query(
            f"{USED} / on (UUID) group_left () ({DCGM_FB_TOTAL_BYTES})",
            POD_LEGEND,
        ),
    ).min(0)
    return section(
        "GPUs: dcgm-exporter joined on UUID",
        memory.span(24).height(8),
        utilisation.span(12).height(8),
        share_of_gpu.span(12).height(8),
    )


# -- the dashboard --------------------------------------------------------------------------------


def variables() -> list[cogbuilder.Builder[dm.VariableModel]]:
    all_ = dm.VariableOption(selected=True, text="All", value="$__all")
    return [
        db.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dm.VariableOption(selected=True, text="default", value="default")),
        db.QueryVariable("hostname")
        .label("Node")
        .description("hostname label of gpuguard's GPU series (the Kubernetes node name)")
        .datasource(DATASOURCE)
        .query("label_values(gpuguard_gpu_memory_unattributed_bytes, hostname)")
        .definition("label_values(gpuguard_gpu_memory_unattributed_bytes, hostname)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(all_),
        db.QueryVariable("namespace")
        .label("Namespace")
        .description("namespace of the pods using GPU memory")
        .datasource(DATASOURCE)
        .query('label_values(gpuguard_pod_gpu_memory_used_bytes{hostname=~"$hostname"}, namespace)')
        .definition(
            'label_values(gpuguard_pod_gpu_memory_used_bytes{hostname=~"$hostname"}, namespace)'
        )
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_CASE_INSENSITIVE_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(all_),
    ]


def sections() -> Section:
    return [*pod_rows(), *enforcement_rows(), *node_rows(), *agent_rows(), *dcgm_rows()]


def build() -> dict[str, object]:
    """The dashboard as a JSON-ready mapping. Panel ids are assigned in order (1, 2, …) so the
    output never depends on anything but this code."""
    dashboard = (
        db.Dashboard("gpuguard: GPU memory limits")
        .uid(UID)
        .description(
            "gpuguard's per-pod GPU memory against its limits, kills, refusals, enforcer and "
            "sharing-agent health, and dcgm-exporter's GPUs joined on UUID."
        )
        .tags(["gpuguard", "gpu", "nvidia", "kubernetes"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .variables(variables())
    )
    panel_id = 0
    for section, panels in sections():
        panel_id += 1
        dashboard = dashboard.with_row(section.id(panel_id))
        for panel in panels:
            panel_id += 1
            dashboard = dashboard.with_panel(panel.id(panel_id))
    encoded: dict[str, object] = json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))
    return encoded


def render() -> str:
    """The exact bytes of ``helm/gpuguard/files/dashboard.json``: sorted keys, 2-space indent."""
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    mode.add_argument("--stdout", action="store_true", help="print the JSON instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            sys.stderr.write(
                f"{OUTPUT} differs from dashboards/generate.py's output: "
                "run `python dashboards/generate.py` and commit the result\n"
            )
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    sys.stdout.write(f"wrote {OUTPUT}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
