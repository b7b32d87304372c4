"""GPUGuardUnboundedGPUMemory, the chart's opt-in alert on GPU memory that nothing bounds: the
chart renders it only where ``prometheusRule.unboundedGPUMemory.thresholdBytes`` is set (an admin
who chose no default limit is not paged by default), and the rule it renders passes
``promtool check rules --lint=all`` and fires, on a real promtool 3.16, only for
``bound_by="none"`` memory above the threshold for the configured time.

The rule lives in ``templates/prometheusrule.yaml``, not in ``files/alerts.yaml``: its threshold
is a value, and the plain rules file has none to read (docs/alerts.md says how to add it there).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart_rules import CHART, Helm, helm_tool, rendered_groups
from tests.exported_metrics import TARGET_LABELS, exported
from tests.promtools import tool

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = REPO / "docs" / "alerts.md"
ALERT = "GPUGuardUnboundedGPUMemory"
GiB = 1 << 30


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm_tool(tmp_path_factory.mktemp("helm-home"))


def unbounded_rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in groups for r in g["rules"] if r.get("alert") == ALERT]


def test_the_alert_is_not_rendered_by_default(helm: Helm, tmp_path: Path) -> None:
    groups = rendered_groups(helm, tmp_path, None)
    assert groups, "the PrometheusRule has no groups"
    assert unbounded_rules(groups) == []
    shipped = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert groups == shipped["groups"]


def test_the_alert_renders_with_the_threshold_and_duration_an_admin_sets(
    helm: Helm, tmp_path: Path
) -> None:
    (rule,) = unbounded_rules(
        rendered_groups(helm, tmp_path, {"thresholdBytes": 8 * GiB, "for": "10m"})
    )
    assert rule["expr"].split() == [
        'gpuguard_gpu_memory_bound_bytes{bound_by="none"}',
        ">",
        str(8 * GiB),
    ]
    assert rule["for"] == "10m"
    assert rule["labels"] == {"severity": "warning"}
    assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
    # 0 is a threshold (any unbounded memory), not "off".
    (zero,) = unbounded_rules(rendered_groups(helm, tmp_path, {"thresholdBytes": 0}))
    assert zero["expr"].split()[-1] == "0"
    assert zero["for"] == "15m"


def test_the_rule_reads_only_what_gpuguard_exports() -> None:
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    assert 'gpuguard_gpu_memory_bound_bytes{bound_by="none"}' in template
    labels = exported()["gpuguard_gpu_memory_bound_bytes"]
    assert {"bound_by", "gpu", "UUID", "GPU_I_ID", "hostname"} <= labels


def test_the_runbook_has_a_section_for_it() -> None:
    headings = re.findall(r"^#{2,4} (\S+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    assert ALERT in headings


SERIES = (
    "gpuguard_gpu_memory_bound_bytes"
    '{{gpu="0",UUID="GPU-aa",GPU_I_ID="",hostname="gpu-1",bound_by="{}"}}'
)


def unit_test(rules: Path) -> dict[str, Any]:
    """A promtool unit test over the rendered rule (threshold 8 GiB, for 10m, 30 s interval):
    10 GiB unbounded from the start fires at 10 min and not before; 6 GiB unbounded (below the
    threshold) and 20 GiB bounded by an annotation never fire."""
    annotations = {
        "summary": "10GiB of GPU memory on GPU 0 of gpu-1 is bounded by no limit",
        "description": (
            "Pods that nothing bounds (no limit from any source gpuguard reads, or exempt) have"
            " held 10GiB on GPU 0 (GPU-aa) of node gpu-1, more than 8589934592 bytes, for 10m."
            " gpuguard never stops a process for this memory; gpuguard_pods_unbounded counts"
            " the pods."
        ),
        "runbook_url": "docs/alerts.md#gpuguardunboundedgpumemory",
    }
    fired = {
        "exp_labels": {
            "severity": "warning",
            "gpu": "0",
            "UUID": "GPU-aa",
            "hostname": "gpu-1",
            "bound_by": "none",
        },
        "exp_annotations": annotations,
    }
    return {
        "rule_files": [str(rules)],
        "evaluation_interval": "30s",
        "tests": [
            {
                "name": "unbounded memory above the threshold",
                "interval": "30s",
                "input_series": [
                    {"series": SERIES.format("none"), "values": f"{10 * GiB}x40"},
                    {"series": SERIES.format("annotation"), "values": f"{20 * GiB}x40"},
                ],
                "alert_rule_test": [
                    {"eval_time": "9m", "alertname": ALERT, "exp_alerts": []},
                    {"eval_time": "11m", "alertname": ALERT, "exp_alerts": [fired]},
                ],
            },
            {
                "name": "unbounded memory below the threshold, bounded memory above it",
                "interval": "30s",
                "input_series": [
                    {"series": SERIES.format("none"), "values": f"{6 * GiB}x40"},
                    {"series": SERIES.format("default"), "values": f"{20 * GiB}x40"},
                ],
                "alert_rule_test": [{"eval_time": "15m", "alertname": ALERT, "exp_alerts": []}],
            },
        ],
    }


def test_promtool_checks_and_fires_the_rendered_rule_only_above_the_threshold(
    helm: Helm, tmp_path: Path
) -> None:
    promtool = tool("promtool")
    groups = rendered_groups(helm, tmp_path, {"thresholdBytes": 8 * GiB, "for": "10m"})
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    done = subprocess.run(
        [str(promtool), "check", "rules", "--lint=all", "--lint-fatal", str(rules)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    test = unit_test(rules)
    for item in test["tests"]:
        for series in item["input_series"]:
            labels = set(re.findall(r'(\w+)="', series["series"]))
            assert labels <= exported()["gpuguard_gpu_memory_bound_bytes"] | TARGET_LABELS
    cases = tmp_path / "unbounded.test.yaml"
    cases.write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run(
        [str(promtool), "test", "rules", str(cases)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The unit test can fail: the same cases against a threshold of 12 GiB never fire.
    groups = rendered_groups(helm, tmp_path, {"thresholdBytes": 12 * GiB, "for": "10m"})
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    done = subprocess.run(
        [str(promtool), "test", "rules", str(cases)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    assert ALERT in done.stdout + done.stderr
