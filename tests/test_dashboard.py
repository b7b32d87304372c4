"""The Grafana dashboard: the committed ``helm/gpuguard/files/dashboard.json`` is what
``dashboards/generate.py`` builds with grafana-foundation-sdk, the SDK's Go types accept it (and
reject a corrupted copy), every query parses as PromQL, and every metric a query reads is one
gpuguard really exports (scraped from a fresh registry) or one of dcgm-exporter's.

The Go checker (``dashboards/validate``; ``tests/dashboard_validator.py``) is built on demand by
``scripts/ensure-dashboard-validator.sh`` and cached under ``~/.cache``; without Go these tests
skip locally and fail in CI (``rigs.prereq.require``).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dashboards import generate
from gpuguard.adapters.metrics import (
    PrometheusAgentRecorder,
    PrometheusRecorder,
    SnapshotCollector,
)
from gpuguard.core.model import PodRef, ResolvedLimit, Trigger
from gpuguard.core.policy import Decision, EnforcerState, PodUsage, UsageState
from tests.dashboard_validator import validate
from tests.fakes import GiB, gpu, kill_target, uid

ROOT = Path(__file__).resolve().parent.parent

DESIGN_METRICS = frozenset(
    {
        # docs/design.md, Metrics, as Prometheus names them (counters with _total).
        "gpuguard_pod_gpu_memory_used_bytes",
        "gpuguard_pod_gpu_memory_limit_bytes",
        "gpuguard_violations_total",
        "gpuguard_kills_total",
        "gpuguard_refusals_total",
        "gpuguard_gpu_memory_unattributed_bytes",
        "gpuguard_gpu_memory_bound_bytes",
        "gpuguard_pods_unbounded",
        "gpuguard_poll_duration_seconds",
        "gpuguard_last_poll_timestamp_seconds",
        "gpuguard_enforcement_active",
        "gpuguard_events_dropped_total",
        "gpuguard_watch_restarts_total",
        "gpuguard_nvml_errors_total",
        "gpuguard_sharing_labels_info",
        "gpuguard_sharing_reconcile_errors_total",
        "gpuguard_sharing_waiting",
        # The per-pod kill series that names each stopped container.
        "gpuguard_pod_last_kill_timestamp_seconds",
    }
)
HISTOGRAMS = frozenset({"gpuguard_poll_duration_seconds"})
DCGM_METRICS = frozenset(
    {
        # dcgm-exporter's default counters the dashboard joins on UUID (FB_* in MiB).
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_UTIL",
    }
)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def sample_names(metric: str) -> set[str]:
    """The sample names a query may read for one metric of docs/design.md, Metrics."""
    if metric in HISTOGRAMS:
        return {f"{metric}_bucket", f"{metric}_sum", f"{metric}_count"}
    return {metric}


ALLOWED = frozenset(
    {name for metric in DESIGN_METRICS for name in sample_names(metric)} | DCGM_METRICS
)


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(generate.OUTPUT.read_text(encoding="utf-8"))
    return loaded


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def exprs_of(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and query variables."""
    exprs = [t["expr"] for p in panels_of(dashboard) for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


# -- generator and committed JSON -----------------------------------------------------------------


def test_the_committed_dashboard_is_exactly_what_the_generator_writes() -> None:
    assert generate.OUTPUT.read_text(encoding="utf-8") == generate.render(), (
        "helm/gpuguard/files/dashboard.json drifted from dashboards/generate.py: "
        "run `.venv/bin/python dashboards/generate.py` and commit the result"
    )


def test_the_generator_is_deterministic() -> None:
    assert generate.render() == generate.render()


def test_check_mode_exits_1_on_drift_and_0_when_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    copy_ = tmp_path / "dashboard.json"
    monkeypatch.setattr(generate, "OUTPUT", copy_)
    copy_.write_text(generate.render().replace("Kills and violations", "Kills"), encoding="utf-8")
    assert generate.main(["--check"]) == 1
    assert "differs from dashboards/generate.py's output" in capsys.readouterr().err
    copy_.unlink()
    assert generate.main(["--check"]) == 1  # missing counts as drift
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0


# -- panels, variables, datasource ----------------------------------------------------------------


def test_the_dashboard_has_the_datasource_hostname_and_namespace_variables(
    committed: dict[str, Any],
) -> None:
    variables = {v["name"]: v for v in committed["templating"]["list"]}
    assert set(variables) == {"datasource", "hostname", "namespace"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("hostname", "namespace"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] is True
        assert variables[name]["allValue"] == ".*"


def test_every_panel_has_a_title_the_datasource_variable_and_queries(
    committed: dict[str, Any],
) -> None:
    panels = list(panels_of(committed))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        assert panel.get("title", "").strip(), f"panel {panel['id']} has no title"
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel.get("description", "").strip(), f"{title!r}: no description"
        assert panel.get("datasource") == DATASOURCE, f"{title!r}: not on $datasource"
        targets = panel.get("targets", [])
        assert targets, f"{title!r}: no query"
        assert len({t["refId"] for t in targets}) == len(targets), f"{title!r}: refIds repeat"
        for target in targets:
            assert target.get("datasource") == DATASOURCE, f"{title!r}: query not on $datasource"
            assert target["expr"].strip(), f"{title!r}: empty query"


def test_the_issues_panels_are_all_there(committed: dict[str, Any]) -> None:
    """The rows asked for: each row's panels, by what they read."""
    reads = {
        p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in panels_of(committed)
    }
    wanted = {
        "GPU memory used vs limit per pod": ["_used_bytes", "_limit_bytes"],
        "Time to limit (estimate)": ["deriv(gpuguard_pod_gpu_memory_used_bytes"],
        "Kills and violations per node": ["gpuguard_kills_total", "gpuguard_violations_total"],
        "Containers stopped": ["gpuguard_pod_last_kill_timestamp_seconds"],
        "Refusals by reason": ["sum by (reason)", "gpuguard_refusals_total"],
        "Unattributed GPU memory": ["gpuguard_gpu_memory_unattributed_bytes"],
        "GPU memory by what bounds it": ["gpuguard_gpu_memory_bound_bytes"],
        "Poll duration": ["histogram_quantile(0.99", "gpuguard_poll_duration_seconds_bucket"],
        "Enforcement state per node": ["gpuguard_enforcement_active"],
        "Seconds since the last poll": ["time() - ", "gpuguard_last_poll_timestamp_seconds"],
        "Sharing labels per node": ["gpuguard_sharing_labels_info"],
        "Label changes": ["gpuguard_sharing_labels_info"],
        "Agent waiting": ["gpuguard_sharing_waiting"],
        "Reconcile errors by reason": ["gpuguard_sharing_reconcile_errors_total"],
        "GPU memory: dcgm-exporter vs gpuguard": ["DCGM_FI_DEV_FB_USED", "on (UUID)"],
        "GPU utilisation of each pod's GPU": ["DCGM_FI_DEV_GPU_UTIL", "on (UUID)"],
    }
    for title, fragments in wanted.items():
        assert title in reads, f"missing panel {title!r}"
        for fragment in fragments:
            assert fragment in reads[title], f"{title!r} does not read {fragment!r}"


def test_dcgm_series_are_joined_on_uuid_never_on_a_host_label(committed: dict[str, Any]) -> None:
    for expr in exprs_of(committed):
        if "DCGM_" not in expr:
            continue
        for match in re.finditer(r"\bon\s*\(([^)]*)\)", expr):
            assert [s.strip() for s in match.group(1).split(",")] == ["UUID"], expr
        assert "Hostname" not in expr, expr


def test_counters_without_a_pod_label_are_never_grouped_by_pod(committed: dict[str, Any]) -> None:
    """gpuguard's counters carry no pod label (docs/design.md, Metrics): on a ServiceMonitor their
    ``pod`` is gpuguard's own, so grouping a counter by pod would name the wrong pod."""
    counter = re.compile(r"gpuguard_(kills|violations|refusals|sharing_reconcile_errors)_total")
    for expr in exprs_of(committed):
        if counter.search(expr):
            for match in re.finditer(r"\bby\s*\(([^)]*)\)", expr):
                assert "pod" not in [s.strip() for s in match.group(1).split(",")], expr


# -- metric names ---------------------------------------------------------------------------------


def exported_sample_names() -> set[str]:
    """Sample names a real registry exposes with gpuguard's collectors and recorders, each with
    a value so every family has a sample (one pod with a limit on one GPU)."""
    registry = CollectorRegistry()
    recorder = PrometheusRecorder(registry)
    recorder.count_kill(kill_target(1, gpu(0)), wall_time=time.time())
    recorder.count_violation(Trigger.PRESSURE)
    recorder.observe_poll(0.01)
    recorder.count_event_dropped("rate_limit")
    recorder.count_watch_restart("pods", "expired")
    recorder.count_nvml_error("nvmlDeviceGetMemoryInfo")
    agent = PrometheusAgentRecorder(registry, node="gpu-node-1")
    agent.show_labels(rule="slice", device_plugin_config="slice-4", mig_config=None)
    collector = SnapshotCollector(hostname="gpu-node-1")
    registry.register(collector)
    g0 = gpu(0)
    usage = PodUsage(
        pod=PodRef(uid=uid(1), namespace="team", name="pod-1"),
        container="c0",
        device=g0,
        used_bytes=3 * GiB,
        unknown_processes=0,
        limit=ResolvedLimit(limit_bytes=4 * GiB, source=None),
        state=UsageState.OK,
    )
    decision = Decision(
        state=EnforcerState(),
        usages=(usage,),
        unattributed_bytes={g0.key: 0},
        devices=(g0,),
        enforcement_active=True,
    )
    collector.publish(decision, wall_time=1_700_000_000.0, ready=True, reason="ok")
    text = generate_latest(registry).decode()
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("gpuguard_")
    }


def test_every_metric_of_design_5_4_is_exported_under_that_name() -> None:
    """The test's list is docs/design.md's (Metrics); this keeps it honest against the real
    exporter."""
    exported = exported_sample_names()
    for metric in sorted(DESIGN_METRICS):
        missing = sample_names(metric) - exported
        assert not missing, f"{metric}: not exported as {sorted(missing)}"


def test_every_metric_name_in_a_query_is_exported_by_gpuguard_or_dcgm_exporter(
    committed: dict[str, Any],
) -> None:
    """A textual scan (needs no Go): every gpuguard_* and DCGM_* token of every query."""
    exported = exported_sample_names()
    for expr in exprs_of(committed):
        for name in re.findall(r"\b(?:gpuguard|DCGM)_[A-Za-z0-9_]*", expr):
            assert name in ALLOWED, (
                f"{name} (in {expr!r}) is neither in docs/design.md, Metrics nor dcgm's"
            )
            if name.startswith("gpuguard_"):
                assert name in exported, f"{name} (in {expr!r}) is not exported by gpuguard"


# -- the Go checker -------------------------------------------------------------------------------


@pytest.mark.tools
def test_the_go_types_accept_the_committed_dashboard_and_every_query_parses(
    validator: Path,
) -> None:
    run = validate(validator, generate.OUTPUT)
    assert run.returncode == 0, run.stderr
    assert "ok" in run.stdout


def _corrupt(dashboard: dict[str, Any], how: str) -> dict[str, Any]:
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in broken["panels"] if p["type"] == "timeseries")
    if how == "unknown top-level key":
        broken["refreshEvery"] = "30s"
    elif how == "unknown key in panel options":
        panel["options"]["legend"]["showLegends"] = True
    elif how == "unknown key in a query":
        panel["targets"][0]["expression"] = panel["targets"][0]["expr"]
    elif how == "wrong type of a query":
        panel["targets"][0]["expr"] = 42
    elif how == "wrong type of a grid position":
        panel["gridPos"]["w"] = "full"
    elif how == "grid wider than 24":
        panel["gridPos"]["w"] = 25
    elif how == "PromQL that does not parse":
        panel["targets"][0]["expr"] = "sum by (pod (gpuguard_kills_total)"
    else:
        raise AssertionError(how)
    return broken


@pytest.mark.tools
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("unknown top-level key", "unexpected field 'refreshEvery'"),
        ("unknown key in panel options", "unexpected field 'showLegends'"),
        ("unknown key in a query", "unexpected field 'expression'"),
        ("wrong type of a query", "targets[0].expr"),
        ("wrong type of a grid position", "gridPos.w"),
        ("grid wider than 24", "gridPos.w: must be <= 24"),
        ("PromQL that does not parse", "parse error"),
    ],
)
def test_the_go_types_reject_a_corrupted_copy(
    validator: Path, committed: dict[str, Any], tmp_path: Path, how: str, message: str
) -> None:
    broken = tmp_path / "dashboard.json"
    broken.write_text(json.dumps(_corrupt(committed, how)), encoding="utf-8")
    run = validate(validator, broken)
    assert run.returncode == 1, f"{how}: accepted\n{run.stdout}"
    assert message in run.stderr, run.stderr


@pytest.mark.tools
def test_every_metric_prometheus_parses_out_of_a_query_is_exported_or_dcgms(
    validator: Path, committed: dict[str, Any]
) -> None:
    """The same check as the textual scan, with Prometheus's own parser naming the selectors
    (so a selector by ``__name__`` or a name the regex misses cannot slip through)."""
    run = validate(validator, generate.OUTPUT, "-queries")
    assert run.returncode == 0, run.stderr
    queries = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(queries) == len(exprs_of(committed))
    exported = exported_sample_names()
    for query in queries:
        assert query["metrics"], f"{query['title']!r}: {query['expr']!r} reads no metric"
        for name in query["metrics"]:
            assert name in ALLOWED, f"{query['title']!r} reads {name}: not design.md's or dcgm's"
            assert name in exported or name in DCGM_METRICS, f"{name} is not exported"


def test_the_bound_by_panel_stacks_each_gpus_memory_by_what_bounds_it(
    committed: dict[str, Any],
) -> None:
    (panel,) = [p for p in panels_of(committed) if p["title"] == "GPU memory by what bounds it"]
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert panel["fieldConfig"]["defaults"]["unit"] == "bytes"
    (target,) = panel["targets"]
    assert target["expr"].startswith('gpuguard_gpu_memory_bound_bytes{hostname=~"$hostname"}')
    for label in ("bound_by", "hostname", "gpu", "UUID"):
        assert "{{" + label + "}}" in target["legendFormat"]
